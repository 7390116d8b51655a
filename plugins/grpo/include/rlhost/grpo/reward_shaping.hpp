// Reward scaling and reward shaping, in NeMo-RL's order: scale_rewards (grpo.reward_scaling)
// first, then apply_reward_shaping (grpo.reward_shaping), then baselines/advantages.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace rlh::grpo {

// grpo.reward_scaling: clamp each reward to [source_min, source_max], then map linearly onto
// [target_min, target_max].
struct RewardScalingConfig {
  bool enabled = false;
  double source_min = 0.0;
  double source_max = 1.0;
  double target_min = 0.0;
  double target_max = 1.0;

  static RewardScalingConfig from_json(const nlohmann::json& reward_scaling);
};

// Scales in place when enabled; returns how many rewards lay outside the source interval
// (NeMo-RL prints a warning for them).
int64_t scale_rewards(const RewardScalingConfig& cfg, std::span<double> rewards);

// grpo.reward_shaping. Two modes, as NeMo-RL's apply_reward_shaping:
//  * stop_properly_penalty_coef set (in [0, 1]): truncated samples' rewards are multiplied by it
//    (the DAPO keys are ignored);
//  * else DAPO's overlong penalty, all three keys required:
//      expected = max_response_length - overlong_buffer_length
//      R += min(-(len - expected) / overlong_buffer_length * overlong_buffer_penalty, 0)
//    (not capped: NeMo-RL relies on lengths never exceeding max_response_length).
struct RewardShapingConfig {
  bool enabled = false;
  std::optional<double> overlong_buffer_length;
  std::optional<double> overlong_buffer_penalty;
  std::optional<double> max_response_length;
  std::optional<double> stop_properly_penalty_coef;

  // Reads and, when enabled, validates (missing DAPO keys, negative penalty, coef outside [0,1]).
  static RewardShapingConfig from_json(const nlohmann::json& reward_shaping);
  void validate() const;
};

struct ShapedRewards {
  std::vector<double> rewards;   // shaped ("total_reward")
  std::vector<double> unshaped;  // before shaping ("unshaped_total_reward": DAPO's std input)
};

// response_lengths: generated tokens per sample (DAPO mode); truncated: 1 where the response hit
// the length limit (stop-properly mode). Either may be empty when its mode is not used.
ShapedRewards apply_reward_shaping(const RewardShapingConfig& cfg, std::span<const double> rewards,
                                   std::span<const int64_t> response_lengths,
                                   std::span<const uint8_t> truncated);

}  // namespace rlh::grpo
