// The configuration keys the GRPO loop reads whatever its section (grpo.* or ppo.*): the ClippedPG
// loss, checkpointing, what the loop reads of policy.*, data and env selection. The grpo and ppo
// plugins list their own section's keys before these (plugin.cpp, ppo_plugin.cpp).
#pragma once

// clang-format off
#define RLH_GRPO_LOOP_SHARED_KEYS \
    /* loss_fn (ClippedPGLossFn) */ \
    "loss_fn.reference_policy_kl_penalty", "loss_fn.reference_policy_kl_type", \
    "loss_fn.kl_input_clamp_value", "loss_fn.kl_output_clamp_value", "loss_fn.ratio_clip_min", \
    "loss_fn.ratio_clip_max", "loss_fn.ratio_clip_c", "loss_fn.use_on_policy_kl_approximation", \
    "loss_fn.use_importance_sampling_correction", "loss_fn.truncated_importance_sampling_ratio", \
    "loss_fn.truncated_importance_sampling_ratio_min", "loss_fn.truncated_importance_sampling_type", \
    "loss_fn.sequence_level_importance_ratios", "loss_fn.token_level_loss", \
    "loss_fn.disable_ppo_ratio", "loss_fn.force_on_policy_ratio", "loss_fn.use_cispo", \
    "loss_fn.positive_example_nll_weight", "loss_fn.use_kl_in_reward", "loss_fn.constant_normalizer", \
    /* checkpointing */ \
    "checkpointing.enabled", "checkpointing.checkpoint_dir", "checkpointing.metric_name", \
    "checkpointing.higher_is_better", "checkpointing.keep_top_k", "checkpointing.save_period", \
    "checkpointing.ft_keep_latest_k", "checkpointing.ft_save_period", "checkpointing.checkpoint_must_save_by", "checkpointing.model_save_format", "checkpointing.model_save_dtype", \
    /* policy: what the loop reads */ \
    "policy.model_name", "policy.tokenizer.name", "policy.tokenizer.chat_template", "policy.tokenizer.chat_template_kwargs", \
    "policy.train_global_batch_size", "policy.train_micro_batch_size", "policy.logprob_batch_size", \
    "policy.max_total_sequence_length", "policy.dtensor_cfg.enabled", "policy.megatron_cfg.enabled", \
    "policy.sequence_packing.enabled", "policy.sequence_packing.train_mb_tokens", \
    "policy.sequence_packing.logprob_mb_tokens", "policy.dynamic_batching.enabled", \
    "policy.dynamic_batching.train_mb_tokens", "policy.dynamic_batching.logprob_mb_tokens", \
    "policy.generation.backend", "policy.generation.max_new_tokens", "policy.generation.temperature", \
    "policy.generation.top_p", "policy.generation.top_k", "policy.generation.min_p", \
    "policy.generation.val_temperature", "policy.generation.val_top_p", "policy.generation.val_top_k", \
    "policy.generation.stop_token_ids", "policy.generation.stop_strings", \
    /* data / env selection */ \
    "data.max_input_seq_length", "data.shuffle", "data.default.env_name", "data.train.env_name",
// clang-format on
