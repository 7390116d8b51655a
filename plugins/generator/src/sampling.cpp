// Sampling one token per row of logits (semantics in sampling.hpp).
//
// Cost per row is a few passes over the vocabulary: scale + max (vectorised), the top-k/top-p cut
// (O(V) partial selection, only when a filter is set), one vectorised exp pass that also gives
// the log-sum-exp of the kept set, and the inverse-CDF walk (serial, stops at the drawn token).
#include "rlhost/generator/sampling.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>

#include "simd.hpp"

namespace rlh::gen {

void validate(const SamplingParams& p) {
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature))
    throw std::invalid_argument("sampling: temperature must be a finite number >= 0 (0 = greedy), got " +
                                std::to_string(p.temperature));
  if (p.top_k < -1)
    throw std::invalid_argument("sampling: top_k must be >= 0 (0 or -1 = off), got " + std::to_string(p.top_k));
  if (!(p.top_p > 0 && p.top_p <= 1))
    throw std::invalid_argument("sampling: top_p must be in (0, 1], got " + std::to_string(p.top_p));
  if (!(p.min_p >= 0 && p.min_p <= 1))
    throw std::invalid_argument("sampling: min_p must be in [0, 1], got " + std::to_string(p.min_p));
}

// kernels_cpu's filter_threshold (plugins/kernels_cpu/src/logprob.cpp) for float, step for step:
// the generator samples from exactly the set the trainer's processed logprob keeps. top-k splits
// off the k largest with nth_element (ties with the k-th value kept); top-p walks the mass down
// the largest values, sorting them in slices of growing size (64, then 4x) so a peaked row costs
// O(V). Any change there must be mirrored here; test_sampling compares the two.
float filter_threshold(const float* z, int64_t V, int64_t top_k, double top_p, float* tmp) {
  std::copy(z, z + V, tmp);
  int64_t kept = V;
  float tau = -INFINITY;
  if (top_k > 0 && top_k < V) {
    std::nth_element(tmp, tmp + (top_k - 1), tmp + V, std::greater<float>());
    tau = tmp[top_k - 1];
    kept = std::partition(tmp, tmp + V, [tau](float x) { return x >= tau; }) - tmp;
  }
  if (top_p < 1.0) {
    const float mx = *std::max_element(tmp, tmp + kept);
    double total = 0;
    for (int64_t i = 0; i < kept; ++i) total += std::exp(double(tmp[i] - mx));
    double before = 0;
    int64_t sorted = 0, want = std::min<int64_t>(kept, 64);
    for (;;) {
      if (want < kept) std::nth_element(tmp + sorted, tmp + want - 1, tmp + kept, std::greater<float>());
      std::sort(tmp + sorted, tmp + want, std::greater<float>());
      for (int64_t i = sorted; i < want; ++i) {
        if (i > 0 && before / total >= top_p) return tmp[i - 1];
        before += std::exp(double(tmp[i] - mx));
      }
      sorted = want;
      if (sorted == kept) return tmp[kept - 1];
      want = std::min(kept, want * 4);
    }
  }
  return tau;
}

namespace {

// z = logits * scale; returns max(z), or NaN when any z is NaN or infinite (z * 0 is NaN
// exactly then, and the sum carries it): broken weights must not sample quietly.
template <class T>
RLH_GEN_INLINE float scale_max_body(float* z, const float* logits, int64_t V, float scale) {
  float mx = -INFINITY, bad = 0.f;
#pragma omp simd reduction(max : mx) reduction(+ : bad)
  for (int64_t j = 0; j < V; ++j) {
    z[j] = logits[j] * scale;
    mx = std::max(mx, z[j]);
    bad += z[j] * 0.f;
  }
  return bad == 0.f ? mx : NAN;
}

// e = exp(z - mx) where z >= tau, else 0; returns the sum (float lanes, then double).
template <class T>
RLH_GEN_INLINE double exp_kept_body(float* e, const float* z, int64_t V, float mx, float tau) {
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < V; ++j) {
    const float w = z[j] >= tau ? simd::exp_fast(z[j] - mx) : 0.f;
    e[j] = w;
    sum += w;
  }
  return double(sum);
}

