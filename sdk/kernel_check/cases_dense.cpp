// Cases of the dense ops: gemm, embedding, rmsnorm, rope, attention, swiglu, geglu, bias, add.
// Shapes are small and odd (so vector tails and partial tiles run), several operands are strided
// (q/k/v read out of a fused projection, gate out of gate|up), and the larger ones cross the
// tiles and thread splits of the providers we have (attention over 256-key tiles, a GEMM past
// one OpenBLAS block).
#include <cmath>
#include <cstdio>
#include <string>

#include "cases.hpp"

namespace rlh::sdk::kcheck {
namespace {

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof(b), "%g", v);
  return b;
}

Case gemm_case(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, double beta,
               int64_t pad) {
  Case c;
  c.name = "gemm ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) + " M=" + std::to_string(M) +
           " N=" + std::to_string(N) + " K=" + std::to_string(K) + " alpha=" + num(alpha) +
           " beta=" + num(beta) + " lda+" + std::to_string(pad);
  const int64_t arows = ta ? K : M, acols = ta ? M : K, lda = acols + pad;
  const int64_t brows = tb ? N : K, bcols = tb ? K : N;
  c.in_sizes = {arows * lda, brows * bcols, M * N};
  c.in_scale = {1, 1, 1};
  c.out_sizes = {M * N};
  c.fwd.op = "gemm";
  c.fwd.inputs = {in(0, strided({arows, acols}, {lda, 1})), in(1, contiguous({brows, bcols}))};
  c.fwd.outputs = {out(0, contiguous({M, N}))};
  c.fwd.attrs = {attr_i("transpose_a", ta), attr_i("transpose_b", tb), attr_d("alpha", alpha),
                 attr_d("beta", beta)};
  c.fwd.init_outputs = {{2, 0}};
  return c;
}

// gemm C = A B^T with B marked a weight: plain gemm in every variant, and the weight-only
// variant's case (bf16 A x e4m3 B with its scale; K in 64s, N in 32s, as such products take).
Case gemm_weight_case(int64_t M, int64_t N, int64_t K, double alpha, double beta, int64_t pad) {
  Case c = gemm_case(false, true, M, N, K, alpha, beta, pad);
  c.name = "gemm C = A B^T, B a weight: M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" +
           std::to_string(K) + " alpha=" + num(alpha) + " beta=" + num(beta) + " lda+" + std::to_string(pad);
  c.fwd.inputs[1].role = Role::weight;
  return c;
}

Case gemm_batched_case() {
  Case c;
  const int64_t batch = 3, M = 5, N = 6, K = 7;
  c.name = "gemm batched 3x[5x7 @ (6x7)^T]";
  c.in_sizes = {batch * M * K, batch * N * K};
  c.in_scale = {1, 1};
  c.out_sizes = {batch * M * N};
  c.fwd.op = "gemm";
  c.fwd.inputs = {in(0, contiguous({batch, M, K})), in(1, contiguous({batch, N, K}))};
  c.fwd.outputs = {out(0, contiguous({batch, M, N}))};
  c.fwd.attrs = {attr_i("transpose_b", 1)};
  return c;
}

// gemm with batch_invariant = 1 (a generator's products, C = A B^T): every row of C must depend
// on its own row of A only, bitwise; the forward again on the first `prefix` rows checks it.
Case gemm_rows_case(int64_t M, int64_t N, int64_t K, int64_t pad, int64_t prefix) {
  Case c;
  const int64_t lda = K + pad;
  c.name = "gemm batch_invariant C = A B^T M=" + std::to_string(M) + " N=" + std::to_string(N) +
           " K=" + std::to_string(K) + " lda+" + std::to_string(pad) + " (rows 0.." + std::to_string(prefix - 1) +
           " again alone)";
  c.in_sizes = {M * lda, N * K};
  c.in_scale = {1, 1};
  c.out_sizes = {M * N};
  const std::vector<Attr> attrs = {attr_i("transpose_b", 1), attr_i("batch_invariant", 1)};
  c.fwd = {"gemm", {in(0, strided({M, K}, {lda, 1})), in(1, contiguous({N, K}))}, {out(0, contiguous({M, N}))}, attrs, {}, {}};
  c.fwd_prefix = {"gemm",
                  {in(0, strided({prefix, K}, {lda, 1})), in(1, contiguous({N, K}))},
                  {out(0, strided({prefix, N}, {N, 1}))},
                  attrs,
                  {},
                  {}};
  return c;
}

