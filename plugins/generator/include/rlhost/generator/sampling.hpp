// The sampling parameters of a request. The draw itself is the kernel registry's `sample` op
// (docs/ops.md; kernels_cpu: sample.cpp), one token per row of logits with the row's uniform
// from rng.hpp, as vLLM's V1 sampler and NeMo-RL's trainer define it:
//
// temperature > 0 (random sampling), in vLLM's order:
//   z = logits / temperature                       (float, as the trainer's kernel forms it)
//   min_p > 0:  drop tokens with p < min_p * p_max, i.e. z < max(z) + log(min_p)
//   top_k > 0:  keep z >= the k-th largest z (ties at the cut are kept)
//   top_p < 1:  in descending order keep a token while the probability mass of the tokens before
//               it (renormalised over what top-k kept) is < top_p; the largest is always kept
//   the token is drawn from softmax over the kept set by inverse CDF with one uniform u (rng.hpp)
//   logprob = z[token] - logsumexp(z over the kept set)   ("processed" logprob)
// kernels_cpu cuts top-k/top-p with the code of its linear_logprob filter (the same selection,
// double-precision mass walk and tie rule), so the trainer's processed logprob of a sampled
// token is never -inf; tests/kernels holds the two against each other.
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

}  // namespace rlh::gen
