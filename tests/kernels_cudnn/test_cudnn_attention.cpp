// kernels_cudnn's attention on a GPU, through the C ABI, as the registry and the engines call it:
// against kernels_cpu's float64 attention (the oracle, on the same bf16-rounded inputs) and
// against kernels_cuda's, forward and backward, on packed sequences of uneven lengths (with
// length 1 and empty ones), GQA 4/2 and 32/8, head dims 64 and 128, windows 0 and 16, q|k|v read
// out of one fused buffer with padded rows and written back into one (the padding must stay
// untouched), with and without a caller workspace. Also: the registry puts kernels_cudnn first
// for attention (and kernels_cuda for the rest), a pin moves attention back, refusals are
// answers (UNIMPLEMENTED) that fall through, and the forward is bitwise repeatable.
// Skips, with the reason, where there is no CUDA device; fails where there is one but
// kernels_cudnn cannot be created (no usable cuDNN: the message says where it looked).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "../kernels_cuda/cuda_test_util.hpp"
#include "rlhost/host.h"
#include "rlhost/kernels.h"
#include "rlhost/sdk/kernel_registry.hpp"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/plugin.hpp"
#include "rlhost/sdk/status.hpp"

namespace {

using rlh::kcuda::testing::bf2f;
using rlh::kcuda::testing::cuda_unavailable;
using rlh::kcuda::testing::DevBuf;
using rlh::kcuda::testing::f2bf;
using rlh::kcuda::testing::round_bf16;
namespace sdk = rlh::sdk;

// The three providers, loaded by a host from the build's plugin folder (RLH_TEST_PLUGIN_DIR where
// the binaries were carried to a GPU machine), one instance each.
struct Providers {
  rlhost_t* host = nullptr;
  const rlh_host_api* svc = nullptr;
  const rlh_kernels_api *cudnn = nullptr, *cuda = nullptr, *cpu = nullptr;
  rlh_kernels *i_cudnn = nullptr, *i_cuda = nullptr, *i_cpu = nullptr;
  std::string error;  // why kernels_cudnn (or another) is missing

