// attention: causal softmax(scale * q k^T) v over packed sequences with GQA and an optional
// sliding window, flash-style (conventions in kernels.hpp).
//
// Forward, per (sequence, query head, block of kBq queries):
//   for each tile of kBk visible keys:
//     S = scale * Q K^T               [bq, bk]   (gemm; -inf where masked)
//     m' = max(m, rowmax S); P = exp(S - m'); l = l*exp(m-m') + rowsum P; O = O*exp(m-m') + P V
//   O /= l; lse = m + log l
// so memory is O(threads * kBq * kBk), never [N, N].
//
// Backward recomputes P = exp(S - lse) and, with Delta_i = dO_i . O_i and dS = P * (dP - Delta),
// dP = dO V^T, gives dV = P^T dO, dK = scale dS^T Q, dQ = scale dS K. It runs as two passes so
// that every output row has exactly one writer (no atomics, no per-thread copies of dq/dk/dv,
// results independent of the thread count):
//   pass A, per (sequence, kv head, block of keys): dK, dV of those keys over all the queries
//     (of every query head in the group) that see them;
//   pass B, per (sequence, query head, block of queries): dQ.
// Pass B recomputes S and dP once more (7 tile matmuls instead of 5), the price of that.
//
// Soft-capping (Gemma-2): S = c tanh(scale Q K^T / c) before the mask. The backward multiplies
// dS by the cap's derivative 1 / cosh^2(s / c), kept per tile from the recomputed scores (a third
// tile per thread) before they become probabilities.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "rlhost/kernels_cpu/kernels.hpp"
#include "simd.hpp"  // exp_t, RLH_KCPU_MULTIVERSION

namespace rlh::kcpu {
namespace {

// Tile sizes (measured on AVX-512 at T = 4096, D = 64: 128-query blocks beat 64 by ~10%, as
// each packed key tile serves more queries; larger blocks gained little more).
constexpr int64_t kBq = 128;   // queries per forward block / dQ block
constexpr int64_t kBk = 256;   // keys per forward tile / dQ tile
constexpr int64_t kBkA = 128;  // keys per dK/dV block (pass A)
constexpr int64_t kBqA = 256;  // queries per pass-A tile

// Visible keys of query i (positions within its sequence): [key_lo(i), i].
inline int64_t key_lo(int64_t i, int64_t W) { return W > 0 ? std::max<int64_t>(0, i - W + 1) : 0; }
// Last query that sees key j in a sequence of length L.
inline int64_t query_hi(int64_t j, int64_t W, int64_t L) {
  return W > 0 ? std::min(L - 1, j + W - 1) : L - 1;
}

// S = scale * Q K^T for queries i0.. (bq rows) and keys j0.. (bk), soft-capped when cap > 0,
// then -inf where a key is not visible. Tiles entirely inside the visible band skip the masking
// loop.
// With F (the backward), F gets the cap's derivative 1 / cosh^2(s / cap) (0 where masked),
// from the uncapped score: 1 - tanh^2 would cancel in float where tanh is near 1.
template <class T>
void scores_tile(T* S, int64_t ldS, const T* q, int64_t ldq, const T* k, int64_t ldk, int64_t bq,
                 int64_t bk, int64_t Dk, T scale, int64_t i0, int64_t j0, int64_t W, T cap,
                 T* F = nullptr) {
  gemm<T>(false, true, bq, bk, Dk, scale, q, ldq, k, ldk, T(0), S, ldS);
  if (cap > 0)
    for (int64_t r = 0; r < bq; ++r)
      for (int64_t c = 0; c < bk; ++c) {
        const T u = S[r * ldS + c] / cap;
        S[r * ldS + c] = cap * std::tanh(u);
        if (F) {
          const T ch = std::cosh(u);
          F[r * ldS + c] = T(1) / (ch * ch);
        }
      }
  const bool causal_ok = j0 + bk - 1 <= i0;
  const bool window_ok = W <= 0 || j0 >= key_lo(i0 + bq - 1, W);
  if (causal_ok && window_ok) return;
  for (int64_t r = 0; r < bq; ++r) {
    const int64_t i = i0 + r;
    const int64_t lo = key_lo(i, W) - j0, hi = i - j0;  // visible columns [lo, hi]
    T* s = S + r * ldS;
    for (int64_t c = 0; c < bk; ++c)
      if (c < lo || c > hi) {
        s[c] = -INFINITY;
        if (F) F[r * ldS + c] = 0;
      }
  }
}

// Online-softmax update of rows [0, bq): see the file comment. S becomes P.
template <class T>
RLH_KCPU_INLINE void softmax_update_rows(T* S, int64_t ldS, int64_t bq, int64_t bk, T* m, T* l,
                                         T* O, int64_t ldO, int64_t Dv) {
  for (int64_t r = 0; r < bq; ++r) {
    T* s = S + r * ldS;
    T mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t c = 0; c < bk; ++c) mx = std::max(mx, s[c]);
    const T m_new = std::max(m[r], mx);
    if (m_new == -INFINITY) {  // nothing visible yet in this row
      for (int64_t c = 0; c < bk; ++c) s[c] = 0;
      continue;
    }
    const T corr = exp_t(m[r] - m_new);
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < bk; ++c) {
      const T p = exp_t(s[c] - m_new);
      s[c] = p;
      sum += p;
    }
    l[r] = l[r] * corr + sum;
    m[r] = m_new;
    if (corr != T(1)) {
      T* o = O + r * ldO;
#pragma omp simd
      for (int64_t d = 0; d < Dv; ++d) o[d] *= corr;
    }
  }
}

