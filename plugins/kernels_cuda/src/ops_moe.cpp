// kernels_cuda's op entry points for mixture of experts (moe_router.cu, moe_permute.cu,
// grouped_gemm.cu). Operand checks are kernels_cpu's; what only the device can check (expert ids,
// row permutations, offsets) raises the error flag. Routing weights, probs, lse and their
// gradients are statistics ('s': f32 in a bf16 op); the router also runs in f64 (the engine's
// router_fp64).

#include <cmath>
#include <cstring>
#include <memory>

#include "op_call.hpp"

namespace rlh::kcuda {

namespace {

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

}  // namespace

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

}  // namespace rlh::kcuda
