// Engine MoE properties on MoE fixtures (HF weights, so the router makes real, uneven choices):
// two Qwen2-MoE configurations of tests/engine/fixtures and DeepSeek-V3 (MLA attention, sigmoid
// group-limited routing) of the shared fixtures. Packing, micro-batching, recompute and thread
// count do not change results; the routing record and replay; the auxiliary losses' gradients
// against finite differences of their reported values; the frozen router; the float64 router;
// the kernels through the C ABI; pipeline stages' routing columns, replay and losses (with
// interleaved virtual stages each model chunk's own columns); refusals. (Agreement with Hugging
// Face is test_engine_fixtures.)
#include <gtest/gtest.h>

#include <omp.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels_cpu_abi.hpp"
#include "rlhost/engine/engine.hpp"
#include "rlhost/host.h"
#include "rlhost/model/llama_family.hpp"
#include "rlhost/sdk/pipeline_parallel.hpp"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/safetensors.hpp"

#include <nlohmann/json.hpp>

using namespace rlh;
using engine::Engine;
using engine::EngineOptions;
using engine::MicroBatch;
using engine::MoeOptions;

namespace {

struct Model {
  sdk::TransformerDesc desc;
  std::vector<std::vector<float>> weights;
};

// qwen2-moe-tiny: softmax without renormalisation, gated shared expert, a dense layer between
// MoE layers. qwen2-moe-step2-tied-tiny: renormalised top-3 of 6, MoE every second layer, tied.
// deepseek-v3-tiny (shared fixtures): MLA, first layer dense, sigmoid scores with a selection
// bias, 2 groups of which 1 is eligible, routed_scaling_factor 2.5, an ungated shared expert.
std::string fixture_dir(const std::string& name) {
  if (name == "deepseek-v3-tiny") {
    const char* env = std::getenv("RLHOST_FIXTURES");
    return std::string(env && *env ? env : RLH_FIXTURES_DIR) + "/" + name;
  }
  return std::string(RLH_ENGINE_FIXTURES_DIR) + "/" + name;
}

const Model& model(const std::string& name) {
  static std::map<std::string, Model> cache;
  auto it = cache.find(name);
  if (it == cache.end()) {
    const std::string dir = fixture_dir(name);
    Model m;
    m.desc = model::describe_model_dir(dir);
    m.weights = sdk::load_weights_f32(m.desc, sdk::st::Checkpoint::open(dir + "/model.safetensors")).tensors;
    it = cache.emplace(name, std::move(m)).first;
  }
  return it->second;
}

std::unique_ptr<Engine> make(const std::string& name, EngineOptions o = {}) {
  const Model& m = model(name);
  if (o.ops == nullptr) o.ops = &test::cpu_ops();
  auto e = std::make_unique<Engine>(m.desc, o);
  e->load_parameters(m.weights);
  return e;
}

// Packed sequences of the given lengths with deterministic ids.
struct Batch {
  std::vector<int32_t> ids, cu;
  MicroBatch mb() const {
    MicroBatch m;
    m.input_ids = ids;
    m.cu_seqlens = cu;
    return m;
  }
};
Batch make_batch(const std::vector<int>& lens, int64_t V) {
  Batch b;
  b.cu.push_back(0);
  for (size_t s = 0; s < lens.size(); ++s) {
    for (int t = 0; t < lens[s]; ++t) b.ids.push_back(int32_t(3 + (s * 131 + t * 37 + t * t) % (V - 3)));
    b.cu.push_back(int32_t(b.ids.size()));
  }
  return b;
}

// Mean NLL over the predicted tokens (normalised by the caller's global count).
engine::LossResult nll(const engine::LossContext& c, const engine::OutputViews& o,
                       engine::OutputGrads& g) {
  engine::LossResult r;
  const auto& cu = c.microbatch->cu_seqlens;
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int32_t t = cu[s] + 1; t < cu[s + 1]; ++t) {
      r.loss -= o.logprob[size_t(t)] / double(c.global_tokens);
      g.logprob[size_t(t)] = float(-1.0 / double(c.global_tokens));
    }
  return r;
}
// No loss of its own: only the MoE auxiliary losses make gradients.
engine::LossResult no_loss(const engine::LossContext&, const engine::OutputViews&,
                           engine::OutputGrads&) {
  return {};
}

// A 2-D int32 micro-batch field over `data` (the vectors must outlive it).
rlh_named_tensor int32_field(const char* name, std::vector<int32_t>& data, std::vector<int64_t>& shape,
                             std::vector<int64_t>& strides) {
  rlh_named_tensor f{};
  f.name = name;
  f.tensor.data = data.data();
  f.tensor.device = rlh_device{RLH_DEVICE_CPU, 0};
  f.tensor.ndim = 2;
  f.tensor.dtype = rlh_dtype{RLH_DTYPE_INT, 32, 1};
  f.tensor.shape = shape.data();
  f.tensor.strides = strides.data();
  return f;
}

int64_t predicted(const Batch& b) { return int64_t(b.ids.size()) - int64_t(b.cu.size()) + 1; }

double metric(const engine::StepResult& r, const std::string& name) {
  for (const auto& [k, v] : r.metrics)
    if (k == name) return v;
  ADD_FAILURE() << "no metric " << name;
  return NAN;
}

std::vector<std::vector<float>> grads(Engine& e) {
  std::vector<std::vector<float>> g;
  for (size_t i = 0; i < e.num_params(); ++i) g.emplace_back(e.grad(i).begin(), e.grad(i).end());
  return g;
}

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  double mx = 0, err = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    mx = std::max(mx, std::fabs(double(b[i])));
    err = std::max(err, std::fabs(double(a[i]) - double(b[i])));
  }
  return err / std::max(mx, 1e-30);
}