// P = exp(S - lse_r) row by row (lse is this tile's rows, contiguous).
template <class T>
RLH_KCPU_INLINE void probs_rows(T* S, int64_t ldS, int64_t bq, int64_t bk, const T* lse) {
  for (int64_t r = 0; r < bq; ++r) {
    T* s = S + r * ldS;
    const T z = lse[r];
#pragma omp simd
    for (int64_t c = 0; c < bk; ++c) s[c] = exp_t(s[c] - z);
  }
}

// dS *= F (the gradient through the cap).
template <class T>
void times_rows(T* dS, const T* F, int64_t ld, int64_t bq, int64_t bk) {
  for (int64_t r = 0; r < bq; ++r)
    for (int64_t c = 0; c < bk; ++c) dS[r * ld + c] *= F[r * ld + c];
}

// dP <- P * (dP - Delta_r): the score gradient dS.
template <class T>
RLH_KCPU_INLINE void dscores_rows(T* dP, const T* P, int64_t ld, int64_t bq, int64_t bk,
                                  const T* delta) {
  for (int64_t r = 0; r < bq; ++r) {
    T* d = dP + r * ld;
    const T* p = P + r * ld;
    const T dr = delta[r];
#pragma omp simd
    for (int64_t c = 0; c < bk; ++c) d[c] = p[c] * (d[c] - dr);
  }
}

RLH_KCPU_MULTIVERSION(softmax_update_f, softmax_update_rows,
                      (float* S, int64_t ldS, int64_t bq, int64_t bk, float* m, float* l, float* O,
                       int64_t ldO, int64_t Dv),
                      (S, ldS, bq, bk, m, l, O, ldO, Dv))
RLH_KCPU_MULTIVERSION(probs_f, probs_rows,
                      (float* S, int64_t ldS, int64_t bq, int64_t bk, const float* lse),
                      (S, ldS, bq, bk, lse))

template <class T>
void softmax_update(T* S, int64_t ldS, int64_t bq, int64_t bk, T* m, T* l, T* O, int64_t ldO,
                    int64_t Dv) {
  if constexpr (std::is_same_v<T, float>)
    softmax_update_f_select()(S, ldS, bq, bk, m, l, O, ldO, Dv);
  else
    softmax_update_rows<T>(S, ldS, bq, bk, m, l, O, ldO, Dv);
}
template <class T>
void probs(T* S, int64_t ldS, int64_t bq, int64_t bk, const T* lse) {
  if constexpr (std::is_same_v<T, float>)
    probs_f_select()(S, ldS, bq, bk, lse);
  else
    probs_rows<T>(S, ldS, bq, bk, lse);
}

