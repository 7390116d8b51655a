// The kernels_cuda plugin: the CUDA ops of rlh_kernels_cuda_core behind the C ABI's KERNELS
// component (abi/include/rlhost/kernels.h). Operands, attributes and semantics are those of
// docs/ops.md; docs/kernels_cuda.md says what this provider adds and at what precision.
//
// Operands live in CUDA device memory of the instance's device (RLH_DEVICE_CUDA, or managed).
// dtypes: each op runs in f32 or bf16 (its "float" operands), with these extensions of the
// contract for bf16 ops: statistics (rmsnorm rstd, attention lse, the logprob outputs and their
// gradients) and parameter gradients (dw, db, dtable, dW, gemm's C) may be f32 instead of bf16
// (f32 is what the engine should pass); adamw takes a bf16 or f32 gradient; adamw, sumsq and
// scale take lists of tensors (multi-tensor: 4k outputs for adamw, k inputs for sumsq, k
// outputs for scale) and run each list in one launch.
// Work is queued on rlh_op_call.stream (a cudaStream_t; NULL = the legacy default stream);
// nothing synchronises. Scratch comes from rlh_op_call.workspace when it is large enough, else
// from a stream-ordered pool of this instance (cudaMallocFromPoolAsync / cudaFreeAsync).
// RLH_KCUDA_CHECK=1 synchronises after every op and reports launch errors and out-of-range ids
// or targets (which otherwise yield zero rows and no gradient).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "rlhost/kernels.h"
#include "rlhost/kernels_cuda/kernels.hpp"
#include "losses.hpp"
#include "rlhost/losses/loss_ops.hpp"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/plugin.hpp"

namespace rlh::kcuda {
namespace {

using sdk::Error;

struct Attr {
  std::string name;
  int32_t type = RLH_VALUE_INT64;
  int64_t i = 0;
  double d = 0;
};

struct OpSpec;

}  // namespace
}  // namespace rlh::kcuda

struct rlh_kernels {
  const rlh_host_api* host = nullptr;
  rlh_device device{};
  rlh::kcuda::DeviceInfo info;
  rlh::kcuda::GemmEngine* gemm = nullptr;
  cudaMemPool_t pool = nullptr;
  int* err = nullptr;  // device flag: an id or target out of range
  bool check = false;
};

struct rlh_op {
  const rlh::kcuda::OpSpec* spec = nullptr;
  rlh::kcuda::DType dt = rlh::kcuda::DType::f32;
  std::vector<rlh::kcuda::Attr> attrs;
  rlh_kernels* inst = nullptr;
};

namespace rlh::kcuda {
namespace {

sdk::MakeStatusFn g_make_status = nullptr;

[[noreturn]] void bad(const std::string& what) { throw Error(RLH_E_INVALID_ARGUMENT, what); }

void cuda_ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(RLH_E_INTERNAL, std::string("kernels_cuda ") + what + ": " + cudaGetErrorString(e));
}

// ---------------------------------------------------------------------------------------------
// Workspace: the caller's arena first, then the instance's stream-ordered pool.

class CallWorkspace final : public Workspace {
 public:
  CallWorkspace(rlh_kernels* inst, void* base, size_t size, cudaStream_t s)
      : inst_(inst), base_(static_cast<char*>(base)), size_(base ? size : 0), s_(s) {}
  ~CallWorkspace() override {
    for (void* p : owned_) cudaFreeAsync(p, s_);
  }
  void* get(size_t bytes) override {
    const size_t need = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
    const size_t start = (used_ + 255) / 256 * 256;
    if (base_ && reinterpret_cast<uintptr_t>(base_) % 256 == 0 && start + need <= size_) {
      used_ = start + need;
      return base_ + start;
    }
    void* p = nullptr;
    const cudaError_t e = cudaMallocFromPoolAsync(&p, need, inst_->pool, s_);
    if (e != cudaSuccess)
      throw Error(RLH_E_RESOURCE_EXHAUSTED, "kernels_cuda workspace of " + std::to_string(bytes) +
                                                " bytes: " + cudaGetErrorString(e));
    owned_.push_back(p);
    return p;
  }

 private:
  rlh_kernels* inst_;
  char* base_;
  size_t size_, used_ = 0;
  cudaStream_t s_;
  std::vector<void*> owned_;
};

// ---------------------------------------------------------------------------------------------
// One call's operands and attributes.

struct Call {
  const rlh_op* op;
  const rlh_op_call* call;
  CallWorkspace* ws;
  cudaStream_t stream;

  const rlh_tensor& in(size_t i) const { return call->inputs[i]; }
  const rlh_tensor& out(size_t i) const { return call->outputs[i]; }
  bool has_in(size_t i) const { return i < call->num_inputs && call->inputs[i].data; }
  bool has_out(size_t i) const { return i < call->num_outputs && call->outputs[i].data; }
  size_t nin() const { return call->num_inputs; }
  size_t nout() const { return call->num_outputs; }

  double num(const char* name, double fallback) const {
    if (const rlh_named_value* a = sdk::find_attr(call->attrs, call->num_attrs, name))
      return a->type == RLH_VALUE_DOUBLE ? a->double_value : double(a->int64_value);
    for (auto it = op->attrs.rbegin(); it != op->attrs.rend(); ++it)
      if (it->name == name) return it->type == RLH_VALUE_DOUBLE ? it->d : double(it->i);
    return fallback;
  }
  int64_t integer(const char* name, int64_t fallback) const { return int64_t(num(name, double(fallback))); }
  bool flag(const char* name) const { return num(name, 0) != 0; }
  DType dt() const { return op->dt; }
  int* err() const { return op->inst->err; }
};

template <class T = void>
T* ptr(const rlh_tensor& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data) + t.byte_offset);
}
bool is_bf16(const rlh_tensor& t) { return t.dtype.code == RLH_DTYPE_BFLOAT; }
Flex flex(const rlh_tensor& t) { return Flex{ptr(t), is_bf16(t)}; }
Flex flex_opt_in(const Call& c, size_t i) { return c.has_in(i) ? flex(c.in(i)) : Flex{}; }

// Operand checks shared with every provider (rlhost/sdk/kernels.hpp).
using sdk::need_heads;
using sdk::need_rows;
using sdk::need_vec;
int64_t numel(const rlh_tensor& t) { return sdk::tensor_numel(t); }

// ---------------------------------------------------------------------------------------------
// The ops

// gemm with batch_invariant = 1 (docs/ops.md): C = A B^T with every row of C a function of its
// row of A alone, whatever M (a generator's deterministic mode): grouped_gemm.cu's tiles over one
// group of rows, whose summation order never depends on the number of rows (cuBLASLt picks its
// kernel, split-K included, by the problem's shape). Only 2-D C = A B^T, alpha 1, beta 0.
void run_gemm_rows(const Call& c) {
  const rlh_tensor &A = c.in(0), &B = c.in(1), &C = c.out(0);
  if (A.ndim != 2 || B.ndim != 2 || C.ndim != 2 || c.flag("transpose_a") || !c.flag("transpose_b") ||
      c.num("alpha", 1) != 1 || c.num("beta", 0) != 0 || c.has_in(2))
    bad("gemm (batch_invariant): kernels_cuda offers only 2-D C = A B^T (transpose_b = 1, alpha 1, beta 0, no bias)");
  GroupedGemmArgs g;
  g.ta = false;
  g.tb = true;
  g.G = 1;
  g.T = C.shape[0];
  g.N = C.shape[1];
  g.K = A.shape[1];
  g.lda = need_rows(A, g.T, g.K, "gemm A");
  g.ldb = need_rows(B, g.N, g.K, "gemm B");
  g.ldc = need_rows(C, g.T, g.N, "gemm C");
  g.stride_b = g.N * g.ldb;
  g.A = ptr(A);
  g.B = ptr(B);
  g.C = ptr(C);
  g.ab = c.dt();
  g.c_dt = is_bf16(C) ? DType::bf16 : DType::f32;
  g.err = c.err();
  grouped_gemm(g, c.stream);
}

void run_gemm(const Call& c) {
  if (c.flag("batch_invariant")) return run_gemm_rows(c);
  const bool ta = c.flag("transpose_a"), tb = c.flag("transpose_b");
  const rlh_tensor &A = c.in(0), &B = c.in(1), &C = c.out(0);
  if (A.ndim != B.ndim || A.ndim != C.ndim || (A.ndim != 2 && A.ndim != 3))
    bad("gemm: operands must all be 2-D, or all 3-D (batched)");
  const int b0 = A.ndim == 3 ? 1 : 0;
  GemmArgs g;
  g.batch = b0 ? A.shape[0] : 1;
  if (b0 && (B.shape[0] != g.batch || C.shape[0] != g.batch)) bad("gemm: batch sizes differ");
  g.M = C.shape[b0];
  g.N = C.shape[b0 + 1];
  g.K = ta ? A.shape[b0] : A.shape[b0 + 1];
  if ((ta ? A.shape[b0 + 1] : A.shape[b0]) != g.M || (tb ? B.shape[b0 + 1] : B.shape[b0]) != g.K ||
      (tb ? B.shape[b0] : B.shape[b0 + 1]) != g.N)
    bad("gemm: shapes do not chain");
  for (const rlh_tensor* t : {&A, &B, &C})
    if (t->shape[b0 + 1] > 1 && t->strides[b0 + 1] != 1) bad("gemm: last dimension must be contiguous");
  auto ld = [&](const rlh_tensor& t) { return t.shape[b0] > 1 ? t.strides[b0] : t.shape[b0 + 1]; };
  g.ta = ta;
  g.tb = tb;
  g.alpha = c.num("alpha", 1);
  g.beta = c.num("beta", 0);
  g.A = ptr(A);
  g.lda = ld(A);
  g.B = ptr(B);
  g.ldb = ld(B);
  g.C = ptr(C);
  g.ldc = ld(C);
  if (b0) {
    g.stride_a = A.strides[0];
    g.stride_b = B.strides[0];
    g.stride_c = C.strides[0];
  }
  g.ab = c.dt();
  g.c_dt = is_bf16(C) ? DType::bf16 : DType::f32;
  g.allow_tf32 = c.flag("allow_tf32");
  if (c.has_in(2)) {  // bias [N], fused into the epilogue
    need_vec(c.in(2), g.N, "gemm bias");
    if (is_bf16(c.in(2)) != is_bf16(C)) bad("gemm: bias must have C's dtype");
    g.bias = ptr(c.in(2));
    g.bias_dt = g.c_dt;
  }
  gemm(c.op->inst->gemm, g, *c.ws, c.stream);
}

