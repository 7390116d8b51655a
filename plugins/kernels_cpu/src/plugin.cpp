// The kernels_cpu plugin: kernels_cpu's ops behind the C ABI's KERNELS component
// (abi/include/rlhost/kernels.h). Operands, attributes and semantics of every op are those of
// docs/ops.md; this file only checks descriptors and unpacks them into the typed calls of
// kernels.hpp (float32 and float64; the optimizer ops float32). The decoding ops are in
// ops_decode.cpp; what both files share (the handles, one call's operands, the checks) in
// op_call.hpp.
//
// Tensors: row-major with a unit stride in the last dimension; the leading (token) dimension
// may have any stride >= the row, so ops read q/k/v or gate/up out of one fused buffer. A [N,H,D]
// operand must have strides (ld, D, 1). An optional operand is absent when its data is NULL.
// Workspace: taken from rlh_op_call.workspace when the caller gives one, else from the host's
// allocation service (so the host counts it), else the heap.
#include <algorithm>
#include <limits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/kernels.h"
#include "rlhost/kernels_cpu/blas.hpp"
#include "rlhost/kernels_cpu/kernels.hpp"
#include "rlhost/losses/clipped_pg_loss.hpp"
#include "rlhost/losses/loss_ops.hpp"
#include "rlhost/losses/nll_loss.hpp"
#include "rlhost/losses/packing.hpp"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/plugin.hpp"
#include "worker_pool.hpp"

#include "decode_ops.hpp"  // gemm_rows (the batch-invariant gemm)
#include "op_call.hpp"

