// Engine properties on small random models (no files): packing and micro-batching do not change
// outputs or gradients, recompute is exact, the optimizer step is AdamW with global-norm
// clipping, the loss callback sees what forward() returns, unsupported descriptions are refused.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "kernels_cpu_abi.hpp"
#include "rlhost/engine/engine.hpp"
#include "rlhost/model/llama_family.hpp"

using namespace rlh;
using engine::Engine;
using engine::MicroBatch;

namespace {

// Qwen2 (q/k/v biases, sliding window on layer 1, yarn) and Qwen3 (q/k norms, tied, head_dim
// != hidden/heads): between them every feature of the dense engine.
sdk::TransformerDesc qwen2_desc() {
  nlohmann::json c = {{"architectures", {"Qwen2ForCausalLM"}},
                      {"vocab_size", 97},
                      {"hidden_size", 48},
                      {"intermediate_size", 80},
                      {"num_hidden_layers", 2},
                      {"num_attention_heads", 4},
                      {"num_key_value_heads", 2},
                      {"max_position_embeddings", 64},
                      {"rms_norm_eps", 1e-6},
                      {"rope_theta", 10000.0},
                      {"rope_scaling", {{"type", "yarn"}, {"factor", 4.0},
                                        {"original_max_position_embeddings", 16}}},
                      {"use_sliding_window", true},
                      {"sliding_window", 5},
                      {"max_window_layers", 1},
                      {"tie_word_embeddings", false},
                      {"torch_dtype", "float32"}};
  return model::describe(c);
}

sdk::TransformerDesc qwen3_desc() {
  nlohmann::json c = {{"architectures", {"Qwen3ForCausalLM"}},
                      {"vocab_size", 101},
                      {"hidden_size", 32},
                      {"intermediate_size", 72},
                      {"num_hidden_layers", 2},
                      {"num_attention_heads", 4},
                      {"num_key_value_heads", 1},
                      {"head_dim", 16},
                      {"max_position_embeddings", 128},
                      {"rms_norm_eps", 1e-6},
                      {"rope_theta", 1000000.0},
                      {"tie_word_embeddings", true},
                      {"torch_dtype", "float32"}};
  return model::describe(c);
}

// Gemma-3 (sandwich norms with (1 + w), q/k norms with (1 + w), GeGLU, scaled embedding, a
// window on every other layer with its own RoPE, linear-scaled RoPE on the full layer, softmax
// scale from query_pre_attn_scalar, tied): the features the layer program added for it.
sdk::TransformerDesc gemma3_desc() {
  nlohmann::json c = {{"architectures", {"Gemma3ForCausalLM"}},
                      {"vocab_size", 89},
                      {"hidden_size", 32},
                      {"intermediate_size", 56},
                      {"num_hidden_layers", 3},
                      {"num_attention_heads", 4},
                      {"num_key_value_heads", 2},
                      {"head_dim", 16},
                      {"max_position_embeddings", 128},
                      {"rms_norm_eps", 1e-6},
                      {"rope_theta", 1000000.0},
                      {"rope_local_base_freq", 10000.0},
                      {"rope_scaling", {{"rope_type", "linear"}, {"factor", 2.0}}},
                      {"sliding_window", 5},
                      {"sliding_window_pattern", 2},
                      {"query_pre_attn_scalar", 24},
                      {"torch_dtype", "float32"}};
  return model::describe(c);
}

// Gemma-2 (Gemma-3's layout without q/k norms, with soft-capped attention scores and final
// logits; caps small enough here that tanh bends the random model's scores).
sdk::TransformerDesc gemma2_desc() {
  nlohmann::json c = {{"architectures", {"Gemma2ForCausalLM"}},
                      {"vocab_size", 89},
                      {"hidden_size", 32},
                      {"intermediate_size", 56},
                      {"num_hidden_layers", 3},
                      {"num_attention_heads", 4},
                      {"num_key_value_heads", 2},
                      {"head_dim", 16},
                      {"max_position_embeddings", 128},
                      {"rms_norm_eps", 1e-6},
                      {"rope_theta", 10000.0},
                      {"sliding_window", 5},
                      {"query_pre_attn_scalar", 16},
                      {"attn_logit_softcapping", 0.5},
                      {"final_logit_softcapping", 1.5},
                      {"torch_dtype", "float32"}};
  return model::describe(c);
}

// Random weights; 1-D tensors (norms, biases) around 1 and 0.
void randomize(Engine& e, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> N01(0, 1);
  for (size_t i = 0; i < e.num_params(); ++i) {
    const auto& p = e.desc().params[i];
    const bool is_norm = p.role == sdk::ParamRole::attn_norm || p.role == sdk::ParamRole::mlp_norm ||
                         p.role == sdk::ParamRole::final_norm || p.role == sdk::ParamRole::q_norm ||
                         p.role == sdk::ParamRole::k_norm || p.role == sdk::ParamRole::post_attn_norm ||
                         p.role == sdk::ParamRole::post_mlp_norm;
    for (float& x : e.param(i)) x = is_norm ? 1.f + 0.2f * N01(rng) : 0.15f * N01(rng);
  }
}

// Sequences of the given lengths with deterministic ids; `weights` is a per-token field.
struct Batch {
  std::vector<int32_t> ids, cu;
  std::vector<float> weights;
  std::vector<int64_t> shape;
  MicroBatch mb() const {
    MicroBatch m;
    m.input_ids = ids;
    m.cu_seqlens = cu;
    rlh_named_tensor f{};
    f.name = "token_weight";
    f.tensor.data = const_cast<float*>(weights.data());
    f.tensor.device = rlh_device{RLH_DEVICE_CPU, 0};
    f.tensor.ndim = 1;
    f.tensor.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
    f.tensor.shape = const_cast<int64_t*>(shape.data());
    static int64_t one = 1;
    f.tensor.strides = &one;
    m.fields.push_back(f);
    return m;
  }
};

Batch make_batch(const std::vector<int>& lens, int64_t V, int seed_offset = 0) {
  Batch b;
  b.cu.push_back(0);
  int s = 0;
  for (int L : lens) {
    for (int t = 0; t < L; ++t) {
      b.ids.push_back(int32_t((s * 31 + t * 17 + 5 + seed_offset) % V));
      b.weights.push_back(0.5f + 0.1f * float((s + 3 * t) % 7));
    }
    b.cu.push_back(int32_t(b.ids.size()));
    ++s;
  }
  b.shape = {int64_t(b.ids.size())};
  return b;
}

Batch sequence_of(const Batch& b, size_t s) {
  Batch o;
  o.ids.assign(b.ids.begin() + b.cu[s], b.ids.begin() + b.cu[s + 1]);
  o.weights.assign(b.weights.begin() + b.cu[s], b.weights.begin() + b.cu[s + 1]);
  o.cu = {0, int32_t(o.ids.size())};
  o.shape = {int64_t(o.ids.size())};
  return o;
}

// A GRPO-like loss: weighted logprob + processed logprob + entropy bonus, normalised by the
// global token count; reads the per-token field.
engine::LossResult weighted_loss(const engine::LossContext& ctx, const engine::OutputViews& o,
                                 engine::OutputGrads& g) {
  engine::LossResult r;
  const rlh_tensor* w = ctx.microbatch->field("token_weight");
  const float* wt = static_cast<const float*>(w->data);
  const double inv = 1.0 / double(ctx.global_tokens);
  for (size_t t = 0; t < o.logprob.size(); ++t) {
    r.loss += -wt[t] * o.logprob[t] * inv - 0.01 * o.entropy[t] * inv;
    g.logprob[t] = float(-wt[t] * inv);
    g.entropy[t] = float(-0.01 * inv);
    if (std::isfinite(o.processed_logprob[t])) {
      r.loss += -0.3 * o.processed_logprob[t] * inv;
      g.processed_logprob[t] = float(-0.3 * inv);
    }
  }
  r.metrics.push_back({"tokens", double(o.logprob.size())});
  return r;
}

engine::StepOptions grads_only(int64_t global_tokens) {
  engine::StepOptions so;
  so.global_tokens = global_tokens;
  so.apply_optimizer = false;
  so.outputs.logprob = true;
  so.outputs.entropy = true;
  so.outputs.processed_logprob = true;
  so.outputs.temperature = 0.8;
  so.outputs.top_k = 20;
  so.outputs.top_p = 0.9;
  return so;
}

std::vector<float> all_grads(Engine& e) {
  std::vector<float> g;
  for (size_t i = 0; i < e.num_params(); ++i) g.insert(g.end(), e.grad(i).begin(), e.grad(i).end());
  return g;
}

double rel_error(const std::vector<float>& got, const std::vector<float>& ref) {
  double maxref = 0, maxerr = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    maxref = std::max(maxref, std::fabs(double(ref[i])));
    const double e = std::fabs(double(got[i]) - double(ref[i]));
    if (std::isnan(e)) return INFINITY;
    maxerr = std::max(maxerr, e);
  }
  return maxerr / std::max(maxref, 1e-30);
}

