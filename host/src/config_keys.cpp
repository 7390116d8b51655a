// Checking every key of a resolved configuration against who owns it.
//
// A key is fine when a loaded component owns it (its config_keys), or the host owns it
// (`rlhost.*`). A key that NeMo-RL knows but nothing loaded here uses gets one warning (so real
// NeMo-RL configs load: `policy.generation.vllm_cfg`), one per subtree. Any other key is an
// error naming the key, the file that set it, and the closest known key.
#include "config_keys.hpp"

#include <algorithm>
#include <set>

namespace rlh::host {
namespace {

// Keys of NeMo-RL's configurations (examples/configs/*.yaml at v0.7 and the MasterConfig
// schema). A trailing ".*" covers a whole subtree whose inner keys rlhost does not check.
const char* const kNemoRlKeys[] = {
    // grpo
    "grpo.num_prompts_per_step", "grpo.num_generations_per_prompt", "grpo.max_rollout_turns",
    "grpo.max_num_epochs", "grpo.max_num_steps", "grpo.normalize_rewards",
    "grpo.use_leave_one_out_baseline", "grpo.val_period", "grpo.val_at_start", "grpo.val_at_end",
    "grpo.val_batch_size", "grpo.max_val_samples", "grpo.overlong_filtering",
    "grpo.use_dynamic_sampling", "grpo.batch_multiplier", "grpo.dynamic_sampling_max_gen_batches",
    "grpo.reward_shaping.*", "grpo.reward_scaling.*", "grpo.adv_estimator.*", "grpo.async_grpo.*",
    "grpo.seed", "grpo.skip_reference_policy_logprobs_calculation", "grpo.calculate_advantages_on_gpu",
    "grpo.seq_logprob_error_threshold", "grpo.invalid_tool_call_advantage",
    "grpo.malformed_thinking_advantage", "grpo.advantage_clip_low", "grpo.advantage_clip_high",
    "grpo.use_kl_in_reward",
    // loss_fn
    "loss_fn.reference_policy_kl_penalty", "loss_fn.reference_policy_kl_type",
    "loss_fn.kl_input_clamp_value", "loss_fn.kl_output_clamp_value", "loss_fn.ratio_clip_min",
    "loss_fn.ratio_clip_max", "loss_fn.ratio_clip_c", "loss_fn.use_on_policy_kl_approximation",
    "loss_fn.use_importance_sampling_correction", "loss_fn.truncated_importance_sampling_ratio",
    "loss_fn.truncated_importance_sampling_ratio_min", "loss_fn.truncated_importance_sampling_type",
    "loss_fn.sequence_level_importance_ratios", "loss_fn.token_level_loss",
    "loss_fn.disable_ppo_ratio", "loss_fn.force_on_policy_ratio", "loss_fn.use_cispo",
    "loss_fn.positive_example_nll_weight", "loss_fn.truncated_importance_sampling_ratio_max",
    // checkpointing
    "checkpointing.enabled", "checkpointing.checkpoint_dir", "checkpointing.metric_name",
    "checkpointing.higher_is_better", "checkpointing.keep_top_k", "checkpointing.save_period",
    "checkpointing.checkpoint_must_save_by", "checkpointing.model_save_format",
    "checkpointing.save_consolidated", "checkpointing.save_optimizer",
    // policy
    "policy.model_name", "policy.tokenizer.*", "policy.train_global_batch_size",
    "policy.train_micro_batch_size", "policy.generation_batch_size", "policy.logprob_batch_size",
    "policy.logprob_chunk_size", "policy.max_total_sequence_length", "policy.precision",
    "policy.max_grad_norm", "policy.make_sequence_length_divisible_by", "policy.optimizer.*",
    "policy.scheduler.*", "policy.dynamic_batching.*", "policy.sequence_packing.*",
    "policy.dtensor_cfg.*", "policy.megatron_cfg.*", "policy.hf_config_overrides.*",
    "policy.reward_model_cfg.*", "policy.offload_optimizer_for_logprob",
    "policy.generation.backend", "policy.generation.max_new_tokens", "policy.generation.temperature",
    "policy.generation.top_p", "policy.generation.top_k", "policy.generation.min_p",
    "policy.generation.val_temperature", "policy.generation.val_top_p", "policy.generation.val_top_k",
    "policy.generation.stop_token_ids", "policy.generation.stop_strings",
    "policy.generation.refit_transport", "policy.generation.vllm_cfg.*",
    "policy.generation.vllm_kwargs.*", "policy.generation.sglang_cfg.*",
    "policy.generation.colocated.*", "policy.generation.model_name",
    "policy.generation.mcore_generation_config.*", "policy.refit_buffer_size_gb", "policy.lora_cfg.*",
    "policy.hf_config_overrides", "policy.value_head.*",
    // data, env, logger, cluster and the rest
    "data.*", "env.*", "logger.*", "cluster.*", "reward_penalties.*", "data_plane.*",
    "on_policy_distillation.*", "distillation.*", "sft.*", "dpo.*", "rm.*", "ppo.*",
    "teacher.*", "critic.*", "eval.*",
};

bool matches(const std::string& key, const std::string& pattern) {
  if (pattern.size() >= 2 && pattern.compare(pattern.size() - 2, 2, ".*") == 0) {
    const std::string prefix = pattern.substr(0, pattern.size() - 2);
    return key == prefix || key.rfind(prefix + ".", 0) == 0;
  }
  return key == pattern || key.rfind(pattern + ".", 0) == 0;  // a map under an owned key
}

// The subtree a NeMo-RL pattern names, for one warning per subtree.
std::string warn_root(const std::string& key, const std::string& pattern) {
  if (pattern.size() >= 2 && pattern.compare(pattern.size() - 2, 2, ".*") == 0) {
    // "policy.generation.vllm_cfg.*" warns once for the vllm_cfg subtree; broad section patterns
    // ("data.*") warn per second-level key.
    const std::string prefix = pattern.substr(0, pattern.size() - 2);
    if (std::count(prefix.begin(), prefix.end(), '.') >= 1) return prefix;
    size_t next = key.find('.', prefix.size() + 1);
    return next == std::string::npos ? key : key.substr(0, next);
  }
  return pattern;
}

}  // namespace

KeyCheck check_keys(const Json& resolved, const std::vector<std::string>& owned_patterns,
                    const std::function<std::string(const std::string&)>& origin_of) {
  KeyCheck result;
  std::vector<std::string> keys;
  collect_keys(resolved, "", keys);
  std::set<std::string> warned;
  for (const auto& key : keys) {
    if (matches(key, "rlhost.*")) continue;
    bool owned = std::any_of(owned_patterns.begin(), owned_patterns.end(),
                             [&](const std::string& p) { return matches(key, p); });
    if (owned) continue;
    const char* nemo = nullptr;
    for (const char* p : kNemoRlKeys)
      if (matches(key, p)) { nemo = p; break; }
    if (nemo != nullptr) {
      std::string root = warn_root(key, nemo);
      if (warned.insert(root).second) result.unused_known.push_back(root);
      continue;
    }
    // Unknown. Past the first kMaxReported, only counted: a file of 100,000 stray keys would
    // otherwise cost 100,000 suggestion searches and as many error lines.
    if (result.errors.size() >= KeyCheck::kMaxReported) {
      ++result.unreported;
      continue;
    }
    // Suggest the closest key among owned patterns, NeMo-RL keys and the config's own siblings.
    std::vector<std::string> candidates(owned_patterns.begin(), owned_patterns.end());
    for (const char* p : kNemoRlKeys) candidates.emplace_back(p);
    std::string best;
    size_t best_d = SIZE_MAX;
    for (auto c : candidates) {
      if (c.size() >= 2 && c.compare(c.size() - 2, 2, ".*") == 0) c.resize(c.size() - 2);
      size_t d = edit_distance(key, c);
      if (d < best_d) { best_d = d; best = c; }
    }
    std::string msg = "unknown config key '" + key + "' (from " + origin_of(key) + ")";
    if (!best.empty() && best_d <= std::max<size_t>(3, key.size() / 4)) msg += "; did you mean '" + best + "'?";
    msg += " No loaded plugin owns it and NeMo-RL does not define it.";
    result.errors.push_back(msg);
  }
  return result;
}

}  // namespace rlh::host
