// OCP FP8 e4m3fn on the host, for the FP8 KV cache (kv_cache_write and paged_attention with
// e4m3 caches; docs/ops.md): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no
// infinities, largest finite 448 (code 0x7E), NaN S.1111.111.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

namespace rlh::kcpu {

// x rounded to the nearest e4m3 value, ties to even; finite values past the largest saturate to
// +-448, as vLLM's FP8 cache write clamps before converting (a key or value scaled past the
// range keeps its sign and the largest magnitude instead of becoming NaN). NaN stays NaN.
inline uint8_t e4m3_encode(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  if (a >= 448.f) return sign | 0x7E;
  if (a < 0.015625f) {  // below 2^-6: subnormals, steps of 2^-9 (8 rounds up to the least normal, 0x08)
    return sign | uint8_t(std::nearbyint(a * 512.f));
  }
  int e = 0;
  const float f = std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1): exponent field e - 1 + 7
  int m = int(std::nearbyint((2.f * f - 1.f) * 8.f));  // exact before rounding: 3 bits kept
  int E = e + 6;
  if (m == 8) {
    m = 0;
    ++E;
  }
  return sign | uint8_t(E << 3) | uint8_t(m);
}

// The value of every code (NaN for 0x7F and 0xFF).
inline const std::array<float, 256>& e4m3_values() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> v{};
    for (int c = 0; c < 256; ++c) {
      const int E = (c >> 3) & 15, m = c & 7;
      float a = E == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.f + float(m) / 8.f, E - 7);
      if (E == 15 && m == 7) a = NAN;
      v[size_t(c)] = c & 0x80 ? -a : a;
    }
    return v;
  }();
  return t;
}

}  // namespace rlh::kcpu
