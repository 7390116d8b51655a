// DAPO dynamic sampling (see dynamic_sampling.hpp).
#include "rlhost/grpo/dynamic_sampling.hpp"

#include <map>
#include <stdexcept>
#include <string>

#include "json_read.hpp"

namespace rlh::grpo {

DynamicSamplingConfig DynamicSamplingConfig::from_json(const nlohmann::json& grpo) {
  detail::Section s(grpo, "grpo");
  DynamicSamplingConfig c;
  s.read("num_prompts_per_step", c.num_prompts_per_step);
  s.read("num_generations_per_prompt", c.num_generations_per_prompt);
  s.read("use_dynamic_sampling", c.use_dynamic_sampling);
  s.read("dynamic_sampling_max_gen_batches", c.dynamic_sampling_max_gen_batches);
  s.read("batch_multiplier", c.batch_multiplier);
  c.validate();
  return c;
}

void DynamicSamplingConfig::validate() const {
  if (num_prompts_per_step <= 0 || num_generations_per_prompt <= 0)
    throw ConfigError("grpo: num_prompts_per_step and num_generations_per_prompt must be positive");
  if (!use_dynamic_sampling && batch_multiplier != 1.0)
    throw ConfigError("grpo: batch_multiplier>1 can only be used if use_dynamic_sampling=true");
  if (use_dynamic_sampling) {
    if (dynamic_sampling_max_gen_batches <= 0)
      throw ConfigError("grpo: dynamic_sampling_max_gen_batches must be > 0 with use_dynamic_sampling");
    if (!(batch_multiplier > 0)) throw ConfigError("grpo: batch_multiplier must be positive");
    if (prompts_per_generation_batch() <= 0)
      throw ConfigError("grpo: int(num_prompts_per_step * batch_multiplier) must be at least 1");
  }
}

int64_t DynamicSamplingConfig::prompts_per_generation_batch() const {
  if (!use_dynamic_sampling) return num_prompts_per_step;
  return static_cast<int64_t>(static_cast<double>(num_prompts_per_step) * batch_multiplier);
}

DynamicSampler::DynamicSampler(const DynamicSamplingConfig& cfg) : cfg_(cfg) { cfg_.validate(); }

bool DynamicSampler::add(std::span<const int64_t> group_ids, std::span<const double> std) {
  if (complete_) throw std::logic_error("dynamic sampling: batch already complete; reset() first");
  if (group_ids.size() != std.size())
    throw std::invalid_argument("dynamic sampling: group_ids and std differ in length");
  const int64_t batch = num_gen_batches_++;
  if (!cfg_.use_dynamic_sampling) {
    for (size_t i = 0; i < std.size(); ++i) cache_.emplace_back(batch, static_cast<int64_t>(i));
    complete_ = true;
    return true;
  }
  std::map<int64_t, bool> varies;
  for (size_t i = 0; i < std.size(); ++i) {
    bool& v = varies[group_ids[i]];
    v = v || std[i] != 0.0;
  }
  for (size_t i = 0; i < std.size(); ++i)
    if (varies[group_ids[i]]) cache_.emplace_back(batch, static_cast<int64_t>(i));
  if (num_cached() >= cfg_.train_samples()) {
    complete_ = true;
    return true;
  }
  if (num_gen_batches_ > cfg_.dynamic_sampling_max_gen_batches)
    throw std::runtime_error(
        "dynamic sampling has reached the maximum allowed number of batches (" +
        std::to_string(cfg_.dynamic_sampling_max_gen_batches) + "): " +
        std::to_string(num_cached()) + " of " + std::to_string(cfg_.train_samples()) +
        " samples with non-zero std; increase batch_multiplier or data diversity");
  return false;
}

std::vector<std::pair<int64_t, int64_t>> DynamicSampler::selection() const {
  if (!complete_) throw std::logic_error("dynamic sampling: selection before the batch is complete");
  if (!cfg_.use_dynamic_sampling) return cache_;
  return {cache_.begin(), cache_.begin() + cfg_.train_samples()};
}

Metrics DynamicSampler::metrics() const {
  Metrics m;
  if (!complete_ || !cfg_.use_dynamic_sampling) return m;
  m.sum("dynamic_sampling_num_gen_batches", static_cast<double>(num_gen_batches_));
  m.sum("dynamic_sampling_num_discarded_valid_samples",
        static_cast<double>(num_cached() - cfg_.train_samples()));
  return m;
}

void DynamicSampler::reset() {
  cache_.clear();
  num_gen_batches_ = 0;
  complete_ = false;
}

}  // namespace rlh::grpo
