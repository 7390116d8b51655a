// The GRPO loop's settings, read from the whole resolved configuration in NeMo-RL's layout:
// grpo.*, loss_fn.*, checkpointing.*, and what the loop reads of policy.*, data.* and env.*
// (model, tokenizer, batch sizes, generation settings, datasets, environment). A missing key
// takes NeMo-RL's default; a bad value is a ConfigError of one line naming the key.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/grpo/advantages.hpp"
#include "rlhost/grpo/clipped_pg_loss.hpp"
#include "rlhost/grpo/dynamic_sampling.hpp"
#include "rlhost/grpo/reward_shaping.hpp"
#include "rlhost/sdk/checkpoint.hpp"

namespace rlh::grpo {

// Sampling for one kind of generation (training or validation).
struct SamplingSettings {
  double temperature = 1.0;  // 0 = greedy
  int32_t top_k = 0;         // 0 = off
  double top_p = 1.0;
  double min_p = 0.0;
};

struct GenerationConfig {
  std::string component;     // generator component name (policy.generation.backend, mapped)
  int64_t max_new_tokens = 0;
  // policy.generation.vllm_cfg.max_model_len (0: absent or null): as in vLLM, a sequence (prompt
  // and response) ends when it reaches this length; never above max_total_sequence_length.
  int64_t max_model_len = 0;
  // The length each sequence of a rollout ends at: max_model_len, else max_total_sequence_length.
  int64_t sequence_cap(int64_t max_total_sequence_length) const {
    return max_model_len > 0 ? std::min(max_model_len, max_total_sequence_length) : max_total_sequence_length;
  }
  // The key that sets sequence_cap(), for messages.
  const char* sequence_cap_key(int64_t max_total_sequence_length) const {
    return max_model_len > 0 && max_model_len < max_total_sequence_length ? "policy.generation.vllm_cfg.max_model_len"
                                                                         : "policy.max_total_sequence_length";
  }
  SamplingSettings train, validation;
  std::vector<int32_t> stop_token_ids;  // beyond the tokenizer's EOS ids
  std::vector<std::string> stop_strings;
  nlohmann::json section;    // policy.generation, handed to the generator
  // policy.generation.colocated: false runs the generator on ranks of its own
  // (generation_ranks.hpp): resources.gpus_per_node x resources.num_nodes of them.
  bool colocated = true;
  int64_t generator_ranks = 0;
  std::string resources_text;  // names the resources in the layout's errors
  // policy.generation.vllm_cfg.tensor_parallel_size: the generator ranks form groups of this many
  // consecutive ranks, each one tensor-parallel generator (non-colocated generation only).
  int64_t tensor_parallel_size = 1;
  // rlhost.refit_reshard (default true): non-colocated refits send each generator rank its pieces
  // from every trainer rank (where the backend has visit_weight_pieces); false: trainer 0
  // broadcasts the gathered weights (the refit before ABI 0.9).
  bool refit_reshard = true;
};

// How prompts become token ids.
enum class PromptFormat {
  kChatTemplate,  // the tokenizer's chat template, with a system prompt when the row has one
  kRaw,           // the prompt text as is (policy.tokenizer.chat_template: null, or no template)
};

struct DataSource {
  std::string component;  // dataset component: "jsonl", "synthetic_arithmetic", ...
  nlohmann::json config;  // what its create() receives
  std::string origin;     // "data.train" / "data.validation"
};

struct PolicyConfig {
  std::string model_name;      // as written (folder or hub id)
  std::string tokenizer_name;  // policy.tokenizer.name, default model_name
  // policy.tokenizer.chat_template_kwargs: a JSON object of variables every chat template
  // rendering gets (NeMo-RL binds them to apply_chat_template, e.g. Qwen3's enable_thinking);
  // "" for none.
  std::string chat_template_kwargs;
  PromptFormat prompt_format = PromptFormat::kChatTemplate;
  bool prompt_format_explicit = false;  // chat_template key given
  std::string backend;         // "dtensor" | "megatron"
  int64_t train_global_batch_size = 0;
  int64_t train_micro_batch_size = 1;
  int64_t logprob_batch_size = 1;
  int64_t max_total_sequence_length = 0;
  // Token budgets per micro-batch when sequence packing or dynamic batching is on (0 = off:
  // micro-batches of train_micro_batch_size / logprob_batch_size sequences).
  int64_t train_mb_tokens = 0;
  int64_t logprob_mb_tokens = 0;
  nlohmann::json section;  // policy, handed to the backend
};

struct GrpoLoopConfig {
  // grpo
  int64_t num_prompts_per_step = 32;
  int64_t num_generations_per_prompt = 16;
  int64_t max_num_epochs = 1;
  int64_t max_num_steps = 1000000;
  int64_t val_period = 0;  // 0 = never
  int64_t val_start_at = -1;  // grpo.val_start_at: no periodic validation before this step (-1: none)
  bool val_at_start = false;
  bool val_at_end = false;
  int64_t val_batch_size = 256;
  std::optional<int64_t> max_val_samples;  // null = the whole validation set
  bool overlong_filtering = false;
  // grpo.seq_logprob_error_threshold (ppo.*): a sample whose mean exp|generation - prev logprob|
  // over its response tokens exceeds it leaves the loss (NeMo-RL's
  // compute_and_apply_seq_logprob_error_masking); null: the per-sequence metrics only.
  std::optional<double> seq_logprob_error_threshold;
  // grpo.stop_at_validation_metric / _threshold: training ends once a validation's metric (e.g.
  // accuracy) reaches the threshold, after that step's checkpoint (NeMo-RL's early stop).
  std::optional<std::string> stop_at_validation_metric;
  double stop_at_validation_threshold = 0;
  uint64_t seed = 42;
  bool skip_reference_policy_logprobs = false;
  // Generation/environment turns per rollout (NeMo-RL's run_multi_turn_rollout); 1 = single turn.
  int64_t max_rollout_turns = 1;
  // grpo.async_grpo.enabled: the next steps' rollouts are generated while this step trains, on
  // non-colocated generator ranks: max_trajectory_age_steps = k keeps k steps' requests ahead,
  // so a step trains on rollouts drawn with weights k versions old (fewer in the first k steps).
  bool async_grpo = false;
  int64_t async_age = 1;
  AdvantageConfig advantages;
  DynamicSamplingConfig dynamic_sampling;
  RewardScalingConfig reward_scaling;
  RewardShapingConfig reward_shaping;
  ClippedPGConfig loss;