  Providers() {
    sdk::check(rlhost_create(&host));
    rlhost_set_log_level(host, RLH_LOG_WARN);
    const char* dir = std::getenv("RLH_TEST_PLUGIN_DIR");
    sdk::check(rlhost_add_plugin_dir(host, dir && *dir ? dir : RLH_PLUGIN_DIR));
    svc = rlhost_services(host);
    cudnn = make("kernels_cudnn", sdk::cuda_device(0), &i_cudnn);
    cuda = make("kernels_cuda", sdk::cuda_device(0), &i_cuda);
    cpu = make("kernels_cpu", sdk::kCPU, &i_cpu);
  }
  const rlh_kernels_api* make(const char* name, rlh_device dev, rlh_kernels** inst) {
    try {
      sdk::check(rlhost_load_plugin(host, name));
      const rlh_component_desc* d = nullptr;
      sdk::check(svc->find_component(svc->ctx, RLH_KIND_KERNELS, name, &d));
      auto* api = static_cast<const rlh_kernels_api*>(d->api);
      sdk::check(api->create(svc, dev, "{}", 2, inst));
      return api;
    } catch (const std::exception& e) {
      error += std::string(error.empty() ? "" : "; ") + name + ": " + e.what();
      return nullptr;
    }
  }
};

Providers& providers() {
  static Providers* p = new Providers();  // for the whole process
  return *p;
}

#define REQUIRE_PROVIDERS()                                                                    \
  do {                                                                                         \
    const std::string why_ = cuda_unavailable();                                               \
    if (!why_.empty()) GTEST_SKIP() << "no CUDA device: " << why_;                             \
    if (!providers().cudnn || !providers().cuda || !providers().cpu)                           \
      FAIL() << "a CUDA device is here but a provider could not be created: " << providers().error; \
  } while (0)

// Operand descriptors whose shape/stride arrays stay alive as long as the list.
struct Operands {
  struct Slot {
    int64_t shape[3], strides[3];
  };
  std::deque<Slot> slots;
  std::vector<rlh_tensor> in, out;
  rlh_tensor make(void* p, rlh_dtype dt, rlh_device dev, std::initializer_list<int64_t> shape,
                  std::initializer_list<int64_t> strides) {
    Slot& s = slots.emplace_back();
    std::copy(shape.begin(), shape.end(), s.shape);
    std::copy(strides.begin(), strides.end(), s.strides);
    rlh_tensor t{};
    t.data = p;
    t.device = dev;
    t.dtype = dt;
    t.ndim = int32_t(shape.size());
    t.shape = s.shape;
    t.strides = s.strides;
    return t;
  }
  rlh_tensor heads(void* p, rlh_dtype dt, rlh_device dev, int64_t N, int64_t H, int64_t D, int64_t ld) {
    return make(p, dt, dev, {N, H, D}, {ld, D, 1});
  }
  rlh_tensor vec(void* p, rlh_dtype dt, rlh_device dev, int64_t n) { return make(p, dt, dev, {n}, {1}); }
};

// Resolves and runs one op; "" or the error. `ws_query`: pass the workspace the provider asks for.
std::string run_op(const rlh_kernels_api* api, rlh_kernels* inst, const char* name, rlh_device dev,
                   const std::vector<rlh_tensor>& in, const std::vector<rlh_tensor>& out,
                   const std::vector<rlh_named_value>& attrs, bool ws_query = false) {
  rlh_op_desc d{};
  d.struct_size = RLH_STRUCT_SIZE(rlh_op_desc, num_attrs);
  d.name = name;
  d.device = dev;
  d.inputs = in.data();
  d.num_inputs = in.size();
  d.outputs = out.data();
  d.num_outputs = out.size();
  d.shapes_valid = 1;
  d.attrs = attrs.data();
  d.num_attrs = attrs.size();
  rlh_op* op = nullptr;
  if (rlh_status* s = api->get_op(inst, &d, &op)) {
    sdk::StatusPtr owned(s);
    return "resolve: " + sdk::status_message(s);
  }
  rlh_op_call c{};
  c.struct_size = RLH_STRUCT_SIZE(rlh_op_call, workspace_bytes);
  c.inputs = in.data();
  c.num_inputs = in.size();
  c.outputs = out.data();
  c.num_outputs = out.size();
  c.attrs = attrs.data();
  c.num_attrs = attrs.size();
  DevBuf ws;
  if (ws_query && api->workspace_size) {
    size_t bytes = 0;
    if (rlh_status* s = api->workspace_size(op, &c, &bytes)) {
      sdk::StatusPtr owned(s);
      api->release_op(op);
      return "workspace_size: " + sdk::status_message(s);
    }
    std::printf("  %s workspace: %.1f MiB\n", name, double(bytes) / (1 << 20));
    ws = DevBuf((bytes + 3) / 4, false);
    c.workspace = ws.get();
    c.workspace_bytes = bytes;
  }
  std::string err;
  if (rlh_status* s = api->run(op, &c)) {
    sdk::StatusPtr owned(s);
    err = "run: " + sdk::status_message(s);
  }
  api->release_op(op);
  if (dev.device_type == RLH_DEVICE_CUDA) {
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess && err.empty()) err = std::string("after the run: ") + cudaGetErrorString(e);
  }
  return err;
}

struct Case {
  const char* name;
  std::vector<int> lens;  // sequence lengths (0: an empty sequence)
  int64_t Hq, Hkv, D, window;
  bool fused;  // q|k|v in one buffer with padded rows (else three contiguous buffers)
  bool workspace;
};

// One provider's device buffers of a case: fused q|k|v (or q, k, v), o, lse, and the gradients
// laid out like the inputs.
struct DeviceSet {
  DevBuf qkv, q, k, v, o, lse, dout, dqkv, dq, dk, dv;
};

constexpr float kSentinel = 7.0f;  // bf16-exact: padding columns must keep it

