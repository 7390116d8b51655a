// Configuration errors of the RL losses (and of the grpo plugin's configs, which reuse them).
//
// Every config struct here is read from NeMo-RL's section (loss_fn, dpo, grpo, ...) as JSON, with
// NeMo-RL's defaults for absent keys. Keys this library does not know are left alone (NeMo-RL's
// pydantic models allow extras; the host reports unknown keys). A key of the wrong type, an
// invalid value or an invalid combination throws ConfigError with one line naming the key, e.g.
//   loss_fn.ratio_clip_min: expected a number, got string "0.2"
//   loss_fn: sequence_level_importance_ratios (GSPO) is mutually exclusive with token_level_loss
#pragma once

#include <stdexcept>
#include <string>

namespace rlh::losses {

// An invalid configuration; what() is one line. A std::invalid_argument, so the SDK's guard()
// turns it into RLH_E_INVALID_ARGUMENT.
class ConfigError : public std::invalid_argument {
 public:
  explicit ConfigError(const std::string& msg) : std::invalid_argument(msg) {}
};

}  // namespace rlh::losses