// x [M, K], W = gate | up [2F, K] -> h [M, F] = act(x Wg^T) * (x Wu^T), each product rounded to
// bf16 first: gemm then swiglu_fwd / geglu_fwd. Few rows on gemv.cu's GLU epilogue; otherwise
// the two ops through a [M, 2F] workspace.
void run_gemm_glu_fwd(const Call& c) {
  const rlh_tensor &X = c.in(0), &W = c.in(1), &H = c.out(0);
  if (X.ndim != 2 || W.ndim != 2 || H.ndim != 2) bad("gemm_glu_fwd: x, W and h must be 2-D");
  const int64_t M = X.shape[0], K = X.shape[1], F = H.shape[1];
  if (W.shape[0] != 2 * F || W.shape[1] != K || H.shape[0] != M) bad("gemm_glu_fwd: W must be [2F, K] for h [M, F]");
  const int64_t act = c.integer("activation", 0);
  if (act < 0 || act > 2) bad("gemm_glu_fwd: activation must be 0 (silu), 1 (gelu, tanh) or 2 (gelu, erf)");
  if (c.dt() != DType::bf16) bad("gemm_glu_fwd: bf16 only");
  GemmArgs g;
  g.M = M;
  g.N = F;
  g.K = K;
  g.tb = true;
  g.A = ptr(X);
  g.lda = need_rows(X, M, K, "gemm_glu_fwd x");
  g.B = ptr(W);
  g.ldb = need_rows(W, 2 * F, K, "gemm_glu_fwd W");
  g.C = ptr(H);
  g.ldc = need_rows(H, M, F, "gemm_glu_fwd h");
  g.ab = DType::bf16;
  g.c_dt = DType::bf16;
  if (gemv_glu_rows(g, int(act), c.stream)) return;
  const int64_t ldh = g.ldc;
  void* gu = c.ws->get(size_t(M * 2 * F) * 2);
  g.N = 2 * F;
  g.C = gu;
  g.ldc = 2 * F;
  gemm(c.op->inst->gemm, g, *c.ws, c.stream);
  const uint16_t* gate = static_cast<const uint16_t*>(gu);  // bf16 [M, 2F]: gate, then up
  if (act == 0)
    swiglu_fwd(DType::bf16, ptr(H), ldh, gate, 2 * F, gate + F, 2 * F, M, F, c.stream);
  else
    geglu_fwd(DType::bf16, ptr(H), ldh, gate, 2 * F, gate + F, 2 * F, M, F, act == 1, c.stream);
}

void run_embedding_fwd(const Call& c) {
  const int64_t N = numel(c.in(0)), V = c.in(1).shape[0], C = c.in(1).shape[1];
  need_vec(c.in(0), N, "embedding_fwd ids");
  need_vec(c.in(1), V * C, "embedding_fwd table");
  need_vec(c.out(0), N * C, "embedding_fwd out");
  embedding_fwd(c.dt(), ptr(c.out(0)), ptr<int32_t>(c.in(0)), ptr(c.in(1)), N, C, V, c.err(), c.stream);
}

void run_embedding_bwd(const Call& c) {
  const int64_t N = numel(c.in(0)), V = c.out(0).shape[0], C = c.out(0).shape[1];
  need_vec(c.in(0), N, "embedding_bwd ids");
  need_vec(c.in(1), N * C, "embedding_bwd dout");
  need_vec(c.out(0), V * C, "embedding_bwd dtable");
  embedding_bwd(c.dt(), flex(c.out(0)), ptr<int32_t>(c.in(0)), ptr(c.in(1)), N, C, V, c.err(),
                *c.ws, c.stream);
}

void run_rmsnorm_fwd(const Call& c) {
  const int64_t N = c.in(0).shape[0], C = c.in(0).shape[1];
  const int64_t ldx = need_rows(c.in(0), N, C, "rmsnorm_fwd x");
  need_vec(c.in(1), C, "rmsnorm_fwd w");
  const int64_t ldy = need_rows(c.out(0), N, C, "rmsnorm_fwd y");
  Flex rstd;
  if (c.has_out(1)) {
    need_vec(c.out(1), N, "rmsnorm_fwd rstd");
    rstd = flex(c.out(1));
  }
  rmsnorm_fwd(c.dt(), ptr(c.out(0)), ldy, rstd, ptr(c.in(0)), ldx, ptr(c.in(1)), N, C,
              float(c.num("eps", 1e-6)), float(c.num("weight_offset", 0)), c.stream);
}

// a, b [N, C], w [C] -> y = a + b, yn = rmsnorm(y); contiguous rows, yn apart from a and b
void run_add_rmsnorm_fwd(const Call& c) {
  const int64_t N = c.in(0).shape[0], C = c.in(0).shape[1];
  need_vec(c.in(0), N * C, "add_rmsnorm_fwd a");
  need_vec(c.in(1), N * C, "add_rmsnorm_fwd b");
  need_vec(c.in(2), C, "add_rmsnorm_fwd w");
  need_vec(c.out(0), N * C, "add_rmsnorm_fwd y");
  need_vec(c.out(1), N * C, "add_rmsnorm_fwd yn");
  if (ptr(c.out(1)) == ptr(c.in(0)) || ptr(c.out(1)) == ptr(c.in(1))) bad("add_rmsnorm_fwd: yn may not be a or b (y may)");
  add_rmsnorm_fwd(c.dt(), ptr(c.out(0)), ptr(c.out(1)), ptr(c.in(0)), ptr(c.in(1)), ptr(c.in(2)), N, C,
                  float(c.num("eps", 1e-6)), float(c.num("weight_offset", 0)), c.stream);
}

void run_rmsnorm_bwd(const Call& c) {
  const int64_t N = c.in(1).shape[0], C = c.in(1).shape[1];
  const int64_t lddy = need_rows(c.in(0), N, C, "rmsnorm_bwd dy");
  const int64_t ldx = need_rows(c.in(1), N, C, "rmsnorm_bwd x");
  need_vec(c.in(2), C, "rmsnorm_bwd w");
  need_vec(c.in(3), N, "rmsnorm_bwd rstd");
  const int64_t lddx = need_rows(c.out(0), N, C, "rmsnorm_bwd dx");
  Flex dw;
  if (c.has_out(1)) {
    need_vec(c.out(1), C, "rmsnorm_bwd dw");
    dw = flex(c.out(1));
  }
  rmsnorm_bwd(c.dt(), ptr(c.out(0)), lddx, dw, ptr(c.in(0)), lddy, ptr(c.in(1)), ldx, ptr(c.in(2)),
              flex(c.in(3)), N, C, float(c.num("weight_offset", 0)), c.flag("accumulate"), *c.ws,
              c.stream);
}

void run_rope(const Call& c, bool backward) {
  const rlh_tensor& x = c.in(0);
  if (x.ndim != 3) bad("rope: x must be [N, H, D]");
  const int64_t N = x.shape[0], H = x.shape[1], D = x.shape[2];
  const int64_t ldx = need_heads(x, N, H, D, "rope x");
  const int64_t ldy = need_heads(c.out(0), N, H, D, "rope y");
  need_vec(c.in(1), N, "rope positions");
  const int64_t R = 2 * numel(c.in(2));
  need_vec(c.in(2), R / 2, "rope inv_freq");
  rope(c.dt(), ptr(c.out(0)), ldy, ptr(x), ldx, ptr<int32_t>(c.in(1)), ptr<float>(c.in(2)), N, H,
       D, R, c.num("scale", 1), c.flag("interleaved"), backward, c.stream);
}
void run_rope_fwd(const Call& c) { run_rope(c, false); }
void run_rope_bwd(const Call& c) { run_rope(c, true); }

AttnArgs attn_common(const Call& c, const rlh_tensor& q, const rlh_tensor& k, const rlh_tensor& v,
                     const rlh_tensor& cu) {
  if (q.ndim != 3 || k.ndim != 3 || v.ndim != 3) bad("attention: q, k, v must be [N, H, D]");
  AttnArgs a;
  a.t = c.dt();
  a.N = q.shape[0];
  a.Hq = q.shape[1];
  a.Hkv = k.shape[1];
  a.Dk = q.shape[2];
  a.Dv = v.shape[2];
  a.S = numel(cu) - 1;
  need_vec(cu, a.S + 1, "attention cu_seqlens");
  a.cu = ptr<int32_t>(cu);
  a.scale = float(c.num("scale", 1.0 / std::sqrt(double(a.Dk))));
  a.window = c.integer("window", 0);
  a.softcap = float(c.num("softcap", 0));
  a.force_simt = c.flag("force_simt");
  a.ldq = need_heads(q, a.N, a.Hq, a.Dk, "attention q");
  a.ldk = need_heads(k, a.N, a.Hkv, a.Dk, "attention k");
  a.ldv = need_heads(v, a.N, a.Hkv, a.Dv, "attention v");
  a.q = ptr(q);
  a.k = ptr(k);
  a.v = ptr(v);
  return a;
}

void run_attention_fwd(const Call& c) {
  AttnArgs a = attn_common(c, c.in(0), c.in(1), c.in(2), c.in(3));
  a.ldo = need_heads(c.out(0), a.N, a.Hq, a.Dv, "attention_fwd o");
  a.o = ptr(c.out(0));
  need_vec(c.out(1), a.Hq * a.N, "attention_fwd lse");
  a.lse = flex(c.out(1));
  attention_fwd(a, c.op->inst->info, c.stream);
}

void run_attention_bwd(const Call& c) {
  AttnArgs a = attn_common(c, c.in(1), c.in(2), c.in(3), c.in(6));
  a.lddo = need_heads(c.in(0), a.N, a.Hq, a.Dv, "attention_bwd dout");
  a.dout = ptr(c.in(0));
  a.ldo = need_heads(c.in(4), a.N, a.Hq, a.Dv, "attention_bwd o");
  a.o = ptr(c.in(4));
  need_vec(c.in(5), a.Hq * a.N, "attention_bwd lse");
  a.lse = flex(c.in(5));
  a.lddq = need_heads(c.out(0), a.N, a.Hq, a.Dk, "attention_bwd dq");
  a.lddk = need_heads(c.out(1), a.N, a.Hkv, a.Dk, "attention_bwd dk");
  a.lddv = need_heads(c.out(2), a.N, a.Hkv, a.Dv, "attention_bwd dv");
  a.dq = ptr(c.out(0));
  a.dk = ptr(c.out(1));
  a.dv = ptr(c.out(2));
  attention_bwd(a, c.op->inst->info, *c.ws, c.stream);
}

