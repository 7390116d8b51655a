// Train/generation mismatch diagnostics that NeMo-RL's ClippedPGLossFn always logs, on the loss
// frame (one entry per loss position, see packing.hpp). `mask` = token_mask * sample_mask; every
// value is a sum over masked positions divided by (global_valid_toks + 1e-8), so it sums over
// micro-batches to the step's mean.
//
//   token_mult_prob_error = mean exp(|lp_gen - lp_prev|)
//   gen_kl_error          = mean K(lp_prev - lp_gen)     K = the configured k1/k2/k3, no clamps
//   policy_kl_error       = mean K(lp_gen - lp_prev)
//   js_divergence_error   = mean ½ k3-form KL(P_prev‖M) + ½ KL(P_gen‖M), M = ½(p_prev + p_gen)
//   approx_entropy        = -mean exp(lp - lp_gen) · lp
#pragma once

#include <span>

#include "rlhost/losses/kl.hpp"
#include "rlhost/losses/metrics.hpp"

namespace rlh::losses {

struct MismatchDiagnostics {
  double token_mult_prob_error = 0;
  double gen_kl_error = 0;
  double policy_kl_error = 0;
  double js_divergence_error = 0;
  // rlhost: mean |lp_gen - lp_old| over the valid tokens (summable: divided by the global count),
  // and its largest value (0 when no token is valid): the train/generation parity the generator's
  // precision is judged by (docs/generator.md).
  double logprob_abs_error = 0;
  double logprob_abs_error_max = 0;
};

MismatchDiagnostics mismatch_diagnostics(std::span<const double> prev_lp,
                                         std::span<const double> gen_lp,
                                         std::span<const double> mask, double global_valid_toks,
                                         KlType kl_type);

double approx_entropy(std::span<const double> lp, std::span<const double> gen_lp,
                      std::span<const double> mask, double global_valid_toks);

// Adds the four mismatch diagnostics to `m` under NeMo-RL's names, and rlhost's
// logprob_abs_error (summed) and logprob_abs_error_max (a maximum).
void add_mismatch_metrics(Metrics& m, const MismatchDiagnostics& d);

}  // namespace rlh::losses
