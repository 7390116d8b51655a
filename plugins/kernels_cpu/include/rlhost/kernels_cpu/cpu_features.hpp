// What this x86-64 CPU and its OS can execute, read once from cpuid and xgetbv.
//
// Kernels pick their SIMD variant from here at run time (the library itself is built for plain
// x86-64), and the OpenBLAS loader derives OPENBLAS_CORETYPE from it (blas.hpp). A feature counts
// only when the OS also saves its registers (XCR0), so a VM that hides AVX-512 state reads as
// AVX2.
#pragma once

#include <string>

namespace rlh::kcpu {

// Highest SIMD level a kernel variant may use on this machine.
enum class SimdLevel {
  generic,  // SSE2 (x86-64 baseline)
  avx2,     // AVX2 + FMA
  avx512,   // AVX-512 F/BW/DQ/VL (+ AVX2, FMA)
};

struct CpuFeatures {
  std::string vendor;  // "GenuineIntel"
  std::string brand;   // "Intel(R) Xeon(R) Processor"
  int family = 0;      // display family (6)
  int model = 0;       // display model
  bool sse2 = false, avx = false, avx2 = false, fma = false;
  bool avx512f = false, avx512bw = false, avx512dq = false, avx512vl = false;
  bool avx512_bf16 = false, amx_tile = false;
  bool os_ymm = false;  // XCR0 saves YMM state
  bool os_zmm = false;  // XCR0 saves opmask + ZMM state
  SimdLevel level = SimdLevel::generic;
};

// Read once (thread-safe), then cached. Setting RLH_KCPU_SIMD=generic|avx2|avx512 in the
// environment caps `level` (for testing the other variants on a bigger machine).
const CpuFeatures& cpu_features();

// One line for logs: "GenuineIntel family 6 model 167 'Intel(R) Xeon(R) Processor': avx2 fma
// avx512f ... -> avx512".
std::string cpu_features_string();

const char* to_string(SimdLevel);

}  // namespace rlh::kcpu