using ScaleMaxFn = float (*)(float*, const float*, int64_t, float);
using ExpKeptFn = double (*)(float*, const float*, int64_t, float, float);

RLH_GEN_TARGET_AVX512 float scale_max_avx512(float* z, const float* l, int64_t V, float s) {
  return scale_max_body<float>(z, l, V, s);
}
RLH_GEN_TARGET_AVX2 float scale_max_avx2(float* z, const float* l, int64_t V, float s) {
  return scale_max_body<float>(z, l, V, s);
}
float scale_max_generic(float* z, const float* l, int64_t V, float s) {
  return scale_max_body<float>(z, l, V, s);
}
RLH_GEN_TARGET_AVX512 double exp_kept_avx512(float* e, const float* z, int64_t V, float mx, float tau) {
  return exp_kept_body<float>(e, z, V, mx, tau);
}
RLH_GEN_TARGET_AVX2 double exp_kept_avx2(float* e, const float* z, int64_t V, float mx, float tau) {
  return exp_kept_body<float>(e, z, V, mx, tau);
}
double exp_kept_generic(float* e, const float* z, int64_t V, float mx, float tau) {
  return exp_kept_body<float>(e, z, V, mx, tau);
}

}  // namespace

Sampled sample_row(const float* logits, int64_t V, const SamplingParams& p, double u, float* scratch) {
  static const ScaleMaxFn scale_max = simd::dispatch(&scale_max_avx512, &scale_max_avx2, &scale_max_generic);
  static const ExpKeptFn exp_kept = simd::dispatch(&exp_kept_avx512, &exp_kept_avx2, &exp_kept_generic);
  float* z = scratch;
  float* e = scratch + V;
  float* tmp = scratch + 2 * V;
  const bool greedy = p.greedy();
  // The trainer's kernel forms z = (h W^T) * (1/T) with 1/T rounded to float; so do we.
  const float inv_t = greedy ? 1.f : float(1.0 / p.temperature);
  const float mx = scale_max(z, logits, V, inv_t);
  if (!std::isfinite(mx)) throw std::runtime_error("sampling: logits are not finite (max " + std::to_string(mx) + ")");

  float tau = -INFINITY;
  if (!greedy) {
    if (p.min_p > 0) {  // p_j >= min_p * p_max  <=>  z_j >= max(z) + log(min_p)
      tau = mx + float(std::log(p.min_p));
      for (int64_t j = 0; j < V; ++j)
        if (z[j] < tau) z[j] = -INFINITY;  // what top-k/top-p see next, as in vLLM
    }
    const int64_t k = p.top_k > 0 && p.top_k < V ? p.top_k : 0;
    if (k > 0 || p.top_p < 1.0) tau = std::max(tau, filter_threshold(z, V, k, p.top_p, tmp));
  }
  const double total = exp_kept(e, z, V, mx, tau);
  if (!(total > 0) || !std::isfinite(total)) throw std::runtime_error("sampling: logits are not finite");
  const double lse = double(mx) + std::log(total);

  int64_t tok = -1;
  if (greedy) {
    for (int64_t j = 0; j < V && tok < 0; ++j)
      if (z[j] == mx) tok = j;
  } else {
    // Inverse CDF in id order; the last token with weight catches a target rounded past the end.
    const double target = u * total;
    double acc = 0;
    for (int64_t j = 0; j < V; ++j) {
      if (e[j] <= 0.f) continue;
      acc += double(e[j]);
      tok = j;
      if (acc > target) break;
    }
  }
  return Sampled{int32_t(tok), float(double(z[tok]) - lse)};
}

}  // namespace rlh::gen
