// sample (docs/ops.md): one token per row of logits, as vLLM's V1 sampler and NeMo-RL's trainer
// define them:
//   temperature > 0: z = logits / temperature (float, as the trainer's kernel forms it); min_p
//     drops tokens with p < min_p p_max; top_k keeps z >= the k-th largest (ties kept); top_p keeps
//     the smallest prefix of the descending order whose mass before each kept token is < top_p
//     (linear_logprob's filter, logprob.cpp, the same code: a sampled token is never one the
//     trainer's processed logprob cuts); the token is drawn by inverse CDF with the row's u; its
//     logprob is z[token] - logsumexp(z over the kept set).
//   temperature == 0 (greedy): argmax (lowest id among equal maxima), logprob of the unfiltered
//     softmax at temperature 1 (what vLLM reports for greedy requests).
// min_p has no trainer counterpart in NeMo-RL: with min_p > 0 the logprobs include its cut.
//
// Cost per row is a few passes over the vocabulary: scale + max (vectorised), the top-k/top-p cut
// (O(V) partial selection, only when a filter is set), one vectorised exp pass that also gives
// the log-sum-exp of the kept set, and the inverse-CDF walk (serial, stops at the drawn token).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "decode_ops.hpp"
#include "simd.hpp"
#include "worker_pool.hpp"