class EngineModels : public ::testing::TestWithParam<int> {
 protected:
  sdk::TransformerDesc desc() const {
    return GetParam() == 0 ? qwen2_desc() : GetParam() == 1 ? qwen3_desc() : GetParam() == 2 ? gemma3_desc() : gemma2_desc();
  }
};

// (2) A packed batch gives the same outputs and gradients as each sequence run alone.
TEST_P(EngineModels, PackedBatchEqualsSequencesAlone) {
  Engine e(desc(), test::engine_options());
  randomize(e, 11);
  const Batch packed = make_batch({7, 19, 1, 12}, e.desc().vocab_size);
  const int64_t global = int64_t(packed.ids.size());
  const engine::StepOptions so = grads_only(global);

  std::vector<float> sum_grads(size_t(e.num_elements()), 0.f);
  std::vector<float> lp_alone, ent_alone, proc_alone;
  double loss_alone = 0;
  for (size_t s = 0; s + 1 < packed.cu.size(); ++s) {
    const Batch one = sequence_of(packed, s);
    const MicroBatch mb = one.mb();
    const engine::Outputs o = e.forward(mb, so.outputs);
    lp_alone.insert(lp_alone.end(), o.logprob.begin(), o.logprob.end());
    ent_alone.insert(ent_alone.end(), o.entropy.begin(), o.entropy.end());
    proc_alone.insert(proc_alone.end(), o.processed_logprob.begin(), o.processed_logprob.end());
    loss_alone += e.train_step({&mb, 1}, so, weighted_loss).loss;
    const std::vector<float> g = all_grads(e);
    for (size_t i = 0; i < g.size(); ++i) sum_grads[i] += g[i];
  }
  const MicroBatch mb = packed.mb();
  const engine::Outputs o = e.forward(mb, so.outputs);
  EXPECT_LE(rel_error(o.logprob, lp_alone), 1e-6);
  EXPECT_LE(rel_error(o.entropy, ent_alone), 1e-6);
  EXPECT_EQ(o.logprob[0], 0.f);  // first position of a sequence predicts nothing
  for (size_t t = 0; t < proc_alone.size(); ++t) {
    if (std::isinf(proc_alone[t]))
      EXPECT_EQ(o.processed_logprob[t], proc_alone[t]) << t;
    else
      EXPECT_NEAR(o.processed_logprob[t], proc_alone[t], 1e-5) << t;
  }
  const engine::StepResult r = e.train_step({&mb, 1}, so, weighted_loss);
  EXPECT_NEAR(r.loss, loss_alone, 1e-6 * std::fabs(loss_alone));
  EXPECT_LE(rel_error(all_grads(e), sum_grads), 1e-5);
}

