// Internal: ISA dispatch for the generator's hot loops, and a vectorisable float exp.
//
// The plugin is built for baseline x86-64 like kernels_cpu; hot loops are always_inline template
// bodies instantiated once per ISA (target attributes) and picked at run time from
// kernels_cpu's cpuid reading, so one binary uses AVX-512 where it exists.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#include "rlhost/kernels_cpu/cpu_features.hpp"

#define RLH_GEN_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,bmi2")))
#define RLH_GEN_TARGET_AVX2 __attribute__((target("avx2,fma,bmi2")))
#define RLH_GEN_INLINE inline __attribute__((always_inline))

namespace rlh::gen::simd {

template <class F>
F dispatch(F f512, F f256, F fgen) {
  switch (kcpu::cpu_features().level) {
    case kcpu::SimdLevel::avx512: return f512;
    case kcpu::SimdLevel::avx2: return f256;
    default: return fgen;
  }
}

// exp(x) in float without branches, so loops around it vectorise: Cephes' expf (range
// reduction by ln 2 in two parts, degree-6 polynomial, exponent by bit arithmetic); about 2 ulp
// over the normal range, 0 below -87.3, +inf above 88.7, -inf -> 0.
RLH_GEN_INLINE float exp_fast(float x) {
  const float hi = 88.7228f, lo = -87.3365f;
  float xc = x > hi ? hi : x;
  xc = xc < lo ? lo : xc;
  const float magic = 12582912.0f;  // 1.5 * 2^23: round to nearest without SSE4.1
  const float n = (xc * 1.44269504088896341f + magic) - magic;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  const int32_t ni = static_cast<int32_t>(n);
  const int32_t n1 = ni > 127 ? 127 : ni;
  const float res = p * std::bit_cast<float>((n1 + 127) << 23) * (ni > 127 ? 2.0f : 1.0f);
  return x < lo ? 0.0f : (x > hi ? INFINITY : res);
}

}  // namespace rlh::gen::simd
