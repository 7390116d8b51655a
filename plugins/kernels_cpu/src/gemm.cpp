// gemm: C = alpha * op(A) @ op(B) + beta * C (conventions in kernels.hpp).
//
// float: the problem is split over the OpenMP threads along its larger output dimension and each
// part runs single-threaded on OpenBLAS (blas.cpp) or, when OpenBLAS is absent or failed its
// verification, on the builtin packed SIMD kernel below. double: a plain loop nest (tests only).
// gemm_naive is the oracle both are checked against.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "gemm_internal.hpp"  // SgemmFn, sgemm_openblas
#include "rlhost/kernels_cpu/blas.hpp"
#include "rlhost/kernels_cpu/kernels.hpp"
#include "simd.hpp"  // dispatch, RLH_KCPU_TARGET_*

namespace rlh::kcpu {

// ---------------------------------------------------------------------------------------------
// Threads

void set_num_threads(int n) { omp_set_num_threads(n > 0 ? n : omp_get_num_procs()); }
int num_threads() { return omp_get_max_threads(); }

namespace {

void check_gemm_args(bool ta, bool tb, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
                     int64_t ldc) {
  if (M < 0 || N < 0 || K < 0) throw std::invalid_argument("gemm: negative dimension");
  const int64_t a_cols = ta ? M : K, b_cols = tb ? K : N;
  if (lda < std::max<int64_t>(1, a_cols) || ldb < std::max<int64_t>(1, b_cols) ||
      ldc < std::max<int64_t>(1, N))
    throw std::invalid_argument("gemm: leading dimension smaller than the row (M=" +
                                std::to_string(M) + " N=" + std::to_string(N) +
                                " K=" + std::to_string(K) + ")");
}

// C = beta * C, with beta == 0 writing zeros (so NaN garbage in C does not survive).
template <class T>
void scale_c(int64_t M, int64_t N, T beta, T* C, int64_t ldc) {
  if (beta == T(1)) return;
  for (int64_t i = 0; i < M; ++i) {
    T* c = C + i * ldc;
    if (beta == T(0))
      std::fill(c, c + N, T(0));
    else
      for (int64_t j = 0; j < N; ++j) c[j] *= beta;
  }
}

// ---------------------------------------------------------------------------------------------
// Builtin packed kernel (BLIS structure): pack a KC x NC panel of op(B) into NR-wide column
// strips and an MC x KC block of op(A) into MR-tall row strips, then an MR x NR micro-kernel
// keeps its C tile in registers across KC. NR = 2 vectors, MR = 6: 12 accumulators.

constexpr int kMR = 6;
constexpr int64_t kKC = 256, kMC = 72, kNC = 2048;

// Per-thread packing buffer `which` (0: B panel, 1: A block) of n floats, allocated on first use.
float* packing_panel(int which, size_t n) {
  struct Panels {
    std::unique_ptr<float[]> p[2];
  };
  static thread_local Panels panels;
  if (!panels.p[which]) panels.p[which].reset(new float[n]);
  return panels.p[which].get();
}

template <int VW>
RLH_KCPU_INLINE void micro_kernel(int64_t kc, const float* ap, const float* bp, float* C,
                                  int64_t ldc, float alpha, int mr, int nr) {
  typedef float V __attribute__((vector_size(VW * sizeof(float))));
  constexpr int NR = 2 * VW;
  V c[kMR][2];
  for (int i = 0; i < kMR; ++i) c[i][0] = c[i][1] = V{};
  for (int64_t p = 0; p < kc; ++p) {
    V b0, b1;
    std::memcpy(&b0, bp + p * NR, sizeof(V));
    std::memcpy(&b1, bp + p * NR + VW, sizeof(V));
    for (int i = 0; i < kMR; ++i) {
      const float a = ap[p * kMR + i];
      c[i][0] += a * b0;
      c[i][1] += a * b1;
    }
  }
  if (mr == kMR && nr == NR) {
    for (int i = 0; i < kMR; ++i) {
      V c0, c1;
      std::memcpy(&c0, C + i * ldc, sizeof(V));
      std::memcpy(&c1, C + i * ldc + VW, sizeof(V));
      c0 += alpha * c[i][0];
      c1 += alpha * c[i][1];
      std::memcpy(C + i * ldc, &c0, sizeof(V));
      std::memcpy(C + i * ldc + VW, &c1, sizeof(V));
    }
  } else {
    float tile[kMR][NR];
    for (int i = 0; i < kMR; ++i) {
      std::memcpy(&tile[i][0], &c[i][0], sizeof(V));
      std::memcpy(&tile[i][VW], &c[i][1], sizeof(V));
    }
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nr; ++j) C[i * ldc + j] += alpha * tile[i][j];
  }
}

// Accumulates alpha*op(A)*op(B) into C (beta already applied).
template <int VW>
RLH_KCPU_INLINE void sgemm_packed(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                                  const float* A, int64_t lda, const float* B, int64_t ldb,
                                  float* C, int64_t ldc) {
  constexpr int NR = 2 * VW;
  // Fixed-size per-thread panels (not problem-sized, so not taken from a Scratch).
  float* Bp = packing_panel(0, kKC * kNC);
  float* Ap = packing_panel(1, kMC * kKC);
  for (int64_t jc = 0; jc < N; jc += kNC) {
    const int64_t nc = std::min(kNC, N - jc);
    for (int64_t pc = 0; pc < K; pc += kKC) {
      const int64_t kc = std::min(kKC, K - pc);
      for (int64_t j0 = 0; j0 < nc; j0 += NR) {
        float* dst = Bp + (j0 / NR) * kc * NR;
        for (int64_t p = 0; p < kc; ++p)
          for (int j = 0; j < NR; ++j) {
            const int64_t col = jc + j0 + j, row = pc + p;
            dst[p * NR + j] = j0 + j < nc ? (tb ? B[col * ldb + row] : B[row * ldb + col]) : 0.f;
          }
      }
      for (int64_t ic = 0; ic < M; ic += kMC) {
        const int64_t mc = std::min(kMC, M - ic);
        for (int64_t i0 = 0; i0 < mc; i0 += kMR) {
          float* dst = Ap + (i0 / kMR) * kc * kMR;
          for (int64_t p = 0; p < kc; ++p)
            for (int i = 0; i < kMR; ++i) {
              const int64_t row = ic + i0 + i, col = pc + p;
              dst[p * kMR + i] = i0 + i < mc ? (ta ? A[col * lda + row] : A[row * lda + col]) : 0.f;
            }
        }
        for (int64_t j0 = 0; j0 < nc; j0 += NR)
          for (int64_t i0 = 0; i0 < mc; i0 += kMR)
            micro_kernel<VW>(kc, Ap + (i0 / kMR) * kc * kMR, Bp + (j0 / NR) * kc * NR,
                             C + (ic + i0) * ldc + jc + j0, ldc, alpha,
                             int(std::min<int64_t>(kMR, mc - i0)),
                             int(std::min<int64_t>(NR, nc - j0)));
      }
    }
  }
}

using PackedFn = void (*)(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
                          const float*, int64_t, float*, int64_t);
RLH_KCPU_TARGET_AVX512 void sgemm_packed_avx512(bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                                                float alpha, const float* A, int64_t lda,
                                                const float* B, int64_t ldb, float* C,
                                                int64_t ldc) {
  sgemm_packed<16>(ta, tb, M, N, K, alpha, A, lda, B, ldb, C, ldc);
}
RLH_KCPU_TARGET_AVX2 void sgemm_packed_avx2(bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                                            float alpha, const float* A, int64_t lda,
                                            const float* B, int64_t ldb, float* C, int64_t ldc) {
  sgemm_packed<8>(ta, tb, M, N, K, alpha, A, lda, B, ldb, C, ldc);
}
void sgemm_packed_generic(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                          const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                          int64_t ldc) {
  sgemm_packed<4>(ta, tb, M, N, K, alpha, A, lda, B, ldb, C, ldc);
}

// ---------------------------------------------------------------------------------------------
// Splitting over threads. The larger output dimension is cut into chunks (at least 32 rows or 64
// columns each, at most kChunks of them) that the threads take dynamically: when another process
// holds a core, the thread that still runs takes more chunks instead of the whole step waiting
// for the slow half (a static 50/50 split measured 88 vs 121 GFLOP/s with one competing
// process). Every element of C comes from exactly one single-threaded call with the full K loop.
// The cut depends on the problem's shape only, never on the thread count, and one thread walks
// the same chunks: OpenBLAS's kernels sum K in an order that can depend on a call's shape (its
// Haswell/Zen kernels do; SkylakeX's happen not to), so a thread-dependent cut changed low bits
// between 1 and 2 threads. With a fixed cut, results do not depend on the thread count on any
// kernel (tests check 1 vs 2 threads bit for bit, also under OPENBLAS_CORETYPE=Haswell).

constexpr int64_t kChunks = 8;

void sgemm_threaded(detail::SgemmFn fn, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                    float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
                    float beta, float* C, int64_t ldc) {
  const double flops = 2.0 * double(M) * double(N) * double(K);
  const bool by_rows = M >= N;
  const int64_t extent = by_rows ? M : N, grain = by_rows ? 8 : 16, min_chunk = by_rows ? 32 : 64;
  int64_t chunk = std::max(min_chunk, (extent + kChunks - 1) / kChunks);
  chunk = (chunk + grain - 1) / grain * grain;
  const int64_t chunks = (extent + chunk - 1) / chunk;
  if (flops < 2e6 || chunks <= 1) {
    fn(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  const int nt = omp_in_parallel() ? 1 : num_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(int(std::min<int64_t>(nt, chunks))) if (nt > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * chunk, hi = std::min(extent, lo + chunk);
    if (by_rows)
      fn(ta, tb, hi - lo, N, K, alpha, ta ? A + lo : A + lo * lda, lda, B, ldb, beta,
         C + lo * ldc, ldc);
    else
      fn(ta, tb, M, hi - lo, K, alpha, A, lda, tb ? B + lo * ldb : B + lo, ldb, beta, C + lo, ldc);
  }
}

}  // namespace

namespace detail {
void sgemm_builtin(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                   int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  static const PackedFn fn =
      dispatch<PackedFn>(sgemm_packed_avx512, sgemm_packed_avx2, sgemm_packed_generic);
  scale_c(M, N, beta, C, ldc);
  if (K > 0 && alpha != 0.f) fn(ta, tb, M, N, K, alpha, A, lda, B, ldb, C, ldc);
}
}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Entry points

template <>
void gemm<float>(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                 int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  check_gemm_args(ta, tb, M, N, K, lda, ldb, ldc);
  if (M == 0 || N == 0) return;
  if (K == 0 || alpha == 0.f) {
    scale_c(M, N, beta, C, ldc);
    return;
  }
  detail::SgemmFn fn = gemm_backend() == GemmBackend::openblas ? detail::sgemm_openblas()
                                                                 : detail::sgemm_builtin;
  if (!fn) fn = detail::sgemm_builtin;
  sgemm_threaded(fn, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

template <>
void gemm<double>(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                  const double* A, int64_t lda, const double* B, int64_t ldb, double beta,
                  double* C, int64_t ldc) {
  check_gemm_args(ta, tb, M, N, K, lda, ldb, ldc);
  if (M == 0 || N == 0) return;
  scale_c(M, N, beta, C, ldc);
  if (K == 0 || alpha == 0.0) return;
  // Row i of C accumulates a(i,p) * row p of op(B): contiguous in j when B is not transposed.
#pragma omp parallel for schedule(static) if (!omp_in_parallel() && M * N * K > 100000)
  for (int64_t i = 0; i < M; ++i) {
    double* c = C + i * ldc;
    for (int64_t p = 0; p < K; ++p) {
      const double a = alpha * (ta ? A[p * lda + i] : A[i * lda + p]);
      if (tb)
        for (int64_t j = 0; j < N; ++j) c[j] += a * B[j * ldb + p];
      else
        for (int64_t j = 0; j < N; ++j) c[j] += a * B[p * ldb + j];
    }
  }
}

template <class T>
void gemm_batched(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                  int64_t lda, int64_t stride_a, const T* B, int64_t ldb, int64_t stride_b, T beta,
                  T* C, int64_t ldc, int64_t stride_c, int64_t batch) {
  if (batch < 0) throw std::invalid_argument("gemm_batched: negative batch");
  // Many small problems: one per thread. Few large ones: each one threaded inside.
  const bool per_thread = !omp_in_parallel() && batch >= 2 * num_threads();
#pragma omp parallel for schedule(static) if (per_thread)
  for (int64_t b = 0; b < batch; ++b)
    gemm<T>(ta, tb, M, N, K, alpha, A + b * stride_a, lda, B + b * stride_b, ldb, beta,
            C + b * stride_c, ldc);
}

template <class T>
void gemm_naive(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  check_gemm_args(ta, tb, M, N, K, lda, ldb, ldc);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < K; ++p)
        acc += double(ta ? A[p * lda + i] : A[i * lda + p]) *
               double(tb ? B[j * ldb + p] : B[p * ldb + j]);
      const double prev = beta == T(0) ? 0.0 : double(beta) * double(C[i * ldc + j]);
      C[i * ldc + j] = T(double(alpha) * acc + prev);
    }
}

template void gemm_batched<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*,
                                  int64_t, int64_t, const float*, int64_t, int64_t, float, float*,
                                  int64_t, int64_t, int64_t);
template void gemm_batched<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*,
                                   int64_t, int64_t, const double*, int64_t, int64_t, double,
                                   double*, int64_t, int64_t, int64_t);
template void gemm_naive<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*,
                                int64_t, const float*, int64_t, float, float*, int64_t);
template void gemm_naive<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*,
                                 int64_t, const double*, int64_t, double, double*, int64_t);

}  // namespace rlh::kcpu
