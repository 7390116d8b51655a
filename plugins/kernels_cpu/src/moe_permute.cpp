// MoE token permutation: tokens to expert-sorted rows and back (dropless: every one of the N*K
// (token, choice) pairs gets a row; no capacity, no padding).
//
//   index:     row[n, k] = the row of pair (n, k) in expert order. Rows of expert e are
//              offsets[e] .. offsets[e+1]-1 and hold its pairs in (n, k) order (a stable
//              counting sort), so the layout depends only on the choice, never on threads.
//   permute:   xp[row[n, k]] = x[n]                      (a scatter: each row written once)
//   backward:  dx[n] (+)= sum_k dxp[row[n, k]]           (a gather, k in order)
//   unpermute: y[n] (+)= sum_k w[n, k] yp[row[n, k]]     (the weighted combine)
//   backward:  dyp[row[n, k]] = w[n, k] dy[n],  dw[n, k] = <dy[n], yp[row[n, k]]>
// Every output row has one writer and sums in a fixed order: thread-count independent.
#include <omp.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "rlhost/kernels_cpu/kernels.hpp"

namespace rlh::kcpu {

void moe_permute_index(int32_t* row, int32_t* offsets, const int32_t* experts, int64_t N,
                       int64_t K, int64_t E) {
  if (N < 0 || K <= 0 || E <= 0) throw std::invalid_argument("moe_permute: bad sizes");
  if (N * K > int64_t(INT32_MAX)) throw std::invalid_argument("moe_permute: more than 2^31 rows");
  std::vector<int64_t> count(size_t(E) + 1, 0);
  for (int64_t i = 0; i < N * K; ++i) {
    const int32_t e = experts[i];
    if (e < 0 || e >= E)
      throw std::invalid_argument("moe_permute: expert " + std::to_string(e) + " outside [0, " +
                                  std::to_string(E) + ")");
    ++count[size_t(e) + 1];
  }
  for (int64_t e = 0; e < E; ++e) count[size_t(e) + 1] += count[size_t(e)];
  for (int64_t e = 0; e <= E; ++e) offsets[e] = int32_t(count[size_t(e)]);
  for (int64_t i = 0; i < N * K; ++i) row[i] = int32_t(count[size_t(experts[i])]++);
}

template <class T>
void moe_permute_fwd(T* xp, int64_t ldxp, int32_t* row, int32_t* offsets, const T* x, int64_t ldx,
                     const int32_t* experts, int64_t N, int64_t K, int64_t C, int64_t E) {
  moe_permute_index(row, offsets, experts, N, K, E);
#pragma omp parallel for schedule(static) if (N * K * C > 65536)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const T* src = x + n * ldx;
      T* dst = xp + int64_t(row[n * K + k]) * ldxp;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dst[c] = src[c];
    }
}

namespace {

// y[n] (+)= sum_k w[n,k] yp[row[n,k]]; w null = 1 (the permute backward).
template <class T>
void combine(T* y, int64_t ldy, const T* yp, int64_t ldyp, const int32_t* row, const T* w,
             int64_t N, int64_t K, int64_t C, bool accumulate) {
  const int64_t rows = N * K;
#pragma omp parallel for schedule(static) if (N * K * C > 65536)
  for (int64_t n = 0; n < N; ++n) {
    T* dst = y + n * ldy;
    if (!accumulate)
      for (int64_t c = 0; c < C; ++c) dst[c] = T(0);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = row[n * K + k];
      if (r < 0 || r >= rows) continue;  // check_rows refused such rows before
      const T* src = yp + r * ldyp;
      const T wk = w ? w[n * K + k] : T(1);
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dst[c] += wk * src[c];
    }
  }
}

// row must be a permutation of 0 .. N*K-1 (what moe_permute_index makes): every permuted row
// then has exactly one writer in the backward scatter.
void check_rows(const int32_t* row, int64_t N, int64_t K, const char* what) {
  std::vector<char> seen(size_t(N * K), 0);
  for (int64_t i = 0; i < N * K; ++i) {
    if (row[i] < 0 || row[i] >= N * K || seen[size_t(row[i])])
      throw std::invalid_argument(std::string(what) + ": row is not a permutation of [0, N*K)");
    seen[size_t(row[i])] = 1;
  }
}

}  // namespace

template <class T>
void moe_permute_bwd(T* dx, int64_t lddx, const T* dxp, int64_t lddxp, const int32_t* row,
                     int64_t N, int64_t K, int64_t C, bool accumulate) {
  check_rows(row, N, K, "moe_permute_bwd");
  combine<T>(dx, lddx, dxp, lddxp, row, nullptr, N, K, C, accumulate);
}

template <class T>
void moe_unpermute_fwd(T* y, int64_t ldy, const T* yp, int64_t ldyp, const int32_t* row,
                       const T* weights, int64_t N, int64_t K, int64_t C, bool accumulate) {
  check_rows(row, N, K, "moe_unpermute_fwd");
  combine<T>(y, ldy, yp, ldyp, row, weights, N, K, C, accumulate);
}

template <class T>
void moe_unpermute_bwd(T* dyp, int64_t lddyp, T* dweights, const T* dy, int64_t lddy,
                       const T* yp, int64_t ldyp, const int32_t* row, const T* weights, int64_t N,
                       int64_t K, int64_t C) {
  check_rows(row, N, K, "moe_unpermute_bwd");
#pragma omp parallel for schedule(static) if (N * K * C > 65536)
  for (int64_t n = 0; n < N; ++n) {
    const T* d = dy + n * lddy;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = row[n * K + k];
      T* out = dyp + r * lddyp;
      const T wk = weights[n * K + k];
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) out[c] = wk * d[c];
      if (dweights) {
        const T* src = yp + r * ldyp;
        T acc = 0;
#pragma omp simd reduction(+ : acc)
        for (int64_t c = 0; c < C; ++c) acc += d[c] * src[c];
        dweights[n * K + k] = acc;
      }
    }
  }
}

template void moe_permute_fwd<float>(float*, int64_t, int32_t*, int32_t*, const float*, int64_t,
                                     const int32_t*, int64_t, int64_t, int64_t, int64_t);
template void moe_permute_fwd<double>(double*, int64_t, int32_t*, int32_t*, const double*,
                                      int64_t, const int32_t*, int64_t, int64_t, int64_t, int64_t);
template void moe_permute_bwd<float>(float*, int64_t, const float*, int64_t, const int32_t*,
                                     int64_t, int64_t, int64_t, bool);
template void moe_permute_bwd<double>(double*, int64_t, const double*, int64_t, const int32_t*,
                                      int64_t, int64_t, int64_t, bool);
template void moe_unpermute_fwd<float>(float*, int64_t, const float*, int64_t, const int32_t*,
                                       const float*, int64_t, int64_t, int64_t, bool);
template void moe_unpermute_fwd<double>(double*, int64_t, const double*, int64_t, const int32_t*,
                                        const double*, int64_t, int64_t, int64_t, bool);
template void moe_unpermute_bwd<float>(float*, int64_t, float*, const float*, int64_t,
                                       const float*, int64_t, const int32_t*, const float*,
                                       int64_t, int64_t, int64_t);
template void moe_unpermute_bwd<double>(double*, int64_t, double*, const double*, int64_t,
                                        const double*, int64_t, const int32_t*, const double*,
                                        int64_t, int64_t, int64_t);

}  // namespace rlh::kcpu
