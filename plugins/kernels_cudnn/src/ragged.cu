// Kernels of ragged.hpp.
#include "ragged.hpp"

#include <algorithm>

namespace rlh::kcudnn {
namespace {

__global__ void ragged_setup_kernel(const int32_t* __restrict__ cu, int64_t S, int64_t B, int64_t N, int64_t T,
                                    Multipliers mult, int64_t* __restrict__ offsets,
                                    int32_t* __restrict__ seqlens) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i > B) return;
  const int64_t at = min(max(int64_t(cu[min(i, S)]), int64_t(0)), N);
  for (int j = 0; j < mult.n; ++j) offsets[j * (B + 1) + i] = mult.m[j] * at;
  if (i < B) {
    int64_t len = 0;
    if (i < S) len = int64_t(cu[i + 1]) - int64_t(cu[i]);
    seqlens[i] = int32_t(min(max(len, int64_t(0)), T));
  }
}

// A 32 x 32 tile transpose: in is [rows, cols], out is [cols, rows].
__global__ void transpose_kernel(const float* __restrict__ in, float* __restrict__ out, int64_t rows, int64_t cols) {
  __shared__ float tile[32][33];
  const int64_t r0 = int64_t(blockIdx.y) * 32, c0 = int64_t(blockIdx.x) * 32;
  for (int k = threadIdx.y; k < 32; k += blockDim.y) {
    const int64_t r = r0 + k, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[k][threadIdx.x] = in[r * cols + c];
  }
  __syncthreads();
  for (int k = threadIdx.y; k < 32; k += blockDim.y) {
    const int64_t c = c0 + k, r = r0 + threadIdx.x;
    if (r < rows && c < cols) out[c * rows + r] = tile[threadIdx.x][k];
  }
}

void transpose(const float* in, float* out, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const dim3 grid(unsigned((cols + 31) / 32), unsigned((rows + 31) / 32));
  transpose_kernel<<<grid, dim3(32, 8), 0, stream>>>(in, out, rows, cols);
}

}  // namespace

void ragged_setup(const int32_t* cu, int64_t S, int64_t B, int64_t N, int64_t T, const Multipliers& mult,
                  int64_t* offsets, int32_t* seqlens, cudaStream_t stream) {
  const int threads = 128;
  const int64_t blocks = (B + 1 + threads - 1) / threads;
  ragged_setup_kernel<<<unsigned(blocks), threads, 0, stream>>>(cu, S, B, N, T, mult, offsets, seqlens);
}

void stats_to_lse(const float* packed, float* lse, int64_t N, int64_t H, cudaStream_t stream) {
  transpose(packed, lse, N, H, stream);
}

void lse_to_stats(const float* lse, float* packed, int64_t N, int64_t H, cudaStream_t stream) {
  transpose(lse, packed, H, N, stream);
}

}  // namespace rlh::kcudnn
