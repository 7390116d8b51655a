// Per-token KL estimators (Schulman's k1/k2/k3), as NeMo-RL's calculate_kl computes them.
//
// With logr = lp_ref - lp (clamped to [-in_clamp, in_clamp] when an input clamp is set):
//   k1 = -logr,   k2 = logr^2 / 2,   k3 = exp(logr) - 1 - logr
// An optional importance weight W multiplies the estimate before the output clamp
// ([-out_clamp, out_clamp]). Gradients follow PyTorch's autograd of that expression: a clamp
// passes the gradient only inside its closed interval, and where the input clamp is active the
// weight is detached (so the clamp silences both the estimator's and the weight's gradient).
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace rlh::losses {

enum class KlType { kK1, kK2, kK3 };

// "k1" | "k2" | "k3"; anything else throws ConfigError naming `key`.
KlType parse_kl_type(std::string_view s, std::string_view key);
const char* kl_type_name(KlType t);

// The estimator at logr, and its derivative d/d logr.
double kl_estimator(KlType t, double logr);
double kl_estimator_dlogr(KlType t, double logr);

// calculate_kl without weights or clamps (the mismatch diagnostics): K(lp_ref - lp).
double kl_plain(KlType t, double lp, double lp_ref);

// One token of the KL penalty before the coefficient: value = clamp_out(W * K(clamp_in(logr))),
// and its derivative with respect to lp, given the weight's value `w` and its derivative
// `dw_dlp` (the caller applies nan_to_num semantics: a non-finite weight arrives as w = 0,
// dw_dlp = 0).
struct KlToken {
  double value = 0;
  double d_lp = 0;
};
KlToken kl_token(KlType t, double lp, double lp_ref, std::optional<double> input_clamp,
                 std::optional<double> output_clamp, double w, double dw_dlp);

}  // namespace rlh::losses