Case embedding_case() {
  Case c;
  const int64_t V = 11, C = 13;
  const std::vector<int32_t> ids = {3, 0, 10, 3, 3, 7, 1, 0, 5};
  const int64_t N = int64_t(ids.size());
  c.name = "embedding V=11 C=13 N=9 (repeated ids)";
  c.in_sizes = {V * C};
  c.in_scale = {1};
  c.out_sizes = {N * C};
  c.ints = {IntBuf{ids, {N}}};
  c.fwd = {"embedding_fwd", {ints(0, {N}), in(0, contiguous({V, C}))}, {out(0, contiguous({N, C}))}, {}, {}, {}};
  c.bwd = {"embedding_bwd", {ints(0, {N}), gout(0, contiguous({N, C}))}, {gin(0, contiguous({V, C}))}, {}, {}, {0}};
  return c;
}

Case rmsnorm_case(int64_t N, int64_t C, double w_offset, int64_t ldx, int64_t ldy) {
  Case c;
  const double eps = 1e-5;
  c.name = "rmsnorm N=" + std::to_string(N) + " C=" + std::to_string(C) + " w_offset=" + num(w_offset) +
           " ldx=" + std::to_string(ldx) + " ldy=" + std::to_string(ldy);
  c.in_sizes = {N * ldx, C};
  c.in_scale = {1, 0.5};
  c.out_sizes = {N * ldy, N};
  c.fwd = {"rmsnorm_fwd",
           {in(0, strided({N, C}, {ldx, 1})), in(1, contiguous({C}))},
           {out(0, strided({N, C}, {ldy, 1})), out(1, contiguous({N}))},
           {attr_d("eps", eps), attr_d("weight_offset", w_offset)},
           {},
           {}};
  c.bwd = {"rmsnorm_bwd",
           {gout(0, strided({N, C}, {ldy, 1})), in(0, strided({N, C}, {ldx, 1})), in(1, contiguous({C})),
            saved(1, contiguous({N}))},
           {gin(0, strided({N, C}, {ldx, 1})), gin(1, contiguous({C}))},
           {attr_d("weight_offset", w_offset)},
           {},
           {1}};
  return c;
}

Case rope_case(int64_t H, int64_t D, int64_t R, bool interleaved, double scale, int64_t ld) {
  Case c;
  const std::vector<int32_t> pos = {0, 1, 7, 100, 4095, 33};
  const int64_t N = int64_t(pos.size());
  std::vector<float> inv_freq(size_t(R / 2));
  for (int64_t i = 0; i < R / 2; ++i) inv_freq[size_t(i)] = float(std::pow(10000.0, -2.0 * double(i) / double(R)));
  c.name = "rope H=" + std::to_string(H) + " D=" + std::to_string(D) + " R=" + std::to_string(R) +
           (interleaved ? " interleaved" : " half_split") + " scale=" + num(scale) + " ld=" + std::to_string(ld);
  c.in_sizes = {N * ld};
  c.in_scale = {1};
  c.out_sizes = {N * ld};
  c.ints = {IntBuf{pos, {N}}};
  c.consts = {inv_freq};
  const Layout lay = strided({N, H, D}, {ld, D, 1});
  const std::vector<Attr> attrs = {attr_d("scale", scale), attr_i("interleaved", interleaved)};
  c.fwd = {"rope_fwd", {in(0, lay), ints(0, {N}), cst(0, {R / 2})}, {out(0, lay)}, attrs, {}, {}};
  c.bwd = {"rope_bwd", {gout(0, lay), ints(0, {N}), cst(0, {R / 2})}, {gin(0, lay)}, attrs, {}, {}};
  return c;
}

