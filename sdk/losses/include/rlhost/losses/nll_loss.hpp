// NeMo-RL's NLLLossFn (SFT): loss = -sum lp * token_mask[t+1] * sample_mask / global_valid_toks.
#pragma once

#include "rlhost/losses/metrics.hpp"
#include "rlhost/losses/packing.hpp"
#include "rlhost/losses/clipped_pg_loss.hpp"  // LossResult

namespace rlh::losses {

struct NllInputs {
  Packing packing;
  const double* logprobs = nullptr;     // output frame, differentiated
  const double* token_mask = nullptr;   // token frame
  const double* sample_mask = nullptr;  // per sequence
  double global_valid_toks = 0;
};

// Metrics: loss, num_unmasked_tokens (this call's sum of the mask), num_valid_samples.
LossResult nll_loss(const NllInputs& in, double* grad_logprobs);

// NeMo-RL's per-sample form (NLLLossFn with dpo_loss=True): nll_i = -sum_t lp * mask, divided by
// max(sum_t mask, 1) when `average`. Used by the DPO loss's SFT term.
std::vector<double> per_sample_nll(const LossFrame& f, const std::vector<double>& lp,
                                   const std::vector<double>& mask, bool average,
                                   std::vector<double>* d_scale = nullptr);

}  // namespace rlh::losses
