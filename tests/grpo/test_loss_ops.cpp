// The registry's loss ops (clipped_pg_loss, nll_loss; docs/ops.md) against the grpo plugin's host
// loss callback on the same micro-batch: kernels_cpu's reference op, loaded from the build's
// plugin folder and called through the C ABI with the attributes rlhost/losses/loss_ops.hpp maps
// a config to, must give the callback's loss, gradients and metrics bit for bit (both run the SDK
// loss library in fp64 and round to the same float32 tensors). Configs: PPO with the KL clamps,
// dual clip with k1 and truncated IS under the sequence-level reduction, icepop with k2 and the
// on-policy KL, seq-mask-tis, force_on_policy_ratio, disable_ppo_ratio, CISPO, GSPO and the
// positive-example NLL, on packed sequences (one of a single token) with masked tokens and a
// masked sample.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "rlhost/grpo/loss_adapter.hpp"
#include "rlhost/host.h"
#include "rlhost/losses/loss_ops.hpp"
#include "rlhost/kernels.h"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/plugin.hpp"

namespace {

using namespace rlh;
using grpo::ClippedPGConfig;
using grpo::LossAdapter;

class PluginHost {
 public:
  PluginHost() {
    sdk::check(rlhost_create(&h_), "rlhost_create");
    rlhost_set_log_level(h_, RLH_LOG_WARN);
    sdk::check(rlhost_add_plugin_dir(h_, RLH_PLUGIN_DIR));
  }
  ~PluginHost() { rlhost_destroy(h_); }
  sdk::Host host() const { return sdk::Host(rlhost_services(h_)); }

 private:
  rlhost_t* h_ = nullptr;
};

// One packed micro-batch of float32 tensors, token-aligned (position 0 of a sequence: no
// prediction), as a CPU backend hands it to the callback.
struct Batch {
  std::vector<int64_t> offsets = {0, 7, 8, 20, 33};
  std::vector<int32_t> cu, ids;
  int64_t N = 33, S = 4;
  std::map<std::string, std::vector<float>> f;  // fields and the "logprobs" output
  int64_t g_tok = 19, g_seq = 3;

