// Cases of the MoE ops (router, permute / unpermute, grouped gemm) and of the optimizer ops
// (adamw, adamw_bf16, sumsq, amax, scale). The MoE integer outputs (chosen experts, permutation rows,
// group offsets) are compared exactly with the reference's, and the backward calls read the
// reference's.
#include <cstdio>
#include <string>

#include "cases.hpp"

namespace rlh::sdk::kcheck {
namespace {

struct RouterOpts {
  int64_t scoring = 0;
  bool norm_topk_prob = false;
  double scaling_factor = 1.0;
  bool replay = false;
  int64_t n_group = 1, topk_group = 1;
};

// Outputs: weights [N,K], probs [N,E], lse [N]; experts int32 [N,K] is ints[0]. lse enters the
// loss (as a router z-loss does) with softmax scoring.
Case router_case(const std::string& label, int64_t N, int64_t E, int64_t K, int64_t pad, RouterOpts o,
                 bool with_bias) {
  Case c;
  const int64_t ldl = E + pad;
  const bool softmax = o.scoring == 0;
  c.name = "moe_router " + label + " N=" + std::to_string(N) + " E=" + std::to_string(E) +
           " K=" + std::to_string(K) + " ldl=" + std::to_string(ldl);
  c.in_sizes = {N * ldl};
  c.in_scale = {1.5};
  if (with_bias) {  // selection only
    c.in_sizes.push_back(E);
    c.in_scale.push_back(0.1);
  }
  c.out_sizes = {N * K, N * E, N};
  std::vector<int32_t> given(size_t(N * K), 0);
  if (o.replay)  // distinct experts per row
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) given[size_t(n * K + k)] = int32_t((n * 3 + k) % E);
  c.ints = {IntBuf{given, {N, K}}};
  c.ints_read = o.replay;
  const std::vector<Attr> attrs = {attr_i("scoring", o.scoring), attr_i("norm_topk_prob", o.norm_topk_prob),
                                   attr_d("scaling_factor", o.scaling_factor), attr_i("replay", o.replay),
                                   attr_i("n_group", o.n_group), attr_i("topk_group", o.topk_group)};
  c.fwd.op = "moe_router_fwd";
  c.fwd.inputs = {in(0, strided({N, E}, {ldl, 1}))};
  if (with_bias) c.fwd.inputs.push_back(in(1, contiguous({E})));
  c.fwd.outputs = {out(0, contiguous({N, K})), ints(0, {N, K}), out(1, contiguous({N, E})), out(2, contiguous({N}))};
  c.fwd.attrs = attrs;
  c.bwd.op = "moe_router_bwd";
  c.bwd.inputs = {gout(0, contiguous({N, K})), saved(1, contiguous({N, E})), ints(0, {N, K}),
                  gout(1, contiguous({N, E}))};
  if (softmax) c.bwd.inputs.push_back(gout(2, contiguous({N})));
  c.bwd.outputs = {gin(0, strided({N, E}, {ldl, 1}))};
  c.bwd.attrs = attrs;
  return c;
}

// The expert-sorted rows written out: expert by expert, pairs in (n, k) order.
void rows_literal(const std::vector<int32_t>& experts, int64_t N, int64_t K, int64_t E, std::vector<int32_t>& row) {
  row.assign(size_t(N * K), -1);
  int32_t r = 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < N * K; ++i)
      if (experts[size_t(i)] == e) row[size_t(i)] = r++;
}

// A fixed choice: K distinct experts per row, never expert `skip` (an expert with no rows).
std::vector<int32_t> some_experts(int64_t N, int64_t K, int64_t E, int64_t skip) {
  std::vector<int32_t> others;
  for (int32_t e = 0; e < E; ++e)
    if (e != skip) others.push_back(e);
  const int64_t m = int64_t(others.size());
  std::vector<int32_t> ex(size_t(N * K));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)  // descending runs from a row-dependent start
      ex[size_t(n * K + k)] = others[size_t(((n * 7 + n / 3) % m + m - k) % m)];
  return ex;
}

Case permute_case(int64_t N, int64_t K, int64_t E, int64_t C, int64_t pad) {
  Case c;
  const int64_t ldx = C + pad;
  c.name = "moe_permute N=" + std::to_string(N) + " K=" + std::to_string(K) + " E=" + std::to_string(E) +
           " C=" + std::to_string(C) + " ldx=" + std::to_string(ldx);
  c.in_sizes = {N * ldx};
  c.in_scale = {1};
  c.out_sizes = {N * K * C};
  c.ints = {IntBuf{some_experts(N, K, E, E / 2), {N, K}}, IntBuf{std::vector<int32_t>(size_t(N * K), 0), {N, K}},
            IntBuf{std::vector<int32_t>(size_t(E + 1), 0), {E + 1}}};
  c.fwd = {"moe_permute_fwd",
           {in(0, strided({N, C}, {ldx, 1})), ints(0, {N, K})},
           {out(0, contiguous({N * K, C})), ints(1, {N, K}), ints(2, {E + 1})},
           {},
           {},
           {}};
  c.bwd = {"moe_permute_bwd", {gout(0, contiguous({N * K, C})), ints(1, {N, K})}, {gin(0, strided({N, C}, {ldx, 1}))}, {}, {}, {}};
  return c;
}

