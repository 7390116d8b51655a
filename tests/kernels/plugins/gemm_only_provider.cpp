// A kernel provider for the registry and conformance tests: it answers `gemm` on the CPU and
// nothing else, so every other op falls through to the next provider. Its float32 GEMM is
// OpenBLAS's sgemm on the whole problem, which is what kernels_cpu runs on one thread, so an
// engine on one thread gives bit for bit the same results with or without it. It also offers an
// FP8 GEMM (e4m3 A and B, each with its float32 scale appended to the inputs as docs/ops.md
// says, C float32), so the conformance runner's fp8 path has a provider to check, its
// weight-only form (A bf16, B e4m3 with B's scale: the runner's bf16xe4m3 variant), and a bf16
// GEMM that writes its C only in float32 (it lists bf16 but takes the bf16+f32 form alone, as
// cuDNN's attention takes its lse only in float32).
// RLH_TEST_PROVIDER_MODE makes it misbehave for the error tests: "resolve_fails" (get_op fails
// with INTERNAL), "run_fails" (run fails), "wrong" (its GEMM ignores beta: wrong results where
// C is accumulated into). "device_memory" makes it say its operands live in "device" memory
// (provider_info) that only its memory services hand out (host memory it tracks), and refuse
// to run on any other pointer: the conformance runner's staging path, checked without a GPU.
// Probe score 5: ahead of kernels_cpu (1).
#include <dlfcn.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "rlhost/kernels.h"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/plugin.hpp"

struct rlh_kernels {
  std::string mode;
  std::mutex mu;
  std::map<const char*, size_t> blocks;  // memory_alloc's blocks: start -> bytes
  // Whether [p, p + bytes) lies inside one of the blocks.
  bool owns(const void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu);
    const char* c = static_cast<const char*>(p);
    auto it = blocks.upper_bound(c);
    if (it == blocks.begin()) return false;
    --it;
    return c + bytes <= it->first + it->second;
  }
};
struct rlh_op {
  bool ta = false, tb = false;  // the desc's attributes: defaults a call's attributes override
  double alpha = 1, beta = 0;
  bool fp8 = false, bf16 = false, w8 = false;  // w8: A bf16 x B e4m3 (weight-only)
  std::string mode;
  rlh_kernels* k = nullptr;
};

namespace {

using rlh::sdk::Error;
rlh::sdk::MakeStatusFn g_make = nullptr;

using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                       float, float*, int);
Sgemm sgemm() {
  static Sgemm f = [] {
    void* h = dlopen("libopenblas.so.0", RTLD_NOW | RTLD_LOCAL);
    return h ? reinterpret_cast<Sgemm>(dlsym(h, "cblas_sgemm")) : nullptr;
  }();
  if (!f) throw Error(RLH_E_UNAVAILABLE, "test provider: no OpenBLAS");
  return f;
}

bool is_cpu_matrix(const rlh_tensor& t, int32_t code, int bits) {
  return t.dtype.code == code && t.dtype.bits == bits && t.device.device_type == RLH_DEVICE_CPU && t.ndim == 2;
}
bool is_f32_cpu_matrix(const rlh_tensor& t) { return is_cpu_matrix(t, RLH_DTYPE_FLOAT, 32); }
bool is_e4m3_cpu_matrix(const rlh_tensor& t) { return is_cpu_matrix(t, RLH_DTYPE_FLOAT8_E4M3FN, 8); }
bool is_bf16_cpu_matrix(const rlh_tensor& t) { return is_cpu_matrix(t, RLH_DTYPE_BFLOAT, 16); }
bool is_f32_scale(const rlh_tensor& t) {
  return t.dtype.code == RLH_DTYPE_FLOAT && t.dtype.bits == 32 && t.device.device_type == RLH_DEVICE_CPU &&
         rlh::sdk::tensor_numel(t) == 1;
}

// OCP FP8 e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN.
float e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return NAN;
  const float v = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
  return (b & 0x80) ? -v : v;
}

// A [rows, cols] bf16 matrix (row stride ld) as float32 with the same ld.
std::vector<float> widen_bf16(const rlh_tensor& t) {
  const int64_t rows = t.shape[0], cols = t.shape[1], ld = rows > 1 ? t.strides[0] : cols;
  std::vector<float> out(size_t((rows - 1) * ld + cols), 0.f);
  const uint16_t* p = rlh::sdk::tensor_data<uint16_t>(t);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const uint32_t bits = uint32_t(p[r * ld + c]) << 16;
      std::memcpy(&out[size_t(r * ld + c)], &bits, 4);
    }
  return out;
}

// A [rows, cols] e4m3 matrix (row stride ld) times its scale, as float32 with the same ld.
std::vector<float> dequantize(const rlh_tensor& t, const rlh_tensor& scale) {
  const int64_t rows = t.shape[0], cols = t.shape[1], ld = rows > 1 ? t.strides[0] : cols;
  const float s = *rlh::sdk::tensor_data<float>(scale);
  std::vector<float> out(size_t((rows - 1) * ld + cols), 0.f);
  const uint8_t* p = rlh::sdk::tensor_data<uint8_t>(t);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[size_t(r * ld + c)] = e4m3_value(p[r * ld + c]) * s;
  return out;
}

