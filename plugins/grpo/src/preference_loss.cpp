// NeMo-RL's PreferenceLossFn (see preference_loss.hpp).
#include "rlhost/grpo/preference_loss.hpp"

#include <cmath>
#include <stdexcept>
#include <string>

namespace rlh::grpo {

namespace {
// Stable in both tails: a margin of +-2000 gives 0 and -2000 (and gradients 0 and -1), not NaN.
double log_sigmoid(double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); }
double sigmoid(double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}
}  // namespace

LossResult preference_loss(const PreferenceInputs& in, double* grad_values) {
  if (in.values == nullptr || in.sample_mask == nullptr || grad_values == nullptr)
    throw std::invalid_argument("preference_loss: missing values, sample_mask or gradient");
  validate(in.packing);
  const int64_t ns = in.packing.num_seqs;
  if (ns % 2 != 0)
    throw std::invalid_argument("preference_loss: a micro-batch holds (chosen, rejected) pairs, got " +
                                std::to_string(ns) + " sequences");
  const int64_t* off = in.packing.seq_offsets;
  for (int64_t t = 0; t < in.packing.num_tokens; ++t) grad_values[t] = 0;
  // The reward of sequence i: its value at its last token.
  auto last = [&](int64_t i) {
    if (off[i + 1] <= off[i])
      throw std::invalid_argument("preference_loss: sequence " + std::to_string(i) + " is empty (no token to score)");
    return off[i + 1] - 1;
  };
  const double* sm = in.sample_mask;
  const double denom = in.global_valid_seqs / 2 + 1e-8;  // NeMo-RL's masked_mean adds 1e-8
  double loss = 0, acc = 0, chosen_mean = 0, rejected_mean = 0, valid = 0;
  for (int64_t i = 0; i < ns; ++i) valid += sm[i];
  for (int64_t k = 0; k < ns / 2; ++k) {
    const int64_t c = 2 * k, rj = 2 * k + 1, tc = last(c), tr = last(rj);
    const double rc = in.values[tc], rr = in.values[tr], delta = rc - rr;
    if (sm[c] == 0 && sm[rj] == 0) continue;  // a pair left out (too long): no part in any sum
    loss += -log_sigmoid(delta) * sm[c] * sm[c] / denom;
    const double g = -sigmoid(-delta) * sm[c] * sm[c] / denom;  // d loss / d r_chosen
    grad_values[tc] += g;
    grad_values[tr] -= g;
    acc += (rc > rr ? 1.0 : 0.0) * sm[c] / denom;
    chosen_mean += rc * sm[c] / denom;
    rejected_mean += rr * sm[rj] / denom;
  }
  LossResult r;
  r.loss = loss;
  r.metrics.sum("loss", loss);
  r.metrics.sum("accuracy", acc);
  r.metrics.sum("rewards_chosen_mean", chosen_mean);
  r.metrics.sum("rewards_rejected_mean", rejected_mean);
  r.metrics.sum("num_valid_samples", valid / 2);
  return r;
}

}  // namespace rlh::grpo
