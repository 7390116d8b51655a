// Supervised fine-tuning, NeMo-RL's sft_train on rlhost components: rows of a dataset (prompt
// and answer) become prompt + answer + EOS token sequences with the loss mask on the answer, and
// each step is one optimizer step of the NLL loss (rlh_grpo_core's NLLLossFn through the loss
// adapter) over train_global_batch_size rows, normalised by the global count of answer tokens.
// Validation (eval-only steps) every sft.val_period steps gives validation/val_loss; checkpoints
// are the GRPO loop's step_N/ folders, and policy/ in them is a loadable HF model folder, so an
// SFT run can be the starting point of a GRPO run.
#pragma once

#include <memory>
#include <string>

#include "rlhost/sdk/plugin.hpp"

namespace rlh::grpo {

class SftLoop {
 public:
  SftLoop(const sdk::Host& host, const std::string& config_text);
  ~SftLoop();
  SftLoop(const SftLoop&) = delete;
  SftLoop& operator=(const SftLoop&) = delete;
  void run();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace rlh::grpo
