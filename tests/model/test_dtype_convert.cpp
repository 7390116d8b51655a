// Element conversions: exact widening, round-to-nearest-even narrowing, checked against
// independent references (the compiler's _Float16 conversion; a nearest-of-two-candidates rule
// in double for bf16).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "rlhost/sdk/safetensors.hpp"

using namespace rlh::sdk::st;

namespace {

[[maybe_unused]] bool same_bits(float a, float b) { return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b); }

// Independent bf16 rounding: among the two bf16 neighbours of x pick the nearer, ties to the one
// with an even last bit. Overflow past the largest finite bf16 goes to inf as IEEE does.
uint16_t bf16_reference(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);  // truncation toward zero
  if ((u & 0xffffu) == 0) return lo;
  const uint16_t hi = static_cast<uint16_t>(lo + 1);
  const double dx = std::fabs(static_cast<double>(x));
  const double dlo = std::fabs(static_cast<double>(bf16_to_f32(lo)));
  // The next magnitude up; 0x7f80 is inf, compare against 2^128 instead.
  const double dhi = (hi & 0x7fffu) == 0x7f80u ? std::ldexp(1.0, 128) : std::fabs(static_cast<double>(bf16_to_f32(hi)));
  const double elo = dx - dlo, ehi = dhi - dx;
  if (elo < ehi) return lo;
  if (ehi < elo) return hi;
  return (lo & 1u) ? hi : lo;
}

// Independent f16 rounding in double: the f16 grid spacing at |x| is 2^(e-10) (e >= -14 for
// subnormals); scale, round half to even, scale back. Values from 65520 up are infinite.
double f16_reference_value(float x) {
  const double ax = std::fabs(static_cast<double>(x));
  double r;
  if (ax >= 65520.0) {
    r = std::numeric_limits<double>::infinity();
  } else if (ax == 0.0) {
    r = 0.0;
  } else {
    const int e = std::max(std::ilogb(ax), -14);
    const double ulp = std::ldexp(1.0, e - 10);
    r = std::nearbyint(ax / ulp) * ulp;  // default rounding mode: ties to even
  }
  return std::signbit(x) ? -r : r;
}

}  // namespace

TEST(DtypeConvert, Bf16WidenAndNarrowRoundTripEveryPattern) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const float f = bf16_to_f32(static_cast<uint16_t>(b));
    EXPECT_EQ(f32_to_bf16(f), b) << std::hex << b;
  }
}

TEST(DtypeConvert, F16WidenAndNarrowRoundTripEveryPattern) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const float f = f16_to_f32(static_cast<uint16_t>(b));
    ASSERT_EQ(f32_to_f16(f), b) << std::hex << b;
  }
}

TEST(DtypeConvert, F16NarrowMatchesNearestEvenReference) {
  auto check = [](uint32_t u) {
    const float x = std::bit_cast<float>(u);
    if (std::isnan(x)) return;
    const double want = f16_reference_value(x);
    const double got = f16_to_f32(f32_to_f16(x));
    ASSERT_EQ(got, want) << std::hex << u;
    ASSERT_EQ(std::signbit(got), std::signbit(want)) << std::hex << u;
  };
  for (uint64_t u = 0; u <= 0xffffffffull; u += 509) check(static_cast<uint32_t>(u));
  std::mt19937 rng(5);
  for (int i = 0; i < 200000; ++i) check(rng());
}

#if defined(__FLT16_MAX__)  // compilers with a native half type (GCC >= 12, clang >= 15 on x86)
TEST(DtypeConvert, F16WidenMatchesCompilerHalf) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    _Float16 h;
    const uint16_t bits = static_cast<uint16_t>(b);
    std::memcpy(&h, &bits, 2);
    const float ref = static_cast<float>(h);
    const float got = f16_to_f32(bits);
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(got));
    } else {
      EXPECT_TRUE(same_bits(ref, got)) << std::hex << b;
    }
  }
}

TEST(DtypeConvert, F16NarrowMatchesCompilerHalfOnASweep) {
  // Every 251st float32 pattern (covers all exponents, subnormals, overflow) plus random ones.
  auto check = [](uint32_t u) {
    const float x = std::bit_cast<float>(u);
    const _Float16 h = static_cast<_Float16>(x);
    uint16_t ref;
    std::memcpy(&ref, &h, 2);
    const uint16_t got = f32_to_f16(x);
    if (std::isnan(x)) {
      ASSERT_EQ(got & 0x7c00u, 0x7c00u);
      ASSERT_NE(got & 0x3ffu, 0u);
    } else {
      ASSERT_EQ(got, ref) << std::hex << u;
    }
  };
  for (uint64_t u = 0; u <= 0xffffffffull; u += 251) check(static_cast<uint32_t>(u));
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) check(rng());
}
#endif

