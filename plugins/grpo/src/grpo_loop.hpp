// The GRPO training loop, NeMo-RL's grpo_train on rlhost components:
//
//   prompts (dataset, seeded epoch order) -> refit the generator from the backend's policy
//   -> num_generations_per_prompt responses per prompt -> rewards (environment) -> scaling,
//   shaping, DAPO dynamic sampling -> GRPO advantages -> logprobs under the current policy
//   (prev_logprobs) and the reference policy -> optimizer step(s) with the ClippedPG loss
//   (global token/sequence counts per global batch) -> metrics -> validation every val_period
//   -> a step_N/ checkpoint every save_period (and at the end), keep_top_k by metric_name.
//
// A run resumes from the newest complete checkpoint in checkpointing.checkpoint_dir: weights,
// optimizer state and step come back through the backend's load_state, the data position from
// training_info.json; generation draws from a counter-based RNG keyed by (seed, step, prompt,
// sample), so a resumed run continues exactly as the uninterrupted one would have.
#pragma once

#include <memory>
#include <string>

#include "rlhost/sdk/plugin.hpp"

namespace rlh::grpo {

class GrpoLoop {
 public:
  // `config_text`: the whole resolved configuration (JSON). Reads and checks it; creates nothing.
  // `algorithm`: "grpo", or "ppo" (NeMo-RL's ppo.py: the same loop with a critic and GAE; see
  // ppo_critic.hpp).
  GrpoLoop(const sdk::Host& host, const std::string& config_text, const std::string& algorithm = "grpo");
  ~GrpoLoop();
  GrpoLoop(const GrpoLoop&) = delete;
  GrpoLoop& operator=(const GrpoLoop&) = delete;

  // Creates the components and runs to completion; throws rlh::sdk::Error (RLH_E_CANCELLED when
  // the host asks to stop).
  void run();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace rlh::grpo