namespace rlh::kcpu {
namespace {

sdk::MakeStatusFn g_make_status = nullptr;


// ---------------------------------------------------------------------------------------------
// The ops, one function each (T = float or double).

// gemm with batch_invariant = 1 (docs/ops.md): y = x W^T with each row of y a function of its
// own row of x alone (gemm_rows.cpp), for decoding; only that form is offered.
template <class T>
void run_gemm_rows(const Call& c) {
  const rlh_tensor &A = c.in(0), &B = c.in(1), &C = c.out(0);
  if (A.ndim != 2 || B.ndim != 2 || C.ndim != 2 || c.flag("transpose_a") || !c.flag("transpose_b") ||
      c.num("alpha", 1) != 1 || c.num("beta", 0) != 0)
    bad("gemm (batch_invariant): kernels_cpu offers only 2-D C = A B^T (transpose_b = 1, alpha 1, beta 0)");
  const int64_t M = C.shape[0], N = C.shape[1], K = A.shape[1];
  const int64_t lda = need_rows(A, M, K, "gemm A"), ldb = need_rows(B, N, K, "gemm B");
  const int64_t ldc = need_rows(C, M, N, "gemm C");
  gemm_rows(data<T>(C), ldc, data<T>(A), lda, data<T>(B), ldb, M, N, K, c.op->inst->pool());
}

template <class T>
void run_gemm(const Call& c) {
  if (c.flag("batch_invariant")) return run_gemm_rows<T>(c);
  const bool ta = c.flag("transpose_a"), tb = c.flag("transpose_b");
  const T alpha = T(c.num("alpha", 1)), beta = T(c.num("beta", 0));
  const rlh_tensor &A = c.in(0), &B = c.in(1), &C = c.out(0);
  if (A.ndim != B.ndim || A.ndim != C.ndim || (A.ndim != 2 && A.ndim != 3))
    bad("gemm: operands must all be 2-D, or all 3-D (batched)");
  const int b0 = A.ndim == 3 ? 1 : 0;
  const int64_t batch = b0 ? A.shape[0] : 1;
  if (b0 && (B.shape[0] != batch || C.shape[0] != batch)) bad("gemm: batch sizes differ");
  const int64_t M = C.shape[b0], N = C.shape[b0 + 1];
  const int64_t K = ta ? A.shape[b0] : A.shape[b0 + 1];
  if ((ta ? A.shape[b0 + 1] : A.shape[b0]) != M || (tb ? B.shape[b0 + 1] : B.shape[b0]) != K ||
      (tb ? B.shape[b0] : B.shape[b0 + 1]) != N)
    bad("gemm: shapes do not chain");
  for (const rlh_tensor* t : {&A, &B, &C})
    if (t->shape[b0 + 1] > 1 && t->strides[b0 + 1] != 1) bad("gemm: last dimension must be contiguous");
  auto ld = [&](const rlh_tensor& t) {
    return t.shape[b0] > 1 ? t.strides[b0] : t.shape[b0 + 1];
  };
  if (b0)
    gemm_batched<T>(ta, tb, M, N, K, alpha, data<T>(A), ld(A), A.strides[0], data<T>(B), ld(B),
                    B.strides[0], beta, data<T>(C), ld(C), C.strides[0], batch);
  else
    gemm<T>(ta, tb, M, N, K, alpha, data<T>(A), ld(A), data<T>(B), ld(B), beta, data<T>(C), ld(C));
}

template <class T>
void run_embedding_fwd(const Call& c) {
  const int64_t N = numel(c.in(0)), V = c.in(1).shape[0], C = c.in(1).shape[1];
  need_vec(c.in(0), N, "embedding_fwd ids");
  need_vec(c.in(1), V * C, "embedding_fwd table");
  need_vec(c.out(0), N * C, "embedding_fwd out");
  embedding_fwd<T>(data<T>(c.out(0)), data<int32_t>(c.in(0)), data<T>(c.in(1)), N, C, V);
}

template <class T>
void run_embedding_bwd(const Call& c) {
  const int64_t N = numel(c.in(0)), V = c.out(0).shape[0], C = c.out(0).shape[1];
  need_vec(c.in(0), N, "embedding_bwd ids");
  need_vec(c.in(1), N * C, "embedding_bwd dout");
  need_vec(c.out(0), V * C, "embedding_bwd dtable");
  embedding_bwd<T>(data<T>(c.out(0)), data<int32_t>(c.in(0)), data<T>(c.in(1)), N, C, V);
}

template <class T>
void run_rmsnorm_fwd(const Call& c) {
  const int64_t N = c.in(0).shape[0], C = c.in(0).shape[1];
  const int64_t ldx = need_rows(c.in(0), N, C, "rmsnorm_fwd x");
  need_vec(c.in(1), C, "rmsnorm_fwd w");
  const int64_t ldy = need_rows(c.out(0), N, C, "rmsnorm_fwd y");
  T* rstd = nullptr;
  if (c.has_out(1)) {
    need_vec(c.out(1), N, "rmsnorm_fwd rstd");
    rstd = data<T>(c.out(1));
  }
  rmsnorm_fwd<T>(data<T>(c.out(0)), ldy, rstd, data<T>(c.in(0)), ldx, data<T>(c.in(1)), N, C,
                 T(c.num("eps", 1e-6)), T(c.num("weight_offset", 0)));
}

// gemm_glu_fwd: h = act(x Wg^T) * (x Wu^T) with W = gate | up [2F, K]: by definition gemm into a
// [M, 2F] scratch, then swiglu_fwd (activation 0) or geglu_fwd (1: tanh form, 2: erf).
template <class T>
void run_gemm_glu_fwd(const Call& c) {
  const rlh_tensor &X = c.in(0), &W = c.in(1), &H = c.out(0);
  const int64_t act = c.integer("activation", 0);
  const sdk::ProductSizes z = sdk::fused_product_sizes("gemm_glu_fwd", X, W, H, act, 0);
  const int64_t M = z.M, K = z.K, F = z.N;
  const int64_t ldx = need_rows(X, M, K, "gemm_glu_fwd x"), ldw = need_rows(W, 2 * F, K, "gemm_glu_fwd W");
  const int64_t ldh = need_rows(H, M, F, "gemm_glu_fwd h");
  std::vector<T> gu(size_t(M * 2 * F));
  gemm<T>(false, true, M, 2 * F, K, T(1), data<T>(X), ldx, data<T>(W), ldw, T(0), gu.data(), 2 * F);
  if (act == 0)
    swiglu_fwd<T>(data<T>(H), ldh, gu.data(), 2 * F, gu.data() + F, 2 * F, M, F);
  else
    geglu_fwd<T>(data<T>(H), ldh, gu.data(), 2 * F, gu.data() + F, 2 * F, M, F, act == 1);
}

// rmsnorm_gemm_fwd: h = rmsnorm(x) W^T, or with activation >= 0 the GLU of the product's gate |
// up halves (W [2N, K], h [M, N]): by definition rmsnorm_fwd into a scratch, then gemm (then
// swiglu_fwd / geglu_fwd). A decoding step's norm and the product that reads it as one op.
template <class T>
void run_rmsnorm_gemm_fwd(const Call& c) {
  const rlh_tensor &X = c.in(0), &W = c.in(2), &H = c.out(0);
  const int64_t act = c.integer("activation", -1);
  const sdk::ProductSizes z = sdk::fused_product_sizes("rmsnorm_gemm_fwd", X, W, H, act, -1);
  const int64_t M = z.M, K = z.K, N = z.N, rows = z.rows;
  const int64_t ldx = need_rows(X, M, K, "rmsnorm_gemm_fwd x"), ldw = need_rows(W, rows, K, "rmsnorm_gemm_fwd W");
  const int64_t ldh = need_rows(H, M, N, "rmsnorm_gemm_fwd h");
  need_vec(c.in(1), K, "rmsnorm_gemm_fwd w");
  std::vector<T> xn(size_t(M * K));
  rmsnorm_fwd<T>(xn.data(), K, nullptr, data<T>(X), ldx, data<T>(c.in(1)), M, K, T(c.num("eps", 1e-6)),
                 T(c.num("weight_offset", 0)));
  if (act < 0) {
    gemm<T>(false, true, M, N, K, T(1), xn.data(), K, data<T>(W), ldw, T(0), data<T>(H), ldh);
    return;
  }
  std::vector<T> gu(size_t(M * 2 * N));
  gemm<T>(false, true, M, 2 * N, K, T(1), xn.data(), K, data<T>(W), ldw, T(0), gu.data(), 2 * N);
  if (act == 0)
    swiglu_fwd<T>(data<T>(H), ldh, gu.data(), 2 * N, gu.data() + N, 2 * N, M, N);
  else
    geglu_fwd<T>(data<T>(H), ldh, gu.data(), 2 * N, gu.data() + N, 2 * N, M, N, act == 1);
}

// gemm_add_fwd: y = r + x W^T: by definition gemm into a scratch, then add_fwd (y may be r). A
// product and the residual add after it as one op. round_product = 0: r is gemm's C (beta 1),
// the product added to it unrounded.
template <class T>
void run_gemm_add_fwd(const Call& c) {
  const rlh_tensor &X = c.in(0), &W = c.in(1), &R = c.in(2), &Y = c.out(0);
  const sdk::ProductSizes z = sdk::fused_product_sizes("gemm_add_fwd", X, W, Y, -1, -1);
  const int64_t M = z.M, K = z.K, N = z.N;
  const int64_t ldx = need_rows(X, M, K, "gemm_add_fwd x"), ldw = need_rows(W, N, K, "gemm_add_fwd W");
  const int64_t ldr = need_rows(R, M, N, "gemm_add_fwd r"), ldy = need_rows(Y, M, N, "gemm_add_fwd y");
  if (c.num("round_product", 1) == 0) {
    if (data<T>(Y) != data<T>(R))
      for (int64_t r = 0; r < M; ++r) std::copy_n(data<T>(R) + r * ldr, N, data<T>(Y) + r * ldy);
    gemm<T>(false, true, M, N, K, T(1), data<T>(X), ldx, data<T>(W), ldw, T(1), data<T>(Y), ldy);
    return;
  }
  std::vector<T> p(size_t(M * N));
  gemm<T>(false, true, M, N, K, T(1), data<T>(X), ldx, data<T>(W), ldw, T(0), p.data(), N);
  for (int64_t r = 0; r < M; ++r) add_fwd<T>(data<T>(Y) + r * ldy, data<T>(R) + r * ldr, p.data() + r * N, N);
}

// add_rmsnorm_fwd: y = a + b, then yn = rmsnorm(y): by definition the two ops in turn (a
// residual add and the next norm, which a decoding step runs once per layer boundary).
template <class T>
void run_add_rmsnorm_fwd(const Call& c) {
  const int64_t N = c.in(0).shape[0], C = c.in(0).shape[1];
  need_vec(c.in(0), N * C, "add_rmsnorm_fwd a");
  need_vec(c.in(1), N * C, "add_rmsnorm_fwd b");
  need_vec(c.in(2), C, "add_rmsnorm_fwd w");
  need_vec(c.out(0), N * C, "add_rmsnorm_fwd y");
  need_vec(c.out(1), N * C, "add_rmsnorm_fwd yn");
  if (data<T>(c.out(1)) == data<T>(c.in(0)) || data<T>(c.out(1)) == data<T>(c.in(1)))
    bad("add_rmsnorm_fwd: yn may not be a or b (y may)");
  add_fwd<T>(data<T>(c.out(0)), data<T>(c.in(0)), data<T>(c.in(1)), N * C);
  rmsnorm_fwd<T>(data<T>(c.out(1)), C, nullptr, data<T>(c.out(0)), C, data<T>(c.in(2)), N, C,
                 T(c.num("eps", 1e-6)), T(c.num("weight_offset", 0)));
}

template <class T>
void run_rmsnorm_bwd(const Call& c) {
  const int64_t N = c.in(1).shape[0], C = c.in(1).shape[1];
  const int64_t lddy = need_rows(c.in(0), N, C, "rmsnorm_bwd dy");
  const int64_t ldx = need_rows(c.in(1), N, C, "rmsnorm_bwd x");
  need_vec(c.in(2), C, "rmsnorm_bwd w");
  need_vec(c.in(3), N, "rmsnorm_bwd rstd");
  const int64_t lddx = need_rows(c.out(0), N, C, "rmsnorm_bwd dx");
  T* dw = nullptr;
  if (c.has_out(1)) {
    need_vec(c.out(1), C, "rmsnorm_bwd dw");
    dw = data<T>(c.out(1));
  }
  rmsnorm_bwd<T>(data<T>(c.out(0)), lddx, dw, data<T>(c.in(0)), lddy, data<T>(c.in(1)), ldx,
                 data<T>(c.in(2)), data<T>(c.in(3)), N, C, T(c.num("weight_offset", 0)),
                 c.flag("accumulate"));
}

}  // namespace

// (outside the anonymous namespace: ops_decode.cpp's rope_kv_cache_write runs it too)
template <class T>
void run_rope(const Call& c, bool backward) {
  const rlh_tensor& x = c.in(0);
  if (x.ndim != 3) bad("rope: x must be [N, H, D]");
  const int64_t N = x.shape[0], H = x.shape[1], D = x.shape[2];
  const int64_t ldx = need_heads(x, N, H, D, "rope x");
  const int64_t ldy = need_heads(c.out(0), N, H, D, "rope y");
  need_vec(c.in(1), N, "rope positions");
  const int64_t R = 2 * numel(c.in(2));
  need_vec(c.in(2), R / 2, "rope inv_freq");
  const double scale = c.num("scale", 1);
  const bool il = c.flag("interleaved");
  if (backward)
    rope_bwd<T>(data<T>(c.out(0)), ldy, data<T>(x), ldx, data<int32_t>(c.in(1)),
                data<float>(c.in(2)), N, H, D, R, scale, il);
  else
    rope_fwd<T>(data<T>(c.out(0)), ldy, data<T>(x), ldx, data<int32_t>(c.in(1)),
                data<float>(c.in(2)), N, H, D, R, scale, il);
}
template void run_rope<float>(const Call& c, bool backward);
template void run_rope<double>(const Call& c, bool backward);

namespace {

template <class T>
void run_rope_fwd(const Call& c) { run_rope<T>(c, false); }
template <class T>
void run_rope_bwd(const Call& c) { run_rope<T>(c, true); }

struct AttnDims {
  int64_t N, Hq, Hkv, Dk, Dv, S;
};
AttnDims attn_dims(const rlh_tensor& q, const rlh_tensor& k, const rlh_tensor& v,
                   const rlh_tensor& cu) {
  if (q.ndim != 3 || k.ndim != 3 || v.ndim != 3) bad("attention: q, k, v must be [N, H, D]");
  return {q.shape[0], q.shape[1], k.shape[1], q.shape[2], v.shape[2], numel(cu) - 1};
}


template <class T>
void run_attention_fwd(const Call& c) {
  const AttnDims d = attn_dims(c.in(0), c.in(1), c.in(2), c.in(3));
  const int64_t ldq = need_heads(c.in(0), d.N, d.Hq, d.Dk, "attention_fwd q");
  const int64_t ldk = need_heads(c.in(1), d.N, d.Hkv, d.Dk, "attention_fwd k");
  const int64_t ldv = need_heads(c.in(2), d.N, d.Hkv, d.Dv, "attention_fwd v");
  const int64_t ldo = need_heads(c.out(0), d.N, d.Hq, d.Dv, "attention_fwd o");
  need_vec(c.out(1), d.Hq * d.N, "attention_fwd lse");
  attention_fwd<T>(data<T>(c.out(0)), ldo, data<T>(c.out(1)), data<T>(c.in(0)), ldq,
                   data<T>(c.in(1)), ldk, data<T>(c.in(2)), ldv, data<int32_t>(c.in(3)), d.S, d.N,
                   d.Hq, d.Hkv, d.Dk, d.Dv, T(c.num("scale", 1.0 / std::sqrt(double(d.Dk)))),
                   c.integer("window", 0), c.scratch, T(softcap_of(c)));
}

template <class T>
void run_attention_bwd(const Call& c) {
  const AttnDims d = attn_dims(c.in(1), c.in(2), c.in(3), c.in(6));
  const int64_t lddo = need_heads(c.in(0), d.N, d.Hq, d.Dv, "attention_bwd dout");
  const int64_t ldq = need_heads(c.in(1), d.N, d.Hq, d.Dk, "attention_bwd q");
  const int64_t ldk = need_heads(c.in(2), d.N, d.Hkv, d.Dk, "attention_bwd k");
  const int64_t ldv = need_heads(c.in(3), d.N, d.Hkv, d.Dv, "attention_bwd v");
  const int64_t ldo = need_heads(c.in(4), d.N, d.Hq, d.Dv, "attention_bwd o");
  need_vec(c.in(5), d.Hq * d.N, "attention_bwd lse");
  const int64_t lddq = need_heads(c.out(0), d.N, d.Hq, d.Dk, "attention_bwd dq");
  const int64_t lddk = need_heads(c.out(1), d.N, d.Hkv, d.Dk, "attention_bwd dk");
  const int64_t lddv = need_heads(c.out(2), d.N, d.Hkv, d.Dv, "attention_bwd dv");
  attention_bwd<T>(data<T>(c.out(0)), lddq, data<T>(c.out(1)), lddk, data<T>(c.out(2)), lddv,
                   data<T>(c.in(0)), lddo, data<T>(c.in(1)), ldq, data<T>(c.in(2)), ldk,
                   data<T>(c.in(3)), ldv, data<T>(c.in(4)), ldo, data<T>(c.in(5)),
                   data<int32_t>(c.in(6)), d.S, d.N, d.Hq, d.Hkv, d.Dk, d.Dv,
                   T(c.num("scale", 1.0 / std::sqrt(double(d.Dk)))), c.integer("window", 0),
                   c.scratch, T(softcap_of(c)));
}

template <class T>
void run_swiglu_fwd(const Call& c) {
  const int64_t N = c.in(0).shape[0], F = c.in(0).shape[1];
  const int64_t ldg = need_rows(c.in(0), N, F, "swiglu_fwd gate");
  const int64_t ldu = need_rows(c.in(1), N, F, "swiglu_fwd up");
  const int64_t ldh = need_rows(c.out(0), N, F, "swiglu_fwd h");
  swiglu_fwd<T>(data<T>(c.out(0)), ldh, data<T>(c.in(0)), ldg, data<T>(c.in(1)), ldu, N, F);
}

template <class T>
void run_swiglu_bwd(const Call& c) {
  const int64_t N = c.in(1).shape[0], F = c.in(1).shape[1];
  const int64_t lddh = need_rows(c.in(0), N, F, "swiglu_bwd dh");
  const int64_t ldg = need_rows(c.in(1), N, F, "swiglu_bwd gate");
  const int64_t ldu = need_rows(c.in(2), N, F, "swiglu_bwd up");
  const int64_t lddg = need_rows(c.out(0), N, F, "swiglu_bwd dgate");
  const int64_t lddu = need_rows(c.out(1), N, F, "swiglu_bwd dup");
  swiglu_bwd<T>(data<T>(c.out(0)), lddg, data<T>(c.out(1)), lddu, data<T>(c.in(0)), lddh,
                data<T>(c.in(1)), ldg, data<T>(c.in(2)), ldu, N, F);
}

template <class T>
void run_geglu_fwd(const Call& c) {
  const int64_t N = c.in(0).shape[0], F = c.in(0).shape[1];
  const int64_t ldg = need_rows(c.in(0), N, F, "geglu_fwd gate");
  const int64_t ldu = need_rows(c.in(1), N, F, "geglu_fwd up");
  const int64_t ldh = need_rows(c.out(0), N, F, "geglu_fwd h");
  geglu_fwd<T>(data<T>(c.out(0)), ldh, data<T>(c.in(0)), ldg, data<T>(c.in(1)), ldu, N, F,
               c.integer("approximate_tanh", 1) != 0);
}

template <class T>
void run_geglu_bwd(const Call& c) {
  const int64_t N = c.in(1).shape[0], F = c.in(1).shape[1];
  const int64_t lddh = need_rows(c.in(0), N, F, "geglu_bwd dh");
  const int64_t ldg = need_rows(c.in(1), N, F, "geglu_bwd gate");
  const int64_t ldu = need_rows(c.in(2), N, F, "geglu_bwd up");
  const int64_t lddg = need_rows(c.out(0), N, F, "geglu_bwd dgate");
  const int64_t lddu = need_rows(c.out(1), N, F, "geglu_bwd dup");
  geglu_bwd<T>(data<T>(c.out(0)), lddg, data<T>(c.out(1)), lddu, data<T>(c.in(0)), lddh,
               data<T>(c.in(1)), ldg, data<T>(c.in(2)), ldu, N, F, c.integer("approximate_tanh", 1) != 0);
}

template <class T>
void run_bias_add_fwd(const Call& c) {
  const int64_t N = c.out(0).shape[0], M = c.out(0).shape[1];
  const int64_t ldy = need_rows(c.out(0), N, M, "bias_add_fwd y");
  need_vec(c.in(0), M, "bias_add_fwd b");
  bias_add_fwd<T>(data<T>(c.out(0)), ldy, data<T>(c.in(0)), N, M);
}

template <class T>
void run_bias_bwd(const Call& c) {
  const int64_t N = c.in(0).shape[0], M = c.in(0).shape[1];
  const int64_t lddy = need_rows(c.in(0), N, M, "bias_bwd dy");
  need_vec(c.out(0), M, "bias_bwd db");
  bias_bwd<T>(data<T>(c.out(0)), data<T>(c.in(0)), lddy, N, M);
}

template <class T>
void run_add_fwd(const Call& c) {
  const int64_t n = numel(c.out(0));
  need_vec(c.in(0), n, "add_fwd a");
  need_vec(c.in(1), n, "add_fwd b");
  need_vec(c.out(0), n, "add_fwd y");
  add_fwd<T>(data<T>(c.out(0)), data<T>(c.in(0)), data<T>(c.in(1)), n);
}

LogprobOpts logprob_opts(const Call& c) {
  LogprobOpts o;
  o.temperature = c.num("temperature", 1);
  o.top_k = c.integer("top_k", 0);
  o.top_p = c.num("top_p", 1);
  o.chunk_bytes = c.integer("chunk_bytes", 0);
  o.softcap = softcap_of(c);
  return o;
}

// target [N] or [N, K]; logprob (and dlogprob) the same shape.
int64_t targets_per_token(const rlh_tensor& target) {
  return target.ndim == 2 ? target.shape[1] : 1;
}

template <class T>
void run_linear_logprob_fwd(const Call& c) {
  const int64_t N = c.in(0).shape[0], C = c.in(0).shape[1], V = c.in(1).shape[0];
  const int64_t K = targets_per_token(c.in(2));
  need_vec(c.in(0), N * C, "linear_logprob_fwd h");
  need_vec(c.in(1), V * C, "linear_logprob_fwd W");
  need_vec(c.in(2), N * K, "linear_logprob_fwd target");
  need_vec(c.out(0), N * K, "linear_logprob_fwd logprob");
  need_vec(c.out(1), N, "linear_logprob_fwd lse");
  T* ent = nullptr;
  if (c.has_out(2)) {
    need_vec(c.out(2), N, "linear_logprob_fwd entropy");
    ent = data<T>(c.out(2));
  }
  linear_logprob_fwd<T>(data<T>(c.out(0)), data<T>(c.out(1)), ent, data<T>(c.in(0)),
                        data<T>(c.in(1)), data<int32_t>(c.in(2)), N, C, V, K, logprob_opts(c),
                        c.scratch);
}

template <class T>
void run_linear_logprob_bwd(const Call& c) {
  const int64_t N = c.in(0).shape[0], C = c.in(0).shape[1], V = c.in(1).shape[0];
  const int64_t K = targets_per_token(c.in(2));
  need_vec(c.in(0), N * C, "linear_logprob_bwd h");
  need_vec(c.in(1), V * C, "linear_logprob_bwd W");
  need_vec(c.in(2), N * K, "linear_logprob_bwd target");
  need_vec(c.in(3), N, "linear_logprob_bwd lse");
  const T* dlp = nullptr;
  const T* ent = nullptr;
  const T* dent = nullptr;
  if (c.has_in(4)) {
    need_vec(c.in(4), N * K, "linear_logprob_bwd dlogprob");
    dlp = data<T>(c.in(4));
  }
  if (c.has_in(5)) {
    need_vec(c.in(5), N, "linear_logprob_bwd entropy");
    ent = data<T>(c.in(5));
  }
  if (c.has_in(6)) {
    need_vec(c.in(6), N, "linear_logprob_bwd dentropy");
    dent = data<T>(c.in(6));
  }
  need_vec(c.out(0), N * C, "linear_logprob_bwd dh");
  need_vec(c.out(1), V * C, "linear_logprob_bwd dW");
  linear_logprob_bwd<T>(data<T>(c.out(0)), data<T>(c.out(1)), dlp, dent, data<T>(c.in(0)),
                        data<T>(c.in(1)), data<int32_t>(c.in(2)), data<T>(c.in(3)), ent, N, C, V,
                        K, logprob_opts(c), c.flag("accumulate"), c.scratch);
}

// ---------------------------------------------------------------------------------------------
// Mixture of experts

RouterOpts router_opts(const Call& c) {
  RouterOpts o;
  o.scoring = int(c.integer("scoring", 0));
  o.norm_topk_prob = c.flag("norm_topk_prob");
  o.scaling_factor = c.num("scaling_factor", 1);
  o.replay = c.flag("replay");
  o.n_group = c.integer("n_group", 1);
  o.topk_group = c.integer("topk_group", 1);
  return o;
}

// logits [N, E] (rows may be strided), weights [N, K], experts int32 [N, K] (read with replay),
// probs [N, E], lse [N] (optional); bias [E] (optional input).
template <class T>
void run_moe_router_fwd(const Call& c) {
  const rlh_tensor& z = c.in(0);
  if (z.ndim != 2) bad("moe_router_fwd: logits must be [N, E]");
  const int64_t N = z.shape[0], E = z.shape[1];
  const int64_t ldl = need_rows(z, N, E, "moe_router_fwd logits");
  const rlh_tensor& w = c.out(0);
  if (w.ndim != 2 || w.shape[0] != N) bad("moe_router_fwd: weights must be [N, K]");
  const int64_t K = w.shape[1];
  need_vec(w, N * K, "moe_router_fwd weights");
  need_vec(c.out(1), N * K, "moe_router_fwd experts");
  need_vec(c.out(2), N * E, "moe_router_fwd probs");
  T* lse = nullptr;
  if (c.has_out(3)) {
    need_vec(c.out(3), N, "moe_router_fwd lse");
    lse = data<T>(c.out(3));
  }
  const T* bias = nullptr;
  if (c.has_in(1)) {
    need_vec(c.in(1), E, "moe_router_fwd bias");
    bias = data<T>(c.in(1));
  }
  moe_router_fwd<T>(data<T>(w), data<int32_t>(c.out(1)), data<T>(c.out(2)), lse, data<T>(z), ldl,
                    bias, N, E, K, router_opts(c));
}

// dweights [N, K], probs [N, E], experts int32 [N, K], dprobs [N, E] (optional), dlse [N]
// (optional) -> dlogits [N, E] (rows may be strided).
template <class T>
void run_moe_router_bwd(const Call& c) {
  const rlh_tensor& p = c.in(1);
  if (p.ndim != 2 || c.in(0).ndim != 2) bad("moe_router_bwd: probs must be [N, E], dweights [N, K]");
  const int64_t N = p.shape[0], E = p.shape[1], K = c.in(0).shape[1];
  need_vec(c.in(0), N * K, "moe_router_bwd dweights");
  need_vec(p, N * E, "moe_router_bwd probs");
  need_vec(c.in(2), N * K, "moe_router_bwd experts");
  const T* dprobs = nullptr;
  const T* dlse = nullptr;
  if (c.has_in(3)) {
    need_vec(c.in(3), N * E, "moe_router_bwd dprobs");
    dprobs = data<T>(c.in(3));
  }
  if (c.has_in(4)) {
    need_vec(c.in(4), N, "moe_router_bwd dlse");
    dlse = data<T>(c.in(4));
  }
  const int64_t lddl = need_rows(c.out(0), N, E, "moe_router_bwd dlogits");
  moe_router_bwd<T>(data<T>(c.out(0)), lddl, data<T>(c.in(0)), data<T>(p),
                    data<int32_t>(c.in(2)), dprobs, dlse, N, E, K, router_opts(c));
}

// x [N, C], experts int32 [N, K] -> xp [N*K, C], row int32 [N, K], offsets int32 [E+1]
template <class T>
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
  moe_permute_fwd<T>(data<T>(c.out(0)), ldxp, data<int32_t>(c.out(1)), data<int32_t>(c.out(2)),
                     data<T>(x), ldx, data<int32_t>(c.in(1)), N, K, C, E);
}

// dxp [N*K, C], row int32 [N, K] -> dx [N, C]
template <class T>
void run_moe_permute_bwd(const Call& c) {
  const rlh_tensor& dx = c.out(0);
  if (dx.ndim != 2 || c.in(1).ndim != 2) bad("moe_permute_bwd: dx must be [N, C], row [N, K]");
  const int64_t N = dx.shape[0], C = dx.shape[1], K = c.in(1).shape[1];
  const int64_t lddxp = need_rows(c.in(0), N * K, C, "moe_permute_bwd dxp");
  need_vec(c.in(1), N * K, "moe_permute_bwd row");
  const int64_t lddx = need_rows(dx, N, C, "moe_permute_bwd dx");
  moe_permute_bwd<T>(data<T>(dx), lddx, data<T>(c.in(0)), lddxp, data<int32_t>(c.in(1)), N, K, C,
                     c.flag("accumulate"));
}

// yp [N*K, C], row int32 [N, K], weights [N, K] -> y [N, C]
template <class T>
void run_moe_unpermute_fwd(const Call& c) {
  const rlh_tensor& y = c.out(0);
  if (y.ndim != 2 || c.in(1).ndim != 2) bad("moe_unpermute_fwd: y must be [N, C], row [N, K]");
  const int64_t N = y.shape[0], C = y.shape[1], K = c.in(1).shape[1];
  const int64_t ldyp = need_rows(c.in(0), N * K, C, "moe_unpermute_fwd yp");
  need_vec(c.in(1), N * K, "moe_unpermute_fwd row");
  need_vec(c.in(2), N * K, "moe_unpermute_fwd weights");
  const int64_t ldy = need_rows(y, N, C, "moe_unpermute_fwd y");
  moe_unpermute_fwd<T>(data<T>(y), ldy, data<T>(c.in(0)), ldyp, data<int32_t>(c.in(1)),
                       data<T>(c.in(2)), N, K, C, c.flag("accumulate"));
}

// dy [N, C], yp [N*K, C], row int32 [N, K], weights [N, K] -> dyp [N*K, C], dweights [N, K]
// (optional)
template <class T>
void run_moe_unpermute_bwd(const Call& c) {
  const rlh_tensor& dy = c.in(0);
  if (dy.ndim != 2 || c.in(2).ndim != 2) bad("moe_unpermute_bwd: dy must be [N, C], row [N, K]");
  const int64_t N = dy.shape[0], C = dy.shape[1], K = c.in(2).shape[1];
  const int64_t lddy = need_rows(dy, N, C, "moe_unpermute_bwd dy");
  const int64_t ldyp = need_rows(c.in(1), N * K, C, "moe_unpermute_bwd yp");
  need_vec(c.in(2), N * K, "moe_unpermute_bwd row");
  need_vec(c.in(3), N * K, "moe_unpermute_bwd weights");
  const int64_t lddyp = need_rows(c.out(0), N * K, C, "moe_unpermute_bwd dyp");
  T* dw = nullptr;
  if (c.has_out(1)) {
    need_vec(c.out(1), N * K, "moe_unpermute_bwd dweights");
    dw = data<T>(c.out(1));
  }
  moe_unpermute_bwd<T>(data<T>(c.out(0)), lddyp, dw, data<T>(dy), lddy, data<T>(c.in(1)), ldyp,
                       data<int32_t>(c.in(2)), data<T>(c.in(3)), N, K, C);
}

// A, B, offsets int32 [G+1] -> C. transpose_a = 0: A [T, K], B [G, K, N] ([G, N, K] with
// transpose_b), C [T, N]. transpose_a = 1: A [T, M], B [T, N], C [G, M, N]. The group axis of a
// 3-D operand may have any stride; rows any stride >= the row; last dimension contiguous.
template <class T>
void run_grouped_gemm(const Call& c) {
  const bool ta = c.flag("transpose_a"), tb = c.flag("transpose_b");
  const T alpha = T(c.num("alpha", 1)), beta = T(c.num("beta", 0));
  const rlh_tensor &A = c.in(0), &B = c.in(1), &Cm = c.out(0);
  const int64_t G = numel(c.in(2)) - 1;
  if (G < 1) bad("grouped_gemm: offsets must be [G+1], G >= 1");
  need_vec(c.in(2), G + 1, "grouped_gemm offsets");
  const int32_t* off = data<int32_t>(c.in(2));
  if (A.ndim != 2) bad("grouped_gemm: A must be 2-D");
  const int64_t T_rows = A.shape[0];
  if (off[G] != T_rows) bad("grouped_gemm: offsets[G] must equal A's rows");
  auto mat3 = [&](const rlh_tensor& t, int64_t rows, int64_t cols, const char* what,
                  int64_t* ld) -> int64_t {
    if (t.ndim != 3 || t.shape[0] != G || t.shape[1] != rows || t.shape[2] != cols)
      bad(std::string(what) + ": expected shape [" + std::to_string(G) + ", " +
          std::to_string(rows) + ", " + std::to_string(cols) + "]");
    if (cols > 1 && t.strides[2] != 1) bad(std::string(what) + ": last dimension must be contiguous");
    if (rows > 1 && t.strides[1] < cols) bad(std::string(what) + ": rows overlap");
    *ld = rows > 1 ? t.strides[1] : cols;
    return G > 1 ? t.strides[0] : rows * *ld;
  };
  if (!ta) {
    const int64_t K = A.shape[1];
    if (B.ndim != 3) bad("grouped_gemm: B must be [G, K, N] or [G, N, K]");
    const int64_t N = tb ? B.shape[1] : B.shape[2];
    const int64_t lda = need_rows(A, T_rows, K, "grouped_gemm A");
    int64_t ldb = 0;
    const int64_t sb = tb ? mat3(B, N, K, "grouped_gemm B", &ldb) : mat3(B, K, N, "grouped_gemm B", &ldb);
    const int64_t ldc = need_rows(Cm, T_rows, N, "grouped_gemm C");
    grouped_gemm<T>(false, tb, G, off, T_rows, N, K, alpha, data<T>(A), lda, data<T>(B), ldb, sb,
                    beta, data<T>(Cm), ldc, 0);
  } else {
    if (tb) bad("grouped_gemm: transpose_b with transpose_a is not offered");
    const int64_t M = A.shape[1];
    if (B.ndim != 2 || B.shape[0] != T_rows) bad("grouped_gemm: B must be [T, N] with transpose_a");
    const int64_t N = B.shape[1];
    const int64_t lda = need_rows(A, T_rows, M, "grouped_gemm A");
    const int64_t ldb = need_rows(B, T_rows, N, "grouped_gemm B");
    int64_t ldc = 0;
    const int64_t sc = mat3(Cm, M, N, "grouped_gemm C", &ldc);
    grouped_gemm<T>(true, false, G, off, M, N, T_rows, alpha, data<T>(A), lda, data<T>(B), ldb, 0,
                    beta, data<T>(Cm), ldc, sc);
  }
}

template <class T>
void run_adamw(const Call& c) {
  if constexpr (std::is_same_v<T, float>) {
    const int64_t n = numel(c.out(0));
    for (size_t i = 0; i < 4; ++i) need_vec(c.out(i), n, "adamw p/g/m/v");
    AdamWOpts o;
    o.lr = c.num("lr", o.lr);
    o.beta1 = c.num("beta1", o.beta1);
    o.beta2 = c.num("beta2", o.beta2);
    o.eps = c.num("eps", o.eps);
    o.weight_decay = c.num("weight_decay", o.weight_decay);
    o.step = c.integer("step", 1);
    o.grad_scale = c.num("grad_scale", 1);
    o.zero_grad = c.flag("zero_grad");
    adamw(data<float>(c.out(0)), data<float>(c.out(1)), data<float>(c.out(2)),
          data<float>(c.out(3)), n, o);
  }
}

// adamw_bf16: adamw, then p16 = bf16 of the updated p, rounded to nearest even (the working copy
// a bf16 engine computes with; the reference for providers that fuse the two).
template <class T>
void run_adamw_bf16(const Call& c) {
  if constexpr (std::is_same_v<T, float>) {
    run_adamw<float>(c);
    const int64_t n = numel(c.out(0));
    need_vec(c.out(4), n, "adamw_bf16 p16");
    const float* p = data<float>(c.out(0));
    uint16_t* p16 = data<uint16_t>(c.out(4));
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, &p[i], 4);
      p16[i] = std::isnan(p[i]) ? uint16_t((u >> 16) | 0x40) : uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
    }
  }
}

