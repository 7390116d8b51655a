// The batch-invariant gemm: y = x W^T for the few-row products of decoding (and the prefill
// chunks between them), written so that every output row depends only on its own input row —
// bitwise, for any number of rows, any row grouping and any thread count. kernels_cpu's gemm
// runs it when asked for batch invariance (docs/ops.md, `gemm` with batch_invariant = 1).
//
// Why not the OpenBLAS path: its result for one row changes with the number of rows M (gemv for
// M = 1, small-matrix kernels, different edge tiles): row 0 of an [M, 768] x [768, 1280] product
// differs between M = 1 and M = 2 on this machine. A generator on top of it would sample a
// different token when another prompt joins the batch. Here each output element y[m, n] has its
// own 16-lane accumulator fed k = 0, 16, 32, ... in order and reduced by a fixed tree, whatever
// tile, chunk or thread computes it, so decoding is batch-invariant and a preempted sequence
// recomputes exactly the cache it lost.
//
// Speed: register tiles of 4 rows x 4 weight rows (16 accumulators, 8 loads per 16 FMAs: FMA
// bound, not load bound) with the weight rows of a tile reused across all input rows while in
// L1; one row (decoding at batch 1) uses 1 x 8 tiles and is bound by reading W. Work is split
// over the instance's threads (worker_pool.hpp) by blocks of weight rows.
//
// Written with GCC vector types of 16 floats: one zmm register under AVX-512, a pair of ymm under
// AVX2, four xmm otherwise. The arithmetic order of an element is the same in every tile shape:
// lanes accumulate k = l, l+16, l+32, ... (a zero-padded tail last), then the fixed tree of hsum16.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "rlhost/kernels_cpu/kernels.hpp"
#include "simd.hpp"
#include "worker_pool.hpp"

