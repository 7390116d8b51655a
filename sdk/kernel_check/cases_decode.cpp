// Cases of the decode ops (docs/ops.md, "decoding"): kv_cache_write into caches laid out row by
// row and as kernels_cpu keeps them (keys transposed within a block), paged_attention over
// kernels_cpu's layout and over row-major keys (a GPU's; kernels_cpu copies them into its own),
// with GQA, windows, Dk != Dv and unread block-table entries left at -1, and
// sample at every filter (temperature, top-k, top-p, min-p, greedy) with float64 uniforms, and
// scoring given ids.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>

#include "cases.hpp"

namespace rlh::sdk::kcheck {
namespace {

// A [B, H, bs, D] cache: rows of D (row-major), or keys transposed within a block (strides
// (H D bs, D bs, 1, bs): kernels_cpu's key layout).
Layout cache_layout(int64_t B, int64_t H, int64_t bs, int64_t D, bool transposed) {
  if (transposed) return strided({B, H, bs, D}, {H * D * bs, D * bs, 1, bs});
  return contiguous({B, H, bs, D});
}

Case kv_cache_write_case(bool transposed_keys, int64_t pad) {
  Case c;
  const int64_t R = 5, H = 2, Dk = 8, Dv = 6, bs = 4, B = 5;
  const int64_t ldk = H * Dk + pad, ldv = H * Dv + pad;
  c.name = std::string("kv_cache_write R=5 Hkv=2 Dk=8 Dv=6 bs=4 B=5 ") +
           (transposed_keys ? "keys transposed" : "row-major") + " ld+" + std::to_string(pad) + " (a skipped row)";
  c.in_sizes = {R * ldk, R * ldv, B * H * bs * Dk, B * H * bs * Dv};  // k, v, the caches before
  c.in_scale = {1, 1, 1, 1};
  c.out_sizes = {B * H * bs * Dk, B * H * bs * Dv};
  c.ints = {IntBuf{{3, 17, -1, 8, 0}, {R}}};  // block * bs + offset; -1: skipped
  c.fwd = {"kv_cache_write",
           {in(0, strided({R, H, Dk}, {ldk, Dk, 1})), in(1, strided({R, H, Dv}, {ldv, Dv, 1})), ints(0, {R})},
           {out(0, cache_layout(B, H, bs, Dk, transposed_keys)), out(1, cache_layout(B, H, bs, Dv, false))},
           {},
           {{2, 0}, {3, 1}},
           {}};
  return c;
}

struct PagedShape {
  std::vector<int32_t> positions;  // one row per sequence
  int64_t Hq, Hkv, Dk, Dv, bs, window;
  int64_t pad = 0;     // extra elements per row of q and o
  double softcap = 0;  // Gemma-2's attn_logit_softcapping (the attribute only when set)
  bool row_major_keys = false;   // keys as a GPU keeps them: rows of Dk (kernels_cuda's tensor-core path)
  bool batch_invariant = false;  // the attribute (every row one partition on kernels_cuda)
  // The caches marked weights: FP8 e4m3 caches with their scales in the bf16xe4m3 variant (an
  // FP8 KV cache, docs/ops.md), the op's dtype in the others.
  bool fp8_caches = false;
};

Case paged_attention_case(const PagedShape& p) {
  Case c;
  const int64_t R = int64_t(p.positions.size());
  int64_t T = 0, used = 0;
  for (int32_t pos : p.positions) {
    T = std::max<int64_t>(T, pos / p.bs + 1);
    used += pos / p.bs + 1;
  }
  const int64_t B = used + 3;  // some blocks no row reads
  // Each row's blocks: distinct ids spread over the cache; entries past its last block: -1.
  std::vector<int32_t> ids(static_cast<size_t>(B));
  std::iota(ids.begin(), ids.end(), 0);
  for (int64_t i = 0; i < B; ++i) std::swap(ids[size_t(i)], ids[size_t((i * 7 + 3) % B)]);
  std::vector<int32_t> table(size_t(R * T), -1);
  int64_t next = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b <= p.positions[size_t(r)] / p.bs; ++b) table[size_t(r * T + b)] = ids[size_t(next++)];
  const int64_t ldq = p.Hq * p.Dk + p.pad, ldo = p.Hq * p.Dv + p.pad;
  char b[160];
  std::snprintf(b, sizeof(b), "paged_attention R=%lld Hq=%lld Hkv=%lld Dk=%lld Dv=%lld bs=%lld window=%lld B=%lld pad=%lld",
                (long long)R, (long long)p.Hq, (long long)p.Hkv, (long long)p.Dk, (long long)p.Dv, (long long)p.bs,
                (long long)p.window, (long long)B, (long long)p.pad);
  c.name = std::string(b) + (p.softcap > 0 ? " softcap=" + std::to_string(p.softcap) : "") +
           (p.row_major_keys ? " keys row-major" : "") + (p.batch_invariant ? " batch_invariant" : "") +
           (p.fp8_caches ? " caches as weights (fp8)" : "");
  c.in_sizes = {R * ldq, B * p.Hkv * p.bs * p.Dk, B * p.Hkv * p.bs * p.Dv};
  c.in_scale = {1.5, 1.5, 1};
  c.out_sizes = {R * ldo};
  c.ints = {IntBuf{table, {R, T}}, IntBuf{p.positions, {R}}};
  c.fwd = {"paged_attention",
           {in(0, strided({R, p.Hq, p.Dk}, {ldq, p.Dk, 1})), in(1, cache_layout(B, p.Hkv, p.bs, p.Dk, !p.row_major_keys)),
            in(2, cache_layout(B, p.Hkv, p.bs, p.Dv, false)), ints(0, {R, T}), ints(1, {R})},
           {out(0, strided({R, p.Hq, p.Dv}, {ldo, p.Dv, 1}))},
           {attr_d("scale", 1.0 / std::sqrt(double(p.Dk))), attr_i("window", p.window)},
           {},
           {}};
  if (p.softcap > 0) c.fwd.attrs.push_back(attr_d("softcap", p.softcap));
  if (p.batch_invariant) c.fwd.attrs.push_back(attr_i("batch_invariant", 1));
  if (p.fp8_caches) c.fwd.inputs[1].role = c.fwd.inputs[2].role = Role::weight;
  return c;
}

// Positions 0 .. n-1 spread over [0, top]: rows of one tile, of many, on tile edges (63, 64).
std::vector<int32_t> spread_positions(int n, int32_t top) {
  std::vector<int32_t> p = {0, 63, 64, 127, top};
  for (int i = int(p.size()); i < n; ++i) p.push_back(int32_t((int64_t(i) * 7919) % (top + 1)));
  return p;
}

struct SampleOpts {
  double temperature = 1.0;
  int64_t top_k = 0;
  double top_p = 1.0, min_p = 0.0;
  double softcap = 0;  // Gemma-2's final_logit_softcapping (the attribute only when set)
  bool given = false;  // score given ids (the third input) instead of drawing: ids across [0, V), and outside it
};

Case sample_case(const char* label, int64_t S, int64_t V, int64_t pad, SampleOpts o) {
  Case c;
  char b[160];
  std::snprintf(b, sizeof(b), "sample %s S=%lld V=%lld ld+%lld temperature=%g top_k=%lld top_p=%g min_p=%g", label,
                (long long)S, (long long)V, (long long)pad, o.temperature, (long long)o.top_k, o.top_p, o.min_p);
  c.name = std::string(b) + (o.softcap > 0 ? " softcap=" + std::to_string(o.softcap) : "") + (o.given ? " given ids" : "");
  const int64_t ld = V + pad;
  c.in_sizes = {S * ld, S};  // logits, uniforms
  c.in_scale = {2.0, 1.0};
  c.in_uniform = {false, true};
  c.out_sizes = {S};  // logprobs; the tokens are ints[0]
  c.ints = {IntBuf{std::vector<int32_t>(size_t(S), 0), {S}}};
  Operand logits = in(0, strided({S, V}, {ld, 1})), u = in(1, contiguous({S})), lp = out(0, contiguous({S}));
  logits.role = Role::f32;  // the contract's dtypes, in every variant
  u.role = Role::f64;
  lp.role = Role::f32;
  std::vector<Operand> inputs = {logits, u};
  if (o.given) {  // the first and last ids, some between, and two outside the vocabulary (token -1, logprob 0)
    std::vector<int32_t> g(static_cast<size_t>(S));
    for (int64_t i = 0; i < S; ++i) g[size_t(i)] = int32_t((i * 37 + 11) % V);
    g[0] = 0;
    if (S > 1) g[1] = int32_t(V - 1);
    if (S > 2) g[2] = -1;
    if (S > 3) g[3] = int32_t(V);
    c.ints.push_back(IntBuf{g, {S}});
    inputs.push_back(ints(1, {S}));
  }
  c.fwd = {"sample",
           inputs,
           {ints(0, {S}), lp},
           {attr_d("temperature", o.temperature), attr_i("top_k", o.top_k), attr_d("top_p", o.top_p),
            attr_d("min_p", o.min_p)},
           {},
           {}};
  if (o.softcap > 0) c.fwd.attrs.push_back(attr_d("softcap", o.softcap));
  return c;
}

}  // namespace

