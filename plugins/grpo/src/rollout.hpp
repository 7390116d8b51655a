// Rollouts: prompts from a dataset (seeded epoch order, checkpointable position), rendered and
// tokenized; generation of several responses per prompt; scoring by the environment.
#pragma once

#include <cstdint>
#include <memory>
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
  std::vector<double> rewards;       // per environment reward name (summed over turns)
  // Multi-turn rollouts: ids holds every turn's generated tokens and the environment's
  // observation tokens after them, in order; mask[t] is 1 for a generated token (trained) and 0
  // for an observation token (logprobs[t] = 0, never trained). Empty mask: every token generated.
  std::vector<uint8_t> mask;
  int64_t turns = 1;                 // generation turns taken
  bool terminated = true;            // the environment ended the episode (not the turn limit)
  int64_t generated_tokens() const;
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

// The generator request of run_rollout for `prompts` (it owns every buffer `args` points into;
// not movable, hence held by pointer). Asynchronous GRPO sends the next step's requests ahead
// with it (generation_ranks.hpp).
struct GenerateRequest {
  std::vector<int32_t> ids;
  std::vector<int64_t> offsets;
  std::vector<int32_t> stop_ids;
  std::vector<std::string> stop_strings;
  std::vector<const char*> stop_ptrs;
  rlh_sampling sampling{};
  rlh_generate_args args{};
  GenerateRequest() = default;
  GenerateRequest(const GenerateRequest&) = delete;
  GenerateRequest& operator=(const GenerateRequest&) = delete;
};
std::unique_ptr<GenerateRequest> make_generate_request(const Tokenizer& tok, const std::vector<Prompt>& prompts,
                                                       int64_t samples, const SamplingSettings& sampling,
                                                       const GenerationConfig& gcfg,
                                                       int64_t max_total_sequence_length, uint64_t seed,
                                                       int64_t step_key, int64_t first_prompt_index);

// The most tokens a response to `prompt` may have: max_new_tokens, and as vLLM ends a sequence
// at max_model_len, what the prompt leaves of gcfg.sequence_cap(max_total_sequence_length).
int64_t response_room(const GenerationConfig& gcfg, int64_t max_total_sequence_length, const Prompt& prompt);
// Cuts a longer response to `room` tokens, marked truncated. make_generate_request asks for the
// room of the batch's shortest prompt, so the generator's samples of longer ones are cut here.
void cut_to_room(Response& resp, int64_t room);

// Generates `samples` responses per prompt and scores them. `step_key` and `first_prompt_index`
// key the generator's counter-based sampling RNG, so a step's samples are a pure function of
// (seed, step, prompt, sample) and a resumed run draws the same ones. Each response ends within
// its own room (response_room), as each vLLM request does.
Rollout run_rollout(Generator& gen, const Tokenizer& tok, Environment& env,
                    std::vector<Prompt> prompts, int64_t samples, const SamplingSettings& sampling,
                    const GenerationConfig& gcfg, int64_t max_total_sequence_length, uint64_t seed,
                    int64_t step_key, int64_t first_prompt_index, RolloutTimes* times);

// Multi-turn rollouts (NeMo-RL's run_multi_turn_rollout): up to `max_turns` rounds of generation
// for the samples still active, each scored by the environment, which answers with rewards (summed
// over turns), done flags and observation texts. An observation is tokenized on its own and
// appended after the turn's generated ids; the next turn's prompt is the previous ids plus the
// observation ids, never a re-tokenized history, so training sees exactly the sampled tokens.
// A sample stops when the environment says done, at the turn limit, or when its sequence reaches
// max_total_sequence_length (its last generation or observation is cut there and it is marked
// truncated). The environment sees the turn's response text, and in metadata_json the row plus
// "rlh_history": the previous turns' {"response", "observation"} texts. max_turns = 1 is
// run_rollout.
Rollout run_multi_turn_rollout(Generator& gen, const Tokenizer& tok, Environment& env,
                               std::vector<Prompt> prompts, int64_t samples, const SamplingSettings& sampling,
                               const GenerationConfig& gcfg, int64_t max_total_sequence_length,
                               int64_t max_turns, uint64_t seed, int64_t step_key, int64_t first_prompt_index,
                               RolloutTimes* times);

}  // namespace rlh::grpo
