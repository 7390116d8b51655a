// The rm plugin: the ALGORITHM component `rm` (NeMo-RL's rm_train over rlhost components): a
// Bradley-Terry reward model trained on preference pairs. A plugin of its own built from
// plugins/grpo, as dpo is: it shares the preference loop with dpo (preference_loop.cpp) and
// rlh_grpo_core's PreferenceLossFn, and loading `grpo` or `dpo` never brings it along.
#include <memory>
#include <string>

#include "rlhost/algorithm.h"
#include "rlhost/sdk/plugin.hpp"
#include "preference_loop.hpp"
#include "loop_algorithm.hpp"

namespace {

std::unique_ptr<rlh::grpo::PreferenceLoop> make(const rlh::sdk::Host& host, const std::string& config) {
  return std::make_unique<rlh::grpo::PreferenceLoop>(host, config, rlh::grpo::PreferenceAlgorithm::rm);
}
constexpr char kName[] = "rm";
const rlh_algorithm_api& kApi = rlh::grpo::LoopAlgorithm<rlh::grpo::PreferenceLoop, make, kName>::api;

const char* const kKeys[] = {
    "rm.max_num_epochs", "rm.max_num_steps", "rm.val_period", "rm.val_batches", "rm.val_global_batch_size",
    "rm.val_micro_batch_size", "rm.val_at_start", "rm.val_at_end", "rm.seed",
    "policy.reward_model_cfg.enabled", "policy.reward_model_cfg.reward_model_type",
    "checkpointing.enabled", "checkpointing.checkpoint_dir", "checkpointing.metric_name",
    "checkpointing.higher_is_better", "checkpointing.keep_top_k", "checkpointing.save_period",
    "checkpointing.ft_keep_latest_k", "checkpointing.ft_save_period", "checkpointing.checkpoint_must_save_by", "checkpointing.model_save_format", "checkpointing.model_save_dtype",
    "policy.model_name", "policy.tokenizer.name", "policy.tokenizer.chat_template",
    "policy.tokenizer.chat_template_kwargs",
    "policy.train_global_batch_size", "policy.train_micro_batch_size", "policy.max_total_sequence_length",
    "policy.dtensor_cfg.enabled", "policy.megatron_cfg.enabled", "policy.sequence_packing.enabled",
    "policy.sequence_packing.train_mb_tokens", "policy.dynamic_batching.enabled",
    "policy.dynamic_batching.train_mb_tokens", "data.shuffle", "data.max_input_seq_length", nullptr};

const rlh_component_desc kRm = rlh::sdk::component_desc(
    RLH_KIND_ALGORITHM, "rm", "0.1.0", RLH_ALGORITHM_API_VERSION_MAJOR, RLH_ALGORITHM_API_VERSION_MINOR, &kApi,
    "reward model (NeMo-RL's rm_train): Bradley-Terry PreferenceLossFn on the value head, validation, step_N "
    "checkpoints",
    kKeys);

const rlh_component_desc* const kComponents[] = {&kRm};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("rm", "0.1.0", "rlhost", kComponents,
                                        "Bradley-Terry reward models over rlhost backends"))
