// Generation under tensor, context or pipeline parallelism (docs/parallelism.md, "The loops under
// model parallelism"). The ranks of one model-parallel group train on the same share of every
// batch, so each needs the same rollouts. Each rank's generator holds the full weights (refit
// through visit_weights, which gathers the pieces), so instead of every rank generating the whole
// share, the group's ranks split each generate call's prompts into contiguous parts, generate
// their part, and all-gather the samples over the group: every rank then sees every sample, in
// the same order, as if it had generated them alone. A prompt's samples are drawn from the
// generator's counter-based RNG keyed by (seed, step, first_prompt_index + prompt, sample), and
// each part keeps its prompts' indices, so the samples are those one rank draws.
#pragma once

#include "components.hpp"
#include "rlhost/sdk/comm.hpp"

namespace rlh::grpo {

// Sets `gen` to split its generate calls over `group` (kept by reference: it outlives `gen`); a
// no-op for an empty group or a group of one.
void split_generation_over(const sdk::Host& host, Generator& gen, const sdk::Comm& group);

// One generate call split over `group` (what split_generation_over installs). A failure on any
// rank fails the call on every rank, with that rank's message.
void generate_over_group(const sdk::Comm& group, Generator& gen, const rlh_generate_args& args, rlh_sample_fn fn,
                         void* user);

}  // namespace rlh::grpo
