// RoPE's angle and rotation, shared by rope.cu's kernels and decode.cu's rotating cache write so
// that their bits agree: the angle as Hugging Face forms it (float32 product of float32 inv_freq
// and float32 position), the precise (non-intrinsic) float32 sin and cos.
#pragma once

#include "common.cuh"

namespace rlh::kcuda {

// cos and sin of pair i's angle at `pos`, times scale (and sign: -1 for the inverse rotation).
__device__ __forceinline__ void rope_cos_sin(const float* inv_freq, int64_t i, int32_t pos, float scale, float sign,
                                             float& c, float& s) {
  const float angle = __fmul_rn(inv_freq[i], float(pos));
  float sv, cv;
  sincosf(angle, &sv, &cv);
  c = cv * scale;
  s = sv * scale * sign;
}

// The pair (xa, xb) rotated by (c, s).
__device__ __forceinline__ void rope_rotate(float xa, float xb, float c, float s, float& ya, float& yb) {
  ya = xa * c - xb * s;
  yb = xb * c + xa * s;
}

}  // namespace rlh::kcuda
