// GRPO advantages, as NeMo-RL's GRPOAdvantageEstimator and calculate_baseline_and_std_per_prompt
// compute them: responses are grouped by identical prompt token ids; within a group, with the
// valid samples V (valid_mask = 1) and n = |V| - [leave_one_out]:
//   baseline_i = sum_{j in V, j != i if LOO} R_j / n
//   std_i      = Bessel-corrected std of the same set (the other samples with LOO)
// A group with at most one valid sample is degenerate: baseline = reward (so A = 0), std = 0.
//   A_i = R_i - baseline_i;  A_i /= (std_i + 1e-6) where normalize_rewards and std_i > 0
// then the optional clamp to [advantage_clip_low, advantage_clip_high]. The advantage is per
// sequence; broadcast_to_tokens (packing.hpp) expands it to the token frame.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace rlh::grpo {

// The GRPO estimator's settings. NeMo-RL reads normalize_rewards / use_leave_one_out_baseline
// from grpo.adv_estimator (which its example configs interpolate from the grpo keys of the same
// name); from_json takes grpo.adv_estimator.* when present, else grpo.*.
struct AdvantageConfig {
  bool normalize_rewards = true;
  bool use_leave_one_out_baseline = true;
  std::optional<double> advantage_clip_low;
  std::optional<double> advantage_clip_high;

  // Reads the `grpo` section. adv_estimator.name must be "grpo" (the other estimators are not
  // implemented here: ConfigError).
  static AdvantageConfig from_json(const nlohmann::json& grpo);
};

// Group index of every sample: samples whose prompt token sequences are identical share a group.
// Prompt i is prompt_tokens[prompt_offsets[i] .. prompt_offsets[i+1]); groups are numbered in
// order of first appearance.
std::vector<int64_t> group_by_prompt(std::span<const int32_t> prompt_tokens,
                                     std::span<const int64_t> prompt_offsets);

struct BaselineStd {
  std::vector<double> baseline;
  std::vector<double> std;
};

// NeMo-RL's calculate_baseline_and_std_per_prompt. valid_mask empty = all valid. std_rewards
// (optional, DAPO) supplies the rewards the std is computed from (the baseline always uses
// `rewards`). Sums are formed relative to the group's first valid reward and the std in two
// passes, so equal rewards give exactly baseline = reward and std = 0.
BaselineStd baseline_and_std_per_prompt(std::span<const int64_t> group_ids,
                                        std::span<const double> rewards,
                                        std::span<const double> valid_mask,
                                        bool leave_one_out,
                                        std::span<const double> std_rewards = {});

// Per-sequence GRPO advantages (see the header comment).
std::vector<double> grpo_advantages(const AdvantageConfig& cfg,
                                    std::span<const int64_t> group_ids,
                                    std::span<const double> rewards,
                                    std::span<const double> valid_mask = {});

// Overlong filtering (grpo.overlong_filtering): truncated samples get loss_multiplier 0 (their
// sample_mask) but stay valid for the baseline: compute advantages with the full valid mask.
void apply_overlong_filtering(std::span<const uint8_t> truncated, std::span<double> loss_multiplier);

}  // namespace rlh::grpo