// y = y0 + sum_k w yp[row] (the accumulate form); inputs yp [N*K,C], weights [N,K], y0 [N,ldy].
Case unpermute_case(int64_t N, int64_t K, int64_t E, int64_t C, int64_t pad) {
  Case c;
  const int64_t ldy = C + pad;
  std::vector<int32_t> row;
  rows_literal(some_experts(N, K, E, 1), N, K, E, row);
  c.name = "moe_unpermute N=" + std::to_string(N) + " K=" + std::to_string(K) + " C=" + std::to_string(C) +
           " ldy=" + std::to_string(ldy) + " accumulate";
  c.in_sizes = {N * K * C, N * K, N * ldy};
  c.in_scale = {1, 0.5, 1};
  c.out_sizes = {N * ldy};
  c.ints = {IntBuf{row, {N, K}}};
  c.fwd = {"moe_unpermute_fwd",
           {in(0, contiguous({N * K, C})), ints(0, {N, K}), in(1, contiguous({N, K}))},
           {out(0, strided({N, C}, {ldy, 1}))},
           {attr_i("accumulate", 1)},
           {{2, 0}},
           {}};
  c.bwd = {"moe_unpermute_bwd",
           {gout(0, strided({N, C}, {ldy, 1})), in(0, contiguous({N * K, C})), ints(0, {N, K}),
            in(1, contiguous({N, K}))},
           {gin(0, contiguous({N * K, C})), gin(1, contiguous({N, K}))},
           {},
           {},
           {}};
  return c;
}

// transpose_a = 0: C [T,N] = alpha A [T,K] op(B_g) + beta C0, B [G,K,N] or [G,N,K] (transpose_b).
// transpose_a = 1: C_g [M,N] = alpha A_g^T B_g + beta C0_g, A [T,M], B [T,N].
Case grouped_gemm_case(bool ta, bool tb, std::vector<int32_t> offsets, int64_t M, int64_t N, int64_t K,
                       double alpha, double beta, int64_t pad) {
  Case c;
  const int64_t G = int64_t(offsets.size()) - 1, T = offsets.back();
  char b[160];
  std::snprintf(b, sizeof(b), "grouped_gemm ta=%d tb=%d G=%lld T=%lld M=%lld N=%lld K=%lld alpha=%g beta=%g lda+%lld",
                int(ta), int(tb), (long long)G, (long long)T, (long long)M, (long long)N, (long long)K, alpha,
                beta, (long long)pad);
  c.name = b;
  c.ints = {IntBuf{offsets, {G + 1}}};
  c.in_scale = {1, 1, 1};
  c.fwd.op = "grouped_gemm";
  if (!ta) {
    const int64_t lda = K + pad;
    c.in_sizes = {T * lda, G * K * N, T * N};
    c.out_sizes = {T * N};
    c.fwd.inputs = {in(0, strided({T, K}, {lda, 1})),
                    in(1, contiguous(tb ? std::vector<int64_t>{G, N, K} : std::vector<int64_t>{G, K, N})),
                    ints(0, {G + 1})};
    c.fwd.outputs = {out(0, contiguous({T, N}))};
  } else {
    const int64_t lda = M + pad;
    c.in_sizes = {T * lda, T * N, G * M * N};
    c.out_sizes = {G * M * N};
    c.fwd.inputs = {in(0, strided({T, M}, {lda, 1})), in(1, contiguous({T, N})), ints(0, {G + 1})};
    c.fwd.outputs = {out(0, contiguous({G, M, N}))};
  }
  c.fwd.attrs = {attr_i("transpose_a", ta), attr_i("transpose_b", tb), attr_d("alpha", alpha), attr_d("beta", beta)};
  c.fwd.init_outputs = {{2, 0}};
  return c;
}

const std::vector<Attr> kAdamwAttrs(bool zero_grad) {
  return {attr_d("lr", 1e-2),           attr_d("beta1", 0.9), attr_d("beta2", 0.95), attr_d("eps", 1e-8),
          attr_d("weight_decay", 0.1), attr_i("step", 3),    attr_d("grad_scale", 0.5),
          attr_i("zero_grad", zero_grad)};
}