void run_swiglu_fwd(const Call& c) {
  const int64_t N = c.in(0).shape[0], F = c.in(0).shape[1];
  const int64_t ldg = need_rows(c.in(0), N, F, "swiglu_fwd gate");
  const int64_t ldu = need_rows(c.in(1), N, F, "swiglu_fwd up");
  const int64_t ldh = need_rows(c.out(0), N, F, "swiglu_fwd h");
  swiglu_fwd(c.dt(), ptr(c.out(0)), ldh, ptr(c.in(0)), ldg, ptr(c.in(1)), ldu, N, F, c.stream);
}

void run_geglu_fwd(const Call& c) {
  const int64_t N = c.in(0).shape[0], F = c.in(0).shape[1];
  const int64_t ldg = need_rows(c.in(0), N, F, "geglu_fwd gate");
  const int64_t ldu = need_rows(c.in(1), N, F, "geglu_fwd up");
  const int64_t ldh = need_rows(c.out(0), N, F, "geglu_fwd h");
  geglu_fwd(c.dt(), ptr(c.out(0)), ldh, ptr(c.in(0)), ldg, ptr(c.in(1)), ldu, N, F,
            c.integer("approximate_tanh", 1) != 0, c.stream);
}

void run_geglu_bwd(const Call& c) {
  const int64_t N = c.in(1).shape[0], F = c.in(1).shape[1];
  const int64_t lddh = need_rows(c.in(0), N, F, "geglu_bwd dh");
  const int64_t ldg = need_rows(c.in(1), N, F, "geglu_bwd gate");
  const int64_t ldu = need_rows(c.in(2), N, F, "geglu_bwd up");
  const int64_t lddg = need_rows(c.out(0), N, F, "geglu_bwd dgate");
  const int64_t lddu = need_rows(c.out(1), N, F, "geglu_bwd dup");
  geglu_bwd(c.dt(), ptr(c.out(0)), lddg, ptr(c.out(1)), lddu, ptr(c.in(0)), lddh, ptr(c.in(1)), ldg,
            ptr(c.in(2)), ldu, N, F, c.integer("approximate_tanh", 1) != 0, c.stream);
}

void run_swiglu_bwd(const Call& c) {
  const int64_t N = c.in(1).shape[0], F = c.in(1).shape[1];
  const int64_t lddh = need_rows(c.in(0), N, F, "swiglu_bwd dh");
  const int64_t ldg = need_rows(c.in(1), N, F, "swiglu_bwd gate");
  const int64_t ldu = need_rows(c.in(2), N, F, "swiglu_bwd up");
  const int64_t lddg = need_rows(c.out(0), N, F, "swiglu_bwd dgate");
  const int64_t lddu = need_rows(c.out(1), N, F, "swiglu_bwd dup");
  swiglu_bwd(c.dt(), ptr(c.out(0)), lddg, ptr(c.out(1)), lddu, ptr(c.in(0)), lddh, ptr(c.in(1)),
             ldg, ptr(c.in(2)), ldu, N, F, c.stream);
}

void run_bias_add_fwd(const Call& c) {
  const int64_t N = c.out(0).shape[0], M = c.out(0).shape[1];
  const int64_t ldy = need_rows(c.out(0), N, M, "bias_add_fwd y");
  need_vec(c.in(0), M, "bias_add_fwd b");
  bias_add_fwd(c.dt(), ptr(c.out(0)), ldy, ptr(c.in(0)), N, M, c.stream);
}

void run_bias_bwd(const Call& c) {
  const int64_t N = c.in(0).shape[0], M = c.in(0).shape[1];
  const int64_t lddy = need_rows(c.in(0), N, M, "bias_bwd dy");
  need_vec(c.out(0), M, "bias_bwd db");
  bias_bwd(c.dt(), flex(c.out(0)), ptr(c.in(0)), lddy, N, M, *c.ws, c.stream);
}

void run_add_fwd(const Call& c) {
  const int64_t n = numel(c.out(0));
  need_vec(c.in(0), n, "add_fwd a");
  need_vec(c.in(1), n, "add_fwd b");
  need_vec(c.out(0), n, "add_fwd y");
  add_fwd(c.dt(), ptr(c.out(0)), ptr(c.in(0)), ptr(c.in(1)), n, c.stream);
}

LogprobArgs logprob_common(const Call& c) {
  if (c.integer("top_k", 0) > 0 || c.num("top_p", 1) < 1)
    throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda linear_logprob: top_k/top_p filtering is not offered");
  LogprobArgs a;
  a.t = c.dt();
  a.N = c.in(0).shape[0];
  a.C = c.in(0).shape[1];
  a.V = c.in(1).shape[0];
  need_vec(c.in(0), a.N * a.C, "linear_logprob h");
  need_vec(c.in(1), a.V * a.C, "linear_logprob W");
  a.K = c.in(2).ndim == 2 ? c.in(2).shape[1] : 1;  // target [N] or [N, K]
  need_vec(c.in(2), a.N * a.K, "linear_logprob target");
  a.h = ptr(c.in(0));
  a.W = ptr(c.in(1));
  a.target = ptr<int32_t>(c.in(2));
  a.temperature = c.num("temperature", 1);
  a.softcap = float(c.num("softcap", 0));
  a.chunk_bytes = c.integer("chunk_bytes", 0);
  a.err = c.err();
  return a;
}

// The optional logits cache (an engine's training step): fp32 [N, ld >= V] that the forward
// fills tile by tile and the backward reads instead of recomputing the logits.
void logits_cache(const rlh_tensor& t, LogprobArgs& a) {
  a.ld_cache = need_rows(t, a.N, a.V, "linear_logprob logits_cache");
  if (t.dtype.code != RLH_DTYPE_FLOAT || t.dtype.bits != 32) bad("linear_logprob logits_cache must be float32");
  a.logits_cache = ptr<float>(t);
}

void run_linear_logprob_fwd(const Call& c) {
  LogprobArgs a = logprob_common(c);
  need_vec(c.out(0), a.N * a.K, "linear_logprob_fwd logprob");
  need_vec(c.out(1), a.N, "linear_logprob_fwd lse");
  a.logprob = flex(c.out(0));
  a.lse = flex(c.out(1));
  if (c.has_out(2)) {
    need_vec(c.out(2), a.N, "linear_logprob_fwd entropy");
    a.entropy = flex(c.out(2));
  }
  if (c.has_out(3)) logits_cache(c.out(3), a);
  linear_logprob_fwd(c.op->inst->gemm, a, *c.ws, c.stream);
}

void run_linear_logprob_bwd(const Call& c) {
  LogprobArgs a = logprob_common(c);
  need_vec(c.in(3), a.N, "linear_logprob_bwd lse");
  a.lse = flex(c.in(3));
  if (c.has_in(4)) need_vec(c.in(4), a.N * a.K, "linear_logprob_bwd dlogprob");
  for (size_t i = 5; i < 7; ++i)
    if (c.has_in(i)) need_vec(c.in(i), a.N, "linear_logprob_bwd entropy/dentropy");
  a.dlogprob = flex_opt_in(c, 4);
  a.entropy = flex_opt_in(c, 5);
  a.dentropy = flex_opt_in(c, 6);
  need_vec(c.out(0), a.N * a.C, "linear_logprob_bwd dh");
  need_vec(c.out(1), a.V * a.C, "linear_logprob_bwd dW");
  a.dh = ptr(c.out(0));
  a.dW = flex(c.out(1));
  a.accumulate = c.flag("accumulate");
  if (c.has_in(7)) logits_cache(c.in(7), a);
  linear_logprob_bwd(c.op->inst->gemm, a, *c.ws, c.stream);
}

// Tensor lists of a multi-tensor op: every k-th operand from `first`.
struct ListStore {
  std::vector<int64_t> n;
  std::vector<void*> p;
  std::vector<bool> bf;
  std::unique_ptr<bool[]> bf_arr;
  TensorList list() {
    bf_arr.reset(new bool[bf.size()]);
    for (size_t i = 0; i < bf.size(); ++i) bf_arr[i] = bf[i];
    return TensorList{n.data(), p.data(), bf_arr.get(), n.size()};
  }
};
ListStore list_of(const rlh_tensor* ts, size_t count, size_t first, size_t step, const char* what) {
  ListStore l;
  for (size_t i = first; i < count; i += step) {
    const int64_t n = numel(ts[i]);
    need_vec(ts[i], n, what);
    l.n.push_back(n);
    l.p.push_back(ptr(ts[i]));
    l.bf.push_back(is_bf16(ts[i]));
  }
  return l;
}

// adamw: outputs p, g, m, v per tensor; adamw_bf16: p, g, m, v, p16 (the bf16 working copy of
// p, written in the same pass).
void run_adamw_lists(const Call& c, size_t group) {
  if (c.nout() % group != 0) bad(group == 4 ? "adamw: outputs are p, g, m, v (repeated per tensor)"
                                            : "adamw_bf16: outputs are p, g, m, v, p16 (repeated per tensor)");
  ListStore p = list_of(c.call->outputs, c.nout(), 0, group, "adamw p");
  ListStore g = list_of(c.call->outputs, c.nout(), 1, group, "adamw g");
  ListStore m = list_of(c.call->outputs, c.nout(), 2, group, "adamw m");
  ListStore v = list_of(c.call->outputs, c.nout(), 3, group, "adamw v");
  for (size_t i = 0; i < p.n.size(); ++i)
    if (g.n[i] != p.n[i] || m.n[i] != p.n[i] || v.n[i] != p.n[i]) bad("adamw: p, g, m, v sizes differ");
  ListStore p16;
  TensorList p16_list;
  if (group == 5) {
    p16 = list_of(c.call->outputs, c.nout(), 4, group, "adamw_bf16 p16");
    for (size_t i = 0; i < p.n.size(); ++i)
      if (p16.n[i] != p.n[i] || !p16.bf[i]) bad("adamw_bf16: p16 must be bfloat16 of p's size");
    p16_list = p16.list();
  }
  AdamWArgs o;
  o.lr = c.num("lr", o.lr);
  o.beta1 = c.num("beta1", o.beta1);
  o.beta2 = c.num("beta2", o.beta2);
  o.eps = c.num("eps", o.eps);
  o.weight_decay = c.num("weight_decay", o.weight_decay);
  o.step = c.integer("step", 1);
  o.grad_scale = c.num("grad_scale", 1);
  o.zero_grad = c.flag("zero_grad");
  if (group == 5) o.p_bf16 = &p16_list;
  adamw(p.list(), g.list(), m.list(), v.list(), o, *c.ws, c.stream);
}
void run_adamw(const Call& c) { run_adamw_lists(c, 4); }
void run_adamw_bf16(const Call& c) { run_adamw_lists(c, 5); }

