// Mismatch diagnostics and metric bookkeeping (see diagnostics.hpp, metrics.hpp).
#include "rlhost/losses/diagnostics.hpp"

#include <algorithm>
#include <cmath>

namespace rlh::losses {

namespace {
constexpr double kEps = 1e-8;  // NeMo-RL's masked_mean adds it to the denominator

// log(0.5 e^a + 0.5 e^b) without overflow.
double log_mixture(double a, double b) {
  const double m = std::max(a, b);
  if (std::isinf(m) && m < 0) return m;
  return std::log(0.5) + m + std::log(std::exp(a - m) + std::exp(b - m));
}
}  // namespace

void Metrics::add(std::string_view name, double v, Reduce r) {
  for (Metric& m : items_) {
    if (m.name == name) {
      switch (m.reduce) {
        case Reduce::kSum: m.value += v; break;
        case Reduce::kMin: m.value = std::min(m.value, v); break;
        case Reduce::kMax: m.value = std::max(m.value, v); break;
      }
      return;
    }
  }
  items_.push_back(Metric{std::string(name), v, r});
}

void Metrics::merge(const Metrics& other) {
  for (const Metric& m : other.items()) add(m.name, m.value, m.reduce);
}

std::optional<double> Metrics::get(std::string_view name) const {
  for (const Metric& m : items_)
    if (m.name == name) return m.value;
  return std::nullopt;
}

MismatchDiagnostics mismatch_diagnostics(std::span<const double> prev_lp,
                                         std::span<const double> gen_lp,
                                         std::span<const double> mask, double global_valid_toks,
                                         KlType kl_type) {
  MismatchDiagnostics d;
  for (size_t q = 0; q < mask.size(); ++q) {
    const double m = mask[q];
    if (m == 0) continue;
    const double prev = prev_lp[q], gen = gen_lp[q];
    // NeMo-RL: exp(|gen - prev| * mask), then the masked mean.
    d.token_mult_prob_error += m * std::exp(std::abs(gen - prev) * m);
    d.gen_kl_error += m * kl_plain(kl_type, gen, prev);     // logr = prev - gen
    d.policy_kl_error += m * kl_plain(kl_type, prev, gen);  // logr = gen - prev
    d.logprob_abs_error += m * std::abs(gen - prev);
    d.logprob_abs_error_max = std::max(d.logprob_abs_error_max, std::abs(gen - prev));
    const double lm = log_mixture(prev, gen);
    const double a = prev - lm, b = gen - lm;
    d.js_divergence_error += m * (0.5 * (std::exp(a) - a - 1) + 0.5 * (std::exp(b) - b - 1));
  }
  const double denom = global_valid_toks + kEps;
  d.token_mult_prob_error /= denom;
  d.gen_kl_error /= denom;
  d.policy_kl_error /= denom;
  d.js_divergence_error /= denom;
  d.logprob_abs_error /= denom;
  return d;
}

double approx_entropy(std::span<const double> lp, std::span<const double> gen_lp,
                      std::span<const double> mask, double global_valid_toks) {
  double s = 0;
  for (size_t q = 0; q < mask.size(); ++q) {
    if (mask[q] == 0) continue;
    s += mask[q] * std::exp(lp[q] - gen_lp[q]) * lp[q];
  }
  return -s / (global_valid_toks + kEps);
}

void add_mismatch_metrics(Metrics& m, const MismatchDiagnostics& d) {
  m.sum("token_mult_prob_error", d.token_mult_prob_error);
  m.sum("gen_kl_error", d.gen_kl_error);
  m.sum("policy_kl_error", d.policy_kl_error);
  m.sum("js_divergence_error", d.js_divergence_error);
  m.sum("logprob_abs_error", d.logprob_abs_error);
  m.max("logprob_abs_error_max", d.logprob_abs_error_max);
}

}  // namespace rlh::losses