// Another routing of the whole model: each choice of a [N, R] record (R columns: each MoE
// layer's top_k in turn) moved to the next expert.
std::vector<int32_t> moved_routing(const sdk::TransformerDesc& d, std::vector<int32_t> routed, int64_t N, int64_t R) {
  int64_t col = 0;
  for (const auto& l : d.layers) {
    if (l.mlp.kind != sdk::MlpKind::moe) continue;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < l.mlp.moe.top_k; ++k) {
        int32_t& x = routed[size_t(n * R + col + k)];
        x = int32_t((x + 1) % l.mlp.moe.num_experts);
      }
    col += l.mlp.moe.top_k;
  }
  return routed;
}

bool sigmoid_scores(const std::string& name) {
  for (const auto& l : model(name).desc.layers)
    if (l.mlp.kind == sdk::MlpKind::moe && l.mlp.moe.scoring == sdk::MoeScoring::sigmoid) return true;
  return false;
}

class MoeModel : public ::testing::TestWithParam<std::string> {};

// One packed micro-batch = one micro-batch per sequence (gradients, the per-sequence and z
// losses); recompute and the thread count change no bit.
TEST_P(MoeModel, PackingMicroBatchesRecomputeAndThreadsDoNotChangeResults) {
  EngineOptions o;
  const bool losses = !sigmoid_scores(GetParam());  // the auxiliary losses need softmax scores
  if (losses) {
    o.moe.load_balancing = MoeOptions::LoadBalancing::seq_aux_loss;
    o.moe.aux_loss_coef = 0.05;
    o.moe.z_loss_coef = 1e-3;
  }
  const Batch b = make_batch({9, 17, 5, 13}, model(GetParam()).desc.vocab_size);
  engine::StepOptions so;
  so.global_tokens = predicted(b);
  so.apply_optimizer = false;

  auto run = [&](EngineOptions eo, int64_t max_tokens, engine::StepResult* r) {
    auto e = make(GetParam(), eo);
    std::vector<std::vector<int32_t>> cu;
    const std::vector<MicroBatch> mbs = engine::split_microbatches(b.ids, b.cu, max_tokens, &cu);
    *r = e->train_step(mbs, so, nll);
    return grads(*e);
  };
  engine::StepResult packed, split, recomputed, one_thread;
  const auto g_packed = run(o, 1000, &packed);
  const auto g_split = run(o, 1, &split);
  if (losses) {
    ASSERT_GT(metric(packed, "moe/aux_loss"), 0);
    EXPECT_NEAR(metric(split, "moe/aux_loss"), metric(packed, "moe/aux_loss"), 1e-6 * metric(packed, "moe/aux_loss"));
    EXPECT_NEAR(metric(split, "moe/z_loss"), metric(packed, "moe/z_loss"), 1e-6 * metric(packed, "moe/z_loss"));
  }
  EXPECT_NEAR(split.loss, packed.loss, 1e-6 * packed.loss);
  for (size_t i = 0; i < g_packed.size(); ++i)
    EXPECT_LE(rel(g_split[i], g_packed[i]), 2e-5) << model(GetParam()).desc.params[i].name;

  EngineOptions rc = o;
  rc.recompute = true;
  const auto g_rc = run(rc, 1000, &recomputed);
  EXPECT_EQ(g_rc, g_packed);
  EXPECT_EQ(recomputed.loss, packed.loss);
  if (losses) {
    EXPECT_EQ(metric(recomputed, "moe/aux_loss"), metric(packed, "moe/aux_loss"));
  }

  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto g_1 = run(o, 1000, &one_thread);
  omp_set_num_threads(saved);
  EXPECT_EQ(g_1, g_packed);
}

// The record lists each token's experts per MoE layer; replaying it reproduces the forward bit
// for bit; replaying another routing uses that one.
TEST_P(MoeModel, RoutingRecordAndReplay) {
  const Model& m = model(GetParam());
  auto e = make(GetParam());
  const Batch b = make_batch({11, 20}, m.desc.vocab_size);
  const MicroBatch mb = b.mb();
  const int64_t N = int64_t(b.ids.size()), R = e->routing_width();
  int64_t expect_r = 0;
  for (const auto& l : m.desc.layers)
    if (l.mlp.kind == sdk::MlpKind::moe) expect_r += l.mlp.moe.top_k;
  ASSERT_EQ(R, expect_r);

  engine::OutputRequest req;
  req.routed_experts = true;
  const engine::Outputs o = e->forward(mb, req);
  ASSERT_EQ(o.routing_width, R);
  ASSERT_EQ(int64_t(o.routed_experts.size()), N * R);
  int64_t col = 0;
  for (const auto& l : m.desc.layers) {
    if (l.mlp.kind != sdk::MlpKind::moe) continue;
    const int64_t K = l.mlp.moe.top_k, E = l.mlp.moe.num_experts;
    std::vector<int> used(size_t(E), 0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const int32_t x = o.routed_experts[size_t(n * R + col + k)];
        ASSERT_GE(x, 0);
        ASSERT_LT(x, E);
        ++used[size_t(x)];
        for (int64_t j = 0; j < k; ++j) EXPECT_NE(x, o.routed_experts[size_t(n * R + col + j)]);
      }
    int experts_used = 0;
    for (int u : used) experts_used += u > 0;
    EXPECT_GT(experts_used, 1) << "the router spreads tokens";
    col += K;
  }

  // Replay of the record: the same outputs, bit for bit, and the same record.
  std::vector<int64_t> shape = {N, R}, strides = {R, 1};
  auto field = [&](std::vector<int32_t>& data) { return int32_field("routed_experts", data, shape, strides); };
  std::vector<int32_t> rec = o.routed_experts;
  MicroBatch rmb = mb;
  rmb.fields.push_back(field(rec));
  engine::OutputRequest rreq = req;
  rreq.replay_routing_field = "routed_experts";
  const engine::Outputs o2 = e->forward(rmb, rreq);
  EXPECT_EQ(o2.logprob, o.logprob);
  EXPECT_EQ(o2.routed_experts, o.routed_experts);

  // Another routing (each choice moved to the next expert, keeping a row's choices distinct).
  std::vector<int32_t> other = moved_routing(m.desc, rec, N, R);
  MicroBatch omb = mb;
  omb.fields.push_back(field(other));
  const engine::Outputs o3 = e->forward(omb, rreq);
  EXPECT_EQ(o3.routed_experts, other);
  EXPECT_NE(o3.logprob, o.logprob);

  // A train step records too, per micro-batch.
  engine::StepOptions so;
  so.global_tokens = predicted(b);
  so.apply_optimizer = false;
  so.outputs.routed_experts = true;
  const engine::StepResult sr = e->train_step({&mb, 1}, so, nll);
  ASSERT_EQ(sr.routed_experts.size(), 1u);
  EXPECT_EQ(sr.routed_experts[0], o.routed_experts);

  // A malformed replay field is refused.
  shape = {N, R - 1};
  strides = {R - 1, 1};
  std::vector<int32_t> short_rec(size_t(N * (R - 1)), 0);
  MicroBatch bad = mb;
  bad.fields.push_back(field(short_rec));
  EXPECT_THROW(e->forward(bad, rreq), std::invalid_argument);
  shape = {N, R};
  strides = {R, 1};
  std::vector<int32_t> out_of_range = rec;
  out_of_range[3] = 1000;
  MicroBatch bad2 = mb;
  bad2.fields.push_back(field(out_of_range));
  EXPECT_THROW(e->forward(bad2, rreq), std::invalid_argument);
}