// Two micro-batches in one step equal one micro-batch holding both (global normalisation).
TEST_P(EngineModels, MicrobatchSplitDoesNotChangeTheStep) {
  Engine e(desc(), test::engine_options());
  randomize(e, 12);
  const Batch packed = make_batch({9, 4, 16, 3, 8}, e.desc().vocab_size);
  const engine::StepOptions so = grads_only(int64_t(packed.ids.size()));
  const MicroBatch whole = packed.mb();
  const engine::StepResult r1 = e.train_step({&whole, 1}, so, weighted_loss);
  const std::vector<float> g1 = all_grads(e);

  std::vector<std::vector<int32_t>> cu_store;
  std::vector<MicroBatch> parts = engine::split_microbatches(packed.ids, packed.cu, 16, &cu_store);
  ASSERT_GE(parts.size(), 2u);
  // Per-micro-batch views of the weight field.
  std::vector<Batch> part_batches;
  for (const MicroBatch& p : parts) {
    Batch b;
    b.ids.assign(p.input_ids.begin(), p.input_ids.end());
    b.cu.assign(p.cu_seqlens.begin(), p.cu_seqlens.end());
    const size_t off = size_t(p.input_ids.data() - packed.ids.data());
    b.weights.assign(packed.weights.begin() + off, packed.weights.begin() + off + b.ids.size());
    b.shape = {int64_t(b.ids.size())};
    part_batches.push_back(std::move(b));
  }
  std::vector<MicroBatch> mbs;
  for (const Batch& b : part_batches) mbs.push_back(b.mb());
  const engine::StepResult r2 = e.train_step(mbs, so, weighted_loss);
  EXPECT_NEAR(r2.loss, r1.loss, 1e-6 * std::fabs(r1.loss));
  EXPECT_NEAR(r2.grad_norm, r1.grad_norm, 1e-5 * r1.grad_norm);
  EXPECT_LE(rel_error(all_grads(e), g1), 1e-5);
  ASSERT_EQ(r2.metrics.size(), 1u);
  EXPECT_EQ(r2.metrics[0].second, double(packed.ids.size()));  // metrics sum over micro-batches
}

