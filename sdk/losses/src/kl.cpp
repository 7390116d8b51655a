// Per-token KL estimators and their gradients (see kl.hpp).
#include "rlhost/losses/kl.hpp"

#include <algorithm>
#include <cmath>

#include "rlhost/losses/config_error.hpp"

namespace rlh::losses {

KlType parse_kl_type(std::string_view s, std::string_view key) {
  if (s == "k1") return KlType::kK1;
  if (s == "k2") return KlType::kK2;
  if (s == "k3") return KlType::kK3;
  throw ConfigError(std::string(key) + ": expected \"k1\", \"k2\" or \"k3\", got \"" +
                    std::string(s) + "\"");
}

const char* kl_type_name(KlType t) {
  switch (t) {
    case KlType::kK1: return "k1";
    case KlType::kK2: return "k2";
    case KlType::kK3: return "k3";
  }
  return "?";
}

double kl_estimator(KlType t, double logr) {
  switch (t) {
    case KlType::kK1: return -logr;
    case KlType::kK2: return logr * logr / 2;
    case KlType::kK3: return std::exp(logr) - 1 - logr;
  }
  return 0;
}

double kl_estimator_dlogr(KlType t, double logr) {
  switch (t) {
    case KlType::kK1: return -1;
    case KlType::kK2: return logr;
    case KlType::kK3: return std::exp(logr) - 1;
  }
  return 0;
}

double kl_plain(KlType t, double lp, double lp_ref) { return kl_estimator(t, lp_ref - lp); }

KlToken kl_token(KlType t, double lp, double lp_ref, std::optional<double> input_clamp,
                 std::optional<double> output_clamp, double w, double dw_dlp) {
  double logr = lp_ref - lp;
  double dlogr_dlp = -1;
  if (input_clamp) {
    const double c = *input_clamp;
    const double clamped = std::clamp(logr, -c, c);
    // torch.where(logr == logr_clamped, w, w.detach()): outside the interval (or for NaN) the
    // weight is detached; clamp's own gradient is zero there too.
    if (!(logr == clamped)) {
      dw_dlp = 0;
      dlogr_dlp = 0;
    }
    // std::clamp returns NaN for a NaN input, as torch.clamp does.
    logr = clamped;
  }
  const double k = kl_estimator(t, logr);
  const double dk_dlp = kl_estimator_dlogr(t, logr) * dlogr_dlp;
  KlToken out;
  out.value = w * k;
  out.d_lp = dw_dlp * k + w * dk_dlp;
  if (output_clamp) {
    const double c = *output_clamp;
    const double v = out.value;
    if (!(v >= -c && v <= c)) out.d_lp = 0;  // torch.clamp backward: (x >= min) & (x <= max)
    out.value = std::isnan(v) ? v : std::clamp(v, -c, c);
  }
  return out;
}

}  // namespace rlh::losses
