// A kernel provider for the registry tests: it answers `gemm` in float32 on the CPU and nothing
// else, so every other op falls through to the next provider. Its GEMM is OpenBLAS's sgemm on
// the whole problem, which is what kernels_cpu runs on one thread, so an engine on one thread
// gives bit for bit the same results with or without it. RLH_TEST_PROVIDER_MODE makes it
// misbehave for the error tests: "resolve_fails" (get_op fails with INTERNAL), "run_fails"
// (run fails). Probe score 5: ahead of kernels_cpu (1).
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "rlhost/kernels.h"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/plugin.hpp"

struct rlh_kernels {
  std::string mode;
};
struct rlh_op {
  bool ta = false, tb = false;
  double alpha = 1, beta = 0;
  std::string mode;
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

bool is_f32_cpu_matrix(const rlh_tensor& t) {
  return t.dtype.code == RLH_DTYPE_FLOAT && t.dtype.bits == 32 && t.device.device_type == RLH_DEVICE_CPU &&
         t.ndim == 2;
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
void destroy(rlh_kernels* k) { delete k; }

rlh_status* list_ops(rlh_kernels*, rlh_write_fn write, void* user) {
  static const char kOps[] = "[{\"name\":\"gemm\",\"dtypes\":[\"f32\"],\"backward\":\"gemm\"}]";
  write(user, kOps, sizeof(kOps) - 1);
  return nullptr;
}

rlh_status* get_op(rlh_kernels* k, const rlh_op_desc* d, rlh_op** out) {
  return rlh::sdk::guard(g_make, [&] {
    if (d->name == nullptr || std::strcmp(d->name, "gemm") != 0)
      throw Error(RLH_E_UNIMPLEMENTED, "test provider offers gemm only");
    if (d->num_inputs != 2 || d->num_outputs != 1 || !is_f32_cpu_matrix(d->inputs[0]) ||
        !is_f32_cpu_matrix(d->inputs[1]) || !is_f32_cpu_matrix(d->outputs[0]))
      throw Error(RLH_E_UNIMPLEMENTED, "test provider: 2-D float32 host gemm only");
    if (k->mode == "resolve_fails") throw Error(RLH_E_INTERNAL, "planted failure at resolve");
    auto op = std::make_unique<rlh_op>();
    op->mode = k->mode;
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
    using rlh::sdk::attr_double_or;
    using rlh::sdk::attr_int_or;
    const bool ta = attr_int_or(c->attrs, c->num_attrs, "transpose_a", 0) != 0;
    const bool tb = attr_int_or(c->attrs, c->num_attrs, "transpose_b", 0) != 0;
    const float alpha = float(attr_double_or(c->attrs, c->num_attrs, "alpha", 1));
    const float beta = float(attr_double_or(c->attrs, c->num_attrs, "beta", 0));
    const rlh_tensor &A = c->inputs[0], &B = c->inputs[1], &C = c->outputs[0];
    const int M = int(C.shape[0]), N = int(C.shape[1]), K = int(ta ? A.shape[0] : A.shape[1]);
    auto ld = [](const rlh_tensor& t) { return int(t.shape[0] > 1 ? t.strides[0] : t.shape[1]); };
    sgemm()(101, ta ? 112 : 111, tb ? 112 : 111, M, N, K, alpha, rlh::sdk::tensor_data<float>(A), ld(A),
            rlh::sdk::tensor_data<float>(B), ld(B), beta, rlh::sdk::tensor_data<float>(C), ld(C));
  });
}

void release_op(rlh_op* op) { delete op; }

rlh_status* provider_info(rlh_kernels*, rlh_write_fn write, void* user) {
  static const char kInfo[] = "{\"reference\":false,\"memory\":\"host\"}";
  write(user, kInfo, sizeof(kInfo) - 1);
  return nullptr;
}

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
