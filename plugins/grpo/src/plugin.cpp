// The grpo plugin: the ALGORITHM component `grpo` (NeMo-RL's GRPO loop over rlhost components).
//
// It owns the NeMo-RL keys it implements, one by one rather than whole sections, so the host's
// key check still reports NeMo-RL keys the loop does not use (a warning) and typos (an error with
// the closest key).
#include <memory>
#include <string>

#include "grpo_loop.hpp"
#include "loop_algorithm.hpp"
#include "loop_keys.hpp"
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
    "grpo.val_batch_size", "grpo.max_val_samples", "grpo.overlong_filtering", "grpo.seq_logprob_error_threshold", "grpo.val_start_at", "grpo.stop_at_validation_metric", "grpo.stop_at_validation_threshold",
    "grpo.use_dynamic_sampling", "grpo.batch_multiplier", "grpo.dynamic_sampling_max_gen_batches",
    "grpo.reward_shaping.*", "grpo.reward_scaling.*", "grpo.adv_estimator.name",
    "grpo.adv_estimator.normalize_rewards", "grpo.adv_estimator.use_leave_one_out_baseline",
    "grpo.async_grpo.enabled", "grpo.async_grpo.max_trajectory_age_steps", "grpo.async_grpo.in_flight_weight_updates",
    "grpo.async_grpo.max_generation_failures", "policy.generation.colocated.enabled",
    "policy.generation.colocated.resources.gpus_per_node", "policy.generation.colocated.resources.num_nodes",
    "grpo.seed", "grpo.skip_reference_policy_logprobs_calculation",
    "grpo.advantage_clip_low", "grpo.advantage_clip_high", "grpo.use_kl_in_reward",
    RLH_GRPO_LOOP_SHARED_KEYS
    nullptr};

const rlh_component_desc kGrpo = rlh::sdk::component_desc(
    RLH_KIND_ALGORITHM, "grpo", "0.1.0", RLH_ALGORITHM_API_VERSION_MAJOR, RLH_ALGORITHM_API_VERSION_MINOR,
    &kApi, "GRPO (NeMo-RL's grpo_train): rollouts, rewards, advantages, ClippedPG training, validation, checkpoints",
    kKeys);

const rlh_component_desc* const kComponents[] = {&kGrpo};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("grpo", "0.1.0", "rlhost", kComponents,
                                        "GRPO-family algorithms over rlhost backends, generators and environments"))
