// kernels_cuda's op entry points for the layers of a model and their training: gemm (and its
// GLU epilogue), embedding, norms, RoPE, attention, GLUs, bias and residual adds, the fused
// logprob head, AdamW, the gradient norm's sums, scaling and the GRPO/SFT losses. Each checks its
// operands (docs/ops.md) and queues the launchers of rlh_kernels_cuda_core on the call's stream.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "op_call.hpp"

namespace rlh::kcuda {

namespace {

// gemm with batch_invariant = 1 (docs/ops.md): C = A B^T with every row of C a function of its
// row of A alone, whatever M (a generator's deterministic mode): grouped_gemm.cu's tiles over one
// group of rows, whose summation order never depends on the number of rows (cuBLASLt picks its
// kernel, split-K included, by the problem's shape; this one splits K by N and K alone). Only
// 2-D C = A B^T, alpha 1, beta 0.
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
  g.invariant_split = true;
  // Split K (grouped_gemm.cu): partial sums in bands of rows of at most 32 MiB, so a graph-captured
  // decoding step's products stay inside the caller's workspace (the generator gives 64 MiB).
  if (const int64_t all = gemm_rows_partial_bytes(g, g.T)) {
    const int64_t row = gemm_rows_partial_bytes(g, 1);
    g.split_ws_bytes = size_t(std::min<int64_t>(all, std::max<int64_t>(row, int64_t(32) << 20)));
    g.split_ws = c.ws->get(g.split_ws_bytes);
  }
  grouped_gemm(g, c.stream);
}

}  // namespace

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

namespace {

// A bf16 few-row-capable product C [M, N] = X [M, K] W^T, W [rows, K] (rows = N, or 2N for a
// gate | up weight), its operands checked and named after `op`.
GemmArgs bf16_product(const rlh_tensor& X, const rlh_tensor& W, const rlh_tensor& C, int64_t M, int64_t N, int64_t K,
                      int64_t rows, const std::string& op) {
  GemmArgs g;
  g.M = M;
  g.N = N;
  g.K = K;
  g.tb = true;
  g.A = ptr(X);
  g.lda = need_rows(X, M, K, (op + " x").c_str());
  g.B = ptr(W);
  g.ldb = need_rows(W, rows, K, (op + " W").c_str());
  g.C = ptr(C);
  g.ldc = need_rows(C, M, N, (op + " output").c_str());
  g.ab = DType::bf16;
  g.c_dt = DType::bf16;
  return g;
}

// h = act(x Wg^T) * (x Wu^T) for g's A and W = gate | up [2 g.N, K] into g's C: gemv.cu's GLU
// epilogue at few rows, else gemm into a [M, 2N] workspace and the GLU kernel.
void product_glu(const Call& c, GemmArgs g, int64_t act) {
  if (gemv_glu_rows(g, int(act), c.stream)) return;
  const int64_t M = g.M, F = g.N, ldh = g.ldc;
  void* H = g.C;
  void* gu = c.ws->get(size_t(M * 2 * F) * 2);
  g.N = 2 * F;
  g.C = gu;
  g.ldc = 2 * F;
  gemm(c.op->inst->gemm, g, *c.ws, c.stream);
  const uint16_t* gate = static_cast<const uint16_t*>(gu);  // bf16 [M, 2F]: gate, then up
  if (act == 0)
    swiglu_fwd(DType::bf16, H, ldh, gate, 2 * F, gate + F, 2 * F, M, F, c.stream);
  else
    geglu_fwd(DType::bf16, H, ldh, gate, 2 * F, gate + F, 2 * F, M, F, act == 1, c.stream);
}

}  // namespace

// x [M, K], W = gate | up [2F, K] -> h [M, F] = act(x Wg^T) * (x Wu^T), each product rounded to
// bf16 first: gemm then swiglu_fwd / geglu_fwd. Few rows on gemv.cu's GLU epilogue; otherwise
// the two ops through a [M, 2F] workspace.
void run_gemm_glu_fwd(const Call& c) {
  const rlh_tensor &X = c.in(0), &W = c.in(1), &H = c.out(0);
  const int64_t act = c.integer("activation", 0);
  const sdk::ProductSizes z = sdk::fused_product_sizes("gemm_glu_fwd", X, W, H, act, 0);
  if (c.dt() != DType::bf16) bad("gemm_glu_fwd: bf16 only");
  product_glu(c, bf16_product(X, W, H, z.M, z.N, z.K, z.rows, "gemm_glu_fwd"), act);
}

