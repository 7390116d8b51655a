// The generator's random numbers: a counter-based generator (Philox4x32-10, Salmon et al.,
// "Parallel random numbers: as easy as 1, 2, 3", SC'11), so the draw for a token is a pure
// function of (seed, step, prompt index, sample index, token index).
//
// Why counter-based: a sample must not change when the batch is split differently, run on
// another rank, preempted and recomputed, or scheduled in another order. A stateful generator
// shared by the batch would tie every draw to the order of all draws before it; here there is no
// state at all.
//
// Keying. Philox maps a 128-bit counter under a 64-bit key bijectively to 128 random bits:
//   counter = (token index, sample index, prompt index low 32 bits, prompt index high 32 bits)
//   key     = splitmix64(seed ^ splitmix64(step))
// so distinct tokens/samples/prompts of one (seed, step) never share a counter, and the
// (seed, step) pairs are spread over keys by a strong 64-bit mix. Token and sample indices are
// taken modulo 2^32 (a sequence of 4 billion tokens is not a concern).
#pragma once

#include <array>
#include <cstdint>

namespace rlh::gen {

// One Philox4x32-10 block: 10 rounds over `counter` with `key` (Random123's reference
// algorithm; tests check its known-answer vectors).
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// splitmix64's finaliser (Steele, Lea, Flood 2014): a bijective 64-bit mix.
uint64_t splitmix64(uint64_t x);

// Who draws: the RNG key of one sample of one prompt in one generate call.
struct DrawKey {
  uint64_t seed = 0;
  int64_t step = 0;
  int64_t prompt_index = 0;  // global index (first_prompt_index + local index)
  int64_t sample_index = 0;
};

// A uniform double in [0, 1) with 53 random bits, for the token at `token_index` (0 = the first
// new token) of the sample `key` names.
double uniform01(const DrawKey& key, int64_t token_index);

}  // namespace rlh::gen
