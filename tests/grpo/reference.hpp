// Independent float64 references for the GRPO-family losses, written from NeMo-RL's published
// formulas (ClippedPGLossFn, NLLLossFn, DPOLossFn, calculate_kl, masked_mean) in the layout NeMo-RL
// uses: one ragged row per sequence, token-frame fields of length L, current logprobs of length
// L-1 (next-token frame, i.e. NeMo-RL's [:, 1:] slice). They compute values only; the tests take
// gradients by central finite differences of these functions.
//
// Stop-gradients are explicit arguments: `lp_sg` is the value sg(lp) takes (the unperturbed
// logprobs). Finite differences perturb `lp` and leave `lp_sg` fixed, which is what autograd of
// exp(lp - sg(lp)), sg(clip(r)) or torch.where(.., w, w.detach()) differentiates.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "rlhost/grpo/clipped_pg_loss.hpp"
#include "rlhost/grpo/dpo_loss.hpp"

namespace rlh::grpo::test {

using Rows = std::vector<std::vector<double>>;  // one row per sequence

struct RefSeq {
  // Token frame, length L: entry t describes token t (entry 0 is never used by a loss).
  std::vector<double> token_mask, advantages, prev, gen, ref;
  double sample_mask = 1;
  double reward = 0;
  size_t length() const { return token_mask.size(); }
};

struct RefBatch {
  std::vector<RefSeq> seqs;
  double g_tok = 0, g_seq = 0;  // NeMo-RL's global_valid_toks / global_valid_seqs
  double g_pos = 0;             // global positive-NLL token count (0 = per call)

