// NeMo-RL's NLLLossFn: the SDK's loss library (rlhost/losses/nll_loss.hpp).
#pragma once

#include "rlhost/losses/nll_loss.hpp"
#include "rlhost/grpo/clipped_pg_loss.hpp"

namespace rlh::grpo {
using losses::NllInputs;
using losses::nll_loss;
using losses::per_sample_nll;
}  // namespace rlh::grpo
