// examples/vendor_fp8's FP8 GEMM through the KERNELS ABI: C[M, N] (bf16) = A[M, K] B[N, K]^T with
// e4m3 operands, per-tensor scales and DeepSeek-V3 block scales (A 1x128 tiles, B 128x128
// blocks). Timed on the host around `reps` queued calls and one synchronize (the plugin's own
// memory services; no CUDA is linked here), after warm-ups; median of `rounds`.
//   bench_fp8_gemm PLUGIN.so [--m 8192 --n 8192 --k 8192 --reps 50 --rounds 5 --data normal|uniform]
//   bench_fp8_gemm PLUGIN.so --decode 1 [--cold 1] [--bf16 KERNELS_CUDA.so]   a decoding step's products
//     instead (Llama-3.2-1B's four weights at 1 to 256 rows) in every FP8 form, the activations'
//     quantisation, and the bf16 product beside them, in microseconds a call (decode_products;
//     --cold 1: the weights streamed from memory, not L2)
// Prints: RESULT impl=rlhost name=<case> shape=MxNxK value=<TFLOP/s> unit=TFLOP/s ms=<per call>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
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
  // `first` and copies of its `n` bytes made on the device, enough that together they pass
  // `total` bytes (at least one: `first` alone).
  std::vector<void*> copies_of(void* first, size_t n, size_t total) {
    std::vector<void*> all{first};
    while (all.size() * n < total) {
      all.push_back(alloc(n));
      check(api->memory_copy(k, all.back(), first, n, RLH_COPY_DEVICE_TO_DEVICE, nullptr), "memory_copy");
    }
    check(api->synchronize(k, nullptr), "synchronize");
    return all;
  }
  void free_copies(const std::vector<void*>& all) {
    for (size_t i = 1; i < all.size(); ++i) api->memory_free(k, all[i]);
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

// e4m3 codes of N(0, 1/4) samples, rounded to the nearest code: the data bench_torch.py gives
// torch._scaled_mm (randn / 4). A GEMM this size is power-bound on Hopper, and its clock depends on
// how many bits toggle: this bench's earlier uniformly random codes ran 15% below torch on the H200
// (1,254 TFLOP/s against torch's 1,482 on normal data, 2026-12-04), so both sides multiply the
// same distribution; --data uniform keeps the old data to show the difference in one run.
std::vector<uint8_t> normal_fp8(size_t n, uint64_t seed) {
  std::vector<std::pair<float, uint8_t>> codes;  // the non-negative finite codes, ascending
  for (int c = 0; c < 0x7F; ++c) {
    const int e = c >> 3, m = c & 7;
    codes.emplace_back(e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + float(m) / 8, e - 7), uint8_t(c));
  }
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.25f);
  std::vector<uint8_t> v(n);
  for (auto& b : v) {
    const float x = normal(rng), ax = std::min(std::fabs(x), 448.0f);
    auto hi = std::lower_bound(codes.begin(), codes.end(), std::make_pair(ax, uint8_t(0)));
    if (hi == codes.end()) --hi;
    const auto lo = hi == codes.begin() ? hi : hi - 1;
    const uint8_t c = (ax - lo->first <= hi->first - ax) ? lo->second : hi->second;
    b = uint8_t((x < 0 ? 0x80 : 0) | c);
  }
  return v;
}

// Uniformly random codes of moderate magnitude (exponent field 4..9, no NaN): the data this bench
// drew before 2026-12-06, kept as --data uniform to show the clock effect beside the normal data.
std::vector<uint8_t> uniform_fp8(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = uint8_t((rng() & 0x80) | (4 + rng() % 6) << 3 | (rng() & 7));
  return v;
}

// Op `name` resolved with these operands' shapes: the handle, or the provider's status (owned by
// the caller) when it refuses.
rlh_status* resolve_op(const Dev& d, const char* name, const rlh_tensor* in, size_t nin, const rlh_tensor* out,
                       size_t nout, const rlh_named_value* attrs, size_t nattrs, rlh_op** op) {
  rlh_op_desc od{};
  od.struct_size = sizeof od;
  od.name = name;
  od.device = rlh::sdk::cuda_device(0);
  od.inputs = in;
  od.num_inputs = nin;
  od.outputs = out;
  od.num_outputs = nout;
  od.shapes_valid = 1;
  od.attrs = attrs;
  od.num_attrs = nattrs;
  *op = nullptr;
  return d.api->get_op(d.k, &od, op);
}