struct AttnShape {
  std::vector<int32_t> cu;
  int64_t Hq, Hkv, Dk, Dv, window;
  int64_t pad = 0;     // extra elements per token row of q/k/v/o (as when read out of fused qkv)
  double softcap = 0;  // Gemma-2's attn_logit_softcapping (the attribute only when set)
};

Case attention_case(const AttnShape& a) {
  Case c;
  const int64_t S = int64_t(a.cu.size()) - 1, N = a.cu.back();
  const int64_t Hq = a.Hq, Hkv = a.Hkv, Dk = a.Dk, Dv = a.Dv, W = a.window;
  const int64_t ldq = Hq * Dk + a.pad, ldk = Hkv * Dk + a.pad, ldv = Hkv * Dv + a.pad, ldo = Hq * Dv + a.pad;
  const double scale = 1.0 / std::sqrt(double(Dk));
  c.name = "attention S=" + std::to_string(S) + " N=" + std::to_string(N) + " Hq=" + std::to_string(Hq) +
           " Hkv=" + std::to_string(Hkv) + " Dk=" + std::to_string(Dk) + " Dv=" + std::to_string(Dv) +
           " window=" + std::to_string(W) + " pad=" + std::to_string(a.pad) +
           (a.softcap > 0 ? " softcap=" + num(a.softcap) : "");
  c.in_sizes = {N * ldq, N * ldk, N * ldv};
  c.in_scale = {1.5, 1.5, 1};
  c.out_sizes = {N * ldo, Hq * N};
  c.ints = {IntBuf{a.cu, {S + 1}}};
  const Layout lq = strided({N, Hq, Dk}, {ldq, Dk, 1}), lk = strided({N, Hkv, Dk}, {ldk, Dk, 1}),
               lv = strided({N, Hkv, Dv}, {ldv, Dv, 1}), lo = strided({N, Hq, Dv}, {ldo, Dv, 1}),
               llse = contiguous({Hq, N});
  std::vector<Attr> attrs = {attr_d("scale", scale), attr_i("window", W)};
  if (a.softcap > 0) attrs.push_back(attr_d("softcap", a.softcap));
  c.fwd = {"attention_fwd", {in(0, lq), in(1, lk), in(2, lv), ints(0, {S + 1})}, {out(0, lo), out(1, llse)}, attrs, {}, {}};
  c.bwd = {"attention_bwd",
           {gout(0, lo), in(0, lq), in(1, lk), in(2, lv), saved(0, lo), saved(1, llse), ints(0, {S + 1})},
           {gin(0, lq), gin(1, lk), gin(2, lv)},
           attrs,
           {},
           {}};
  return c;
}

// gate [N,F] with row stride ldg (gate|up fused), up and h contiguous.
Case glu_case(const char* op, const std::string& label, int64_t N, int64_t F, int64_t ldg,
              std::vector<Attr> attrs) {
  Case c;
  c.name = label + " N=" + std::to_string(N) + " F=" + std::to_string(F) + " ldg=" + std::to_string(ldg);
  c.in_sizes = {N * ldg, N * F};
  c.in_scale = {2, 1};
  c.out_sizes = {N * F};
  const std::string fwd = std::string(op) + "_fwd", bwd = std::string(op) + "_bwd";
  c.fwd = {fwd, {in(0, strided({N, F}, {ldg, 1})), in(1, contiguous({N, F}))}, {out(0, contiguous({N, F}))}, attrs, {}, {}};
  c.bwd = {bwd,
           {gout(0, contiguous({N, F})), in(0, strided({N, F}, {ldg, 1})), in(1, contiguous({N, F}))},
           {gin(0, strided({N, F}, {ldg, 1})), gin(1, contiguous({N, F}))},
           attrs,
           {},
           {}};
  return c;
}

