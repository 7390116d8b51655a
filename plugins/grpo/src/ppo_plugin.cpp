// The ppo plugin: the ALGORITHM component `ppo`, NeMo-RL's PPO with a critic (ppo.py), built on
// the GRPO loop (grpo_loop.hpp) with the critic and GAE of ppo_critic.hpp. Its own module so
// that loading grpo loads one algorithm.
#include <memory>
#include <string>

#include "grpo_loop.hpp"
#include "loop_algorithm.hpp"
#include "loop_keys.hpp"
#include "rlhost/algorithm.h"
#include "rlhost/sdk/plugin.hpp"

namespace {

std::unique_ptr<rlh::grpo::GrpoLoop> make(const rlh::sdk::Host& host, const std::string& config) {
  return std::make_unique<rlh::grpo::GrpoLoop>(host, config, "ppo");
}
constexpr char kName[] = "ppo";
const rlh_algorithm_api& kApi = rlh::grpo::LoopAlgorithm<rlh::grpo::GrpoLoop, make, kName>::api;

// What the loop reads under ppo.*, value.* and value_loss_fn.*, then what it shares with grpo.
// The backend reads the critic's optimizer, scheduler, precision and backend settings from the
// value section patched over the policy's (host/data/nemo_rl_support.tsv names each key's rule).
const char* const kKeys[] = {
    // ppo
    "ppo.num_prompts_per_step", "ppo.num_generations_per_prompt", "ppo.max_rollout_turns", "ppo.max_num_epochs",
    "ppo.max_num_steps", "ppo.val_period", "ppo.val_at_start", "ppo.val_at_end", "ppo.val_batch_size",
    "ppo.max_val_samples", "ppo.overlong_filtering", "ppo.seq_logprob_error_threshold", "ppo.use_dynamic_sampling", "ppo.batch_multiplier",
    "ppo.dynamic_sampling_max_gen_batches", "ppo.reward_shaping.*", "ppo.reward_scaling.*", "ppo.adv_estimator.*",
    "ppo.async_ppo.enabled", "ppo.async_ppo.max_trajectory_age_steps", "ppo.async_ppo.in_flight_weight_updates",
    "ppo.async_ppo.max_generation_failures", "ppo.async_ppo.drop_incomplete_targets_on_restore",
    "ppo.async_ppo.warmup_generation_lead_steps", "ppo.seed", "ppo.skip_reference_policy_logprobs_calculation", "ppo.ppo_epochs",
    "ppo.policy_training_start_step", "policy.generation.colocated.enabled",
    "policy.generation.colocated.resources.gpus_per_node", "policy.generation.colocated.resources.num_nodes",
    // the critic
    "value.model_name", "value.tokenizer.name", "value.train_global_batch_size", "value.train_micro_batch_size",
    "value.max_total_sequence_length", "value.reward_model_cfg.enabled", "value.reward_model_cfg.reward_model_type",
    "value.dtensor_cfg.enabled", "value.megatron_cfg.enabled", "value.sequence_packing.enabled",
    "value.sequence_packing.train_mb_tokens", "value.dynamic_batching.enabled", "value.dynamic_batching.train_mb_tokens",
    "value_loss_fn.scale", "value_loss_fn.cliprange",
    RLH_GRPO_LOOP_SHARED_KEYS
    nullptr};

const rlh_component_desc kPpo = rlh::sdk::component_desc(
    RLH_KIND_ALGORITHM, "ppo", "0.1.0", RLH_ALGORITHM_API_VERSION_MAJOR, RLH_ALGORITHM_API_VERSION_MINOR, &kApi,
    "PPO with a critic (NeMo-RL's ppo.py): GRPO's rollouts with a colocated value model, GAE, clipped value loss",
    kKeys);

const rlh_component_desc* const kComponents[] = {&kPpo};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("ppo", "0.1.0", "rlhost", kComponents,
                                        "PPO with a critic over rlhost backends, generators and environments"))
