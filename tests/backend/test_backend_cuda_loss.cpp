// The loss on the device (rlh_train_args.loss_on_device, BACKEND 0.4) on megatron's CUDA path
// (label gpu): the grpo plugin's LossAdapter, running kernels_cuda's clipped_pg_loss / nll_loss
// on the device tensors the backend hands it, against the same adapter on host tensors, from the
// same weights and batch:
//   - the step's loss within 1e-6 relative (the same fp32 outputs, fp64 loss math on both
//     sides), the gradient norm within 1e-5, every summed metric within 1e-6 and the extrema
//     (probs_ratio_min, ...) equal to the host's step_extrema() as float32;
//   - the device path really ran there: its extrema come back in the step's metrics JSON (the
//     host path keeps them in the adapter);
//   - configs: NeMo-RL's defaults (PPO ratio, k3 with clamps), dual clip with k1 and truncated
//     importance sampling under the sequence-level reduction, force_on_policy_ratio, and SFT's NLL.
// Without a usable Hopper GPU every test skips with the reason.
#include <cmath>

#include "backend_harness.hpp"
#include "gpu_skip.hpp"
#include "rlhost/grpo/loss_adapter.hpp"
#include "rlhost/grpo/packing.hpp"

using namespace rlh;
using namespace rlh::test;
using json = nlohmann::json;