Case bias_case() {
  Case c;
  const int64_t N = 6, M = 21, ld = M + 3;
  c.name = "bias_add N=6 M=21 ld=24";
  c.in_sizes = {N * ld, M};
  c.in_scale = {1, 1};
  c.out_sizes = {N * ld};
  c.fwd = {"bias_add_fwd", {in(1, contiguous({M}))}, {out(0, strided({N, M}, {ld, 1}))}, {}, {{0, 0}}, {}};
  c.bwd = {"bias_bwd", {gout(0, strided({N, M}, {ld, 1}))}, {gin(1, contiguous({M}))}, {}, {}, {0}};
  return c;
}

// A residual add and the next norm in one op (decoding's layer boundary): y = a + b, yn = norm(y).
Case add_rmsnorm_case(int64_t N, int64_t C, double w_offset) {
  Case c;
  c.name = "add_rmsnorm N=" + std::to_string(N) + " C=" + std::to_string(C) + " w_offset=" + num(w_offset);
  c.in_sizes = {N * C, N * C, C};
  c.in_scale = {1, 1, 0.5};
  c.out_sizes = {N * C, N * C};
  c.fwd = {"add_rmsnorm_fwd",
           {in(0, contiguous({N, C})), in(1, contiguous({N, C})), in(2, contiguous({C}))},
           {out(0, contiguous({N, C})), out(1, contiguous({N, C}))},
           {attr_d("eps", 1e-5), attr_d("weight_offset", w_offset)},
           {},
           {}};
  return c;
}

// The gate|up product and its GLU in one op: h = act(x Wg^T) * (x Wu^T), W = gate | up [2F, K].
Case gemm_glu_case(int64_t M, int64_t K, int64_t F, int act) {
  Case c;
  c.name = "gemm_glu M=" + std::to_string(M) + " K=" + std::to_string(K) + " F=" + std::to_string(F) +
           " activation=" + std::to_string(act);
  c.in_sizes = {M * K, 2 * F * K};
  c.in_scale = {1, 0.3};
  c.out_sizes = {M * F};
  c.fwd = {"gemm_glu_fwd",
           {in(0, contiguous({M, K})), in(1, contiguous({2 * F, K}))},
           {out(0, contiguous({M, F}))},
           {attr_i("activation", act)},
           {},
           {}};
  return c;
}

// A norm and the product that reads it in one op: h = rmsnorm(x) W^T (with an activation, the
// GLU of the product's gate | up halves, W [2N, K]).
Case rmsnorm_gemm_case(int64_t M, int64_t K, int64_t N, int act, double w_offset) {
  Case c;
  const int64_t rows = act >= 0 ? 2 * N : N;
  c.name = "rmsnorm_gemm M=" + std::to_string(M) + " K=" + std::to_string(K) + " N=" + std::to_string(N) +
           " activation=" + std::to_string(act) + " w_offset=" + num(w_offset);
  c.in_sizes = {M * K, K, rows * K};
  c.in_scale = {1, 0.5, 0.3};
  c.out_sizes = {M * N};
  c.fwd = {"rmsnorm_gemm_fwd",
           {in(0, contiguous({M, K})), in(1, contiguous({K})), in(2, contiguous({rows, K}))},
           {out(0, contiguous({M, N}))},
           {attr_d("eps", 1e-5), attr_d("weight_offset", w_offset), attr_i("activation", act)},
           {},
           {}};
  return c;
}

