// clipped_pg_loss and nll_loss (docs/ops.md): NeMo-RL's ClippedPGLossFn and NLLLossFn on the
// device, so a train step keeps its loss where the logprobs are. The math is kernels_cpu's
// reference (the SDK's rlhost/losses, which the grpo plugin's host callback runs) term for term,
// in fp64 per token, with fp32 operands and outputs.
//
// Determinism: one block; warp w takes sequences w, w + kWarps, ...; lanes stride over a
// sequence's tokens; each lane accumulates in registers, warps reduce with a fixed butterfly and
// the block combines the warps in warp order. No atomics, so reruns are bitwise equal. A loss is
// a few hundred flops per token: one block keeps the step's loss to microseconds beside the
// forward and backward, and needs no scratch memory.
//
// Token alignment: entry t of a sequence is about token t; loss positions are t >= 1 within each
// sequence (the backend's outputs carry no prediction at a sequence's first token), whose
// gradient is written 0.
#include <cmath>
#include <stdexcept>
#include <string>

#include "common.cuh"
#include "losses.hpp"

namespace rlh::kcuda {
namespace {

constexpr int kWarps = 16;
constexpr double kEps = 1e-8;

// Metric slots (rlhost/losses/loss_ops.hpp kClippedPgMetrics, in that order).
enum Slot : int {
  kLoss, kProbsRatio, kProbsRatioClamped, kRatioMin, kRatioMax, kClampedMin, kClampedMax, kKl,
  kTokenMultProbError, kGenKlError, kPolicyKlError, kJsDivergence, kLogprobAbsError,
  kLogprobAbsErrorMax, kSamplingImportanceRatio, kNumValidSamples, kApproxEntropy, kIsOobRatio,
  kPositiveNll, kActorLoss, kClipLowFraction, kClipHighFraction, kSlots
};
static_assert(kSlots == 22, "the metrics of clipped_pg_loss");

// Per-lane running sums and extrema.
enum Acc : int {
  aKl, aActor, aPr, aPrc, aLow, aHigh, aOob, aTmpe, aGenKl, aPolKl, aJs, aAbs, aSir, aEnt, aValid,
  aSums,
  aPrMin = aSums, aPrcMin, aPrMax, aPrcMax, aAbsMax, aCount
};

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;  // every lane holds the same bits (a + b == b + a at each level)
}
__device__ __forceinline__ double warp_min(double v) {
  for (int o = 16; o > 0; o >>= 1) v = fmin(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ double warp_max(double v) {
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ double nan_to_zero(double x) { return isfinite(x) ? x : 0.0; }
// torch.clamp: NaN stays NaN.
__device__ __forceinline__ double tclamp(double x, double lo, double hi) {
  return isnan(x) ? x : fmin(fmax(x, lo), hi);
}
// std::clamp(v, lo, hi) as the host writes it: v < lo ? lo : hi < v ? hi : v (NaN stays NaN).
__device__ __forceinline__ double sclamp(double v, double lo, double hi) {
  return v < lo ? lo : (hi < v ? hi : v);
}

__device__ __forceinline__ double kl_est(int type, double logr) {
  return type == 1 ? -logr : type == 2 ? logr * logr / 2 : exp(logr) - 1 - logr;
}
__device__ __forceinline__ double kl_est_d(int type, double logr) {
  return type == 1 ? -1.0 : type == 2 ? logr : exp(logr) - 1;
}

__device__ __forceinline__ double log_mixture(double a, double b) {
  const double m = fmax(a, b);
  if (isinf(m) && m < 0) return m;
  return log(0.5) + m + log(exp(a - m) + exp(b - m));
}

__global__ void __launch_bounds__(kWarps * 32)
    clipped_pg_kernel(ClippedPgArgs p, float* loss, float* dlp, float* metrics) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool clamp_on = p.mode == 0;
  const double lo = 1.0 - p.ratio_clip_min, hi = 1.0 + p.ratio_clip_max;
  const double tok_denom = p.g_tok + kEps;
  const double coef_denom = (p.constant_normalizer > 0 ? p.g_seq * p.constant_normalizer : p.g_tok) + kEps;
  double acc[aCount];
  for (int k = 0; k < aSums; ++k) acc[k] = 0;
  acc[aPrMin] = acc[aPrcMin] = INFINITY;
  acc[aPrMax] = acc[aPrcMax] = -INFINITY;
  acc[aAbsMax] = 0;

  for (int64_t i = warp; i < p.S; i += kWarps) {
    const int64_t b = p.cu[i], e = p.cu[i + 1];
    const double smv = p.sm[i];
    if (lane == 0) acc[aValid] += smv;
    if (b < e && lane == 0) dlp[b] = 0.f;  // no prediction at a sequence's first token
    // Pass 1: the sequence's token-mask sum and seq-mask-tis's log-ratio sum.
    double tm_sum = 0, s_tis = 0;
    for (int64_t t = b + 1 + lane; t < e; t += 32) {
      const double tmv = p.tm[t];
      tm_sum += tmv;
      if (p.tis_type == 3 && tmv != 0) {
        const double prev = p.mode == 2 ? double(p.lp[t]) : double(p.prev[t]);
        s_tis += tmv * nan_to_zero(prev - double(p.gen[t]));
      }
    }
    tm_sum = warp_sum(tm_sum);
    s_tis = warp_sum(s_tis);
    double kept_seq = 1;
    if (p.tis_type == 3) {
      const double geo = exp(s_tis / (tm_sum + kEps));
      kept_seq = (geo >= p.tis_lo && geo <= p.tis_hi) ? 1.0 : 0.0;
      if (lane == 0) acc[aOob] += (1.0 - kept_seq) * smv;
    }
    // Pass 2: every loss position of the sequence.
    for (int64_t t = b + 1 + lane; t < e; t += 32) {
      const double lp = p.lp[t], a = p.adv[t], gen = p.gen[t], tmv = p.tm[t];
      const double prev = p.mode == 2 ? lp : double(p.prev[t]);
      const double mask = tmv * smv;
      const double coef = p.token_level ? mask / coef_denom : tmv / (tm_sum + kEps) * (smv / (p.g_seq + kEps));
      double d = 0;
      // KL to the reference policy.
      if (p.beta != 0 && coef != 0) {
        double w = 1, dw = 1;
        if (p.on_policy_kl) {
          w = exp(lp - gen);
          dw = w;
        }
        if (!isfinite(w)) w = dw = 0;
        double logr = double(p.ref[t]) - lp, dlogr = -1;
        if (p.kl_in > 0) {
          const double c = sclamp(logr, -p.kl_in, p.kl_in);
          if (!(logr == c)) dw = dlogr = 0;
          logr = c;
        }
        const double k = kl_est(p.kl_type, logr);
        double v = w * k, dv = dw * k + w * kl_est_d(p.kl_type, logr) * dlogr;
        if (p.kl_out > 0) {
          if (!(v >= -p.kl_out && v <= p.kl_out)) dv = 0;
          v = isnan(v) ? v : sclamp(v, -p.kl_out, p.kl_out);
        }
        acc[aKl] += coef * p.beta * v;
        d += coef * p.beta * dv;
      }
      // Ratio: PPO exp(lp - prev), force_on_policy 1 (derivative 1), disable_ppo_ratio lp.
      const double r = p.mode == 0 ? exp(lp - prev) : p.mode == 2 ? 1.0 : lp;
      const double dr = p.mode == 0 ? r : 1.0;
      const double rc = clamp_on ? tclamp(r, lo, hi) : r;
      // Off-policy importance weight, truncated.
      double w = nan_to_zero(exp(prev - gen));
      if (p.tis_type == 1) {
        if (mask != 0 && (w > p.tis_hi || w < p.tis_lo)) acc[aOob] += mask;
        w = tclamp(w, p.tis_lo, p.tis_hi);
      } else if (p.tis_type == 2) {
        if (!(w >= p.tis_lo && w <= p.tis_hi)) {
          acc[aOob] += mask;
          w = 0;
        }
      } else if (p.tis_type == 3) {
        w *= kept_seq;
      }
      // Actor term.
      if (coef != 0) {
        const double wu = p.use_is ? w : 1.0;
        if (p.cispo) {
          acc[aActor] += coef * wu * (-a * rc * lp);
          d += coef * wu * (-a * rc);
        } else {
          const double drc = clamp_on ? ((r >= lo && r <= hi) ? 1.0 : 0.0) : 1.0;
          const double l1 = -a * r, l2 = -a * rc;
          double val, dv;
          if (l1 > l2) {
            val = l1; dv = -a;
          } else if (l2 > l1) {
            val = l2; dv = -a * drc;
          } else {
            val = l1; dv = 0.5 * (-a + -a * drc);
          }
          if (p.clip_c > 0 && a < 0) {
            const double l3 = -a * p.clip_c;
            if (val > l3) {
              val = l3; dv = 0;
            } else if (!(val < l3)) {
              dv *= 0.5;
            }
          }
          acc[aActor] += coef * wu * val;
          d += coef * wu * dv * dr;
        }
      }
      dlp[t] = float(d);
      // Metrics over the valid tokens.
      if (mask != 0) {
        acc[aPr] += mask * r;
        acc[aPrc] += mask * rc;
        acc[aPrMin] = fmin(acc[aPrMin], r);
        acc[aPrMax] = fmax(acc[aPrMax], r);
        acc[aPrcMin] = fmin(acc[aPrcMin], rc);
        acc[aPrcMax] = fmax(acc[aPrcMax], rc);
        if (r < lo) acc[aLow] += mask;
        if (r > hi) acc[aHigh] += mask;
        const double diff = fabs(gen - prev);
        acc[aTmpe] += mask * exp(diff * mask);
        acc[aGenKl] += mask * kl_est(p.kl_type, prev - gen);
        acc[aPolKl] += mask * kl_est(p.kl_type, gen - prev);
        acc[aAbs] += mask * diff;
        acc[aAbsMax] = fmax(acc[aAbsMax], diff);
        const double lm = log_mixture(prev, gen);
        const double x = prev - lm, y = gen - lm;
        acc[aJs] += mask * (0.5 * (exp(x) - x - 1) + 0.5 * (exp(y) - y - 1));
        acc[aSir] += mask * w;
        acc[aEnt] += mask * exp(lp - gen) * lp;
      }
    }
  }

  // Warps, then the block in warp order.
  __shared__ double part[kWarps][aCount];
  for (int k = 0; k < aSums; ++k) acc[k] = warp_sum(acc[k]);
  acc[aPrMin] = warp_min(acc[aPrMin]);
  acc[aPrcMin] = warp_min(acc[aPrcMin]);
  acc[aPrMax] = warp_max(acc[aPrMax]);
  acc[aPrcMax] = warp_max(acc[aPrcMax]);
  acc[aAbsMax] = warp_max(acc[aAbsMax]);
  if (lane == 0)
    for (int k = 0; k < aCount; ++k) part[warp][k] = acc[k];
  __syncthreads();
  if (threadIdx.x != 0) return;
  double s[aCount];
  for (int k = 0; k < aCount; ++k) s[k] = part[0][k];
  for (int w = 1; w < kWarps; ++w) {
    for (int k = 0; k < aSums; ++k) s[k] += part[w][k];
    s[aPrMin] = fmin(s[aPrMin], part[w][aPrMin]);
    s[aPrcMin] = fmin(s[aPrcMin], part[w][aPrcMin]);
    s[aPrMax] = fmax(s[aPrMax], part[w][aPrMax]);
    s[aPrcMax] = fmax(s[aPrcMax], part[w][aPrcMax]);
    s[aAbsMax] = fmax(s[aAbsMax], part[w][aAbsMax]);
  }
  const double total = s[aActor] + s[aKl];
  *loss = float(total);
  if (metrics == nullptr) return;
  double m[kSlots];
  m[kLoss] = total;
  m[kProbsRatio] = s[aPr] / tok_denom;
  m[kProbsRatioClamped] = s[aPrc] / tok_denom;
  m[kRatioMin] = s[aPrMin];
  m[kRatioMax] = s[aPrMax];
  m[kClampedMin] = s[aPrcMin];
  m[kClampedMax] = s[aPrcMax];
  m[kKl] = s[aKl] != 0 ? s[aKl] / p.beta : 0.0;
  m[kTokenMultProbError] = s[aTmpe] / tok_denom;
  m[kGenKlError] = s[aGenKl] / tok_denom;
  m[kPolicyKlError] = s[aPolKl] / tok_denom;
  m[kJsDivergence] = s[aJs] / tok_denom;
  m[kLogprobAbsError] = s[aAbs] / tok_denom;
  m[kLogprobAbsErrorMax] = s[aAbsMax];
  m[kSamplingImportanceRatio] = s[aSir] / tok_denom;
  m[kNumValidSamples] = s[aValid];
  m[kApproxEntropy] = -s[aEnt] / tok_denom;
  m[kIsOobRatio] = p.tis_type == 0 ? 0.0 : s[aOob] / ((p.tis_type == 3 ? p.g_seq : p.g_tok) + kEps);
  m[kPositiveNll] = 0;  // positive_example_nll_weight is refused at resolution
  m[kActorLoss] = s[aActor];
  m[kClipLowFraction] = clamp_on ? s[aLow] / tok_denom : 0.0;
  m[kClipHighFraction] = clamp_on ? s[aHigh] / tok_denom : 0.0;
  for (int k = 0; k < kSlots; ++k) metrics[k] = float(m[k]);
}

__global__ void __launch_bounds__(kWarps * 32)
    nll_kernel(const float* lp, const float* tm, const float* sm, const int32_t* cu, int64_t S,
               double g_tok, float* loss, float* dlp, float* metrics) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const double denom = g_tok + kEps;
  double sum = 0, unmasked = 0, valid = 0;
  for (int64_t i = warp; i < S; i += kWarps) {
    const int64_t b = cu[i], e = cu[i + 1];
    const double smv = sm[i];
    if (lane == 0) valid += smv;
    if (b < e && lane == 0) dlp[b] = 0.f;
    for (int64_t t = b + 1 + lane; t < e; t += 32) {
      const double m = double(tm[t]) * smv;
      double d = 0;
      if (m != 0) {
        sum += double(lp[t]) * m;
        unmasked += m;
        d = -m / denom;
      }
      dlp[t] = float(d);
    }
  }
  __shared__ double part[kWarps][3];
  sum = warp_sum(sum);
  unmasked = warp_sum(unmasked);
  valid = warp_sum(valid);
  if (lane == 0) {
    part[warp][0] = sum;
    part[warp][1] = unmasked;
    part[warp][2] = valid;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  double s[3] = {part[0][0], part[0][1], part[0][2]};
  for (int w = 1; w < kWarps; ++w)
    for (int k = 0; k < 3; ++k) s[k] += part[w][k];
  const double l = -s[0] / denom;
  *loss = float(l);
  if (metrics == nullptr) return;
  metrics[0] = float(l);
  metrics[1] = float(s[1]);
  metrics[2] = float(s[2]);
}

void launched(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace

void clipped_pg_loss(const ClippedPgArgs& a, float* loss, float* dlp, float* metrics, cudaStream_t s) {
  if (a.S < 0 || a.N < 0) throw std::invalid_argument("clipped_pg_loss: negative sizes");
  if (a.mode != 2 && a.prev == nullptr)
    throw std::invalid_argument("clipped_pg_loss: prev_logprobs (input 6) is required unless force_on_policy_ratio");
  if (a.beta != 0 && a.ref == nullptr)
    throw std::invalid_argument("clipped_pg_loss: reference_policy_logprobs (input 7) is required when kl_penalty != 0");
  clipped_pg_kernel<<<1, kWarps * 32, 0, s>>>(a, loss, dlp, metrics);
  launched("clipped_pg_loss");
}

void nll_loss(const float* lp, const float* tm, const float* sm, const int32_t* cu, int64_t N, int64_t S,
              double global_valid_toks, float* loss, float* dlp, float* metrics, cudaStream_t s) {
  if (S < 0 || N < 0) throw std::invalid_argument("nll_loss: negative sizes");
  nll_kernel<<<1, kWarps * 32, 0, s>>>(lp, tm, sm, cu, S, global_valid_toks, loss, dlp, metrics);
  launched("nll_loss");
}

}  // namespace rlh::kcuda