struct Outputs {
  // Host copies (floats) of what one provider computed, in the case's layouts.
  std::vector<float> o, lse, dqkv, dq, dk, dv;
  std::string error;
};

struct Layout {
  int64_t N = 0, S = 0, W = 0, ldq = 0, ldk = 0, ldv = 0;
  int64_t qoff = 0, koff = 0, voff = 0;  // columns in the fused buffer
  std::vector<int32_t> cu;
};

Layout layout_of(const Case& c) {
  Layout L;
  L.cu.push_back(0);
  for (int n : c.lens) L.cu.push_back(L.cu.back() + n);
  L.N = L.cu.back();
  L.S = int64_t(c.lens.size());
  if (c.fused) {
    L.W = (c.Hq + 2 * c.Hkv) * c.D + 8;  // 8 padding columns per row
    L.ldq = L.ldk = L.ldv = L.W;
    L.qoff = 0, L.koff = c.Hq * c.D, L.voff = (c.Hq + c.Hkv) * c.D;
  } else {
    L.ldq = c.Hq * c.D, L.ldk = L.ldv = c.Hkv * c.D;
  }
  return L;
}

// Runs forward then backward of `api` (a device provider) on the case's inputs.
Outputs run_device(const rlh_kernels_api* api, rlh_kernels* inst, const Case& c, const Layout& L,
               const std::vector<float>& qkv, const std::vector<float>& q, const std::vector<float>& k,
               const std::vector<float>& v, const std::vector<float>& dout) {
  Outputs r;
  const rlh_device dev = sdk::cuda_device(0);
  const int64_t N = L.N, Hq = c.Hq, Hkv = c.Hkv, D = c.D;
  DeviceSet s;
  DevBuf cu(size_t(L.S + 1), false);
  cudaMemcpy(cu.get(), L.cu.data(), L.cu.size() * 4, cudaMemcpyHostToDevice);
  auto nan_fill = [](size_t n) { return std::vector<float>(n, NAN); };
  char *qp, *kp, *vp, *dqp, *dkp, *dvp;
  if (c.fused) {
    s.qkv = DevBuf(size_t(N * L.W), true);
    s.qkv.upload(qkv);
    s.dqkv = DevBuf(size_t(N * L.W), true);
    std::vector<float> init(size_t(N * L.W), kSentinel);
    s.dqkv.upload(init);
    qp = static_cast<char*>(s.qkv.get()) + 2 * L.qoff;
    kp = static_cast<char*>(s.qkv.get()) + 2 * L.koff;
    vp = static_cast<char*>(s.qkv.get()) + 2 * L.voff;
    dqp = static_cast<char*>(s.dqkv.get()) + 2 * L.qoff;
    dkp = static_cast<char*>(s.dqkv.get()) + 2 * L.koff;
    dvp = static_cast<char*>(s.dqkv.get()) + 2 * L.voff;
  } else {
    s.q = DevBuf(q.size(), true), s.k = DevBuf(k.size(), true), s.v = DevBuf(v.size(), true);
    s.q.upload(q), s.k.upload(k), s.v.upload(v);
    s.dq = DevBuf(q.size(), true), s.dk = DevBuf(k.size(), true), s.dv = DevBuf(v.size(), true);
    s.dq.upload(nan_fill(q.size())), s.dk.upload(nan_fill(k.size())), s.dv.upload(nan_fill(v.size()));
    qp = static_cast<char*>(s.q.get()), kp = static_cast<char*>(s.k.get()), vp = static_cast<char*>(s.v.get());
    dqp = static_cast<char*>(s.dq.get()), dkp = static_cast<char*>(s.dk.get()), dvp = static_cast<char*>(s.dv.get());
  }
  s.o = DevBuf(size_t(N * Hq * D), true);
  s.o.upload(nan_fill(size_t(N * Hq * D)));
  s.lse = DevBuf(size_t(Hq * N), false);
  s.lse.upload(nan_fill(size_t(Hq * N)));
  s.dout = DevBuf(dout.size(), true);
  s.dout.upload(dout);
  const std::vector<rlh_named_value> attrs = {sdk::attr_int("window", c.window)};
  {
    Operands ops;
    ops.in = {ops.heads(qp, sdk::kBF16, dev, N, Hq, D, L.ldq), ops.heads(kp, sdk::kBF16, dev, N, Hkv, D, L.ldk),
              ops.heads(vp, sdk::kBF16, dev, N, Hkv, D, L.ldv), ops.vec(cu.get(), sdk::kI32, dev, L.S + 1)};
    ops.out = {ops.heads(s.o.get(), sdk::kBF16, dev, N, Hq, D, Hq * D), ops.vec(s.lse.get(), sdk::kF32, dev, Hq * N)};
    r.error = run_op(api, inst, "attention_fwd", dev, ops.in, ops.out, attrs, c.workspace);
    if (!r.error.empty()) return r;
  }
  {
    Operands ops;
    ops.in = {ops.heads(s.dout.get(), sdk::kBF16, dev, N, Hq, D, Hq * D),
              ops.heads(qp, sdk::kBF16, dev, N, Hq, D, L.ldq),
              ops.heads(kp, sdk::kBF16, dev, N, Hkv, D, L.ldk),
              ops.heads(vp, sdk::kBF16, dev, N, Hkv, D, L.ldv),
              ops.heads(s.o.get(), sdk::kBF16, dev, N, Hq, D, Hq * D),
              ops.vec(s.lse.get(), sdk::kF32, dev, Hq * N),
              ops.vec(cu.get(), sdk::kI32, dev, L.S + 1)};
    ops.out = {ops.heads(dqp, sdk::kBF16, dev, N, Hq, D, L.ldq), ops.heads(dkp, sdk::kBF16, dev, N, Hkv, D, L.ldk),
               ops.heads(dvp, sdk::kBF16, dev, N, Hkv, D, L.ldv)};
    r.error = run_op(api, inst, "attention_bwd", dev, ops.in, ops.out, attrs, c.workspace);
    if (!r.error.empty()) return r;
  }
  r.o = s.o.download();
  r.lse = s.lse.download();
  if (c.fused) {
    r.dqkv = s.dqkv.download();
  } else {
    r.dq = s.dq.download(), r.dk = s.dk.download(), r.dv = s.dv.download();
  }
  return r;
}

