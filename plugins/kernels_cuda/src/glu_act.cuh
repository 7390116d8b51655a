// The gated linear units' activations and derivatives, shared by glu.cu's kernels and the
// few-row gemm's GLU epilogue (gemv.cu), so both compute the same bits.
#pragma once

#include "common.cuh"

namespace rlh::kcuda {

__device__ __forceinline__ float sigmoid(float g) { return 1.f / (1.f + expf(-g)); }

// The activation and its derivative. ACT 0: silu; 1: gelu, tanh form; 2: gelu, exact (erf).
template <int ACT>
__device__ __forceinline__ void act_and_grad(float g, float* v, float* d) {
  if constexpr (ACT == 0) {
    const float sg = sigmoid(g);
    *v = g * sg;
    *d = sg * (1.f + g * (1.f - sg));
  } else if constexpr (ACT == 1) {
    const float k = 0.7978845608028654f, c = 0.044715f;
    const float t = tanhf(k * (g + c * g * g * g));
    *v = 0.5f * g * (1.f + t);
    *d = 0.5f * (1.f + t) + 0.5f * g * (1.f - t * t) * k * (1.f + 3.f * c * g * g);
  } else {
    const float e = erff(g * 0.7071067811865476f);
    *v = 0.5f * g * (1.f + e);
    *d = 0.5f * (1.f + e) + g * expf(-0.5f * g * g) * 0.3989422804014327f;
  }
}
template <int ACT>
__device__ __forceinline__ float act_value(float g) {
  if constexpr (ACT == 0) return g * sigmoid(g);
  float v, d;
  act_and_grad<ACT>(g, &v, &d);
  return v;
}

}  // namespace rlh::kcuda