// clipped_pg_loss / nll_loss (losses.cu): fp32 operands, token-aligned (docs/ops.md). The
// attributes are read by the SDK's loss library, as kernels_cpu reads them, so both agree on
// their meaning and defaults; options losses.cu does not implement are refused at resolution
// (loss_op_refusal), so the caller keeps its host loss.
losses::ClippedPGConfig loss_config(const Call& c, losses::LossCounts* n) {
  return losses::clipped_pg_config_from_attrs([&](const char* k, double d) { return c.num(k, d); }, n);
}

void run_clipped_pg_loss(const Call& c) {
  const int64_t N = sdk::tensor_numel(c.in(0)), S = sdk::tensor_numel(c.in(4));
  for (int i : {0, 1, 2, 3}) need_vec(c.in(size_t(i)), N, "clipped_pg_loss per-token input");
  need_vec(c.in(4), S, "clipped_pg_loss sample_mask");
  need_vec(c.in(5), S + 1, "clipped_pg_loss cu_seqlens");
  need_vec(c.out(0), 1, "clipped_pg_loss loss");
  need_vec(c.out(1), N, "clipped_pg_loss dlogprobs");
  if (c.has_out(2)) need_vec(c.out(2), int64_t(losses::kClippedPgMetricCount), "clipped_pg_loss metrics");
  losses::LossCounts n;
  const losses::ClippedPGConfig cfg = loss_config(c, &n);
  ClippedPgArgs a;
  a.lp = ptr<float>(c.in(0));
  a.adv = ptr<float>(c.in(1));
  a.gen = ptr<float>(c.in(2));
  a.tm = ptr<float>(c.in(3));
  a.sm = ptr<float>(c.in(4));
  a.cu = ptr<int32_t>(c.in(5));
  if (c.has_in(6)) {
    need_vec(c.in(6), N, "clipped_pg_loss prev_logprobs");
    a.prev = ptr<float>(c.in(6));
  }
  if (c.has_in(7)) {
    need_vec(c.in(7), N, "clipped_pg_loss reference_policy_logprobs");
    a.ref = ptr<float>(c.in(7));
  }
  a.N = N;
  a.S = S;
  a.g_tok = n.valid_toks;
  a.g_seq = n.valid_seqs;
  a.token_level = cfg.token_level_loss;
  a.mode = cfg.force_on_policy_ratio ? 2 : cfg.disable_ppo_ratio ? 3 : 0;
  a.ratio_clip_min = cfg.ratio_clip_min;
  a.ratio_clip_max = cfg.ratio_clip_max;
  a.clip_c = cfg.ratio_clip_c.value_or(0.0);
  a.beta = cfg.kl_coefficient();
  a.kl_type = int(cfg.reference_policy_kl_type) + 1;
  a.kl_in = cfg.kl_input_clamp_value.value_or(0.0);
  a.kl_out = cfg.kl_output_clamp_value.value_or(0.0);
  a.on_policy_kl = cfg.use_on_policy_kl_approximation;
  a.use_is = cfg.use_importance_sampling_correction;
  if (cfg.truncated_importance_sampling_type) {
    a.tis_type = *cfg.truncated_importance_sampling_type == losses::TruncatedIsType::kTis      ? 1
                 : *cfg.truncated_importance_sampling_type == losses::TruncatedIsType::kIcePop ? 2
                                                                                               : 3;
    a.tis_hi = *cfg.truncated_importance_sampling_ratio;
    a.tis_lo = cfg.truncated_importance_sampling_ratio_min.value_or(0.0);
  }
  a.cispo = cfg.use_cispo;
  a.constant_normalizer = cfg.constant_normalizer.value_or(0.0);
  clipped_pg_loss(a, ptr<float>(c.out(0)), ptr<float>(c.out(1)), c.has_out(2) ? ptr<float>(c.out(2)) : nullptr,
                  c.stream);
}

void run_nll_loss(const Call& c) {
  const int64_t N = sdk::tensor_numel(c.in(0)), S = sdk::tensor_numel(c.in(2));
  need_vec(c.in(0), N, "nll_loss logprobs");
  need_vec(c.in(1), N, "nll_loss token_mask");
  need_vec(c.in(3), S + 1, "nll_loss cu_seqlens");
  need_vec(c.out(0), 1, "nll_loss loss");
  need_vec(c.out(1), N, "nll_loss dlogprobs");
  if (c.has_out(2)) need_vec(c.out(2), int64_t(losses::kNllMetricCount), "nll_loss metrics");
  const losses::LossCounts n = losses::nll_counts_from_attrs([&](const char* k, double d) { return c.num(k, d); });
  nll_loss(ptr<float>(c.in(0)), ptr<float>(c.in(1)), ptr<float>(c.in(2)), ptr<int32_t>(c.in(3)), N, S, n.valid_toks,
           ptr<float>(c.out(0)), ptr<float>(c.out(1)), c.has_out(2) ? ptr<float>(c.out(2)) : nullptr, c.stream);
}

// Why losses.cu cannot compute clipped_pg_loss for these attributes (empty: it can).
std::string loss_op_refusal(const losses::ClippedPGConfig& cfg) {
  if (cfg.sequence_level_importance_ratios) return "sequence_level_importance_ratios (GSPO) is not offered";
  if (cfg.positive_example_nll_weight > 0) return "positive_example_nll_weight (VAPO) is not offered";
  return {};
}

void run_sumsq(const Call& c) {
  ListStore x = list_of(c.call->inputs, c.nin(), 0, 1, "sumsq x");
  need_vec(c.out(0), 1, "sumsq out");
  sumsq(x.list(), ptr<float>(c.out(0)), *c.ws, c.stream);
}

// ---------------------------------------------------------------------------------------------
// Decoding (decode.cu): caches [B, Hkv, bs, D] with strides of their own.

// A cache operand's four strides, with its shape checked against (B, Hkv, bs, D).
void cache_strides(const rlh_tensor& t, int64_t Hkv, int64_t bs, int64_t D, int64_t out[4], const char* what) {
  if (t.ndim != 4) bad(std::string(what) + " must be [B, Hkv, bs, D]");
  if (t.shape[1] != Hkv || t.shape[2] != bs || t.shape[3] != D)
    bad(std::string(what) + ": shape differs from the keys' heads, block size or head dim");
  for (int i = 0; i < 4; ++i) out[i] = t.strides ? t.strides[i] : 0;
  if (!t.strides) {  // contiguous
    out[3] = 1;
    out[2] = D;
    out[1] = bs * D;
    out[0] = Hkv * bs * D;
  }
}

// k [R, Hkv, Dk], v [R, Hkv, Dv], slots int32 [R] -> k_cache, v_cache (in/out)
void run_kv_cache_write(const Call& c) {
  const rlh_tensor &k = c.in(0), &v = c.in(1), &kc = c.out(0), &vc = c.out(1);
  if (k.ndim != 3 || v.ndim != 3) bad("kv_cache_write: k and v must be [R, Hkv, D]");
  KvWriteArgs a;
  a.t = c.dt();
  a.R = k.shape[0];
  a.Hkv = k.shape[1];
  a.Dk = k.shape[2];
  a.Dv = v.shape[2];
  a.ldk = need_heads(k, a.R, a.Hkv, a.Dk, "kv_cache_write k");
  a.ldv = need_heads(v, a.R, a.Hkv, a.Dv, "kv_cache_write v");
  need_vec(c.in(2), a.R, "kv_cache_write slots");
  if (kc.ndim != 4) bad("kv_cache_write: k_cache must be [B, Hkv, bs, Dk]");
  a.bs = kc.shape[2];
  a.num_blocks = kc.shape[0];
  cache_strides(kc, a.Hkv, a.bs, a.Dk, a.kc_strides, "kv_cache_write k_cache");
  cache_strides(vc, a.Hkv, a.bs, a.Dv, a.vc_strides, "kv_cache_write v_cache");
  if (vc.shape[0] != a.num_blocks) bad("kv_cache_write: the caches hold different numbers of blocks");
  a.k = ptr(k);
  a.v = ptr(v);
  a.slots = ptr<int32_t>(c.in(2));
  a.k_cache = ptr(kc);
  a.v_cache = ptr(vc);
  a.err = c.err();
  kv_cache_write(a, c.stream);
}

// q [R, Hq, Dk], k_cache, v_cache, block_table int32 [R, T], positions int32 [R] -> o [R, Hq, Dv]
void run_paged_attention(const Call& c) {
  const rlh_tensor &q = c.in(0), &kc = c.in(1), &vc = c.in(2), &bt = c.in(3);
  if (q.ndim != 3 || kc.ndim != 4 || vc.ndim != 4 || bt.ndim != 2)
    bad("paged_attention: q [R,Hq,Dk], k_cache [B,Hkv,bs,Dk], v_cache [B,Hkv,bs,Dv], block_table [R,T]");
  PagedAttnArgs a;
  a.t = c.dt();
  a.R = q.shape[0];
  a.Hq = q.shape[1];
  a.Dk = q.shape[2];
  a.Hkv = kc.shape[1];
  a.bs = kc.shape[2];
  a.Dv = vc.shape[3];
  cache_strides(kc, a.Hkv, a.bs, a.Dk, a.kc_strides, "paged_attention k_cache");
  cache_strides(vc, a.Hkv, a.bs, a.Dv, a.vc_strides, "paged_attention v_cache");
  a.ldq = need_heads(q, a.R, a.Hq, a.Dk, "paged_attention q");
  a.ldo = need_heads(c.out(0), a.R, a.Hq, a.Dv, "paged_attention o");
  if (bt.shape[0] != a.R || (bt.shape[1] > 1 && bt.strides && bt.strides[1] != 1))
    bad("paged_attention: block_table must be [R, T] with rows contiguous");
  need_vec(c.in(4), a.R, "paged_attention positions");
  a.q = ptr(q);
  a.o = ptr(c.out(0));
  a.k_cache = ptr(kc);
  a.v_cache = ptr(vc);
  a.blocks = ptr<int32_t>(bt);
  a.ld_blocks = bt.strides ? bt.strides[0] : bt.shape[1];
  a.table_width = bt.shape[1];
  a.pos = ptr<int32_t>(c.in(4));
  a.scale = float(c.num("scale", 1.0 / std::sqrt(double(a.Dk))));
  a.window = c.integer("window", 0);
  a.softcap = float(c.num("softcap", 0));
  a.batch_invariant = c.flag("batch_invariant");
  if (const int64_t bytes = paged_attention_workspace_bytes(a)) a.partials = static_cast<float*>(c.ws->get(size_t(bytes)));
  paged_attention(a, c.stream);
}