// One product timed over `reps` queued calls after 5 warm-ups, median of `rounds`, in ms a call;
// the calls taken in turn from `calls` (one, or the same product on copies of its weight).
double time_calls(Dev& d, rlh_op* op, const std::vector<rlh_op_call>& calls, int reps, int rounds = 5) {
  const size_t n = calls.size();
  for (int i = 0; i < 5; ++i) check(d.api->run(op, &calls[size_t(i) % n]), "gemm");
  check(d.api->synchronize(d.k, nullptr), "synchronize");
  std::vector<double> ms;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) check(d.api->run(op, &calls[size_t(i) % n]), "gemm");
    check(d.api->synchronize(d.k, nullptr), "synchronize");
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// A decoding step's products (--decode): Llama-3.2-1B's q|k|v, o, gate|up and down weights at
// 1 to 256 rows, in every form the plugin offers for them: the weight-only product (bf16 A x e4m3
// B, 128x128 block scales), and e4m3 x e4m3 with block scales (A 1x128 tiles; on cuBLASLt with its
// heuristic's pick, `block`, and autotuned as generation runs it, `block_tuned`, and on the
// plugin's few-row kernel, `block_few`), one scale per
// tensor and one per row (per token x per output channel), the last two with and without fast
// accumulation; beside them, with --bf16 PLUGIN.so (kernels_cuda), the bf16 product the FP8 ones
// replace, and the activation's quantisation each FP8 form needs first (quantize_fp8 of A at
// grouping 0, 1 and 3). Microseconds a call over `reps` queued calls; 0 where refused.
// `cold`: each call reads another copy of the weight, the copies together past 192 MiB (L2 is 50
// MiB), so every product streams its weight from memory, as a decoding step does (a layer's
// weights were last read a step earlier). Repeating one weight measures L2-resident weights: at
// 64 rows the FP8 q|k|v product took 7.9 us warm and ~12 under ncu with caches flushed (H100,
// 2026-12-07), and warm figures had the few-row kernel ahead of cuBLASLt where generation found
// them even.
void decode_products(Dev& d, Dev* bf16, int reps, bool cold) {
  const size_t cold_bytes = cold ? size_t(192) << 20 : 0;
  const int64_t shapes[4][2] = {{3072, 2048}, {2048, 2048}, {16384, 2048}, {2048, 8192}};
  const char* names[4] = {"qkv", "o", "gate_up", "down"};
  struct Form {
    const char* name;
    int scaling, fast;
    bool weight_only;
    int few_rows;  // block scaling: 0 cuBLASLt, 2 the plugin's few-row kernel at any rows
    int autotune;  // cuBLASLt's candidates timed at the shape's first product (as generation asks)
  };
  const Form forms[8] = {{"weight_only", 1, 0, true, 0, 0},  {"block", 1, 0, false, 0, 0},
                         {"block_tuned", 1, 0, false, 0, 1}, {"block_few", 1, 0, false, 2, 0},
                         {"tensor", 0, 0, false, 0, 0},      {"tensor_fast", 0, 1, false, 0, 0},
                         {"rows", 3, 0, false, 0, 0},        {"rows_fast", 3, 1, false, 0, 0}};
  for (const int64_t M : {1, 16, 64, 128, 256}) {
    for (int s = 0; s < 4; ++s) {
      const int64_t N = shapes[s][0], K = shapes[s][1];
      const int64_t kb = (K + 127) / 128, kb4 = (kb + 3) / 4 * 4;
      void* a = d.alloc(size_t(M * K) * 2);
      void* aq = d.alloc(size_t(M * K));
      void* b = d.alloc(size_t(N * K));
      void* c = d.alloc(size_t(M * N) * 2);
      const int64_t nsa_max = kb * M, nsb_max = std::max(((N + 127) / 128) * kb4, N);
      void* dsa = d.alloc(size_t(nsa_max) * 4);
      void* dsb = d.alloc(size_t(nsb_max) * 4);
      void* ws = d.alloc(size_t(32) << 20);
      d.put(b, normal_fp8(size_t(N * K), 2).data(), size_t(N * K));
      const std::vector<void*> bs = d.copies_of(b, size_t(N * K), cold_bytes);
      const std::vector<uint8_t> codes = normal_fp8(size_t(M * K), 1);
      d.put(aq, codes.data(), codes.size());
      std::vector<uint16_t> abf(size_t(M * K));  // bf16 in +-[2^-7, 2^-6), random mantissas and signs
      for (size_t i = 0; i < abf.size(); ++i) abf[i] = uint16_t(0x3c00 | (codes[i] & 0x7f) | ((codes[i] & 0x80) << 8));
      d.put(a, abf.data(), abf.size() * 2);
      std::vector<float> sa(size_t(nsa_max), 1.0f / 64), sb(size_t(nsb_max), 1.0f / 64);
      d.put(dsa, sa.data(), sa.size() * 4);
      d.put(dsb, sb.data(), sb.size() * 4);
      const int64_t sA[2] = {M, K}, tA[2] = {K, 1}, sB[2] = {N, K}, tB[2] = {K, 1}, sC[2] = {M, N}, tC[2] = {N, 1},
                    unit[1] = {1};
      // (`weights`: where input 1 is a weight, its copies, taken in turn.)
      auto timed = [&](Dev& dev, void* wsp, const std::vector<rlh_tensor>& in, const std::vector<rlh_tensor>& out,
                       const std::vector<rlh_named_value>& attrs, const std::vector<rlh_named_value>& call_attrs,
                       const char* op_name, const std::string& what,
                       const std::vector<void*>& weights = {}) -> double {
        rlh_op* op = nullptr;
        if (rlh_status* st =
                resolve_op(dev, op_name, in.data(), in.size(), out.data(), out.size(), attrs.data(), attrs.size(), &op)) {
          rlh::sdk::StatusPtr owned(st);
          std::printf("%-8s M=%-3lld %s: refused: %s\n", names[s], (long long)M, what.c_str(),
                      rlh::sdk::status_message(st).c_str());
          return 0;
        }
        std::vector<std::vector<rlh_tensor>> ins(std::max<size_t>(1, weights.size()), in);
        for (size_t i = 0; i < weights.size(); ++i) ins[i][1].data = weights[i];
        std::vector<rlh_op_call> calls(ins.size());
        for (size_t i = 0; i < ins.size(); ++i) {
          rlh_op_call& call = calls[i];
          call.struct_size = sizeof call;
          call.inputs = ins[i].data();
          call.num_inputs = ins[i].size();
          call.outputs = out.data();
          call.num_outputs = out.size();
          call.workspace = wsp;
          call.workspace_bytes = size_t(32) << 20;
          call.attrs = call_attrs.data();
          call.num_attrs = call_attrs.size();
        }
        const double us = 1e3 * time_calls(dev, op, calls, reps);
        dev.api->release_op(op);
        return us;
      };
      std::string line = "RESULT impl=rlhost name=decode_" + std::string(names[s]) + " rows=" + std::to_string(M) +
                         " shape=" + std::to_string(N) + "x" + std::to_string(K);
      char buf[96];
      const rlh_tensor out[1] = {tensor(c, sC, tC, 2, rlh::sdk::kBF16)};
      for (const Form& f : forms) {
        const int64_t na = f.scaling == 3 ? M : f.scaling == 1 ? kb * M : 1;
        const int64_t nb = f.scaling == 3 ? N : f.scaling == 1 ? ((N + 127) / 128) * kb4 : 1;
        const int64_t nsa[1] = {na}, nsb[1] = {nb};
        std::vector<rlh_tensor> in;
        if (f.weight_only)
          in = {tensor(a, sA, tA, 2, rlh::sdk::kBF16), tensor(b, sB, tB, 2, rlh::sdk::kE4M3),
                tensor(dsb, nsb, unit, 1, rlh::sdk::kF32)};
        else
          in = {tensor(aq, sA, tA, 2, rlh::sdk::kE4M3), tensor(b, sB, tB, 2, rlh::sdk::kE4M3),
                tensor(dsa, nsa, unit, 1, rlh::sdk::kF32), tensor(dsb, nsb, unit, 1, rlh::sdk::kF32)};
        const double us = timed(d, ws, in, {out[0]},
                                {rlh::sdk::attr_int("transpose_b", 1), rlh::sdk::attr_int("scaling", f.scaling),
                                 rlh::sdk::attr_int("few_rows", f.few_rows)},
                                {rlh::sdk::attr_int("fast_accum", f.fast), rlh::sdk::attr_int("autotune", f.autotune)},
                                "gemm", f.name, bs);
        std::snprintf(buf, sizeof buf, " %s_us=%.2f", f.name, us);
        line += buf;
        if ((f.weight_only || f.few_rows || f.scaling == 1) && us > 0) {  // the weights' bytes a second
          std::snprintf(buf, sizeof buf, " %s_GBs=%.0f", f.name, double(N * K) / (us * 1e-6) / 1e9);
          line += buf;
        }
      }
      // The activation's quantisation a form needs: 0 one scale (amax, then the codes), 1 a scale
      // per 1x128 tile, 3 a scale per row. (Once per product input: q|k|v and gate|up share one.)
      for (const int grouping : {0, 1, 3}) {
        const int64_t ns = grouping == 3 ? M : grouping == 1 ? kb * M : 1;
        const int64_t nss[1] = {ns};
        const double us = timed(d, ws, {tensor(a, sA, tA, 2, rlh::sdk::kBF16)},
                                {tensor(aq, sA, tA, 2, rlh::sdk::kE4M3), tensor(dsa, nss, unit, 1, rlh::sdk::kF32)},
                                {rlh::sdk::attr_int("grouping", grouping)}, {}, "quantize_fp8",
                                "quantize grouping " + std::to_string(grouping));
        std::snprintf(buf, sizeof buf, " quant%d_us=%.2f", grouping, us);
        line += buf;
      }
      if (bf16 != nullptr) {
        void* bb = bf16->alloc(size_t(N * K) * 2);
        void* ab = bf16->alloc(size_t(M * K) * 2);
        void* cb = bf16->alloc(size_t(M * N) * 2);
        std::vector<uint16_t> wb(size_t(N * K));
        const std::vector<uint8_t> wc = normal_fp8(size_t(N * K), 3);
        for (size_t i = 0; i < wb.size(); ++i) wb[i] = uint16_t(0x3c00 | (wc[i] & 0x7f) | ((wc[i] & 0x80) << 8));
        bf16->put(bb, wb.data(), wb.size() * 2);
        const std::vector<void*> bbs = bf16->copies_of(bb, size_t(N * K) * 2, cold_bytes);
        bf16->put(ab, abf.data(), abf.size() * 2);
        void* wsb = bf16->alloc(size_t(32) << 20);
        const double us = timed(*bf16, wsb,
                                {tensor(ab, sA, tA, 2, rlh::sdk::kBF16), tensor(bb, sB, tB, 2, rlh::sdk::kBF16)},
                                {tensor(cb, sC, tC, 2, rlh::sdk::kBF16)}, {rlh::sdk::attr_int("transpose_b", 1)}, {},
                                "gemm", "bf16", bbs);
        std::snprintf(buf, sizeof buf, " bf16_us=%.2f", us);
        line += buf;
        bf16->free_copies(bbs);
        for (void* p : {bb, ab, cb, wsb}) bf16->api->memory_free(bf16->k, p);
      }
      std::printf("%s\n", line.c_str());
      d.free_copies(bs);
      for (void* p : {a, aq, b, c, dsa, dsb, ws}) d.api->memory_free(d.k, p);
    }
  }
}

