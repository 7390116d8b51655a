// Internal: run-time SIMD dispatch and a vectorizable exp.
//
// The library is compiled for baseline x86-64. Hot loops are written once as an always_inline
// template body and instantiated in three wrappers: one compiled for AVX-512, one for AVX2+FMA,
// one generic. dispatch() picks the wrapper from cpuid (cpu_features().level), so the binary runs
// on any x86-64 and uses the widest unit it has.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "rlhost/kernels_cpu/cpu_features.hpp"

#define RLH_KCPU_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,bmi2")))
#define RLH_KCPU_TARGET_AVX2 __attribute__((target("avx2,fma,bmi2")))
#define RLH_KCPU_INLINE inline __attribute__((always_inline))

namespace rlh::kcpu {

// Vector width in floats of each level (what the gemm micro-kernel tiles by).
template <SimdLevel L>
inline constexpr int kVecFloats = L == SimdLevel::avx512 ? 16 : L == SimdLevel::avx2 ? 8 : 4;

// Pick the variant for this CPU: f512, f256 or fgen, all with the same signature.
template <class F>
RLH_KCPU_INLINE F dispatch(F f512, F f256, F fgen) {
  switch (cpu_features().level) {
    case SimdLevel::avx512: return f512;
    case SimdLevel::avx2: return f256;
    default: return fgen;
  }
}

// Defines NAME_avx512, NAME_avx2, NAME_generic (float instantiations of the always_inline
// template BODY, each compiled for its ISA) and NAME_select(), which returns the one for this CPU.
// PARAMS is the parenthesised parameter list, ARGS the parenthesised argument list.
#define RLH_KCPU_MULTIVERSION(NAME, BODY, PARAMS, ARGS)                           \
  RLH_KCPU_TARGET_AVX512 void NAME##_avx512 PARAMS { BODY<float> ARGS; }          \
  RLH_KCPU_TARGET_AVX2 void NAME##_avx2 PARAMS { BODY<float> ARGS; }              \
  void NAME##_generic PARAMS { BODY<float> ARGS; }                                \
  inline auto NAME##_select() {                                                   \
    static const auto fn = ::rlh::kcpu::dispatch(&NAME##_avx512, &NAME##_avx2, &NAME##_generic); \
    return fn;                                                                    \
  }

// exp(x) for float, branch-free so loops around it vectorize (Cephes expf: range reduction by
// ln2 in two parts, degree-6 polynomial, exponent by bit arithmetic). Max relative error ~2 ulp
// over the normal range; x < -87.3 gives 0 (no denormals), x > 88.7 gives +inf; NaN stays NaN.
RLH_KCPU_INLINE float exp_f(float x) {
  const float hi = 88.7228f, lo = -87.3365f;
  float xc = x > hi ? hi : x;
  xc = xc < lo ? lo : xc;
  xc = xc != xc ? 0.0f : xc;  // NaN: its int conversion below would be undefined (UBSan)
  // n = round(x / ln2) by the 1.5*2^23 trick (vectorizes without SSE4.1 rounding).
  const float magic = 12582912.0f;
  float n = (xc * 1.44269504088896341f + magic) - magic;
  float r = xc - n * 0.693359375f;     // ln2 high part (exact in float)
  r = r - n * -2.12194440e-4f;         // ln2 low part
  float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  // 2^n; n in [-126, 128]; 2^128 (x near 88.72) is built as 2^127 * 2.
  int32_t ni = static_cast<int32_t>(n);
  int32_t n1 = ni > 127 ? 127 : ni;
  float scale = std::bit_cast<float>((n1 + 127) << 23);
  float res = p * scale * (ni > 127 ? 2.0f : 1.0f);
  res = x < lo ? 0.0f : res;
  res = x > hi ? INFINITY : res;
  return x != x ? x : res;
}

// exp for both element types of the kernels: the float path uses exp_f, double uses libm (the
// double instantiations are the finite-difference oracle, where accuracy beats speed).
template <class T>
RLH_KCPU_INLINE T exp_t(T x) {
  if constexpr (std::is_same_v<T, float>)
    return exp_f(x);
  else
    return std::exp(x);
}

}  // namespace rlh::kcpu