// logits f32 [S, V], u f64 [S] -> tokens int32 [S], logprobs f32 [S]
void run_sample(const Call& c) {
  const rlh_tensor& z = c.in(0);
  if (z.ndim != 2) bad("sample: logits must be [S, V]");
  SampleArgs a;
  a.S = z.shape[0];
  a.V = z.shape[1];
  a.ld = need_rows(z, a.S, a.V, "sample logits");
  need_vec(c.in(1), a.S, "sample uniforms");
  need_vec(c.out(0), a.S, "sample tokens");
  need_vec(c.out(1), a.S, "sample logprobs");
  a.logits = ptr<float>(z);
  a.u = ptr<double>(c.in(1));
  a.tokens = ptr<int32_t>(c.out(0));
  a.logprobs = ptr<float>(c.out(1));
  a.temperature = c.num("temperature", 1.0);
  a.top_k = c.integer("top_k", 0);
  a.top_p = c.num("top_p", 1.0);
  a.min_p = c.num("min_p", 0.0);
  a.softcap = float(c.num("softcap", 0.0));
  if (const int64_t bytes = sample_workspace_bytes(a)) a.parts = c.ws->get(size_t(bytes));
  sample(a, c.stream);
}

void run_scale(const Call& c) {
  ListStore x = list_of(c.call->outputs, c.nout(), 0, 1, "scale x");
  scale(x.list(), float(c.num("scale", 1)), *c.ws, c.stream);
}

// ---------------------------------------------------------------------------------------------
// Mixture of experts (moe_router.cu, moe_permute.cu, grouped_gemm.cu). Operand checks are
// kernels_cpu's; what only the device can check (expert ids, row permutations, offsets) raises
// the error flag. Routing weights, probs, lse and their gradients are statistics ('s': f32 in
// a bf16 op); the router also runs in f64 (the engine's router_fp64).

void router_opts(const Call& c, RouterArgs& a) {
  a.t = c.dt();
  a.scoring = int(c.integer("scoring", 0));
  a.norm_topk_prob = c.flag("norm_topk_prob");
  a.scaling_factor = c.num("scaling_factor", 1);
  a.replay = c.flag("replay");
  a.n_group = c.integer("n_group", 1);
  a.topk_group = c.integer("topk_group", 1);
  a.err = c.err();
}

// logits [N, E] (rows may be strided), bias [E] (optional) -> weights [N, K], experts int32
// [N, K] (read with replay), probs [N, E], lse [N] (optional)
void run_moe_router_fwd(const Call& c) {
  const rlh_tensor& z = c.in(0);
  if (z.ndim != 2) bad("moe_router_fwd: logits must be [N, E]");
  RouterArgs a;
  router_opts(c, a);
  a.N = z.shape[0];
  a.E = z.shape[1];
  a.ldl = need_rows(z, a.N, a.E, "moe_router_fwd logits");
  const rlh_tensor& w = c.out(0);
  if (w.ndim != 2 || w.shape[0] != a.N) bad("moe_router_fwd: weights must be [N, K]");
  a.K = w.shape[1];
  need_vec(w, a.N * a.K, "moe_router_fwd weights");
  need_vec(c.out(1), a.N * a.K, "moe_router_fwd experts");
  need_vec(c.out(2), a.N * a.E, "moe_router_fwd probs");
  if (c.has_out(3)) {
    need_vec(c.out(3), a.N, "moe_router_fwd lse");
    a.lse = flex(c.out(3));
  }
  if (c.has_in(1)) {
    need_vec(c.in(1), a.E, "moe_router_fwd bias");
    a.bias = flex(c.in(1));
  }
  a.logits = ptr(z);
  a.weights = flex(w);
  a.experts = ptr<int32_t>(c.out(1));
  a.probs = flex(c.out(2));
  moe_router_fwd(a, c.stream);
}

// dweights [N, K], probs [N, E], experts int32 [N, K], dprobs [N, E] (optional), dlse [N]
// (optional) -> dlogits [N, E] (rows may be strided)
void run_moe_router_bwd(const Call& c) {
  const rlh_tensor& p = c.in(1);
  if (p.ndim != 2 || c.in(0).ndim != 2) bad("moe_router_bwd: probs must be [N, E], dweights [N, K]");
  RouterArgs a;
  router_opts(c, a);
  a.N = p.shape[0];
  a.E = p.shape[1];
  a.K = c.in(0).shape[1];
  need_vec(c.in(0), a.N * a.K, "moe_router_bwd dweights");
  need_vec(p, a.N * a.E, "moe_router_bwd probs");
  need_vec(c.in(2), a.N * a.K, "moe_router_bwd experts");
  if (c.has_in(3)) {
    need_vec(c.in(3), a.N * a.E, "moe_router_bwd dprobs");
    a.dprobs = flex(c.in(3));
  }
  if (c.has_in(4)) {
    need_vec(c.in(4), a.N, "moe_router_bwd dlse");
    a.dlse = flex(c.in(4));
  }
  a.lddl = need_rows(c.out(0), a.N, a.E, "moe_router_bwd dlogits");
  a.dweights = flex(c.in(0));
  a.probs = flex(p);
  a.experts = ptr<int32_t>(c.in(2));
  a.dlogits = ptr(c.out(0));
  moe_router_bwd(a, c.stream);
}

// x [N, C], experts int32 [N, K] -> xp [N*K, C], row int32 [N, K], offsets int32 [E+1]
void run_moe_permute_fwd(const Call& c) {
  const rlh_tensor& x = c.in(0);
  if (x.ndim != 2 || c.in(1).ndim != 2) bad("moe_permute_fwd: x must be [N, C], experts [N, K]");
  const int64_t N = x.shape[0], C = x.shape[1], K = c.in(1).shape[1];
  const int64_t E = numel(c.out(2)) - 1;
  if (E < 1) bad("moe_permute_fwd: offsets must be [E+1], E >= 1");
  const int64_t ldx = need_rows(x, N, C, "moe_permute_fwd x");
  need_vec(c.in(1), N * K, "moe_permute_fwd experts");
  const int64_t ldxp = need_rows(c.out(0), N * K, C, "moe_permute_fwd xp");
  need_vec(c.out(1), N * K, "moe_permute_fwd row");
  need_vec(c.out(2), E + 1, "moe_permute_fwd offsets");
  moe_permute_fwd(c.dt(), ptr(c.out(0)), ldxp, ptr<int32_t>(c.out(1)), ptr<int32_t>(c.out(2)),
                  ptr(x), ldx, ptr<int32_t>(c.in(1)), N, K, C, E, c.err(), *c.ws, c.stream);
}

// dxp [N*K, C], row int32 [N, K] -> dx [N, C]
void run_moe_permute_bwd(const Call& c) {
  const rlh_tensor& dx = c.out(0);
  if (dx.ndim != 2 || c.in(1).ndim != 2) bad("moe_permute_bwd: dx must be [N, C], row [N, K]");
  const int64_t N = dx.shape[0], C = dx.shape[1], K = c.in(1).shape[1];
  const int64_t lddxp = need_rows(c.in(0), N * K, C, "moe_permute_bwd dxp");
  need_vec(c.in(1), N * K, "moe_permute_bwd row");
  const int64_t lddx = need_rows(dx, N, C, "moe_permute_bwd dx");
  moe_permute_bwd(c.dt(), ptr(dx), lddx, ptr(c.in(0)), lddxp, ptr<int32_t>(c.in(1)), N, K, C,
                  c.flag("accumulate"), c.err(), *c.ws, c.stream);
}

// yp [N*K, C], row int32 [N, K], weights [N, K] -> y [N, C]
void run_moe_unpermute_fwd(const Call& c) {
  const rlh_tensor& y = c.out(0);
  if (y.ndim != 2 || c.in(1).ndim != 2) bad("moe_unpermute_fwd: y must be [N, C], row [N, K]");
  const int64_t N = y.shape[0], C = y.shape[1], K = c.in(1).shape[1];
  const int64_t ldyp = need_rows(c.in(0), N * K, C, "moe_unpermute_fwd yp");
  need_vec(c.in(1), N * K, "moe_unpermute_fwd row");
  need_vec(c.in(2), N * K, "moe_unpermute_fwd weights");
  const int64_t ldy = need_rows(y, N, C, "moe_unpermute_fwd y");
  moe_unpermute_fwd(c.dt(), ptr(y), ldy, ptr(c.in(0)), ldyp, ptr<int32_t>(c.in(1)),
                    flex(c.in(2)), N, K, C, c.flag("accumulate"), c.err(), *c.ws, c.stream);
}

// dy [N, C], yp [N*K, C], row int32 [N, K], weights [N, K] -> dyp [N*K, C], dweights [N, K]
// (optional)
void run_moe_unpermute_bwd(const Call& c) {
  const rlh_tensor& dy = c.in(0);
  if (dy.ndim != 2 || c.in(2).ndim != 2) bad("moe_unpermute_bwd: dy must be [N, C], row [N, K]");
  const int64_t N = dy.shape[0], C = dy.shape[1], K = c.in(2).shape[1];
  const int64_t lddy = need_rows(dy, N, C, "moe_unpermute_bwd dy");
  const int64_t ldyp = need_rows(c.in(1), N * K, C, "moe_unpermute_bwd yp");
  need_vec(c.in(2), N * K, "moe_unpermute_bwd row");
  need_vec(c.in(3), N * K, "moe_unpermute_bwd weights");
  const int64_t lddyp = need_rows(c.out(0), N * K, C, "moe_unpermute_bwd dyp");
  Flex dw;
  if (c.has_out(1)) {
    need_vec(c.out(1), N * K, "moe_unpermute_bwd dweights");
    dw = flex(c.out(1));
  }
  moe_unpermute_bwd(c.dt(), ptr(c.out(0)), lddyp, dw, ptr(dy), lddy, ptr(c.in(1)), ldyp,
                    ptr<int32_t>(c.in(2)), flex(c.in(3)), N, K, C, c.err(), *c.ws, c.stream);
}

