// Training on preference pairs, NeMo-RL's dpo_train and rm_train on rlhost components: each
// preference row (context, chosen and rejected completions; dataset_jsonl's preference rows)
// becomes two sequences, chosen then rejected, with the loss mask on the completion. A step takes
// train_global_batch_size pairs and runs one optimizer step with RLH_BATCH_KEEP_PAIRS, so
// micro-batches hold whole pairs:
//   dpo  reference logprobs from a frozen copy of the starting model (the backend's forward on a
//        second, non-trainable model), then DPOLossFn (rlh_grpo_core's dpo_loss);
//   rm   a reward model (the policy loaded with a value head: policy.reward_model_cfg.enabled)
//        trained with PreferenceLossFn, the Bradley-Terry loss on the value at each sequence's
//        last token (rlh_grpo_core's preference_loss).
// Validation (eval-only steps) logs validation-default/<metric>; checkpoints are step_N/ folders
// whose policy/ is a loadable HF model folder (an rm's as *ForSequenceClassification), and a
// resumed run continues bitwise.
#pragma once

#include <memory>
#include <string>

#include "rlhost/sdk/plugin.hpp"

namespace rlh::grpo {

enum class PreferenceAlgorithm { dpo, rm };

class PreferenceLoop {
 public:
  PreferenceLoop(const sdk::Host& host, const std::string& config_text, PreferenceAlgorithm algorithm);
  ~PreferenceLoop();
  PreferenceLoop(const PreferenceLoop&) = delete;
  PreferenceLoop& operator=(const PreferenceLoop&) = delete;
  void run();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace rlh::grpo
