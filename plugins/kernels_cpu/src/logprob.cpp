// linear_logprob: per-token logprob / entropy of logits = h W^T / temperature without ever
// holding the logits of all tokens (conventions in kernels.hpp).
//
// Each token may have K targets (target [N, K], logprob [N, K]): the next token, or the ids of a
// top-k distillation. Gradients of a token's targets add up.
//
// Unfiltered path (top_k = 0, top_p = 1): tokens are taken in blocks of up to kRowBlock rows and
// the vocabulary in chunks of vc rows of W, so a [rows, vc] tile fits chunk_bytes (tile_shape).
// Forward keeps per token an online log-sum-exp over the chunks:
//   m = running max, l = sum e^(z-m), s1 = sum e^(z-m) (z-m), zt = target logit
//   lse = m + log l, entropy = log l - s1 / l  (= -sum p log p, shifted by m for accuracy)
// Backward recomputes each tile and turns it into dlogits in place:
//   dz_j = dlp * (1[j = target] - p_j) - dH * p_j * (z_j - E[z]),  E[z] = lse - H
//   dlogits = dz / temperature;  dh (+)= dlogits W_c;  dW_c += dlogits^T h
// so W's gradient is written chunk by chunk with the whole token block as the inner dimension.
//
// Filtered path (processed logprobs): every row needs all V logits to find its cut, so tokens
// are taken a few rows at a time (rows * V <= chunk_bytes) with whole vocab rows. The cut is a
// threshold tau per row: top-k keeps z >= (k-th largest z); top-p then keeps, in descending
// order, tokens while the probability mass before them is < top_p (tau = the last kept value;
// ties at the cut are all kept). Filtered tokens are -inf: zero probability and zero gradient.
//
// Soft-capping (Gemma-2): a tile's logits are computed unscaled and capped in place,
// z = c tanh(logits / c) / temperature (cap_tile); the backward keeps the cap's derivative
// 1 / cosh^2 in a second tile and multiplies dlogits by it.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <vector>

#include "rlhost/kernels_cpu/kernels.hpp"
#include "simd.hpp"  // exp_t, RLH_KCPU_MULTIVERSION

namespace rlh::kcpu {
namespace {

constexpr int64_t kRowBlock = 4096;
constexpr int64_t kDefaultChunkBytes = int64_t(32) << 20;

bool filtered(const LogprobOpts& o) { return o.top_k > 0 || o.top_p < 1.0; }

void check_opts(const LogprobOpts& o, int64_t V) {
  if (!(o.temperature > 0)) throw std::invalid_argument("linear_logprob: temperature must be > 0");
  if (o.top_k < 0) throw std::invalid_argument("linear_logprob: top_k must be >= 0");
  if (!(o.top_p > 0 && o.top_p <= 1)) throw std::invalid_argument("linear_logprob: top_p in (0,1]");
  if (!(o.softcap >= 0) || !std::isfinite(o.softcap))
    throw std::invalid_argument("linear_logprob: softcap must be a finite number >= 0");
  if (V <= 0) throw std::invalid_argument("linear_logprob: empty vocabulary");
}

// Tile shape for the unfiltered path: rows per block (up to kRowBlock, fewer when the budget
// would otherwise leave fewer than kMinVocabChunk vocabulary rows per chunk) and vocab rows per
// chunk (what the budget leaves, a multiple of 16 when it cuts the vocabulary).
constexpr int64_t kMinVocabChunk = 256;
void tile_shape(int64_t N, int64_t V, const LogprobOpts& o, size_t elem, int64_t* nb,
                int64_t* vc) {
  const int64_t budget = (o.chunk_bytes > 0 ? o.chunk_bytes : kDefaultChunkBytes) / int64_t(elem);
  *nb = std::max<int64_t>(
      1, std::min({N, kRowBlock, budget / std::min<int64_t>(V, kMinVocabChunk)}));
  int64_t c = std::max<int64_t>(1, budget / *nb);
  if (c < V && c > 16) c = c / 16 * 16;
  *vc = std::min(V, c);
}

// Forward statistics of one [nb, vc] tile of z whose first column is vocab entry v0.
template <class T>
RLH_KCPU_INLINE void stats_rows(const T* Z, int64_t ld, int64_t r0, int64_t r1, int64_t vc,
                                int64_t v0, const int32_t* target, int64_t K, T* m, T* l, T* s1,
                                T* zt) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* z = Z + r * ld;
    T mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < vc; ++j) mx = std::max(mx, z[j]);
    const T m_new = std::max(m[r], mx);
    T sum = 0, sz = 0;
#pragma omp simd reduction(+ : sum, sz)
    for (int64_t j = 0; j < vc; ++j) {
      const T d = z[j] - m_new;
      const T e = exp_t(d);
      sum += e;
      sz += e * d;
    }
    const T corr = m[r] == -INFINITY ? T(0) : exp_t(m[r] - m_new);
    // s1 is relative to the max: rebase the old part (see the file comment).
    s1[r] = corr * (s1[r] + l[r] * (m[r] == -INFINITY ? T(0) : m[r] - m_new)) + sz;
    l[r] = l[r] * corr + sum;
    m[r] = m_new;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t t = target[r * K + k];
      if (t >= v0 && t < v0 + vc) zt[r * K + k] = z[t - v0];
    }
  }
}