// The float64 oracle (kernels_cpu through the ABI in f64), in the same layouts.
Outputs run_reference(const Case& c, const Layout& L, const std::vector<float>& qkv, const std::vector<float>& q,
                  const std::vector<float>& k, const std::vector<float>& v, const std::vector<float>& dout) {
  Providers& P = providers();
  Outputs r;
  const int64_t N = L.N, Hq = c.Hq, Hkv = c.Hkv, D = c.D;
  auto dbl = [](const std::vector<float>& f) { return std::vector<double>(f.begin(), f.end()); };
  std::vector<double> dqkv_in = c.fused ? dbl(qkv) : std::vector<double>{};
  std::vector<double> dq_in = dbl(q), dk_in = dbl(k), dv_in = dbl(v), ddout = dbl(dout);
  std::vector<double> o(size_t(N * Hq * D)), lse(size_t(Hq * N));
  std::vector<double> gqkv(c.fused ? size_t(N * L.W) : 0, kSentinel), gq(q.size()), gk(k.size()), gv(v.size());
  std::vector<int32_t> cu = L.cu;
  double *qp, *kp, *vp, *dqp, *dkp, *dvp;
  if (c.fused) {
    qp = dqkv_in.data() + L.qoff, kp = dqkv_in.data() + L.koff, vp = dqkv_in.data() + L.voff;
    dqp = gqkv.data() + L.qoff, dkp = gqkv.data() + L.koff, dvp = gqkv.data() + L.voff;
  } else {
    qp = dq_in.data(), kp = dk_in.data(), vp = dv_in.data(), dqp = gq.data(), dkp = gk.data(), dvp = gv.data();
  }
  const std::vector<rlh_named_value> attrs = {sdk::attr_int("window", c.window)};
  const rlh_device cpu = sdk::kCPU;
  {
    Operands ops;
    ops.in = {ops.heads(qp, sdk::kF64, cpu, N, Hq, D, L.ldq), ops.heads(kp, sdk::kF64, cpu, N, Hkv, D, L.ldk),
              ops.heads(vp, sdk::kF64, cpu, N, Hkv, D, L.ldv), ops.vec(cu.data(), sdk::kI32, cpu, L.S + 1)};
    ops.out = {ops.heads(o.data(), sdk::kF64, cpu, N, Hq, D, Hq * D), ops.vec(lse.data(), sdk::kF64, cpu, Hq * N)};
    r.error = run_op(P.cpu, P.i_cpu, "attention_fwd", cpu, ops.in, ops.out, attrs);
    if (!r.error.empty()) return r;
  }
  {
    Operands ops;
    ops.in = {ops.heads(ddout.data(), sdk::kF64, cpu, N, Hq, D, Hq * D),
              ops.heads(qp, sdk::kF64, cpu, N, Hq, D, L.ldq),
              ops.heads(kp, sdk::kF64, cpu, N, Hkv, D, L.ldk),
              ops.heads(vp, sdk::kF64, cpu, N, Hkv, D, L.ldv),
              ops.heads(o.data(), sdk::kF64, cpu, N, Hq, D, Hq * D),
              ops.vec(lse.data(), sdk::kF64, cpu, Hq * N),
              ops.vec(cu.data(), sdk::kI32, cpu, L.S + 1)};
    ops.out = {ops.heads(dqp, sdk::kF64, cpu, N, Hq, D, L.ldq), ops.heads(dkp, sdk::kF64, cpu, N, Hkv, D, L.ldk),
               ops.heads(dvp, sdk::kF64, cpu, N, Hkv, D, L.ldv)};
    r.error = run_op(P.cpu, P.i_cpu, "attention_bwd", cpu, ops.in, ops.out, attrs);
    if (!r.error.empty()) return r;
  }
  auto flt = [](const std::vector<double>& d) { return std::vector<float>(d.begin(), d.end()); };
  r.o = flt(o), r.lse = flt(lse);
  if (c.fused) {
    r.dqkv = flt(gqkv);
  } else {
    r.dq = flt(gq), r.dk = flt(gk), r.dv = flt(gv);
  }
  return r;
}

