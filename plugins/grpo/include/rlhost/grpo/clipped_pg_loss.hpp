// NeMo-RL's ClippedPGLossFn: the math is the SDK's loss library (rlhost/losses/clipped_pg_loss.hpp, shared with kernels_cpu's reference op); this plugin reads its config.
#pragma once

#include "rlhost/losses/clipped_pg_loss.hpp"
#include "rlhost/grpo/kl.hpp"
#include "rlhost/grpo/metrics.hpp"
#include "rlhost/grpo/packing.hpp"

#include <nlohmann/json_fwd.hpp>

namespace rlh::grpo {
using losses::TruncatedIsType;
using losses::truncated_is_name;
using losses::ClippedPGConfig;
using losses::ClippedPGInputs;
using losses::LossResult;
using losses::positive_valid_tokens;
using losses::clipped_pg_loss;

// Reads NeMo-RL's loss_fn section (absent keys keep ClippedPGConfig's defaults) and validates it;
// ConfigError names the key.
ClippedPGConfig clipped_pg_config_from_json(const nlohmann::json& loss_fn);
}  // namespace rlh::grpo