// dlogits of one tile, in place over z. ez = E[z] per row (only read when dH is given).
template <class T>
RLH_KCPU_INLINE void grad_rows(T* Z, int64_t ld, int64_t r0, int64_t r1, int64_t vc, int64_t v0,
                               const int32_t* target, int64_t K, const T* lse, const T* ez,
                               const T* dlp, const T* dH, T inv_temp) {
  for (int64_t r = r0; r < r1; ++r) {
    T* z = Z + r * ld;
    T a = 0;  // sum of the row's logprob gradients (a missing target's logprob is the constant 0)
    if (dlp)
      for (int64_t k = 0; k < K; ++k)
        if (target[r * K + k] >= 0) a += dlp[r * K + k];
    const T b = dH ? dH[r] : T(0);
    const T zl = lse[r], e = dH ? ez[r] : T(0);
#pragma omp simd
    for (int64_t j = 0; j < vc; ++j) {
      const T p = exp_t(z[j] - zl);
      z[j] = (-a * p - b * p * (z[j] - e)) * inv_temp;
    }
    if (dlp)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t t = target[r * K + k];
        if (t >= v0 && t < v0 + vc) z[t - v0] += dlp[r * K + k] * inv_temp;
      }
  }
}

RLH_KCPU_MULTIVERSION(stats_f, stats_rows,
                      (const float* Z, int64_t ld, int64_t r0, int64_t r1, int64_t vc, int64_t v0,
                       const int32_t* target, int64_t K, float* m, float* l, float* s1,
                       float* zt),
                      (Z, ld, r0, r1, vc, v0, target, K, m, l, s1, zt))
RLH_KCPU_MULTIVERSION(grad_f, grad_rows,
                      (float* Z, int64_t ld, int64_t r0, int64_t r1, int64_t vc, int64_t v0,
                       const int32_t* target, int64_t K, const float* lse, const float* ez,
                       const float* dlp, const float* dH, float inv_temp),
                      (Z, ld, r0, r1, vc, v0, target, K, lse, ez, dlp, dH, inv_temp))

// Runs fn(r0, r1) over rows [0, n) in blocks of about 64K elements, taken dynamically by the
// threads (row results do not depend on the blocking).
void for_rows(int64_t n, int64_t work, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t per_row = std::max<int64_t>(1, work / std::max<int64_t>(1, n));
  const int64_t rows = std::max<int64_t>(1, 65536 / per_row);
  const int64_t blocks = (n + rows - 1) / rows;
#pragma omp parallel for schedule(dynamic, 1) if (blocks > 1 && !omp_in_parallel())
  for (int64_t b = 0; b < blocks; ++b) fn(b * rows, std::min(n, (b + 1) * rows));
}

