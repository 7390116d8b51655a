// RMSNorm's row arithmetic, shared by every kernel that normalises a row (rmsnorm.cu's kernels
// and gemv.cu's normalising prologue), so that their bits agree: the squares summed as fused
// multiply-adds in chunk and element order, then rstd with one Newton step.
#pragma once

#include "common.cuh"

namespace rlh::kcuda {

// ss += v[k]^2 for the chunk's 8 values in order, as fused multiply-adds.
__device__ __forceinline__ void sumsq8(float& ss, const float* v) {
#pragma unroll
  for (int k = 0; k < 8; ++k) ss = fmaf(v[k], v[k], ss);
}

// rstd of a row's sum of squares (rsqrtf is approximate, 2 ulp; one Newton step makes it match
// 1/sqrtf to rounding).
__device__ __forceinline__ float rstd_of(float ss, int64_t C, float eps) {
  const float r = rsqrtf(ss / float(C) + eps);
  return r * (1.5f - 0.5f * (ss / float(C) + eps) * r * r);
}

}  // namespace rlh::kcuda
