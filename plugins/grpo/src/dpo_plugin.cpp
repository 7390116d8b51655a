// The dpo plugin: the ALGORITHM component `dpo` (NeMo-RL's dpo_train over rlhost components).
// A plugin of its own built from plugins/grpo, as sft is: it shares the loop pieces (components,
// checkpoints, data order) and rlh_grpo_core's DPOLossFn, and loading `grpo` never brings it along.
#include <memory>
#include <string>

#include "rlhost/algorithm.h"
#include "rlhost/sdk/plugin.hpp"
#include "preference_loop.hpp"
#include "loop_algorithm.hpp"

namespace {

std::unique_ptr<rlh::grpo::PreferenceLoop> make(const rlh::sdk::Host& host, const std::string& config) {
  return std::make_unique<rlh::grpo::PreferenceLoop>(host, config, rlh::grpo::PreferenceAlgorithm::dpo);
}
constexpr char kName[] = "dpo";
const rlh_algorithm_api& kApi = rlh::grpo::LoopAlgorithm<rlh::grpo::PreferenceLoop, make, kName>::api;

const char* const kKeys[] = {
    "dpo.max_num_epochs", "dpo.max_num_steps", "dpo.val_period", "dpo.val_batches", "dpo.val_global_batch_size",
    "dpo.val_micro_batch_size", "dpo.val_at_start", "dpo.val_at_end", "dpo.seed",
    "dpo.reference_policy_kl_penalty", "dpo.preference_average_log_probs", "dpo.sft_average_log_probs",
    "dpo.preference_loss_weight", "dpo.sft_loss_weight",
    "checkpointing.enabled", "checkpointing.checkpoint_dir", "checkpointing.metric_name",
    "checkpointing.higher_is_better", "checkpointing.keep_top_k", "checkpointing.save_period",
    "checkpointing.ft_keep_latest_k", "checkpointing.ft_save_period", "checkpointing.checkpoint_must_save_by", "checkpointing.model_save_format", "checkpointing.model_save_dtype",
    "policy.model_name", "policy.tokenizer.name", "policy.tokenizer.chat_template",
    "policy.tokenizer.chat_template_kwargs",
    "policy.train_global_batch_size", "policy.train_micro_batch_size", "policy.max_total_sequence_length",
    "policy.dtensor_cfg.enabled", "policy.megatron_cfg.enabled", "policy.sequence_packing.enabled",
    "policy.sequence_packing.train_mb_tokens", "policy.dynamic_batching.enabled",
    "policy.dynamic_batching.train_mb_tokens", "data.shuffle", "data.max_input_seq_length", nullptr};

const rlh_component_desc kDpo = rlh::sdk::component_desc(
    RLH_KIND_ALGORITHM, "dpo", "0.1.0", RLH_ALGORITHM_API_VERSION_MAJOR, RLH_ALGORITHM_API_VERSION_MINOR, &kApi,
    "DPO (NeMo-RL's dpo_train): preference pairs, frozen reference, DPOLossFn, validation, step_N checkpoints", kKeys);

const rlh_component_desc* const kComponents[] = {&kDpo};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("dpo", "0.1.0", "rlhost", kComponents,
                                        "direct preference optimization over rlhost backends"))
