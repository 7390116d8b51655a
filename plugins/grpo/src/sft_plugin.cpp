// The sft plugin: the ALGORITHM component `sft` (NeMo-RL's sft_train over rlhost components).
// A plugin of its own (built from plugins/grpo, sharing its loop pieces) so that loading `grpo`
// never brings a second algorithm along: the host asks for rlhost.algorithm when two are loaded.
#include <memory>
#include <string>

#include "rlhost/algorithm.h"
#include "rlhost/sdk/plugin.hpp"
#include "sft_loop.hpp"
#include "loop_algorithm.hpp"

namespace {

std::unique_ptr<rlh::grpo::SftLoop> make(const rlh::sdk::Host& host, const std::string& config) {
  return std::make_unique<rlh::grpo::SftLoop>(host, config);
}
constexpr char kName[] = "sft";
const rlh_algorithm_api& kApi = rlh::grpo::LoopAlgorithm<rlh::grpo::SftLoop, make, kName>::api;

const char* const kKeys[] = {
    "sft.max_num_epochs", "sft.max_num_steps", "sft.val_period", "sft.val_batches",
    "sft.val_global_batch_size", "sft.val_at_start", "sft.val_at_end", "sft.seed", "sft.only_unmask_final",
    "checkpointing.enabled", "checkpointing.checkpoint_dir", "checkpointing.metric_name",
    "checkpointing.higher_is_better", "checkpointing.keep_top_k", "checkpointing.save_period",
    "checkpointing.ft_keep_latest_k", "checkpointing.ft_save_period", "checkpointing.checkpoint_must_save_by", "checkpointing.model_save_format", "checkpointing.model_save_dtype",
    "policy.model_name", "policy.tokenizer.name", "policy.tokenizer.chat_template",
    "policy.tokenizer.chat_template_kwargs",
    "policy.train_global_batch_size", "policy.train_micro_batch_size", "policy.max_total_sequence_length",
    "policy.dtensor_cfg.enabled", "policy.megatron_cfg.enabled", "policy.sequence_packing.enabled",
    "policy.sequence_packing.train_mb_tokens", "policy.dynamic_batching.enabled",
    "policy.dynamic_batching.train_mb_tokens", "data.shuffle", "data.add_bos", "data.add_eos",
    "data.add_generation_prompt", "data.max_input_seq_length", nullptr};

const rlh_component_desc kSft = rlh::sdk::component_desc(
    RLH_KIND_ALGORITHM, "sft", "0.1.0", RLH_ALGORITHM_API_VERSION_MAJOR, RLH_ALGORITHM_API_VERSION_MINOR, &kApi,
    "SFT (NeMo-RL's sft_train): NLL on answer tokens, validation loss, step_N checkpoints", kKeys);

const rlh_component_desc* const kComponents[] = {&kSft};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("sft", "0.1.0", "rlhost", kComponents,
                                        "supervised fine-tuning over rlhost backends"))