// Recompute re-runs the same ops on the same inputs: bitwise the same gradients.
TEST_P(EngineModels, RecomputeIsExact) {
  engine::EngineOptions with = test::engine_options();
  with.recompute = true;
  Engine a(desc(), test::engine_options()), b(desc(), with);
  randomize(a, 13);
  randomize(b, 13);
  const Batch packed = make_batch({11, 6, 20}, a.desc().vocab_size);
  const MicroBatch mb = packed.mb();
  const engine::StepOptions so = grads_only(int64_t(packed.ids.size()));
  const engine::StepResult ra = a.train_step({&mb, 1}, so, weighted_loss);
  const engine::StepResult rb = b.train_step({&mb, 1}, so, weighted_loss);
  EXPECT_EQ(ra.loss, rb.loss);
  EXPECT_EQ(all_grads(a), all_grads(b));
}

// The thread count changes nothing (every kernel splits work the same way for any count).
TEST_P(EngineModels, ThreadCountDoesNotChangeResults) {
  const int saved = omp_get_max_threads();
  const Batch packed = make_batch({30, 14}, desc().vocab_size);
  const MicroBatch mb = packed.mb();
  const engine::StepOptions so = grads_only(int64_t(packed.ids.size()));
  std::vector<float> g[2];
  double loss[2];
  for (int t = 0; t < 2; ++t) {
    omp_set_num_threads(t + 1);
    Engine e(desc(), test::engine_options());
    randomize(e, 14);
    loss[t] = e.train_step({&mb, 1}, so, weighted_loss).loss;
    g[t] = all_grads(e);
  }
  omp_set_num_threads(saved);
  EXPECT_EQ(loss[0], loss[1]);
  EXPECT_EQ(g[0], g[1]);
}

// The engine's gradients are those of its own forward: central differences of the loss in
// float32 on a sample of parameters of every tensor (1e-3 steps; the bound allows float32
// rounding of the loss, far below what a wrong formula gives).
TEST_P(EngineModels, GradientsMatchFiniteDifferences) {
  Engine e(desc(), test::engine_options());
  randomize(e, 21);
  const Batch packed = make_batch({9, 14}, e.desc().vocab_size);
  const MicroBatch mb = packed.mb();
  engine::StepOptions so = grads_only(int64_t(packed.ids.size()));
  so.outputs.processed_logprob = false;  // the filtered cut is not differentiable at ties
  auto loss = [](const engine::LossContext& ctx, const engine::OutputViews& o, engine::OutputGrads& g) {
    engine::LossResult r;
    for (size_t t = 0; t < o.logprob.size(); ++t) {
      const double w = 1.0 + 0.25 * double(t % 3);
      r.loss -= w * o.logprob[t] / double(ctx.global_tokens);
      g.logprob[t] = float(-w / double(ctx.global_tokens));
      r.loss -= 0.05 * o.entropy[t] / double(ctx.global_tokens);
      g.entropy[t] = float(-0.05 / double(ctx.global_tokens));
    }
    return r;
  };
  e.train_step({&mb, 1}, so, loss);
  const std::vector<float> analytic = all_grads(e);
  auto loss_at = [&]() {
    engine::Outputs o = e.forward(mb, so.outputs);
    double l = 0;
    for (size_t t = 0; t < o.logprob.size(); ++t)
      l -= ((1.0 + 0.25 * double(t % 3)) * o.logprob[t] + 0.05 * o.entropy[t]) / double(packed.ids.size());
    return l;
  };
  int64_t at = 0, checked = 0;
  for (size_t i = 0; i < e.num_params(); ++i) {
    std::span<float> p = e.param(i);
    for (size_t j : {size_t(0), p.size() / 2, p.size() - 1}) {
      const float keep = p[j];
      const float h = 1e-3f * std::max(1.0f, std::fabs(keep));
      const float hi = keep + h, lo = keep - h;  // the steps as float32 holds them
      p[j] = hi;
      const double up = loss_at();
      p[j] = lo;
      const double down = loss_at();
      p[j] = keep;
      const double fd = (up - down) / (double(hi) - double(lo));
      const double g = analytic[size_t(at) + j];
      EXPECT_NEAR(g, fd, 2e-3 * std::max(1.0, std::fabs(fd)) + 1e-4)
          << e.desc().params[i].name << "[" << j << "]";
      ++checked;
    }
    at += int64_t(p.size());
  }
  EXPECT_GT(checked, 30);
}

