// The GRPO loss adapter (rlh_grpo_core's LossAdapter, the rlh_loss_fn the GRPO algorithm hands a
// backend) as the loss callback of a backend plugin's train step (llama-tiny):
//  - the step's loss equals the adapter's loss computed directly on the forward's outputs, with
//    several micro-batches summing to the whole batch;
//  - gradients come back token-aligned: 0 at the first token of every sequence and wherever the
//    token or sample mask is 0;
//  - on-policy (prev = generation logprobs = the forward's, computed in the step's micro-batches),
//    every probability ratio is exactly 1 and the gradient at token t is -advantage * mask / G_tok.
#include "backend_harness.hpp"
#include "rlhost/grpo/loss_adapter.hpp"
#include "rlhost/grpo/packing.hpp"

using namespace rlh;
using namespace rlh::test;

namespace {

const Host& host() {
  static Host h({"model_llama", "kernels_cpu", "dtensor", "megatron"});
  return h;
}

std::string llama_tiny() { return fixtures_root() + "/llama-tiny"; }

// A GRPO batch: prompts of 3 tokens, responses after them (one response token masked out, as
// tool output would be), a sequence with sample_mask 0, per-sequence advantages on every token.
struct GrpoBatch {
  std::unique_ptr<Batch> batch;
  std::vector<double> token_mask, advantages, sample_mask;
  grpo::ValidCounts counts;
};

GrpoBatch make_batch() {
  GrpoBatch g;
  g.batch = random_batch({9, 12, 6, 10}, 512, 21);
  const Batch& b = *g.batch;
  const double adv[] = {0.7, -1.2, 0.4, 1.5};
  g.sample_mask = {1, 1, 0, 1};
  for (int64_t s = 0; s < b.num_seqs(); ++s)
    for (int64_t t = b.offsets()[size_t(s)]; t < b.offsets()[size_t(s) + 1]; ++t) {
      const int64_t j = t - b.offsets()[size_t(s)];
      g.token_mask.push_back(j >= 3 && j != 5 ? 1.0 : 0.0);
      g.advantages.push_back(adv[s]);
    }
  const grpo::Packing p{b.num_tokens(), b.num_seqs(), b.offsets().data()};
  g.counts = grpo::valid_counts(p, g.token_mask.data(), g.sample_mask.data());
  return g;
}

std::vector<float> to_f32(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

// The fields the ClippedPG loss reads, token-aligned; prev/generation/reference logprobs are the
// forward's plus the given per-token offsets (0 at position 0, where logprobs are 0).
void add_fields(GrpoBatch& g, const std::vector<float>& lp, const std::vector<double>& d_prev,
                const std::vector<double>& d_gen, const std::vector<double>& d_ref) {
  std::vector<float> prev, gen, ref;
  const auto& off = g.batch->offsets();
  for (int64_t s = 0; s + 1 < int64_t(off.size()); ++s)
    for (int64_t t = off[size_t(s)]; t < off[size_t(s) + 1]; ++t) {
      const bool first = t == off[size_t(s)];
      prev.push_back(first ? 0.0f : float(lp[size_t(t)] + d_prev[size_t(t)]));
      gen.push_back(first ? 0.0f : float(lp[size_t(t)] + d_gen[size_t(t)]));
      ref.push_back(first ? 0.0f : float(lp[size_t(t)] + d_ref[size_t(t)]));
    }
  g.batch->add_f32("advantages", to_f32(g.advantages));
  g.batch->add_f32("prev_logprobs", prev);
  g.batch->add_f32("generation_logprobs", gen);
  g.batch->add_f32("reference_policy_logprobs", ref);
  g.batch->add_f32("token_mask", to_f32(g.token_mask));
  g.batch->add_f32("sample_mask", to_f32(g.sample_mask));
}

// The adapter's loss on the whole batch, with `lp` as its (token-aligned) logprobs output; also
// returns the gradient it writes.
double adapter_loss(grpo::LossAdapter& adapter, Batch& batch, const grpo::ValidCounts& counts,
                    std::vector<float> lp, std::vector<float>* grad = nullptr) {
  std::vector<float> g(lp.size(), 0.0f);
  float loss = 0;
  int64_t n = batch.num_tokens(), stride = 1;
  auto view = [&](float* p, int ndim) {
    rlh_tensor t{};
    t.data = p;
    t.device = rlh_device{RLH_DEVICE_CPU, 0};
    t.ndim = ndim;
    t.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
    t.shape = &n;
    t.strides = &stride;
    return t;
  };
  const rlh_named_tensor out{"logprobs", view(lp.data(), 1)};
  const rlh_tensor grad_t = view(g.data(), 1), loss_t = view(&loss, 0);
  rlh_microbatch mb{};
  mb.struct_size = RLH_STRUCT_SIZE(rlh_microbatch, metric_ctx);
  mb.batch = batch.raw();
  mb.outputs = &out;
  mb.num_outputs = 1;
  mb.grads = &grad_t;
  mb.loss = &loss_t;
  mb.global_num_tokens = int64_t(counts.tokens);
  mb.global_num_seqs = int64_t(counts.seqs);
  adapter.run(mb);
  if (grad != nullptr) *grad = g;
  return loss;
}

// The adapter as the backend's callback, checking each micro-batch's gradient layout after it ran.
struct CheckedAdapter {
  grpo::LossAdapter& adapter;
  std::vector<std::pair<int64_t, float>> grads;  // (tok_index, gradient) for every token seen

  static rlh_status* fn(void* user, const rlh_microbatch* mb) {
    auto* self = static_cast<CheckedAdapter*>(user);
    rlh_status* s = grpo::LossAdapter::callback(self->adapter.user(), mb);
    if (s != nullptr) return s;
    const rlh_batch& b = *mb->batch;
    const float* g = static_cast<const float*>(mb->grads[0].data);
    const double* tok_index = nullptr;
    const float *tm = nullptr, *sm = nullptr;
    for (size_t i = 0; i < b.num_fields; ++i) {
      const std::string name = b.fields[i].name;
      if (name == "tok_index") tok_index = static_cast<const double*>(b.fields[i].tensor.data);
      if (name == "token_mask") tm = static_cast<const float*>(b.fields[i].tensor.data);
      if (name == "sample_mask") sm = static_cast<const float*>(b.fields[i].tensor.data);
    }
    for (int64_t s2 = 0; s2 < b.num_seqs; ++s2)
      for (int64_t t = b.seq_offsets[s2]; t < b.seq_offsets[s2 + 1]; ++t) {
        if (t == b.seq_offsets[s2]) {
          EXPECT_EQ(g[t], 0.0f) << "gradient at the first token of a sequence";
        }
        if (tm[t] == 0 || sm[s2] == 0) {
          EXPECT_EQ(g[t], 0.0f) << "gradient where the mask is 0";
        } else {
          EXPECT_NE(g[t], 0.0f) << "no gradient where the loss counts the token";
        }
        self->grads.emplace_back(int64_t(tok_index[t]), g[t]);
      }
    return nullptr;
  }
};

class GrpoThroughBackend : public ::testing::TestWithParam<std::string> {};

TEST_P(GrpoThroughBackend, StepLossEqualsTheAdaptersLossOnTheForwardOutputs) {
  Backend be(host(), GetParam().c_str());
  rlh_model* m = be.load(llama_tiny(), true);
  GrpoBatch g = make_batch();
  const std::vector<float> lp = be.logprobs(m, *g.batch);
  // Off-policy enough that some ratios leave [0.8, 1.2] (clipping active) and the KL is not 0.
  std::vector<double> d_prev, d_gen, d_ref;
  for (int64_t t = 0; t < g.batch->num_tokens(); ++t) {
    d_prev.push_back(0.3 * std::sin(1.7 * double(t)));
    d_gen.push_back(d_prev.back() + 0.05 * std::cos(double(t)));
    d_ref.push_back(0.2 * std::cos(0.9 * double(t)));
  }
  add_fields(g, lp, d_prev, d_gen, d_ref);
  std::vector<double> tok_index(size_t(g.batch->num_tokens()));
  for (size_t t = 0; t < tok_index.size(); ++t) tok_index[t] = double(t);
  g.batch->add("tok_index", tok_index, {RLH_DTYPE_FLOAT, 64, 1});

  grpo::LossAdapter reference{grpo::ClippedPGConfig{}};
  const double want = adapter_loss(reference, *g.batch, g.counts, lp);

  grpo::LossAdapter adapter{grpo::ClippedPGConfig{}};
  CheckedAdapter checked{adapter, {}};
  const std::vector<rlh_output_spec> specs = adapter.output_specs(1.0, 0, 1.0);
  rlh_train_args a{};
  a.struct_size = RLH_STRUCT_SIZE(rlh_train_args, reserved0);
  a.batch = g.batch->raw();
  a.specs = specs.data();
  a.num_outputs = specs.size();
  a.loss_fn = &CheckedAdapter::fn;
  a.loss_user = &checked;
  a.global_num_tokens = int64_t(g.counts.tokens);
  a.global_num_seqs = int64_t(g.counts.seqs);
  a.micro_batch_seqs = 2;
  a.learning_rate = -1;
  rlh_train_result r{};
  r.struct_size = RLH_STRUCT_SIZE(rlh_train_result, num_micro_batches);
  sdk::check(be.api()->train_step(be.raw(), m, &a, &r));
  EXPECT_EQ(r.num_micro_batches, 2);
  // The step's forward runs micro-batches of 2 sequences, the reference's logprobs the whole batch:
  // OpenBLAS picks its kernels by shape, so the two differ in their last bits (1.03e-6 relative
  // under its Haswell kernels, which an AVX2 machine gets; within 1e-6 under SkylakeX's).
  EXPECT_NEAR(r.loss, want, 1e-5 * std::fabs(want));
  EXPECT_NE(want, 0.0);
  EXPECT_GT(r.grad_norm, 0.0);
  const auto ratio_max = adapter.step_extrema().get("probs_ratio_max");
  ASSERT_TRUE(ratio_max.has_value());
  EXPECT_GT(*ratio_max, 1.2) << "the case exercises clipping";
  EXPECT_EQ(checked.grads.size(), size_t(g.batch->num_tokens()));
}

TEST_P(GrpoThroughBackend, OnPolicyRatiosAreOneAndGradientsAreMinusAdvantage) {
  Backend be(host(), GetParam().c_str());
  rlh_model* m = be.load(llama_tiny(), true);
  GrpoBatch g = make_batch();
  // One sequence per forward pass, as in the step below (micro_batch_seqs 1): the same passes
  // give bitwise the same logprobs, so prev_logprobs are exactly the step's.
  const std::vector<float> lp = be.logprobs(m, *g.batch, 1.0, 1);
  const std::vector<double> zero(size_t(g.batch->num_tokens()), 0.0);
  add_fields(g, lp, zero, zero, zero);
  std::vector<double> tok_index(size_t(g.batch->num_tokens()));
  for (size_t t = 0; t < tok_index.size(); ++t) tok_index[t] = double(t);
  g.batch->add("tok_index", tok_index, {RLH_DTYPE_FLOAT, 64, 1});

  grpo::ClippedPGConfig cfg;
  cfg.reference_policy_kl_penalty = 0;  // the surrogate alone
  grpo::LossAdapter adapter{cfg};
  CheckedAdapter checked{adapter, {}};
  Backend::TrainOptions o;
  o.micro_batch_seqs = 1;
  o.eval_only = true;
  o.specs = adapter.output_specs(1.0, 0, 1.0);
  rlh_train_args a{};
  a.struct_size = RLH_STRUCT_SIZE(rlh_train_args, reserved0);
  a.batch = g.batch->raw();
  a.specs = o.specs.data();
  a.num_outputs = o.specs.size();
  a.loss_fn = &CheckedAdapter::fn;
  a.loss_user = &checked;
  a.global_num_tokens = int64_t(g.counts.tokens);
  a.global_num_seqs = int64_t(g.counts.seqs);
  a.micro_batch_seqs = 1;
  a.eval_only = 1;
  rlh_train_result r{};
  r.struct_size = RLH_STRUCT_SIZE(rlh_train_result, num_micro_batches);
  sdk::check(be.api()->train_step(be.raw(), m, &a, &r));
  EXPECT_EQ(*adapter.step_extrema().get("probs_ratio_min"), 1.0);
  EXPECT_EQ(*adapter.step_extrema().get("probs_ratio_max"), 1.0);
  // Token-level ClippedPG at ratio 1: d loss / d lp[t] = -A * token_mask[t] * sample_mask / G,
  // with NeMo-RL's masked_mean denominator G + 1e-8.
  const auto& off = g.batch->offsets();
  ASSERT_EQ(checked.grads.size(), size_t(g.batch->num_tokens()));
  for (const auto& [t, grad] : checked.grads) {
    int64_t s = 0;
    while (off[size_t(s) + 1] <= t) ++s;
    const double want = -g.advantages[size_t(t)] * g.token_mask[size_t(t)] * g.sample_mask[size_t(s)] / (g.counts.tokens + 1e-8);
    EXPECT_EQ(grad, float(want)) << "token " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, GrpoThroughBackend, ::testing::Values("dtensor", "megatron"));

}  // namespace
