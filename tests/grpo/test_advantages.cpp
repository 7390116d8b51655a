// GRPO advantages, overlong filtering, reward scaling/shaping and DAPO dynamic sampling.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/grpo/advantages.hpp"
#include "rlhost/grpo/config.hpp"
#include "rlhost/grpo/dynamic_sampling.hpp"
#include "rlhost/grpo/reward_shaping.hpp"

namespace rlh::grpo {
namespace {

using nlohmann::json;

// NeMo-RL's calculate_baseline_and_std_per_prompt, transcribed literally in float64: the
// leave-one-out matrix (1 - I) or ones, E[x] and E[x^2] over the masked set, Bessel factor,
// nan -> 0.
void ref_baseline_std(const std::vector<int64_t>& gid, const std::vector<double>& r,
                      const std::vector<double>& valid, bool loo, const std::vector<double>& sr,
                      std::vector<double>& base, std::vector<double>& sd) {
  const size_t n = r.size();
  base.assign(n, 0.0);
  sd.assign(n, 0.0);
  std::map<int64_t, std::vector<size_t>> groups;
  for (size_t i = 0; i < n; ++i) groups[gid[i]].push_back(i);
  for (auto& [g, idx] : groups) {
    double vs = 0;
    for (size_t i : idx) vs += valid[i];
    if (vs <= 1) {
      for (size_t i : idx) base[i] = r[i];
      continue;
    }
    const double num = vs - (loo ? 1 : 0);
    for (size_t a = 0; a < idx.size(); ++a) {
      double b = 0, sb = 0, sq = 0;
      for (size_t c = 0; c < idx.size(); ++c) {
        const double m = (loo && a == c) ? 0.0 : 1.0;
        b += m * r[idx[c]] * valid[idx[c]];
        sb += m * sr[idx[c]] * valid[idx[c]];
        sq += m * sr[idx[c]] * sr[idx[c]] * valid[idx[c]];
      }
      b /= num;
      sb /= num;
      sq /= num;
      base[idx[a]] = b;
      const double s = std::sqrt((sq - sb * sb) * (num / (num - 1)));
      sd[idx[a]] = std::isnan(s) ? 0.0 : s;
    }
  }
}

TEST(Advantages, BaselineAndStdMatchNeMoRlFormula) {
  std::mt19937_64 rng(5);
  std::normal_distribution<double> nr(0.3, 1.0);
  std::vector<int64_t> gid;
  std::vector<double> r, sr, valid;
  const int sizes[] = {4, 3, 8, 5, 6};
  for (int g = 0; g < 5; ++g)
    for (int k = 0; k < sizes[g]; ++k) {
      gid.push_back(g * 7 - 3);  // arbitrary keys
      r.push_back(nr(rng));
      sr.push_back(nr(rng));
      valid.push_back((g == 2 && k == 3) || (g == 3 && k == 0) ? 0.0 : 1.0);
    }
  for (bool loo : {true, false}) {
    for (bool separate_std : {false, true}) {
      std::vector<double> b0, s0;
      ref_baseline_std(gid, r, valid, loo, separate_std ? sr : r, b0, s0);
      const BaselineStd got =
          baseline_and_std_per_prompt(gid, r, valid, loo, separate_std ? std::span<const double>(sr)
                                                                        : std::span<const double>());
      for (size_t i = 0; i < r.size(); ++i) {
        EXPECT_NEAR(got.baseline[i], b0[i], 1e-12) << "baseline " << i << " loo " << loo;
        EXPECT_NEAR(got.std[i], s0[i], 1e-12) << "std " << i << " loo " << loo;
      }
    }
  }
}

TEST(Advantages, EqualRewardsGiveExactlyZero) {
  // 0.1 is not representable: naive sums would leave ~1e-17 residues and a tiny std > 0.
  const std::vector<int64_t> gid = {0, 0, 0, 0, 0, 1, 1, 1};
  const std::vector<double> r = {0.1, 0.1, 0.1, 0.1, 0.1, 0.7, 0.7, 0.7};
  for (bool loo : {true, false}) {
    AdvantageConfig cfg;
    cfg.use_leave_one_out_baseline = loo;
    const BaselineStd bs = baseline_and_std_per_prompt(gid, r, {}, loo);
    const std::vector<double> a = grpo_advantages(cfg, gid, r);
    for (size_t i = 0; i < r.size(); ++i) {
      EXPECT_EQ(bs.baseline[i], r[i]);
      EXPECT_EQ(bs.std[i], 0.0);
      EXPECT_EQ(a[i], 0.0);
    }
  }
}

TEST(Advantages, DegenerateGroupsHaveZeroAdvantage) {
  // Group 0: one sample. Group 1: two samples, one invalid (<= 1 valid).
  const std::vector<int64_t> gid = {0, 1, 1};
  const std::vector<double> r = {3.0, 1.0, -2.0}, valid = {1, 1, 0};
  const std::vector<double> a = grpo_advantages(AdvantageConfig{}, gid, r, valid);
  EXPECT_EQ(a[0], 0.0);
  EXPECT_EQ(a[1], 0.0);
  EXPECT_EQ(a[2], 0.0);
}

TEST(Advantages, TwoSamplesWithLeaveOneOutAreNotNormalised) {
  // Each sample's baseline is the other's reward; the std of one other sample is 0 (NeMo-RL:
  // 0 * 1/0 = nan -> 0), so nothing is divided.
  const std::vector<double> a = grpo_advantages(AdvantageConfig{}, std::vector<int64_t>{4, 4},
                                                std::vector<double>{1.0, 0.25});
  EXPECT_DOUBLE_EQ(a[0], 0.75);
  EXPECT_DOUBLE_EQ(a[1], -0.75);
}

TEST(Advantages, NormalisedByTheStdOfTheOthers) {
  const std::vector<int64_t> gid = {0, 0, 0, 0};
  const std::vector<double> r = {1, 0, 0, 0};
  AdvantageConfig cfg;
  std::vector<double> a = grpo_advantages(cfg, gid, r);
  EXPECT_DOUBLE_EQ(a[0], 1.0);  // the others {0,0,0}: baseline 0, std 0 -> not normalised
  const double sd = std::sqrt(1.0 / 3.0);  // Bessel std of {1, 0, 0}
  EXPECT_NEAR(a[1], (0 - 1.0 / 3.0) / (sd + 1e-6), 1e-14);
  cfg.use_leave_one_out_baseline = false;
  a = grpo_advantages(cfg, gid, r);
  EXPECT_NEAR(a[0], 0.75 / (0.5 + 1e-6), 1e-14);  // mean 0.25, Bessel std 0.5
  EXPECT_NEAR(a[1], -0.25 / (0.5 + 1e-6), 1e-14);
  cfg.normalize_rewards = false;
  a = grpo_advantages(cfg, gid, r);
  EXPECT_DOUBLE_EQ(a[0], 0.75);
  cfg.advantage_clip_low = -0.1;
  cfg.advantage_clip_high = 0.5;
  a = grpo_advantages(cfg, gid, r);
  EXPECT_EQ(a[0], 0.5);
  EXPECT_EQ(a[1], -0.1);
}

TEST(Advantages, InvalidSamplesDoNotVoteInTheirSiblingsBaseline) {
  const std::vector<int64_t> gid = {0, 0, 0, 0};
  const std::vector<double> r = {1.0, 2.0, 100.0, 4.0}, valid = {1, 1, 0, 1};
  const BaselineStd bs = baseline_and_std_per_prompt(gid, r, valid, true);
  EXPECT_DOUBLE_EQ(bs.baseline[0], 3.0);  // (2 + 4) / 2
  EXPECT_DOUBLE_EQ(bs.baseline[3], 1.5);
}

TEST(Advantages, GroupByIdenticalPromptTokens) {
  const std::vector<int32_t> tok = {1, 2, 3, 1, 2, 1, 2, 3, 1, 2, 9};
  const std::vector<int64_t> off = {0, 3, 5, 8, 8, 10, 10, 11};
  const std::vector<int64_t> g = group_by_prompt(tok, off);
  EXPECT_EQ(g, (std::vector<int64_t>{0, 1, 0, 2, 1, 2, 3}));
  EXPECT_THROW(group_by_prompt(tok, std::vector<int64_t>{0, 3}), std::invalid_argument);
}

TEST(Advantages, OverlongFilteringZeroesLossMultiplierButKeepsTheBaseline) {
  const std::vector<int64_t> gid = {0, 0, 0};
  const std::vector<double> r = {1.0, 0.0, 0.5};
  const std::vector<uint8_t> truncated = {0, 1, 0};
  std::vector<double> lm = {1, 1, 1};
  apply_overlong_filtering(truncated, lm);
  EXPECT_EQ(lm, (std::vector<double>{1, 0, 1}));
  // Advantages are computed with every sample valid (NeMo-RL passes no valid mask), so the
  // truncated sample still shapes its siblings' baselines.
  const std::vector<double> a = grpo_advantages(AdvantageConfig{}, gid, r);
  const BaselineStd bs = baseline_and_std_per_prompt(gid, r, {}, true);
  EXPECT_DOUBLE_EQ(bs.baseline[0], 0.25);
  EXPECT_NEAR(a[0], 0.75 / (bs.std[0] + 1e-6), 1e-14);
}

TEST(AdvantageConfig, ReadsGrpoAndAdvEstimatorKeys) {
  AdvantageConfig c = AdvantageConfig::from_json(json::object());
  EXPECT_TRUE(c.normalize_rewards);
  EXPECT_TRUE(c.use_leave_one_out_baseline);
  EXPECT_FALSE(c.advantage_clip_low);
  c = AdvantageConfig::from_json(json{{"normalize_rewards", false},
                                      {"advantage_clip_low", -3},
                                      {"advantage_clip_high", nullptr}});
  EXPECT_FALSE(c.normalize_rewards);
  EXPECT_EQ(*c.advantage_clip_low, -3.0);
  // adv_estimator's own keys win (NeMo-RL's estimator reads them).
  c = AdvantageConfig::from_json(
      json{{"use_leave_one_out_baseline", true},
           {"adv_estimator", {{"name", "grpo"}, {"use_leave_one_out_baseline", false}}}});
  EXPECT_FALSE(c.use_leave_one_out_baseline);
  EXPECT_THROW(AdvantageConfig::from_json(json{{"adv_estimator", {{"name", "gdpo"}}}}), ConfigError);
  EXPECT_THROW(AdvantageConfig::from_json(json{{"normalize_rewards", "yes"}}), ConfigError);
}

// ---- reward scaling and shaping ---------------------------------------------------------------

TEST(RewardScaling, ClampsThenMapsLinearly) {
  RewardScalingConfig c = RewardScalingConfig::from_json(
      json{{"enabled", true}, {"source_min", 0.0}, {"source_max", 1.0}, {"target_min", -1.0},
           {"target_max", 1.0}});
  std::vector<double> r = {0.0, 0.25, 1.0, 1.5, -2.0};
  EXPECT_EQ(scale_rewards(c, r), 2);
  EXPECT_EQ(r, (std::vector<double>{-1.0, -0.5, 1.0, 1.0, -1.0}));
  c.enabled = false;
  std::vector<double> r2 = {5.0};
  EXPECT_EQ(scale_rewards(c, r2), 0);
  EXPECT_EQ(r2[0], 5.0);
  EXPECT_THROW(RewardScalingConfig::from_json(
                   json{{"enabled", true}, {"source_min", 1.0}, {"source_max", 1.0}}),
               ConfigError);
}

TEST(RewardShaping, DapoOverlongPenalty) {
  const RewardShapingConfig c = RewardShapingConfig::from_json(
      json{{"enabled", true}, {"overlong_buffer_length", 4}, {"overlong_buffer_penalty", 1},
           {"max_response_length", 20}, {"stop_properly_penalty_coef", nullptr}});
  const std::vector<double> r = {1.0, 1.0, 1.0, 0.0};
  const std::vector<int64_t> len = {10, 16, 18, 20};
  const ShapedRewards s = apply_reward_shaping(c, r, len, {});
  EXPECT_EQ(s.unshaped, r);
  EXPECT_DOUBLE_EQ(s.rewards[0], 1.0);   // below max - buffer
  EXPECT_DOUBLE_EQ(s.rewards[1], 1.0);   // exactly at the threshold
  EXPECT_DOUBLE_EQ(s.rewards[2], 0.5);   // 2 of 4 buffer tokens
  EXPECT_DOUBLE_EQ(s.rewards[3], -1.0);  // the whole buffer
}

TEST(RewardShaping, StopProperlyPenaltyScalesTruncatedRewards) {
  const RewardShapingConfig c = RewardShapingConfig::from_json(
      json{{"enabled", true}, {"stop_properly_penalty_coef", 0.25}, {"overlong_buffer_length", 4}});
  const ShapedRewards s =
      apply_reward_shaping(c, std::vector<double>{2.0, 2.0}, {}, std::vector<uint8_t>{1, 0});
  EXPECT_EQ(s.rewards, (std::vector<double>{0.5, 2.0}));
}

TEST(RewardShaping, InvalidSettingsAreRejected) {
  EXPECT_THROW(RewardShapingConfig::from_json(json{{"enabled", true}}), ConfigError);
  EXPECT_THROW(RewardShapingConfig::from_json(json{{"enabled", true},
                                                   {"stop_properly_penalty_coef", 1.5}}),
               ConfigError);
  EXPECT_THROW(RewardShapingConfig::from_json(json{{"enabled", true},
                                                   {"overlong_buffer_length", 4},
                                                   {"overlong_buffer_penalty", -1},
                                                   {"max_response_length", 20}}),
               ConfigError);
  // Disabled: nothing is required, rewards pass through.
  const RewardShapingConfig off = RewardShapingConfig::from_json(json{{"enabled", false}});
  EXPECT_EQ(apply_reward_shaping(off, std::vector<double>{3.0}, {}, {}).rewards[0], 3.0);
}

// ---- dynamic sampling -------------------------------------------------------------------------

// std per sample for a batch of groups of `gens` samples, group g varying iff varies[g].
std::vector<double> stds(const std::vector<bool>& varies, int gens) {
  std::vector<double> s;
  for (bool v : varies)
    for (int k = 0; k < gens; ++k) s.push_back(v ? 0.5 : 0.0);
  return s;
}
std::vector<int64_t> groups(size_t n, int gens) {
  std::vector<int64_t> g;
  for (size_t i = 0; i < n; ++i)
    for (int k = 0; k < gens; ++k) g.push_back(static_cast<int64_t>(i));
  return g;
}

DynamicSamplingConfig ds_config() {
  return DynamicSamplingConfig::from_json(json{{"num_prompts_per_step", 3},
                                               {"num_generations_per_prompt", 4},
                                               {"use_dynamic_sampling", true},
                                               {"batch_multiplier", 2.0},
                                               {"dynamic_sampling_max_gen_batches", 2}});
}

TEST(DynamicSampling, AccumulatesGroupsWithVaryingRewardsAcrossBatches) {
  const DynamicSamplingConfig cfg = ds_config();
  EXPECT_EQ(cfg.prompts_per_generation_batch(), 6);
  EXPECT_EQ(cfg.train_samples(), 12);
  DynamicSampler ds(cfg);
  EXPECT_FALSE(ds.add(groups(6, 4), stds({false, true, false, false, true, false}, 4)));
  EXPECT_EQ(ds.num_cached(), 8);
  EXPECT_TRUE(ds.metrics().items().empty());
  EXPECT_TRUE(ds.add(groups(6, 4), stds({false, false, false, true, false, false}, 4)));
  const auto sel = ds.selection();
  ASSERT_EQ(sel.size(), 12u);
  EXPECT_EQ(sel[0], (std::pair<int64_t, int64_t>{0, 4}));   // batch 0, group 1
  EXPECT_EQ(sel[4], (std::pair<int64_t, int64_t>{0, 16}));  // batch 0, group 4
  EXPECT_EQ(sel[8], (std::pair<int64_t, int64_t>{1, 12}));  // batch 1, group 3
  EXPECT_EQ(*ds.metrics().get("dynamic_sampling_num_gen_batches"), 2.0);
  EXPECT_EQ(*ds.metrics().get("dynamic_sampling_num_discarded_valid_samples"), 0.0);
  EXPECT_THROW(ds.add(groups(1, 4), stds({true}, 4)), std::logic_error);
  ds.reset();
  EXPECT_EQ(ds.num_gen_batches(), 0);
  EXPECT_FALSE(ds.complete());
}

TEST(DynamicSampling, SurplusIsDiscardedAndCounted) {
  DynamicSampler ds(ds_config());
  EXPECT_TRUE(ds.add(groups(6, 4), stds({true, true, false, true, true, false}, 4)));
  EXPECT_EQ(ds.selection().size(), 12u);
  EXPECT_EQ(ds.selection().back(), (std::pair<int64_t, int64_t>{0, 15}));
  EXPECT_EQ(*ds.metrics().get("dynamic_sampling_num_discarded_valid_samples"), 4.0);
  EXPECT_EQ(*ds.metrics().get("dynamic_sampling_num_gen_batches"), 1.0);
}

TEST(DynamicSampling, RaisesAfterMaxGenBatchesPlusOne) {
  // NeMo-RL continues while num_gen_batches <= dynamic_sampling_max_gen_batches.
  DynamicSampler ds(ds_config());
  const auto none = stds({false, false, false, false, false, true}, 4);
  EXPECT_FALSE(ds.add(groups(6, 4), none));
  EXPECT_FALSE(ds.add(groups(6, 4), none));
  EXPECT_THROW(ds.add(groups(6, 4), stds({false, false, false, false, false, false}, 4)),
               std::runtime_error);
}

TEST(DynamicSampling, LeaveOneOutStdKeepsWholeGroups) {
  // Rewards [1,0,0,0]: with the leave-one-out std, sample 0's std (over {0,0,0}) is 0 but the
  // group varies: it is kept whole, the correct sample included.
  const std::vector<int64_t> gid = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2};
  const std::vector<double> r = {1, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 1};
  const BaselineStd bs = baseline_and_std_per_prompt(gid, r, {}, true);
  EXPECT_EQ(bs.std[0], 0.0);
  EXPECT_GT(bs.std[1], 0.0);
  DynamicSamplingConfig cfg = ds_config();
  cfg.num_prompts_per_step = 2;
  cfg.batch_multiplier = 1.5;
  DynamicSampler ds(cfg);
  EXPECT_TRUE(ds.add(gid, bs.std));
  const auto sel = ds.selection();
  ASSERT_EQ(sel.size(), 8u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(sel[i].second, i);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(sel[4 + i].second, 8 + i);
}

TEST(DynamicSampling, DisabledPassesEverythingThrough) {
  const DynamicSamplingConfig cfg =
      DynamicSamplingConfig::from_json(json{{"num_prompts_per_step", 2}, {"num_generations_per_prompt", 2}});
  EXPECT_EQ(cfg.prompts_per_generation_batch(), 2);
  DynamicSampler ds(cfg);
  EXPECT_TRUE(ds.add(groups(2, 2), stds({false, false}, 2)));
  EXPECT_EQ(ds.selection().size(), 4u);
  EXPECT_TRUE(ds.metrics().items().empty());
}

TEST(DynamicSampling, ConfigChecks) {
  EXPECT_THROW(DynamicSamplingConfig::from_json(json{{"batch_multiplier", 2.0}}), ConfigError);
  EXPECT_THROW(DynamicSamplingConfig::from_json(
                   json{{"use_dynamic_sampling", true}, {"dynamic_sampling_max_gen_batches", 0}}),
               ConfigError);
  EXPECT_THROW(DynamicSamplingConfig::from_json(json{{"use_dynamic_sampling", "true"}}), ConfigError);
  DynamicSamplingConfig c = DynamicSamplingConfig::from_json(
      json{{"num_prompts_per_step", 5}, {"use_dynamic_sampling", true}, {"batch_multiplier", 1.3}});
  EXPECT_EQ(c.prompts_per_generation_batch(), 6);  // int(6.5)
  EXPECT_EQ(c.dynamic_sampling_max_gen_batches, 10);
}

}  // namespace
}  // namespace rlh::grpo