// p, g, m, v in/out (v drawn positive); adamw_bf16 also writes p16, bf16 of the updated p.
Case adamw_case(int64_t n, bool zero_grad, bool bf16_copy) {
  Case c;
  c.name = std::string(bf16_copy ? "adamw_bf16" : "adamw") + " n=" + std::to_string(n) + (zero_grad ? " zero_grad" : "");
  c.in_sizes = {n, n, n, n};
  c.in_scale = {1, 1, 0.1, 0.01};
  c.in_positive = {false, false, false, true};
  c.out_sizes = {n, n, n, n};
  c.fwd.op = bf16_copy ? "adamw_bf16" : "adamw";
  c.fwd.outputs = {out(0, contiguous({n})), out(1, contiguous({n})), out(2, contiguous({n})), out(3, contiguous({n}))};
  if (bf16_copy) {
    c.out_sizes.push_back(n);
    Operand p16 = out(4, contiguous({n}));
    p16.role = Role::bf16;
    c.fwd.outputs.push_back(p16);
  }
  c.fwd.attrs = kAdamwAttrs(zero_grad);
  c.fwd.init_outputs = {{0, 0}, {1, 1}, {2, 2}, {3, 3}};
  return c;
}

Case sumsq_case() {
  Case c;
  const int64_t n = 140001;
  c.name = "sumsq n=140001";
  c.in_sizes = {n};
  c.in_scale = {1};
  c.out_sizes = {1};
  c.fwd = {"sumsq", {in(0, contiguous({n}))}, {out(0, contiguous({1}))}, {}, {}, {}};
  return c;
}

// amax over a vector with one NaN-free spread of magnitudes, and over a matrix.
Case amax_case(std::vector<int64_t> shape, double sd) {
  Case c;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  c.name = "amax n=" + std::to_string(n) + (shape.size() > 1 ? " (matrix)" : "");
  c.in_sizes = {n};
  c.in_scale = {sd};
  c.out_sizes = {1};
  c.fwd = {"amax", {in(0, contiguous(shape))}, {out(0, contiguous({1}))}, {}, {}, {}};
  return c;
}

Case scale_case() {
  Case c;
  const int64_t n = 777;
  c.name = "scale n=777";
  c.in_sizes = {n};
  c.in_scale = {1};
  c.out_sizes = {n};
  c.fwd = {"scale", {}, {out(0, contiguous({n}))}, {attr_d("scale", double(0.37f))}, {{0, 0}}, {}};
  return c;
}

}  // namespace

void add_moe_cases(std::vector<Case>& v) {
  RouterOpts ro;  // Qwen2-MoE: softmax, no renormalisation
  v.push_back(router_case("softmax", 11, 8, 2, 3, ro, false));
  ro.norm_topk_prob = true;  // Mixtral, Qwen3-MoE
  v.push_back(router_case("softmax norm", 9, 6, 3, 0, ro, false));
  v.push_back(router_case("softmax norm threads", 700, 16, 4, 0, ro, false));
  ro.replay = true;  // routing replay: the experts are given
  v.push_back(router_case("softmax norm replay", 7, 8, 2, 1, ro, false));
  ro = RouterOpts{};  // DeepSeek-V3: sigmoid, selection bias, group-limited, scaled
  ro.scoring = 1;
  ro.norm_topk_prob = true;
  ro.scaling_factor = 2.5;
  ro.n_group = 4;
  ro.topk_group = 2;
  v.push_back(router_case("sigmoid groups bias", 9, 8, 3, 2, ro, true));
  ro = RouterOpts{};  // one expert, sigmoid: Qwen2-MoE's shared-expert gate
  ro.scoring = 1;
  v.push_back(router_case("sigmoid gate", 13, 1, 1, 0, ro, false));
  v.push_back(permute_case(7, 2, 5, 6, 3));
  v.push_back(permute_case(300, 4, 9, 64, 0));  // threaded
  v.push_back(unpermute_case(7, 2, 5, 6, 2));
  v.push_back(unpermute_case(300, 4, 9, 64, 0));
  v.push_back(grouped_gemm_case(false, true, {0, 5, 5, 17, 30}, 0, 9, 12, 1.0, 0.0, 3));
  v.push_back(grouped_gemm_case(false, false, {0, 0, 70, 150}, 0, 33, 20, 0.5, 1.0, 0));
  v.push_back(grouped_gemm_case(true, false, {0, 9, 9, 40}, 13, 7, 0, 1.0, 0.5, 2));
  v.push_back(grouped_gemm_case(true, false, {0, 100, 130}, 70, 11, 0, 1.0, 0.0, 0));
  // groups (ta = 0) and C_g rows (ta = 1) beyond one 256-row task
  v.push_back(grouped_gemm_case(false, true, {0, 600, 610}, 0, 5, 8, 1.0, 0.0, 1));
  v.push_back(grouped_gemm_case(true, false, {0, 20, 50}, 300, 4, 0, 1.0, 1.0, 0));
}

void add_optimizer_cases(std::vector<Case>& v) {
  v.push_back(adamw_case(1000, false, false));
  v.push_back(adamw_case(70001, true, false));  // past one 64K chunk, several GPU blocks
  v.push_back(adamw_case(1000, false, true));
  v.push_back(adamw_case(70001, true, true));
  v.push_back(sumsq_case());
  v.push_back(amax_case({100003}, 3.0));
  v.push_back(amax_case({37, 130}, 0.01));
  v.push_back(scale_case());
}

}  // namespace rlh::sdk::kcheck