template <class T>
void run_sumsq(const Call& c) {
  if constexpr (std::is_same_v<T, float>) {
    const int64_t n = numel(c.in(0));
    need_vec(c.in(0), n, "sumsq x");
    need_vec(c.out(0), 1, "sumsq out");
    *data<float>(c.out(0)) = float(sumsq(data<float>(c.in(0)), n));
  }
}

// max |x| (NaN when x holds a NaN): what an FP8 provider's scales come from, so the conformance
// runner has a reference for it (docs/ops.md).
template <class T>
void run_amax(const Call& c) {
  const int64_t n = numel(c.in(0));
  need_vec(c.in(0), n, "amax x");
  need_vec(c.out(0), 1, "amax out");
  const T* x = data<T>(c.in(0));
  T m = 0;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    m = std::max(m, std::fabs(x[i]));
  }
  *data<T>(c.out(0)) = nan ? std::numeric_limits<T>::quiet_NaN() : m;
}

template <class T>
void run_scale(const Call& c) {
  if constexpr (std::is_same_v<T, float>) {
    const int64_t n = numel(c.out(0));
    need_vec(c.out(0), n, "scale x");
    scale(data<float>(c.out(0)), n, float(c.num("scale", 1)));
  }
}

// ---------------------------------------------------------------------------------------------
// Losses: NeMo-RL's ClippedPGLossFn and NLLLossFn (docs/ops.md), computed by the SDK's loss
// library (rlhost/losses), the same code as the grpo plugin's host loss callback. Operands are
// token-aligned; the library works in its output frame (packing.hpp), so logprobs move there
// and the gradient back.