// A, B, offsets int32 [G+1] -> C. transpose_a = 0: A [T, K], B [G, K, N] ([G, N, K] with
// transpose_b), C [T, N]. transpose_a = 1: A [T, M], B [T, N], C [G, M, N]. The group axis of a
// 3-D operand may have any stride; rows any stride >= the row; last dimension contiguous.
// C may be f32 in a bf16 op (dW accumulated into fp32 gradients with beta = 1). The offsets are
// never read on the host (offsets[G] = T is checked on the device).
void run_grouped_gemm(const Call& c) {
  GroupedGemmArgs g;
  g.ta = c.flag("transpose_a");
  g.tb = c.flag("transpose_b");
  g.alpha = c.num("alpha", 1);
  g.beta = c.num("beta", 0);
  const rlh_tensor &A = c.in(0), &B = c.in(1), &Cm = c.out(0);
  g.G = numel(c.in(2)) - 1;
  if (g.G < 1) bad("grouped_gemm: offsets must be [G+1], G >= 1");
  need_vec(c.in(2), g.G + 1, "grouped_gemm offsets");
  if (A.ndim != 2) bad("grouped_gemm: A must be 2-D");
  g.T = A.shape[0];
  auto mat3 = [&](const rlh_tensor& t, int64_t rows, int64_t cols, const char* what,
                  int64_t* ld) -> int64_t {
    if (t.ndim != 3 || t.shape[0] != g.G || t.shape[1] != rows || t.shape[2] != cols)
      bad(std::string(what) + ": expected shape [" + std::to_string(g.G) + ", " +
          std::to_string(rows) + ", " + std::to_string(cols) + "]");
    if (cols > 1 && t.strides[2] != 1) bad(std::string(what) + ": last dimension must be contiguous");
    if (rows > 1 && t.strides[1] < cols) bad(std::string(what) + ": rows overlap");
    *ld = rows > 1 ? t.strides[1] : cols;
    return g.G > 1 ? t.strides[0] : rows * *ld;
  };
  if (!g.ta) {
    g.K = A.shape[1];
    if (B.ndim != 3) bad("grouped_gemm: B must be [G, K, N] or [G, N, K]");
    g.N = g.tb ? B.shape[1] : B.shape[2];
    g.lda = need_rows(A, g.T, g.K, "grouped_gemm A");
    g.stride_b = g.tb ? mat3(B, g.N, g.K, "grouped_gemm B", &g.ldb) : mat3(B, g.K, g.N, "grouped_gemm B", &g.ldb);
    g.ldc = need_rows(Cm, g.T, g.N, "grouped_gemm C");
  } else {
    if (g.tb) bad("grouped_gemm: transpose_b with transpose_a is not offered");
    g.M = A.shape[1];
    if (B.ndim != 2 || B.shape[0] != g.T) bad("grouped_gemm: B must be [T, N] with transpose_a");
    g.N = B.shape[1];
    g.lda = need_rows(A, g.T, g.M, "grouped_gemm A");
    g.ldb = need_rows(B, g.T, g.N, "grouped_gemm B");
    g.stride_c = mat3(Cm, g.M, g.N, "grouped_gemm C", &g.ldc);
  }
  g.offsets = ptr<int32_t>(c.in(2));
  g.A = ptr(A);
  g.B = ptr(B);
  g.C = ptr(Cm);
  g.ab = c.dt();
  g.c_dt = is_bf16(Cm) ? DType::bf16 : DType::f32;
  g.err = c.err();
  g.force_simt = c.flag("force_simt");
  grouped_gemm(g, c.stream);
}

// ---------------------------------------------------------------------------------------------
// The op table. Operand kinds: f = the op's dtype (f32 or bf16), i = int32, k = float32,
// d = float64, s = statistic / parameter gradient (f32, or bf16 in a bf16 op), g = f32 or bf16
// in any op.

struct OpSpec {
  const char* name;
  const char* inputs;
  size_t min_inputs;
  const char* outputs;
  size_t min_outputs;
  const char* backward;
  bool bf16;        // offered in bf16
  bool variadic_in;  // inputs repeat the last kind (sumsq)
  bool variadic_out; // outputs repeat the kind pattern (adamw: 4, scale: 1)
  void (*run)(const Call&);
  bool batch_invariant;
};

const OpSpec kOps[] = {
    {"gemm", "ffs", 2, "s", 1, "gemm", true, false, false, run_gemm, false},
    {"embedding_fwd", "if", 2, "f", 1, "embedding_bwd", true, false, false, run_embedding_fwd, true},
    {"embedding_bwd", "if", 2, "s", 1, "", true, false, false, run_embedding_bwd, false},
    {"rmsnorm_fwd", "ff", 2, "fs", 1, "rmsnorm_bwd", true, false, false, run_rmsnorm_fwd, true},
    {"rmsnorm_bwd", "fffs", 4, "fs", 1, "", true, false, false, run_rmsnorm_bwd, false},
    {"gemm_glu_fwd", "ff", 2, "f", 1, "", true, false, false, run_gemm_glu_fwd, false},
    {"add_rmsnorm_fwd", "fff", 3, "ff", 2, "", true, false, false, run_add_rmsnorm_fwd, true},
    {"rope_fwd", "fik", 3, "f", 1, "rope_bwd", true, false, false, run_rope_fwd, true},
    {"rope_bwd", "fik", 3, "f", 1, "", true, false, false, run_rope_bwd, true},
    {"attention_fwd", "fffi", 4, "fs", 2, "attention_bwd", true, false, false, run_attention_fwd, false},
    {"attention_bwd", "fffffsi", 7, "fff", 3, "", true, false, false, run_attention_bwd, false},
    {"swiglu_fwd", "ff", 2, "f", 1, "swiglu_bwd", true, false, false, run_swiglu_fwd, true},
    {"swiglu_bwd", "fff", 3, "ff", 2, "", true, false, false, run_swiglu_bwd, true},
    {"geglu_fwd", "ff", 2, "f", 1, "geglu_bwd", true, false, false, run_geglu_fwd, true},
    {"geglu_bwd", "fff", 3, "ff", 2, "", true, false, false, run_geglu_bwd, true},
    {"bias_add_fwd", "f", 1, "f", 1, "bias_bwd", true, false, false, run_bias_add_fwd, true},
    {"bias_bwd", "f", 1, "s", 1, "", true, false, false, run_bias_bwd, false},
    {"add_fwd", "ff", 2, "f", 1, "", true, false, false, run_add_fwd, true},
    {"linear_logprob_fwd", "ffi", 3, "sssk", 2, "linear_logprob_bwd", true, false, false,
     run_linear_logprob_fwd, false},
    {"linear_logprob_bwd", "ffissssk", 4, "fs", 2, "", true, false, false, run_linear_logprob_bwd, false},
    {"adamw", "", 0, "kgkk", 4, "", false, false, true, run_adamw, true},
    {"adamw_bf16", "", 0, "kgkkg", 5, "", false, false, true, run_adamw_bf16, true},
    {"sumsq", "g", 1, "k", 1, "", false, true, false, run_sumsq, false},
    {"scale", "", 0, "g", 1, "", false, false, true, run_scale, true},
    {"kv_cache_write", "ffi", 3, "ff", 2, "", true, false, false, run_kv_cache_write, true},
    {"paged_attention", "fffii", 5, "f", 1, "", true, false, false, run_paged_attention, false},
    {"sample", "kd", 2, "ik", 2, "", false, false, false, run_sample, true},
    {"moe_router_fwd", "fs", 1, "siss", 3, "moe_router_bwd", true, false, false, run_moe_router_fwd, true},
    {"moe_router_bwd", "ssiss", 3, "f", 1, "", true, false, false, run_moe_router_bwd, true},
    {"moe_permute_fwd", "fi", 2, "fii", 3, "moe_permute_bwd", true, false, false, run_moe_permute_fwd, true},
    {"moe_permute_bwd", "fi", 2, "f", 1, "", true, false, false, run_moe_permute_bwd, true},
    {"moe_unpermute_fwd", "fis", 3, "f", 1, "moe_unpermute_bwd", true, false, false, run_moe_unpermute_fwd, true},
    {"moe_unpermute_bwd", "ffis", 4, "fs", 1, "", true, false, false, run_moe_unpermute_bwd, true},
    {"grouped_gemm", "ffi", 3, "s", 1, "grouped_gemm", true, false, false, run_grouped_gemm, false},
    {"clipped_pg_loss", "kkkkkikkk", 6, "kkk", 2, "", false, false, false, run_clipped_pg_loss, false},
    {"nll_loss", "kkki", 4, "kkk", 2, "", false, false, false, run_nll_loss, false},
};

const OpSpec* find_op(const char* name) {
  for (const OpSpec& s : kOps)
    if (name && std::strcmp(s.name, name) == 0) return &s;
  return nullptr;
}

bool same(rlh_dtype a, rlh_dtype b) { return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes; }

