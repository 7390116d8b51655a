// GRPO advantages (see advantages.hpp).
#include "rlhost/grpo/advantages.hpp"

#include <cmath>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "json_read.hpp"

namespace rlh::grpo {

AdvantageConfig AdvantageConfig::from_json(const nlohmann::json& grpo) {
  detail::Section s(grpo, "grpo");
  AdvantageConfig c;
  s.read("normalize_rewards", c.normalize_rewards);
  s.read("use_leave_one_out_baseline", c.use_leave_one_out_baseline);
  s.read("advantage_clip_low", c.advantage_clip_low);
  s.read("advantage_clip_high", c.advantage_clip_high);
  const detail::Section est = s.sub("adv_estimator");
  std::string name = "grpo";
  est.read("name", name);
  if (name != "grpo")
    throw ConfigError(est.key("name") + ": '" + name +
                      "' is not implemented by rlh_grpo_core (only 'grpo')");
  est.read("normalize_rewards", c.normalize_rewards);
  est.read("use_leave_one_out_baseline", c.use_leave_one_out_baseline);
  if (c.advantage_clip_low && c.advantage_clip_high && *c.advantage_clip_low > *c.advantage_clip_high)
    throw ConfigError("grpo: advantage_clip_low must not exceed advantage_clip_high");
  return c;
}

std::vector<int64_t> group_by_prompt(std::span<const int32_t> prompt_tokens,
                                     std::span<const int64_t> prompt_offsets) {
  if (prompt_offsets.empty()) throw std::invalid_argument("group_by_prompt: empty prompt_offsets");
  const size_t n = prompt_offsets.size() - 1;
  if (prompt_offsets[0] != 0 || prompt_offsets[n] != static_cast<int64_t>(prompt_tokens.size()))
    throw std::invalid_argument("group_by_prompt: prompt_offsets do not cover prompt_tokens");
  std::map<std::vector<int32_t>, int64_t> ids;
  std::vector<int64_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (prompt_offsets[i + 1] < prompt_offsets[i])
      throw std::invalid_argument("group_by_prompt: prompt_offsets decrease");
    std::vector<int32_t> key(prompt_tokens.begin() + prompt_offsets[i],
                             prompt_tokens.begin() + prompt_offsets[i + 1]);
    auto [it, inserted] = ids.emplace(std::move(key), static_cast<int64_t>(ids.size()));
    out[i] = it->second;
  }
  return out;
}

BaselineStd baseline_and_std_per_prompt(std::span<const int64_t> group_ids,
                                        std::span<const double> rewards,
                                        std::span<const double> valid_mask, bool leave_one_out,
                                        std::span<const double> std_rewards) {
  const size_t n = rewards.size();
  if (group_ids.size() != n) throw std::invalid_argument("baseline: group_ids and rewards differ in length");
  if (!valid_mask.empty() && valid_mask.size() != n)
    throw std::invalid_argument("baseline: valid_mask and rewards differ in length");
  if (!std_rewards.empty() && std_rewards.size() != n)
    throw std::invalid_argument("baseline: std_rewards and rewards differ in length");
  auto v = [&](size_t i) { return valid_mask.empty() ? 1.0 : valid_mask[i]; };
  auto s = [&](size_t i) { return std_rewards.empty() ? rewards[i] : std_rewards[i]; };

  std::map<int64_t, std::vector<size_t>> groups;
  for (size_t i = 0; i < n; ++i) groups[group_ids[i]].push_back(i);

  BaselineStd out;
  out.baseline.assign(n, 0.0);
  out.std.assign(n, 0.0);
  for (const auto& [gid, idx] : groups) {
    double total_valid = 0;
    for (size_t j : idx) total_valid += v(j);
    if (total_valid <= 1) {
      for (size_t j : idx) out.baseline[j] = rewards[j];  // degenerate: A = 0
      continue;
    }
    const double cnt = total_valid - (leave_one_out ? 1.0 : 0.0);
    // Reference values: the first valid sample's rewards (sums of differences are exact zeros
    // for equal rewards).
    double ref_r = 0, ref_s = 0;
    for (size_t j : idx) {
      if (v(j) != 0) {
        ref_r = rewards[j];
        ref_s = s(j);
        break;
      }
    }
    for (size_t i : idx) {
      double w_sum = 0, dr = 0, ds = 0;
      for (size_t j : idx) {
        if (leave_one_out && j == i) continue;
        w_sum += v(j);
        dr += v(j) * (rewards[j] - ref_r);
        ds += v(j) * (s(j) - ref_s);
      }
      out.baseline[i] = (w_sum == cnt) ? ref_r + dr / cnt : (ref_r * w_sum + dr) / cnt;
      // std over the same weighted set: (E[x^2] - E[x]^2) * cnt / (cnt - 1), in two passes.
      const double mean_s = (w_sum == cnt) ? ref_s + ds / cnt : (ref_s * w_sum + ds) / cnt;
      if (!(cnt > 1)) continue;  // Bessel factor undefined: NeMo-RL's nan_to_num gives 0
      double ss = 0;
      for (size_t j : idx) {
        if (leave_one_out && j == i) continue;
        const double dv = s(j) - mean_s;
        ss += v(j) * dv * dv;
      }
      const double var = (ss + mean_s * mean_s * (cnt - w_sum)) / (cnt - 1);
      out.std[i] = var >= 0 ? std::sqrt(var) : 0.0;  // sqrt of a negative -> NaN -> 0
    }
  }
  return out;
}

std::vector<double> grpo_advantages(const AdvantageConfig& cfg, std::span<const int64_t> group_ids,
                                    std::span<const double> rewards,
                                    std::span<const double> valid_mask) {
  const BaselineStd bs = baseline_and_std_per_prompt(group_ids, rewards, valid_mask,
                                                     cfg.use_leave_one_out_baseline);
  std::vector<double> a(rewards.size());
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = rewards[i] - bs.baseline[i];
    if (cfg.normalize_rewards && bs.std[i] > 0) a[i] /= bs.std[i] + 1e-6;
    if (cfg.advantage_clip_low && a[i] < *cfg.advantage_clip_low) a[i] = *cfg.advantage_clip_low;
    if (cfg.advantage_clip_high && a[i] > *cfg.advantage_clip_high) a[i] = *cfg.advantage_clip_high;
  }
  return a;
}

void apply_overlong_filtering(std::span<const uint8_t> truncated,
                              std::span<double> loss_multiplier) {
  if (truncated.size() != loss_multiplier.size())
    throw std::invalid_argument("overlong filtering: truncated and loss_multiplier differ in length");
  for (size_t i = 0; i < truncated.size(); ++i)
    if (truncated[i]) loss_multiplier[i] = 0;
}

}  // namespace rlh::grpo
