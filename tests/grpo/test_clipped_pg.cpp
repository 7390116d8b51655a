// ClippedPGLossFn variants against the float64 reference: loss value, every metric, and the
// gradient against finite differences of the reference (stop-gradients held fixed).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "reference.hpp"
#include "test_util.hpp"

namespace rlh::grpo::test {
namespace {

struct Variant {
  std::string name;
  std::function<void(ClippedPGConfig&)> configure;
  std::function<void(GenOptions&)> generate = [](GenOptions&) {};
  std::function<void(Case&)> adjust = [](Case&) {};
  bool unfiltered = false;  // a separate unfiltered-logprob output for the KL
};

// Log-ratio kinks of a config's clip interval (and dual clip).
std::vector<double> kinks_of(const ClippedPGConfig& c) {
  std::vector<double> k = {std::log(1 - c.ratio_clip_min), std::log(1 + c.ratio_clip_max)};
  if (c.ratio_clip_c) k.push_back(std::log(*c.ratio_clip_c));
  return k;
}

// Some reference logprobs far from the policy: the KL input clamp (|logr| > 20) and output clamp
// (estimate > 10) both engage, away from their kinks.
void add_kl_offsets(Case& c, const std::vector<double>& offsets) {
  size_t k = 0;
  for (size_t b = 0; b < c.batch.seqs.size(); ++b) {
    RefSeq& s = c.batch.seqs[b];
    for (size_t j = 0; j + 1 < s.length(); ++j) {
      if (s.token_mask[j + 1] == 0 || s.sample_mask == 0) continue;
      if ((j + b) % 3 == 0 && k < 10) {
        // The on-policy weight exp(lp - gen) is 1 here, so weight * estimate stays clear of the
        // output clamp's kink.
        s.ref[j + 1] = c.lp[b][j] + offsets[k++ % offsets.size()];
        s.gen[j + 1] = c.lp[b][j];
      }
    }
  }
}

void add_kl_extremes(Case& c) { add_kl_offsets(c, {25.0, -25.0, 3.0, -12.0, 5.0}); }

// GSPO: keep each sequence's mean log-ratio away from the clip bounds.
void fix_gspo_kinks(Case& c, const ClippedPGConfig& cfg) {
  const double lo = std::log(1 - cfg.ratio_clip_min), hi = std::log(1 + cfg.ratio_clip_max);
  for (size_t b = 0; b < c.batch.seqs.size(); ++b) {
    RefSeq& s = c.batch.seqs[b];
    double num = 0, den = 0;
    for (size_t j = 0; j + 1 < s.length(); ++j) {
      num += (c.lp[b][j] - s.prev[j + 1]) * s.token_mask[j + 1];
      den += s.token_mask[j + 1];
    }
    if (den == 0) continue;
    const double mean = num / (den + kRefEps);
    double shift = 0;
    for (double k : {lo, hi})
      if (std::abs(mean - k) < 5e-3) shift = (mean < k ? -1e-2 : 1e-2);
    for (size_t j = 0; j + 1 < s.length(); ++j) s.prev[j + 1] -= shift;
  }
}

// Generation logprobs that make some importance weights overflow to inf or turn NaN (both
// become 0 through nan_to_num), and NaN at a masked position (ignored).
void add_bad_generation_logprobs(Case& c) {
  int placed = 0;
  for (size_t b = 0; b < c.batch.seqs.size() && placed < 3; ++b) {
    RefSeq& s = c.batch.seqs[b];
    if (s.sample_mask == 0) continue;
    for (size_t t = 1; t < s.length() && placed < 3; ++t) {
      if (s.token_mask[t] == 0) continue;
      s.gen[t] = placed == 0 ? s.prev[t] - 800.0 : placed == 1 ? std::nan("") : s.prev[t] - 750;
      ++placed;
    }
  }
}

std::vector<Variant> variants() {
  std::vector<Variant> v;
  v.push_back({"grpo_default", [](ClippedPGConfig&) {}});
  v.push_back({"asymmetric_clip", [](ClippedPGConfig& c) { c.ratio_clip_max = 0.28; },
               [](GenOptions& o) { o.lr_lo = -0.9; o.lr_hi = 0.7; }});
  v.push_back({"dual_clip", [](ClippedPGConfig& c) { c.ratio_clip_c = 3.0; },
               [](GenOptions& o) { o.lr_lo = -0.6; o.lr_hi = 1.8; }});
  v.push_back({"sequence_level_loss", [](ClippedPGConfig& c) { c.token_level_loss = false; }});
  for (KlType t : {KlType::kK1, KlType::kK2, KlType::kK3}) {
    v.push_back({std::string("kl_clamped_") + kl_type_name(t),
                 [t](ClippedPGConfig& c) {
                   c.reference_policy_kl_type = t;
                   c.reference_policy_kl_penalty = 0.3;
                 },
                 [](GenOptions&) {}, add_kl_extremes});
  }
  // Input clamp without output clamp: only the weight's detach (torch.where(.., w, w.detach()))
  // keeps the gradient of a clamped token at 0.
  v.push_back({"kl_input_clamp_only_k1",
               [](ClippedPGConfig& c) {
                 c.reference_policy_kl_type = KlType::kK1;
                 c.reference_policy_kl_penalty = 0.3;
                 c.kl_output_clamp_value.reset();
               },
               [](GenOptions&) {}, [](Case& c) { add_kl_offsets(c, {25.0, -25.0, 0.5}); }});
  v.push_back({"on_policy_kl_input_clamp_only_k3",
               [](ClippedPGConfig& c) {
                 c.use_on_policy_kl_approximation = true;
                 c.reference_policy_kl_penalty = 0.3;
                 c.kl_output_clamp_value.reset();
               },
               [](GenOptions&) {}, [](Case& c) { add_kl_offsets(c, {-25.0, -30.0, 1.0}); }});
  v.push_back({"kl_no_clamps",
               [](ClippedPGConfig& c) {
                 c.reference_policy_kl_penalty = 0.2;
                 c.kl_input_clamp_value.reset();
                 c.kl_output_clamp_value.reset();
               }});
  v.push_back({"on_policy_kl_approximation",
               [](ClippedPGConfig& c) {
                 c.use_on_policy_kl_approximation = true;
                 c.reference_policy_kl_penalty = 0.3;
               },
               [](GenOptions&) {}, add_kl_extremes});
  v.push_back({"kl_on_unfiltered_logprobs",
               [](ClippedPGConfig& c) {
                 c.use_on_policy_kl_approximation = true;
                 c.reference_policy_kl_penalty = 0.25;
               },
               [](GenOptions&) {}, add_kl_extremes, true});
  v.push_back({"no_kl", [](ClippedPGConfig& c) { c.reference_policy_kl_penalty = 0.0; }});
  v.push_back({"kl_in_reward", [](ClippedPGConfig& c) { c.use_kl_in_reward = true; }});
  v.push_back({"importance_sampling",
               [](ClippedPGConfig& c) { c.use_importance_sampling_correction = true; },
               [](GenOptions& o) { o.gen_noise = 0.3; }});
  v.push_back({"importance_sampling_nonfinite_weights",
               [](ClippedPGConfig& c) { c.use_importance_sampling_correction = true; },
               [](GenOptions&) {}, add_bad_generation_logprobs});
  v.push_back({"tis",
               [](ClippedPGConfig& c) {
                 c.use_importance_sampling_correction = true;
                 c.truncated_importance_sampling_type = TruncatedIsType::kTis;
                 c.truncated_importance_sampling_ratio = 1.1;
               },
               [](GenOptions& o) { o.gen_noise = 0.2; }});
  v.push_back({"tis_with_min",
               [](ClippedPGConfig& c) {
                 c.use_importance_sampling_correction = true;
                 c.truncated_importance_sampling_type = TruncatedIsType::kTis;
                 c.truncated_importance_sampling_ratio = 1.1;
                 c.truncated_importance_sampling_ratio_min = 0.9;
               },
               [](GenOptions& o) { o.gen_noise = 0.2; }});
  v.push_back({"icepop",
               [](ClippedPGConfig& c) {
                 c.use_importance_sampling_correction = true;
                 c.truncated_importance_sampling_type = TruncatedIsType::kIcePop;
                 c.truncated_importance_sampling_ratio = 1.15;
                 c.truncated_importance_sampling_ratio_min = 0.85;
               },
               [](GenOptions& o) { o.gen_noise = 0.2; }});
  v.push_back({"seq_mask_tis",
               [](ClippedPGConfig& c) {
                 c.use_importance_sampling_correction = true;
                 c.truncated_importance_sampling_type = TruncatedIsType::kSeqMaskTis;
                 c.truncated_importance_sampling_ratio = 1.04;
                 c.truncated_importance_sampling_ratio_min = 0.96;
               },
               [](GenOptions& o) { o.gen_noise = 0.08; }});
  v.push_back({"gspo",
               [](ClippedPGConfig& c) {
                 c.sequence_level_importance_ratios = true;
                 c.token_level_loss = false;
                 c.use_importance_sampling_correction = true;
               },
               [](GenOptions& o) { o.lr_lo = -0.5; o.lr_hi = 0.45; o.gen_noise = 0.05; }});
  v.push_back({"gspo_tis",
               [](ClippedPGConfig& c) {
                 c.sequence_level_importance_ratios = true;
                 c.token_level_loss = false;
                 c.use_importance_sampling_correction = true;
                 c.truncated_importance_sampling_type = TruncatedIsType::kTis;
                 c.truncated_importance_sampling_ratio = 1.2;
               },
               [](GenOptions& o) { o.gen_noise = 0.1; }});
  v.push_back({"cispo",
               [](ClippedPGConfig& c) {
                 c.use_cispo = true;
                 c.ratio_clip_max = 0.28;
               },
               [](GenOptions& o) { o.lr_lo = -0.9; o.lr_hi = 0.8; }});
  v.push_back({"reinforce_disable_ppo_ratio", [](ClippedPGConfig& c) { c.disable_ppo_ratio = true; }});
  v.push_back({"reinforce_dual_clip",
               [](ClippedPGConfig& c) {
                 c.disable_ppo_ratio = true;
                 c.ratio_clip_c = 2.0;
               }});
  v.push_back({"force_on_policy_ratio", [](ClippedPGConfig& c) { c.force_on_policy_ratio = true; }});
  v.push_back({"force_on_policy_sequence_level",
               [](ClippedPGConfig& c) {
                 c.force_on_policy_ratio = true;
                 c.token_level_loss = false;
                 c.use_importance_sampling_correction = true;
               }});
  v.push_back({"positive_example_nll",
               [](ClippedPGConfig& c) { c.positive_example_nll_weight = 0.1; }});
  v.push_back({"positive_example_nll_global",
               [](ClippedPGConfig& c) { c.positive_example_nll_weight = 0.1; }, [](GenOptions&) {},
               [](Case& c) { c.batch.g_pos = 17.0; }});
  v.push_back({"dr_grpo_constant_normalizer",
               [](ClippedPGConfig& c) { c.constant_normalizer = 16.0; }});
  v.push_back({"per_token_advantages_dual_asym",
               [](ClippedPGConfig& c) {
                 c.ratio_clip_min = 0.1;
                 c.ratio_clip_max = 0.3;
                 c.ratio_clip_c = 2.5;
               },
               [](GenOptions& o) {
                 o.per_token_advantages = true;
                 o.lr_lo = -0.8;
                 o.lr_hi = 1.5;
               }});
  return v;
}

void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

class ClippedPG : public ::testing::TestWithParam<Variant> {};

TEST_P(ClippedPG, MatchesReferenceValueMetricsAndFiniteDifferenceGradient) {
  const Variant& v = GetParam();
  ClippedPGConfig cfg;
  v.configure(cfg);
  cfg.validate();
  GenOptions o;
  o.seed = std::hash<std::string>{}(v.name) % 1000 + 7;
  o.kinks = kinks_of(cfg);
  v.generate(o);
  Case c = make_case(o);
  v.adjust(c);
  if (cfg.sequence_level_importance_ratios) fix_gspo_kinks(c, cfg);
  const RefBatch& B = c.batch;

  // A distinct unfiltered logprob (what top-k/top-p filtering would leave unchanged).
  Rows lpu = c.lp;
  for (auto& row : lpu)
    for (double& x : row) x -= 0.05;
  const Rows* lpu_ptr = v.unfiltered ? &lpu : nullptr;

  const Packed p = pack(B, c.lp, iota_order(B.seqs.size()), lpu_ptr, /*last_output=*/-7.5);
  std::vector<double> g(p.num_tokens()), gu(p.num_tokens());
  const LossResult got = clipped_pg_loss(cfg, p.pg_inputs(B, v.unfiltered), g.data(),
                                         v.unfiltered ? gu.data() : nullptr);
  const RefOut want = ref_clipped_pg(cfg, B, c.lp, c.lp, lpu_ptr, lpu_ptr);

  expect_close(got.loss, want.loss, 1e-12, "loss");
  for (const auto& [name, value] : want.m) {
    const auto m = got.metrics.get(name);
    ASSERT_TRUE(m.has_value()) << "metric " << name << " missing";
    if (std::isnan(value)) {
      EXPECT_TRUE(std::isnan(*m)) << name;
    } else {
      expect_close(*m, value, 1e-12, "metric " + name);
    }
  }
  if (cfg.truncated_importance_sampling_type) {
    EXPECT_TRUE(got.metrics.has("is_oob_ratio"));
  }
  EXPECT_TRUE(std::isfinite(got.loss));

  // d loss / d logprobs (and d loss / d unfiltered logprobs) against finite differences.
  const Rows fd = finite_difference(
      [&](const Rows& x) { return ref_clipped_pg(cfg, B, x, c.lp, lpu_ptr, lpu_ptr).loss; }, c.lp);
  expect_rows_near(unpack_grad(p, g, B), fd, 2e-8, 1e-6, v.name + " d/dlogprobs");
  if (v.unfiltered) {
    const Rows fdu = finite_difference(
        [&](const Rows& x) { return ref_clipped_pg(cfg, B, c.lp, c.lp, &x, &lpu).loss; }, lpu);
    expect_rows_near(unpack_grad(p, gu, B), fdu, 2e-8, 1e-6, v.name + " d/dunfiltered");
  }
}

// Splitting the batch into micro-batches, in any packing order, and summing the micro-batch
// losses, gradients and (summable) metrics gives the whole-batch values; extrema combine by
// min/max. The exception is NeMo-RL's positive-example NLL with its per-call normaliser, whose
// split value is the sum of per-call references instead.
TEST_P(ClippedPG, MicroBatchAndPackingInvariance) {
  const Variant& v = GetParam();
  ClippedPGConfig cfg;
  v.configure(cfg);
  GenOptions o;
  o.seed = std::hash<std::string>{}(v.name) % 1000 + 101;
  o.kinks = kinks_of(cfg);
  v.generate(o);
  Case c = make_case(o);
  v.adjust(c);
  const RefBatch& B = c.batch;
  const size_t n = B.seqs.size();
  Rows lpu = c.lp;
  for (auto& row : lpu)
    for (double& x : row) x += 0.03;
  const Rows* lpu_ptr = v.unfiltered ? &lpu : nullptr;

  const Packed whole = pack(B, c.lp, iota_order(n), lpu_ptr);
  std::vector<double> gw(whole.num_tokens()), guw(whole.num_tokens());
  const LossResult w = clipped_pg_loss(cfg, whole.pg_inputs(B, v.unfiltered), gw.data(),
                                       v.unfiltered ? guw.data() : nullptr);
  const Rows gw_rows = unpack_grad(whole, gw, B);
  const Rows guw_rows = v.unfiltered ? unpack_grad(whole, guw, B) : Rows();
  const bool per_call_nll = cfg.positive_example_nll_weight > 0 && B.g_pos == 0;

  const std::vector<std::vector<std::vector<int>>> splits = {
      {{0}, {1}, {2}, {3}, {4}, {5}, {6}},
      {{0, 1}, {2, 3, 4}, {5, 6}},
      {{6, 3, 0}, {5, 1, 4, 2}},
      {{4, 2, 6, 0, 1, 5, 3}},
  };
  for (size_t si = 0; si < splits.size(); ++si) {
    double loss = 0, ref_sum = 0;
    Metrics merged;
    Rows g(n), gu(n);
    for (size_t b = 0; b < n; ++b) g[b].assign(c.lp[b].size(), 0.0), gu[b].assign(c.lp[b].size(), 0.0);
    for (const std::vector<int>& chunk : splits[si]) {
      const Packed p = pack(B, c.lp, chunk, lpu_ptr);
      std::vector<double> gc(p.num_tokens()), guc(p.num_tokens());
      const LossResult r = clipped_pg_loss(cfg, p.pg_inputs(B, v.unfiltered), gc.data(),
                                           v.unfiltered ? guc.data() : nullptr);
      loss += r.loss;
      merged.merge(r.metrics);
      const Rows rows = unpack_grad(p, gc, B);
      const Rows rows_u = v.unfiltered ? unpack_grad(p, guc, B) : Rows();
      for (int b : chunk) {
        g[b] = rows[b];
        if (v.unfiltered) gu[b] = rows_u[b];
      }
      if (per_call_nll) {
        RefBatch sub;
        Rows sub_lp, sub_lpu;
        for (int b : chunk) {
          sub.seqs.push_back(B.seqs[b]);
          sub_lp.push_back(c.lp[b]);
          sub_lpu.push_back(lpu[b]);
        }
        sub.g_tok = B.g_tok;
        sub.g_seq = B.g_seq;
        ref_sum += ref_clipped_pg(cfg, sub, sub_lp, sub_lp, v.unfiltered ? &sub_lpu : nullptr,
                                  v.unfiltered ? &sub_lpu : nullptr).loss;
      }
    }
    const std::string where = v.name + " split " + std::to_string(si);
    if (per_call_nll) {
      expect_close(loss, ref_sum, 1e-12, where + " loss (per-call NLL normaliser)");
      continue;
    }
    expect_close(loss, w.loss, 1e-12, where + " loss");
    expect_rows_near(g, gw_rows, 1e-15, 1e-11, where + " gradient");
    if (v.unfiltered) expect_rows_near(gu, guw_rows, 1e-15, 1e-11, where + " unfiltered gradient");
    for (const Metric& m : w.metrics.items()) {
      const auto got = merged.get(m.name);
      ASSERT_TRUE(got.has_value()) << m.name;
      if (std::isnan(m.value)) {
        EXPECT_TRUE(std::isnan(*got)) << where << " " << m.name;
      } else {
        expect_close(*got, m.value, 1e-11, where + " metric " + m.name);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, ClippedPG, ::testing::ValuesIn(variants()),
                         [](const ::testing::TestParamInfo<Variant>& i) { return i.param.name; });

// ---- hand-computed cases: one sequence [prompt, response token] -------------------------------

struct OneToken {
  std::vector<int64_t> offsets = {0, 2};
  std::vector<double> lp = {0, 0}, adv = {0, 0}, prev = {0, 0}, gen = {0, 0}, ref = {0, 0},
                      tm = {0, 1}, sm = {1};
  ClippedPGInputs inputs() {
    ClippedPGInputs in;
    in.packing = Packing{2, 1, offsets.data()};
    in.logprobs = lp.data();
    in.advantages = adv.data();
    in.prev_logprobs = prev.data();
    in.generation_logprobs = gen.data();
    in.reference_policy_logprobs = ref.data();
    in.token_mask = tm.data();
    in.sample_mask = sm.data();
    in.global_valid_toks = 1;
    in.global_valid_seqs = 1;
    return in;
  }
};

TEST(ClippedPGByHand, PositiveAdvantageAboveTheClipIsFlat) {
  ClippedPGConfig cfg;
  cfg.reference_policy_kl_penalty = 0;
  OneToken t;
  t.lp[0] = std::log(0.75);
  t.prev[1] = std::log(0.5);  // ratio 1.5
  t.gen[1] = std::log(0.5);
  t.adv[1] = 1.0;
  std::vector<double> g(2);
  const LossResult r = clipped_pg_loss(cfg, t.inputs(), g.data());
  EXPECT_NEAR(r.loss, -1.2 / (1 + 1e-8), 1e-15);
  EXPECT_EQ(g[0], 0.0);
  EXPECT_EQ(g[1], 0.0);
  // Every global mean divides by (count + 1e-8), as NeMo-RL's masked_mean does.
  EXPECT_NEAR(*r.metrics.get("probs_ratio"), 1.5 / (1 + 1e-8), 1e-12);
  EXPECT_NEAR(*r.metrics.get("probs_ratio_clamped"), 1.2 / (1 + 1e-8), 1e-12);
  EXPECT_NEAR(*r.metrics.get("probs_ratio_clip_high_fraction"), 1.0 / (1 + 1e-8), 1e-12);
}

TEST(ClippedPGByHand, NegativeAdvantageKeepsTheUnclippedGradientUnlessDualClipped) {
  ClippedPGConfig cfg;
  cfg.reference_policy_kl_penalty = 0;
  OneToken t;
  t.lp[0] = std::log(0.75);
  t.prev[1] = std::log(0.5);
  t.gen[1] = std::log(0.5);
  t.adv[1] = -1.0;
  std::vector<double> g(2);
  LossResult r = clipped_pg_loss(cfg, t.inputs(), g.data());
  EXPECT_NEAR(r.loss, 1.5, 1e-7);
  EXPECT_NEAR(g[0], 1.5, 1e-7);  // d(-A r)/dlp = -A r
  cfg.ratio_clip_c = 1.3;
  r = clipped_pg_loss(cfg, t.inputs(), g.data());
  EXPECT_NEAR(r.loss, 1.3, 1e-7);
  EXPECT_EQ(g[0], 0.0);
}

TEST(ClippedPGByHand, K3PenaltyAndItsScoreFunctionGradient) {
  ClippedPGConfig cfg;
  cfg.reference_policy_kl_penalty = 0.1;
  OneToken t;
  t.lp[0] = std::log(0.5);
  t.prev[1] = t.lp[0];
  t.gen[1] = t.lp[0];
  t.ref[1] = std::log(0.25);
  std::vector<double> g(2);
  const LossResult r = clipped_pg_loss(cfg, t.inputs(), g.data());
  const double k3 = 0.5 - 1 - std::log(0.5);  // e^logr - 1 - logr at logr = log 0.5
  EXPECT_NEAR(r.loss, 0.1 * k3, 1e-9);
  EXPECT_NEAR(*r.metrics.get("kl_penalty"), k3, 1e-8);
  // d/dlp [w * k3(ref - lp)] with w = exp(lp - sg(lp)): k3 + (1 - e^logr).
  EXPECT_NEAR(g[0], 0.1 * (k3 + 0.5), 1e-9);
}

TEST(ClippedPGByHand, ForceOnPolicyRatioIsOneWithGradientMinusA) {
  ClippedPGConfig cfg;
  cfg.force_on_policy_ratio = true;
  cfg.reference_policy_kl_penalty = 0;
  OneToken t;
  t.lp[0] = std::log(0.3);
  t.prev[1] = 123.0;  // ignored
  t.gen[1] = std::log(0.3);
  t.adv[1] = 0.7;
  std::vector<double> g(2);
  ClippedPGInputs in = t.inputs();
  in.prev_logprobs = nullptr;  // not needed
  const LossResult r = clipped_pg_loss(cfg, in, g.data());
  EXPECT_NEAR(r.loss, -0.7, 1e-7);
  EXPECT_NEAR(g[0], -0.7, 1e-7);
  EXPECT_EQ(*r.metrics.get("probs_ratio_min"), 1.0);
  EXPECT_NEAR(*r.metrics.get("token_mult_prob_error"), 1.0, 1e-7);  // prev := lp = gen
}

TEST(ClippedPGByHand, CispoDetachesTheClippedRatio) {
  ClippedPGConfig cfg;
  cfg.use_cispo = true;
  cfg.reference_policy_kl_penalty = 0;
  OneToken t;
  t.lp[0] = std::log(0.75);
  t.prev[1] = std::log(0.5);  // r = 1.5 -> sg(clip) = 1.2
  t.gen[1] = t.prev[1];
  t.adv[1] = 2.0;
  std::vector<double> g(2);
  const LossResult r = clipped_pg_loss(cfg, t.inputs(), g.data());
  EXPECT_NEAR(r.loss, -2.0 * 1.2 * std::log(0.75), 1e-7);
  EXPECT_NEAR(g[0], -2.0 * 1.2, 1e-7);  // still a gradient although the ratio is clipped
}

TEST(ClippedPGByHand, NoValidTokensGiveInfiniteExtremaAndZeroLoss) {
  ClippedPGConfig cfg;
  OneToken t;
  t.tm[1] = 0;
  std::vector<double> g(2, 5.0);
  const LossResult r = clipped_pg_loss(cfg, t.inputs(), g.data());
  EXPECT_EQ(r.loss, 0.0);
  EXPECT_EQ(*r.metrics.get("probs_ratio_min"), std::numeric_limits<double>::infinity());
  EXPECT_EQ(*r.metrics.get("probs_ratio_max"), -std::numeric_limits<double>::infinity());
  EXPECT_EQ(g[0], 0.0);
  EXPECT_EQ(g[1], 0.0);
}

// Masked positions never contribute, even when their values are not finite (a deliberate
// difference from PyTorch, where NaN * 0 would poison the masked mean).
TEST(ClippedPGByHand, NonFiniteValuesAtMaskedPositionsAreIgnored) {
  ClippedPGConfig cfg;
  cfg.use_importance_sampling_correction = true;
  std::vector<int64_t> off = {0, 3};
  std::vector<double> lp = {std::nan(""), std::log(0.5), 0}, adv = {0, 5, 1},
                      prev = {0, 1e9, std::log(0.5)}, gen = {0, -INFINITY, std::log(0.5)},
                      ref = {0, std::nan(""), std::log(0.5)}, tm = {0, 0, 1}, sm = {1};
  ClippedPGInputs in;
  in.packing = Packing{3, 1, off.data()};
  in.logprobs = lp.data();
  in.advantages = adv.data();
  in.prev_logprobs = prev.data();
  in.generation_logprobs = gen.data();
  in.reference_policy_logprobs = ref.data();
  in.token_mask = tm.data();
  in.sample_mask = sm.data();
  in.global_valid_toks = 1;
  in.global_valid_seqs = 1;
  std::vector<double> g(3);
  const LossResult r = clipped_pg_loss(cfg, in, g.data());
  EXPECT_NEAR(r.loss, -1.0, 1e-7);  // the one valid token: A = 1, r = 1, w = 1, KL = 0
  for (const Metric& m : r.metrics.items()) EXPECT_TRUE(std::isfinite(m.value)) << m.name;
  EXPECT_EQ(g[0], 0.0);
  EXPECT_NEAR(g[1], -1.0, 1e-7);
}

TEST(ClippedPGInputsCheck, MissingInputsAndBadLayoutsThrow) {
  ClippedPGConfig cfg;
  OneToken t;
  std::vector<double> g(2);
  ClippedPGInputs in = t.inputs();
  in.reference_policy_logprobs = nullptr;
  EXPECT_THROW(clipped_pg_loss(cfg, in, g.data()), std::invalid_argument);
  in = t.inputs();
  in.prev_logprobs = nullptr;
  EXPECT_THROW(clipped_pg_loss(cfg, in, g.data()), std::invalid_argument);
  in = t.inputs();
  t.offsets[1] = 3;  // does not match num_tokens
  EXPECT_THROW(clipped_pg_loss(cfg, in, g.data()), std::invalid_argument);
}

}  // namespace
}  // namespace rlh::grpo::test