// z <- c tanh(z / c) * inv_temp over n contiguous logits (rows x cols tiles), and the cap's
// derivative 1 / cosh^2(z / c) into F when F is given. The gemm before it ran with alpha 1.
template <class T>
void cap_tile(T* z, int64_t rows, int64_t cols, T c, T inv_temp, T* F) {
  for_rows(rows, rows * cols, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * cols; i < r1 * cols; ++i) {
      const T u = z[i] / c;
      z[i] = c * std::tanh(u) * inv_temp;
      if (F) {  // 1 / cosh^2, not 1 - tanh^2: that cancels in float where tanh is near 1
        const T ch = std::cosh(u);
        F[i] = T(1) / (ch * ch);
      }
    }
  });
}
template <class T>
void times_tile(T* g, const T* F, int64_t rows, int64_t cols) {
  for_rows(rows, rows * cols, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * cols; i < r1 * cols; ++i) g[i] *= F[i];
  });
}

// ---------------------------------------------------------------------------------------------
// Filtered path helpers

// Threshold tau of one row z[0..V) (see the file comment); tmp holds V elements.
// top-p never sorts the whole row: the largest `want` candidates are split off with nth_element
// (O(V)) and sorted, the mass is walked down them, and only when the cut lies further does the
// next, 4x larger slice follow. A peaked distribution costs O(V); a flat one ends in a full sort.
template <class T>
T filter_threshold(const T* z, int64_t V, const LogprobOpts& o, T* tmp) {
  std::copy(z, z + V, tmp);
  int64_t kept = V;
  T tau = -INFINITY;
  if (o.top_k > 0 && o.top_k < V) {
    std::nth_element(tmp, tmp + (o.top_k - 1), tmp + V, std::greater<T>());
    tau = tmp[o.top_k - 1];
    // Ties with the k-th value are kept too.
    kept = std::partition(tmp, tmp + V, [tau](T x) { return x >= tau; }) - tmp;
  }
  if (o.top_p < 1.0) {
    const T mx = *std::max_element(tmp, tmp + kept);
    double total = 0;
    for (int64_t i = 0; i < kept; ++i) total += std::exp(double(tmp[i] - mx));
    double before = 0;
    int64_t sorted = 0, want = std::min<int64_t>(kept, 64);
    for (;;) {
      // tmp[0, sorted) holds the largest values in descending order; extend it to `want`.
      if (want < kept)
        std::nth_element(tmp + sorted, tmp + want - 1, tmp + kept, std::greater<T>());
      std::sort(tmp + sorted, tmp + want, std::greater<T>());
      for (int64_t i = sorted; i < want; ++i) {
        if (i > 0 && before / total >= o.top_p) return tmp[i - 1];
        before += std::exp(double(tmp[i] - mx));
      }
      sorted = want;
      if (sorted == kept) return tmp[kept - 1];
      want = std::min(kept, want * 4);
    }
  }
  return tau;
}

// Statistics of one full row under the filter: lse, entropy, and whether the target is kept.
template <class T>
void filtered_row_stats(const T* z, int64_t V, T tau, T* lse, T* ent) {
  T mx = -INFINITY;
  for (int64_t j = 0; j < V; ++j)
    if (z[j] >= tau) mx = std::max(mx, z[j]);
  T l = 0, s1 = 0;
  for (int64_t j = 0; j < V; ++j)
    if (z[j] >= tau) {
      const T d = z[j] - mx, e = exp_t(d);
      l += e;
      s1 += e * d;
    }
  *lse = mx + std::log(l);
  *ent = std::log(l) - s1 / l;
}

