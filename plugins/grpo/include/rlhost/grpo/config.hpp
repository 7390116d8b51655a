// The GRPO family's configuration errors: the SDK's loss library's (rlhost/losses/config_error.hpp).
#pragma once

#include "rlhost/losses/config_error.hpp"

namespace rlh::grpo {
using losses::ConfigError;
}  // namespace rlh::grpo