// x [M, K], w [K], W [N, K] (gate | up [2N, K] with an activation) -> h [M, N] = rmsnorm(x) W^T
// (or its GLU): rmsnorm_fwd, gemm (then swiglu_fwd), bitwise. Few rows on gemv.cu's normalising
// prologue (a decoding step's norm launch saved); otherwise the ops through a workspace.
void run_rmsnorm_gemm_fwd(const Call& c) {
  const rlh_tensor &X = c.in(0), &W = c.in(2), &H = c.out(0);
  const int64_t act = c.integer("activation", -1);
  const sdk::ProductSizes z = sdk::fused_product_sizes("rmsnorm_gemm_fwd", X, W, H, act, -1);
  const int64_t M = z.M, K = z.K, N = z.N, rows = z.rows;
  need_vec(c.in(1), K, "rmsnorm_gemm_fwd w");
  if (c.dt() != DType::bf16) bad("rmsnorm_gemm_fwd: bf16 only");
  GemmArgs g = bf16_product(X, W, H, M, N, K, rows, "rmsnorm_gemm_fwd");
  GemvExtra ex;
  ex.norm_w = static_cast<const uint16_t*>(ptr(c.in(1)));
  ex.eps = float(c.num("eps", 1e-6));
  ex.woff = float(c.num("weight_offset", 0));
  if (gemv_norm_rows(g, int(act), ex, c.stream)) return;
  void* xn = c.ws->get(size_t(M * K) * 2);  // the norm, then the product (and its GLU) as the ops run them
  rmsnorm_fwd(DType::bf16, xn, K, Flex{}, g.A, g.lda, ex.norm_w, M, K, ex.eps, ex.woff, c.stream);
  g.A = xn;
  g.lda = K;
  if (act < 0)
    gemm(c.op->inst->gemm, g, *c.ws, c.stream);
  else
    product_glu(c, g, act);
}

// x [M, K], W [N, K], r [M, N] -> y [M, N] = r + x W^T, the product rounded first: gemm then
// add_fwd, bitwise; y may be r. Few rows on gemv.cu's residual epilogue (a decoding step's add
// launch saved); otherwise the two ops through a workspace. round_product = 0: r is the GEMM's
// C (cuBLASLt's epilogue adds it to the fp32 product, in most kernels before the one rounding),
// no workspace, no add pass.
void run_gemm_add_fwd(const Call& c) {
  const rlh_tensor &X = c.in(0), &W = c.in(1), &Rt = c.in(2), &Y = c.out(0);
  const sdk::ProductSizes z = sdk::fused_product_sizes("gemm_add_fwd", X, W, Y, -1, -1);
  const int64_t M = z.M, K = z.K, N = z.N;
  if (c.dt() != DType::bf16) bad("gemm_add_fwd: bf16 only");
  GemmArgs g = bf16_product(X, W, Y, M, N, K, N, "gemm_add_fwd");
  GemvExtra ex;
  ex.res = static_cast<const uint16_t*>(ptr(Rt));
  ex.ldres = need_rows(Rt, M, N, "gemm_add_fwd r");
  if (c.num("round_product", 1) == 0) {
    if (ex.ldres != g.ldc && static_cast<const void*>(ex.res) != g.C) {  // r into y first: C's layout is y's
      if (cudaMemcpy2DAsync(g.C, size_t(g.ldc) * 2, ex.res, size_t(ex.ldres) * 2, size_t(N) * 2, size_t(M),
                            cudaMemcpyDeviceToDevice, c.stream) != cudaSuccess)
        bad(std::string("gemm_add_fwd: copying r: ") + cudaGetErrorString(cudaGetLastError()));
    } else {
      g.Cin = ex.res;  // (r itself when y is r: in place)
    }
    g.beta = 1;
    gemm(c.op->inst->gemm, g, *c.ws, c.stream);
    return;
  }
  if (gemv_add_rows(g, ex, c.stream)) return;
  // The product into a workspace, then y = r + p row by row (add_fwd: contiguous rows at once).
  void* p = c.ws->get(size_t(M * N) * 2);
  const int64_t ldy = g.ldc;
  g.C = p;
  g.ldc = N;
  gemm(c.op->inst->gemm, g, *c.ws, c.stream);
  const uint16_t* pr = static_cast<const uint16_t*>(p);
  uint16_t* y = static_cast<uint16_t*>(ptr(Y));
  if (ldy == N && ex.ldres == N) {
    add_fwd(DType::bf16, y, ex.res, pr, M * N, c.stream);
  } else {
    for (int64_t r = 0; r < M; ++r) add_fwd(DType::bf16, y + r * ldy, ex.res + r * ex.ldres, pr + r * N, N, c.stream);
  }
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

namespace {

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

}  // namespace

void run_rope_fwd(const Call& c) { run_rope(c, false); }

void run_rope_bwd(const Call& c) { run_rope(c, true); }

namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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

void run_scale(const Call& c) {
  ListStore x = list_of(c.call->outputs, c.nout(), 0, 1, "scale x");
  scale(x.list(), float(c.num("scale", 1)), *c.ws, c.stream);
}

}  // namespace rlh::kcuda