  explicit Batch(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 0.4f);
    std::uniform_real_distribution<float> u(0.f, 1.f);
    for (int64_t o : offsets) cu.push_back(int32_t(o));
    ids.assign(size_t(N), 1);
    for (const char* k : {"logprobs", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs"}) {
      auto& v = f[k];
      for (int64_t t = 0; t < N; ++t) v.push_back(-0.9f + nd(rng));
    }
    for (int64_t t = 0; t < N; ++t) f["advantages"].push_back(2 * nd(rng));
    for (int64_t t = 0; t < N; ++t) f["token_mask"].push_back(u(rng) < 0.8f ? 1.f : 0.f);
    f["sample_mask"] = {1.f, 1.f, 0.f, 1.f};
    f["rewards"] = {1.f, 0.f, 1.f, 0.5f};
    for (int64_t i = 0; i < S; ++i) {  // token-aligned outputs and fields: 0 at a sequence's start
      for (const char* k : {"logprobs", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs"})
        f[k][size_t(offsets[size_t(i)])] = 0.f;
    }
  }
  sdk::Tensor view(const std::string& k) {
    auto& v = f.at(k);
    return sdk::Tensor(v.data(), {int64_t(v.size())});
  }
};

struct Result {
  float loss = 0;
  std::vector<float> grad;
  std::map<std::string, double> metrics;  // sums, then extrema
};

// The grpo callback on the batch; with `op_host`, through its device-loss path (the kernel op,
// resolved through that host's providers) on these host tensors.
Result host_loss(LossAdapter::Config cfg, Batch& b, const sdk::Host* op_host = nullptr) {
  LossAdapter a(std::move(cfg));
  if (op_host != nullptr) a.enable_device_loss(*op_host, "{}", true);
  std::vector<std::string> names;
  std::vector<sdk::Tensor> views;
  views.reserve(16);
  std::vector<rlh_named_tensor> fields;
  for (auto& [k, v] : b.f) {
    if (k == "logprobs") continue;
    views.push_back(b.view(k));
    fields.push_back(rlh_named_tensor{k.c_str(), views.back().raw()});
  }
  Result r;
  r.grad.assign(size_t(b.N), 0.f);
  views.push_back(b.view("logprobs"));
  rlh_named_tensor out{"logprobs", views.back().raw()};
  views.push_back(sdk::Tensor(r.grad.data(), {b.N}));
  rlh_tensor grad = views.back().raw();
  views.push_back(sdk::Tensor(&r.loss, {}));
  rlh_tensor loss = views.back().raw();
  rlh_batch batch{};
  batch.struct_size = sizeof(rlh_batch);
  batch.num_tokens = b.N;
  batch.num_seqs = b.S;
  batch.token_ids = b.ids.data();
  batch.seq_offsets = b.offsets.data();
  batch.fields = fields.data();
  batch.num_fields = fields.size();
  rlh_microbatch mb{};
  mb.struct_size = RLH_STRUCT_SIZE(rlh_microbatch, metric_ctx);
  mb.batch = &batch;
  mb.outputs = &out;
  mb.num_outputs = 1;
  mb.grads = &grad;
  mb.loss = &loss;
  mb.global_num_tokens = b.g_tok;
  mb.global_num_seqs = b.g_seq;
  mb.metric = [](void* ctx, const char* name, double v) { (*static_cast<std::map<std::string, double>*>(ctx))[name] += v; };
  mb.metric_ctx = &r.metrics;
  a.run(mb);
  const grpo::Metrics extrema = a.step_extrema();  // a copy: items() of a temporary would dangle
  for (const grpo::Metric& m : extrema.items()) r.metrics[m.name] = m.value;
  return r;
}

Result op_loss(const sdk::KernelRegistry& reg, const char* name, const std::vector<rlh_named_value>& attrs,
               Batch& b, std::vector<std::string> inputs, size_t num_metrics) {
  Result r;
  r.grad.assign(size_t(b.N), 0.f);
  std::vector<float> metrics(num_metrics, -1.f);
  std::vector<rlh_tensor> in;
  std::vector<sdk::Tensor> keep;
  keep.reserve(16);
  for (const std::string& k : inputs) {
    keep.push_back(k == "cu_seqlens" ? sdk::Tensor(b.cu.data(), {b.S + 1}, sdk::kI32) : b.view(k));
    in.push_back(keep.back().raw());
  }
  keep.push_back(sdk::Tensor(&r.loss, {1}));
  keep.push_back(sdk::Tensor(r.grad.data(), {b.N}));
  keep.push_back(sdk::Tensor(metrics.data(), {int64_t(num_metrics)}));
  const std::vector<rlh_tensor> out = {keep[keep.size() - 3].raw(), keep[keep.size() - 2].raw(), keep.back().raw()};
  const sdk::Op op = reg.resolve(name, sdk::kCPU, in, out, attrs);
  op.run(in, out, attrs);
  const auto& table = std::string(name) == "nll_loss" ? std::span<const losses::OpMetric>(losses::kNllMetrics)
                                                      : std::span<const losses::OpMetric>(losses::kClippedPgMetrics);
  for (size_t i = 0; i < num_metrics; ++i) r.metrics[table[i].name] = metrics[i];
  return r;
}

void expect_same(const Result& host, const Result& op, const std::vector<std::string>& metric_names) {
  EXPECT_EQ(host.loss, op.loss);
  ASSERT_EQ(host.grad.size(), op.grad.size());
  for (size_t t = 0; t < host.grad.size(); ++t) EXPECT_EQ(host.grad[t], op.grad[t]) << "dlogprobs[" << t << "]";
  for (const std::string& n : metric_names) {
    ASSERT_TRUE(host.metrics.count(n)) << n;
    EXPECT_EQ(float(host.metrics.at(n)), op.metrics.at(n)) << n;
  }
}

class LossOps : public ::testing::Test {
 protected:
  void SetUp() override {
    const sdk::Host host = ph_.host();
    std::string listing;  // listing the kernel providers loads the plugin path's
    sdk::check(host.api()->list_components(host.api()->ctx, RLH_KIND_KERNELS, sdk::write_to_string, &listing));
    const auto* api = host.find<rlh_kernels_api>(RLH_KIND_KERNELS, "kernels_cpu", RLH_STRUCT_SIZE(rlh_kernels_api, release_op));
    ASSERT_NE(api, nullptr) << "kernels_cpu not found on " << RLH_PLUGIN_DIR;
    reg_.add("kernels_cpu", api, host.api(), sdk::kCPU);
  }
  PluginHost ph_;
  sdk::KernelRegistry reg_;
};

struct PgCase {
  const char* label;
  ClippedPGConfig cfg;
};

std::vector<PgCase> pg_cases() {
  std::vector<PgCase> v;
  ClippedPGConfig c;  // NeMo-RL's defaults: PPO ratio, k3 with both clamps, token-level
  c.reference_policy_kl_penalty = 0.05;
  c.kl_input_clamp_value = 0.4;
  c.kl_output_clamp_value = 0.05;
  v.push_back({"ppo k3 clamps", c});
  c = ClippedPGConfig{};
  c.ratio_clip_min = 0.1;
  c.ratio_clip_max = 0.28;
  c.ratio_clip_c = 1.5;
  c.reference_policy_kl_type = losses::KlType::kK1;
  c.use_importance_sampling_correction = true;
  c.truncated_importance_sampling_type = losses::TruncatedIsType::kTis;
  c.truncated_importance_sampling_ratio = 1.2;
  c.token_level_loss = false;
  v.push_back({"dual clip k1 tis sequence-level", c});
  c = ClippedPGConfig{};
  c.reference_policy_kl_penalty = 0.1;
  c.reference_policy_kl_type = losses::KlType::kK2;
  c.kl_input_clamp_value.reset();
  c.kl_output_clamp_value.reset();
  c.use_on_policy_kl_approximation = true;
  c.use_importance_sampling_correction = true;
  c.truncated_importance_sampling_type = losses::TruncatedIsType::kIcePop;
  c.truncated_importance_sampling_ratio = 1.3;
  c.truncated_importance_sampling_ratio_min = 0.7;
  v.push_back({"icepop k2 on-policy kl", c});
  c = ClippedPGConfig{};
  c.use_kl_in_reward = true;
  c.use_importance_sampling_correction = true;
  c.truncated_importance_sampling_type = losses::TruncatedIsType::kSeqMaskTis;
  c.truncated_importance_sampling_ratio = 1.1;
  c.truncated_importance_sampling_ratio_min = 0.9;
  c.constant_normalizer = 6;
  v.push_back({"seq-mask-tis constant_normalizer", c});
  c = ClippedPGConfig{};
  c.force_on_policy_ratio = true;
  v.push_back({"force_on_policy_ratio", c});
  c = ClippedPGConfig{};
  c.disable_ppo_ratio = true;
  v.push_back({"disable_ppo_ratio", c});
  c = ClippedPGConfig{};
  c.use_cispo = true;
  v.push_back({"cispo", c});
  c = ClippedPGConfig{};
  c.sequence_level_importance_ratios = true;
  c.token_level_loss = false;
  c.use_importance_sampling_correction = true;
  v.push_back({"gspo", c});
  c = ClippedPGConfig{};
  c.positive_example_nll_weight = 0.3;
  v.push_back({"positive-example nll", c});
  return v;
}

TEST_F(LossOps, ClippedPgReferenceOpEqualsHostCallback) {
  uint32_t seed = 7;
  for (const PgCase& pc : pg_cases()) {
    SCOPED_TRACE(pc.label);
    Batch b(seed++);
    const Result host = host_loss(pc.cfg, b);
    losses::LossCounts n{double(b.g_tok), double(b.g_seq), 0};
    const std::vector<rlh_named_value> attrs = losses::clipped_pg_attrs(pc.cfg, n);
    const Result op = op_loss(reg_, "clipped_pg_loss", attrs, b,
                              {"logprobs", "advantages", "generation_logprobs", "token_mask", "sample_mask", "cu_seqlens",
                               "prev_logprobs", "reference_policy_logprobs", "rewards"},
                              losses::kClippedPgMetricCount);
    std::vector<std::string> names;
    for (size_t i = 0; i < losses::kClippedPgMetricCount; ++i)
      if (losses::clipped_pg_metric_reported(pc.cfg, i)) names.push_back(losses::kClippedPgMetrics[i].name);
    expect_same(host, op, names);
    // The host callback reports nothing the table lacks.
    for (const auto& [name, v] : host.metrics) EXPECT_TRUE(op.metrics.count(name)) << name;
    // The callback's device-loss path (the op on the micro-batch's tensors) gives the same.
    const sdk::Host h = ph_.host();
    Result via_op = host_loss(pc.cfg, b, &h);
    for (auto& [name, v] : via_op.metrics) via_op.metrics[name] = float(v);
    expect_same(host, via_op, names);
  }
}

TEST_F(LossOps, NllReferenceOpEqualsHostCallback) {
  Batch b(3);
  const Result host = host_loss(grpo::NllConfig{}, b);
  const Result op = op_loss(reg_, "nll_loss", losses::nll_attrs({double(b.g_tok), 0, 0}), b,
                            {"logprobs", "token_mask", "sample_mask", "cu_seqlens"}, losses::kNllMetricCount);
  expect_same(host, op, {"loss", "num_unmasked_tokens", "num_valid_samples"});
}

TEST_F(LossOps, BadAttributesNameTheKey) {
  Batch b(1);
  ClippedPGConfig c;
  std::vector<rlh_named_value> attrs = losses::clipped_pg_attrs(c, {double(b.g_tok), double(b.g_seq), 0});
  for (rlh_named_value& a : attrs)
    if (std::string(a.name) == "ratio_clip_c") a.double_value = 0.5;  // must exceed 1
  try {
    op_loss(reg_, "clipped_pg_loss", attrs, b,
            {"logprobs", "advantages", "generation_logprobs", "token_mask", "sample_mask", "cu_seqlens",
             "prev_logprobs", "reference_policy_logprobs"},
            losses::kClippedPgMetricCount);
    FAIL() << "a dual clip of 0.5 was accepted";
  } catch (const sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("ratio_clip_c"), std::string::npos) << e.what();
  }
}

}  // namespace