struct LossFrameIo {
  std::vector<int64_t> offsets;  // [S+1]
  losses::Packing packing;
};

LossFrameIo loss_packing(const rlh_tensor& cu, int64_t N, const char* op) {
  const int64_t S1 = numel(cu);
  if (S1 < 1) bad(std::string(op) + ": cu_seqlens must have S+1 >= 1 entries");
  need_vec(cu, S1, (std::string(op) + " cu_seqlens").c_str());
  LossFrameIo io;
  const int32_t* p = data<int32_t>(cu);
  io.offsets.assign(p, p + S1);
  io.packing.num_tokens = N;
  io.packing.num_seqs = S1 - 1;
  io.packing.seq_offsets = io.offsets.data();
  try {
    losses::validate(io.packing);
  } catch (const std::invalid_argument& e) {
    bad(std::string(op) + ": cu_seqlens: " + e.what());
  }
  return io;
}

template <class T>
std::vector<double> loss_operand(const rlh_tensor& t, int64_t n, const std::string& what) {
  need_vec(t, n, what.c_str());
  const T* x = data<T>(t);
  return std::vector<double>(x, x + n);
}

template <class T>
void write_loss_outputs(const Call& c, const losses::Packing& p, const losses::LossResult& r,
                        const std::vector<double>& grad_out_frame,
                        std::span<const losses::OpMetric> names, const char* op) {
  need_vec(c.out(0), 1, (std::string(op) + " loss").c_str());
  *data<T>(c.out(0)) = T(r.loss);
  const std::vector<double> g = losses::to_token_frame(p, grad_out_frame);
  need_vec(c.out(1), p.num_tokens, (std::string(op) + " dlogprobs").c_str());
  T* d = data<T>(c.out(1));
  for (int64_t i = 0; i < p.num_tokens; ++i) d[i] = T(g[size_t(i)]);
  if (!c.has_out(2)) return;
  need_vec(c.out(2), int64_t(names.size()), (std::string(op) + " metrics").c_str());
  T* m = data<T>(c.out(2));
  for (size_t i = 0; i < names.size(); ++i) m[i] = T(r.metrics.get(names[i].name).value_or(0.0));
}

