// How kernels_cpu gets a fast sgemm: OpenBLAS, loaded at run time with the right core type.
//
// Why at run time: Debian's libopenblas0-pthread is built DYNAMIC_ARCH and picks its kernels in
// its library constructor from cpuid; on CPU models newer than its tables it falls back to
// "Prescott" (SSE3) kernels, 5-6x slower than its SkylakeX (AVX-512) ones. OpenBLAS honours
// OPENBLAS_CORETYPE, read in that same constructor, so the variable must be set before the
// library is loaded: kernels_cpu never links OpenBLAS, it dlopens it on first use.
//
// The decision (openblas_coretype_choice, a pure function so it is tested alone):
//   1. From cpuid + XCR0 (cpu_features.hpp): AVX-512 F/BW/DQ/VL with ZMM state -> "SkylakeX";
//      AVX2 + FMA -> "Haswell"; AVX -> "Sandybridge"; else nothing (OpenBLAS decides).
//   2. OPENBLAS_CORETYPE already set by the user: kept as is, unless it is the known-slow
//      "Prescott" and step 1 found something better, which replaces it (users set Prescott to
//      work around detection failures; the verification below covers the correctness side).
//   3. Unset: set to the step-1 choice.
//   The variable is set only around dlopen and restored afterwards, so the process environment
//   is unchanged. OPENBLAS_NUM_THREADS is set to 1 the same way unless the user set it:
//   kernels_cpu splits GEMMs over its own OpenMP threads and calls OpenBLAS single-threaded, so
//   two thread pools never spin against each other.
// If OpenBLAS is already in the process (loaded by someone else), its core type is whatever
// that load chose; blas_info() reports it.
// Verification: after loading, sgemm is run on a few small problems (all transpose cases,
// alpha/beta, odd sizes) against gemm_naive; any mismatch disables OpenBLAS and gemm falls back
// to the builtin SIMD kernel. RLH_KCPU_BLAS=builtin skips OpenBLAS entirely; RLH_KCPU_OPENBLAS
// names the library to load (default libopenblas.so.0).
#pragma once

#include <string>

#include "rlhost/kernels_cpu/cpu_features.hpp"

namespace rlh::kcpu {

enum class GemmBackend {
  openblas,  // OpenBLAS cblas_sgemm (single-threaded calls, split over our threads)
  builtin,   // kernels_cpu's own packed SIMD kernel
};

struct BlasInfo {
  GemmBackend backend = GemmBackend::builtin;  // what gemm<float> uses
  std::string library;            // the file loaded, "" if none
  bool already_loaded = false;    // OpenBLAS was in the process before we loaded it
  std::string coretype_user;      // OPENBLAS_CORETYPE before loading ("" = unset)
  std::string coretype_used;      // what OpenBLAS was loaded with ("" = unset)
  std::string decision;           // why, one sentence
  std::string corename;           // openblas_get_corename() after loading
  std::string config;             // openblas_get_config()
  bool verified = false;          // small GEMMs matched gemm_naive
  std::string error;              // why OpenBLAS is not used, if it is not
};

// Loads and verifies on first call (thread-safe), then returns the cached result.
const BlasInfo& blas_info();
std::string blas_info_string();

// Step 1-3 above. `user` is the current OPENBLAS_CORETYPE (nullptr = unset). Returns the value
// to load OpenBLAS with ("" = leave unset) and explains in *why.
std::string openblas_coretype_choice(const char* user, SimdLevel level, std::string* why);

// Tests: run gemm<float> on a given backend (openblas only if it loaded and verified).
// Returns the backend previously in use.
GemmBackend gemm_backend_set(GemmBackend b);
GemmBackend gemm_backend();

}  // namespace rlh::kcpu
