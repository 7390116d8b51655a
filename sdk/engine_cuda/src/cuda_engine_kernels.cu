// The CUDA engine's own kernels: what is not an op of the contract (docs/ops.md).
#include <cuda_bf16.h>

#include "device_memory.hpp"

namespace rlh::engine::cuda {
namespace {

// Refreshes the bf16 working copy from the fp32 master weights after AdamW: 4 elements per
// thread with 16-byte loads (the flat buffers are 256-byte aligned; the tail goes one by one).
__global__ void cast_kernel(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst,
                            int64_t n) {
  const int64_t n4 = n / 4;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += stride) {
    const float4 v = reinterpret_cast<const float4*>(src)[i];
    __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y);
    __nv_bfloat162 hi = __floats2bfloat162_rn(v.z, v.w);
    reinterpret_cast<__nv_bfloat162*>(dst)[2 * i] = lo;
    reinterpret_cast<__nv_bfloat162*>(dst)[2 * i + 1] = hi;
  }
  for (int64_t i = n4 * 4 + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride)
    dst[i] = __float2bfloat16_rn(src[i]);
}

}  // namespace

void cast_to_bf16(const float* src, void* dst, int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  const int64_t blocks = std::min<int64_t>((n / 4 + 255) / 256 + 1, 132 * 16);
  cast_kernel<<<unsigned(blocks), 256, 0, s>>>(src, static_cast<__nv_bfloat16*>(dst), n);
  check(cudaGetLastError(), "cast_to_bf16");
}

}  // namespace rlh::engine::cuda