void add_decode_cases(std::vector<Case>& v) {
  v.push_back(kv_cache_write_case(false, 0));
  v.push_back(kv_cache_write_case(true, 5));
  v.push_back(paged_attention_case({{0, 5, 13, 17, 9}, 4, 2, 8, 8, 4, 0}));
  v.push_back(paged_attention_case({{30, 2, 21}, 4, 1, 8, 6, 4, 6, 3}));  // window, MQA, Dv != Dk, strided
  v.push_back(paged_attention_case({{40, 3, 63}, 8, 2, 64, 64, 16, 0}));  // a model's head dim and block
  v.push_back(paged_attention_case({{30, 2, 21}, 4, 2, 8, 8, 4, 6, 0, 1.5}));  // soft-capped (Gemma-2), window
  // Row-major keys at head dims 64 and 128 (kernels_cuda's tensor-core kernel): Llama-3's groups
  // of 4, groups of 16 and 32 (two m-tiles), a window, padded rows; few rows (split over the
  // keys, partials combined) and many (one partition a row); and the batch-invariant form.
  {
    PagedShape p{spread_positions(5, 700), 32, 8, 64, 64, 16, 0};
    p.row_major_keys = true;
    v.push_back(paged_attention_case(p));
    p.batch_invariant = true;
    v.push_back(paged_attention_case(p));
    PagedShape w{spread_positions(40, 300), 16, 1, 128, 128, 16, 100, 8};
    w.row_major_keys = true;
    v.push_back(paged_attention_case(w));
    PagedShape m{spread_positions(3, 200), 32, 1, 64, 64, 32, 0};
    m.row_major_keys = true;
    v.push_back(paged_attention_case(m));
    PagedShape b{spread_positions(300, 260), 8, 2, 64, 64, 16, 0};
    b.row_major_keys = true;
    v.push_back(paged_attention_case(b));
  }
  SampleOpts o;
  v.push_back(sample_case("plain", 6, 50, 0, o));
  o.temperature = 0.7;
  o.top_k = 5;
  v.push_back(sample_case("top_k", 6, 50, 3, o));
  o = SampleOpts{};
  o.temperature = 1.3;
  o.top_p = 0.8;
  v.push_back(sample_case("top_p", 6, 50, 0, o));
  o = SampleOpts{};
  o.min_p = 0.1;
  o.top_k = 20;
  o.top_p = 0.95;
  v.push_back(sample_case("min_p+top_k+top_p", 6, 300, 0, o));
  o = SampleOpts{};
  o.temperature = 0;
  v.push_back(sample_case("greedy", 6, 50, 0, o));
  o = SampleOpts{};
  o.temperature = 0.8;
  o.top_k = 10;
  o.softcap = 1.5;  // Gemma-2's final soft-cap, before the temperature
  v.push_back(sample_case("softcap", 6, 50, 0, o));
}

