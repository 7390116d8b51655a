// Rollouts: prompts from a dataset (seeded epoch order, checkpointable position), rendered and
// tokenized; generation of several responses per prompt; scoring by the environment.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "components.hpp"
#include "loop_config.hpp"

namespace rlh::grpo {

// NeMo-RL's StatefulDataLoader over a dataset with batch_size = num_prompts_per_step, shuffle
// and drop_last: epoch e visits the rows in a permutation fixed by (seed, e), in batches; a batch
// that would run past the end starts the next epoch. Its state is two integers.
class PromptOrder {
 public:
  PromptOrder(int64_t size, uint64_t seed, bool shuffle);
  // The next `n` row indices (n <= size).
  std::vector<int64_t> next(int64_t n);
  int64_t epoch() const { return epoch_; }
  int64_t position() const { return position_; }
  nlohmann::json state() const;
  void restore(const nlohmann::json& state, const std::string& origin);

 private:
  void build_order();
  int64_t size_;
  uint64_t seed_;
  bool shuffle_;
  int64_t epoch_ = 0;
  int64_t position_ = 0;  // rows consumed in this epoch
  std::vector<int64_t> order_;
};

// A prompt ready for generation.
struct Prompt {
  int64_t row_index = 0;
  nlohmann::json row;         // the dataset row (environment metadata)
  std::string text;           // rendered prompt text
  std::vector<int32_t> ids;   // its tokens
  bool too_long = false;      // longer than max_input_seq_length: truncated, never trained on
};

// Renders and tokenizes a dataset row (NeMo-RL's math data processor: an optional system prompt
// and the prompt as the user message through the chat template; or the raw prompt text).
Prompt make_prompt(const Tokenizer& tok, PromptFormat format, const nlohmann::json& row,
                   int64_t row_index, int64_t max_input_seq_length, const std::string& origin);

// One generated response with its scores.
struct Response {
  int64_t prompt = 0;                // index into the rollout's prompts
  std::vector<int32_t> ids;          // generated tokens (including a stop token)
  std::vector<float> logprobs;       // the generator's processed logprobs, one per token
  bool truncated = false;
  int64_t weight_version = -1;
  std::string text;                  // decoded, special tokens skipped
  std::vector<double> rewards;       // per environment reward name
};

struct Rollout {
  std::vector<Prompt> prompts;
  std::vector<Response> responses;   // prompt-major: prompt i's sample j at i * samples + j
  int64_t samples_per_prompt = 1;
};

struct RolloutTimes {
  double generation = 0;
  double reward = 0;
};

// Generates `samples` responses per prompt and scores them. `step_key` and `first_prompt_index`
// key the generator's counter-based sampling RNG, so a step's samples are a pure function of
// (seed, step, prompt, sample) and a resumed run draws the same ones.
Rollout run_rollout(Generator& gen, const Tokenizer& tok, Environment& env,
                    std::vector<Prompt> prompts, int64_t samples, const SamplingSettings& sampling,
                    const GenerationConfig& gcfg, int64_t max_total_sequence_length, uint64_t seed,
                    int64_t step_key, int64_t first_prompt_index, RolloutTimes* times);

}  // namespace rlh::grpo