template <class T>
void run_clipped_pg_loss(const Call& c) {
  const char* op = "clipped_pg_loss";
  const int64_t N = numel(c.in(0));
  const LossFrameIo io = loss_packing(c.in(5), N, op);
  const int64_t S = io.packing.num_seqs;
  losses::LossCounts counts;
  const losses::ClippedPGConfig cfg = losses::clipped_pg_config_from_attrs(
      [&](const char* n, double d) { return c.num(n, d); }, &counts);
  const std::vector<double> lp = losses::to_output_frame(io.packing, loss_operand<T>(c.in(0), N, "clipped_pg_loss logprobs"));
  const std::vector<double> adv = loss_operand<T>(c.in(1), N, "clipped_pg_loss advantages");
  const std::vector<double> gen = loss_operand<T>(c.in(2), N, "clipped_pg_loss generation_logprobs");
  const std::vector<double> tm = loss_operand<T>(c.in(3), N, "clipped_pg_loss token_mask");
  const std::vector<double> sm = loss_operand<T>(c.in(4), S, "clipped_pg_loss sample_mask");
  std::vector<double> prev, ref, rewards;
  if (c.has_in(6)) prev = loss_operand<T>(c.in(6), N, "clipped_pg_loss prev_logprobs");
  if (c.has_in(7)) ref = loss_operand<T>(c.in(7), N, "clipped_pg_loss reference_policy_logprobs");
  if (c.has_in(8)) rewards = loss_operand<T>(c.in(8), S, "clipped_pg_loss rewards");
  if (cfg.needs_prev_logprobs() && prev.empty()) bad("clipped_pg_loss: prev_logprobs (input 6) is required unless force_on_policy_ratio");
  if (cfg.needs_reference_logprobs() && ref.empty()) bad("clipped_pg_loss: reference_policy_logprobs (input 7) is required when kl_penalty != 0");
  losses::ClippedPGInputs in;
  in.packing = io.packing;
  in.logprobs = lp.data();
  in.advantages = adv.data();
  in.generation_logprobs = gen.data();
  in.token_mask = tm.data();
  in.sample_mask = sm.data();
  in.prev_logprobs = prev.empty() ? nullptr : prev.data();
  in.reference_policy_logprobs = ref.empty() ? nullptr : ref.data();
  in.rewards = cfg.positive_example_nll_weight > 0 && !rewards.empty() ? rewards.data() : nullptr;
  in.global_valid_toks = counts.valid_toks;
  in.global_valid_seqs = counts.valid_seqs;
  in.global_positive_toks = counts.positive_toks;
  std::vector<double> grad(size_t(N), 0.0);
  const losses::LossResult r = losses::clipped_pg_loss(cfg, in, grad.data());
  write_loss_outputs<T>(c, io.packing, r, grad, losses::kClippedPgMetrics, op);
}