// Pipeline stages (sdk/pipeline_parallel.hpp) in one process, the boundary activations handed
// over by hand: stage records are the whole model's record cut at route_begin; replaying the
// whole model's [N, R] record on the stages (each reads its columns) gives one engine's outputs
// under that routing, and the train step's gradients with the auxiliary losses (load balancing,
// z-loss), their values summed over the stages, are one engine's.
TEST_P(MoeModel, PipelineStagesRecordAndReplayTheirColumns) {
  const Model& m = model(GetParam());
  // Stage 1 starts at the last MoE layer, so both stages hold MoE layers.
  int64_t first = -1, moe_layers = 0;
  sdk::MoeScoring scoring = sdk::MoeScoring::softmax;
  for (const auto& l : m.desc.layers)
    if (l.mlp.kind == sdk::MlpKind::moe) first = l.index, scoring = l.mlp.moe.scoring, ++moe_layers;
  ASSERT_GE(moe_layers, 2);
  EngineOptions o;
  o.moe.load_balancing = MoeOptions::LoadBalancing::seq_aux_loss;
  o.moe.aux_loss_coef = 0.01;
  o.moe.z_loss_coef = 0.001;
  const bool losses = scoring == sdk::MoeScoring::softmax;
  if (!losses) o.moe = MoeOptions{};  // sigmoid scores: no auxiliary losses
  auto whole = make(GetParam(), o);
  const Batch b = make_batch({11, 20}, m.desc.vocab_size);
  const MicroBatch mb = b.mb();
  const int64_t N = int64_t(b.ids.size()), R = whole->routing_width(), C = m.desc.hidden_size;
  engine::OutputRequest req;
  req.routed_experts = true;
  const engine::Outputs ref = whole->forward(mb, req);

  std::vector<sdk::PpLayout> layouts;
  std::vector<std::unique_ptr<Engine>> stages;
  for (int64_t s = 0; s < 2; ++s) {
    layouts.push_back(sdk::make_pp_layout(m.desc, 2, s, {first, 0}));
  }
  for (int64_t s = 0; s < 2; ++s) {
    EngineOptions so = o;
    so.ops = &test::cpu_ops();
    so.pp = &layouts[size_t(s)];
    auto e = std::make_unique<Engine>(m.desc, so);  // the engine takes the stage from so.pp
    std::vector<std::vector<float>> w;
    for (int64_t i : layouts[size_t(s)].full_index) w.push_back(m.weights[size_t(i)]);
    e->load_parameters(w);
    EXPECT_EQ(layouts[size_t(s)].route_total, R);
    stages.push_back(std::move(e));
  }
  // Both stages' records, put side by side at route_begin, are the whole model's.
  const auto run = [&](const MicroBatch& in, const engine::OutputRequest& r) {
    std::vector<float> x(size_t(N * C));
    const engine::Outputs o0 = stages[0]->forward_stage(in, r, {}, x);
    engine::Outputs o1 = stages[1]->forward_stage(in, r, x, {});
    if (r.routed_experts) {
      std::vector<int32_t> rec(size_t(N * R), -1);
      const engine::Outputs* parts[2] = {&o0, &o1};
      for (int s = 0; s < 2; ++s) {
        const int64_t w = parts[s]->routing_width, at = layouts[size_t(s)].route_begin;
        EXPECT_EQ(w, stages[size_t(s)]->routing_width());
        for (int64_t n = 0; n < N; ++n)
          for (int64_t k = 0; k < w; ++k) rec[size_t(n * R + at + k)] = parts[s]->routed_experts[size_t(n * w + k)];
      }
      o1.routed_experts = rec;
    }
    return o1;
  };
  const engine::Outputs got = run(mb, req);
  EXPECT_EQ(got.logprob, ref.logprob);
  EXPECT_EQ(got.routed_experts, ref.routed_experts);

  // Replay another routing of the whole model (each choice moved to the next expert).
  std::vector<int32_t> other = moved_routing(m.desc, ref.routed_experts, N, R);
  std::vector<int64_t> shape = {N, R}, strides = {R, 1};  // the field points at these
  MicroBatch rmb = mb;
  rmb.fields.push_back(int32_field("routes", other, shape, strides));
  engine::OutputRequest rreq = req;
  rreq.replay_routing_field = "routes";
  const engine::Outputs ref_other = whole->forward(rmb, rreq);
  const engine::Outputs got_other = run(rmb, rreq);
  EXPECT_NE(ref_other.logprob, ref.logprob);
  EXPECT_EQ(got_other.logprob, ref_other.logprob);
  EXPECT_EQ(got_other.routed_experts, other);

  // A train step under the replayed routing: the stages' gradients are the whole engine's.
  engine::StepOptions so;
  so.global_tokens = predicted(b);
  so.apply_optimizer = false;
  so.outputs.replay_routing_field = "routes";
  const engine::StepResult sr = whole->train_step({&rmb, 1}, so, nll);
  const std::vector<std::vector<float>> g_ref = grads(*whole);
  std::vector<float> x(size_t(N * C)), dx(size_t(N * C));
  for (auto& e : stages) e->begin_stage_step({&rmb, 1}, so);
  stages[0]->forward_stage(rmb, so.outputs, {}, x);
  const engine::LossResult lr = stages[1]->backward_stage(rmb, 0, 1, so, nll, x, {}, dx);
  stages[0]->backward_stage(rmb, 0, 1, so, nll, {}, dx, {});
  for (auto& e : stages) e->end_stage_step();
  EXPECT_NEAR(lr.loss, sr.loss, 1e-6 * std::fabs(sr.loss));
  // A tied embedding's two copies (stage 0's lookup, stage 1's head) each hold a part: their sum.
  std::vector<float> embed_sum;
  for (int64_t s = 0; s < 2; ++s) {
    const std::vector<std::vector<float>> g = grads(*stages[size_t(s)]);
    for (size_t j = 0; j < g.size(); ++j) {
      const size_t i = size_t(layouts[size_t(s)].full_index[j]);
      if (layouts[size_t(s)].shares_embedding && int64_t(j) == layouts[size_t(s)].embed_local) {
        if (embed_sum.empty()) embed_sum.assign(g[j].size(), 0.f);
        for (size_t k = 0; k < g[j].size(); ++k) embed_sum[k] += g[j][k];
        if (s == 1) EXPECT_LE(rel(embed_sum, g_ref[i]), 1e-5) << m.desc.params[i].name << " (tied: both copies)";
        continue;
      }
      EXPECT_LE(rel(g[j], g_ref[i]), 1e-5) << m.desc.params[i].name;
    }
  }
  // The auxiliary losses' values, summed over the stages; the busiest expert's share, the largest.
  const Engine::MoeValues v0 = stages[0]->stage_moe_values(), v1 = stages[1]->stage_moe_values();
  const auto metrics = engine::moe_step_metrics(o.moe, v0.aux + v1.aux, v0.z + v1.z, std::max(v0.max_load, v1.max_load));
  ASSERT_EQ(metrics.size(), losses ? 3u : 1u);
  for (const auto& [k, v] : metrics) EXPECT_NEAR(v, metric(sr, k), 1e-9 * std::fabs(metric(sr, k)) + 1e-12) << k;
}