// A product and the residual add after it in one op: y = r + x W^T (round_product 0: the
// product unrounded before the add, a GEMM epilogue's form).
Case gemm_add_case(int64_t M, int64_t K, int64_t N, int round_product = 1) {
  Case c;
  c.name = "gemm_add M=" + std::to_string(M) + " K=" + std::to_string(K) + " N=" + std::to_string(N) +
           (round_product ? "" : " round_product=0");
  c.in_sizes = {M * K, N * K, M * N};
  c.in_scale = {1, 0.3, 1};
  c.out_sizes = {M * N};
  c.fwd = {"gemm_add_fwd",
           {in(0, contiguous({M, K})), in(1, contiguous({N, K})), in(2, contiguous({M, N}))},
           {out(0, contiguous({M, N}))},
           round_product ? std::vector<Attr>{} : std::vector<Attr>{attr_i("round_product", 0)},
           {},
           {}};
  return c;
}

Case add_case() {
  Case c;
  const int64_t n = 1000;
  c.name = "add n=1000";
  c.in_sizes = {n, n};
  c.in_scale = {1, 1};
  c.out_sizes = {n};
  c.fwd = {"add_fwd", {in(0, contiguous({n})), in(1, contiguous({n}))}, {out(0, contiguous({n}))}, {}, {}, {}};
  return c;
}

}  // namespace

void add_dense_cases(std::vector<Case>& v) {
  for (int t = 0; t < 4; ++t) {
    v.push_back(gemm_case(t & 1, t & 2, 7, 9, 11, 0.7, 0.0, 0));
    v.push_back(gemm_case(t & 1, t & 2, 13, 5, 8, 1.0, 0.5, 3));
  }
  v.push_back(gemm_case(false, true, 70, 45, 300, 1.0, 0.0, 0));  // threaded split, BLAS blocks
  v.push_back(gemm_case(true, false, 40, 96, 130, 1.0, 1.0, 0));
  // C = A B^T at sizes and row strides in multiples of 16 bytes: the only products an FP8 GEMM
  // on cuBLASLt takes (both operands K-major), so an FP8 provider has cases it answers.
  v.push_back(gemm_case(false, true, 32, 48, 64, 1.0, 0.0, 16));
  v.push_back(gemm_case(false, true, 48, 64, 256, 0.5, 0.5, 0));
  v.push_back(gemm_batched_case());
  v.push_back(gemm_rows_case(9, 13, 37, 3, 4));
  v.push_back(gemm_rows_case(33, 40, 300, 0, 1));  // K past one 16-lane block, a single row alone
  v.push_back(embedding_case());
  v.push_back(rmsnorm_case(5, 37, 0.0, 37, 37));
  v.push_back(rmsnorm_case(6, 40, 1.0, 43, 45));
  v.push_back(rope_case(3, 16, 16, false, 1.0, 48));
  v.push_back(rope_case(2, 16, 8, true, 1.3, 40));
  v.push_back(rope_case(2, 12, 8, false, 0.9, 24));
  v.push_back(attention_case({{0, 37}, 4, 2, 8, 8, 0}));
  v.push_back(attention_case({{0, 5, 5, 30, 31}, 4, 1, 8, 6, 0}));  // packed, empty, MQA, Dv != Dk
  v.push_back(attention_case({{0, 40, 67}, 2, 2, 8, 8, 7, 5}));     // window, strided
  v.push_back(attention_case({{0, 300}, 2, 1, 4, 4, 0}));           // several key tiles
  v.push_back(attention_case({{0, 17, 317}, 4, 2, 4, 4, 100}));     // window across tiles
  v.push_back(attention_case({{0, 40, 67}, 2, 2, 8, 8, 7, 5, 1.5}));  // soft-capped (Gemma-2), window, strided
  // the head dims models use (and tensor-core attention providers accept), q/k/v out of fused qkv
  v.push_back(attention_case({{0, 50, 51, 130}, 4, 2, 64, 64, 0, 64}));
  v.push_back(attention_case({{0, 70, 97}, 2, 1, 128, 128, 33}));
  // soft-capped at a head dim tensor-core kernels take uncapped, and at Gemma's 256
  v.push_back(attention_case({{0, 50, 51, 130}, 4, 2, 64, 64, 0, 64, 1.5}));
  v.push_back(attention_case({{0, 33, 70}, 2, 1, 256, 256, 16, 0, 1.5}));
  v.push_back(glu_case("swiglu", "swiglu", 7, 19, 21, {}));
  v.push_back(glu_case("geglu", "geglu tanh", 6, 23, 26, {attr_i("approximate_tanh", 1)}));
  v.push_back(glu_case("geglu", "geglu erf", 6, 23, 26, {attr_i("approximate_tanh", 0)}));
  v.push_back(bias_case());
  v.push_back(add_case());
  v.push_back(add_rmsnorm_case(3, 64, 0.0));    // vector rows
  v.push_back(add_rmsnorm_case(4, 2056, 1.0));  // rows past one warp's 256-value stride, Gemma's offset
  v.push_back(add_rmsnorm_case(2, 37, 0.0));    // rows that do not vectorise
  v.push_back(gemm_glu_case(1, 64, 24, 0));      // a decoding row: kernels_cuda's few-row path
  v.push_back(gemm_glu_case(3, 2056, 40, 1));    // several warps a column, GeGLU (tanh)
  v.push_back(gemm_glu_case(9, 48, 32, 2));      // past the few rows: gemm, then the GLU (erf)
}