template <class T>
void run_nll_loss(const Call& c) {
  const char* op = "nll_loss";
  const int64_t N = numel(c.in(0));
  const LossFrameIo io = loss_packing(c.in(3), N, op);
  const losses::LossCounts counts =
      losses::nll_counts_from_attrs([&](const char* n, double d) { return c.num(n, d); });
  const std::vector<double> lp = losses::to_output_frame(io.packing, loss_operand<T>(c.in(0), N, "nll_loss logprobs"));
  const std::vector<double> tm = loss_operand<T>(c.in(1), N, "nll_loss token_mask");
  const std::vector<double> sm = loss_operand<T>(c.in(2), io.packing.num_seqs, "nll_loss sample_mask");
  losses::NllInputs in;
  in.packing = io.packing;
  in.logprobs = lp.data();
  in.token_mask = tm.data();
  in.sample_mask = sm.data();
  in.global_valid_toks = counts.valid_toks;
  std::vector<double> grad(size_t(N), 0.0);
  const losses::LossResult r = losses::nll_loss(in, grad.data());
  write_loss_outputs<T>(c, io.packing, r, grad, losses::kNllMetrics, op);
}

// ---------------------------------------------------------------------------------------------
// The op table: name, operand counts, which operands are int32 / float32 constants (the rest
// have the op's float dtype), its backward op, and whether float64 is offered.

// op dtype, int32, float32 / float64 constant, bf16, and a KV cache: the op dtype or FP8 e4m3
// (its scale a trailing float32 input; kv_cache_write, paged_attention)
enum Kind : char { F = 'f', I = 'i', K = 'k', D = 'd', B = 'b', Q = 'q' };