  void set_global_counts() {
    g_tok = g_seq = 0;
    for (const RefSeq& s : seqs) {
      g_seq += s.sample_mask;
      for (size_t t = 1; t < s.length(); ++t) g_tok += s.token_mask[t] * s.sample_mask;
    }
  }
};

struct RefOut {
  double loss = 0;
  std::map<std::string, double> m;
};

constexpr double kRefEps = 1e-8;

inline double ref_clamp(double x, double lo, double hi) { return std::min(std::max(x, lo), hi); }
inline double nan_to_num0(double x) { return std::isfinite(x) ? x : 0.0; }

inline double ref_kl(KlType t, double logr) {
  switch (t) {
    case KlType::kK1: return -logr;
    case KlType::kK2: return 0.5 * logr * logr;
    case KlType::kK3: return std::exp(logr) - 1.0 - logr;
  }
  return 0;
}

// ClippedPGLossFn.__call__, transcribed. lpu/lpu_sg: the unfiltered logprobs (default: lp).
inline RefOut ref_clipped_pg(const ClippedPGConfig& c, const RefBatch& B, const Rows& lp,
                             const Rows& lp_sg, const Rows* lpu_in = nullptr,
                             const Rows* lpu_sg_in = nullptr) {
  const Rows& lpu = lpu_in ? *lpu_in : lp;
  const Rows& lpu_sg = lpu_sg_in ? *lpu_sg_in : lp_sg;
  const double beta = c.use_kl_in_reward ? 0.0 : c.reference_policy_kl_penalty;
  const double lo = 1 - c.ratio_clip_min, hi = 1 + c.ratio_clip_max;
  const size_t nb = B.seqs.size();
  RefOut out;

  auto prev_at = [&](size_t b, size_t j) {
    return c.force_on_policy_ratio ? lp_sg[b][j] : B.seqs[b].prev[j + 1];
  };

  // Diagnostics over mask = token_mask[:, 1:] * sample_mask.
  double mult = 0, gkl = 0, pkl = 0, js = 0, abs_err = 0, abs_max = 0;
  for (size_t b = 0; b < nb; ++b) {
    const RefSeq& s = B.seqs[b];
    for (size_t j = 0; j + 1 < s.length(); ++j) {
      const double m = s.token_mask[j + 1] * s.sample_mask;
      const double prev = prev_at(b, j), gen = s.gen[j + 1];
      mult += std::exp(std::abs(gen - prev) * m) * m;
      abs_err += std::abs(gen - prev) * m;
      if (m != 0) abs_max = std::max(abs_max, std::abs(gen - prev));
      gkl += ref_kl(c.reference_policy_kl_type, prev - gen) * m;
      pkl += ref_kl(c.reference_policy_kl_type, gen - prev) * m;
      const double lmix = std::log(0.5 * std::exp(prev) + 0.5 * std::exp(gen));
      js += (0.5 * (std::exp(prev - lmix) - (prev - lmix) - 1) +
             0.5 * (std::exp(gen - lmix) - (gen - lmix) - 1)) * m;
    }
  }
  out.m["token_mult_prob_error"] = mult / (B.g_tok + kRefEps);
  out.m["gen_kl_error"] = gkl / (B.g_tok + kRefEps);
  out.m["policy_kl_error"] = pkl / (B.g_tok + kRefEps);
  out.m["js_divergence_error"] = js / (B.g_tok + kRefEps);
  out.m["logprob_abs_error"] = abs_err / (B.g_tok + kRefEps);
  out.m["logprob_abs_error_max"] = abs_max;

  const double tok_norm =
      c.constant_normalizer ? B.g_seq * *c.constant_normalizer : B.g_tok;  // Dr.GRPO option

  // Reduces a per-token quantity the way the actor/KL terms are reduced.
  auto reduce = [&](const Rows& v) {
    double total = 0;
    for (size_t b = 0; b < nb; ++b) {
      const RefSeq& s = B.seqs[b];
      if (c.token_level_loss) {
        for (size_t j = 0; j + 1 < s.length(); ++j)
          total += v[b][j] * s.token_mask[j + 1] * s.sample_mask / (tok_norm + kRefEps);
      } else {
        double num = 0, den = 0;
        for (size_t j = 0; j + 1 < s.length(); ++j) {
          num += v[b][j] * s.token_mask[j + 1];
          den += s.token_mask[j + 1];
        }
        total += num / (den + kRefEps) * s.sample_mask / (B.g_seq + kRefEps);
      }
    }
    return total;
  };
  auto zero_rows = [&]() {
    Rows r(nb);
    for (size_t b = 0; b < nb; ++b) r[b].assign(B.seqs[b].length() > 0 ? B.seqs[b].length() - 1 : 0, 0.0);
    return r;
  };

  // KL penalty.
  double kl = 0;
  if (beta != 0) {
    Rows klv = zero_rows();
    for (size_t b = 0; b < nb; ++b) {
      const RefSeq& s = B.seqs[b];
      for (size_t j = 0; j + 1 < s.length(); ++j) {
        const double gen = s.gen[j + 1];
        double w = c.use_on_policy_kl_approximation ? std::exp(lpu[b][j] - gen)
                                                    : std::exp(lpu[b][j] - lpu_sg[b][j]);
        double w_sg = c.use_on_policy_kl_approximation ? std::exp(lpu_sg[b][j] - gen) : 1.0;
        w = nan_to_num0(w);
        w_sg = nan_to_num0(w_sg);
        double logr = s.ref[j + 1] - lpu[b][j];
        if (c.kl_input_clamp_value) {
          const double lc = ref_clamp(logr, -*c.kl_input_clamp_value, *c.kl_input_clamp_value);
          if (lc != logr) w = w_sg;  // torch.where(logr == clamped, w, w.detach())
          logr = lc;
        }
        double v = w * ref_kl(c.reference_policy_kl_type, logr);
        if (c.kl_output_clamp_value)
          v = ref_clamp(v, -*c.kl_output_clamp_value, *c.kl_output_clamp_value);
        klv[b][j] = beta * v;
      }
    }
    kl = reduce(klv);
  }

  // Ratios and the clipped objective.
  Rows r = zero_rows(), rc = zero_rows(), clip = zero_rows();
  std::vector<double> gspo(nb, 1.0);
  for (size_t b = 0; b < nb; ++b) {
    const RefSeq& s = B.seqs[b];
    if (c.sequence_level_importance_ratios && !c.force_on_policy_ratio && !c.disable_ppo_ratio) {
      double num = 0, den = 0;
      for (size_t j = 0; j + 1 < s.length(); ++j) {
        num += (lp[b][j] - s.prev[j + 1]) * s.token_mask[j + 1];
        den += s.token_mask[j + 1];
      }
      gspo[b] = std::exp(num / (den + kRefEps));
    }
    for (size_t j = 0; j + 1 < s.length(); ++j) {
      const double prev = prev_at(b, j);
      if (c.force_on_policy_ratio) {
        r[b][j] = std::exp(lp[b][j] - lp_sg[b][j]);
        rc[b][j] = r[b][j];
      } else if (!c.disable_ppo_ratio) {
        r[b][j] = c.sequence_level_importance_ratios ? gspo[b] : std::exp(lp[b][j] - prev);
        rc[b][j] = ref_clamp(r[b][j], lo, hi);
      } else {
        r[b][j] = lp[b][j];
        rc[b][j] = lp[b][j];
      }
      const double a = s.advantages[j + 1];
      if (c.use_cispo) {
        const double rc_sg = ref_clamp(std::exp(lp_sg[b][j] - prev), lo, hi);
        clip[b][j] = -a * rc_sg * lp[b][j];
      } else {
        clip[b][j] = std::max(-a * r[b][j], -a * rc[b][j]);
      }
      if (c.ratio_clip_c && a < 0) clip[b][j] = std::min(clip[b][j], -a * *c.ratio_clip_c);
    }
  }

  // Importance weights.
  Rows w = zero_rows();
  std::vector<double> wseq(nb, 1.0);
  for (size_t b = 0; b < nb; ++b) {
    const RefSeq& s = B.seqs[b];
    if (c.sequence_level_importance_ratios) {
      double sum = 0;
      for (size_t j = 0; j + 1 < s.length(); ++j)
        sum += (prev_at(b, j) - s.gen[j + 1]) * s.token_mask[j + 1] * s.sample_mask;
      wseq[b] = nan_to_num0(std::exp(sum));
      for (size_t j = 0; j + 1 < s.length(); ++j) w[b][j] = wseq[b];
    } else {
      for (size_t j = 0; j + 1 < s.length(); ++j)
        w[b][j] = nan_to_num0(std::exp(prev_at(b, j) - s.gen[j + 1]));
    }
  }
  if (c.truncated_importance_sampling_type) {
    const double t_hi = *c.truncated_importance_sampling_ratio;
    double oob = 0;
    switch (*c.truncated_importance_sampling_type) {
      case TruncatedIsType::kTis: {
        const double t_lo = c.truncated_importance_sampling_ratio_min.value_or(0.0);
        for (size_t b = 0; b < nb; ++b) {
          const RefSeq& s = B.seqs[b];
          for (size_t j = 0; j + 1 < s.length(); ++j) {
            oob += ((w[b][j] > t_hi || w[b][j] < t_lo) ? 1.0 : 0.0) * s.token_mask[j + 1] * s.sample_mask;
            w[b][j] = ref_clamp(w[b][j], t_lo, t_hi);
          }
          wseq[b] = ref_clamp(wseq[b], t_lo, t_hi);
        }
        out.m["is_oob_ratio"] = oob / (B.g_tok + kRefEps);
        break;
      }
      case TruncatedIsType::kIcePop: {
        const double t_lo = *c.truncated_importance_sampling_ratio_min;
        for (size_t b = 0; b < nb; ++b) {
          const RefSeq& s = B.seqs[b];
          for (size_t j = 0; j + 1 < s.length(); ++j) {
            const bool kept = w[b][j] >= t_lo && w[b][j] <= t_hi;
            oob += (kept ? 0.0 : 1.0) * s.token_mask[j + 1] * s.sample_mask;
            if (!kept) w[b][j] = 0;
          }
          if (!(wseq[b] >= t_lo && wseq[b] <= t_hi)) wseq[b] = 0;
        }
        out.m["is_oob_ratio"] = oob / (B.g_tok + kRefEps);
        break;
      }
      case TruncatedIsType::kSeqMaskTis: {
        const double t_lo = *c.truncated_importance_sampling_ratio_min;
        for (size_t b = 0; b < nb; ++b) {
          const RefSeq& s = B.seqs[b];
          double num = 0, den = 0;
          for (size_t j = 0; j + 1 < s.length(); ++j) {
            num += nan_to_num0(prev_at(b, j) - s.gen[j + 1]) * s.token_mask[j + 1];
            den += s.token_mask[j + 1];
          }
          const double geo = std::exp(num / (den + kRefEps));
          const double kept = (geo >= t_lo && geo <= t_hi) ? 1.0 : 0.0;
          oob += (1.0 - kept) * s.sample_mask;
          for (size_t j = 0; j + 1 < s.length(); ++j) w[b][j] *= kept;
        }
        out.m["is_oob_ratio"] = oob / (B.g_seq + kRefEps);
        break;
      }
    }
  }

  Rows wclip = zero_rows();
  for (size_t b = 0; b < nb; ++b)
    for (size_t j = 0; j < clip[b].size(); ++j)
      wclip[b][j] = (c.use_importance_sampling_correction ? w[b][j] : 1.0) * clip[b][j];
  const double actor = reduce(wclip);

  // Metrics.
  double sir = 0, ent = 0, pr = 0, prc = 0, low = 0, high = 0, valid = 0;
  double pr_min = INFINITY, pr_max = -INFINITY, prc_min = INFINITY, prc_max = -INFINITY;
  for (size_t b = 0; b < nb; ++b) {
    const RefSeq& s = B.seqs[b];
    valid += s.sample_mask;
    if (c.sequence_level_importance_ratios) sir += wseq[b] * s.sample_mask / (B.g_seq + kRefEps);
    for (size_t j = 0; j + 1 < s.length(); ++j) {
      const double m = s.token_mask[j + 1] * s.sample_mask;
      if (!c.sequence_level_importance_ratios) sir += w[b][j] * m / (B.g_tok + kRefEps);
      ent -= std::exp(lp[b][j] - s.gen[j + 1]) * lp[b][j] * m / (B.g_tok + kRefEps);
      pr += r[b][j] * m / (B.g_tok + kRefEps);
      prc += rc[b][j] * m / (B.g_tok + kRefEps);
      if (m != 0) {
        pr_min = std::min(pr_min, r[b][j]);
        pr_max = std::max(pr_max, r[b][j]);
        prc_min = std::min(prc_min, rc[b][j]);
        prc_max = std::max(prc_max, rc[b][j]);
        if (r[b][j] < lo) low += m;
        if (r[b][j] > hi) high += m;
      }
    }
  }

  double nll = 0;
  if (c.positive_example_nll_weight > 0) {
    double cnt = 0;
    for (const RefSeq& s : B.seqs)
      for (size_t j = 0; j + 1 < s.length(); ++j)
        cnt += s.token_mask[j + 1] * s.sample_mask * (s.reward > 0 ? 1.0 : 0.0);
    if (cnt > 0) {
      const double norm = B.g_pos > 0 ? B.g_pos : cnt;
      for (size_t b = 0; b < nb; ++b) {
        const RefSeq& s = B.seqs[b];
        for (size_t j = 0; j + 1 < s.length(); ++j)
          nll += -lp[b][j] * s.token_mask[j + 1] * s.sample_mask * (s.reward > 0 ? 1.0 : 0.0) /
                 (norm + kRefEps);
      }
    }
  }

  out.loss = actor + kl + c.positive_example_nll_weight * nll;
  out.m["loss"] = out.loss;
  out.m["actor_loss"] = actor;
  out.m["kl_penalty"] = kl != 0 ? kl / beta : 0.0;
  out.m["sampling_importance_ratio"] = sir;
  out.m["approx_entropy"] = ent;
  out.m["probs_ratio"] = pr;
  out.m["probs_ratio_clamped"] = prc;
  out.m["probs_ratio_min"] = pr_min;
  out.m["probs_ratio_max"] = pr_max;
  out.m["probs_ratio_clamped_min"] = prc_min;
  out.m["probs_ratio_clamped_max"] = prc_max;
  out.m["num_valid_samples"] = valid;
  out.m["positive_nll_loss"] = nll;
  if (!c.force_on_policy_ratio && !c.disable_ppo_ratio) {
    out.m["probs_ratio_clip_low_fraction"] = low / (B.g_tok + kRefEps);
    out.m["probs_ratio_clip_high_fraction"] = high / (B.g_tok + kRefEps);
  }
  return out;
}

// NLLLossFn: -sum lp * token_mask[1:] * sample_mask / (G_tok + eps).
inline double ref_nll(const RefBatch& B, const Rows& lp) {
  double s = 0;
  for (size_t b = 0; b < B.seqs.size(); ++b)
    for (size_t j = 0; j + 1 < B.seqs[b].length(); ++j)
      s += lp[b][j] * B.seqs[b].token_mask[j + 1] * B.seqs[b].sample_mask;
  return -s / (B.g_tok + kRefEps);
}

// DPOLossFn: sequences (2k, 2k+1) = (chosen, rejected).
inline RefOut ref_dpo(const DpoConfig& c, const RefBatch& B, const Rows& lp) {
  const size_t nb = B.seqs.size();
  std::vector<double> rew(nb, 0.0), nll(nb, 0.0);
  for (size_t b = 0; b < nb; ++b) {
    const RefSeq& s = B.seqs[b];
    double den = 0, mden = 0;
    for (size_t j = 0; j + 1 < s.length(); ++j) {
      rew[b] += (lp[b][j] - s.ref[j + 1]) * s.token_mask[j + 1];
      den += s.token_mask[j + 1];
      nll[b] -= lp[b][j] * s.token_mask[j + 1] * s.sample_mask;
      mden += s.token_mask[j + 1] * s.sample_mask;
    }
    if (c.preference_average_log_probs) rew[b] /= std::max(den, 1.0);
    if (c.sft_average_log_probs) nll[b] /= std::max(mden, 1.0);
  }
  const double half = B.g_seq / 2 + kRefEps;
  double pref = 0, acc = 0, cm = 0, rm = 0, sft = 0;
  for (size_t k = 0; 2 * k + 1 < nb; ++k) {
    const RefSeq& ch = B.seqs[2 * k];
    const RefSeq& rj = B.seqs[2 * k + 1];
    const double x = c.reference_policy_kl_penalty * (rew[2 * k] - rew[2 * k + 1]);
    const double logsig = -std::log1p(std::exp(-x));
    pref += -logsig * ch.sample_mask * ch.sample_mask / half;
    acc += (rew[2 * k] > rew[2 * k + 1] ? 1.0 : 0.0) * ch.sample_mask / half;
    cm += rew[2 * k] * ch.sample_mask / half;
    rm += rew[2 * k + 1] * rj.sample_mask / half;
    sft += nll[2 * k] * ch.sample_mask / half;
  }
  if (!(c.sft_loss_weight > 0)) sft = 0;
  RefOut o;
  o.loss = c.sft_loss_weight * sft + c.preference_loss_weight * pref;
  o.m["loss"] = o.loss;
  o.m["preference_loss"] = pref;
  o.m["sft_loss"] = sft;
  o.m["accuracy"] = acc;
  o.m["rewards_chosen_mean"] = cm;
  o.m["rewards_rejected_mean"] = rm;
  double valid = 0;
  for (const RefSeq& s : B.seqs) valid += s.sample_mask;
  o.m["num_valid_samples"] = valid / 2;
  return o;
}

// Central finite differences of f(rows) with respect to every entry of `x`.
template <typename F>
Rows finite_difference(F&& f, Rows x, double h = 1e-6) {
  Rows g(x.size());
  for (size_t b = 0; b < x.size(); ++b) {
    g[b].assign(x[b].size(), 0.0);
    for (size_t j = 0; j < x[b].size(); ++j) {
      const double x0 = x[b][j];
      x[b][j] = x0 + h;
      const double fp = f(x);
      x[b][j] = x0 - h;
      const double fm = f(x);
      x[b][j] = x0;
      g[b][j] = (fp - fm) / (2 * h);
    }
  }
  return g;
}

}  // namespace rlh::grpo::test