// The elements of one [N, H, D] operand (rows ld apart, starting at column `col`).
std::vector<float> pick(const std::vector<float>& buf, int64_t N, int64_t HD, int64_t ld, int64_t col) {
  std::vector<float> out;
  out.reserve(size_t(N * HD));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < HD; ++j) out.push_back(buf[size_t(n * ld + col + j)]);
  return out;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
    m = std::max(m, std::fabs(double(a[i]) - double(b[i])));
  }
  return m;
}

struct Grads {
  std::vector<float> dq, dk, dv;
};
Grads grads_of(const Case& c, const Layout& L, const Outputs& r) {
  if (!c.fused) return {r.dq, r.dk, r.dv};
  return {pick(r.dqkv, L.N, c.Hq * c.D, L.W, L.qoff), pick(r.dqkv, L.N, c.Hkv * c.D, L.W, L.koff),
          pick(r.dqkv, L.N, c.Hkv * c.D, L.W, L.voff)};
}

void check_case(const Case& c) {
  Providers& P = providers();
  const Layout L = layout_of(c);
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto rand_vec = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = round_bf16(nd(rng));
    return v;
  };
  std::vector<float> qkv, q, k, v;
  if (c.fused) {
    qkv = rand_vec(size_t(L.N * L.W));
  } else {
    q = rand_vec(size_t(L.N * c.Hq * c.D)), k = rand_vec(size_t(L.N * c.Hkv * c.D)),
    v = rand_vec(size_t(L.N * c.Hkv * c.D));
  }
  const std::vector<float> dout = rand_vec(size_t(L.N * c.Hq * c.D));

  const Outputs ref = run_reference(c, L, qkv, q, k, v, dout);
  ASSERT_TRUE(ref.error.empty()) << "kernels_cpu f64: " << ref.error;
  const Outputs dnn = run_device(P.cudnn, P.i_cudnn, c, L, qkv, q, k, v, dout);
  ASSERT_TRUE(dnn.error.empty()) << "kernels_cudnn: " << dnn.error;
  const Outputs cud = run_device(P.cuda, P.i_cuda, c, L, qkv, q, k, v, dout);
  ASSERT_TRUE(cud.error.empty()) << "kernels_cuda: " << cud.error;

  using rlh::kcuda::testing::rel_error;
  const Grads g_ref = grads_of(c, L, ref), g_dnn = grads_of(c, L, dnn), g_cud = grads_of(c, L, cud);
  struct Row {
    const char* what;
    double dnn, cud, vs, tol;
  };
  const Row rows[] = {
      {"o", rel_error(dnn.o, ref.o), rel_error(cud.o, ref.o), rel_error(dnn.o, cud.o), 1e-2},
      {"lse (abs)", max_abs_diff(dnn.lse, ref.lse), max_abs_diff(cud.lse, ref.lse), max_abs_diff(dnn.lse, cud.lse),
       1e-2},
      {"dq", rel_error(g_dnn.dq, g_ref.dq), rel_error(g_cud.dq, g_ref.dq), rel_error(g_dnn.dq, g_cud.dq), 3e-2},
      {"dk", rel_error(g_dnn.dk, g_ref.dk), rel_error(g_cud.dk, g_ref.dk), rel_error(g_dnn.dk, g_cud.dk), 3e-2},
      {"dv", rel_error(g_dnn.dv, g_ref.dv), rel_error(g_cud.dv, g_ref.dv), rel_error(g_dnn.dv, g_cud.dv), 3e-2},
  };
  std::printf("%s (N %ld, S %ld, %ld/%ld heads of %ld, window %ld%s):\n", c.name, long(L.N), long(L.S), long(c.Hq),
              long(c.Hkv), long(c.D), long(c.window), c.fused ? ", fused padded q|k|v" : "");
  for (const Row& r : rows) {
    std::printf("  %-10s cudnn vs f64 %.2e   cuda vs f64 %.2e   cudnn vs cuda %.2e\n", r.what, r.dnn, r.cud, r.vs);
    EXPECT_LE(r.dnn, r.tol) << c.name << " " << r.what << ": kernels_cudnn against the float64 oracle";
    EXPECT_LE(r.vs, 2 * r.tol) << c.name << " " << r.what << ": kernels_cudnn against kernels_cuda";
  }
  // The padding columns of the fused gradient buffer are never written.
  if (c.fused) {
    const int64_t used = (c.Hq + 2 * c.Hkv) * c.D;
    int64_t touched = 0;
    for (int64_t n = 0; n < L.N; ++n)
      for (int64_t j = used; j < L.W; ++j) touched += dnn.dqkv[size_t(n * L.W + j)] != kSentinel;
    EXPECT_EQ(touched, 0) << c.name << ": kernels_cudnn wrote into the padding between rows";
  }
}