namespace {

const Host& host() {
  static Host h({"model_llama", "kernels_cpu", "megatron"});
  return h;
}

json config() {
  return {{"precision", "bfloat16"},
          {"device", "cuda"},
          {"max_grad_norm", 1.0},
          {"megatron_cfg", {{"optimizer", {{"lr", 1e-3}, {"weight_decay", 0.1}}}}}};
}

// A GRPO batch (masked prompt tokens, one masked sample) with prev/generation/reference logprobs
// near the model's own.
struct GrpoBatch {
  std::unique_ptr<Batch> batch;
  grpo::ValidCounts counts;
};

GrpoBatch make_batch(const std::vector<float>& lp_of_model) {
  GrpoBatch g;
  g.batch = random_batch({9, 12, 6, 10, 31, 2}, 512, 21);
  Batch& b = *g.batch;
  const double adv[] = {0.7, -1.2, 0.4, 1.5, -0.3, 0.9};
  std::vector<float> tm, ad, prev, gen, ref;
  const std::vector<float> sm = {1, 1, 0, 1, 1, 1};
  for (int64_t s = 0; s < b.num_seqs(); ++s)
    for (int64_t t = b.offsets()[size_t(s)]; t < b.offsets()[size_t(s) + 1]; ++t) {
      const int64_t j = t - b.offsets()[size_t(s)];
      const bool first = j == 0;
      const float lp = lp_of_model.empty() ? -2.f : lp_of_model[size_t(t)];
      tm.push_back(j >= 3 && j != 5 ? 1.f : 0.f);
      ad.push_back(float(adv[s]));
      prev.push_back(first ? 0.f : lp + 0.05f * float((t % 7) - 3));
      gen.push_back(first ? 0.f : lp + 0.03f * float((t % 5) - 2));
      ref.push_back(first ? 0.f : lp - 0.04f * float((t % 3) - 1));
    }
  b.add_f32("advantages", ad);
  b.add_f32("prev_logprobs", prev);
  b.add_f32("generation_logprobs", gen);
  b.add_f32("reference_policy_logprobs", ref);
  b.add_f32("token_mask", tm);
  b.add_f32("sample_mask", sm);
  std::vector<double> tmd(tm.begin(), tm.end()), smd(sm.begin(), sm.end());
  const grpo::Packing p{b.num_tokens(), b.num_seqs(), b.offsets().data()};
  g.counts = grpo::valid_counts(p, tmd.data(), smd.data());
  return g;
}

struct Run {
  json metrics;
  grpo::Metrics extrema;
};

// One train step of a fresh llama-tiny on the GPU with `cfg`'s loss, on host or device tensors.
Run step(const grpo::LossAdapter::Config& cfg, bool on_device) {
  Backend be(host(), "megatron", config());
  rlh_model* m = be.load(fixtures_root() + "/llama-tiny", true);
  auto probe = random_batch({9, 12, 6, 10, 31, 2}, 512, 21);
  GrpoBatch g = make_batch(be.logprobs(m, *probe));
  grpo::LossAdapter a(cfg);
  Backend::TrainOptions o;
  o.micro_batch_seqs = 2;
  o.specs = a.output_specs(1.0, 0, 1.0);
  if (on_device) {
    a.enable_device_loss(sdk::Host(host().services()), R"({"verify": false})");
    std::string why;
    EXPECT_TRUE(a.device_loss_supported(sdk::cuda_device(0), o.specs, &why)) << why;
    o.loss_on_device = true;
  }
  o.raw_fn = a.fn();
  o.raw_user = a.user();
  const auto r = be.train(m, *g.batch, int64_t(g.counts.tokens), int64_t(g.counts.seqs), nullptr, o);
  return Run{r.metrics, a.step_extrema()};
}

void expect_close(double device, double host_value, double rel, const std::string& what) {
  EXPECT_LE(std::fabs(device - host_value), rel * std::fabs(host_value) + 1e-9) << what << ": device " << device
                                                                                << ", host " << host_value;
}

void compare(const grpo::LossAdapter::Config& cfg, const char* label) {
  SCOPED_TRACE(label);
  const Run h = step(cfg, false), d = step(cfg, true);
  expect_close(d.metrics["loss"].get<double>(), h.metrics["loss"].get<double>(), 1e-6, "loss");
  expect_close(d.metrics["grad_norm"].get<double>(), h.metrics["grad_norm"].get<double>(), 1e-5, "grad_norm");
  const json &hm = h.metrics["metrics"], &dm = d.metrics["metrics"];
  for (const auto& [k, v] : hm.items()) {
    ASSERT_TRUE(dm.contains(k)) << k << " is missing from the device loss's metrics";
    expect_close(dm[k].get<double>(), v.get<double>(), 1e-6, k);
  }
  for (const grpo::Metric& e : h.extrema.items()) {
    ASSERT_TRUE(dm.contains(e.name)) << e.name << ": the device loss reports extrema in the step's metrics";
    EXPECT_EQ(float(dm[e.name].get<double>()), float(e.value)) << e.name;
  }
  EXPECT_TRUE(d.extrema.items().empty()) << "the device path keeps no host extrema";
  std::printf("  %s: loss host %.9g device %.9g, %zu metrics\n", label, h.metrics["loss"].get<double>(),
              d.metrics["loss"].get<double>(), hm.size());
}

TEST(BackendCudaLoss, ClippedPgOnTheDeviceEqualsTheHostLoss) {
  REQUIRE_GPU();
  grpo::ClippedPGConfig c;
  compare(c, "defaults (ppo, k3 with clamps)");
  c = grpo::ClippedPGConfig{};
  c.ratio_clip_c = 3.0;
  c.reference_policy_kl_type = grpo::KlType::kK1;
  c.use_importance_sampling_correction = true;
  c.truncated_importance_sampling_type = grpo::TruncatedIsType::kTis;
  c.truncated_importance_sampling_ratio = 1.05;
  c.token_level_loss = false;
  compare(c, "dual clip, k1, tis, sequence-level");
  c = grpo::ClippedPGConfig{};
  c.force_on_policy_ratio = true;
  compare(c, "force_on_policy_ratio");
}

TEST(BackendCudaLoss, NllOnTheDeviceEqualsTheHostLoss) {
  REQUIRE_GPU();
  compare(grpo::NllConfig{}, "nll");
}

// An option the device op lacks (GSPO) is answered at setup: the loss stays on the host.
TEST(BackendCudaLoss, UnofferedOptionsKeepTheHostLoss) {
  REQUIRE_GPU();
  grpo::ClippedPGConfig c;
  c.sequence_level_importance_ratios = true;
  c.token_level_loss = false;
  grpo::LossAdapter a(c);
  a.enable_device_loss(sdk::Host(host().services()), R"({"verify": false})");
  std::string why;
  EXPECT_FALSE(a.device_loss_supported(sdk::cuda_device(0), a.output_specs(1.0, 0, 1.0), &why));
  EXPECT_NE(why.find("sequence_level_importance_ratios"), std::string::npos) << why;
}

}  // namespace
