// Device helpers shared by the kernels of kernels_cuda.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "rlhost/kernels_cuda/kernels.hpp"

namespace rlh::kcuda {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
template <class T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float ld_flex(const Flex& f, int64_t i) {
  return f.bf16 ? __bfloat162float(static_cast<const bf16*>(f.p)[i])
                : static_cast<const float*>(f.p)[i];
}
__device__ __forceinline__ void st_flex(const Flex& f, int64_t i, float v) {
  if (f.bf16)
    static_cast<bf16*>(f.p)[i] = __float2bfloat16_rn(v);
  else
    static_cast<float*>(f.p)[i] = v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
template <class T>
__device__ __forceinline__ T block_sum(T v, T* shared32) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) shared32[warp] = v;
  __syncthreads();
  T r = T(0);
  for (int i = 0; i < nw; ++i) r += shared32[i];  // fixed order: deterministic
  return r;
}

// Gemma-2's soft-capping, c tanh(x / c) (c = 0: x itself, so an uncapped call is bitwise
// unchanged), and its derivative 1 / cosh^2(x / c) from the uncapped x: 1 - tanh^2 cancels in
// fp32 where tanh is near 1 (kernels_cpu does the same). cosh overflows to inf: derivative 0.
__device__ __forceinline__ float soft_cap(float x, float c) { return c > 0.f ? c * tanhf(x / c) : x; }
__device__ __forceinline__ float soft_cap_grad(float x, float c) {
  if (!(c > 0.f)) return 1.f;
  const float ch = coshf(x / c);
  return 1.f / (ch * ch);
}

// The same with the cap compiled in only where a launch asks for it (CAP), so the uncapped
// kernels keep their registers and speed.
template <bool CAP>
__device__ __forceinline__ float soft_cap_if(float x, float c) {
  if constexpr (CAP) return soft_cap(x, c);
  else return x;
}
template <bool CAP>
__device__ __forceinline__ float soft_cap_grad_if(float x, float c) {
  if constexpr (CAP) return soft_cap_grad(x, c);
  else return 1.f;
}

inline unsigned ceil_div(int64_t a, int64_t b) { return unsigned((a + b - 1) / b); }

}  // namespace rlh::kcuda