// ---------------------------------------------------------------------------------------------

TEST(KernelsCudnnAttention, MatchesTheFloat64OracleAndKernelsCuda) {
  REQUIRE_PROVIDERS();
  const Case cases[] = {
      {"gqa4/2 d64", {1, 37, 128, 5, 300}, 4, 2, 64, 0, true, false},
      {"gqa4/2 d64 window16", {1, 37, 128, 5, 300}, 4, 2, 64, 16, true, true},
      {"gqa4/2 d128 window16 separate", {200, 1, 63, 17}, 4, 2, 128, 16, false, false},
      {"gqa32/8 d64 empty sequences", {0, 129, 1, 0, 250, 64}, 32, 8, 64, 0, true, true},
      {"gqa32/8 d128", {513, 1, 77, 300}, 32, 8, 128, 0, true, false},
      {"gqa32/8 d64 window16 separate", {40, 1, 333}, 32, 8, 64, 16, false, true},
      {"mha8/8 d64", {90, 1, 410}, 8, 8, 64, 0, true, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    check_case(c);
  }
}

// The registry (every provider on the plugin path, score order) asks kernels_cudnn first for
// attention and takes everything else from kernels_cuda; a pin moves attention back; a shape
// kernels_cudnn refuses falls through.
TEST(KernelsCudnnAttention, TheRegistryPutsItFirstForAttention) {
  REQUIRE_PROVIDERS();
  auto resolve = [&](const sdk::KernelRegistry& reg, const char* name, int64_t D, int64_t Dv) {
    const rlh_device dev = sdk::cuda_device(0);
    Operands ops;
    const int64_t N = 64, Hq = 4, Hkv = 2;
    DevBuf buf(size_t(N * 64 * 8), true), cu(2, false);
    char* p = static_cast<char*>(buf.get());
    if (std::string(name) == "attention_fwd") {
      ops.in = {ops.heads(p, sdk::kBF16, dev, N, Hq, D, Hq * D), ops.heads(p, sdk::kBF16, dev, N, Hkv, D, Hkv * D),
                ops.heads(p, sdk::kBF16, dev, N, Hkv, Dv, Hkv * Dv), ops.vec(cu.get(), sdk::kI32, dev, 2)};
      ops.out = {ops.heads(p, sdk::kBF16, dev, N, Hq, Dv, Hq * Dv), ops.vec(p, sdk::kF32, dev, Hq * N)};
    } else {
      ops.in = {ops.make(p, sdk::kBF16, dev, {N, D}, {D, 1}), ops.vec(p, sdk::kBF16, dev, D)};
      ops.out = {ops.make(p, sdk::kBF16, dev, {N, D}, {D, 1}), ops.vec(p, sdk::kF32, dev, N)};
    }
    return reg.resolve(name, dev, ops.in, ops.out, {}, false).provider();
  };
  Providers& P = providers();
  {
    auto reg = sdk::make_kernel_registry(sdk::Host(P.svc), sdk::cuda_device(0), {}, "test");
    EXPECT_EQ(resolve(*reg, "attention_fwd", 64, 64), "kernels_cudnn");
    EXPECT_EQ(resolve(*reg, "rmsnorm_fwd", 64, 64), "kernels_cuda");
    EXPECT_EQ(resolve(*reg, "attention_fwd", 64, 32), "kernels_cuda");  // Dk != Dv: refused, falls through
    EXPECT_EQ(resolve(*reg, "attention_fwd", 72, 72), "kernels_cuda");  // head dim 72: refused
  }
  {
    auto reg = sdk::make_kernel_registry(sdk::Host(P.svc), sdk::cuda_device(0), {{"attention", "kernels_cuda"}}, "test");
    EXPECT_EQ(resolve(*reg, "attention_fwd", 64, 64), "kernels_cuda");
  }
}

// What kernels_cudnn does not offer is an answer (UNIMPLEMENTED naming it), not a failure.
TEST(KernelsCudnnAttention, RefusalsAreAnswers) {
  REQUIRE_PROVIDERS();
  Providers& P = providers();
  const rlh_device dev = sdk::cuda_device(0);
  const int64_t N = 32;
  DevBuf buf(size_t(N * 8 * 256 * 2), false), cu(2, false);
  char* p = static_cast<char*>(buf.get());
  auto try_fwd = [&](rlh_dtype dt, int64_t D, int64_t Dv, std::vector<rlh_named_value> attrs, const char* name) {
    Operands ops;
    ops.in = {ops.heads(p, dt, dev, N, 4, D, 4 * D), ops.heads(p, dt, dev, N, 2, D, 2 * D),
              ops.heads(p, dt, dev, N, 2, Dv, 2 * Dv), ops.vec(cu.get(), sdk::kI32, dev, 2)};
    if (std::string(name) == "attention_fwd") {
      ops.out = {ops.heads(p, dt, dev, N, 4, Dv, 4 * Dv), ops.vec(p, sdk::kF32, dev, 4 * N)};
    } else {
      ops.in = {ops.heads(p, dt, dev, N, 4, Dv, 4 * Dv), ops.in[0], ops.in[1], ops.in[2],
                ops.heads(p, dt, dev, N, 4, Dv, 4 * Dv), ops.vec(p, sdk::kF32, dev, 4 * N), ops.in[3]};
      ops.out = {ops.heads(p, dt, dev, N, 4, D, 4 * D), ops.heads(p, dt, dev, N, 2, D, 2 * D),
                 ops.heads(p, dt, dev, N, 2, Dv, 2 * Dv)};
    }
    rlh_op_desc d{};
    d.struct_size = RLH_STRUCT_SIZE(rlh_op_desc, num_attrs);
    d.name = name;
    d.device = dev;
    d.inputs = ops.in.data(), d.num_inputs = ops.in.size(), d.outputs = ops.out.data(), d.num_outputs = ops.out.size();
    d.shapes_valid = 1;
    d.attrs = attrs.data(), d.num_attrs = attrs.size();
    rlh_op* op = nullptr;
    sdk::StatusPtr s(P.cudnn->get_op(P.i_cudnn, &d, &op));
    if (!s) {
      P.cudnn->release_op(op);
      return std::string("resolved");
    }
    EXPECT_EQ(s->code, RLH_E_UNIMPLEMENTED) << sdk::status_message(s.get());
    return sdk::status_message(s.get());
  };
  const std::string f32 = try_fwd(sdk::kF32, 64, 64, {}, "attention_fwd");
  const std::string dv = try_fwd(sdk::kBF16, 64, 32, {}, "attention_fwd");
  const std::string d72 = try_fwd(sdk::kBF16, 72, 72, {}, "attention_fwd");
  const std::string det = try_fwd(sdk::kBF16, 64, 64, {sdk::attr_int("deterministic", 1)}, "attention_bwd");
  for (const std::string& m : {f32, dv, d72, det}) {
    std::printf("refused: %s\n", m.c_str());
    EXPECT_EQ(m.rfind("kernels_cudnn attention_", 0), 0u) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  EXPECT_NE(f32.find("bfloat16"), std::string::npos) << f32;
  EXPECT_NE(dv.find("head dims differ"), std::string::npos) << dv;
  EXPECT_NE(d72.find("head dim 72"), std::string::npos) << d72;
  EXPECT_NE(det.find("deterministic"), std::string::npos) << det;
  EXPECT_EQ(try_fwd(sdk::kBF16, 64, 64, {}, "attention_bwd"), "resolved");
}

// The forward gives bitwise the same o and lse on a rerun (op_info says deterministic); the
// backward's dQ is accumulated with atomics, op_info says so, and this reports whether two runs
// matched.
TEST(KernelsCudnnAttention, ForwardIsRepeatable) {
  REQUIRE_PROVIDERS();
  Providers& P = providers();
  const Case c{"repeat", {300, 1, 211}, 8, 2, 64, 0, true, false};
  const Layout L = layout_of(c);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> qkv(size_t(L.N * L.W)), dout(size_t(L.N * c.Hq * c.D));
  for (float& x : qkv) x = round_bf16(nd(rng));
  for (float& x : dout) x = round_bf16(nd(rng));
  const Outputs a = run_device(P.cudnn, P.i_cudnn, c, L, qkv, {}, {}, {}, dout);
  const Outputs b = run_device(P.cudnn, P.i_cudnn, c, L, qkv, {}, {}, {}, dout);
  ASSERT_TRUE(a.error.empty() && b.error.empty()) << a.error << b.error;
  EXPECT_EQ(std::memcmp(a.o.data(), b.o.data(), a.o.size() * 4), 0);
  EXPECT_EQ(std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * 4), 0);
  std::printf("backward bitwise repeatable in this run: %s\n",
              std::memcmp(a.dqkv.data(), b.dqkv.data(), a.dqkv.size() * 4) == 0 ? "yes" : "no");
}

}  // namespace