  PolicyConfig policy;
  GenerationConfig generation;

  // data / env
  DataSource train_data;
  std::optional<DataSource> validation_data;
  bool shuffle = true;
  int64_t max_input_seq_length = 0;  // 0 = max_total_sequence_length
  std::string env_name;
  std::string data_note;  // said once at start when the data does not come from data.*
  nlohmann::json env_config = nlohmann::json::object();

  // checkpointing
  sdk::CheckpointConfig checkpointing;
  std::string model_save_dtype = "float32";  // checkpointing.model_save_dtype

  nlohmann::json whole;  // the resolved configuration (config.yaml of checkpoints)

  // The algorithm's own section: "grpo", or "ppo" (NeMo-RL's ppo.yaml has the same loop keys
  // under ppo.*; its advantages are GAE's, read by PpoConfig, and it has no grpo-only keys).
  std::string section = "grpo";

  // Reads and checks the whole configuration; throws ConfigError naming the key.
  static GrpoLoopConfig from_json(const nlohmann::json& whole, const std::string& section = "grpo");
  // True when the loss needs reference-policy logprobs and the config does not skip them.
  bool needs_reference() const {
    return loss.needs_reference_logprobs() && !skip_reference_policy_logprobs;
  }
};

// The pieces other algorithms (sft) read the same way.
// reward_model: the caller trains a reward model (rm); otherwise policy.reward_model_cfg.enabled
// true is refused by name.
PolicyConfig read_policy_config(const nlohmann::json& whole, bool reward_model = false);
DataSource read_data_source(const nlohmann::json& data, const std::string& split, bool required);
// checkpointing.model_save_format (NeMo-RL's; only "safetensors", the HF layout, is written) and
// rlhost's checkpointing.model_save_dtype: the dtype of step_N/policy's HF weights, "float32"
// (the default: the master weights) or "bfloat16" (the masters kept beside them for resume).
std::string read_model_save_dtype(const nlohmann::json& checkpointing);
// The per-model config the policy is loaded with so that its saves write that dtype (the
// backends' save_dtype override).
nlohmann::json policy_save_overrides(const std::string& model_save_dtype);

// The resolved configuration as block YAML (config.yaml in checkpoints): every scalar is written
// in JSON form, which YAML reads back as the same value.
std::string to_yaml(const nlohmann::ordered_json& j);

// The host's resolved configuration text as JSON; INVALID_ARGUMENT naming `algorithm` if it is not.
nlohmann::json parse_loop_config(const std::string& config_text, const char* algorithm);

}  // namespace rlh::grpo
