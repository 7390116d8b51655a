// Element conversions between checkpoint dtypes and float32/float64.
//
// Bit-level, with no reliance on compiler half types, so the results are the same on every host
// and a bf16/f16 checkpoint read to float32 and written back is bit-identical (every bf16/f16
// value is exactly representable in float32, and rounding an exact value returns it).
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "rlhost/sdk/safetensors.hpp"

namespace rlh::sdk::st {

// ---------------------------------------------------------------------------------------------
// scalar conversions

float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t f32_to_bf16(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    // NaN: keep sign and the top payload bits (so a bf16 NaN round-trips unchanged); if the
    // payload lived only in the dropped bits, set the quiet bit so the result is not inf.
    const uint16_t top = static_cast<uint16_t>(u >> 16);
    return (top & 0x007fu) ? top : static_cast<uint16_t>(top | 0x0040u);
  }
  // Round to nearest even on the 16 dropped bits. Overflow rounds into the exponent and gives
  // inf, which is the correctly rounded result.
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);
}

float f16_to_f32(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exp = (bits >> 10) & 0x1fu;
  const uint32_t man = bits & 0x3ffu;
  uint32_t out;
  if (exp == 0x1f) {
    out = sign | 0x7f800000u | (man << 13);  // inf / NaN (payload kept)
  } else if (exp != 0) {
    out = sign | ((exp + 112u) << 23) | (man << 13);  // normal: rebias 15 -> 127
  } else if (man == 0) {
    out = sign;  // +-0
  } else {
    // Subnormal f16 = man * 2^-24; exact in float32.
    const float mag = static_cast<float>(man) * 0x1p-24f;
    out = sign | std::bit_cast<uint32_t>(mag);
  }
  return std::bit_cast<float>(out);
}

uint16_t f32_to_f16(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t absu = u & 0x7fffffffu;
  if (absu > 0x7f800000u) {
    // NaN: keep the top payload bits (an f16 NaN round-trips unchanged), else make it quiet.
    const uint32_t payload = (absu >> 13) & 0x3ffu;
    return static_cast<uint16_t>(sign | 0x7c00u | (payload ? payload : 0x200u));
  }
  if (absu >= 0x477ff000u) {
    // >= 65520 (halfway between the largest f16, 65504, and 2^16) rounds to inf; inf stays inf.
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (absu >= 0x38800000u) {
    // Normal f16 range (>= 2^-14): rebias and round the 13 dropped mantissa bits to nearest even.
    // A carry out of the mantissa correctly bumps the exponent.
    const uint32_t rebiased = absu - (112u << 23);
    const uint32_t lsb = (rebiased >> 13) & 1u;
    return static_cast<uint16_t>(sign | ((rebiased + 0xfffu + lsb) >> 13));
  }
  // Subnormal or zero: value / 2^-24 rounded to an integer, nearest even. The float32 product is
  // exact (power-of-two scaling of a value that stays normal) and nearbyint rounds to even under
  // the default rounding mode.
  const float scaled = std::bit_cast<float>(absu) * 0x1p24f;
  const uint32_t m = static_cast<uint32_t>(std::nearbyint(scaled));
  return static_cast<uint16_t>(sign | m);  // m == 0x400 becomes the smallest normal, correctly
}

float f8e4m3_to_f32(uint8_t bits) {
  const bool neg = bits & 0x80u;
  const uint32_t exp = (bits >> 3) & 0xfu;
  const uint32_t man = bits & 0x7u;
  float mag;
  if (exp == 0xf && man == 0x7) {
    mag = std::numeric_limits<float>::quiet_NaN();
  } else if (exp == 0) {
    mag = static_cast<float>(man) * 0x1p-9f;  // subnormal: man/8 * 2^(1-7)
  } else {
    mag = std::ldexp(1.0f + static_cast<float>(man) / 8.0f, static_cast<int>(exp) - 7);
  }
  return neg ? -mag : mag;
}

float f8e5m2_to_f32(uint8_t bits) {
  // E5M2 is the top byte of an IEEE f16.
  return f16_to_f32(static_cast<uint16_t>(bits) << 8);
}

// ---------------------------------------------------------------------------------------------
// bulk conversions (unaligned sources: memcpy each element)

namespace {

template <class T>
T load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <class Out>
void convert_to(DType t, const std::byte* src, size_t n, Out* dst) {
  switch (t) {
    case DType::BOOL:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(load<uint8_t>(src + i) != 0);
      return;
    case DType::U8:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(load<uint8_t>(src + i));
      return;
    case DType::I8:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(load<int8_t>(src + i));
      return;
    case DType::F8_E5M2:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(f8e5m2_to_f32(load<uint8_t>(src + i)));
      return;
    case DType::F8_E4M3:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(f8e4m3_to_f32(load<uint8_t>(src + i)));
      return;
    case DType::I16:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(load<int16_t>(src + 2 * i));
      return;
    case DType::U16:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(load<uint16_t>(src + 2 * i));
      return;
    case DType::F16:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(f16_to_f32(load<uint16_t>(src + 2 * i)));
      return;
    case DType::BF16:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(bf16_to_f32(load<uint16_t>(src + 2 * i)));
      return;
    case DType::I32:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(load<int32_t>(src + 4 * i));
      return;
    case DType::U32:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(load<uint32_t>(src + 4 * i));
      return;
    case DType::F32:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(load<float>(src + 4 * i));
      return;
    case DType::F64:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(load<double>(src + 8 * i));
      return;
    case DType::I64:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(load<int64_t>(src + 8 * i));
      return;
    case DType::U64:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(load<uint64_t>(src + 8 * i));
      return;
  }
  throw std::invalid_argument("convert: unknown dtype");
}

}  // namespace

void convert_to_f32(DType t, const std::byte* src, size_t n, float* dst) { convert_to(t, src, n, dst); }
void convert_to_f64(DType t, const std::byte* src, size_t n, double* dst) { convert_to(t, src, n, dst); }

void convert_from_f32(DType t, const float* src, size_t n, std::byte* dst) {
  switch (t) {
    case DType::F32:
      if (n) std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::F64:
      for (size_t i = 0; i < n; ++i) {
        const double d = src[i];
        std::memcpy(dst + 8 * i, &d, 8);
      }
      return;
    case DType::BF16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_bf16(src[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    case DType::F16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_f16(src[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    default:
      throw std::invalid_argument("convert: cannot write float32 values as " +
                                  std::string(dtype_name(t)));
  }
}

}  // namespace rlh::sdk::st