// qwen3-moe-tiny's two layers, then both again scaled by 0.9 (no two layers alike): four MoE
// layers, so that under PP 2 x VPP 2 every model chunk holds one and each rank's two chunks are
// column runs apart (rank 0: layers 0 and 2).
const Model& four_layer_qwen3_moe() {
  static const Model m4 = [] {
    const std::string shared = fixture_dir("deepseek-v3-tiny"), dir = shared.substr(0, shared.rfind('/')) + "/qwen3-moe-tiny";
    Model m2;
    m2.desc = model::describe_model_dir(dir);
    m2.weights = sdk::load_weights_f32(m2.desc, sdk::st::Checkpoint::open(dir + "/model.safetensors")).tensors;
    nlohmann::json cfg = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
    cfg["num_hidden_layers"] = 4;
    Model m;
    m.desc = model::describe(cfg);
    std::map<std::string, size_t> at;
    for (size_t i = 0; i < m2.desc.params.size(); ++i) at[m2.desc.params[i].name] = i;
    const std::string pre = "model.layers.";
    for (const auto& p : m.desc.params) {
      std::string name = p.name;
      float scale = 1.f;
      if (name.rfind(pre, 0) == 0) {
        const size_t dot = name.find('.', pre.size());
        const int layer = std::stoi(name.substr(pre.size(), dot - pre.size()));
        if (layer >= 2) scale = 0.9f;
        name = pre + std::to_string(layer % 2) + name.substr(dot);
      }
      auto it = at.find(name);
      if (it == at.end()) throw std::runtime_error("four_layer_qwen3_moe: no " + name + " in qwen3-moe-tiny");
      m.weights.push_back(m2.weights[it->second]);
      for (float& x : m.weights.back()) x *= scale;
    }
    return m;
  }();
  return m4;
}

