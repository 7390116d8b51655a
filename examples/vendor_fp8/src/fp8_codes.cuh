// FP8 codes and scales (and the 16-byte bf16 load), as every quantising kernel of this plugin computes them (fp8_kernels.cu's
// passes and fp8_producers.cu's fused norms and GLU), so that their codes agree for the same
// values and scale.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "fp8_kernels.hpp"

namespace vfp8 {

__device__ __forceinline__ unsigned char to_fp8(float v, Fmt f) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, f == Fmt::e4m3 ? __NV_E4M3 : __NV_E5M2);
}

// x / s from the reciprocal: the product, then one FMA correction (Markstein), which gives the
// quotient the division rounds to save in rare ties, at three instructions instead of an IEEE
// division's dozen (the division made the quantisation passes instruction-bound: 2026-12-06).
// Infinite or NaN products pass through (the correction would turn infinity into NaN).
struct Divisor {
  float s, inv;
  __device__ explicit Divisor(float scale) : s(scale), inv(1.0f / scale) {}
  __device__ __forceinline__ float operator()(float x) const {
    const float q = x * inv;
    return isfinite(q) ? fmaf(fmaf(-q, s, x), inv, q) : q;
  }
};

// Eight values / s as codes, converted in pairs.
__device__ __forceinline__ uint2 codes8(const float v[8], const Divisor& d, Fmt f) {
  const __nv_fp8_interpretation_t k = f == Fmt::e4m3 ? __NV_E4M3 : __NV_E5M2;
  unsigned w[2];
  for (int h = 0; h < 2; ++h) {
    const unsigned lo = __nv_cvt_float2_to_fp8x2(make_float2(d(v[4 * h]), d(v[4 * h + 1])), __NV_SATFINITE, k);
    const unsigned hi = __nv_cvt_float2_to_fp8x2(make_float2(d(v[4 * h + 2]), d(v[4 * h + 3])), __NV_SATFINITE, k);
    w[h] = (lo & 0xffffu) | (hi << 16);
  }
  return make_uint2(w[0], w[1]);
}

// |v| as ordered bits: non-negative floats order as unsigned integers, and a NaN (positive once
// its sign is cleared) sorts above infinity, so a max over bits propagates NaN.
__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(fabsf(v)); }

// Eight bf16 (one 16-byte word at p) widened to float.
__device__ __forceinline__ void load8_bf16(const void* p, float v[8]) {
  const uint4 u = *static_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    v[2 * k] = f.x;
    v[2 * k + 1] = f.y;
  }
}

__device__ __forceinline__ float scale_of(float a, float fmax, float mult) {
  return (a > 0.0f && isfinite(a)) ? a / fmax * mult : 1.0f;
}

}  // namespace vfp8