// A UnitStore (sharded parameters, unit_store.hpp) over one local copy: the engine reads every
// unit through it in the documented order and hands gradients over unit by unit; outputs and
// gradients equal the engine's own storage (bitwise for one micro-batch).
class LocalStore : public engine::UnitStore {
 public:
  explicit LocalStore(Engine& model) : src(model) {
    params.assign(model.flat_params().begin(), model.flat_params().end());
    grads.assign(params.size(), 0.f);
    for (int64_t u = 0; u < model.num_units(); ++u) ranges.push_back(model.unit_range(u));
  }
  float* acquire_params(int64_t u) override {
    log += "P" + std::to_string(u) + " ";
    EXPECT_FALSE(held.count(u)) << "unit " << u << " acquired twice";
    held.insert(u);
    const auto [b, e] = ranges[size_t(u)];
    buf[u].assign(params.begin() + b, params.begin() + e);  // a gathered copy, as FSDP's
    return buf[u].data();
  }
  void release_params(int64_t u) override {
    log += "p" + std::to_string(u) + " ";
    EXPECT_TRUE(held.erase(u)) << "unit " << u << " released but not held";
    buf.erase(u);
  }
  float* acquire_grads(int64_t u) override {
    log += "G" + std::to_string(u) + " ";
    const auto [b, e] = ranges[size_t(u)];
    gbuf[u].assign(size_t(e - b), 0.f);
    return gbuf[u].data();
  }
  void release_grads(int64_t u) override {
    log += "g" + std::to_string(u) + " ";
    const auto [b, e] = ranges[size_t(u)];
    for (int64_t i = b; i < e; ++i) grads[size_t(i)] += gbuf[u][size_t(i - b)];
    gbuf.erase(u);
  }
  Engine& src;
  std::vector<float> params, grads;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  std::map<int64_t, std::vector<float>> buf, gbuf;
  std::set<int64_t> held;
  std::string log;
};