// The kernel provider of the plugin at `path` (loaded for the process's life), or null with the
// reason printed.
const rlh_kernels_api* kernel_provider(const char* path) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    std::fprintf(stderr, "bench_fp8_gemm: %s\n", dlerror());
    return nullptr;
  }
  auto entry = reinterpret_cast<rlh_plugin_entry_fn>(dlsym(lib, RLH_PLUGIN_ENTRY_SYMBOL));
  const rlh_plugin_desc* desc = entry ? entry(RLH_ABI_VERSION_MAJOR, RLH_ABI_VERSION_MINOR) : nullptr;
  for (size_t i = 0; desc && i < desc->num_components; ++i)
    if (desc->components[i]->kind == RLH_KIND_KERNELS) return static_cast<const rlh_kernels_api*>(desc->components[i]->api);
  std::fprintf(stderr, "bench_fp8_gemm: %s has no kernel provider\n", path);
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: bench_fp8_gemm PLUGIN.so [--m M --n N --k K --reps R --rounds N --data normal|uniform] | --decode 1 [--cold 1] [--bf16 PLUGIN.so]\n");
    return 2;
  }
  int64_t M = 8192, N = 8192, K = 8192;
  int reps = 50, rounds = 5;
  bool uniform = false;
  bool decode = false, cold = false;
  const char* bf16_plugin = nullptr;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const long long v = std::atoll(argv[i + 1]);
    if (a == "--bf16") {
      bf16_plugin = argv[i + 1];
    } else if (a == "--data") {
      if (std::strcmp(argv[i + 1], "normal") != 0 && std::strcmp(argv[i + 1], "uniform") != 0) {
        std::fprintf(stderr, "bench_fp8_gemm: --data takes normal or uniform, not %s\n", argv[i + 1]);
        return 2;
      }
      uniform = std::strcmp(argv[i + 1], "uniform") == 0;
    } else if (a == "--decode") decode = v != 0;
    else if (a == "--cold") cold = v != 0;
    else if (a == "--m") M = v;
    else if (a == "--n") N = v;
    else if (a == "--k") K = v;
    else if (a == "--reps") reps = int(v);
    else if (a == "--rounds") rounds = int(v);
    else {
      std::fprintf(stderr, "bench_fp8_gemm: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (reps < 1 || rounds < 1) {
    std::fprintf(stderr, "bench_fp8_gemm: --reps and --rounds must be at least 1\n");
    return 2;
  }
  const rlh_kernels_api* api = kernel_provider(argv[1]);
  const rlh_kernels_api* bf16_api = bf16_plugin ? kernel_provider(bf16_plugin) : nullptr;
  if (!api || (bf16_plugin && !bf16_api)) return 1;
  try {
    rlh_kernels* k = nullptr;
    check(api->create(nullptr, rlh::sdk::cuda_device(0), "{}", 2, &k), "create on cuda:0");
    Dev d{api, k};
    if (decode) {
      Dev b16{bf16_api, nullptr};
      if (bf16_api) check(bf16_api->create(nullptr, rlh::sdk::cuda_device(0), "{}", 2, &b16.k), "create the bf16 provider");
      decode_products(d, bf16_api ? &b16 : nullptr, reps, cold);
      if (bf16_api) bf16_api->destroy(b16.k);
      api->destroy(k);
      return 0;
    }
    const int64_t kb = (K + 127) / 128, kb4 = (kb + 3) / 4 * 4;
    void* a = d.alloc(size_t(M * K));
    void* b = d.alloc(size_t(N * K));
    void* c = d.alloc(size_t(M * N) * 2);
    d.put(a, (uniform ? uniform_fp8 : normal_fp8)(size_t(M * K), 1).data(), size_t(M * K));
    d.put(b, (uniform ? uniform_fp8 : normal_fp8)(size_t(N * K), 2).data(), size_t(N * K));
    const int64_t na = kb * M, nb = ((N + 127) / 128) * kb4;
    std::vector<float> sa(size_t(na), 1.0f / 64), sb(size_t(nb), 1.0f / 64);
    void* dsa = d.alloc(size_t(na) * 4);
    void* dsb = d.alloc(size_t(nb) * 4);
    d.put(dsa, sa.data(), sa.size() * 4);
    d.put(dsb, sb.data(), sb.size() * 4);
    void* ws = d.alloc(size_t(32) << 20);
    const int64_t sA[2] = {M, K}, tA[2] = {K, 1}, sB[2] = {N, K}, tB[2] = {K, 1}, sC[2] = {M, N}, tC[2] = {N, 1};
    // (scaling, fast accumulation): per-tensor scales with cuBLASLt's fp32 promotion and with fast
    // accumulation (torch's use_fast_accum, TransformerEngine's forward default), then block scales.
    for (const auto& [scaling, fast] : {std::pair{0, 0}, std::pair{0, 1}, std::pair{1, 0}}) {
      const int64_t nsa[1] = {scaling ? na : 1}, nsb[1] = {scaling ? nb : 1}, unit[1] = {1};
      const rlh_tensor in[4] = {tensor(a, sA, tA, 2, rlh::sdk::kE4M3), tensor(b, sB, tB, 2, rlh::sdk::kE4M3),
                                tensor(dsa, nsa, unit, 1, rlh::sdk::kF32), tensor(dsb, nsb, unit, 1, rlh::sdk::kF32)};
      const rlh_tensor out[1] = {tensor(c, sC, tC, 2, rlh::sdk::kBF16)};
      const rlh_named_value attrs[2] = {rlh::sdk::attr_int("transpose_b", 1), rlh::sdk::attr_int("scaling", scaling)};
      rlh_op* op = nullptr;
      check(resolve_op(d, "gemm", in, 4, out, 1, attrs, 2, &op), "resolve gemm");
      rlh_op_call call{};
      call.struct_size = sizeof call;
      call.inputs = in;
      call.num_inputs = 4;
      call.outputs = out;
      call.num_outputs = 1;
      call.workspace = ws;
      call.workspace_bytes = size_t(32) << 20;
      const rlh_named_value call_attrs[1] = {rlh::sdk::attr_int("fast_accum", fast)};
      call.attrs = call_attrs;
      call.num_attrs = 1;
      const double t = time_calls(d, op, {call}, reps, rounds);
      const char* name = scaling ? "fp8_gemm_block" : fast ? "fp8_gemm_tensor_fast_accum" : "fp8_gemm_tensor";
      std::printf("RESULT impl=rlhost name=%s%s shape=%lldx%lldx%lld value=%.1f unit=TFLOP/s ms=%.4f\n",
                  uniform ? "uniform_" : "", name, (long long)M, (long long)N, (long long)K,
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
