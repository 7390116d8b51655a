// Device helpers shared by the kernels of kernels_cuda.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>
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

// acc += the dot product of two 16-byte chunks of 8 bf16, in order, as fused multiply-adds (the
// few-row gemm's and the fused decoding layer's sums).
__device__ __forceinline__ void fma8(float& acc, const uint4& a, const uint4& b) {
  const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* y = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 u = __bfloat1622float2(x[i]), v = __bfloat1622float2(y[i]);
    acc = fmaf(u.x, v.x, acc);
    acc = fmaf(u.y, v.y, acc);
  }
}

inline unsigned ceil_div(int64_t a, int64_t b) { return unsigned((a + b - 1) / b); }

// Programmatic dependent launch (Hopper). A decoding step at batch 1 is ~190 kernels of a few
// microseconds each, and each one's launch and first loads otherwise wait for the kernel before it
// to drain: a kernel launched by launch_pdl may be scheduled while its predecessor on the stream
// still runs. Its contract: pdl_wait() before reading anything earlier work wrote or writing
// anything earlier work reads (it returns once the predecessor has completed and its writes are
// visible; at once for a kernel launched without the attribute). pdl_trigger() lets the next
// kernel be scheduled; called after pdl_wait, at most two grids are in flight. Before pdl_wait
// a kernel may only compute indices and prefetch into L2 (prefetch_l2: a hint, never data a
// result depends on, so a weight written just before is still read after the wait). Two
// exceptions read weights before the wait for real: the few-row gemm's first round
// (RLH_KCUDA_GEMV_PRELOAD) and decode_layer.cu's producer warp; they rely on no kernel that
// writes weights being launched with the attribute directly before them (a refit's copies are
// ordinary launches or copies, which a PDL launch after them waits for in full).
//
// Triggering before the wait instead (so a chain of launches goes resident together, and the
// few-row gemm's first weights stream while RoPE and attention still run) was built as a
// build-time switch and measured on an H100 (2026-12-07): batch 1 808-813 tok/s against 817-820
// with the trigger after the wait, batch 256 the same; removed
// (bench/results/h100-2026-12-07-s28-pdlab-parity.log).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// An A/B switch read from the environment: on unless the variable is "0" (RLH_KCUDA_PDL,
// RLH_KCUDA_PAGED_MMA, RLH_KCUDA_GEMV_PRELOAD; docs/kernels_cuda.md). Callers keep the answer.
bool env_switch_on(const char* name);

// Whether launch_pdl sets the attribute: a device of compute capability 9 or more, and
// RLH_KCUDA_PDL not 0 (the A/B switch; docs/kernels_cuda.md).
bool pdl_enabled();

// kernel<<<grid, block, smem, s>>>(args...) with programmatic stream serialisation allowed when
// pdl_enabled(). Only kernels that keep pdl_wait's contract are launched through it.
template <class... KArgs, class... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  // an error stays the launch's last error: the caller's check_launch names it
  (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace rlh::kcuda