namespace rlh::kcpu {

namespace {

typedef float v16 __attribute__((vector_size(64)));

RLH_KCPU_INLINE v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
RLH_KCPU_INLINE v16 load_tail(const float* p, int64_t n) {
  v16 v = {};
  std::memcpy(&v, p, size_t(n) * sizeof(float));
  return v;
}

// The fixed reduction tree: lane i + lane i+8, then i + i+4, i + i+2, i + i+1 (never
// reassociated: no -ffast-math here). Written as whole-vector halvings, which compile to two or
// three shuffles and adds instead of fifteen scalar additions.
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
RLH_KCPU_INLINE float hsum16(v16 v) {
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// One register tile: RM input rows x RN weight rows over the whole K. `pf` (may be null): `npf`
// rows of W (ldw apart) to prefetch meanwhile, one line per row and k step — rows of the next
// weight tile, so its weights stream in from L3/DRAM while this one computes (each tile starts
// RN short streams that the hardware prefetcher would pick up only after a few misses). The
// caller spreads a tile's rows over the row tiles that reuse the current weights, so requests
// go out at an even pace instead of overflowing the miss queues in one burst.
template <int RM, int RN>
RLH_KCPU_INLINE void tile(float* y, int64_t ldy, const float* x, int64_t ldx, const float* W,
                         int64_t ldw, int64_t K, const float* pf = nullptr, int npf = RN) {
  v16 acc[RM][RN];
  for (int m = 0; m < RM; ++m)
    for (int n = 0; n < RN; ++n) acc[m][n] = v16{};
  const int64_t K16 = K / 16 * 16;
  for (int64_t k = 0; k < K16; k += 16) {
    if (pf)
      for (int n = 0; n < npf; ++n) __builtin_prefetch(pf + n * ldw + k);
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
RLH_KCPU_INLINE void tile_rn(int rn, float* y, int64_t ldy, const float* x, int64_t ldx,
                            const float* W, int64_t ldw, int64_t K, const float* pf, int npf) {
  switch (rn) {
    case 1: tile<RM, 1>(y, ldy, x, ldx, W, ldw, K, pf, npf); break;
    case 2: tile<RM, 2>(y, ldy, x, ldx, W, ldw, K, pf, npf); break;
    case 3: tile<RM, 3>(y, ldy, x, ldx, W, ldw, K, pf, npf); break;
    default: tile<RM, 4>(y, ldy, x, ldx, W, ldw, K, pf, npf); break;
  }
}

// All of y[:, 0:N] on the calling thread.
template <class T>
RLH_KCPU_INLINE void linear_body(float* y, int64_t ldy, const float* x, int64_t ldx, const float* W,
                                int64_t ldw, int64_t M, int64_t N, int64_t K) {
  if (M == 1) {  // decoding one sequence: a matrix-vector product, bound by reading W
    int64_t n = 0;
    for (; n + 8 <= N; n += 8)
      tile<1, 8>(y + n, ldy, x, ldx, W + n * ldw, ldw, K, n + 16 <= N ? W + (n + 8) * ldw : nullptr);
    for (; n < N; n += 4)
      tile_rn<1>(int(std::min<int64_t>(4, N - n)), y + n, ldy, x, ldx, W + n * ldw, ldw, K, nullptr, 0);
    return;
  }
  // Blocks of input rows that stay in L2 while the weight rows of this call stream past.
  constexpr int64_t kRowBlock = 64;
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t m1 = std::min(M, m0 + kRowBlock);
    for (int64_t n = 0; n < N; n += 4) {
      const int rn = int(std::min<int64_t>(4, N - n));
      const float* Wn = W + n * ldw;
      // The next weight tile's 4 rows are prefetched by the row tiles of this one, evenly:
      // with `tiles` row tiles, tile j takes rows [j*ceil(4/tiles), ...).
      const bool prefetch = n + 8 <= N;
      const int64_t tiles = (m1 - m0 + 3) / 4, per = (4 + tiles - 1) / tiles;
      for (int64_t m = m0, j = 0; m < m1; m += 4, ++j) {
        float* yt = y + m * ldy + n;
        const float* xt = x + m * ldx;
        const int64_t r0 = std::min<int64_t>(4, j * per), r1 = std::min<int64_t>(4, r0 + per);
        const float* p = prefetch && r1 > r0 ? W + (n + 4 + r0) * ldw : nullptr;
        const int np = int(r1 - r0);
        switch (std::min<int64_t>(4, m1 - m)) {
          case 1: tile_rn<1>(rn, yt, ldy, xt, ldx, Wn, ldw, K, p, np); break;
          case 2: tile_rn<2>(rn, yt, ldy, xt, ldx, Wn, ldw, K, p, np); break;
          case 3: tile_rn<3>(rn, yt, ldy, xt, ldx, Wn, ldw, K, p, np); break;
          default: tile_rn<4>(rn, yt, ldy, xt, ldx, Wn, ldw, K, p, np); break;
        }
      }
    }
  }
}

using LinearFn = void (*)(float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t,
                          int64_t, int64_t);
RLH_KCPU_TARGET_AVX512 void linear_avx512(float* y, int64_t ldy, const float* x, int64_t ldx,
                                         const float* W, int64_t ldw, int64_t M, int64_t N, int64_t K) {
  linear_body<float>(y, ldy, x, ldx, W, ldw, M, N, K);
}
RLH_KCPU_TARGET_AVX2 void linear_avx2(float* y, int64_t ldy, const float* x, int64_t ldx,
                                     const float* W, int64_t ldw, int64_t M, int64_t N, int64_t K) {
  linear_body<float>(y, ldy, x, ldx, W, ldw, M, N, K);
}
void linear_generic(float* y, int64_t ldy, const float* x, int64_t ldx, const float* W,
                    int64_t ldw, int64_t M, int64_t N, int64_t K) {
  linear_body<float>(y, ldy, x, ldx, W, ldw, M, N, K);
}

}  // namespace

void gemm_rows(float* y, int64_t ldy, const float* x, int64_t ldx, const float* W, int64_t ldw, int64_t M,
               int64_t N, int64_t K, WorkerPool& pool) {
  if (M < 0 || N < 0 || K < 0) throw std::invalid_argument("gemm (batch-invariant): negative dimension");
  if (ldx < K || ldw < K || ldy < N)
    throw std::invalid_argument("gemm (batch-invariant): leading dimension smaller than a row");
  if (M == 0 || N == 0) return;
  static const LinearFn fn = dispatch(&linear_avx512, &linear_avx2, &linear_generic);
  const int nt = omp_in_parallel() ? 1 : pool.threads();
  const double work = double(M) * double(N) * double(K);
  // Column blocks (multiples of 8 weight rows) taken dynamically from the pool, several per
  // thread, so a thread that loses its core to another process does not hold the step back.
  int64_t nc = std::max<int64_t>(16, (N + 8 * nt - 1) / (8 * nt));
  nc = (nc + 7) / 8 * 8;
  const int64_t chunks = (N + nc - 1) / nc;
  if (nt <= 1 || chunks <= 1 || work < double(1 << 16)) {
    fn(y, ldy, x, ldx, W, ldw, M, N, K);
    return;
  }
  pool.parallel_for(chunks, [&](int64_t c, int) {
    const int64_t n0 = c * nc, n1 = std::min(N, n0 + nc);
    fn(y + n0, ldy, x, ldx, W + n0 * ldw, ldw, M, n1 - n0, K);
  });
}

// float64: each y[m, n] is a sum over k in a fixed order (8 lanes by k mod 8, then a fixed tree)
// of exact products: a function of row m alone, whatever M or the thread count. (Decoding's
// float64 MoE router: widened float inputs and weights, so the products are exact.)
void gemm_rows(double* y, int64_t ldy, const double* x, int64_t ldx, const double* W, int64_t ldw, int64_t M,
               int64_t N, int64_t K, WorkerPool& pool) {
  if (M < 0 || N < 0 || K < 0) throw std::invalid_argument("gemm (batch-invariant): negative dimension");
  if (ldx < K || ldw < K || ldy < N)
    throw std::invalid_argument("gemm (batch-invariant): leading dimension smaller than a row");
  auto row = [&](int64_t m, int) {
    const double* xm = x + m * ldx;
    for (int64_t n = 0; n < N; ++n) {
      const double* wn = W + n * ldw;
      double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        for (int j = 0; j < 8; ++j) acc[j] += xm[k + j] * wn[k + j];
      for (int j = 0; k < K; ++k, ++j) acc[j] += xm[k] * wn[k];
      y[m * ldy + n] = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    }
  };
  if (!omp_in_parallel() && M > 1 && M * N * K > (int64_t(1) << 20)) {
    pool.parallel_for(M, row);
  } else {
    for (int64_t m = 0; m < M; ++m) row(m, 0);
  }
}

}  // namespace rlh::kcpu
