// Sampling one token from one row of logits, and its processed logprob, as vLLM's V1 sampler
// and NeMo-RL's trainer define them.
//
// temperature > 0 (random sampling), in vLLM's order:
//   z = logits / temperature                       (float, as the trainer's kernel forms it)
//   min_p > 0:  drop tokens with p < min_p * p_max, i.e. z < max(z) + log(min_p)
//   top_k > 0:  keep z >= the k-th largest z (ties at the cut are kept)
//   top_p < 1:  in descending order keep a token while the probability mass of the tokens before
//               it (renormalised over what top-k kept) is < top_p; the largest is always kept
//   the token is drawn from softmax over the kept set by inverse CDF with one uniform u (rng.hpp)
//   logprob = z[token] - logsumexp(z over the kept set)   ("processed" logprob)
// The top-k/top-p cut is kernels_cpu's linear_logprob filter (logprob.cpp, filter_threshold)
// reproduced exactly — same selection, same double-precision mass walk, same tie rule — so the
// trainer's processed logprob of a sampled token is never -inf; test_sampling holds the two
// against each other on rows with ties, flat and peaked distributions.
// min_p has no trainer counterpart in NeMo-RL: with min_p > 0 the logprobs include its cut (as
// vLLM's processed logprobs do) and a trainer without min_p differs on the tokens it cut.
//
// temperature == 0 (greedy): the token is argmax(logits) (the lowest id among equal maxima, as
// torch.argmax) and its logprob is that of the unfiltered softmax at temperature 1, which is what
// vLLM reports for greedy requests; the trainer matches it with temperature 1 and no filter.
#pragma once

#include <cstdint>

namespace rlh::gen {

struct SamplingParams {
  double temperature = 1.0;  // 0 = greedy
  int64_t top_k = 0;         // 0 (or -1, vLLM's "off") = off; >= vocabulary = off
  double top_p = 1.0;        // 1 = off
  double min_p = 0.0;        // 0 = off
  bool greedy() const { return temperature == 0.0; }
};

// Throws std::invalid_argument naming the field: temperature < 0 or not finite, top_k < -1,
// top_p outside (0, 1], min_p outside [0, 1].
void validate(const SamplingParams& p);

struct Sampled {
  int32_t token = -1;
  float logprob = 0.f;
};

// Floats of scratch sample_row needs for a vocabulary of V.
inline int64_t sample_scratch_floats(int64_t V) { return 3 * V; }

// Samples from one row of raw logits [V] with uniform u in [0, 1) (ignored when greedy).
// `scratch` holds sample_scratch_floats(V) floats. Pure: the result depends only on the inputs.
Sampled sample_row(const float* logits, int64_t V, const SamplingParams& p, double u,
                   float* scratch);

// The kept-set threshold of kernels_cpu's filter: tokens with z >= the returned value survive
// top_k then top_p (-inf when nothing is cut). `tmp` holds V floats. Exposed for tests.
float filter_threshold(const float* z, int64_t V, int64_t top_k, double top_p, float* tmp);

}  // namespace rlh::gen
