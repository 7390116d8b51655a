// DPO, NeMo-RL's dpo_train on rlhost components: each preference row (context, chosen and
// rejected completions; dataset_jsonl's preference rows) becomes two sequences, chosen then
// rejected, with the loss mask on the completion. A step takes train_global_batch_size pairs:
// reference logprobs from a frozen copy of the starting model (the backend's forward on a second,
// non-trainable model), then one optimizer step of DPOLossFn (rlh_grpo_core's dpo_loss through
// the loss adapter) with RLH_BATCH_KEEP_PAIRS, so micro-batches hold whole pairs. Validation
// (eval-only steps) logs validation-default/<metric>; checkpoints are step_N/ folders whose
// policy/ is a loadable HF model folder, and a resumed run continues bitwise.
#pragma once

#include <memory>
#include <string>

#include "rlhost/sdk/plugin.hpp"

namespace rlh::grpo {

class DpoLoop {
 public:
  DpoLoop(const sdk::Host& host, const std::string& config_text);
  ~DpoLoop();
  DpoLoop(const DpoLoop&) = delete;
  DpoLoop& operator=(const DpoLoop&) = delete;
  void run();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace rlh::grpo