template <class T>
void fwd_filtered(T* logprob, T* lse, T* entropy, const T* h, const T* W, const int32_t* target,
                  int64_t N, int64_t C, int64_t V, int64_t K, const LogprobOpts& o,
                  const Scratch& scratch) {
  const int64_t budget = (o.chunk_bytes > 0 ? o.chunk_bytes : kDefaultChunkBytes) / int64_t(sizeof(T));
  const int64_t nb = std::max<int64_t>(1, std::min(N, budget / V));
  const int nt = num_threads();
  ScratchArray<T> buf(scratch, size_t(nb) * V);
  ScratchArray<T> tmp(scratch, size_t(nt) * V);
  const T inv_temp = T(1.0 / o.temperature), cap = T(o.softcap);
  for (int64_t n0 = 0; n0 < N; n0 += nb) {
    const int64_t rows = std::min(nb, N - n0);
    gemm<T>(false, true, rows, V, C, cap > 0 ? T(1) : inv_temp, h + n0 * C, C, W, C, T(0), buf.data(), V);
    if (cap > 0) cap_tile<T>(buf.data(), rows, V, cap, inv_temp, nullptr);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; ++r) {
      const T* z = buf.data() + r * V;
      const T tau = filter_threshold(z, V, o, tmp.data() + size_t(omp_get_thread_num()) * V);
      T row_lse, row_ent;
      filtered_row_stats(z, V, tau, &row_lse, &row_ent);
      const int64_t n = n0 + r;
      lse[n] = row_lse;
      if (entropy) entropy[n] = row_ent;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t t = target[n * K + k];
        logprob[n * K + k] = t < 0 ? T(0) : (z[t] >= tau ? z[t] - row_lse : T(-INFINITY));
      }
    }
  }
}

template <class T>
void bwd_filtered(T* dh, T* dW, const T* dlp, const T* dH, const T* h, const T* W,
                  const int32_t* target, const T* lse, const T* entropy, int64_t N, int64_t C,
                  int64_t V, int64_t K, const LogprobOpts& o, bool accumulate,
                  const Scratch& scratch) {
  const int64_t budget = (o.chunk_bytes > 0 ? o.chunk_bytes : kDefaultChunkBytes) / int64_t(sizeof(T));
  const int64_t nb = std::max<int64_t>(1, std::min(N, budget / V));
  const int nt = num_threads();
  ScratchArray<T> buf(scratch, size_t(nb) * V);
  ScratchArray<T> tmp(scratch, size_t(nt) * V);
  const T inv_temp = T(1.0 / o.temperature), cap = T(o.softcap);
  ScratchArray<T> F(scratch, cap > 0 ? size_t(nb) * V : 0);
  for (int64_t n0 = 0; n0 < N; n0 += nb) {
    const int64_t rows = std::min(nb, N - n0);
    gemm<T>(false, true, rows, V, C, cap > 0 ? T(1) : inv_temp, h + n0 * C, C, W, C, T(0), buf.data(), V);
    if (cap > 0) cap_tile<T>(buf.data(), rows, V, cap, inv_temp, F.data());
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; ++r) {
      T* z = buf.data() + r * V;
      const int64_t n = n0 + r;
      const T tau = filter_threshold(z, V, o, tmp.data() + size_t(omp_get_thread_num()) * V);
      // Targets that were filtered out (or absent) have a constant logprob: no gradient.
      // Decided before z is overwritten with dlogits below.
      std::vector<uint8_t> kept(size_t(K), 0);
      T a = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t t = target[n * K + k];
        kept[size_t(k)] = dlp && t >= 0 && z[t] >= tau;
        if (kept[size_t(k)]) a += dlp[n * K + k];
      }
      const T b = dH ? dH[n] : T(0);
      const T ez = dH ? lse[n] - entropy[n] : T(0);
      for (int64_t j = 0; j < V; ++j) {
        const T p = z[j] >= tau ? exp_t(z[j] - lse[n]) : T(0);
        z[j] = (-a * p - b * p * (z[j] - ez)) * inv_temp;
      }
      for (int64_t k = 0; k < K; ++k)
        if (kept[size_t(k)]) z[target[n * K + k]] += dlp[n * K + k] * inv_temp;
    }
    if (cap > 0) times_tile<T>(buf.data(), F.data(), rows, V);
    gemm<T>(false, false, rows, C, V, T(1), buf.data(), V, W, C, accumulate ? T(1) : T(0),
            dh + n0 * C, C);
    gemm<T>(true, false, V, C, rows, T(1), buf.data(), V, h + n0 * C, C, T(1), dW, C);
  }
}

void check_targets(const int32_t* target, int64_t N, int64_t K, int64_t V) {
  if (K < 1) throw std::invalid_argument("linear_logprob: K (targets per token) must be >= 1");
  for (int64_t i = 0; i < N * K; ++i)
    if (target[i] >= V) throw std::invalid_argument("linear_logprob: target outside the vocabulary");
}

}  // namespace