void check_layout(const int32_t* cu, int64_t S, int64_t N, int64_t Hq, int64_t Hkv) {
  if (Hkv <= 0 || Hq % Hkv) throw std::invalid_argument("attention: Hq must be a multiple of Hkv");
  if (S < 0 || cu[0] != 0 || cu[S] != N)
    throw std::invalid_argument("attention: cu_seqlens must run from 0 to N");
  for (int64_t s = 0; s < S; ++s)
    if (cu[s + 1] < cu[s]) throw std::invalid_argument("attention: cu_seqlens must not decrease");
}

// Threads worth using: one for problems so small that waking a second thread costs more than
// the work (about L^2/2 * H * (Dk + Dv) multiply-adds in all).
int attention_threads(const int32_t* cu, int64_t S, int64_t Hq, int64_t Dk, int64_t Dv) {
  if (omp_in_parallel()) return 1;
  double work = 0;
  for (int64_t s = 0; s < S; ++s) {
    const double L = double(cu[s + 1]) - cu[s];
    work += L * L * 0.5 * double(Hq) * double(Dk + Dv);
  }
  return work < 2e5 ? 1 : num_threads();
}

// Work units (sequence, block) flattened: block b of sequence s is unit first[s] + b. Returns
// the total and fills first[0..S].
int64_t count_blocks(const int32_t* cu, int64_t S, int64_t block, int64_t* first) {
  first[0] = 0;
  for (int64_t s = 0; s < S; ++s)
    first[s + 1] = first[s] + (int64_t(cu[s + 1]) - cu[s] + block - 1) / block;
  return first[S];
}
int64_t unit_sequence(const int64_t* first, int64_t S, int64_t u) {
  return std::upper_bound(first, first + S + 1, u) - first - 1;
}

}  // namespace

template <class T>
void attention_fwd(T* o, int64_t ldo, T* lse, const T* q, int64_t ldq, const T* k, int64_t ldk,
                   const T* v, int64_t ldv, const int32_t* cu, int64_t S, int64_t N, int64_t Hq,
                   int64_t Hkv, int64_t Dk, int64_t Dv, T scale, int64_t W,
                   const Scratch& scratch, T cap) {
  check_layout(cu, S, N, Hq, Hkv);
  const int64_t group = Hq / Hkv;
  ScratchArray<int64_t> first(scratch, S + 1);
  const int64_t blocks = count_blocks(cu, S, kBq, first.data());
  const int nt = attention_threads(cu, S, Hq, Dk, Dv);
  const int64_t per_thread = kBq * kBk + 2 * kBq;  // S tile, m, l
  ScratchArray<T> ws(scratch, size_t(nt) * per_thread);

#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
  for (int64_t u = 0; u < blocks * Hq; ++u) {
    const int64_t h = u % Hq, b = u / Hq;
    const int64_t s = unit_sequence(first.data(), S, b);
    const int64_t base = cu[s], L = cu[s + 1] - cu[s];
    const int64_t i0 = (b - first[s]) * kBq, bq = std::min(kBq, L - i0);
    const int64_t g = h / group;
    T* Sbuf = ws.data() + omp_get_thread_num() * per_thread;
    T* m = Sbuf + kBq * kBk;
    T* l = m + kBq;
    T* O = o + (base + i0) * ldo + h * Dv;  // accumulated in place
    for (int64_t r = 0; r < bq; ++r) {
      m[r] = -INFINITY;
      l[r] = 0;
      std::fill(O + r * ldo, O + r * ldo + Dv, T(0));
    }
    const T* Q = q + (base + i0) * ldq + h * Dk;
    const int64_t jlo = key_lo(i0, W), jhi = i0 + bq - 1;
    for (int64_t j0 = jlo; j0 <= jhi; j0 += kBk) {
      const int64_t bk = std::min(kBk, jhi + 1 - j0);
      const T* K = k + (base + j0) * ldk + g * Dk;
      const T* Vt = v + (base + j0) * ldv + g * Dv;
      scores_tile<T>(Sbuf, kBk, Q, ldq, K, ldk, bq, bk, Dk, scale, i0, j0, W, cap);
      softmax_update<T>(Sbuf, kBk, bq, bk, m, l, O, ldo, Dv);
      gemm<T>(false, false, bq, Dv, bk, T(1), Sbuf, kBk, Vt, ldv, T(1), O, ldo);
    }
    for (int64_t r = 0; r < bq; ++r) {
      const T inv = T(1) / l[r];
      for (int64_t d = 0; d < Dv; ++d) O[r * ldo + d] *= inv;
      lse[h * N + base + i0 + r] = m[r] + std::log(l[r]);
    }
  }
}