rlh_status* create(const rlh_host_api* host, rlh_device device, const char*, size_t, rlh_kernels** out) {
  g_make = host ? host->make_status : nullptr;
  return rlh::sdk::guard(g_make, [&] {
    if (device.device_type != RLH_DEVICE_CPU) throw Error(RLH_E_UNIMPLEMENTED, "test provider: CPU only");
    auto k = std::make_unique<rlh_kernels>();
    const char* m = std::getenv("RLH_TEST_PROVIDER_MODE");
    k->mode = m ? m : "";
    *out = k.release();
  });
}
void destroy(rlh_kernels* k) {
  for (auto& [p, bytes] : k->blocks) std::free(const_cast<char*>(p));  // what a caller leaked
  delete k;
}

rlh_status* list_ops(rlh_kernels*, rlh_write_fn write, void* user) {
  static const char kOps[] = "[{\"name\":\"gemm\",\"dtypes\":[\"f32\",\"bf16\",\"e4m3\"],\"backward\":\"gemm\"}]";
  write(user, kOps, sizeof(kOps) - 1);
  return nullptr;
}

rlh_status* get_op(rlh_kernels* k, const rlh_op_desc* d, rlh_op** out) {
  return rlh::sdk::guard(g_make, [&] {
    if (d->name == nullptr || std::strcmp(d->name, "gemm") != 0)
      throw Error(RLH_E_UNIMPLEMENTED, "test provider offers gemm only");
    const bool f32 = d->num_inputs == 2 && d->num_outputs == 1 && is_f32_cpu_matrix(d->inputs[0]) &&
                     is_f32_cpu_matrix(d->inputs[1]) && is_f32_cpu_matrix(d->outputs[0]);
    const bool fp8 = d->num_inputs == 4 && d->num_outputs == 1 && is_e4m3_cpu_matrix(d->inputs[0]) &&
                     is_e4m3_cpu_matrix(d->inputs[1]) && is_f32_scale(d->inputs[2]) && is_f32_scale(d->inputs[3]) &&
                     is_f32_cpu_matrix(d->outputs[0]);
    const bool bf16 = d->num_inputs == 2 && d->num_outputs == 1 && is_bf16_cpu_matrix(d->inputs[0]) &&
                      is_bf16_cpu_matrix(d->inputs[1]) && is_f32_cpu_matrix(d->outputs[0]);
    const bool w8 = d->num_inputs == 3 && d->num_outputs == 1 && is_bf16_cpu_matrix(d->inputs[0]) &&
                    is_e4m3_cpu_matrix(d->inputs[1]) && is_f32_scale(d->inputs[2]) && is_f32_cpu_matrix(d->outputs[0]);
    if (!f32 && !fp8 && !bf16 && !w8)
      throw Error(RLH_E_UNIMPLEMENTED,
                  "test provider: 2-D float32, bf16 into float32, e4m3 with scales into float32 or bf16 x e4m3 "
                  "into float32, host gemm only");
    if (k->mode == "resolve_fails") throw Error(RLH_E_INTERNAL, "planted failure at resolve");
    auto op = std::make_unique<rlh_op>();
    op->mode = k->mode;
    op->fp8 = fp8;
    op->bf16 = bf16;
    op->w8 = w8;
    op->k = k;
    using rlh::sdk::attr_double_or;
    using rlh::sdk::attr_int_or;
    op->ta = attr_int_or(d->attrs, d->num_attrs, "transpose_a", 0) != 0;
    op->tb = attr_int_or(d->attrs, d->num_attrs, "transpose_b", 0) != 0;
    op->alpha = attr_double_or(d->attrs, d->num_attrs, "alpha", 1);
    op->beta = attr_double_or(d->attrs, d->num_attrs, "beta", 0);
    *out = op.release();
  });
}

rlh_status* op_info(rlh_op*, rlh_op_info* out) {
  rlh_op_info i{};
  i.struct_size = out->struct_size;
  i.deterministic = 1;
  std::memcpy(out, &i, std::min(out->struct_size, sizeof(i)));
  return nullptr;
}