TEST(DtypeConvert, F16NarrowEdgeCases) {
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bffu);
  EXPECT_EQ(f32_to_f16(65519.99f), 0x7bffu);  // below the halfway point to 2^16
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00u);   // halfway rounds to even -> inf
  EXPECT_EQ(f32_to_f16(-std::numeric_limits<float>::infinity()), 0xfc00u);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001u);     // smallest subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000u);     // halfway to 0: ties to even (0)
  EXPECT_EQ(f32_to_f16(std::ldexp(3.0f, -25)), 0x0002u);     // 1.5 ulp: ties to even (2)
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000u);
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00u);  // tie -> even (1.0)
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02u);
}

TEST(DtypeConvert, Bf16NarrowMatchesNearestEvenReference) {
  std::mt19937 rng(11);
  for (int i = 0; i < 300000; ++i) {
    const uint32_t u = rng();
    const float x = std::bit_cast<float>(u);
    if (std::isnan(x)) continue;
    ASSERT_EQ(f32_to_bf16(x), bf16_reference(x)) << std::hex << u;
  }
  // Exact ties in both parities, and overflow.
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80u);
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82u);
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x7f7fffffu)), 0x7f80u);
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x7f7f7fffu)), 0x7f7fu);
  // A NaN whose payload is only in the low bits must stay NaN.
  const uint16_t n = f32_to_bf16(std::bit_cast<float>(0x7f800001u));
  EXPECT_TRUE(std::isnan(bf16_to_f32(n)));
}

TEST(DtypeConvert, Fp8Decoding) {
  EXPECT_EQ(f8e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(f8e4m3_to_f32(0xb8), -1.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(f8e4m3_to_f32(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(f8e4m3_to_f32(0x7f - 8), 240.0f);  // 0x77: 2^7 * 1.875
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0xff)));
  EXPECT_EQ(f8e5m2_to_f32(0x3c), 1.0f);
  EXPECT_EQ(f8e5m2_to_f32(0x7b), 57344.0f);
  EXPECT_EQ(f8e5m2_to_f32(0x01), std::ldexp(1.0f, -16));
  EXPECT_TRUE(std::isinf(f8e5m2_to_f32(0x7c)));
  EXPECT_TRUE(std::isnan(f8e5m2_to_f32(0x7d)));
}

TEST(DtypeConvert, BulkIntegerAndFloatConversions) {
  const int64_t i64[] = {-1, 0, 123456789, -(int64_t{1} << 40)};
  double out[4];
  convert_to_f64(DType::I64, reinterpret_cast<const std::byte*>(i64), 4, out);
  EXPECT_EQ(out[0], -1.0);
  EXPECT_EQ(out[2], 123456789.0);
  EXPECT_EQ(out[3], -std::ldexp(1.0, 40));
  const uint8_t b[] = {0, 1, 7};
  float f[3];
  convert_to_f32(DType::BOOL, reinterpret_cast<const std::byte*>(b), 3, f);
  EXPECT_EQ(f[0], 0.0f);
  EXPECT_EQ(f[1], 1.0f);
  EXPECT_EQ(f[2], 1.0f);
  convert_to_f32(DType::U8, reinterpret_cast<const std::byte*>(b), 3, f);
  EXPECT_EQ(f[2], 7.0f);
  const int32_t i32[] = {-5, 9};
  convert_to_f32(DType::I32, reinterpret_cast<const std::byte*>(i32), 2, f);
  EXPECT_EQ(f[0], -5.0f);
  // Unaligned source: convert_to_f32 must not assume alignment.
  std::byte buf[1 + 2 * sizeof(float)];
  const float two[2] = {1.5f, -2.25f};
  std::memcpy(buf + 1, two, sizeof two);
  convert_to_f32(DType::F32, buf + 1, 2, f);
  EXPECT_EQ(f[0], 1.5f);
  EXPECT_EQ(f[1], -2.25f);
  // F64 -> F32 rounds to nearest.
  const double d = 1.0 + std::ldexp(1.0, -30);
  convert_to_f32(DType::F64, reinterpret_cast<const std::byte*>(&d), 1, f);
  EXPECT_EQ(f[0], 1.0f);
  // Writing as an integer dtype is refused.
  std::byte dst[8];
  EXPECT_THROW(convert_from_f32(DType::I32, f, 1, dst), std::invalid_argument);
}