// Interleaved virtual stages (PP 2 x VPP 2) in one process: two stage engines of two model
// chunks each, run in the virtual stages' order (v = c P + s), the activations handed over by
// hand. Each chunk records its own run of columns (PpLayout::Chunk::route_begin); put in place
// they are the one-rank engine's record. Replaying another routing of the whole model gives the
// one-rank engine's logprobs under it, the forwards of a train step under replay record that
// routing, and the step's gradients and MoE metrics are the one-rank engine's.
void check_virtual_stage_routing(const Model& m, const std::string& label) {
  SCOPED_TRACE(label);
  constexpr int64_t P = 2, V = 2, S = P * V;
  EngineOptions o;
  o.ops = &test::cpu_ops();
  o.moe.load_balancing = MoeOptions::LoadBalancing::seq_aux_loss;
  o.moe.aux_loss_coef = 0.01;
  o.moe.z_loss_coef = 0.001;
  Engine whole(m.desc, o);
  whole.load_parameters(m.weights);
  const Batch b = make_batch({11, 20, 7}, m.desc.vocab_size);
  const MicroBatch mb = b.mb();
  const int64_t N = int64_t(b.ids.size()), R = whole.routing_width(), C = m.desc.hidden_size;
  engine::OutputRequest req;
  req.routed_experts = true;
  const engine::Outputs ref = whole.forward(mb, req);

  sdk::PpSplit split;
  split.virtual_size = V;
  std::vector<sdk::PpLayout> layouts;
  for (int64_t s = 0; s < P; ++s) layouts.push_back(sdk::make_pp_layout(m.desc, P, s, split));
  std::vector<std::unique_ptr<Engine>> stages;
  for (int64_t s = 0; s < P; ++s) {
    EngineOptions so = o;
    so.pp = &layouts[size_t(s)];
    auto e = std::make_unique<Engine>(m.desc, so);
    std::vector<std::vector<float>> w;
    for (int64_t i : layouts[size_t(s)].full_index) w.push_back(m.weights[size_t(i)]);
    e->load_parameters(w);
    ASSERT_EQ(layouts[size_t(s)].route_total, R);
    ASSERT_EQ(layouts[size_t(s)].chunks.size(), size_t(V));
    stages.push_back(std::move(e));
  }
  // Virtual stage v is chunk v / P of rank v % P. xs[v]: the input of virtual stage v.
  std::vector<std::vector<float>> xs(size_t(S), std::vector<float>(size_t(N * C)));
  // Each chunk's record put at its columns of the whole [N, R].
  const auto place = [&](std::vector<int32_t>& rec, const engine::Outputs& got, int64_t v) {
    const sdk::PpLayout::Chunk& c = layouts[size_t(v % P)].chunks[size_t(v / P)];
    EXPECT_EQ(got.routing_width, c.route_count) << "virtual stage " << v;
    ASSERT_EQ(int64_t(got.routed_experts.size()), N * c.route_count) << "virtual stage " << v;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < c.route_count; ++k)
        rec[size_t(n * R + c.route_begin + k)] = got.routed_experts[size_t(n * c.route_count + k)];
  };
  const auto run = [&](const MicroBatch& in, const engine::OutputRequest& r) {
    engine::Outputs last;
    std::vector<int32_t> rec(size_t(N * R), -1);
    for (int64_t v = 0; v < S; ++v) {
      const std::span<const float> x_in = v > 0 ? std::span<const float>(xs[size_t(v)]) : std::span<const float>();
      const std::span<float> x_out = v < S - 1 ? std::span<float>(xs[size_t(v + 1)]) : std::span<float>();
      engine::Outputs got = stages[size_t(v % P)]->forward_stage(in, r, x_in, x_out, v / P);
      if (r.routed_experts) place(rec, got, v);
      if (v == S - 1) last = std::move(got);
    }
    last.routed_experts = rec;
    return last;
  };
  const auto max_diff = [](const std::vector<float>& a, const std::vector<float>& b) {
    EXPECT_EQ(a.size(), b.size());
    double d = 0;
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) d = std::max(d, std::fabs(double(a[i]) - double(b[i])));
    return d;
  };
  const engine::Outputs got = run(mb, req);
  EXPECT_EQ(got.routed_experts, ref.routed_experts) << "the chunks' records put in place are one engine's";
  EXPECT_LE(max_diff(got.logprob, ref.logprob), 1e-6);

  // Another routing of the whole model (each choice moved to the next expert), replayed.
  std::vector<int32_t> other = moved_routing(m.desc, ref.routed_experts, N, R);
  std::vector<int64_t> shape = {N, R}, strides = {R, 1};  // the field points at these
  MicroBatch rmb = mb;
  rmb.fields.push_back(int32_field("routes", other, shape, strides));
  engine::OutputRequest rreq = req;
  rreq.replay_routing_field = "routes";
  const engine::Outputs ref_other = whole.forward(rmb, rreq);
  const engine::Outputs got_other = run(rmb, rreq);
  EXPECT_GT(max_diff(ref_other.logprob, ref.logprob), 1e-4) << "the other routing changes the outputs";
  EXPECT_LE(max_diff(got_other.logprob, ref_other.logprob), 1e-6) << "replaying another routing";
  EXPECT_EQ(got_other.routed_experts, other);

  // A train step under the replayed routing: the forwards of the virtual stages before the last
  // (with the record asked for) record that routing; then the backwards from the last virtual
  // stage down. The stages' gradients and MoE metrics are the one-rank engine's.
  engine::StepOptions so;
  so.global_tokens = predicted(b);
  so.global_sequences = int64_t(b.cu.size()) - 1;
  so.apply_optimizer = false;
  so.outputs.replay_routing_field = "routes";
  const engine::StepResult sr = whole.train_step({&rmb, 1}, so, nll);
  const std::vector<std::vector<float>> g_ref = grads(whole);
  for (auto& e : stages) e->begin_stage_step({&rmb, 1}, so);
  engine::OutputRequest fwd = so.outputs;
  fwd.routed_experts = true;
  for (int64_t v = 0; v + 1 < S; ++v) {
    const engine::Outputs f = stages[size_t(v % P)]->forward_stage(
        rmb, fwd, v > 0 ? std::span<const float>(xs[size_t(v)]) : std::span<const float>(), xs[size_t(v + 1)], v / P);
    const sdk::PpLayout::Chunk& c = layouts[size_t(v % P)].chunks[size_t(v / P)];
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < c.route_count; ++k)
        ASSERT_EQ(f.routed_experts[size_t(n * c.route_count + k)], other[size_t(n * R + c.route_begin + k)])
            << "virtual stage " << v << ": the train step's forward records the replayed routing";
  }
  std::vector<float> dy, dx(size_t(N * C));
  engine::LossResult lr;
  for (int64_t v = S - 1; v >= 0; --v) {
    const std::span<const float> x_in = v > 0 ? std::span<const float>(xs[size_t(v)]) : std::span<const float>();
    const engine::LossResult got_lr = stages[size_t(v % P)]->backward_stage(
        rmb, 0, 1, so, nll, x_in, dy, v > 0 ? std::span<float>(dx) : std::span<float>(), v / P);
    if (v == S - 1) lr = got_lr;
    dy = dx;
  }
  for (auto& e : stages) e->end_stage_step();
  EXPECT_NEAR(lr.loss, sr.loss, 1e-6 * std::fabs(sr.loss));
  std::vector<float> embed_sum;  // a tied embedding's two copies (stage 0's lookup, stage 1's head)
  for (int64_t s = 0; s < P; ++s) {
    const std::vector<std::vector<float>> g = grads(*stages[size_t(s)]);
    for (size_t j = 0; j < g.size(); ++j) {
      const size_t i = size_t(layouts[size_t(s)].full_index[j]);
      if (layouts[size_t(s)].shares_embedding && int64_t(j) == layouts[size_t(s)].embed_local) {
        if (embed_sum.empty()) embed_sum.assign(g[j].size(), 0.f);
        for (size_t k = 0; k < g[j].size(); ++k) embed_sum[k] += g[j][k];
        if (s == P - 1) {
          EXPECT_LE(rel(embed_sum, g_ref[i]), 1e-5) << m.desc.params[i].name << " (tied: both copies)";
        }
        continue;
      }
      EXPECT_LE(rel(g[j], g_ref[i]), 1e-5) << m.desc.params[i].name;
    }
  }
  const Engine::MoeValues v0 = stages[0]->stage_moe_values(), v1 = stages[1]->stage_moe_values();
  const auto metrics = engine::moe_step_metrics(o.moe, v0.aux + v1.aux, v0.z + v1.z, std::max(v0.max_load, v1.max_load));
  ASSERT_EQ(metrics.size(), 3u);
  for (const auto& [k, v] : metrics) EXPECT_NEAR(v, metric(sr, k), 1e-9 * std::fabs(metric(sr, k)) + 1e-12) << k;
}

