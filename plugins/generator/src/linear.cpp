// Row-invariant y = x W^T (why and how in linear.hpp).
//
// Written with GCC vector types of 16 floats: one zmm register under AVX-512, a pair of ymm under
// AVX2, four xmm otherwise. The arithmetic order of an element is the same in every tile shape:
// lanes accumulate k = l, l+16, l+32, ... (a zero-padded tail last), then the fixed tree of hsum16.
#include "rlhost/generator/linear.hpp"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "simd.hpp"

namespace rlh::gen {

namespace {

typedef float v16 __attribute__((vector_size(64)));

RLH_GEN_INLINE v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
RLH_GEN_INLINE v16 load_tail(const float* p, int64_t n) {
  v16 v = {};
  std::memcpy(&v, p, size_t(n) * sizeof(float));
  return v;
}

// The fixed reduction tree: halves, quarters, ... (never reassociated: no -ffast-math here).
RLH_GEN_INLINE float hsum16(v16 v) {
  float t[16];
  std::memcpy(t, &v, sizeof(t));
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = t[i] + t[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// One register tile: RM input rows x RN weight rows over the whole K.
template <int RM, int RN>
RLH_GEN_INLINE void tile(float* y, int64_t ldy, const float* x, int64_t ldx, const float* W,
                         int64_t ldw, int64_t K) {
  v16 acc[RM][RN];
  for (int m = 0; m < RM; ++m)
    for (int n = 0; n < RN; ++n) acc[m][n] = v16{};
  const int64_t K16 = K / 16 * 16;
  for (int64_t k = 0; k < K16; k += 16) {
    v16 xv[RM];
    for (int m = 0; m < RM; ++m) xv[m] = load16(x + m * ldx + k);
    for (int n = 0; n < RN; ++n) {
      const v16 w = load16(W + n * ldw + k);
      for (int m = 0; m < RM; ++m) acc[m][n] += xv[m] * w;
    }
  }
  if (K16 < K) {
    v16 xv[RM];
    for (int m = 0; m < RM; ++m) xv[m] = load_tail(x + m * ldx + K16, K - K16);
    for (int n = 0; n < RN; ++n) {
      const v16 w = load_tail(W + n * ldw + K16, K - K16);
      for (int m = 0; m < RM; ++m) acc[m][n] += xv[m] * w;
    }
  }
  for (int m = 0; m < RM; ++m)
    for (int n = 0; n < RN; ++n) y[m * ldy + n] = hsum16(acc[m][n]);
}

// Edge tiles by run-time shape (rm, rn <= 4).
template <int RM>
RLH_GEN_INLINE void tile_rn(int rn, float* y, int64_t ldy, const float* x, int64_t ldx,
                            const float* W, int64_t ldw, int64_t K) {
  switch (rn) {
    case 1: tile<RM, 1>(y, ldy, x, ldx, W, ldw, K); break;
    case 2: tile<RM, 2>(y, ldy, x, ldx, W, ldw, K); break;
    case 3: tile<RM, 3>(y, ldy, x, ldx, W, ldw, K); break;
    default: tile<RM, 4>(y, ldy, x, ldx, W, ldw, K); break;
  }
}

// All of y[:, 0:N] on the calling thread.
template <class T>
RLH_GEN_INLINE void linear_body(float* y, int64_t ldy, const float* x, int64_t ldx, const float* W,
                                int64_t ldw, int64_t M, int64_t N, int64_t K) {
  if (M == 1) {  // decoding one sequence: a matrix-vector product, bound by reading W
    int64_t n = 0;
    for (; n + 8 <= N; n += 8) tile<1, 8>(y + n, ldy, x, ldx, W + n * ldw, ldw, K);
    for (; n < N; n += 4) tile_rn<1>(int(std::min<int64_t>(4, N - n)), y + n, ldy, x, ldx, W + n * ldw, ldw, K);
    return;
  }
  // Blocks of input rows that stay in L2 while the weight rows of this call stream past.
  constexpr int64_t kRowBlock = 64;
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t m1 = std::min(M, m0 + kRowBlock);
    for (int64_t n = 0; n < N; n += 4) {
      const int rn = int(std::min<int64_t>(4, N - n));
      const float* Wn = W + n * ldw;
      for (int64_t m = m0; m < m1; m += 4) {
        float* yt = y + m * ldy + n;
        const float* xt = x + m * ldx;
        switch (std::min<int64_t>(4, m1 - m)) {
          case 1: tile_rn<1>(rn, yt, ldy, xt, ldx, Wn, ldw, K); break;
          case 2: tile_rn<2>(rn, yt, ldy, xt, ldx, Wn, ldw, K); break;
          case 3: tile_rn<3>(rn, yt, ldy, xt, ldx, Wn, ldw, K); break;
          default: tile_rn<4>(rn, yt, ldy, xt, ldx, Wn, ldw, K); break;
        }
      }
    }
  }
}

using LinearFn = void (*)(float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t,
                          int64_t, int64_t);
RLH_GEN_TARGET_AVX512 void linear_avx512(float* y, int64_t ldy, const float* x, int64_t ldx,
                                         const float* W, int64_t ldw, int64_t M, int64_t N, int64_t K) {
  linear_body<float>(y, ldy, x, ldx, W, ldw, M, N, K);
}
RLH_GEN_TARGET_AVX2 void linear_avx2(float* y, int64_t ldy, const float* x, int64_t ldx,
                                     const float* W, int64_t ldw, int64_t M, int64_t N, int64_t K) {
  linear_body<float>(y, ldy, x, ldx, W, ldw, M, N, K);
}
void linear_generic(float* y, int64_t ldy, const float* x, int64_t ldx, const float* W,
                    int64_t ldw, int64_t M, int64_t N, int64_t K) {
  linear_body<float>(y, ldy, x, ldx, W, ldw, M, N, K);
}

}  // namespace

void linear(float* y, int64_t ldy, const float* x, int64_t ldx, const float* W, int64_t ldw,
            int64_t M, int64_t N, int64_t K) {
  if (M < 0 || N < 0 || K < 0) throw std::invalid_argument("linear: negative dimension");
  if (ldx < K || ldw < K || ldy < N) throw std::invalid_argument("linear: leading dimension smaller than a row");
  if (M == 0 || N == 0) return;
  static const LinearFn fn = simd::dispatch(&linear_avx512, &linear_avx2, &linear_generic);
  const int nt = omp_in_parallel() ? 1 : omp_get_max_threads();
  const double work = double(M) * double(N) * double(K);
  // Column blocks (multiples of 8 weight rows) taken dynamically, several per thread, so a
  // thread that loses its core to another process does not hold the step back.
  int64_t nc = std::max<int64_t>(16, (N + 8 * nt - 1) / (8 * nt));
  nc = (nc + 7) / 8 * 8;
  const int64_t chunks = (N + nc - 1) / nc;
  if (nt <= 1 || chunks <= 1 || work < double(1 << 18)) {
    fn(y, ldy, x, ldx, W, ldw, M, N, K);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(int(std::min<int64_t>(nt, chunks)))
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n0 = c * nc, n1 = std::min(N, n0 + nc);
    fn(y + n0, ldy, x, ldx, W + n0 * ldw, ldw, M, n1 - n0, K);
  }
}

}  // namespace rlh::gen
