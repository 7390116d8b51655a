// NeMo-RL's DPOLossFn (see dpo_loss.hpp).
#include "rlhost/grpo/dpo_loss.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "json_read.hpp"
#include "rlhost/grpo/nll_loss.hpp"

namespace rlh::grpo {

namespace {
constexpr double kEps = 1e-8;

double log_sigmoid(double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); }
double sigmoid(double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}
}  // namespace

DpoConfig DpoConfig::from_json(const nlohmann::json& dpo) {
  detail::Section s(dpo, "dpo");
  DpoConfig c;
  s.read("reference_policy_kl_penalty", c.reference_policy_kl_penalty);
  s.read("preference_loss_weight", c.preference_loss_weight);
  s.read("sft_loss_weight", c.sft_loss_weight);
  s.read("preference_average_log_probs", c.preference_average_log_probs);
  s.read("sft_average_log_probs", c.sft_average_log_probs);
  return c;
}

LossResult dpo_loss(const DpoConfig& cfg, const DpoInputs& in, double* grad_logprobs) {
  if (in.logprobs == nullptr || in.reference_policy_logprobs == nullptr ||
      in.token_mask == nullptr || in.sample_mask == nullptr || grad_logprobs == nullptr)
    throw std::invalid_argument(
        "dpo_loss: missing logprobs, reference_policy_logprobs, token_mask, sample_mask or "
        "gradient");
  if (in.packing.num_seqs % 2 != 0)
    throw std::invalid_argument("dpo_loss: a micro-batch holds (chosen, rejected) pairs, got " +
                                std::to_string(in.packing.num_seqs) + " sequences");
  const LossFrame f = make_loss_frame(in.packing);
  const int64_t nq = f.size(), ns = in.packing.num_seqs, np = ns / 2;
  const std::vector<double> lp = gather_output(f, in.logprobs);
  const std::vector<double> ref = gather_field(f, in.reference_policy_logprobs);
  const std::vector<double> tm = gather_field(f, in.token_mask);
  const double* sm = in.sample_mask;
  const double beta = cfg.reference_policy_kl_penalty;
  const double denom = in.global_valid_seqs / 2 + kEps;

  // Implicit rewards r_i and their scale (d r_i / d lp_q = tm_q * scale_i).
  std::vector<double> rew(ns, 0.0), tm_sum(ns, 0.0), scale(ns, 1.0);
  for (int64_t q = 0; q < nq; ++q) {
    if (tm[q] == 0) continue;
    rew[f.seq[q]] += (lp[q] - ref[q]) * tm[q];
    tm_sum[f.seq[q]] += tm[q];
  }
  if (cfg.preference_average_log_probs) {
    for (int64_t i = 0; i < ns; ++i) {
      scale[i] = 1.0 / std::max(tm_sum[i], 1.0);
      rew[i] *= scale[i];
    }
  }

  double pref = 0, acc = 0, chosen_mean = 0, rejected_mean = 0;
  std::vector<double> d_rew(ns, 0.0);  // d loss / d r_i
  for (int64_t k = 0; k < np; ++k) {
    const int64_t c = 2 * k, rj = 2 * k + 1;
    const double delta = rew[c] - rew[rj];
    // per_sample_loss = -logsigmoid(beta delta) * sm_c, then masked_mean with sm_c again.
    pref += -log_sigmoid(beta * delta) * sm[c] * sm[c] / denom;
    const double g = cfg.preference_loss_weight * (-beta * sigmoid(-beta * delta)) * sm[c] * sm[c] /
                     denom;
    d_rew[c] += g;
    d_rew[rj] -= g;
    acc += (rew[c] > rew[rj] ? 1.0 : 0.0) * sm[c] / denom;
    chosen_mean += rew[c] * sm[c] / denom;
    rejected_mean += rew[rj] * sm[rj] / denom;
  }

  std::vector<double> d(nq, 0.0);
  for (int64_t q = 0; q < nq; ++q) {
    const int64_t i = f.seq[q];
    if (tm[q] != 0 && d_rew[i] != 0) d[q] += d_rew[i] * tm[q] * scale[i];
  }

  double sft = 0;
  if (cfg.sft_loss_weight > 0) {
    std::vector<double> mask(nq);
    for (int64_t q = 0; q < nq; ++q) mask[q] = tm[q] * sm[f.seq[q]];
    std::vector<double> sft_scale;
    const std::vector<double> nll = per_sample_nll(f, lp, mask, cfg.sft_average_log_probs, &sft_scale);
    for (int64_t k = 0; k < np; ++k) sft += nll[2 * k] * sm[2 * k] / denom;
    for (int64_t q = 0; q < nq; ++q) {
      const int64_t i = f.seq[q];
      if (i % 2 != 0 || mask[q] == 0) continue;
      d[q] += cfg.sft_loss_weight * (-mask[q] * sft_scale[i]) * sm[i] / denom;
    }
  }

  LossResult r;
  r.loss = cfg.sft_loss_weight * sft + cfg.preference_loss_weight * pref;
  double valid = 0;
  for (int64_t i = 0; i < ns; ++i) valid += sm[i];
  r.metrics.sum("loss", r.loss);
  r.metrics.sum("sft_loss", sft);
  r.metrics.sum("preference_loss", pref);
  r.metrics.sum("accuracy", acc);
  r.metrics.sum("rewards_chosen_mean", chosen_mean);
  r.metrics.sum("rewards_rejected_mean", rejected_mean);
  r.metrics.sum("num_valid_samples", valid / 2);
  scatter_output(f, d, grad_logprobs, in.packing.num_tokens);
  return r;
}

}  // namespace rlh::grpo