TEST(MoeEngine, VirtualPipelineStagesRecordAndReplayTheirChunksColumns) {
  // Every chunk an MoE layer; rank 0's chunks are columns [0, 2) and [4, 6).
  check_virtual_stage_routing(four_layer_qwen3_moe(), "four-layer qwen3-moe");
  // Layer 2 dense: rank 0's second chunk records no column (route_count 0).
  check_virtual_stage_routing(model("qwen2-moe-tiny"), "qwen2-moe-tiny");
}

// The auxiliary losses alone (the callback's loss is 0): the engine's gradient g against the
// directional derivative of the reported losses along g, (L(w + h g) - L(w - h g)) / 2h = |g|^2,
// per parameter tensor, with the routing replayed so that the top-k cannot flip.
void check_aux_gradient(const std::string& name, EngineOptions o) {
  const Model& m = model(name);
  auto e = make(name, o);
  const Batch b = make_batch({14, 9, 21}, m.desc.vocab_size);
  engine::OutputRequest rec;
  rec.routed_experts = true;
  std::vector<int32_t> routes = e->forward(b.mb(), rec).routed_experts;
  std::vector<int64_t> shape = {int64_t(b.ids.size()), e->routing_width()}, strides = {shape[1], 1};
  rlh_named_tensor f{};
  f.name = "routes";
  f.tensor.data = routes.data();
  f.tensor.device = rlh_device{RLH_DEVICE_CPU, 0};
  f.tensor.ndim = 2;
  f.tensor.dtype = rlh_dtype{RLH_DTYPE_INT, 32, 1};
  f.tensor.shape = shape.data();
  f.tensor.strides = strides.data();
  MicroBatch mb = b.mb();
  mb.fields.push_back(f);
  engine::StepOptions so;
  so.global_tokens = predicted(b);
  so.apply_optimizer = false;
  so.outputs.replay_routing_field = "routes";
  auto objective = [&](engine::StepResult* r = nullptr) {
    const engine::StepResult s = e->train_step({&mb, 1}, so, no_loss);
    if (r) *r = s;
    double v = 0;
    for (const auto& [k, x] : s.metrics)
      if (k == "moe/aux_loss" || k == "moe/z_loss") v += x;
    return v;
  };
  engine::StepResult base;
  objective(&base);
  const auto g = grads(*e);
  const std::vector<std::vector<float>> w0 = e->save_parameters();
  int checked = 0;
  for (size_t i = 0; i < e->num_params(); ++i) {
    const sdk::ParamDesc& p = m.desc.params[i];
    // every router, and upstream of the first: layer 0's q and norm, the embedding
    const bool wanted = p.role == sdk::ParamRole::router ||
                        ((p.role == sdk::ParamRole::q || p.role == sdk::ParamRole::attn_norm) &&
                         p.layer == 0) ||
                        p.role == sdk::ParamRole::embed;
    if (!wanted) continue;
    double g2 = 0;
    for (float x : g[i]) g2 += double(x) * double(x);
    ASSERT_GT(g2, 0) << p.name << ": the auxiliary losses reach it";
    const double h = 1e-2 / std::sqrt(g2);
    double L[2];
    for (int sgn = 0; sgn < 2; ++sgn) {
      std::vector<std::vector<float>> w = w0;
      for (size_t j = 0; j < w[i].size(); ++j) w[i][j] += float((sgn ? -h : h) * g[i][j]);
      e->load_parameters(w);
      L[sgn] = objective();
    }
    e->load_parameters(w0);
    const double fd = (L[0] - L[1]) / (2 * h);
    EXPECT_NEAR(fd, g2, 2e-3 * g2) << p.name;
    ++checked;
  }
  EXPECT_GE(checked, 4);
}

