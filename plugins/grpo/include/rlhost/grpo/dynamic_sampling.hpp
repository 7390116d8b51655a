// DAPO dynamic sampling, as NeMo-RL's grpo_train/dynamic_sampling drive it.
//
// Each training step generates batches of int(num_prompts_per_step * batch_multiplier) prompts x
// num_generations_per_prompt responses. After each batch, the prompt groups whose rewards vary
// (std > 0; see below) are appended to a cache; once the cache holds at least
// num_prompts_per_step * num_generations_per_prompt samples, its first that-many samples are the
// training batch and the rest are discarded (dynamic_sampling_num_discarded_valid_samples).
// While short, generation continues; NeMo-RL raises once the buffer is still short after
// generation batch number dynamic_sampling_max_gen_batches + 1 (its check is
// `num_gen_batches <= max_gen_batches` -> continue), and so does DynamicSampler::add.
//
// Selection unit: NeMo-RL filters *samples* by their own std (std != 0), which is the group's
// std without the leave-one-out baseline. With the leave-one-out baseline each sample's std is
// over the *other* samples, so in a group like rewards [1, 0, 0, 0] it drops the one correct
// sample and keeps the rest. The DAPO guide and paper describe keeping whole groups whose rewards
// vary, which is what this implements: a group is kept when any of its samples has std != 0.
// Without leave-one-out (the DAPO recipes) both rules pick the same samples.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "rlhost/grpo/metrics.hpp"

namespace rlh::grpo {

struct DynamicSamplingConfig {
  int64_t num_prompts_per_step = 32;
  int64_t num_generations_per_prompt = 16;
  bool use_dynamic_sampling = false;
  int64_t dynamic_sampling_max_gen_batches = 10;
  double batch_multiplier = 1.0;

  // Reads the `grpo` section. batch_multiplier != 1 without use_dynamic_sampling, or
  // dynamic_sampling_max_gen_batches <= 0 with it, is a ConfigError (NeMo-RL's assertions).
  static DynamicSamplingConfig from_json(const nlohmann::json& grpo);
  void validate() const;

  // Prompts per generation batch: int(num_prompts_per_step * batch_multiplier) with dynamic
  // sampling, num_prompts_per_step without.
  int64_t prompts_per_generation_batch() const;
  // Samples in a training batch: num_prompts_per_step * num_generations_per_prompt.
  int64_t train_samples() const { return num_prompts_per_step * num_generations_per_prompt; }
};

// One training step's accumulation of generation batches.
class DynamicSampler {
 public:
  explicit DynamicSampler(const DynamicSamplingConfig& cfg);

  // Adds generation batch number num_gen_batches()+1: each sample's prompt group (any integer
  // key; only equality within the batch matters) and its std from baseline_and_std_per_prompt
  // (computed on the unshaped reward when reward shaping is on). Returns true when the training
  // batch is complete. Throws std::runtime_error when the limit is exceeded, and
  // std::logic_error when called after completion.
  bool add(std::span<const int64_t> group_ids, std::span<const double> std);

  bool complete() const { return complete_; }
  int64_t num_gen_batches() const { return num_gen_batches_; }
  int64_t num_cached() const { return static_cast<int64_t>(cache_.size()); }

  // The training batch: (generation batch index from 0, sample index within it), in cache order,
  // train_samples() entries. Only once complete().
  std::vector<std::pair<int64_t, int64_t>> selection() const;

  // dynamic_sampling_num_gen_batches and dynamic_sampling_num_discarded_valid_samples, as NeMo-RL
  // logs them once the batch is complete (empty before).
  Metrics metrics() const;

  // Starts a new training step.
  void reset();

 private:
  DynamicSamplingConfig cfg_;
  std::vector<std::pair<int64_t, int64_t>> cache_;
  int64_t num_gen_batches_ = 0;
  bool complete_ = false;
};

}  // namespace rlh::grpo