// Cases added after the list above was fixed (all_cases: appended last, so the earlier cases
// keep their indices, which seed their inputs).
void add_dense_cases_late(std::vector<Case>& v) {
  // gemm batch_invariant on tensor-core shapes (K, lda multiples of 8), where kernels_cuda splits
  // K by N and K: one k-block a chunk over two column tiles, and a decoding step's o_proj (16
  // tiles, 16 chunks); then many rows (kernels_cuda runs the chunks inside one block from 1,024
  // rows) against three alone (split over blocks): the two paths' bits must agree.
  v.push_back(gemm_rows_case(70, 200, 1040, 8, 3));
  v.push_back(gemm_rows_case(5, 2048, 2048, 0, 2));
  v.push_back(gemm_rows_case(1100, 200, 1040, 8, 3));
}

// The fused decoding products (appended last: the cases before keep their indices, so their seeds).
void add_fused_product_cases(std::vector<Case>& v) {
  v.push_back(rmsnorm_gemm_case(1, 64, 24, -1, 0.0));    // a decoding row: the few-row product's prologue
  v.push_back(rmsnorm_gemm_case(3, 2056, 40, 0, 1.0));   // several warps a column, SwiGLU, Gemma's offset
  v.push_back(rmsnorm_gemm_case(2, 2048, 64, -1, 0.0));  // one warp a column over a whole 2048 row
  v.push_back(rmsnorm_gemm_case(9, 48, 32, 1, 0.0));     // past the few rows: the ops (GeGLU, tanh)
  v.push_back(gemm_add_case(1, 64, 24));                 // the few-row product's residual epilogue
  v.push_back(gemm_add_case(3, 8192, 40));               // several warps a column (a down projection's K)
  v.push_back(gemm_add_case(9, 48, 32));                 // past the few rows: gemm, then add_fwd
}

// The training forward's residual epilogue (opt-in; appended last, as the fused products): many rows
// (cuBLASLt with r as C), a few rows (the same, not the few-row kernel's two roundings).
void add_residual_epilogue_cases(std::vector<Case>& v) {
  v.push_back(gemm_add_case(80, 64, 48, 0));
  v.push_back(gemm_add_case(2, 96, 40, 0));
}

void add_weight_only_cases(std::vector<Case>& v) {
  // gemm with B marked a weight: the weight-only variant's cases (bf16 x e4m3; decoding's rows).
  v.push_back(gemm_weight_case(1, 32, 64, 1.0, 0.0, 0));
  v.push_back(gemm_weight_case(13, 96, 192, 0.5, 0.5, 16));
  v.push_back(gemm_weight_case(70, 64, 128, 1.0, 0.0, 0));  // two chunks of 64 tokens
}

}  // namespace rlh::sdk::kcheck