TEST_P(EngineModels, UnitStoreReadsUnitsInOrderAndMatchesOwnStorage) {
  Engine a(desc(), test::engine_options());
  randomize(a, 21);
  LocalStore store(a);
  engine::EngineOptions with = test::engine_options();
  with.units = &store;
  Engine b(desc(), with);
  const int64_t L = int64_t(a.desc().layers.size());
  ASSERT_EQ(b.num_units(), L + 1);
  EXPECT_EQ(b.unit_range(0).first, 0);
  EXPECT_EQ(b.unit_range(L).second, a.num_elements());
  EXPECT_THROW(b.param(0), std::logic_error);
  EXPECT_THROW(b.flat_grads(), std::logic_error);

  const Batch packed = make_batch({9, 4, 16}, a.desc().vocab_size);
  const MicroBatch mb = packed.mb();
  engine::StepOptions so = grads_only(int64_t(packed.ids.size()));
  // Forward only: the same outputs; every unit given back.
  const engine::Outputs oa = a.forward(mb, so.outputs), ob = b.forward(mb, so.outputs);
  EXPECT_EQ(oa.logprob, ob.logprob);
  EXPECT_EQ(oa.entropy, ob.entropy);
  std::string fwd = "P" + std::to_string(L) + " ";
  for (int64_t l = 0; l < L; ++l) fwd += "P" + std::to_string(l) + " p" + std::to_string(l) + " ";
  EXPECT_EQ(store.log, fwd + "p" + std::to_string(L) + " ");
  EXPECT_TRUE(store.held.empty());

  // One micro-batch: bitwise the same loss and gradients; the order of the contract.
  store.log.clear();
  const engine::StepResult ra = a.train_step({&mb, 1}, so, weighted_loss);
  const engine::StepResult rb = b.train_step({&mb, 1}, so, weighted_loss);
  EXPECT_EQ(ra.loss, rb.loss);
  EXPECT_EQ(rb.grad_norm, 0.0);  // the store's owner computes it
  std::vector<float> ga(a.flat_grads().begin(), a.flat_grads().end());
  EXPECT_EQ(store.grads, ga);
  std::string bwd = "G" + std::to_string(L) + " ";
  for (int64_t l = L - 1; l >= 0; --l) {
    const std::string n = std::to_string(l);
    bwd += "P" + n + " G" + n + " g" + n + " p" + n + " ";
  }
  bwd += "g" + std::to_string(L) + " p" + std::to_string(L) + " ";
  EXPECT_EQ(store.log, fwd + bwd);
  EXPECT_TRUE(store.held.empty());

  // Micro-batches accumulate in the store (within rounding of the engine's in-GEMM sums).
  std::vector<std::vector<int32_t>> cu_store;
  const std::vector<MicroBatch> parts = engine::split_microbatches(packed.ids, packed.cu, 16, &cu_store);
  std::vector<Batch> pb;
  for (const MicroBatch& p : parts) {
    Batch x;
    x.ids.assign(p.input_ids.begin(), p.input_ids.end());
    x.cu.assign(p.cu_seqlens.begin(), p.cu_seqlens.end());
    const size_t off = size_t(p.input_ids.data() - packed.ids.data());
    x.weights.assign(packed.weights.begin() + off, packed.weights.begin() + off + x.ids.size());
    x.shape = {int64_t(x.ids.size())};
    pb.push_back(std::move(x));
  }
  std::vector<MicroBatch> mbs;
  for (const Batch& x : pb) mbs.push_back(x.mb());
  ASSERT_GE(mbs.size(), 2u);
  std::fill(store.grads.begin(), store.grads.end(), 0.f);
  a.train_step(mbs, so, weighted_loss);
  b.train_step(mbs, so, weighted_loss);
  ga.assign(a.flat_grads().begin(), a.flat_grads().end());
  EXPECT_LE(rel_error(store.grads, ga), 1e-6);
  // A store owner applies the update: the engine refuses to.
  so.apply_optimizer = true;
  EXPECT_THROW(b.train_step({&mb, 1}, so, weighted_loss), std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(Models, EngineModels, ::testing::Values(0, 1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::string(i.param == 0   ? "qwen2_bias_window_yarn"
                                              : i.param == 1 ? "qwen3_qknorm_tied"
                                              : i.param == 2 ? "gemma3_sandwich_geglu_local_rope"
                                                             : "gemma2_softcapped");
                         });

// Gemma-2's soft-caps act (finite differences above check their gradients): the logits are
// within the final cap, the logprob is the log-softmax of those capped logits, and turning either
// cap off changes the outputs.
TEST(Engine, Gemma2SoftCapsBoundTheLogitsAndChangeTheOutputs) {
  const sdk::TransformerDesc capped = gemma2_desc();
  ASSERT_EQ(capped.final_logit_softcapping, 1.5);
  sdk::TransformerDesc no_final = capped, no_attn = capped;
  no_final.final_logit_softcapping = 0;
  for (auto& l : no_attn.layers) l.attention.logit_softcapping = 0;
  const Batch b = make_batch({14, 9}, capped.vocab_size);
  const MicroBatch mb = b.mb();
  engine::OutputRequest req;
  req.logits = true;
  req.temperature = 0.8;
  auto run = [&](const sdk::TransformerDesc& d) {
    Engine e(d, test::engine_options());
    randomize(e, 5);
    for (size_t i = 0; i < e.num_params(); ++i)  // larger weights: scores and logits past the caps
      for (float& x : e.param(i)) x *= 3.f;
    return e.forward(mb, req);
  };
  const engine::Outputs o = run(capped);
  const int64_t V = capped.vocab_size, N = int64_t(b.ids.size());
  float most = 0;
  for (float z : o.logits) most = std::max(most, std::fabs(z));
  EXPECT_LE(most, 1.5f);
  EXPECT_GT(most, 1.0f) << "the logits never reach the cap's bend: the test shows nothing";
  for (int64_t t = 0; t + 1 < N; ++t) {
    if (t + 1 == b.cu[1]) continue;  // the first sequence's last token predicts nothing
    double mx = -INFINITY, sum = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(o.logits[size_t(t * V + v)]) / 0.8);
    for (int64_t v = 0; v < V; ++v) sum += std::exp(double(o.logits[size_t(t * V + v)]) / 0.8 - mx);
    const double want = double(o.logits[size_t(t * V + b.ids[size_t(t + 1)])]) / 0.8 - mx - std::log(sum);
    EXPECT_NEAR(o.logprob[size_t(t + 1)], want, 2e-5) << "token " << t + 1;
  }
  EXPECT_GT(rel_error(run(no_final).logprob, o.logprob), 1e-3) << "the final cap is not applied";
  EXPECT_GT(rel_error(run(no_attn).logprob, o.logprob), 1e-3) << "the attention cap is not applied";
}

// Two optimizer steps equal AdamW (torch semantics) applied by hand to the engine's gradients,
// with global-norm clipping and no weight decay on 1-D tensors (Megatron style).
TEST(Engine, OptimizerStepIsClippedAdamW) {
  engine::EngineOptions eo = test::engine_options();
  eo.optimizer.beta1 = 0.9;
  eo.optimizer.beta2 = 0.95;
  eo.optimizer.eps = 1e-8;
  eo.optimizer.weight_decay = 0.1;
  eo.optimizer.decay_1d_params = false;
  eo.optimizer.max_grad_norm = 0.05;  // small enough to clip
  Engine stepping(qwen2_desc(), eo), probe(qwen2_desc(), eo);
  randomize(stepping, 21);
  randomize(probe, 21);
  const Batch packed = make_batch({10, 13}, 97);
  const MicroBatch mb = packed.mb();
  engine::StepOptions so = grads_only(int64_t(packed.ids.size()));
  const size_t n = size_t(stepping.num_elements());

  std::vector<double> w(n), m(n, 0.0), v(n, 0.0);
  const double lrs[2] = {1e-2, 5e-3};
  for (int step = 1; step <= 2; ++step) {
    // Expected update from the probe's gradients at the stepping engine's current weights (so
    // only the optimizer arithmetic is compared; m and v carry over in double).
    const auto current = stepping.save_parameters();
    probe.load_parameters(current);
    size_t k0 = 0;
    for (const auto& t : current)
      for (float x : t) w[k0++] = x;
    so.apply_optimizer = false;
    const engine::StepResult pr = probe.train_step({&mb, 1}, so, weighted_loss);
    so.apply_optimizer = true;
    so.lr = lrs[step - 1];
    const engine::StepResult sr = stepping.train_step({&mb, 1}, so, weighted_loss);
    EXPECT_EQ(sr.step, step);
    EXPECT_NEAR(sr.grad_norm, pr.grad_norm, 1e-6 * pr.grad_norm);
    const double clip = std::min(1.0, eo.optimizer.max_grad_norm / (pr.grad_norm + 1e-6));
    EXPECT_LT(clip, 1.0);
    EXPECT_NEAR(sr.clip_coef, clip, 1e-9);
    size_t k = 0;
    std::vector<std::vector<float>> next;
    for (size_t i = 0; i < probe.num_params(); ++i) {
      const bool decay = probe.desc().params[i].shape.size() > 1;
      std::vector<float> t;
      for (float g32 : probe.grad(i)) {
        const double g = double(g32) * clip;
        m[k] = 0.9 * m[k] + 0.1 * g;
        v[k] = 0.95 * v[k] + 0.05 * g * g;
        const double bc1 = 1 - std::pow(0.9, step), bc2 = 1 - std::pow(0.95, step);
        w[k] *= 1 - so.lr * (decay ? 0.1 : 0.0);
        w[k] -= so.lr / bc1 * m[k] / (std::sqrt(v[k]) / std::sqrt(bc2) + 1e-8);
        t.push_back(float(w[k]));
        ++k;
      }
      next.push_back(std::move(t));
    }
    const auto got = stepping.save_parameters();
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i)
      for (size_t j = 0; j < got[i].size(); ++j)
        worst = std::max(worst, std::fabs(double(got[i][j]) - double(next[i][j])));
    EXPECT_LE(worst, 1e-6) << "step " << step;
  }
}