TEST_P(MoeModel, AuxAndZLossGradientsMatchFiniteDifferences) {
  EngineOptions o;
  o.moe.load_balancing = MoeOptions::LoadBalancing::aux_loss;
  o.moe.aux_loss_coef = 0.1;
  o.moe.z_loss_coef = 0.01;
  if (sigmoid_scores(GetParam())) {  // Megatron's losses are defined on softmax scores: refused
    EXPECT_THROW(make(GetParam(), o), std::invalid_argument);
    return;
  }
  check_aux_gradient(GetParam(), o);
  o.moe.load_balancing = MoeOptions::LoadBalancing::seq_aux_loss;
  o.moe.z_loss_coef = 0;
  check_aux_gradient(GetParam(), o);
  o.moe.router_fp64 = true;
  o.moe.z_loss_coef = 0.02;
  check_aux_gradient(GetParam(), o);
}

// One sequence in one micro-batch: Megatron's aux_loss and seq_aux_loss are the same number.
TEST_P(MoeModel, AuxLossEqualsSeqAuxLossOnOneSequence) {
  if (sigmoid_scores(GetParam())) return;  // refused above
  const Batch b = make_batch({23}, model(GetParam()).desc.vocab_size);
  const MicroBatch mb = b.mb();
  engine::StepOptions so;
  so.global_tokens = predicted(b);
  so.apply_optimizer = false;
  double v[2];
  for (int t = 0; t < 2; ++t) {
    EngineOptions o;
    o.moe.load_balancing = t ? MoeOptions::LoadBalancing::seq_aux_loss : MoeOptions::LoadBalancing::aux_loss;
    o.moe.aux_loss_coef = 0.3;
    v[t] = metric(make(GetParam(), o)->train_step({&mb, 1}, so, nll), "moe/aux_loss");
  }
  EXPECT_GT(v[0], 0);
  EXPECT_NEAR(v[0], v[1], 1e-9 * v[0]);
}

// freeze_moe_router: no router gradient, no router update; every other gradient is unchanged
// (tokens still backpropagate through the routing weights).
TEST_P(MoeModel, FrozenRouter) {
  const Batch b = make_batch({12, 19}, model(GetParam()).desc.vocab_size);
  const MicroBatch mb = b.mb();
  engine::StepOptions so;
  so.global_tokens = predicted(b);
  so.apply_optimizer = false;
  auto live = make(GetParam());
  EngineOptions fo;
  fo.moe.freeze_router = true;
  auto frozen = make(GetParam(), fo);
  const engine::StepResult rl = live->train_step({&mb, 1}, so, nll);
  const engine::StepResult rf = frozen->train_step({&mb, 1}, so, nll);
  EXPECT_EQ(rl.loss, rf.loss);
  double router2 = 0;
  int routers = 0;
  for (size_t i = 0; i < live->num_params(); ++i) {
    const auto& p = live->desc().params[i];
    std::vector<float> gl(live->grad(i).begin(), live->grad(i).end());
    std::vector<float> gf(frozen->grad(i).begin(), frozen->grad(i).end());
    if (p.role == sdk::ParamRole::router) {
      ++routers;
      for (float x : gl) router2 += double(x) * x;
      EXPECT_EQ(gf, std::vector<float>(gf.size(), 0.f)) << p.name;
    } else {
      EXPECT_EQ(gf, gl) << p.name;
    }
  }
  ASSERT_GT(routers, 0);
  ASSERT_GT(router2, 0);
  // The norm leaves the router out. The squared norms are sums of ~1e5 float32
  // terms, so they agree only to a few float32 ulp of the total (~20, ulp 2e-6),
  // which on some CPUs is above 1e-4 of the router's share (8e-3): the bound adds
  // that rounding. Counting the router would still miss by router2 itself.
  const double total2 = rl.grad_norm * rl.grad_norm;
  EXPECT_NEAR(rf.grad_norm * rf.grad_norm, total2 - router2, 1e-4 * router2 + 1e-6 * total2);
  ASSERT_GT(router2, 10 * (1e-4 * router2 + 1e-6 * total2));
  // An optimizer step moves everything but the router.
  so.apply_optimizer = true;
  so.lr = 1e-2;
  const auto before = frozen->save_parameters();
  frozen->train_step({&mb, 1}, so, nll);
  const auto after = frozen->save_parameters();
  for (size_t i = 0; i < before.size(); ++i) {
    const auto role = frozen->desc().params[i].role;
    if (role == sdk::ParamRole::router) {
      EXPECT_EQ(after[i], before[i]) << frozen->desc().params[i].name;
    } else if (role == sdk::ParamRole::expert_gate || role == sdk::ParamRole::q) {
      EXPECT_NE(after[i], before[i]) << frozen->desc().params[i].name;
    }
  }
}

// The float64 router: the same model to float32 rounding, and it does run in float64.
TEST_P(MoeModel, Fp64RouterAgreesAndRunsInFloat64) {
  const Batch b = make_batch({16, 10}, model(GetParam()).desc.vocab_size);
  const MicroBatch mb = b.mb();
  engine::StepOptions so;
  so.global_tokens = predicted(b);
  so.apply_optimizer = false;
  auto f32 = make(GetParam());
  std::unique_ptr<engine::Ops> prof = engine::make_profiling_ops(test::cpu_ops());
  EngineOptions o;
  o.moe.router_fp64 = true;
  o.ops = prof.get();
  auto f64 = make(GetParam(), o);
  const engine::StepResult r32 = f32->train_step({&mb, 1}, so, nll);
  const engine::StepResult r64 = f64->train_step({&mb, 1}, so, nll);
  EXPECT_NEAR(r64.loss, r32.loss, 1e-6 * r32.loss);
  for (size_t i = 0; i < f32->num_params(); ++i) {
    std::vector<float> a(f64->grad(i).begin(), f64->grad(i).end());
    std::vector<float> c(f32->grad(i).begin(), f32->grad(i).end());
    EXPECT_LE(rel(a, c), 1e-4) << f32->desc().params[i].name;
  }
  const std::string report = engine::profiling_report(*prof);
  EXPECT_NE(report.find("moe_router_fwd_f64"), std::string::npos) << report;
  EXPECT_NE(report.find("moe_router_bwd_f64"), std::string::npos) << report;
  EXPECT_NE(report.find("gemm_f64"), std::string::npos) << report;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MoeModel,
                         ::testing::Values("qwen2-moe-tiny", "qwen2-moe-step2-tied-tiny",
                                           "deepseek-v3-tiny"),
                         [](const auto& info) {
                           std::string s;
                           for (char c : info.param) s += std::isalnum((unsigned char)c) ? c : '_';
                           return s;
                         });