template <class T>
void attention_bwd(T* dq, int64_t lddq, T* dk, int64_t lddk, T* dv, int64_t lddv, const T* dout,
                   int64_t lddo, const T* q, int64_t ldq, const T* k, int64_t ldk, const T* v,
                   int64_t ldv, const T* o, int64_t ldo, const T* lse, const int32_t* cu,
                   int64_t S, int64_t N, int64_t Hq, int64_t Hkv, int64_t Dk, int64_t Dv, T scale,
                   int64_t W, const Scratch& scratch, T cap) {
  check_layout(cu, S, N, Hq, Hkv);
  const int64_t group = Hq / Hkv;
  const int nt = attention_threads(cu, S, Hq, Dk, Dv);

  // Delta[h, t] = dO[t, h] . O[t, h]
  ScratchArray<T> delta(scratch, size_t(Hq) * N);
#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t t = 0; t < N; ++t)
    for (int64_t h = 0; h < Hq; ++h) {
      const T* a = dout + t * lddo + h * Dv;
      const T* bb = o + t * ldo + h * Dv;
      T acc = 0;
      for (int64_t d = 0; d < Dv; ++d) acc += a[d] * bb[d];
      delta[h * N + t] = acc;
    }

  const int64_t tile = std::max(kBq * kBk, kBkA * kBqA);
  const int64_t per_thread = (cap > 0 ? 3 : 2) * tile;  // P, dP (and the cap's derivative F)
  ScratchArray<T> ws(scratch, size_t(nt) * per_thread);
  ScratchArray<int64_t> first(scratch, S + 1);

  // Pass A: dK, dV per (sequence, kv head, key block). P and dS are [queries, keys] tiles with
  // row stride kBkA.
  const int64_t kblocks = count_blocks(cu, S, kBkA, first.data());
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
  for (int64_t u = 0; u < kblocks * Hkv; ++u) {
    const int64_t g = u % Hkv, b = u / Hkv;
    const int64_t s = unit_sequence(first.data(), S, b);
    const int64_t base = cu[s], L = cu[s + 1] - cu[s];
    const int64_t j0 = (b - first[s]) * kBkA, bk = std::min(kBkA, L - j0);
    T* P = ws.data() + omp_get_thread_num() * per_thread;
    T* dP = P + tile;
    T* F = dP + tile;  // used only when cap > 0
    T* dK = dk + (base + j0) * lddk + g * Dk;
    T* dV = dv + (base + j0) * lddv + g * Dv;
    for (int64_t r = 0; r < bk; ++r) {
      std::fill(dK + r * lddk, dK + r * lddk + Dk, T(0));
      std::fill(dV + r * lddv, dV + r * lddv + Dv, T(0));
    }
    const T* K = k + (base + j0) * ldk + g * Dk;
    const T* Vt = v + (base + j0) * ldv + g * Dv;
    const int64_t ilo = j0, ihi = query_hi(j0 + bk - 1, W, L);
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      for (int64_t i0 = ilo; i0 <= ihi; i0 += kBqA) {
        const int64_t bq = std::min(kBqA, ihi + 1 - i0);
        const T* Q = q + (base + i0) * ldq + h * Dk;
        const T* dO = dout + (base + i0) * lddo + h * Dv;
        scores_tile<T>(P, kBkA, Q, ldq, K, ldk, bq, bk, Dk, scale, i0, j0, W, cap, cap > 0 ? F : nullptr);
        probs<T>(P, kBkA, bq, bk, lse + h * N + base + i0);
        gemm<T>(true, false, bk, Dv, bq, T(1), P, kBkA, dO, lddo, T(1), dV, lddv);
        gemm<T>(false, true, bq, bk, Dv, T(1), dO, lddo, Vt, ldv, T(0), dP, kBkA);
        dscores_rows<T>(dP, P, kBkA, bq, bk, delta.data() + h * N + base + i0);
        if (cap > 0) times_rows<T>(dP, F, kBkA, bq, bk);
        gemm<T>(true, false, bk, Dk, bq, scale, dP, kBkA, Q, ldq, T(1), dK, lddk);
      }
    }
  }

  // Pass B: dQ per (sequence, query head, query block).
  const int64_t qblocks = count_blocks(cu, S, kBq, first.data());
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
  for (int64_t u = 0; u < qblocks * Hq; ++u) {
    const int64_t h = u % Hq, b = u / Hq;
    const int64_t s = unit_sequence(first.data(), S, b);
    const int64_t base = cu[s], L = cu[s + 1] - cu[s];
    const int64_t i0 = (b - first[s]) * kBq, bq = std::min(kBq, L - i0);
    const int64_t g = h / group;
    T* P = ws.data() + omp_get_thread_num() * per_thread;
    T* dP = P + tile;
    T* F = dP + tile;  // used only when cap > 0
    T* dQ = dq + (base + i0) * lddq + h * Dk;
    for (int64_t r = 0; r < bq; ++r) std::fill(dQ + r * lddq, dQ + r * lddq + Dk, T(0));
    const T* Q = q + (base + i0) * ldq + h * Dk;
    const T* dO = dout + (base + i0) * lddo + h * Dv;
    const int64_t jlo = key_lo(i0, W), jhi = i0 + bq - 1;
    for (int64_t j0 = jlo; j0 <= jhi; j0 += kBk) {
      const int64_t bk = std::min(kBk, jhi + 1 - j0);
      const T* K = k + (base + j0) * ldk + g * Dk;
      const T* Vt = v + (base + j0) * ldv + g * Dv;
      scores_tile<T>(P, kBk, Q, ldq, K, ldk, bq, bk, Dk, scale, i0, j0, W, cap, cap > 0 ? F : nullptr);
      probs<T>(P, kBk, bq, bk, lse + h * N + base + i0);
      gemm<T>(false, true, bq, bk, Dv, T(1), dO, lddo, Vt, ldv, T(0), dP, kBk);
      dscores_rows<T>(dP, P, kBk, bq, bk, delta.data() + h * N + base + i0);
      if (cap > 0) times_rows<T>(dP, F, kBk, bq, bk);
      gemm<T>(false, false, bq, Dk, bk, scale, dP, kBk, K, ldk, T(1), dQ, lddq);
    }
  }
}