// forward() and the loss callback see the same outputs.
TEST(Engine, ForwardOutputsEqualWhatTheLossSees) {
  Engine e(qwen3_desc(), test::engine_options());
  randomize(e, 31);
  const Batch b = make_batch({12, 5}, 101);
  const MicroBatch mb = b.mb();
  engine::StepOptions so = grads_only(int64_t(b.ids.size()));
  const engine::Outputs o = e.forward(mb, so.outputs);
  std::vector<float> seen;
  e.train_step({&mb, 1}, so,
               [&](const engine::LossContext& c, const engine::OutputViews& v,
                   engine::OutputGrads& g) {
                 seen.assign(v.logprob.begin(), v.logprob.end());
                 return weighted_loss(c, v, g);
               });
  EXPECT_EQ(seen, o.logprob);
  // A forward after the step reuses the step's activation storage: same outputs again.
  EXPECT_EQ(e.forward(mb, so.outputs).logprob, o.logprob);
}

// logprob_at_ids (top-k distillation): an id column holding the actual tokens reproduces the
// logprob output and its gradients; absent ids give 0; packing changes nothing.
TEST(Engine, LogprobAtIds) {
  Engine e(qwen3_desc(), test::engine_options());
  randomize(e, 41);
  const Batch b = make_batch({6, 9}, 101);
  const int64_t N = int64_t(b.ids.size()), K = 3;
  std::vector<int64_t> ids(size_t(N * K));
  for (int64_t t = 0; t < N; ++t) {
    ids[size_t(t * K)] = b.ids[size_t(t)];                // the token itself
    ids[size_t(t * K + 1)] = (b.ids[size_t(t)] * 7 + 3) % 101;
    ids[size_t(t * K + 2)] = t % 3 == 0 ? -1 : 50;       // some absent
  }
  std::vector<int64_t> shape = {N, K}, strides = {K, 1};
  MicroBatch mb = b.mb();
  rlh_named_tensor f{};
  f.name = "topk_ids";
  f.tensor.data = ids.data();
  f.tensor.device = rlh_device{RLH_DEVICE_CPU, 0};
  f.tensor.ndim = 2;
  f.tensor.dtype = rlh_dtype{RLH_DTYPE_INT, 64, 1};
  f.tensor.shape = shape.data();
  f.tensor.strides = strides.data();
  mb.fields.push_back(f);

  engine::OutputRequest req;
  req.logprob = true;
  req.logprob_at_ids = true;
  req.ids_field = "topk_ids";
  req.temperature = 0.8;
  const engine::Outputs o = e.forward(mb, req);
  ASSERT_EQ(o.ids_per_token, K);
  for (int64_t t = 0; t < N; ++t) {
    EXPECT_EQ(o.logprob_at_ids[size_t(t * K)], o.logprob[size_t(t)]) << t;
    if (ids[size_t(t * K + 2)] < 0) {
      EXPECT_EQ(o.logprob_at_ids[size_t(t * K + 2)], 0.f) << t;
    }
  }
  // Sequence 1 alone, its ids rows alone: the same values.
  const Batch one = sequence_of(b, 1);
  std::vector<int64_t> ids1(ids.begin() + b.cu[1] * K, ids.end());
  std::vector<int64_t> shape1 = {int64_t(one.ids.size()), K};
  MicroBatch mb1 = one.mb();
  rlh_named_tensor f1 = f;
  f1.tensor.data = ids1.data();
  f1.tensor.shape = shape1.data();
  mb1.fields.push_back(f1);
  const engine::Outputs o1 = e.forward(mb1, req);
  // Not bitwise: the batch's GEMMs differ in shape, so BLAS may sum K in another order (a few
  // float32 ulp of the value: 1.4e-6 at -5.3 was seen in the ASan build).
  for (size_t i = 0; i < o1.logprob_at_ids.size(); ++i) {
    const float want = o.logprob_at_ids[size_t(b.cu[1] * K) + i];
    EXPECT_NEAR(o1.logprob_at_ids[i], want, 1e-6 * std::max(1.0f, std::fabs(want)));
  }

  // Gradients through the id column that holds the tokens equal those through logprob.
  engine::StepOptions so;
  so.global_tokens = N;
  so.apply_optimizer = false;
  so.outputs = req;
  auto via = [&](bool ids_column) {
    e.train_step({&mb, 1}, so,
                 [&](const engine::LossContext&, const engine::OutputViews& v, engine::OutputGrads& g) {
                   engine::LossResult r;
                   for (int64_t t = 0; t < N; ++t) {
                     const float w = -0.1f * float(1 + t % 4);
                     if (ids_column)
                       g.logprob_at_ids[size_t(t * K)] = w;
                     else
                       g.logprob[size_t(t)] = w;
                     r.loss += w * v.logprob[size_t(t)];
                   }
                   return r;
                 });
    return all_grads(e);
  };
  EXPECT_EQ(via(true), via(false));
}

TEST(Engine, RefusesWhatItDoesNotExecute) {
  sdk::TransformerDesc d = qwen2_desc();
  d.layers[1].mlp.kind = sdk::MlpKind::moe;
  EXPECT_THROW(Engine e(d, test::engine_options()), std::invalid_argument);
  d = qwen2_desc();
  d.layers[0].mlp.hidden_act = "relu";  // no GLU form of it is executed
  EXPECT_THROW(Engine e(d, test::engine_options()), std::invalid_argument);
  Engine ok(qwen2_desc(), test::engine_options());
  std::vector<int32_t> ids = {1, 2, 500};
  std::vector<int32_t> cu = {0, 3};
  MicroBatch mb;
  mb.input_ids = ids;
  mb.cu_seqlens = cu;
  EXPECT_THROW(ok.forward(mb, {}), std::invalid_argument);  // id outside the vocabulary
  std::vector<int32_t> bad_cu = {0, 2};
  ids = {1, 2, 3};
  mb.cu_seqlens = bad_cu;
  EXPECT_THROW(ok.forward(mb, {}), std::invalid_argument);  // offsets do not cover the tokens
  EXPECT_THROW(ok.train_step({}, engine::StepOptions{}, weighted_loss), std::invalid_argument);
}

}  // namespace
