// Reward scaling and shaping (see reward_shaping.hpp).
#include "rlhost/grpo/reward_shaping.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "json_read.hpp"

namespace rlh::grpo {

RewardScalingConfig RewardScalingConfig::from_json(const nlohmann::json& j) {
  detail::Section s(j, "grpo.reward_scaling");
  RewardScalingConfig c;
  s.read("enabled", c.enabled);
  s.read("source_min", c.source_min);
  s.read("source_max", c.source_max);
  s.read("target_min", c.target_min);
  s.read("target_max", c.target_max);
  if (c.enabled && !(c.source_max > c.source_min))
    throw ConfigError("grpo.reward_scaling: source_max must be greater than source_min");
  return c;
}

int64_t scale_rewards(const RewardScalingConfig& cfg, std::span<double> rewards) {
  if (!cfg.enabled) return 0;
  if (!(cfg.source_max > cfg.source_min))
    throw ConfigError("grpo.reward_scaling: source_max must be greater than source_min");
  int64_t out_of_range = 0;
  for (double& r : rewards) {
    if (r < cfg.source_min || r > cfg.source_max) ++out_of_range;
    const double c = std::min(std::max(r, cfg.source_min), cfg.source_max);
    r = cfg.target_min +
        (c - cfg.source_min) / (cfg.source_max - cfg.source_min) * (cfg.target_max - cfg.target_min);
  }
  return out_of_range;
}

RewardShapingConfig RewardShapingConfig::from_json(const nlohmann::json& j) {
  detail::Section s(j, "grpo.reward_shaping");
  RewardShapingConfig c;
  s.read("enabled", c.enabled);
  s.read("overlong_buffer_length", c.overlong_buffer_length);
  s.read("overlong_buffer_penalty", c.overlong_buffer_penalty);
  s.read("max_response_length", c.max_response_length);
  s.read("stop_properly_penalty_coef", c.stop_properly_penalty_coef);
  c.validate();
  return c;
}

void RewardShapingConfig::validate() const {
  if (!enabled) return;
  auto fail = [](const std::string& m) { throw ConfigError("grpo.reward_shaping: " + m); };
  if (stop_properly_penalty_coef) {
    if (!(*stop_properly_penalty_coef >= 0 && *stop_properly_penalty_coef <= 1))
      fail("stop_properly_penalty_coef must be in [0, 1]");
    return;
  }
  if (!overlong_buffer_length || !overlong_buffer_penalty || !max_response_length)
    fail("enabled, but only DAPO reward shaping is supported: set overlong_buffer_length, "
         "overlong_buffer_penalty and max_response_length (or stop_properly_penalty_coef)");
  if (!(*overlong_buffer_penalty >= 0)) fail("overlong_buffer_penalty must be >= 0");
  if (!(*overlong_buffer_length > 0)) fail("overlong_buffer_length must be > 0");
}

ShapedRewards apply_reward_shaping(const RewardShapingConfig& cfg, std::span<const double> rewards,
                                   std::span<const int64_t> response_lengths,
                                   std::span<const uint8_t> truncated) {
  ShapedRewards out;
  out.rewards.assign(rewards.begin(), rewards.end());
  out.unshaped = out.rewards;
  if (!cfg.enabled) return out;
  cfg.validate();
  if (cfg.stop_properly_penalty_coef) {
    if (truncated.size() != rewards.size())
      throw std::invalid_argument("reward shaping: stop_properly_penalty_coef needs one truncated "
                                  "flag per sample");
    for (size_t i = 0; i < rewards.size(); ++i)
      if (truncated[i]) out.rewards[i] = rewards[i] * *cfg.stop_properly_penalty_coef;
    return out;
  }
  if (response_lengths.size() != rewards.size())
    throw std::invalid_argument("reward shaping: one response length per sample expected");
  const double buf = *cfg.overlong_buffer_length;
  const double expected = *cfg.max_response_length - buf;
  for (size_t i = 0; i < rewards.size(); ++i) {
    const double exceed = static_cast<double>(response_lengths[i]) - expected;
    out.rewards[i] = rewards[i] + std::min(-exceed / buf * *cfg.overlong_buffer_penalty, 0.0);
  }
  return out;
}

}  // namespace rlh::grpo