template void attention_fwd<float>(float*, int64_t, float*, const float*, int64_t, const float*,
                                   int64_t, const float*, int64_t, const int32_t*, int64_t, int64_t,
                                   int64_t, int64_t, int64_t, int64_t, float, int64_t,
                                   const Scratch&, float);
template void attention_fwd<double>(double*, int64_t, double*, const double*, int64_t,
                                    const double*, int64_t, const double*, int64_t,
                                    const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                    int64_t, double, int64_t, const Scratch&, double);
template void attention_bwd<float>(float*, int64_t, float*, int64_t, float*, int64_t, const float*,
                                   int64_t, const float*, int64_t, const float*, int64_t,
                                   const float*, int64_t, const float*, int64_t, const float*,
                                   const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                   int64_t, float, int64_t, const Scratch&, float);
template void attention_bwd<double>(double*, int64_t, double*, int64_t, double*, int64_t,
                                    const double*, int64_t, const double*, int64_t, const double*,
                                    int64_t, const double*, int64_t, const double*, int64_t,
                                    const double*, const int32_t*, int64_t, int64_t, int64_t,
                                    int64_t, int64_t, int64_t, double, int64_t, const Scratch&, double);
size_t attention_workspace(bool backward, int64_t S, int64_t N, int64_t Hq, size_t esize, int threads,
                           bool softcap) {
  auto piece = [](size_t bytes) { return (bytes + 63) / 64 * 64; };
  const size_t first = piece(size_t(S + 1) * sizeof(int64_t));
  if (!backward) return first + piece(size_t(threads) * size_t(kBq * kBk + 2 * kBq) * esize);
  const int64_t tile = std::max(kBq * kBk, kBkA * kBqA);
  return piece(size_t(Hq) * size_t(N) * esize) + piece(size_t(threads) * size_t((softcap ? 3 : 2) * tile) * esize) +
         first;
}

}  // namespace rlh::kcpu