// Checks counts, devices and dtypes; returns the op's dtype or throws UNIMPLEMENTED.
DType check_operands(const OpSpec& s, const rlh_kernels* inst, const rlh_tensor* ins, size_t nin,
                     const rlh_tensor* outs, size_t nout) {
  auto unimpl = [&](const std::string& why) {
    throw Error(RLH_E_UNIMPLEMENTED, std::string("kernels_cuda ") + s.name + ": " + why);
  };
  const size_t max_in = std::strlen(s.inputs), max_out = std::strlen(s.outputs);
  if (nin < s.min_inputs || (!s.variadic_in && nin > max_in)) unimpl("wrong number of inputs");
  if (nout < s.min_outputs || (!s.variadic_out && nout > max_out)) unimpl("wrong number of outputs");
  if (s.variadic_out && max_out > 0 && nout % max_out != 0) unimpl("outputs must repeat in groups");
  int fdt = -1;  // 0 f32, 1 bf16, 2 f64 (the MoE router only: the engine's router_fp64)
  const bool f64_ok = std::strncmp(s.name, "moe_router", 10) == 0;
  std::vector<std::pair<const rlh_tensor*, char>> flexes;
  auto visit = [&](const rlh_tensor& t, char kind) {
    if (t.data == nullptr && kind != 'f') return;  // absent optional operand
    const int dev = t.device.device_type;
    if ((dev != RLH_DEVICE_CUDA && dev != RLH_DEVICE_CUDA_MANAGED) ||
        t.device.device_id != inst->device.device_id)
      unimpl("operands must be in CUDA memory of cuda:" + std::to_string(inst->device.device_id));
    const bool f32 = same(t.dtype, sdk::kF32), bf = same(t.dtype, sdk::kBF16);
    const bool f64 = f64_ok && same(t.dtype, sdk::kF64);
    switch (kind) {
      case 'i':
        if (!same(t.dtype, sdk::kI32)) unimpl("index operands must be int32");
        break;
      case 'k':
        if (!f32) unimpl("this operand must be float32");
        break;
      case 'd':
        if (!same(t.dtype, sdk::kF64)) unimpl("this operand must be float64");
        break;
      case 'g':
        if (!f32 && !bf) unimpl("operands must be float32 or bfloat16");
        break;
      case 's':
        if (!f32 && !bf && !f64) unimpl("operands must be float32 or bfloat16");
        flexes.push_back({&t, kind});
        break;
      default: {
        const int d = f32 ? 0 : bf ? 1 : f64 ? 2 : -1;
        if (d < 0) unimpl(std::string("dtype ") + sdk::dtype_name(t.dtype) + " not offered");
        if (fdt >= 0 && d != fdt) unimpl("float operands must share one dtype");
        fdt = d;
      }
    }
  };
  for (size_t i = 0; i < nin; ++i)
    visit(ins[i], s.variadic_in ? s.inputs[std::min(i, max_in - 1)] : s.inputs[i]);
  for (size_t i = 0; i < nout; ++i) visit(outs[i], s.variadic_out ? s.outputs[i % max_out] : s.outputs[i]);
  if (fdt == 1 && !s.bf16) unimpl("bfloat16 is not offered for this op");
  // In an f32 op every statistic is f32 too; an f64 op (router) is f64 throughout.
  if (fdt != 1)
    for (auto& [t, k] : flexes)
      if (!same(t->dtype, fdt == 2 ? sdk::kF64 : sdk::kF32))
        unimpl(fdt == 2 ? "a float64 op takes float64 operands only"
                        : "a float32 op takes float32 statistics and gradients");
  if (fdt == 1)
    for (auto& [t, k] : flexes)
      if (same(t->dtype, sdk::kF64)) unimpl("float64 operands only in a float64 op");
  return fdt == 1 ? DType::bf16 : fdt == 2 ? DType::f64 : DType::f32;
}

// ---------------------------------------------------------------------------------------------
// The KERNELS table

void log(const rlh_host_api* host, int32_t level, const std::string& msg) {
  if (host && host->log) host->log(host->ctx, level, msg.data(), msg.size());
}

rlh_status* k_create(const rlh_host_api* host, rlh_device device, const char*, size_t,
                     rlh_kernels** out) {
  const sdk::MakeStatusFn make = host ? host->make_status : nullptr;
  return sdk::guard(make, [&] {
    if (device.device_type != RLH_DEVICE_CUDA)
      throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda runs on CUDA devices only");
    if (!g_make_status) g_make_status = make;
    int count = 0;
    const cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess || count == 0)
      throw Error(RLH_E_UNAVAILABLE, std::string("kernels_cuda: no CUDA device: ") +
                                         (ce != cudaSuccess ? cudaGetErrorString(ce) : "0 devices"));
    if (device.device_id < 0 || device.device_id >= count)
      throw Error(RLH_E_INVALID_ARGUMENT, "kernels_cuda: no device cuda:" + std::to_string(device.device_id));
    cudaDeviceProp prop{};
    cuda_ck(cudaGetDeviceProperties(&prop, device.device_id), "device properties");
    if (prop.major != 9 || prop.minor != 0)
      throw Error(RLH_E_UNIMPLEMENTED, std::string("kernels_cuda is built for sm_90a (Hopper); cuda:") +
                                           std::to_string(device.device_id) + " (" + prop.name +
                                           ") is sm_" + std::to_string(prop.major * 10 + prop.minor));
    int prev = 0;
    cudaGetDevice(&prev);
    cuda_ck(cudaSetDevice(device.device_id), "set device");
    auto k = std::make_unique<rlh_kernels>();
    k->host = host;
    k->device = device;
    k->info.device = device.device_id;
    k->info.sm_count = prop.multiProcessorCount;
    k->info.cc_major = prop.major;
    k->info.cc_minor = prop.minor;
    k->info.smem_optin = prop.sharedMemPerBlockOptin;
    k->check = std::getenv("RLH_KCUDA_CHECK") && std::strcmp(std::getenv("RLH_KCUDA_CHECK"), "0") != 0;
    cudaMemPoolProps pp{};
    pp.allocType = cudaMemAllocationTypePinned;
    pp.location.type = cudaMemLocationTypeDevice;
    pp.location.id = device.device_id;
    cuda_ck(cudaMemPoolCreate(&k->pool, &pp), "memory pool");
    uint64_t keep = UINT64_MAX;  // keep freed workspace cached in the pool
    cudaMemPoolSetAttribute(k->pool, cudaMemPoolAttrReleaseThreshold, &keep);
    cuda_ck(cudaMalloc(reinterpret_cast<void**>(&k->err), sizeof(int)), "error flag");
    cuda_ck(cudaMemset(k->err, 0, sizeof(int)), "error flag");
    try {
      k->gemm = gemm_engine_create(k->info);
    } catch (const std::exception& e) {
      cudaFree(k->err);
      cudaMemPoolDestroy(k->pool);
      throw Error(RLH_E_UNAVAILABLE, std::string("kernels_cuda: ") + e.what());
    }
    cudaSetDevice(prev);
    log(host, RLH_LOG_INFO,
        std::string("kernels_cuda: cuda:") + std::to_string(device.device_id) + " " + prop.name +
            " (sm_90, " + std::to_string(prop.multiProcessorCount) + " SMs); " +
            gemm_engine_info(k->gemm));
    *out = k.release();
  });
}

void k_destroy(rlh_kernels* k) {
  if (!k) return;
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(k->device.device_id);
  gemm_engine_destroy(k->gemm);
  cudaFree(k->err);
  cudaMemPoolDestroy(k->pool);
  cudaSetDevice(prev);
  delete k;
}

rlh_status* k_list_ops(rlh_kernels*, rlh_write_fn write, void* user) {
  return sdk::guard(g_make_status, [&] {
    std::string j = "[";
    for (const OpSpec& s : kOps) {
      if (j.size() > 1) j += ",";
      j += std::string("{\"name\":\"") + s.name + "\",\"dtypes\":[\"f32\"" +
           (s.bf16 ? ",\"bf16\"" : "") +
           (std::strncmp(s.name, "moe_router", 10) == 0 ? ",\"f64\"" : "") +
           "],\"backward\":\"" + s.backward + "\"}";
    }
    j += "]";
    write(user, j.data(), j.size());
  });
}

bool withheld(const char* name) {
  static const std::string list = [] {
    const char* e = std::getenv("RLH_KCUDA_WITHHOLD");
    return "," + std::string(e ? e : "") + ",";
  }();
  return list.find("," + std::string(name) + ",") != std::string::npos;
}

rlh_status* k_get_op(rlh_kernels* k, const rlh_op_desc* d, rlh_op** out) {
  return sdk::guard(g_make_status, [&] {
    const OpSpec* s = find_op(d->name);
    if (!s) throw Error(RLH_E_UNIMPLEMENTED, std::string("kernels_cuda has no op '") + (d->name ? d->name : "") + "'");
    // RLH_KCUDA_WITHHOLD="op,op": this provider answers none of them, so a registry falls through
    // to the next provider and an optional fused op's callers run the ops it fuses (the A/B of
    // the decoding benchmark; docs/kernels_cuda.md).
    if (withheld(s->name))
      throw Error(RLH_E_UNIMPLEMENTED, std::string("kernels_cuda: ") + s->name + " withheld (RLH_KCUDA_WITHHOLD)");
    if (d->device.device_type != RLH_DEVICE_CUDA || d->device.device_id != k->device.device_id)
      throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda: op asked for another device");
    const DType dt = check_operands(*s, k, d->inputs, d->num_inputs, d->outputs, d->num_outputs);
    if (std::strcmp(s->name, "gemm_glu_fwd") == 0 && dt != DType::bf16)
      throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda gemm_glu_fwd: bf16 only");
    auto op = std::make_unique<rlh_op>();
    op->spec = s;
    op->dt = dt;
    op->inst = k;
    for (size_t i = 0; i < d->num_attrs; ++i) {
      const rlh_named_value& a = d->attrs[i];
      if (!a.name) continue;
      op->attrs.push_back(Attr{a.name, a.type, a.int64_value, a.double_value});
    }
    // Soft-capping (Gemma-2's "softcap") is offered by attention (on the CUDA-core kernels: the
    // tensor-core ones do not cap), paged_attention, linear_logprob and sample; a value that is
    // not a finite number >= 0 is refused here, before a step.
    for (const Attr& a : op->attrs)
      if (a.name == "softcap") {
        const double c = a.type == RLH_VALUE_DOUBLE ? a.d : double(a.i);
        if (!(c >= 0) || !std::isfinite(c))
          throw Error(RLH_E_INVALID_ARGUMENT, std::string("kernels_cuda ") + s->name + ": softcap must be a finite number >= 0");
      }
    // Answers known at resolution: gemm's batch invariance for C = A B^T only (a registry then
    // falls through for the rest), filtered logprobs, attention head dims.
    if (std::strcmp(s->name, "gemm") == 0) {
      auto attr = [&](const char* n, double dflt) {
        for (const Attr& x : op->attrs)
          if (x.name == n) return x.type == RLH_VALUE_DOUBLE ? x.d : double(x.i);
        return dflt;
      };
      if (attr("batch_invariant", 0) != 0 &&
          (attr("transpose_a", 0) != 0 || attr("transpose_b", 1) == 0 ||
           (d->shapes_valid && d->num_inputs > 0 && d->inputs[0].ndim != 2)))
        throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda gemm: batch_invariant is offered for 2-D C = A B^T only");
    }
    if (std::strncmp(s->name, "linear_logprob", 14) == 0) {
      for (const Attr& a : op->attrs) {
        const double v = a.type == RLH_VALUE_DOUBLE ? a.d : double(a.i);
        if ((a.name == "top_k" && v > 0) || (a.name == "top_p" && v < 1))
          throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda linear_logprob: top_k/top_p filtering is not offered");
      }
    }
    if (std::strcmp(s->name, "clipped_pg_loss") == 0) {
      // The config is checked now (a bad one is INVALID_ARGUMENT naming the loss_fn key) and an
      // option losses.cu lacks is an answer, so the caller keeps its host loss.
      std::vector<rlh_named_value> attrs(d->attrs, d->attrs + d->num_attrs);
      const losses::ClippedPGConfig cfg = losses::clipped_pg_config_from_attrs(
          [&](const char* k, double dflt) {
            const rlh_named_value* a = sdk::find_attr(attrs.data(), attrs.size(), k);
            return a == nullptr ? dflt : a->type == RLH_VALUE_DOUBLE ? a->double_value : double(a->int64_value);
          },
          nullptr);
      const std::string why = loss_op_refusal(cfg);
      if (!why.empty()) throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda clipped_pg_loss: " + why);
    }
    if (d->shapes_valid && std::strncmp(s->name, "attention", 9) == 0) {
      const rlh_tensor& q = d->inputs[std::strcmp(s->name, "attention_bwd") == 0 ? 1 : 0];
      const rlh_tensor& v = d->inputs[std::strcmp(s->name, "attention_bwd") == 0 ? 3 : 2];
      if (q.ndim == 3 && v.ndim == 3 && (q.shape[2] > 256 || v.shape[2] > 256))
        throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda attention: head dims above 256");
    }
    *out = op.release();
  });
}