template <class T>
void linear_logprob_fwd(T* logprob, T* lse, T* entropy, const T* h, const T* W,
                        const int32_t* target, int64_t N, int64_t C, int64_t V, int64_t K,
                        const LogprobOpts& o, const Scratch& scratch) {
  check_opts(o, V);
  check_targets(target, N, K, V);
  if (N == 0) return;
  if (filtered(o))
    return fwd_filtered(logprob, lse, entropy, h, W, target, N, C, V, K, o, scratch);
  int64_t nb, vc;
  tile_shape(N, V, o, sizeof(T), &nb, &vc);
  ScratchArray<T> buf(scratch, size_t(nb) * vc);
  ScratchArray<T> stats(scratch, size_t(nb) * (3 + K));  // m, l, s1 [nb]; zt [nb, K]
  const T inv_temp = T(1.0 / o.temperature), cap = T(o.softcap);
  for (int64_t n0 = 0; n0 < N; n0 += nb) {
    const int64_t rows = std::min(nb, N - n0);
    T* m = stats.data();
    T* l = m + nb;
    T* s1 = l + nb;
    T* zt = s1 + nb;
    std::fill(m, m + rows, T(-INFINITY));
    std::fill(l, l + rows, T(0));
    std::fill(s1, s1 + rows, T(0));
    std::fill(zt, zt + rows * K, T(0));
    const int32_t* tg = target + n0 * K;
    for (int64_t v0 = 0; v0 < V; v0 += vc) {
      const int64_t cols = std::min(vc, V - v0);
      gemm<T>(false, true, rows, cols, C, cap > 0 ? T(1) : inv_temp, h + n0 * C, C, W + v0 * C, C, T(0),
              buf.data(), cols);
      if (cap > 0) cap_tile<T>(buf.data(), rows, cols, cap, inv_temp, nullptr);
      for_rows(rows, rows * cols, [&](int64_t r0, int64_t r1) {
        if constexpr (std::is_same_v<T, float>)
          stats_f_select()(buf.data(), cols, r0, r1, cols, v0, tg, K, m, l, s1, zt);
        else
          stats_rows<T>(buf.data(), cols, r0, r1, cols, v0, tg, K, m, l, s1, zt);
      });
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = n0 + r;
      lse[n] = m[r] + std::log(l[r]);
      if (entropy) entropy[n] = std::log(l[r]) - s1[r] / l[r];
      for (int64_t k = 0; k < K; ++k)
        logprob[n * K + k] = target[n * K + k] < 0 ? T(0) : zt[r * K + k] - lse[n];
    }
  }
}

template <class T>
void linear_logprob_bwd(T* dh, T* dW, const T* dlp, const T* dH, const T* h, const T* W,
                        const int32_t* target, const T* lse, const T* entropy, int64_t N,
                        int64_t C, int64_t V, int64_t K, const LogprobOpts& o, bool accumulate,
                        const Scratch& scratch) {
  check_opts(o, V);
  check_targets(target, N, K, V);
  if (dH && !entropy) throw std::invalid_argument("linear_logprob_bwd: dentropy needs entropy");
  if (N == 0) return;
  if (filtered(o))
    return bwd_filtered(dh, dW, dlp, dH, h, W, target, lse, entropy, N, C, V, K, o, accumulate,
                        scratch);
  int64_t nb, vc;
  tile_shape(N, V, o, sizeof(T), &nb, &vc);
  ScratchArray<T> buf(scratch, size_t(nb) * vc);
  ScratchArray<T> ez(scratch, dH ? size_t(nb) : 0);
  const T inv_temp = T(1.0 / o.temperature), cap = T(o.softcap);
  ScratchArray<T> F(scratch, cap > 0 ? size_t(nb) * vc : 0);
  for (int64_t n0 = 0; n0 < N; n0 += nb) {
    const int64_t rows = std::min(nb, N - n0);
    if (dH)
      for (int64_t r = 0; r < rows; ++r) ez.data()[r] = lse[n0 + r] - entropy[n0 + r];
    const int32_t* tg = target + n0 * K;
    const T* dlp_b = dlp ? dlp + n0 * K : nullptr;
    const T* dH_b = dH ? dH + n0 : nullptr;
    for (int64_t v0 = 0; v0 < V; v0 += vc) {
      const int64_t cols = std::min(vc, V - v0);
      gemm<T>(false, true, rows, cols, C, cap > 0 ? T(1) : inv_temp, h + n0 * C, C, W + v0 * C, C, T(0),
              buf.data(), cols);
      if (cap > 0) cap_tile<T>(buf.data(), rows, cols, cap, inv_temp, F.data());
      for_rows(rows, rows * cols, [&](int64_t r0, int64_t r1) {
        if constexpr (std::is_same_v<T, float>)
          grad_f_select()(buf.data(), cols, r0, r1, cols, v0, tg, K, lse + n0, ez.data(), dlp_b,
                          dH_b, inv_temp);
        else
          grad_rows<T>(buf.data(), cols, r0, r1, cols, v0, tg, K, lse + n0, ez.data(), dlp_b,
                       dH_b, inv_temp);
      });
      if (cap > 0) times_tile<T>(buf.data(), F.data(), rows, cols);
      const T beta = (v0 == 0 && !accumulate) ? T(0) : T(1);
      gemm<T>(false, false, rows, C, cols, T(1), buf.data(), cols, W + v0 * C, C, beta,
              dh + n0 * C, C);
      gemm<T>(true, false, cols, C, rows, T(1), buf.data(), cols, h + n0 * C, C, T(1),
              dW + v0 * C, C);
    }
  }
}

