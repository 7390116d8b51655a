// examples/vendor_fp8's FP8 GEMM through the KERNELS ABI: C[M, N] (bf16) = A[M, K] B[N, K]^T with
// e4m3 operands, per-tensor scales and DeepSeek-V3 block scales (A 1x128 tiles, B 128x128
// blocks). Timed on the host around `reps` queued calls and one synchronize (the plugin's own
// memory services; no CUDA is linked here), after warm-ups; median of `rounds`.
//   bench_fp8_gemm PLUGIN.so [--m 8192 --n 8192 --k 8192 --reps 50 --rounds 5]
// Prints: RESULT impl=rlhost name=<case> shape=MxNxK value=<TFLOP/s> unit=TFLOP/s ms=<per call>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "rlhost/kernels.h"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/status.hpp"

namespace {

using rlh::sdk::check;

struct Dev {
  const rlh_kernels_api* api;
  rlh_kernels* k;
  void* alloc(size_t n) {
    void* p = nullptr;
    check(api->memory_alloc(k, n, &p), "memory_alloc");
    return p;
  }
  void put(void* dst, const void* src, size_t n) {
    check(api->memory_copy(k, dst, src, n, RLH_COPY_HOST_TO_DEVICE, nullptr), "memory_copy");
    check(api->synchronize(k, nullptr), "synchronize");
  }
};

rlh_tensor tensor(void* p, const int64_t* shape, const int64_t* strides, int nd, rlh_dtype d) {
  rlh_tensor t{};
  t.data = p;
  t.device = rlh::sdk::cuda_device(0);
  t.ndim = nd;
  t.dtype = d;
  t.shape = const_cast<int64_t*>(shape);
  t.strides = const_cast<int64_t*>(strides);
  return t;
}

// Random e4m3 codes of moderate magnitude (no NaN: exponent field below 15).
std::vector<uint8_t> random_fp8(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = uint8_t((rng() & 0x80) | (4 + rng() % 6) << 3 | (rng() & 7));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: bench_fp8_gemm PLUGIN.so [--m M --n N --k K --reps R --rounds N]\n");
    return 2;
  }
  int64_t M = 8192, N = 8192, K = 8192;
  int reps = 50, rounds = 5;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const long long v = std::atoll(argv[i + 1]);
    if (a == "--m") M = v;
    else if (a == "--n") N = v;
    else if (a == "--k") K = v;
    else if (a == "--reps") reps = int(v);
    else if (a == "--rounds") rounds = int(v);
    else {
      std::fprintf(stderr, "bench_fp8_gemm: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    std::fprintf(stderr, "bench_fp8_gemm: %s\n", dlerror());
    return 1;
  }
  auto entry = reinterpret_cast<rlh_plugin_entry_fn>(dlsym(lib, RLH_PLUGIN_ENTRY_SYMBOL));
  const rlh_plugin_desc* desc = entry ? entry(RLH_ABI_VERSION_MAJOR, RLH_ABI_VERSION_MINOR) : nullptr;
  const rlh_kernels_api* api = nullptr;
  for (size_t i = 0; desc && i < desc->num_components; ++i)
    if (desc->components[i]->kind == RLH_KIND_KERNELS) api = static_cast<const rlh_kernels_api*>(desc->components[i]->api);
  if (!api) {
    std::fprintf(stderr, "bench_fp8_gemm: %s has no kernel provider\n", argv[1]);
    return 1;
  }
  try {
    rlh_kernels* k = nullptr;
    check(api->create(nullptr, rlh::sdk::cuda_device(0), "{}", 2, &k), "create on cuda:0");
    Dev d{api, k};
    const int64_t kb = (K + 127) / 128, kb4 = (kb + 3) / 4 * 4;
    void* a = d.alloc(size_t(M * K));
    void* b = d.alloc(size_t(N * K));
    void* c = d.alloc(size_t(M * N) * 2);
    d.put(a, random_fp8(size_t(M * K), 1).data(), size_t(M * K));
    d.put(b, random_fp8(size_t(N * K), 2).data(), size_t(N * K));
    const int64_t na = kb * M, nb = ((N + 127) / 128) * kb4;
    std::vector<float> sa(size_t(na), 1.0f / 64), sb(size_t(nb), 1.0f / 64);
    void* dsa = d.alloc(size_t(na) * 4);
    void* dsb = d.alloc(size_t(nb) * 4);
    d.put(dsa, sa.data(), sa.size() * 4);
    d.put(dsb, sb.data(), sb.size() * 4);
    void* ws = d.alloc(size_t(32) << 20);
    const int64_t sA[2] = {M, K}, tA[2] = {K, 1}, sB[2] = {N, K}, tB[2] = {K, 1}, sC[2] = {M, N}, tC[2] = {N, 1};
    for (int scaling : {0, 1}) {
      const int64_t nsa[1] = {scaling ? na : 1}, nsb[1] = {scaling ? nb : 1}, unit[1] = {1};
      const rlh_tensor in[4] = {tensor(a, sA, tA, 2, rlh::sdk::kE4M3), tensor(b, sB, tB, 2, rlh::sdk::kE4M3),
                                tensor(dsa, nsa, unit, 1, rlh::sdk::kF32), tensor(dsb, nsb, unit, 1, rlh::sdk::kF32)};
      const rlh_tensor out[1] = {tensor(c, sC, tC, 2, rlh::sdk::kBF16)};
      const rlh_named_value attrs[2] = {rlh::sdk::attr_int("transpose_b", 1), rlh::sdk::attr_int("scaling", scaling)};
      rlh_op_desc od{};
      od.struct_size = sizeof od;
      od.name = "gemm";
      od.device = rlh::sdk::cuda_device(0);
      od.inputs = in;
      od.num_inputs = 4;
      od.outputs = out;
      od.num_outputs = 1;
      od.shapes_valid = 1;
      od.attrs = attrs;
      od.num_attrs = 2;
      rlh_op* op = nullptr;
      check(api->get_op(k, &od, &op), "resolve gemm");
      rlh_op_call call{};
      call.struct_size = sizeof call;
      call.inputs = in;
      call.num_inputs = 4;
      call.outputs = out;
      call.num_outputs = 1;
      call.workspace = ws;
      call.workspace_bytes = size_t(32) << 20;
      for (int i = 0; i < 5; ++i) check(api->run(op, &call), "gemm");
      check(api->synchronize(k, nullptr), "synchronize");
      std::vector<double> ms;
      for (int r = 0; r < rounds; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < reps; ++i) check(api->run(op, &call), "gemm");
        check(api->synchronize(k, nullptr), "synchronize");
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps);
      }
      std::sort(ms.begin(), ms.end());
      const double t = ms[ms.size() / 2];
      std::printf("RESULT impl=rlhost name=%s shape=%lldx%lldx%lld value=%.1f unit=TFLOP/s ms=%.4f\n",
                  scaling ? "fp8_gemm_block" : "fp8_gemm_tensor", (long long)M, (long long)N, (long long)K,
                  2.0 * double(M) * double(N) * double(K) / (t * 1e-3) / 1e12, t);
      api->release_op(op);
    }
    for (void* p : {a, b, c, dsa, dsb, ws}) api->memory_free(k, p);
    api->destroy(k);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_fp8_gemm: %s\n", e.what());
    return 1;
  }
  return 0;
}
