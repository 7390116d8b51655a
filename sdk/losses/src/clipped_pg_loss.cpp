// NeMo-RL's ClippedPGLossFn on a packed micro-batch, with its gradient (see clipped_pg_loss.hpp
// and docs/grpo-loss.md). Shared by the grpo plugin's host loss callback and kernels_cpu's
// reference clipped_pg_loss op (docs/ops.md), so the two compute the same values.
//
// Gradients reproduce PyTorch autograd of NeMo-RL's expression graph, stop-gradients included:
// prev/generation/reference logprobs, advantages and importance weights are constants;
// force_on_policy_ratio's exp(lp - sg(lp)) is 1 with derivative 1; CISPO's clipped ratio is
// detached; torch.clamp passes gradient on its closed interval; torch.maximum/minimum split the
// gradient evenly on ties.
#include "rlhost/losses/clipped_pg_loss.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "rlhost/losses/diagnostics.hpp"
#include "rlhost/losses/config_error.hpp"

namespace rlh::losses {

namespace {

constexpr double kEps = 1e-8;  // masked_mean's denominator guard

double nan_to_zero(double x) { return std::isfinite(x) ? x : 0.0; }  // nan/±inf -> 0

double torch_clamp(double x, double lo, double hi) {
  if (std::isnan(x)) return x;
  return std::min(std::max(x, lo), hi);
}

// max(-A r, -A rc) with the optional dual clip min(., -A c) where A < 0; value and d/dr.
struct ClipEval {
  double value;
  double d_ratio;
};

ClipEval clip_objective(double a, double r, bool clamp_on, double lo, double hi,
                        const std::optional<double>& dual_c) {
  const double rc = clamp_on ? torch_clamp(r, lo, hi) : r;
  const double drc = clamp_on ? ((r >= lo && r <= hi) ? 1.0 : 0.0) : 1.0;
  const double l1 = -a * r, d1 = -a;
  const double l2 = -a * rc, d2 = -a * drc;
  ClipEval e;
  if (l1 > l2) {
    e = {l1, d1};
  } else if (l2 > l1) {
    e = {l2, d2};
  } else {
    e = {l1, 0.5 * (d1 + d2)};
  }
  if (dual_c && a < 0) {
    const double l3 = -a * *dual_c;  // constant in lp
    if (e.value > l3) {
      e = {l3, 0.0};
    } else if (!(e.value < l3)) {
      e.d_ratio *= 0.5;  // tie (or NaN): torch.minimum splits the gradient
    }
  }
  return e;
}

void require(const void* p, const char* what) {
  if (p == nullptr) throw std::invalid_argument(std::string("clipped_pg_loss: missing ") + what);
}

}  // namespace

const char* truncated_is_name(TruncatedIsType t) {
  switch (t) {
    case TruncatedIsType::kTis: return "tis";
    case TruncatedIsType::kIcePop: return "icepop";
    case TruncatedIsType::kSeqMaskTis: return "seq-mask-tis";
  }
  return "?";
}

void ClippedPGConfig::validate() const {
  auto fail = [](const std::string& m) { throw ConfigError("loss_fn: " + m); };
  if (sequence_level_importance_ratios && token_level_loss)
    fail("sequence-level importance sampling (sequence_level_importance_ratios, e.g. GSPO) is "
         "mutually exclusive with token_level_loss=true");
  if (use_cispo) {
    if (disable_ppo_ratio) fail("use_cispo is incompatible with disable_ppo_ratio");
    if (force_on_policy_ratio) fail("use_cispo is incompatible with force_on_policy_ratio");
    if (sequence_level_importance_ratios)
      fail("use_cispo is incompatible with sequence_level_importance_ratios");
    if (ratio_clip_c) fail("use_cispo is incompatible with dual clipping (set ratio_clip_c=null)");
    if (!token_level_loss) fail("use_cispo requires token_level_loss=true");
  }
  if (ratio_clip_c && !(*ratio_clip_c > 1))
    fail("ratio_clip_c must exceed 1 (a lower bound of the ratios), got " +
         std::to_string(*ratio_clip_c));
  if (truncated_importance_sampling_type) {
    if (!use_importance_sampling_correction)
      fail("truncated importance sampling is only supported when "
           "use_importance_sampling_correction is true");
    if (!truncated_importance_sampling_ratio || !(*truncated_importance_sampling_ratio > 0))
      fail("truncated_importance_sampling_ratio should be positive");
    if (truncated_importance_sampling_ratio_min &&
        !(*truncated_importance_sampling_ratio_min <= *truncated_importance_sampling_ratio))
      fail("truncated_importance_sampling_ratio_min must be <= truncated_importance_sampling_ratio");
    if (*truncated_importance_sampling_type != TruncatedIsType::kTis &&
        !truncated_importance_sampling_ratio_min)
      fail("truncated_importance_sampling_ratio_min should be set when "
           "truncated_importance_sampling_type is 'icepop' or 'seq-mask-tis'");
    if (*truncated_importance_sampling_type == TruncatedIsType::kSeqMaskTis &&
        sequence_level_importance_ratios)
      fail("seq-mask-tis uses token-level IS correction with sequence-level masking and is "
           "incompatible with sequence_level_importance_ratios=true");
  } else if (truncated_importance_sampling_ratio) {
    // NeMo-RL fails on the first call ("Invalid truncated importance sampling type: None").
    fail("truncated_importance_sampling_ratio is set but truncated_importance_sampling_type is null");
  }
  if (kl_input_clamp_value && !(*kl_input_clamp_value > 0))
    fail("kl_input_clamp_value must be positive or null");
  if (kl_output_clamp_value && !(*kl_output_clamp_value > 0))
    fail("kl_output_clamp_value must be positive or null");
  if (constant_normalizer) {
    if (!(*constant_normalizer > 0)) fail("constant_normalizer must be positive or null");
    if (!token_level_loss) fail("constant_normalizer (Dr.GRPO) requires token_level_loss=true");
  }
}

double positive_valid_tokens(const Packing& p, const double* token_mask, const double* sample_mask,
                             const double* rewards) {
  validate(p);
  double n = 0;
  for (int64_t i = 0; i < p.num_seqs; ++i) {
    if (!(rewards[i] > 0)) continue;
    for (int64_t t = p.seq_offsets[i] + 1; t < p.seq_offsets[i + 1]; ++t)
      n += token_mask[t] * sample_mask[i];
  }
  return n;
}

LossResult clipped_pg_loss(const ClippedPGConfig& cfg, const ClippedPGInputs& in,
                           double* grad_logprobs, double* grad_logprobs_unfiltered) {
  cfg.validate();
  const double beta = cfg.kl_coefficient();
  require(in.logprobs, "logprobs");
  require(in.advantages, "advantages");
  require(in.generation_logprobs, "generation_logprobs");
  require(in.token_mask, "token_mask");
  require(in.sample_mask, "sample_mask");
  if (cfg.needs_prev_logprobs()) require(in.prev_logprobs, "prev_logprobs");
  if (beta != 0) require(in.reference_policy_logprobs, "reference_policy_logprobs");
  require(grad_logprobs, "grad_logprobs");
  const bool separate_kl = in.logprobs_unfiltered != nullptr;
  if (separate_kl) require(grad_logprobs_unfiltered, "grad_logprobs_unfiltered");

  const LossFrame f = make_loss_frame(in.packing);
  const int64_t nq = f.size();
  const int64_t ns = in.packing.num_seqs;
  const double g_tok = in.global_valid_toks, g_seq = in.global_valid_seqs;

  const std::vector<double> lp = gather_output(f, in.logprobs);
  const std::vector<double> lpu = separate_kl ? gather_output(f, in.logprobs_unfiltered) : lp;
  const std::vector<double> adv = gather_field(f, in.advantages);
  const std::vector<double> gen = gather_field(f, in.generation_logprobs);
  const std::vector<double> tm = gather_field(f, in.token_mask);
  // force_on_policy_ratio: prev_logprobs := sg(curr_logprobs).
  const std::vector<double> prev =
      cfg.force_on_policy_ratio ? lp : gather_field(f, in.prev_logprobs);
  const std::vector<double> ref =
      beta != 0 ? gather_field(f, in.reference_policy_logprobs) : std::vector<double>();

  std::vector<double> mask(nq), tm_sum(ns, 0.0);
  for (int64_t q = 0; q < nq; ++q) {
    mask[q] = tm[q] * in.sample_mask[f.seq[q]];
    tm_sum[f.seq[q]] += tm[q];
  }

  // Reduction weight of each loss position: the loss is sum_q coef[q] * value[q].
  std::vector<double> coef(nq);
  if (cfg.token_level_loss) {
    const double denom = cfg.constant_normalizer ? g_seq * *cfg.constant_normalizer : g_tok;
    for (int64_t q = 0; q < nq; ++q) coef[q] = mask[q] / (denom + kEps);
  } else {
    for (int64_t q = 0; q < nq; ++q) {
      const int64_t i = f.seq[q];
      coef[q] = tm[q] / (tm_sum[i] + kEps) * (in.sample_mask[i] / (g_seq + kEps));
    }
  }

  std::vector<double> d_lp(nq, 0.0), d_lpu(separate_kl ? nq : 0, 0.0);
  std::vector<double>& d_kl = separate_kl ? d_lpu : d_lp;

  // ---- KL to the reference policy (on the unfiltered logprobs) ----
  double kl = 0;
  if (beta != 0) {
    for (int64_t q = 0; q < nq; ++q) {
      if (coef[q] == 0) continue;
      double w = 1, dw = 1;  // exp(lp - sg(lp)): value 1, d/dlp 1
      if (cfg.use_on_policy_kl_approximation) {
        w = std::exp(lpu[q] - gen[q]);
        dw = w;
      }
      if (!std::isfinite(w)) w = dw = 0;  // nan_to_num; its gradient is 0 there
      const KlToken t = kl_token(cfg.reference_policy_kl_type, lpu[q], ref[q],
                                 cfg.kl_input_clamp_value, cfg.kl_output_clamp_value, w, dw);
      kl += coef[q] * beta * t.value;
      d_kl[q] += coef[q] * beta * t.d_lp;
    }
  }

  // ---- ratios ----
  enum class Mode { kPpo, kGspo, kForce, kLogprob };
  const Mode mode = cfg.force_on_policy_ratio ? Mode::kForce
                    : cfg.disable_ppo_ratio   ? Mode::kLogprob
                    : cfg.sequence_level_importance_ratios ? Mode::kGspo
                                                           : Mode::kPpo;
  const bool clamp_on = mode == Mode::kPpo || mode == Mode::kGspo;
  const double lo = 1.0 - cfg.ratio_clip_min, hi = 1.0 + cfg.ratio_clip_max;
  std::vector<double> r(nq), dr(nq, 1.0), seq_ratio(ns, 1.0);
  if (mode == Mode::kGspo) {
    std::vector<double> s(ns, 0.0);
    for (int64_t q = 0; q < nq; ++q)
      if (tm[q] != 0) s[f.seq[q]] += tm[q] * (lp[q] - prev[q]);
    for (int64_t i = 0; i < ns; ++i) seq_ratio[i] = std::exp(s[i] / (tm_sum[i] + kEps));
  }
  for (int64_t q = 0; q < nq; ++q) {
    switch (mode) {
      case Mode::kPpo: r[q] = std::exp(lp[q] - prev[q]); dr[q] = r[q]; break;
      case Mode::kGspo: r[q] = seq_ratio[f.seq[q]]; break;  // gradient handled per sequence
      case Mode::kForce: r[q] = 1.0; break;                 // exp(lp - sg(lp))
      case Mode::kLogprob: r[q] = lp[q]; break;             // REINFORCE: "ratio" := lp
    }
  }
  std::vector<double> rc(nq);
  for (int64_t q = 0; q < nq; ++q) rc[q] = clamp_on ? torch_clamp(r[q], lo, hi) : r[q];

  // ---- off-policy importance weights (always computed: they feed the metrics) ----
  std::vector<double> w(nq), seq_w(ns, 1.0);
  if (cfg.sequence_level_importance_ratios) {
    std::vector<double> s(ns, 0.0);
    for (int64_t q = 0; q < nq; ++q)
      if (mask[q] != 0) s[f.seq[q]] += (prev[q] - gen[q]) * mask[q];
    for (int64_t i = 0; i < ns; ++i) seq_w[i] = nan_to_zero(std::exp(s[i]));
    for (int64_t q = 0; q < nq; ++q) w[q] = seq_w[f.seq[q]];
  } else {
    for (int64_t q = 0; q < nq; ++q) w[q] = nan_to_zero(std::exp(prev[q] - gen[q]));
  }
  std::optional<double> is_oob_ratio;
  if (cfg.truncated_importance_sampling_type) {
    const double t_hi = *cfg.truncated_importance_sampling_ratio;
    switch (*cfg.truncated_importance_sampling_type) {
      case TruncatedIsType::kTis: {
        const double t_lo = cfg.truncated_importance_sampling_ratio_min.value_or(0.0);
        double oob = 0;
        for (int64_t q = 0; q < nq; ++q) {
          if (mask[q] != 0 && (w[q] > t_hi || w[q] < t_lo)) oob += mask[q];
          w[q] = torch_clamp(w[q], t_lo, t_hi);
        }
        for (double& v : seq_w) v = torch_clamp(v, t_lo, t_hi);
        is_oob_ratio = oob / (g_tok + kEps);
        break;
      }
      case TruncatedIsType::kIcePop: {
        const double t_lo = *cfg.truncated_importance_sampling_ratio_min;
        double oob = 0;
        for (int64_t q = 0; q < nq; ++q) {
          const bool kept = w[q] >= t_lo && w[q] <= t_hi;
          if (!kept) {
            oob += mask[q];
            w[q] = 0;
          }
        }
        for (double& v : seq_w)
          if (!(v >= t_lo && v <= t_hi)) v = 0;
        is_oob_ratio = oob / (g_tok + kEps);
        break;
      }
      case TruncatedIsType::kSeqMaskTis: {
        const double t_lo = *cfg.truncated_importance_sampling_ratio_min;
        std::vector<double> s(ns, 0.0);
        for (int64_t q = 0; q < nq; ++q)
          if (tm[q] != 0) s[f.seq[q]] += tm[q] * nan_to_zero(prev[q] - gen[q]);
        std::vector<double> kept(ns);
        double oob = 0;
        for (int64_t i = 0; i < ns; ++i) {
          const double geo = std::exp(s[i] / (tm_sum[i] + kEps));
          kept[i] = (geo >= t_lo && geo <= t_hi) ? 1.0 : 0.0;
          oob += (1.0 - kept[i]) * in.sample_mask[i];
        }
        for (int64_t q = 0; q < nq; ++q) w[q] *= kept[f.seq[q]];
        is_oob_ratio = oob / (g_seq + kEps);
        break;
      }
    }
  }

  // ---- actor term ----
  double actor = 0;
  std::vector<double> seq_grad(ns, 0.0);  // GSPO: d actor / d seq_ratio
  for (int64_t q = 0; q < nq; ++q) {
    if (coef[q] == 0) continue;
    const double wu = cfg.use_importance_sampling_correction ? w[q] : 1.0;
    const double a = adv[q];
    if (cfg.use_cispo) {
      // -A * sg(clip(r)) * lp
      actor += coef[q] * wu * (-a * rc[q] * lp[q]);
      d_lp[q] += coef[q] * wu * (-a * rc[q]);
      continue;
    }
    const ClipEval e = clip_objective(a, r[q], clamp_on, lo, hi, cfg.ratio_clip_c);
    actor += coef[q] * wu * e.value;
    const double g = coef[q] * wu * e.d_ratio;
    if (mode == Mode::kGspo) {
      seq_grad[f.seq[q]] += g;
    } else {
      d_lp[q] += g * dr[q];
    }
  }
  if (mode == Mode::kGspo) {
    // seq_ratio_i = exp(sum_t tm_t (lp_t - prev_t) / (sum_t tm_t + eps))
    for (int64_t q = 0; q < nq; ++q) {
      if (tm[q] == 0) continue;
      const int64_t i = f.seq[q];
      if (seq_grad[i] == 0) continue;
      d_lp[q] += seq_grad[i] * seq_ratio[i] * tm[q] / (tm_sum[i] + kEps);
    }
  }

  // ---- VAPO positive-example NLL on samples with reward > 0 ----
  double nll = 0;
  const double mu = cfg.positive_example_nll_weight;
  if (mu > 0 && in.rewards != nullptr) {
    double count = 0;
    for (int64_t q = 0; q < nq; ++q)
      if (in.rewards[f.seq[q]] > 0) count += mask[q];
    if (count > 0) {
      const double norm = (in.global_positive_toks > 0 ? in.global_positive_toks : count) + kEps;
      for (int64_t q = 0; q < nq; ++q) {
        if (mask[q] == 0 || !(in.rewards[f.seq[q]] > 0)) continue;
        nll += -lp[q] * mask[q] / norm;
        d_lp[q] += mu * (-mask[q] / norm);
      }
    }
  }

  LossResult res;
  res.loss = actor + kl + mu * nll;

  // ---- metrics, NeMo-RL's names and normalisations ----
  Metrics& m = res.metrics;
  double pr = 0, prc = 0, low = 0, high = 0;
  double pr_min = std::numeric_limits<double>::infinity(), pr_max = -pr_min;
  double prc_min = pr_min, prc_max = pr_max;
  for (int64_t q = 0; q < nq; ++q) {
    if (mask[q] == 0) continue;
    pr += mask[q] * r[q];
    prc += mask[q] * rc[q];
    pr_min = std::min(pr_min, r[q]);
    pr_max = std::max(pr_max, r[q]);
    prc_min = std::min(prc_min, rc[q]);
    prc_max = std::max(prc_max, rc[q]);
    if (r[q] < lo) low += mask[q];
    if (r[q] > hi) high += mask[q];
  }
  const double tok_denom = g_tok + kEps;
  m.sum("loss", res.loss);
  m.sum("probs_ratio", pr / tok_denom);
  m.sum("probs_ratio_clamped", prc / tok_denom);
  m.min("probs_ratio_min", pr_min);
  m.max("probs_ratio_max", pr_max);
  m.min("probs_ratio_clamped_min", prc_min);
  m.max("probs_ratio_clamped_max", prc_max);
  m.sum("kl_penalty", kl != 0 ? kl / beta : 0.0);
  add_mismatch_metrics(m, mismatch_diagnostics(prev, gen, mask, g_tok, cfg.reference_policy_kl_type));
  double sir = 0;
  if (cfg.sequence_level_importance_ratios) {
    for (int64_t i = 0; i < ns; ++i) sir += in.sample_mask[i] * seq_w[i];
    sir /= g_seq + kEps;
  } else {
    for (int64_t q = 0; q < nq; ++q)
      if (mask[q] != 0) sir += mask[q] * w[q];
    sir /= tok_denom;
  }
  m.sum("sampling_importance_ratio", sir);
  double valid_samples = 0;
  for (int64_t i = 0; i < ns; ++i) valid_samples += in.sample_mask[i];
  m.sum("num_valid_samples", valid_samples);
  m.sum("approx_entropy", approx_entropy(lp, gen, mask, g_tok));
  if (is_oob_ratio) m.sum("is_oob_ratio", *is_oob_ratio);
  m.sum("positive_nll_loss", nll);
  // rlhost additions: the actor term alone, and the fractions of tokens whose ratio lies below /
  // above the clip interval (PPO/GSPO ratios only).
  m.sum("actor_loss", actor);
  if (clamp_on) {
    m.sum("probs_ratio_clip_low_fraction", low / tok_denom);
    m.sum("probs_ratio_clip_high_fraction", high / tok_denom);
  }

  scatter_output(f, d_lp, grad_logprobs, in.packing.num_tokens);
  if (separate_kl) scatter_output(f, d_lpu, grad_logprobs_unfiltered, in.packing.num_tokens);
  return res;
}

}  // namespace rlh::losses
