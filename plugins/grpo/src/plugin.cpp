// The grpo plugin: the ALGORITHM component `grpo` (NeMo-RL's GRPO loop over rlhost components).
//
// It owns the NeMo-RL keys it implements, one by one rather than whole sections, so the host's
// key check still reports NeMo-RL keys the loop does not use (a warning) and typos (an error with
// the closest key).
#include <memory>
#include <string>

#include "grpo_loop.hpp"
#include "loop_algorithm.hpp"
#include "rlhost/algorithm.h"
#include "rlhost/sdk/plugin.hpp"

namespace {

std::unique_ptr<rlh::grpo::GrpoLoop> make(const rlh::sdk::Host& host, const std::string& config) {
  return std::make_unique<rlh::grpo::GrpoLoop>(host, config);
}
constexpr char kName[] = "grpo";
const rlh_algorithm_api& kApi = rlh::grpo::LoopAlgorithm<rlh::grpo::GrpoLoop, make, kName>::api;

// What the loop reads. The backend, generator, datasets and environments own their own keys
// (policy.optimizer, policy.dtensor_cfg, data.train.data_path, env.math, ...); some keys below
// are read by both the loop and a component, which the host allows.
const char* const kKeys[] = {
    // grpo
    "grpo.num_prompts_per_step", "grpo.num_generations_per_prompt", "grpo.max_rollout_turns",
    "grpo.max_num_epochs", "grpo.max_num_steps", "grpo.normalize_rewards",
    "grpo.use_leave_one_out_baseline", "grpo.val_period", "grpo.val_at_start", "grpo.val_at_end",
    "grpo.val_batch_size", "grpo.max_val_samples", "grpo.overlong_filtering",
    "grpo.use_dynamic_sampling", "grpo.batch_multiplier", "grpo.dynamic_sampling_max_gen_batches",
    "grpo.reward_shaping.*", "grpo.reward_scaling.*", "grpo.adv_estimator.name",
    "grpo.adv_estimator.normalize_rewards", "grpo.adv_estimator.use_leave_one_out_baseline",
    "grpo.async_grpo.enabled", "grpo.seed", "grpo.skip_reference_policy_logprobs_calculation",
    "grpo.advantage_clip_low", "grpo.advantage_clip_high", "grpo.use_kl_in_reward",
    // loss_fn (ClippedPGLossFn)
    "loss_fn.reference_policy_kl_penalty", "loss_fn.reference_policy_kl_type",
    "loss_fn.kl_input_clamp_value", "loss_fn.kl_output_clamp_value", "loss_fn.ratio_clip_min",
    "loss_fn.ratio_clip_max", "loss_fn.ratio_clip_c", "loss_fn.use_on_policy_kl_approximation",
    "loss_fn.use_importance_sampling_correction", "loss_fn.truncated_importance_sampling_ratio",
    "loss_fn.truncated_importance_sampling_ratio_min", "loss_fn.truncated_importance_sampling_type",
    "loss_fn.sequence_level_importance_ratios", "loss_fn.token_level_loss",
    "loss_fn.disable_ppo_ratio", "loss_fn.force_on_policy_ratio", "loss_fn.use_cispo",
    "loss_fn.positive_example_nll_weight", "loss_fn.use_kl_in_reward", "loss_fn.constant_normalizer",
    // checkpointing
    "checkpointing.enabled", "checkpointing.checkpoint_dir", "checkpointing.metric_name",
    "checkpointing.higher_is_better", "checkpointing.keep_top_k", "checkpointing.save_period",
    "checkpointing.ft_keep_latest_k", "checkpointing.model_save_format", "checkpointing.model_save_dtype",
    // policy: what the loop reads
    "policy.model_name", "policy.tokenizer.name", "policy.tokenizer.chat_template",
    "policy.train_global_batch_size", "policy.train_micro_batch_size", "policy.logprob_batch_size",
    "policy.max_total_sequence_length", "policy.dtensor_cfg.enabled", "policy.megatron_cfg.enabled",
    "policy.sequence_packing.enabled", "policy.sequence_packing.train_mb_tokens",
    "policy.sequence_packing.logprob_mb_tokens", "policy.dynamic_batching.enabled",
    "policy.dynamic_batching.train_mb_tokens", "policy.dynamic_batching.logprob_mb_tokens",
    "policy.generation.backend", "policy.generation.max_new_tokens", "policy.generation.temperature",
    "policy.generation.top_p", "policy.generation.top_k", "policy.generation.min_p",
    "policy.generation.val_temperature", "policy.generation.val_top_p", "policy.generation.val_top_k",
    "policy.generation.stop_token_ids", "policy.generation.stop_strings",
    // data / env selection
    "data.max_input_seq_length", "data.shuffle", "data.default.env_name", "data.train.env_name",
    nullptr};

const rlh_component_desc kGrpo = rlh::sdk::component_desc(
    RLH_KIND_ALGORITHM, "grpo", "0.1.0", RLH_ALGORITHM_API_VERSION_MAJOR, RLH_ALGORITHM_API_VERSION_MINOR,
    &kApi, "GRPO (NeMo-RL's grpo_train): rollouts, rewards, advantages, ClippedPG training, validation, checkpoints",
    kKeys);

const rlh_component_desc* const kComponents[] = {&kGrpo};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("grpo", "0.1.0", "rlhost", kComponents,
                                        "GRPO-family algorithms over rlhost backends, generators and environments"))
