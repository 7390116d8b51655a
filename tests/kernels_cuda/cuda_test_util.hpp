// Helpers of the kernels_cuda tests: loading the plugin without a host, bf16 on the host,
// device buffers, and the skip on machines without a CUDA device.
#pragma once

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "rlhost/kernels.h"
#include "rlhost/sdk/status.hpp"

namespace rlh::kcuda::testing {

// "" when a CUDA device is usable, else why not.
inline std::string cuda_unavailable() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  if (n == 0) return "0 devices";
  return {};
}

#define RLH_REQUIRE_CUDA()                                                     \
  do {                                                                         \
    const std::string why_ = ::rlh::kcuda::testing::cuda_unavailable();       \
    if (!why_.empty()) GTEST_SKIP() << "no CUDA device: " << why_;             \
  } while (0)

#define CUDA_OK(x)                                                             \
  do {                                                                         \
    const cudaError_t e_ = (x);                                                \
    ASSERT_EQ(e_, cudaSuccess) << #x << ": " << cudaGetErrorString(e_);        \
  } while (0)

#ifdef RLH_KCUDA_PLUGIN_PATH
inline std::string plugin_path() {
  if (const char* p = std::getenv("RLH_KCUDA_PLUGIN"); p && *p) return p;
  return RLH_KCUDA_PLUGIN_PATH;
}
#endif

// A host services table with logging and statuses only (what a kernel provider uses).
inline const rlh_host_api* mini_host() {
  static rlh_host_api h = [] {
    rlh_host_api a{};
    a.struct_size = sizeof(rlh_host_api);
    a.abi_major = RLH_ABI_VERSION_MAJOR;
    a.abi_minor = RLH_ABI_VERSION_MINOR;
    a.log = [](rlh_host_ctx*, int32_t level, const char* msg, size_t len) {
      if (level >= RLH_LOG_INFO) std::fprintf(stderr, "[plugin] %.*s\n", int(len), msg);
    };
    a.make_status = [](rlh_code code, const char* msg, size_t len) {
      return sdk::make_local_status(code, std::string_view(msg, len));
    };
    return a;
  }();
  return &h;
}

#ifdef RLH_KCUDA_PLUGIN_PATH
struct LoadedPlugin {
  void* lib = nullptr;
  const rlh_plugin_desc* desc = nullptr;
  const rlh_kernels_api* api = nullptr;
  std::string error;
};

inline LoadedPlugin load_plugin() {
  LoadedPlugin p;
  const std::string path = plugin_path();
  p.lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!p.lib) {
    const char* e = dlerror();
    p.error = "dlopen " + path + ": " + (e ? e : "?");
    return p;
  }
  auto entry = reinterpret_cast<rlh_plugin_entry_fn>(dlsym(p.lib, RLH_PLUGIN_ENTRY_SYMBOL));
  if (!entry) {
    p.error = "no rlh_plugin_entry in " + path;
    return p;
  }
  p.desc = entry(RLH_ABI_VERSION_MAJOR, RLH_ABI_VERSION_MINOR);
  for (size_t i = 0; p.desc && i < p.desc->num_components; ++i)
    if (p.desc->components[i]->kind == RLH_KIND_KERNELS)
      p.api = static_cast<const rlh_kernels_api*>(p.desc->components[i]->api);
  if (!p.api) p.error = "no KERNELS component in " + path;
  return p;
}
#endif

// bf16 on the host: round to nearest even (NaN stays NaN).
inline uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float bf2f(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float round_bf16(float f) { return bf2f(f2bf(f)); }

// A device buffer of n elements of float32 or bfloat16 (bf16 = true), filled from floats.
class DevBuf {
 public:
  DevBuf() = default;
  DevBuf(size_t n, bool bf16) : n_(n), bf16_(bf16) {
    if (cudaMalloc(&p_, std::max<size_t>(n * es(), 16)) != cudaSuccess) p_ = nullptr;
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : p_(o.p_), n_(o.n_), bf16_(o.bf16_) { o.p_ = nullptr; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(p_, o.p_);
    n_ = o.n_;
    bf16_ = o.bf16_;
    return *this;
  }
  ~DevBuf() { if (p_) cudaFree(p_); }
  void* get() const { return p_; }
  size_t size() const { return n_; }
  bool bf16() const { return bf16_; }
  size_t es() const { return bf16_ ? 2 : 4; }
  void upload(const std::vector<float>& v) {
    if (bf16_) {
      std::vector<uint16_t> b(v.size());
      for (size_t i = 0; i < v.size(); ++i) b[i] = f2bf(v[i]);
      cudaMemcpy(p_, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
    } else {
      cudaMemcpy(p_, v.data(), v.size() * 4, cudaMemcpyHostToDevice);
    }
  }
  std::vector<float> download() const {
    std::vector<float> v(n_);
    if (bf16_) {
      std::vector<uint16_t> b(n_);
      cudaMemcpy(b.data(), p_, n_ * 2, cudaMemcpyDeviceToHost);
      for (size_t i = 0; i < n_; ++i) v[i] = bf2f(b[i]);
    } else {
      cudaMemcpy(v.data(), p_, n_ * 4, cudaMemcpyDeviceToHost);
    }
    return v;
  }
  std::vector<uint8_t> bytes() const {
    std::vector<uint8_t> b(n_ * es());
    cudaMemcpy(b.data(), p_, b.size(), cudaMemcpyDeviceToHost);
    return b;
  }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
  bool bf16_ = false;
};

// max|got - ref| / max|ref| (NaN or inf mismatches give +inf).
inline double rel_error(const std::vector<float>& got, const std::vector<float>& ref) {
  double maxref = 0, maxerr = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(got[i]) != std::isnan(ref[i])) return INFINITY;
    if (std::isinf(ref[i]) || std::isinf(got[i])) {
      if (got[i] != ref[i]) return INFINITY;
      continue;
    }
    maxref = std::max(maxref, std::fabs(double(ref[i])));
    maxerr = std::max(maxerr, std::fabs(double(got[i]) - double(ref[i])));
  }
  return maxerr / std::max(maxref, 1e-30);
}

}  // namespace rlh::kcuda::testing