rlh_status* k_op_info(rlh_op* op, rlh_op_info* out) {
  return sdk::guard(g_make_status, [&] {
    rlh_op_info info{};
    // No atomics in any result (every output element has one writer, reductions run in a fixed
    // order), so reruns are bitwise equal. Row-wise ops are batch-invariant; GEMMs (cuBLASLt
    // picks kernels by shape), attention (tiles follow token positions), reductions and the
    // logprob head (its GEMM) are not.
    // gemm asked for batch invariance runs grouped_gemm.cu's fixed-order tiles (run_gemm_rows);
    // paged_attention asked for it keeps every row in one partition (paged_attention_mma.cu).
    bool rows = false;
    if (std::strcmp(op->spec->name, "gemm") == 0 || std::strcmp(op->spec->name, "paged_attention") == 0)
      for (const Attr& a : op->attrs)
        rows = rows || (a.name == "batch_invariant" && (a.type == RLH_VALUE_DOUBLE ? a.d : double(a.i)) != 0);
    info.batch_invariant = op->spec->batch_invariant || rows ? 1 : 0;
    info.deterministic = 1;
    info.stateful = 0;
    info.workspace_bytes = 0;
    const size_t n = std::min(out->struct_size, sizeof(rlh_op_info));
    if (n > sizeof(size_t))
      std::memcpy(reinterpret_cast<char*>(out) + sizeof(size_t),
                  reinterpret_cast<const char*>(&info) + sizeof(size_t), n - sizeof(size_t));
  });
}

rlh_status* k_run(rlh_op* op, const rlh_op_call* call) {
  return sdk::guard(g_make_status, [&] {
    const OpSpec& s = *op->spec;
    rlh_kernels* k = op->inst;
    if (check_operands(s, k, call->inputs, call->num_inputs, call->outputs, call->num_outputs) != op->dt)
      throw Error(RLH_E_INVALID_ARGUMENT, std::string(s.name) + ": dtype differs from the resolved op");
    int prev = -1;
    cudaGetDevice(&prev);
    if (prev != k->device.device_id) cuda_ck(cudaSetDevice(k->device.device_id), "set device");
    struct Restore {
      int prev, dev;
      ~Restore() { if (prev >= 0 && prev != dev) cudaSetDevice(prev); }
    } restore{prev, k->device.device_id};
    const auto stream = static_cast<cudaStream_t>(call->stream);
    {
      CallWorkspace ws(k, call->workspace, call->workspace_bytes, stream);
      Call c{op, call, &ws, stream};
      s.run(c);
    }
    if (k->check) {
      cuda_ck(cudaStreamSynchronize(stream), s.name);
      cuda_ck(cudaGetLastError(), s.name);
      int flag = 0;
      cuda_ck(cudaMemcpy(&flag, k->err, sizeof(int), cudaMemcpyDeviceToHost), "error flag");
      if (flag) {
        cudaMemset(k->err, 0, sizeof(int));
        bad(std::string(s.name) + ": an id or target is outside [0, V)");
      }
    }
  });
}

void k_release_op(rlh_op* op) { delete op; }

// Operands live in the instance's device memory: the memory services let a caller that knows
// nothing of CUDA (the conformance runner) stage them.
rlh_status* k_provider_info(rlh_kernels*, rlh_write_fn write, void* user) {
  return sdk::guard(g_make_status, [&] {
    static const char kInfo[] = "{\"reference\":false,\"memory\":\"device\"}";
    write(user, kInfo, sizeof(kInfo) - 1);
  });
}

// Runs f with the instance's device current, restoring the caller's after.
template <class F>
void on_device(const rlh_kernels* k, F&& f) {
  int prev = -1;
  cudaGetDevice(&prev);
  if (prev != k->device.device_id) cuda_ck(cudaSetDevice(k->device.device_id), "set device");
  struct Restore {
    int prev, dev;
    ~Restore() { if (prev >= 0 && prev != dev) cudaSetDevice(prev); }
  } restore{prev, k->device.device_id};
  f();
}

rlh_status* k_memory_alloc(rlh_kernels* k, size_t bytes, void** out) {
  return sdk::guard(g_make_status, [&] {
    if (out == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "memory_alloc: out is NULL");
    on_device(k, [&] {
      const cudaError_t e = cudaMalloc(out, std::max<size_t>(bytes, 1));
      if (e != cudaSuccess)
        throw Error(RLH_E_RESOURCE_EXHAUSTED, "kernels_cuda: cudaMalloc of " + std::to_string(bytes) +
                                                  " bytes: " + cudaGetErrorString(e));
    });
  });
}

void k_memory_free(rlh_kernels* k, void* p) {
  if (p == nullptr) return;
  try {
    on_device(k, [&] { cudaFree(p); });
  } catch (...) {
  }
}

rlh_status* k_memory_copy(rlh_kernels* k, void* dst, const void* src, size_t bytes, int32_t dir,
                          void* stream) {
  return sdk::guard(g_make_status, [&] {
    cudaMemcpyKind kind;
    switch (dir) {
      case RLH_COPY_HOST_TO_DEVICE: kind = cudaMemcpyHostToDevice; break;
      case RLH_COPY_DEVICE_TO_HOST: kind = cudaMemcpyDeviceToHost; break;
      case RLH_COPY_DEVICE_TO_DEVICE: kind = cudaMemcpyDeviceToDevice; break;
      default: throw Error(RLH_E_INVALID_ARGUMENT, "memory_copy: unknown direction " + std::to_string(dir));
    }
    if (bytes == 0) return;
    on_device(k, [&] {
      cuda_ck(cudaMemcpyAsync(dst, src, bytes, kind, static_cast<cudaStream_t>(stream)), "memory_copy");
    });
  });
}

rlh_status* k_synchronize(rlh_kernels* k, void* stream) {
  return sdk::guard(g_make_status, [&] {
    on_device(k, [&] {
      cuda_ck(stream ? cudaStreamSynchronize(static_cast<cudaStream_t>(stream)) : cudaDeviceSynchronize(),
              "synchronize");
    });
  });
}

const rlh_kernels_api kApi = [] {
  rlh_kernels_api a{};
  a.struct_size = RLH_STRUCT_SIZE(rlh_kernels_api, workspace_size);
  a.create = k_create;
  a.destroy = k_destroy;
  a.list_ops = k_list_ops;
  a.get_op = k_get_op;
  a.op_info = k_op_info;
  a.run = k_run;
  a.release_op = k_release_op;
  a.state_save = nullptr;
  a.state_load = nullptr;
  a.provider_info = k_provider_info;
  a.memory_alloc = k_memory_alloc;
  a.memory_free = k_memory_free;
  a.memory_copy = k_memory_copy;
  a.synchronize = k_synchronize;
  a.workspace_size = nullptr;  // scratch comes from the call's workspace or the instance's pool
  return a;
}();

// Can it run here? Cheap: counts devices (which loads libcuda.so.1 through the static runtime,
// if present) and reads their compute capability; keeps nothing.
rlh_status* probe(const rlh_host_api* host, int32_t* score, rlh_write_fn write, void* user) {
  return sdk::guard(host ? host->make_status : nullptr, [&] {
    auto say = [&](const std::string& m) { if (write) write(user, m.data(), m.size()); };
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
      *score = 0;
      say(std::string("no CUDA device: ") + (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices"));
      return;
    }
    std::string found;
    int hopper = 0;
    for (int i = 0; i < count; ++i) {
      cudaDeviceProp p{};
      if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
      found += std::string(found.empty() ? "" : ", ") + "cuda:" + std::to_string(i) + " " + p.name +
               " sm_" + std::to_string(p.major * 10 + p.minor);
      hopper += p.major == 9 && p.minor == 0;
    }
    if (hopper == 0) {
      *score = 0;
      say("kernels_cuda is built for sm_90a (Hopper) only; found " + found);
      return;
    }
    *score = 10;
    say(found);
  });
}

const rlh_component_desc kComponent =
    sdk::component_desc(RLH_KIND_KERNELS, "kernels_cuda", "0.1.0", RLH_KERNELS_API_VERSION_MAJOR,
                        RLH_KERNELS_API_VERSION_MINOR, &kApi,
                        "CUDA kernels for Hopper (sm_90a): cuBLASLt GEMMs, flash attention on "
                        "tensor cores, fused norms/rope/swiglu/logprob head, multi-tensor AdamW");
const rlh_component_desc* const kComponents[] = {&kComponent};

rlh_plugin_desc make_desc() {
  rlh_plugin_desc d = sdk::plugin_desc("kernels_cuda", "0.1.0", "rlhost", kComponents,
                                       "CUDA kernel provider (bf16/f32, sm_90a)");
  d.probe = probe;
  return d;
}

}  // namespace
}  // namespace rlh::kcuda

RLH_DEFINE_PLUGIN(rlh::kcuda::make_desc());