// Cases added after the list above was fixed (all_cases: appended last, so the earlier cases
// keep their indices, which seed their inputs).
void add_decode_cases_late(std::vector<Case>& v) {
  // Scoring given ids (a trainer's deterministic logprobs): unfiltered and filtered, soft-capped.
  SampleOpts o;
  o.temperature = 0.9;
  o.given = true;
  v.push_back(sample_case("plain", 8, 5000, 0, o));
  o.top_k = 7;
  o.top_p = 0.9;
  o.softcap = 1.5;
  v.push_back(sample_case("top_k+top_p", 8, 50, 2, o));
}

// paged_attention over FP8 caches (the bf16xe4m3 variant; plain caches in the others): the
// tensor-core kernel's shapes (row-major keys, head dims 64 and 128; a window and padded rows;
// few rows, their partitions combined, and many). No soft-cap: kernels_cuda refuses it over FP8
// caches, and a case every provider refuses checks nothing.
namespace {

// RoPE of the query and key heads, then the rotated keys and the values into the caches, in one op
// (rope_kv_cache_write): rows into a skipped slot, padded rows, partial rotary dims, kernels_cpu's
// transposed keys.
Case rope_kv_case(bool transposed_keys, int64_t pad, int64_t rot) {
  Case c;
  const int64_t R = 5, Hq = 4, H = 2, D = 16, Dv = 16, bs = 4, B = 5;
  const int64_t ldx = (Hq + H) * D + pad, ldv = H * Dv + pad;
  std::vector<float> inv_freq(size_t(rot / 2));
  for (int64_t i = 0; i < rot / 2; ++i) inv_freq[size_t(i)] = float(std::pow(10000.0, -2.0 * double(i) / double(rot)));
  c.name = "rope_kv_cache_write R=5 Hq=4 Hkv=2 D=16 rot=" + std::to_string(rot) + " bs=4 B=5 " +
           (transposed_keys ? "keys transposed" : "row-major") + " ld+" + std::to_string(pad);
  c.in_sizes = {R * ldx, R * ldv, B * H * bs * D, B * H * bs * Dv};  // qk, v, the caches before
  c.in_scale = {1, 1, 1, 1};
  c.out_sizes = {R * ldx, B * H * bs * D, B * H * bs * Dv};
  c.ints = {IntBuf{{3, 17, -1, 8, 0}, {R}}, IntBuf{{7, 300, 0, 12, 1}, {R}}};  // slots (-1: skipped), positions
  c.consts = {inv_freq};
  const Layout lx = strided({R, Hq + H, D}, {ldx, D, 1});
  c.fwd = {"rope_kv_cache_write",
           {in(0, lx), in(1, strided({R, H, Dv}, {ldv, Dv, 1})), ints(1, {R}), cst(0, {rot / 2}), ints(0, {R})},
           {out(0, lx), out(1, cache_layout(B, H, bs, D, transposed_keys)), out(2, cache_layout(B, H, bs, Dv, false))},
           {attr_d("scale", 1.0)},
           {{2, 1}, {3, 2}},
           {}};
  return c;
}

}  // namespace

