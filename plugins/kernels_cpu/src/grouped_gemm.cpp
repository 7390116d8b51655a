// Grouped GEMM over experts: one GEMM per group of consecutive rows (the expert-sorted rows of
// moe_permute), with the group's own weight matrix. Two forms, as the grouped_gemm library that
// Megatron-Core uses (gmm with trans_a / trans_b):
//
//   trans_a = false (forward, and the activation gradient), rows r of group g:
//     C[r, :] = alpha A[r, :] op(B_g) + beta C[r, :]     A [T, K], B_g [K, N] or [N, K], C [T, N]
//   trans_a = true (the weight gradient), group g:
//     C_g = alpha A_g^T B_g + beta C_g                   A [T, M], B [T, N], C_g [M, N]
//     A_g, B_g are the group's rows; an empty group gives C_g = beta C_g.
//
// Work is cut into tasks of at most kTaskRows rows of the grouped operand (trans_a = false) or
// of C_g (trans_a = true), taken dynamically by the threads: a group holding most tokens still
// spreads over them, and many small groups do not each pay for a threaded GEMM. Tasks are large
// because each call packs its whole weight matrix (64-row tasks spent about a third of their time
// packing at d 256). The cut never depends on the thread count: OpenBLAS's small-matrix kernels
// sum in an order that depends on a call's shape, so a thread-dependent cut changed low bits
// (seen with 1 vs 2 threads). Every element of C comes from one gemm call of a fixed shape:
// results are the same for any number of threads.
#include <omp.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "rlhost/kernels_cpu/kernels.hpp"

namespace rlh::kcpu {
namespace {

constexpr int64_t kTaskRows = 256;

struct Task {
  int64_t g, r0, r1;
};

// Tasks of at most `rows` rows: of each group's rows (trans_a = false) or of each C_g's M rows.
std::vector<Task> cut(bool ta, int64_t G, const int32_t* offsets, int64_t M, int64_t rows) {
  std::vector<Task> tasks;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t b = ta ? 0 : offsets[g], e = ta ? M : offsets[g + 1];
    for (int64_t r = b; r < e; r += rows) tasks.push_back({g, r, std::min(e, r + rows)});
  }
  return tasks;
}

}  // namespace

template <class T>
void grouped_gemm(bool ta, bool tb, int64_t G, const int32_t* offsets, int64_t M, int64_t N,
                  int64_t K, T alpha, const T* A, int64_t lda, const T* B, int64_t ldb,
                  int64_t stride_b, T beta, T* C, int64_t ldc, int64_t stride_c) {
  if (G < 0) throw std::invalid_argument("grouped_gemm: negative group count");
  if (G == 0) return;
  if (offsets[0] != 0) throw std::invalid_argument("grouped_gemm: offsets must start at 0");
  for (int64_t g = 0; g < G; ++g)
    if (offsets[g + 1] < offsets[g]) throw std::invalid_argument("grouped_gemm: offsets must not decrease");
  if (ta && tb) throw std::invalid_argument("grouped_gemm: transpose_b with transpose_a is not offered");
  // gemm's own checks would throw inside the parallel loop; check its arguments here.
  if (M < 0 || N < 0 || K < 0) throw std::invalid_argument("grouped_gemm: negative dimension");
  const int64_t a_cols = ta ? M : K, b_cols = tb ? K : N;
  if (lda < std::max<int64_t>(1, a_cols) || ldb < std::max<int64_t>(1, b_cols) ||
      ldc < std::max<int64_t>(1, N))
    throw std::invalid_argument("grouped_gemm: leading dimension smaller than the row");
  const std::vector<Task> tasks = cut(ta, G, offsets, M, kTaskRows);
  const int64_t nt = int64_t(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) if (!omp_in_parallel() && nt > 1)
  for (int64_t i = 0; i < nt; ++i) {
    const Task& t = tasks[size_t(i)];
    const int64_t rows = t.r1 - t.r0;
    if (!ta) {
      // rows [r0, r1) of A and C against B_g
      gemm<T>(false, tb, rows, N, K, alpha, A + t.r0 * lda, lda, B + t.g * stride_b, ldb, beta,
              C + t.r0 * ldc, ldc);
    } else {
      // rows [r0, r1) of C_g = columns [r0, r1) of A_g, inner dimension = the group's rows
      const int64_t a0 = offsets[t.g], kg = offsets[t.g + 1] - a0;
      gemm<T>(true, false, rows, N, kg, alpha, A + a0 * lda + t.r0, lda, B + a0 * ldb, ldb, beta,
              C + t.g * stride_c + t.r0 * ldc, ldc);
    }
  }
}

template void grouped_gemm<float>(bool, bool, int64_t, const int32_t*, int64_t, int64_t, int64_t,
                                  float, const float*, int64_t, const float*, int64_t, int64_t,
                                  float, float*, int64_t, int64_t);
template void grouped_gemm<double>(bool, bool, int64_t, const int32_t*, int64_t, int64_t, int64_t,
                                   double, const double*, int64_t, const double*, int64_t,
                                   int64_t, double, double*, int64_t, int64_t);

}  // namespace rlh::kcpu
