// cpuid/xgetbv feature detection (see cpu_features.hpp).
#include "rlhost/kernels_cpu/cpu_features.hpp"

#include <cpuid.h>  // __get_cpuid_count, __get_cpuid_max

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace rlh::kcpu {
namespace {

struct Regs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

Regs cpuid(unsigned leaf, unsigned sub = 0) {
  Regs r;
  if (!__get_cpuid_count(leaf, sub, &r.a, &r.b, &r.c, &r.d)) r = Regs{};
  return r;
}

// XCR0 via xgetbv; only valid when cpuid reports OSXSAVE.
uint64_t xcr0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

CpuFeatures detect() {
  CpuFeatures f;
  const unsigned max_leaf = __get_cpuid_max(0, nullptr);
  Regs v = cpuid(0);
  char vendor[13] = {};
  std::memcpy(vendor + 0, &v.b, 4);
  std::memcpy(vendor + 4, &v.d, 4);
  std::memcpy(vendor + 8, &v.c, 4);
  f.vendor = vendor;

  Regs l1 = cpuid(1);
  int base_family = (l1.a >> 8) & 0xf, base_model = (l1.a >> 4) & 0xf;
  f.family = base_family == 0xf ? base_family + ((l1.a >> 20) & 0xff) : base_family;
  f.model = (base_family == 6 || base_family == 0xf) ? base_model + (((l1.a >> 16) & 0xf) << 4)
                                                     : base_model;
  f.sse2 = l1.d & (1u << 26);
  f.fma = l1.c & (1u << 12);
  const bool osxsave = l1.c & (1u << 27);
  f.avx = l1.c & (1u << 28);
  if (osxsave) {
    const uint64_t x = xcr0();
    f.os_ymm = (x & 0x6) == 0x6;             // SSE + AVX state
    f.os_zmm = f.os_ymm && (x & 0xe0) == 0xe0;  // opmask, ZMM_Hi256, Hi16_ZMM
  }
  if (max_leaf >= 7) {
    Regs l7 = cpuid(7, 0);
    f.avx2 = l7.b & (1u << 5);
    f.avx512f = l7.b & (1u << 16);
    f.avx512dq = l7.b & (1u << 17);
    f.avx512bw = l7.b & (1u << 30);
    f.avx512vl = l7.b & (1u << 31);
    f.amx_tile = l7.d & (1u << 24);
    Regs l71 = cpuid(7, 1);
    f.avx512_bf16 = l71.a & (1u << 5);
  }
  Regs ext = cpuid(0x80000000);
  if (ext.a >= 0x80000004) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      Regs r = cpuid(0x80000002 + i);
      std::memcpy(brand + 16 * i + 0, &r.a, 4);
      std::memcpy(brand + 16 * i + 4, &r.b, 4);
      std::memcpy(brand + 16 * i + 8, &r.c, 4);
      std::memcpy(brand + 16 * i + 12, &r.d, 4);
    }
    f.brand = brand;
    while (!f.brand.empty() && f.brand.back() == ' ') f.brand.pop_back();
    while (!f.brand.empty() && f.brand.front() == ' ') f.brand.erase(0, 1);
  }

  if (f.avx512f && f.avx512bw && f.avx512dq && f.avx512vl && f.avx2 && f.fma && f.os_zmm)
    f.level = SimdLevel::avx512;
  else if (f.avx2 && f.fma && f.os_ymm)
    f.level = SimdLevel::avx2;
  else
    f.level = SimdLevel::generic;

  // A cap for testing the narrower variants; never raises the level.
  if (const char* cap = std::getenv("RLH_KCPU_SIMD")) {
    SimdLevel want = f.level;
    if (!std::strcmp(cap, "generic")) want = SimdLevel::generic;
    if (!std::strcmp(cap, "avx2")) want = SimdLevel::avx2;
    if (!std::strcmp(cap, "avx512")) want = SimdLevel::avx512;
    if (static_cast<int>(want) < static_cast<int>(f.level)) f.level = want;
  }
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

const char* to_string(SimdLevel l) {
  switch (l) {
    case SimdLevel::generic: return "generic";
    case SimdLevel::avx2: return "avx2";
    case SimdLevel::avx512: return "avx512";
  }
  return "?";
}

std::string cpu_features_string() {
  const CpuFeatures& f = cpu_features();
  std::string s = f.vendor + " family " + std::to_string(f.family) + " model " +
                  std::to_string(f.model) + " '" + f.brand + "':";
  auto add = [&](bool on, const char* name) {
    if (on) s += std::string(" ") + name;
  };
  add(f.avx, "avx");
  add(f.avx2, "avx2");
  add(f.fma, "fma");
  add(f.avx512f, "avx512f");
  add(f.avx512bw, "avx512bw");
  add(f.avx512dq, "avx512dq");
  add(f.avx512vl, "avx512vl");
  add(f.avx512_bf16, "avx512_bf16");
  add(f.amx_tile, "amx_tile");
  add(f.os_ymm, "os_ymm");
  add(f.os_zmm, "os_zmm");
  s += std::string(" -> ") + to_string(f.level);
  return s;
}

}  // namespace rlh::kcpu
