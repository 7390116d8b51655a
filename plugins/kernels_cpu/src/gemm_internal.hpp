// Internal: the single-threaded sgemm entry points gemm.cpp splits work over.
#pragma once

#include <cstdint>

namespace rlh::kcpu::detail {

// C = alpha*op(A)*op(B) + beta*C on the calling thread. Same conventions as gemm().
using SgemmFn = void (*)(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                         const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                         float* C, int64_t ldc);

// OpenBLAS cblas_sgemm wrapped to that signature; nullptr until blas.cpp loaded and verified it.
SgemmFn sgemm_openblas();
// kernels_cpu's packed SIMD kernel (gemm.cpp).
void sgemm_builtin(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                   const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                   int64_t ldc);

}  // namespace rlh::kcpu::detail
