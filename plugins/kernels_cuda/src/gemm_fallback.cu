// The SIMT gemm used where cuBLASLt has no algorithm (any stride, alignment and transpose):
// 32x32 output tiles, 16-deep K slices in shared memory, fp32 accumulation. Slow; only odd
// problems take it (docs/kernels_cuda.md).
#include "common.cuh"

namespace rlh::kcuda {
namespace {

constexpr int TM = 32, TN = 32, TK = 16;

template <class TA, class TC>
__global__ void gemm_fallback_kernel(bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                                     float alpha, float beta, const TA* A, int64_t lda,
                                     int64_t sa, const TA* B, int64_t ldb, int64_t sb, TC* C,
                                     int64_t ldc, int64_t sc, const void* bias, bool bias_bf16) {
  __shared__ float As[TK][TM + 1], Bs[TK][TN + 1];
  const int64_t bz = blockIdx.z;
  A += bz * sa;
  B += bz * sb;
  C += bz * sc;
  const int64_t m0 = int64_t(blockIdx.y) * TM, n0 = int64_t(blockIdx.x) * TN;
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;  // 32 x 8 threads, 4 rows each
  float acc[4] = {0, 0, 0, 0};
  for (int64_t k0 = 0; k0 < K; k0 += TK) {
    for (int i = threadIdx.x; i < TK * TM; i += blockDim.x) {
      const int kk = i / TM, mm = i % TM;
      const int64_t m = m0 + mm, k = k0 + kk;
      As[kk][mm] = (m < M && k < K) ? to_f(ta ? A[k * lda + m] : A[m * lda + k]) : 0.f;
      const int nn = i % TN;
      const int64_t n = n0 + nn;
      Bs[kk][nn] = (n < N && k < K) ? to_f(tb ? B[n * ldb + k] : B[k * ldb + n]) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < TK; ++kk) {
      const float b = Bs[kk][tx];
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[r] += As[kk][ty * 4 + r] * b;
    }
    __syncthreads();
  }
  const int64_t n = n0 + tx;
  if (n >= N) return;
  float bv = 0.f;
  if (bias) bv = bias_bf16 ? __bfloat162float(static_cast<const bf16*>(bias)[n])
                           : static_cast<const float*>(bias)[n];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int64_t m = m0 + ty * 4 + r;
    if (m >= M) continue;
    float v = alpha * acc[r] + bv;
    if (beta != 0.f) v += beta * to_f(C[m * ldc + n]);
    C[m * ldc + n] = from_f<TC>(v);
  }
}

template <class TA, class TC>
void launch(const GemmArgs& g, cudaStream_t s) {
  dim3 grid(ceil_div(g.N, TN), ceil_div(g.M, TM), unsigned(g.batch));
  gemm_fallback_kernel<TA, TC><<<grid, 256, 0, s>>>(
      g.ta, g.tb, g.M, g.N, g.K, float(g.alpha), float(g.beta), static_cast<const TA*>(g.A),
      g.lda, g.stride_a, static_cast<const TA*>(g.B), g.ldb, g.stride_b, static_cast<TC*>(g.C),
      g.ldc, g.stride_c, g.bias, g.bias_dt == DType::bf16);
}

}  // namespace

void gemm_fallback(const GemmArgs& g, cudaStream_t s) {
  if (g.M == 0 || g.N == 0 || g.batch == 0) return;
  if (g.ab == DType::f32)
    launch<float, float>(g, s);
  else if (g.c_dt == DType::f32)
    launch<bf16, float>(g, s);
  else
    launch<bf16, bf16>(g, s);
  check_launch("gemm_fallback");
}

}  // namespace rlh::kcuda
