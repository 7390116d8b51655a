// Packed layouts and the token/output frames: the SDK's loss library (rlhost/losses/packing.hpp).
#pragma once

#include "rlhost/losses/packing.hpp"

namespace rlh::grpo {
using losses::Packing;
using losses::validate;
using losses::LossFrame;
using losses::make_loss_frame;
using losses::gather_field;
using losses::gather_output;
using losses::to_output_frame;
using losses::to_token_frame;
using losses::scatter_output;
using losses::ValidCounts;
using losses::valid_counts;
using losses::broadcast_to_tokens;
}  // namespace rlh::grpo