// Peak memory of an MoE train step against the design (docs/engine.md, "Storage"): parameters,
// gradients, the dense part of each layer without its MLP, the MoE layer's saved set per token
// K (2C + 3Fe + 1) floats + E + 1 router scores + 2K ints (+ E + 1 offsets per layer), one MoE
// scratch set, plus the kernels' fixed workspace. The allowance is smaller than one dense
// per-expert [N, Fe] activation for all experts (what a padded, non-dropless layout would hold).
TEST(MoeEngine, PeakMemoryMatchesTheDesign) {
  const int64_t V = 8192, C = 512, L = 2, Hq = 8, Hkv = 2, D = 64, E = 8, K = 2, Fe = 1024, T = 1024;
  const nlohmann::json cfg = {
      {"architectures", {"MixtralForCausalLM"}}, {"vocab_size", V}, {"hidden_size", C},
      {"intermediate_size", Fe}, {"num_hidden_layers", L}, {"num_attention_heads", Hq},
      {"num_key_value_heads", Hkv}, {"head_dim", D}, {"num_local_experts", E},
      {"num_experts_per_tok", K}, {"max_position_embeddings", 4096}, {"rms_norm_eps", 1e-5},
      {"rope_theta", 10000.0}, {"tie_word_embeddings", false}, {"torch_dtype", "float32"}};
  constexpr int64_t kTile = int64_t(8) << 20;
  EngineOptions eo = test::engine_options();
  eo.logprob_chunk_bytes = kTile;
  Engine e(model::describe(cfg), eo);
  uint32_t x = 99;
  for (size_t i = 0; i < e.num_params(); ++i)
    for (float& v : e.param(i)) {
      x = x * 1664525u + 1013904223u;
      v = (e.desc().params[i].shape.size() == 1 ? 1.f : 0.f) + 0.05f * (float(x >> 8) / 16777216.f - 0.5f);
    }
  std::vector<int32_t> ids(static_cast<size_t>(T)), cu = {0, int32_t(T)};
  for (int64_t t = 0; t < T; ++t) ids[size_t(t)] = int32_t((t * 2654435761u) % uint32_t(V));
  MicroBatch mb;
  mb.input_ids = ids;
  mb.cu_seqlens = cu;
  engine::StepOptions so;
  so.global_tokens = T - 1;
  so.apply_optimizer = false;
  const double loss = e.train_step({&mb, 1}, so, nll).loss;
  const int64_t peak = int64_t(e.counting_allocator()->peak_bytes());

  const int64_t N = T, NK = N * K, W = (Hq + 2 * Hkv) * D, A = Hq * D;
  const int64_t P = e.num_elements();
  const int64_t dense_part = N * C + N + N * W + N * A + Hq * N + 2 * N * C + N;  // no MLP
  const int64_t moe_layer = NK * (2 * C + 3 * Fe + 1) + N * (E + 1);            // floats
  const int64_t moe_ints = 2 * NK + E + 1;
  const int64_t moe_scratch = N * E + NK + NK * C + NK * Fe + NK * 2 * Fe + 2 * N * E + N +
                              N * C + 2 * N;  // + shared-expert scratch of width 0
  const int64_t floats = (L + 1) * N * C + L * (dense_part + moe_layer) + N * C + N + 8 * N +
                         2 * N * C + N * W + N * A + 6 * N + moe_scratch;
  const int64_t ints = 2 * N + L * moe_ints + 2 * N;
  const int64_t designed = 2 * P * 4 + floats * 4 + ints * 4;
  const int64_t workspace = kTile + int64_t(omp_get_max_threads()) * 2 * 128 * 256 * 4 +
                            Hq * T * 4 + T * 5 * 4 + (1 << 20);
  std::printf("MoE %ld experts top-%ld, T=%ld: peak %.1f MiB, designed %.1f MiB + workspace %.1f "
              "MiB; [E, N, Fe] would be %.1f MiB\n",
              long(E), long(K), long(T), peak / 1048576.0, designed / 1048576.0,
              workspace / 1048576.0, E * N * Fe * 4 / 1048576.0);
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_GE(peak, designed) << "every designed buffer is really allocated";
  EXPECT_LE(peak, designed + workspace);
  EXPECT_LT(workspace, E * N * Fe * 4) << "the allowance must not fit a per-expert [N, Fe] set";
}

// What the engine refuses, by name.
TEST(MoeEngine, Refusals) {
  sdk::TransformerDesc d = model("qwen2-moe-tiny").desc;
  for (auto& l : d.layers)
    if (l.mlp.kind == sdk::MlpKind::moe) l.mlp.moe.scoring = sdk::MoeScoring::sigmoid;
  EngineOptions o = test::engine_options();
  o.moe.z_loss_coef = 1e-3;
  try {
    Engine e(d, o);
    ADD_FAILURE() << "sigmoid scores with a z-loss were accepted";
  } catch (const std::invalid_argument& ex) {
    EXPECT_NE(std::string(ex.what()).find("sigmoid"), std::string::npos) << ex.what();
  }
  Engine plain(d, test::engine_options());  // sigmoid scores without auxiliary losses run
  EXPECT_GT(plain.routing_width(), 0);
  sdk::TransformerDesc bad = model("qwen2-moe-tiny").desc;
  for (auto& l : bad.layers)
    if (l.mlp.kind == sdk::MlpKind::moe) l.mlp.moe.top_k = l.mlp.moe.num_experts + 1;
  EXPECT_THROW(Engine e(bad, test::engine_options()), std::invalid_argument);
}

}  // namespace