namespace rlh::kcpu {

namespace {

// z = logits * scale; returns max(z), or NaN when any z is NaN or infinite (z * 0 is NaN
// exactly then, and the sum carries it): broken weights must not sample quietly.
template <class T>
RLH_KCPU_INLINE float scale_max_body(float* z, const float* logits, int64_t V, float scale) {
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
RLH_KCPU_INLINE double exp_kept_body(float* e, const float* z, int64_t V, float mx, float tau) {
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < V; ++j) {
    const float w = z[j] >= tau ? exp_f(z[j] - mx) : 0.f;
    e[j] = w;
    sum += w;
  }
  return double(sum);
}

using ScaleMaxFn = float (*)(float*, const float*, int64_t, float);
using ExpKeptFn = double (*)(float*, const float*, int64_t, float, float);

RLH_KCPU_TARGET_AVX512 float scale_max_avx512(float* z, const float* l, int64_t V, float s) {
  return scale_max_body<float>(z, l, V, s);
}
RLH_KCPU_TARGET_AVX2 float scale_max_avx2(float* z, const float* l, int64_t V, float s) {
  return scale_max_body<float>(z, l, V, s);
}
float scale_max_generic(float* z, const float* l, int64_t V, float s) {
  return scale_max_body<float>(z, l, V, s);
}
RLH_KCPU_TARGET_AVX512 double exp_kept_avx512(float* e, const float* z, int64_t V, float mx, float tau) {
  return exp_kept_body<float>(e, z, V, mx, tau);
}
RLH_KCPU_TARGET_AVX2 double exp_kept_avx2(float* e, const float* z, int64_t V, float mx, float tau) {
  return exp_kept_body<float>(e, z, V, mx, tau);
}
double exp_kept_generic(float* e, const float* z, int64_t V, float mx, float tau) {
  return exp_kept_body<float>(e, z, V, mx, tau);
}

struct Sampled {
  int32_t token = -1;
  float logprob = 0.f;
};

// One row; scratch holds 3 V floats.
Sampled sample_row(const float* logits, int64_t V, const SampleParams& p, double u, const int32_t* given,
                   float* scratch) {
  static const ScaleMaxFn scale_max = dispatch(&scale_max_avx512, &scale_max_avx2, &scale_max_generic);
  static const ExpKeptFn exp_kept = dispatch(&exp_kept_avx512, &exp_kept_avx2, &exp_kept_generic);
  float* z = scratch;
  float* e = scratch + V;
  float* tmp = scratch + 2 * V;
  const bool greedy = p.temperature == 0.0;
  // The trainer's kernel forms z = (h W^T) * (1/T) with 1/T rounded to float; so do we.
  const float inv_t = greedy ? 1.f : float(1.0 / p.temperature);
  const float* raw = logits;
  if (p.softcap > 0) {  // Gemma-2's final soft-cap, before the temperature (linear_logprob's order)
    const float c = float(p.softcap);
    for (int64_t j = 0; j < V; ++j) {
      if (!std::isfinite(logits[j])) throw std::runtime_error("sampling: logits are not finite");
      z[j] = c * std::tanh(logits[j] / c);
    }
    raw = z;
  }
  const float mx = scale_max(z, raw, V, inv_t);
  if (!std::isfinite(mx)) throw std::runtime_error("sampling: logits are not finite (max " + std::to_string(mx) + ")");

  float tau = -INFINITY;
  if (!greedy) {
    if (p.min_p > 0) {  // p_j >= min_p * p_max  <=>  z_j >= max(z) + log(min_p)
      tau = mx + float(std::log(p.min_p));
      for (int64_t j = 0; j < V; ++j)
        if (z[j] < tau) z[j] = -INFINITY;  // what top-k/top-p see next, as in vLLM
    }
    const int64_t k = p.top_k > 0 && p.top_k < V ? p.top_k : 0;
    if (k > 0 || p.top_p < 1.0) tau = std::max(tau, sample_filter_threshold(z, V, k, p.top_p, tmp));
  }
  const double total = exp_kept(e, z, V, mx, tau);
  if (!(total > 0) || !std::isfinite(total)) throw std::runtime_error("sampling: logits are not finite");
  const double lse = double(mx) + std::log(total);

  if (given) {  // no draw: the given id's logprob under the same z and kept set
    const int32_t g = *given;
    if (g < 0 || g >= V) return Sampled{-1, 0.f};
    const bool kept = z[g] >= tau && z[g] > -INFINITY;
    return Sampled{g, kept ? float(double(z[g]) - lse) : -INFINITY};
  }
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

}  // namespace

void sample(const float* logits, int64_t ld, int64_t S, int64_t V, const double* u, const SampleParams& p,
            int32_t* tokens, float* logprobs, WorkerPool& pool, const int32_t* given) {
  if (!(p.softcap >= 0) || !std::isfinite(p.softcap))
    throw std::invalid_argument("sample: softcap must be a finite number >= 0, got " + std::to_string(p.softcap));
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature))
    throw std::invalid_argument("sample: temperature must be a finite number >= 0 (0 = greedy), got " +
                                std::to_string(p.temperature));
  if (!(p.top_p > 0 && p.top_p <= 1))
    throw std::invalid_argument("sample: top_p must be in (0, 1], got " + std::to_string(p.top_p));
  if (!(p.min_p >= 0 && p.min_p <= 1))
    throw std::invalid_argument("sample: min_p must be in [0, 1], got " + std::to_string(p.min_p));
  if (V < 1 || ld < V) throw std::invalid_argument("sample: logits rows must hold the vocabulary");
  // Rows on the pool, each with its own scratch; a row depends only on its logits and its u.
  thread_local std::vector<float> scratch;
  const int threads = S > 1 && !omp_in_parallel() ? pool.threads() : 1;
  const size_t per = size_t(3 * V);
  if (scratch.size() < size_t(threads) * per) scratch.resize(size_t(threads) * per);
  float* const base = scratch.data();  // by pointer: in a worker, `scratch` names its own
  auto row = [&](int64_t i, int worker) {
    const Sampled d = sample_row(logits + i * ld, V, p, u ? u[i] : 0.0, given ? given + i : nullptr,
                                 base + size_t(worker) * per);
    tokens[i] = d.token;
    logprobs[i] = d.logprob;
  };
  if (threads > 1) {
    pool.parallel_for(S, row);
  } else {
    for (int64_t i = 0; i < S; ++i) row(i, 0);
  }
}

}  // namespace rlh::kcpu
