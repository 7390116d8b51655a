// Host-side number formats of the conformance runner: values are held as double and converted to
// an operand's dtype (f64, f32, bf16, fp8 e4m3 / e5m2, i32) only when staged for a call, and back
// when read. Rounding is round-to-nearest-even everywhere, as the hardware formats do it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "rlhost/sdk/kernels.hpp"

namespace rlh::sdk::kcheck {

inline float f32_of_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t bits_of_f32(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// bfloat16: the upper half of a float32, rounded to nearest even (NaN stays a quiet NaN).
inline uint16_t bf16_bits(float f) {
  const uint32_t u = bits_of_f32(f);
  if (std::isnan(f)) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
inline float bf16_value(uint16_t b) { return f32_of_bits(uint32_t(b) << 16); }
inline double round_bf16(double x) { return bf16_value(bf16_bits(float(x))); }

// An 8-bit float format: OCP FP8 e4m3fn (no infinities, max 448, NaN = S.1111.111) or e5m2
// (IEEE-like, max 57344). The encoder picks the nearest finite code, ties to the even code, and
// saturates at the largest finite value (the runner scales inputs so that nothing overflows).
class Fp8Format {
 public:
  explicit Fp8Format(bool e4m3) : e4m3_(e4m3) {
    const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    for (int code = 0; code < 128; ++code) {
      const int e = code >> mbits, m = code & ((1 << mbits) - 1);
      const bool special = e4m3 ? (e == 15 && m == 7) : (e == 31);
      if (special) break;  // codes above are NaN (e4m3) or inf/NaN (e5m2)
      const double v = e == 0 ? std::ldexp(double(m), 1 - bias - mbits)
                              : std::ldexp(double((1 << mbits) + m), e - bias - mbits);
      values_.push_back(v);
    }
  }
  double max_finite() const { return values_.back(); }
  uint8_t nan_code() const { return e4m3_ ? 0x7F : 0x7E; }
  uint8_t encode(double x) const {
    if (std::isnan(x)) return nan_code();
    const uint8_t sign = std::signbit(x) ? 0x80 : 0;
    const double a = std::fabs(x);
    // values_ is increasing: binary search for the first value >= a.
    size_t lo = 0, hi = values_.size();
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      if (values_[mid] < a) lo = mid + 1;
      else hi = mid;
    }
    size_t code = lo;
    if (lo == values_.size()) code = values_.size() - 1;  // saturate
    else if (lo > 0) {
      const double below = a - values_[lo - 1], above = values_[lo] - a;
      if (below < above || (below == above && ((lo - 1) & 1) == 0)) code = lo - 1;
    }
    return uint8_t(sign | code);
  }
  double decode(uint8_t b) const {
    const size_t code = b & 0x7F;
    if (code >= values_.size()) return NAN;
    return (b & 0x80) ? -values_[code] : values_[code];
  }

 private:
  bool e4m3_;
  std::vector<double> values_;
};

inline const Fp8Format& fp8_format(rlh_dtype d) {
  static const Fp8Format e4m3(true), e5m2(false);
  return d.code == RLH_DTYPE_FLOAT8_E4M3FN ? e4m3 : e5m2;
}
inline bool is_fp8(rlh_dtype d) {
  return d.code == RLH_DTYPE_FLOAT8_E4M3FN || d.code == RLH_DTYPE_FLOAT8_E5M2;
}

// The per-tensor scale of an fp8 operand: a power of two (so dequantising is exact in any
// precision) that brings the largest magnitude within the format's range.
inline double fp8_scale(rlh_dtype d, double amax) {
  if (!(amax > 0) || !std::isfinite(amax)) return 1.0;
  return std::exp2(std::ceil(std::log2(amax / fp8_format(d).max_finite())));
}

// x rounded to what a tensor of dtype d holds (fp8: of x / scale, times scale).
inline double round_to(rlh_dtype d, double x, double scale = 1.0) {
  if (d == kF64) return x;
  if (d == kF32) return double(float(x));
  if (d == kBF16) return round_bf16(x);
  if (is_fp8(d)) {
    const Fp8Format& f = fp8_format(d);
    return f.decode(f.encode(x / scale)) * scale;
  }
  return x;
}

// Values as the bytes of a tensor of dtype d (fp8: x / scale encoded), and back.
inline void encode_values(rlh_dtype d, const double* x, size_t n, void* out, double scale = 1.0) {
  if (d == kF64) {
    std::memcpy(out, x, n * 8);
  } else if (d == kF32) {
    auto* o = static_cast<float*>(out);
    for (size_t i = 0; i < n; ++i) o[i] = float(x[i]);
  } else if (d == kBF16) {
    auto* o = static_cast<uint16_t*>(out);
    for (size_t i = 0; i < n; ++i) o[i] = bf16_bits(float(x[i]));
  } else if (is_fp8(d)) {
    const Fp8Format& f = fp8_format(d);
    auto* o = static_cast<uint8_t*>(out);
    for (size_t i = 0; i < n; ++i) o[i] = f.encode(x[i] / scale);
  }
}
inline void decode_values(rlh_dtype d, const void* in, size_t n, double* x, double scale = 1.0) {
  if (d == kF64) {
    std::memcpy(x, in, n * 8);
  } else if (d == kF32) {
    const auto* p = static_cast<const float*>(in);
    for (size_t i = 0; i < n; ++i) x[i] = p[i];
  } else if (d == kBF16) {
    const auto* p = static_cast<const uint16_t*>(in);
    for (size_t i = 0; i < n; ++i) x[i] = bf16_value(p[i]);
  } else if (is_fp8(d)) {
    const Fp8Format& f = fp8_format(d);
    const auto* p = static_cast<const uint8_t*>(in);
    for (size_t i = 0; i < n; ++i) x[i] = f.decode(p[i]) * scale;
  }
}

}  // namespace rlh::sdk::kcheck