rlh_status* run(rlh_op* op, const rlh_op_call* c) {
  return rlh::sdk::guard(g_make, [&] {
    if (op->mode == "run_fails") throw Error(RLH_E_INTERNAL, "planted failure at run");
    if (op->mode == "device_memory")
      for (const rlh_tensor* list : {c->inputs, c->outputs})
        for (size_t i = 0; i < (list == c->inputs ? c->num_inputs : c->num_outputs); ++i)
          if (!op->k->owns(list[i].data, 1))
            throw Error(RLH_E_INVALID_ARGUMENT, "test provider: an operand is not in memory from memory_alloc");
    using rlh::sdk::attr_double_or;
    using rlh::sdk::attr_int_or;
    const bool ta = attr_int_or(c->attrs, c->num_attrs, "transpose_a", op->ta) != 0;
    const bool tb = attr_int_or(c->attrs, c->num_attrs, "transpose_b", op->tb) != 0;
    const float alpha = float(attr_double_or(c->attrs, c->num_attrs, "alpha", op->alpha));
    float beta = float(attr_double_or(c->attrs, c->num_attrs, "beta", op->beta));
    if (op->mode == "wrong") beta = 0;  // the planted bug: C is overwritten, not accumulated into
    const rlh_tensor &A = c->inputs[0], &B = c->inputs[1], &C = c->outputs[0];
    const int M = int(C.shape[0]), N = int(C.shape[1]), K = int(ta ? A.shape[0] : A.shape[1]);
    auto ld = [](const rlh_tensor& t) { return int(t.shape[0] > 1 ? t.strides[0] : t.shape[1]); };
    std::vector<float> a8, b8;
    const float* a = rlh::sdk::tensor_data<float>(A);
    const float* b = rlh::sdk::tensor_data<float>(B);
    if (op->fp8) {
      a8 = dequantize(A, c->inputs[2]);
      b8 = dequantize(B, c->inputs[3]);
      a = a8.data();
      b = b8.data();
    } else if (op->w8) {
      a8 = widen_bf16(A);
      b8 = dequantize(B, c->inputs[2]);
      a = a8.data();
      b = b8.data();
    } else if (op->bf16) {
      a8 = widen_bf16(A);
      b8 = widen_bf16(B);
      a = a8.data();
      b = b8.data();
    }
    sgemm()(101, ta ? 112 : 111, tb ? 112 : 111, M, N, K, alpha, a, ld(A), b, ld(B), beta,
            rlh::sdk::tensor_data<float>(C), ld(C));
  });
}

void release_op(rlh_op* op) { delete op; }

rlh_status* provider_info(rlh_kernels* k, rlh_write_fn write, void* user) {
  const std::string info = std::string("{\"reference\":false,\"memory\":\"") +
                           (k->mode == "device_memory" ? "device" : "host") + "\"}";
  write(user, info.data(), info.size());
  return nullptr;
}

rlh_status* memory_alloc(rlh_kernels* k, size_t bytes, void** out) {
  return rlh::sdk::guard(g_make, [&] {
    char* p = static_cast<char*>(std::aligned_alloc(256, (bytes + 255) / 256 * 256));
    if (!p) throw Error(RLH_E_RESOURCE_EXHAUSTED, "test provider: out of memory");
    std::lock_guard<std::mutex> lock(k->mu);
    k->blocks[p] = bytes;
    *out = p;
  });
}
void memory_free(rlh_kernels* k, void* p) {
  std::lock_guard<std::mutex> lock(k->mu);
  if (k->blocks.erase(static_cast<char*>(p))) std::free(p);
}
rlh_status* memory_copy(rlh_kernels* k, void* dst, const void* src, size_t bytes, int32_t dir, void*) {
  return rlh::sdk::guard(g_make, [&] {
    const bool to_dev = dir == RLH_COPY_HOST_TO_DEVICE || dir == RLH_COPY_DEVICE_TO_DEVICE;
    const bool from_dev = dir == RLH_COPY_DEVICE_TO_HOST || dir == RLH_COPY_DEVICE_TO_DEVICE;
    if (!to_dev && !from_dev) throw Error(RLH_E_INVALID_ARGUMENT, "memory_copy: unknown direction");
    if ((to_dev && !k->owns(dst, bytes)) || (from_dev && !k->owns(src, bytes)))
      throw Error(RLH_E_INVALID_ARGUMENT, "memory_copy: the device side is not memory from memory_alloc");
    std::memcpy(dst, src, bytes);
  });
}
rlh_status* synchronize(rlh_kernels*, void*) { return nullptr; }

const rlh_kernels_api kApi = [] {
  rlh_kernels_api a{};
  a.struct_size = RLH_STRUCT_SIZE(rlh_kernels_api, workspace_size);
  a.create = create;
  a.destroy = destroy;
  a.list_ops = list_ops;
  a.get_op = get_op;
  a.op_info = op_info;
  a.run = run;
  a.release_op = release_op;
  a.provider_info = provider_info;
  a.memory_alloc = memory_alloc;
  a.memory_free = memory_free;
  a.memory_copy = memory_copy;
  a.synchronize = synchronize;
  return a;
}();

rlh_status* probe(const rlh_host_api*, int32_t* score, rlh_write_fn, void*) {
  *score = 5;
  return nullptr;
}

const rlh_component_desc kComponent =
    rlh::sdk::component_desc(RLH_KIND_KERNELS, "test_gemm_provider", "0.1.0", RLH_KERNELS_API_VERSION_MAJOR,
                             RLH_KERNELS_API_VERSION_MINOR, &kApi, "float32 CPU gemm only (registry tests)");
const rlh_component_desc* const kComponents[] = {&kComponent};

rlh_plugin_desc make_desc() {
  rlh_plugin_desc d = rlh::sdk::plugin_desc("test_gemm_provider", "0.1.0", "rlhost tests", kComponents,
                                            "a kernel provider that answers gemm only");
  d.probe = probe;
  return d;
}

}  // namespace

RLH_DEFINE_PLUGIN(make_desc());