template void linear_logprob_fwd<float>(float*, float*, float*, const float*, const float*,
                                        const int32_t*, int64_t, int64_t, int64_t, int64_t,
                                        const LogprobOpts&, const Scratch&);
template void linear_logprob_fwd<double>(double*, double*, double*, const double*, const double*,
                                         const int32_t*, int64_t, int64_t, int64_t, int64_t,
                                         const LogprobOpts&, const Scratch&);
template void linear_logprob_bwd<float>(float*, float*, const float*, const float*, const float*,
                                        const float*, const int32_t*, const float*, const float*,
                                        int64_t, int64_t, int64_t, int64_t, const LogprobOpts&,
                                        bool, const Scratch&);
template void linear_logprob_bwd<double>(double*, double*, const double*, const double*,
                                         const double*, const double*, const int32_t*,
                                         const double*, const double*, int64_t, int64_t, int64_t,
                                         int64_t, const LogprobOpts&, bool, const Scratch&);
size_t linear_logprob_workspace(bool backward, int64_t N, int64_t V, int64_t K, const LogprobOpts& o,
                                bool entropy_grad, size_t esize, int threads) {
  auto piece = [](size_t bytes) { return (bytes + 63) / 64 * 64; };
  if (N == 0) return 0;
  if (filtered(o)) {
    const int64_t budget = (o.chunk_bytes > 0 ? o.chunk_bytes : kDefaultChunkBytes) / int64_t(esize);
    const int64_t nb = std::max<int64_t>(1, std::min(N, budget / V));
    const size_t cap = backward && o.softcap > 0 ? piece(size_t(nb * V) * esize) : 0;  // the cap's derivative
    return piece(size_t(nb * V) * esize) + piece(size_t(threads) * size_t(V) * esize) + cap;
  }
  int64_t nb, vc;
  tile_shape(N, V, o, esize, &nb, &vc);
  if (!backward) return piece(size_t(nb * vc) * esize) + piece(size_t(nb * (3 + K)) * esize);
  return piece(size_t(nb * vc) * esize) + (entropy_grad ? piece(size_t(nb) * esize) : 0) +
         (o.softcap > 0 ? piece(size_t(nb * vc) * esize) : 0);
}

// The sampler's cut (sample.cpp): the same selection, so a sampled token is one the trainer's
// processed logprob keeps.
float sample_filter_threshold(const float* z, int64_t V, int64_t top_k, double top_p, float* tmp) {
  LogprobOpts o;
  o.top_k = top_k;
  o.top_p = top_p;
  return filter_threshold(z, V, o, tmp);
}

}  // namespace rlh::kcpu
