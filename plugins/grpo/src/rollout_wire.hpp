// Rollouts as bytes, for ranks that share their generation: dynamic sampling at more than one
// data-parallel rank generates each batch across the ranks and gathers it whole on every rank, so
// the filter and the training batch are the one-rank ones (see grpo_loop.cpp's collect).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "rlhost/sdk/comm.hpp"
#include "rollout.hpp"

namespace rlh::grpo {

std::vector<uint8_t> serialize_rollout(const Rollout& r);
// `from` names the source in an error (malformed or truncated bytes).
Rollout deserialize_rollout(std::span<const uint8_t> bytes, const std::string& from);

// Concatenates rollouts of the same samples-per-prompt (responses stay prompt-major; their prompt
// indices shifted). `parts` is not empty.
Rollout merge_rollouts(std::vector<Rollout> parts);

// Every rank's rollout of one batch, concatenated in rank order (prompts and responses; the
// responses' prompt indices shifted). Collective over `c`; every rank's samples_per_prompt must
// be the same.
Rollout all_gather_rollout(const sdk::Comm& c, const Rollout& mine);

}  // namespace rlh::grpo