void add_rope_kv_cases(std::vector<Case>& v) {
  v.push_back(rope_kv_case(false, 0, 16));  // kernels_cuda's one launch
  v.push_back(rope_kv_case(false, 8, 8));   // partial rotary dims: rope, then the write
  v.push_back(rope_kv_case(true, 0, 16));   // kernels_cpu's key layout
}

void add_fp8_cache_cases(std::vector<Case>& v) {
  PagedShape a{spread_positions(6, 300), 32, 8, 64, 64, 16, 0};
  a.row_major_keys = a.fp8_caches = true;
  v.push_back(paged_attention_case(a));
  PagedShape w{spread_positions(20, 200), 16, 2, 128, 128, 16, 50, 8};
  w.row_major_keys = w.fp8_caches = true;
  v.push_back(paged_attention_case(w));
  PagedShape b{spread_positions(2, 150), 8, 2, 128, 128, 16, 0};
  b.row_major_keys = b.fp8_caches = true;
  v.push_back(paged_attention_case(b));
}

namespace {

// decode_layer_fwd: one dense layer over rows at `positions` (each its own sequence, its blocks
// spread over the cache as in paged_attention_case), row-major caches as a GPU keeps them.
Case decode_layer_case(const std::vector<int32_t>& positions, int64_t C, int64_t F, int64_t Hq, int64_t Hkv,
                       int64_t D, int64_t bs) {
  Case c;
  const int64_t R = int64_t(positions.size());
  int64_t T = 0, used = 0;
  for (int32_t p : positions) {
    T = std::max<int64_t>(T, p / bs + 1);
    used += p / bs + 1;
  }
  const int64_t B = used + 2;
  std::vector<int32_t> ids(static_cast<size_t>(B));
  std::iota(ids.begin(), ids.end(), 0);
  for (int64_t i = 0; i < B; ++i) std::swap(ids[size_t(i)], ids[size_t((i * 5 + 1) % B)]);
  std::vector<int32_t> table(size_t(R * T), -1), slots;
  int64_t next = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int32_t p = positions[size_t(r)];
    for (int64_t b = 0; b <= p / bs; ++b) table[size_t(r * T + b)] = ids[size_t(next++)];
    slots.push_back(int32_t(table[size_t(r * T + p / bs)] * bs + p % bs));
  }
  std::vector<float> inv_freq(size_t(D / 2));
  for (int64_t i = 0; i < D / 2; ++i) inv_freq[size_t(i)] = float(std::pow(500000.0, -2.0 * double(i) / double(D)));
  char b[200];
  std::snprintf(b, sizeof(b), "decode_layer_fwd R=%lld C=%lld F=%lld Hq=%lld Hkv=%lld D=%lld bs=%lld B=%lld",
                (long long)R, (long long)C, (long long)F, (long long)Hq, (long long)Hkv, (long long)D, (long long)bs,
                (long long)B);
  c.name = b;
  const int64_t Nqkv = (Hq + 2 * Hkv) * D, cache = B * Hkv * bs * D;
  //           x      norm1  W_qkv     W_o          norm2  W_gu        W_down  k, v caches before
  c.in_sizes = {R * C, C, Nqkv * C, C * Hq * D, C, 2 * F * C, C * F, cache, cache};
  c.in_scale = {1, 1, 1 / std::sqrt(double(C)), 1 / std::sqrt(double(Hq * D)), 1, 1 / std::sqrt(double(C)),
                1 / std::sqrt(double(F)), 1, 1};
  c.out_sizes = {R * C, cache, cache};
  c.ints = {IntBuf{positions, {R}}, IntBuf{slots, {R}}, IntBuf{table, {R, T}}};
  c.consts = {inv_freq};
  c.fwd = {"decode_layer_fwd",
           {in(0, contiguous({R, C})), in(1, contiguous({C})), in(2, contiguous({Nqkv, C})),
            in(3, contiguous({C, Hq * D})), in(4, contiguous({C})), in(5, contiguous({2 * F, C})),
            in(6, contiguous({C, F})), ints(0, {R}), ints(1, {R}), ints(2, {R, T}), cst(0, {D / 2})},
           {out(0, contiguous({R, C})), out(1, cache_layout(B, Hkv, bs, D, false)),
            out(2, cache_layout(B, Hkv, bs, D, false))},
           {attr_d("eps", 1e-5), attr_d("scale", 1.0 / std::sqrt(double(D)))},
           {{7, 1}, {8, 2}},
           {}};
  return c;
}

}  // namespace

// Cases of ops added after every list above (appended last: the earlier cases keep their seeds).
void add_decode_layer_cases(std::vector<Case>& v) {
  v.push_back(decode_layer_case({300}, 256, 512, 8, 2, 64, 16));  // Llama's groups of 4, two chunks of keys
  v.push_back(decode_layer_case({0}, 128, 96, 4, 4, 128, 16));    // the first token, D = 128, no grouping
  v.push_back(decode_layer_case({17, 40, 3}, 64, 64, 4, 1, 64, 8));  // several rows (kernels_cuda: one a call)
}

}  // namespace rlh::sdk::kcheck