#define RLH_OP(NAME, IN, MIN_IN, OUT, MIN_OUT, BWD, F64) \
  OpSpec { #NAME, IN, MIN_IN, OUT, MIN_OUT, BWD, F64, run_##NAME<float>, run_##NAME<double> }

const OpSpec kOps[] = {
    RLH_OP(gemm, "ff", 2, "f", 1, "gemm", true),
    RLH_OP(embedding_fwd, "if", 2, "f", 1, "embedding_bwd", true),
    RLH_OP(embedding_bwd, "if", 2, "f", 1, "", true),
    RLH_OP(rmsnorm_fwd, "ff", 2, "ff", 1, "rmsnorm_bwd", true),
    RLH_OP(rmsnorm_bwd, "ffff", 4, "ff", 1, "", true),
    RLH_OP(add_rmsnorm_fwd, "fff", 3, "ff", 2, "", true),
    RLH_OP(gemm_glu_fwd, "ff", 2, "f", 1, "", true),
    RLH_OP(rmsnorm_gemm_fwd, "fff", 3, "f", 1, "", true),
    RLH_OP(gemm_add_fwd, "fff", 3, "f", 1, "", true),
    RLH_OP(rope_fwd, "fik", 3, "f", 1, "rope_bwd", true),
    RLH_OP(rope_bwd, "fik", 3, "f", 1, "", true),
    RLH_OP(attention_fwd, "fffi", 4, "ff", 2, "attention_bwd", true),
    RLH_OP(attention_bwd, "ffffffi", 7, "fff", 3, "", true),
    RLH_OP(swiglu_fwd, "ff", 2, "f", 1, "swiglu_bwd", true),
    RLH_OP(swiglu_bwd, "fff", 3, "ff", 2, "", true),
    RLH_OP(geglu_fwd, "ff", 2, "f", 1, "geglu_bwd", true),
    RLH_OP(geglu_bwd, "fff", 3, "ff", 2, "", true),
    RLH_OP(bias_add_fwd, "f", 1, "f", 1, "bias_bwd", true),
    RLH_OP(bias_bwd, "f", 1, "f", 1, "", true),
    RLH_OP(add_fwd, "ff", 2, "f", 1, "", true),
    RLH_OP(linear_logprob_fwd, "ffi", 3, "fff", 2, "linear_logprob_bwd", true),
    RLH_OP(linear_logprob_bwd, "ffiffff", 4, "ff", 2, "", true),
    RLH_OP(moe_router_fwd, "ff", 1, "fiff", 3, "moe_router_bwd", true),
    RLH_OP(moe_router_bwd, "ffiff", 3, "f", 1, "", true),
    RLH_OP(moe_permute_fwd, "fi", 2, "fii", 3, "moe_permute_bwd", true),
    RLH_OP(moe_permute_bwd, "fi", 2, "f", 1, "", true),
    RLH_OP(moe_unpermute_fwd, "fif", 3, "f", 1, "moe_unpermute_bwd", true),
    RLH_OP(moe_unpermute_bwd, "ffif", 4, "ff", 1, "", true),
    RLH_OP(grouped_gemm, "ffi", 3, "f", 1, "grouped_gemm", true),
    RLH_OP(adamw, "", 0, "ffff", 4, "", false),
    RLH_OP(adamw_bf16, "", 0, "ffffb", 5, "", false),
    RLH_OP(sumsq, "f", 1, "f", 1, "", false),
    RLH_OP(scale, "", 0, "f", 1, "", false),
    RLH_OP(amax, "f", 1, "f", 1, "", true),
    RLH_OP(kv_cache_write, "ffikk", 3, "qq", 2, "", false),
    RLH_OP(rope_kv_cache_write, "ffikikk", 5, "fqq", 3, "", false),
    RLH_OP(paged_attention, "fqqiikk", 5, "f", 1, "", false),
    RLH_OP(decode_layer_fwd, "fffffffiiik", 11, "fff", 3, "", false),
    RLH_OP(sample, "fdi", 2, "ik", 2, "", false),
    RLH_OP(clipped_pg_loss, "fffffifff", 6, "fff", 2, "", true),
    RLH_OP(nll_loss, "fffi", 4, "fff", 2, "", true),
};
#undef RLH_OP

const OpSpec* find_op(const char* name) {
  for (const OpSpec& s : kOps)
    if (name && std::strcmp(s.name, name) == 0) return &s;
  return nullptr;
}

bool same(rlh_dtype a, rlh_dtype b) { return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes; }

// Checks counts, devices and dtypes of a descriptor's operands; returns the op's float dtype
// (f64 = true) or throws UNIMPLEMENTED (an answer: another provider may take it).
bool check_operands(const OpSpec& s, const rlh_tensor* ins, size_t nin, const rlh_tensor* outs,
                    size_t nout) {
  auto unimpl = [&](const std::string& why) {
    throw Error(RLH_E_UNIMPLEMENTED, std::string("kernels_cpu ") + s.name + ": " + why);
  };
  if (nin < s.min_inputs || nin > std::strlen(s.inputs)) unimpl("wrong number of inputs");
  if (nout < s.min_outputs || nout > std::strlen(s.outputs)) unimpl("wrong number of outputs");
  int fdt = -1;  // 0 f32, 1 f64
  size_t fp8_caches = 0;
  auto visit = [&](const rlh_tensor& t, char kind) {
    if (t.device.device_type != RLH_DEVICE_CPU && t.device.device_type != RLH_DEVICE_CUDA_HOST)
      unimpl("operands must be in host memory");
    if (kind == I) {
      if (!same(t.dtype, sdk::kI32)) unimpl("index operands must be int32");
    } else if (kind == K) {
      if (!same(t.dtype, sdk::kF32)) unimpl(std::string("operand must be float32, not ") + sdk::dtype_name(t.dtype));
    } else if (kind == D) {
      if (!same(t.dtype, sdk::kF64)) unimpl(std::string("operand must be float64, not ") + sdk::dtype_name(t.dtype));
    } else if (kind == B) {
      if (!same(t.dtype, sdk::kBF16)) unimpl("this operand must be bfloat16");
    } else if (kind == Q && same(t.dtype, sdk::kE4M3)) {
      ++fp8_caches;
    } else {
      const int d = same(t.dtype, sdk::kF32) ? 0 : same(t.dtype, sdk::kF64) ? 1 : -1;
      if (d < 0) unimpl(std::string("dtype ") + sdk::dtype_name(t.dtype) + " not offered");
      if (fdt >= 0 && d != fdt) unimpl("float operands must share one dtype");
      fdt = d;
    }
  };
  for (size_t i = 0; i < nin; ++i) visit(ins[i], s.inputs[i]);
  for (size_t i = 0; i < nout; ++i) visit(outs[i], s.outputs[i]);
  if (fdt == 1 && !s.f64) unimpl("float64 is not offered for this op");
  // FP8 caches: both of them, each with its float32 scale (the two trailing inputs).
  if (fp8_caches != 0 && fp8_caches != 2) unimpl("both caches float32 or both e4m3");
  if (std::strchr(s.inputs, Q) || std::strchr(s.outputs, Q)) {
    const size_t base = std::strlen(s.inputs) - 2, scales = nin > base ? nin - base : 0;
    if (fp8_caches == 2 && scales != 2) unimpl("e4m3 caches need their two float32 scales (k_scale, v_scale) after the inputs");
    if (fp8_caches == 0 && scales != 0) unimpl("scales are for e4m3 caches");
  }
  return fdt == 1;
}

// ---------------------------------------------------------------------------------------------
// Scratch: bump allocation from the caller's workspace, then the host's allocator, then heap.

struct CallScratch {
  char* base = nullptr;
  size_t size = 0, used = 0;
  const rlh_host_api* host = nullptr;
  rlh_device device{};
  ScratchBlocks* blocks = nullptr;

  static void* alloc(void* ctx, size_t bytes) {
    auto* s = static_cast<CallScratch*>(ctx);
    const size_t need = (bytes + 63) / 64 * 64;
    const size_t start = (s->used + 63) / 64 * 64;
    if (s->base && start + need <= s->size) {
      s->used = start + need;
      return s->base + start;
    }
    if (s->blocks) {
      std::lock_guard<std::mutex> lock(s->blocks->mu);
      auto& f = s->blocks->free;
      for (size_t i = 0; i < f.size(); ++i)
        if (f[i].first == bytes) {
          void* p = f[i].second;
          f.erase(f.begin() + long(i));
          return p;
        }
    }
    if (s->host && s->host->alloc && s->host->free_memory) {
      void* p = nullptr;
      rlh_status* st = s->host->alloc(s->host->ctx, s->device, bytes, 64, &p);
      if (st) {
        rlh_status_destroy(st);
        return nullptr;
      }
      return p;
    }
    return scratch_default().alloc(nullptr, bytes);
  }
  static void free(void* ctx, void* p, size_t bytes) {
    auto* s = static_cast<CallScratch*>(ctx);
    char* c = static_cast<char*>(p);
    if (s->base && c >= s->base && c < s->base + s->size) return;  // the arena is the caller's
    if (s->blocks && s->host && s->host->alloc && s->host->free_memory) {
      std::lock_guard<std::mutex> lock(s->blocks->mu);
      s->blocks->free.emplace_back(bytes, p);
      return;
    }
    if (s->host && s->host->alloc && s->host->free_memory)
      s->host->free_memory(s->host->ctx, s->device, p);
    else
      scratch_default().free(nullptr, p, bytes);
  }
};

// ---------------------------------------------------------------------------------------------
// The KERNELS table

rlh_status* k_create(const rlh_host_api* host, rlh_device device, const char* config, size_t config_len,
                     rlh_kernels** out) {
  const sdk::MakeStatusFn make = host ? host->make_status : nullptr;
  return sdk::guard(make, [&] {
    if (device.device_type != RLH_DEVICE_CPU)
      throw Error(RLH_E_UNIMPLEMENTED, "kernels_cpu runs on the CPU only");
    g_make_status = make;
    // {"num_threads": N}: the decode-sized ops' own pool of N threads (0 or absent: the
    // process-wide pool, OMP_NUM_THREADS wide). Other keys are other providers' business.
    int64_t threads = 0;
    if (config && config_len) {
      const nlohmann::json j = nlohmann::json::parse(config, config + config_len, nullptr, false);
      if (!j.is_object()) throw Error(RLH_E_INVALID_ARGUMENT, "kernels_cpu: the instance config is not a JSON object");
      if (j.contains("num_threads")) {
        if (!j["num_threads"].is_number_integer() || j["num_threads"].get<int64_t>() < 0 ||
            j["num_threads"].get<int64_t>() > 4096)
          throw Error(RLH_E_INVALID_ARGUMENT, "kernels_cpu: num_threads must be an integer in [0, 4096], not " +
                                                  j["num_threads"].dump());
        threads = j["num_threads"].get<int64_t>();
      }
    }
    // The pool first: a thread the system refuses is an error (and nothing is leaked).
    std::unique_ptr<WorkerPool> pool;
    try {
      if (threads > 0) pool = std::make_unique<WorkerPool>(int(threads));
    } catch (const std::runtime_error& e) {
      throw Error(RLH_E_RESOURCE_EXHAUSTED, e.what());
    }
    auto* k = new rlh_kernels;
    k->host = host;
    k->device = device;
    k->own_pool = std::move(pool);
    *out = k;
    if (host && host->log) {  // loads and verifies OpenBLAS now, so the log says what was chosen
      const std::string msg = "kernels_cpu: " + cpu_features_string() + "; " + blas_info_string();
      host->log(host->ctx, RLH_LOG_INFO, msg.data(), msg.size());
    }
  });
}

void k_destroy(rlh_kernels* k) { delete k; }

rlh_status* k_list_ops(rlh_kernels*, rlh_write_fn write, void* user) {
  return sdk::guard(g_make_status, [&] {
    std::string j = "[";
    for (const OpSpec& s : kOps) {
      if (j.size() > 1) j += ",";
      j += std::string("{\"name\":\"") + s.name + "\",\"dtypes\":[\"f32\"" +
           (s.f64 ? ",\"f64\"" : "") + "],\"backward\":\"" + s.backward + "\"}";
    }
    j += "]";
    write(user, j.data(), j.size());
  });
}

rlh_status* k_get_op(rlh_kernels* k, const rlh_op_desc* d, rlh_op** out) {
  return sdk::guard(g_make_status, [&] {
    const OpSpec* s = find_op(d->name);
    if (!s) throw Error(RLH_E_UNIMPLEMENTED, std::string("kernels_cpu has no op '") + (d->name ? d->name : "") + "'");
    if (d->device.device_type != RLH_DEVICE_CPU) throw Error(RLH_E_UNIMPLEMENTED, "kernels_cpu runs on the CPU only");
    const bool f64 = check_operands(*s, d->inputs, d->num_inputs, d->outputs, d->num_outputs);
    auto* op = new rlh_op;
    op->spec = s;
    op->f64 = f64;
    op->inst = k;
    for (size_t i = 0; i < d->num_attrs; ++i) {
      const rlh_named_value& a = d->attrs[i];
      if (!a.name) continue;
      op->attrs.push_back(Attr{a.name, a.type, a.int64_value, a.double_value});
    }
    // gemm asked for batch invariance: only x W^T is offered (gemm_rows.cpp); say so at
    // resolution, so a registry falls through to a provider that offers the rest.
    if (std::strcmp(s->name, "gemm") == 0) {
      auto attr = [&](const char* n, double dflt) {
        for (const Attr& x : op->attrs)
          if (x.name == n) return x.type == RLH_VALUE_DOUBLE ? x.d : double(x.i);
        return dflt;
      };
      if (attr("batch_invariant", 0) != 0 && (attr("transpose_a", 0) != 0 || attr("transpose_b", 1) == 0)) {
        delete op;
        throw Error(RLH_E_UNIMPLEMENTED, "kernels_cpu gemm: batch_invariant is offered for C = A B^T only");
      }
    }
    *out = op;
  });
}

rlh_status* k_op_info(rlh_op* op, rlh_op_info* out) {
  return sdk::guard(g_make_status, [&] {
    // Every op is deterministic (fixed summation orders, any thread count). A row's result
    // depends only on its own input rows except where a float GEMM runs: OpenBLAS picks its
    // kernel (and so the summation order) by the problem's shape, so adding rows can change a
    // row's last bits; gemm with batch_invariant = 1 runs gemm_rows.cpp instead, which is.
    // Workspace is taken at run time.
    const std::string_view name = op->spec->name;
    bool rows = false;  // gemm asked for batch invariance (gemm_rows.cpp)
    for (const Attr& a : op->attrs) rows = rows || (a.name == "batch_invariant" && (a.type == RLH_VALUE_DOUBLE ? a.d : double(a.i)) != 0);
    const bool on_gemm = !op->f64 && !rows && (name == "gemm" || name == "grouped_gemm" ||
                                               name.rfind("linear_logprob", 0) == 0);
    rlh_op_info info{};
    info.batch_invariant = on_gemm ? 0 : 1;
    info.deterministic = 1;
    info.stateful = 0;
    info.workspace_bytes = 0;
    // Only the fields the caller's struct has (struct_size), keeping its struct_size.
    const size_t n = std::min(out->struct_size, sizeof(rlh_op_info));
    if (n > sizeof(size_t))
      std::memcpy(reinterpret_cast<char*>(out) + sizeof(size_t),
                  reinterpret_cast<const char*>(&info) + sizeof(size_t), n - sizeof(size_t));
  });
}

rlh_status* k_run(rlh_op* op, const rlh_op_call* call) {
  return sdk::guard(g_make_status, [&] {
    const OpSpec& s = *op->spec;
    if (check_operands(s, call->inputs, call->num_inputs, call->outputs, call->num_outputs) != op->f64)
      throw Error(RLH_E_INVALID_ARGUMENT, std::string(s.name) + ": dtype differs from the resolved op");
    CallScratch cs;
    cs.base = static_cast<char*>(call->workspace);
    cs.size = call->workspace ? call->workspace_bytes : 0;
    cs.host = op->inst ? op->inst->host : nullptr;
    cs.device = op->inst ? op->inst->device : rlh_device{RLH_DEVICE_CPU, 0};
    cs.blocks = op->inst ? &op->inst->scratch : nullptr;
    Call c{op, call, Scratch{CallScratch::alloc, CallScratch::free, &cs}};
    (op->f64 ? s.run64 : s.run32)(c);
  });
}

void k_release_op(rlh_op* op) { delete op; }

// Scratch of the two kinds of op that take any (attention's tiles, the logprob head's logits
// tiles), so a caller can pass it as the call's workspace and nothing is allocated per call.
rlh_status* k_workspace_size(rlh_op* op, const rlh_op_call* call, size_t* bytes) {
  return sdk::guard(g_make_status, [&] {
    if (bytes == nullptr || call == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "workspace_size: NULL argument");
    *bytes = 0;
    const std::string_view name = op->spec->name;
    const size_t es = op->f64 ? sizeof(double) : sizeof(float);
    const int threads = num_threads();
    Call c{op, call, Scratch{}};
    if (name == "attention_fwd" || name == "attention_bwd") {
      const bool bwd = name == "attention_bwd";
      const rlh_tensor& q = c.in(bwd ? 1 : 0);
      const rlh_tensor& cu = c.in(bwd ? 6 : 3);
      if (q.ndim != 3 || cu.ndim != 1) return;  // run() refuses such operands
      *bytes = attention_workspace(bwd, cu.shape[0] - 1, q.shape[0], q.shape[1], es, threads, c.num("softcap", 0) > 0);
    } else if (name == "linear_logprob_fwd" || name == "linear_logprob_bwd") {
      const bool bwd = name == "linear_logprob_bwd";
      if (c.in(0).ndim != 2 || c.in(1).ndim != 2) return;
      *bytes = linear_logprob_workspace(bwd, c.in(0).shape[0], c.in(1).shape[0], targets_per_token(c.in(2)),
                                        logprob_opts(c), bwd && c.has_in(6), es, threads);
    }
  });
}

// kernels_cpu is the contract's reference: registries order it last, check-kernels compares
// every other provider with it. Its operands are host memory.
rlh_status* k_provider_info(rlh_kernels*, rlh_write_fn write, void* user) {
  return sdk::guard(g_make_status, [&] {
    static const char kInfo[] = "{\"reference\":true,\"memory\":\"host\"}";
    write(user, kInfo, sizeof(kInfo) - 1);
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
  a.state_save = nullptr;  // no stateful ops
  a.state_load = nullptr;
  a.provider_info = k_provider_info;
  // Host memory: no memory services.
  a.workspace_size = k_workspace_size;
  return a;
}();

const rlh_component_desc kComponent =
    sdk::component_desc(RLH_KIND_KERNELS, "kernels_cpu", "0.1.0", RLH_KERNELS_API_VERSION_MAJOR,
                        RLH_KERNELS_API_VERSION_MINOR, &kApi,
                        "fp32/fp64 reference kernels (OpenBLAS sgemm, flash-style attention)");
const rlh_component_desc* const kComponents[] = {&kComponent};

}  // namespace
}  // namespace rlh::kcpu

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("kernels_cpu", "0.1.0", "rlhost", rlh::kcpu::kComponents,
                                        "CPU reference kernel provider"));
