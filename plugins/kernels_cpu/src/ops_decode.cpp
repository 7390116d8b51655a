// kernels_cpu's decoding ops behind the C ABI (plugin.cpp's table names them): the KV cache
// writes, attention over a paged KV cache, the whole decoding layer and sampling
// (decode_ops.hpp), float32 only (their float64 forms exist for the table, and do nothing).
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "decode_ops.hpp"
#include "fp8_e4m3.hpp"
#include "op_call.hpp"

namespace rlh::kcpu {

namespace {

// Stride i of a 4-D operand in elements (DLPack: NULL strides = compact row-major).
int64_t stride4(const rlh_tensor& t, int i) {
  if (t.strides) return t.strides[i];
  int64_t s = 1;
  for (int d = 3; d > i; --d) s *= t.shape[d];
  return s;
}

// q [R, Hq, Dk], k_cache [B, Hkv, bs, Dk] and v_cache [B, Hkv, bs, Dv] of any strides (fastest
// with keys transposed in a block, strides (any, Dk bs, 1, bs), and values row by row, (any,
// bs Dv, Dv, 1)), block_table int32 [R, T], positions int32 [R] -> o [R, Hq, Dv]; scale, window.
// The caches float32, or FP8 e4m3 with k_scale and v_scale (float32 [1]) after the inputs.

}  // namespace

template <class T>
void run_paged_attention(const Call& c) {
  if constexpr (std::is_same_v<T, float>) {
    const rlh_tensor &q = c.in(0), &kc = c.in(1), &vc = c.in(2), &bt = c.in(3), &pos = c.in(4);
    if (q.ndim != 3 || kc.ndim != 4 || vc.ndim != 4 || bt.ndim != 2)
      bad("paged_attention: q [R,Hq,Dk], k_cache [B,Hkv,bs,Dk], v_cache [B,Hkv,bs,Dv], block_table [R,T]");
    PagedAttentionArgs a;
    a.R = q.shape[0];
    a.Hq = q.shape[1];
    a.Dk = q.shape[2];
    a.Hkv = kc.shape[1];
    a.bs = kc.shape[2];
    a.Dv = vc.shape[3];
    if (kc.shape[3] != a.Dk || vc.shape[0] != kc.shape[0] || vc.shape[1] != a.Hkv || vc.shape[2] != a.bs)
      bad("paged_attention: the caches' shapes disagree with q and each other");
    // kernels_cpu's layout (keys transposed in a block, values row by row) is read in place;
    // another (a device provider's row-major keys, which the conformance runner checks) is
    // copied into it first: one cache-sized copy a call, for checking, not for decoding.
    const int64_t B = kc.shape[0];
    const bool fp8 = kc.dtype.code == RLH_DTYPE_FLOAT8_E4M3FN;
    std::vector<float> kcopy, vcopy;
    std::vector<uint8_t> kcopy8, vcopy8;
    const void* kbase = kc.data ? static_cast<const char*>(kc.data) + kc.byte_offset : nullptr;
    const void* vbase = vc.data ? static_cast<const char*>(vc.data) + vc.byte_offset : nullptr;
    int64_t k_block = stride4(kc, 0), v_block = stride4(vc, 0);
    // Copies cache t [B, Hkv, bs, D] (elements E) into `into` with element (b, h, p, d) at
    // b Hkv D bs + `at`.
    auto relayout = [&](const rlh_tensor& t, int64_t D, auto& into, auto at) {
      using E = typename std::remove_reference_t<decltype(into)>::value_type;
      into.resize(size_t(B * a.Hkv * a.bs * D));
      const E* src = data<E>(t);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < a.Hkv; ++h)
          for (int64_t p = 0; p < a.bs; ++p)
            for (int64_t d = 0; d < D; ++d)
              into[size_t(b * a.Hkv * D * a.bs + at(h, p, d))] =
                  src[b * stride4(t, 0) + h * stride4(t, 1) + p * stride4(t, 2) + d * stride4(t, 3)];
      return static_cast<const void*>(into.data());
    };
    if (stride4(kc, 1) != a.Dk * a.bs || stride4(kc, 2) != 1 || stride4(kc, 3) != a.bs) {
      auto at = [&](int64_t h, int64_t p, int64_t d) { return (h * a.Dk + d) * a.bs + p; };
      kbase = fp8 ? relayout(kc, a.Dk, kcopy8, at) : relayout(kc, a.Dk, kcopy, at);
      k_block = a.Hkv * a.Dk * a.bs;
    }
    if (stride4(vc, 1) != a.bs * a.Dv || stride4(vc, 2) != a.Dv || stride4(vc, 3) != 1) {
      auto at = [&](int64_t h, int64_t p, int64_t d) { return (h * a.bs + p) * a.Dv + d; };
      vbase = fp8 ? relayout(vc, a.Dv, vcopy8, at) : relayout(vc, a.Dv, vcopy, at);
      v_block = a.Hkv * a.bs * a.Dv;
    }
    a.ldq = need_heads(q, a.R, a.Hq, a.Dk, "paged_attention q");
    a.ldo = need_heads(c.out(0), a.R, a.Hq, a.Dv, "paged_attention o");
    if (bt.shape[0] != a.R || (bt.shape[1] > 1 && bt.strides && bt.strides[1] != 1))
      bad("paged_attention: block_table must be [R, T]");
    need_vec(pos, a.R, "paged_attention positions");
    a.q = data<float>(q);
    a.out = data<float>(c.out(0));
    if (fp8) {
      a.k8 = static_cast<const uint8_t*>(kbase);
      a.v8 = static_cast<const uint8_t*>(vbase);
      need_vec(c.in(5), 1, "paged_attention k_scale");
      need_vec(c.in(6), 1, "paged_attention v_scale");
      a.k_scale = *data<float>(c.in(5));
      a.v_scale = *data<float>(c.in(6));
    } else {
      a.k = static_cast<const float*>(kbase);
      a.v = static_cast<const float*>(vbase);
    }
    a.k_block = k_block;
    a.v_block = v_block;
    a.blocks = data<int32_t>(bt);
    a.ld_blocks = bt.strides ? bt.strides[0] : bt.shape[1];
    a.table_width = bt.shape[1];
    a.pos = data<int32_t>(pos);
    a.scale = float(c.num("scale", 1.0 / std::sqrt(double(a.Dk))));
    a.window = c.integer("window", 0);
    a.softcap = float(softcap_of(c));
    if (a.R == 0) return;
    for (int64_t r = 0; r < a.R; ++r)
      for (int64_t b = 0; b <= a.pos[r] / std::max<int64_t>(1, a.bs) && b < a.table_width; ++b) {
        const int32_t id = a.blocks[r * a.ld_blocks + b];
        if (id < 0 || id >= B) bad("paged_attention: block id " + std::to_string(id) + " outside the cache");
      }
    paged_attention(a, c.op->inst->pool());
  }
}

// decode_layer_fwd: x [R, C], norm1 [C], W_qkv [(Hq + 2 Hkv) D, C], W_o [C, Hq D], norm2 [C],
// W_gu [2F, C], W_down [C, F], positions [R], slots [R], block_table [R, T], inv_freq [D/2] ->
// y [R, C], k_cache, v_cache [B, Hkv, bs, D] (in/out, any strides); eps, eps2, weight_offset,
// rope_scale, scale; silu only (activation 0), no window, no soft-cap (decode_layer.cpp).
template <class T>
void run_decode_layer_fwd(const Call& c) {
  if constexpr (std::is_same_v<T, float>) {
    const rlh_tensor &x = c.in(0), &wqkv = c.in(2), &wo = c.in(3), &wgu = c.in(5), &wd = c.in(6), &kc = c.out(1),
                     &vc = c.out(2), &bt = c.in(9);
    if (c.num("activation", 0) != 0 || c.num("window", 0) != 0 || c.num("softcap", 0) != 0)
      bad("decode_layer_fwd: activation 0 (silu), no window and no soft-cap only");
    const sdk::DecodeLayerSizes z = sdk::decode_layer_sizes(c.call->inputs, c.call->outputs);
    DecodeLayerRefArgs a;
    a.R = z.R;
    a.C = z.C;
    a.F = z.F;
    a.Hq = z.Hq;
    a.Hkv = z.Hkv;
    a.D = z.D;
    a.bs = z.bs;
    a.num_blocks = z.num_blocks;
    if (bt.ndim != 2) bad("decode_layer_fwd: block_table must be [R, T]");
    a.ldx = need_rows(x, a.R, a.C, "decode_layer_fwd x");
    need_vec(c.in(1), a.C, "decode_layer_fwd norm1");
    need_rows(wqkv, (a.Hq + 2 * a.Hkv) * a.D, a.C, "decode_layer_fwd W_qkv");
    need_vec(wqkv, (a.Hq + 2 * a.Hkv) * a.D * a.C, "decode_layer_fwd W_qkv");
    need_rows(wo, a.C, a.Hq * a.D, "decode_layer_fwd W_o");
    need_vec(wo, a.C * a.Hq * a.D, "decode_layer_fwd W_o");
    need_vec(c.in(4), a.C, "decode_layer_fwd norm2");
    need_rows(wgu, 2 * a.F, a.C, "decode_layer_fwd W_gu");
    need_vec(wgu, 2 * a.F * a.C, "decode_layer_fwd W_gu");
    need_rows(wd, a.C, a.F, "decode_layer_fwd W_down");
    need_vec(wd, a.C * a.F, "decode_layer_fwd W_down");
    need_vec(c.in(7), a.R, "decode_layer_fwd positions");
    need_vec(c.in(8), a.R, "decode_layer_fwd slots");
    if (bt.shape[0] != a.R || (bt.shape[1] > 1 && bt.strides && bt.strides[1] != 1))
      bad("decode_layer_fwd: block_table must be [R, T]");
    need_vec(c.in(10), a.D / 2, "decode_layer_fwd inv_freq");
    a.ldy = need_rows(c.out(0), a.R, a.C, "decode_layer_fwd y");
    a.x = data<float>(x);
    a.norm1 = data<float>(c.in(1));
    a.wqkv = data<float>(wqkv);
    a.wo = data<float>(wo);
    a.norm2 = data<float>(c.in(4));
    a.wgu = data<float>(wgu);
    a.wdown = data<float>(wd);
    a.pos = data<int32_t>(c.in(7));
    a.slots = data<int32_t>(c.in(8));
    a.table = data<int32_t>(bt);
    a.ld_table = bt.strides ? bt.strides[0] : bt.shape[1];
    a.table_width = bt.shape[1];
    a.inv_freq = data<float>(c.in(10));
    a.y = data<float>(c.out(0));
    a.k_cache = data<float>(kc);
    a.v_cache = data<float>(vc);
    for (int i = 0; i < 4; ++i) {
      a.kc[i] = stride4(kc, i);
      a.vc[i] = stride4(vc, i);
    }
    a.eps1 = c.num("eps", 1e-6);
    a.eps2 = c.num("eps2", a.eps1);
    a.woff = c.num("weight_offset", 0);
    a.rope_scale = c.num("rope_scale", 1);
    a.scale = c.num("scale", 1.0 / std::sqrt(double(a.D)));
    try {
      decode_layer_ref(a);
    } catch (const std::invalid_argument& e) {
      bad(e.what());
    }
  }
}

// k [R, Hkv, Dk], v [R, Hkv, Dv], slots int32 [R] (block * bs + offset; -1: skip) -> k_cache
// [B, Hkv, bs, Dk], v_cache [B, Hkv, bs, Dv] (in/out, any strides: kernels_cpu's own layout
// stores keys transposed within a block, paged_attention.cpp). e4m3 caches: the codes of k /
// k_scale and v / v_scale (float32 [1] inputs after slots), rounded to nearest even, finite
// values past 448 saturated (fp8_e4m3.hpp).
template <class T>
void run_kv_cache_write(const Call& c) {
  if constexpr (std::is_same_v<T, float>) {
    const rlh_tensor &k = c.in(0), &v = c.in(1), &kc = c.out(0), &vc = c.out(1);
    if (k.ndim != 3 || v.ndim != 3 || kc.ndim != 4 || vc.ndim != 4)
      bad("kv_cache_write: k, v [R, Hkv, D], caches [B, Hkv, bs, D]");
    const int64_t R = k.shape[0], H = k.shape[1], Dk = k.shape[2], Dv = v.shape[2];
    const int64_t ldk = need_heads(k, R, H, Dk, "kv_cache_write k"), ldv = need_heads(v, R, H, Dv, "kv_cache_write v");
    need_vec(c.in(2), R, "kv_cache_write slots");
    const int64_t B = kc.shape[0], bs = kc.shape[2];
    if (kc.shape[1] != H || kc.shape[3] != Dk || vc.shape[0] != B || vc.shape[1] != H || vc.shape[2] != bs ||
        vc.shape[3] != Dv)
      bad("kv_cache_write: the caches' shapes disagree with k, v and each other");
    const int32_t* slots = data<int32_t>(c.in(2));
    const float *kp = data<float>(k), *vp = data<float>(v);
    for (int64_t r = 0; r < R; ++r)
      if (slots[r] >= 0 && slots[r] / bs >= B) bad("kv_cache_write: slot " + std::to_string(slots[r]) + " outside the cache");
    // Row r, head h into cache t (elements E): `conv` of each of its D values.
    auto write = [&](const rlh_tensor& t, const float* src, int64_t ld, int64_t D, auto conv) {
      using E = decltype(conv(0.f));
      E* base = data<E>(t);
      for (int64_t r = 0; r < R; ++r) {
        if (slots[r] < 0) continue;
        const int64_t b = slots[r] / bs, off = slots[r] % bs;
        for (int64_t h = 0; h < H; ++h) {
          E* dst = base + b * stride4(t, 0) + h * stride4(t, 1) + off * stride4(t, 2);
          for (int64_t d = 0; d < D; ++d) dst[d * stride4(t, 3)] = conv(src[r * ld + h * D + d]);
        }
      }
    };
    if (kc.dtype.code == RLH_DTYPE_FLOAT8_E4M3FN) {
      need_vec(c.in(3), 1, "kv_cache_write k_scale");
      need_vec(c.in(4), 1, "kv_cache_write v_scale");
      const float ks = *data<float>(c.in(3)), vs = *data<float>(c.in(4));
      if (!(ks > 0 && std::isfinite(ks)) || !(vs > 0 && std::isfinite(vs)))
        bad("kv_cache_write: the caches' scales must be finite and > 0 (k_scale " + std::to_string(ks) + ", v_scale " +
            std::to_string(vs) + ")");
      write(kc, kp, ldk, Dk, [ks](float x) { return e4m3_encode(x / ks); });
      write(vc, vp, ldv, Dv, [vs](float x) { return e4m3_encode(x / vs); });
    } else {
      write(kc, kp, ldk, Dk, [](float x) { return x; });
      write(vc, vp, ldv, Dv, [](float x) { return x; });
    }
  }
}

// rope_kv_cache_write: y = rope_fwd(qk) over every head (the query heads, then the caches' Hkv key
// heads), then kv_cache_write of y's key heads and v: by definition the two ops in turn (a
// decoding step's RoPE and cache write as one op).
template <class T>
void run_rope_kv_cache_write(const Call& c) {
  if constexpr (std::is_same_v<T, float>) {
    const rlh_tensor &qk = c.in(0), &y = c.out(0), &kc = c.out(1);
    if (qk.ndim != 3 || y.ndim != 3 || kc.ndim != 4)
      bad("rope_kv_cache_write: qk and y [R, Hq + Hkv, D], caches [B, Hkv, bs, D]");
    const int64_t R = qk.shape[0], H = qk.shape[1], D = qk.shape[2], Hkv = kc.shape[1];
    if (Hkv <= 0 || Hkv >= H)
      bad("rope_kv_cache_write: qk must hold the query heads, then the caches' " + std::to_string(Hkv) + " key heads");
    const int64_t ldy = need_heads(y, R, H, D, "rope_kv_cache_write y");
    rlh_op_call sub = *c.call;
    const rlh_tensor rope_in[3] = {qk, c.in(2), c.in(3)};
    sub.inputs = rope_in;
    sub.num_inputs = 3;
    sub.outputs = &y;
    sub.num_outputs = 1;
    run_rope<T>(Call{c.op, &sub, c.scratch}, false);
    // y's key heads [R, Hkv, D], then v, the slots and (e4m3 caches) the scales
    int64_t kshape[3] = {R, Hkv, D}, kstrides[3] = {ldy, D, 1};
    rlh_tensor k = y;
    k.shape = kshape;
    k.strides = kstrides;
    k.byte_offset += uint64_t((H - Hkv) * D) * sizeof(T);
    std::vector<rlh_tensor> kv_in = {k, c.in(1), c.in(4)};
    for (size_t i = 5; i < c.call->num_inputs; ++i) kv_in.push_back(c.in(i));
    sub.inputs = kv_in.data();
    sub.num_inputs = kv_in.size();
    sub.outputs = c.call->outputs + 1;
    sub.num_outputs = 2;
    run_kv_cache_write<T>(Call{c.op, &sub, c.scratch});
  }
}

// logits [S, V] (rows any distance apart), uniforms float64 [S], given int32 [S] (optional: score
// these ids, no draw) -> tokens int32 [S], logprobs [S]; temperature (0 = greedy), top_k, top_p, min_p.
template <class T>
void run_sample(const Call& c) {
  if constexpr (std::is_same_v<T, float>) {
    const rlh_tensor& z = c.in(0);
    if (z.ndim != 2) bad("sample: logits must be [S, V]");
    const int64_t S = z.shape[0], V = z.shape[1];
    const int64_t ld = need_rows(z, S, V, "sample logits");
    need_vec(c.in(1), S, "sample uniforms");
    need_vec(c.out(0), S, "sample tokens");
    need_vec(c.out(1), S, "sample logprobs");
    SampleParams p;
    p.temperature = c.num("temperature", 1.0);
    p.top_k = c.integer("top_k", 0);
    p.top_p = c.num("top_p", 1.0);
    p.min_p = c.num("min_p", 0.0);
    p.softcap = c.num("softcap", 0.0);
    const int32_t* given = nullptr;
    if (c.has_in(2)) {
      need_vec(c.in(2), S, "sample given ids");
      given = data<int32_t>(c.in(2));
    }
    sample(data<float>(z), ld, S, V, data<double>(c.in(1)), p, data<int32_t>(c.out(0)), data<float>(c.out(1)),
           c.op->inst->pool(), given);
  }
}

#define RLH_INSTANTIATE(NAME)                        \
  template void NAME<float>(const Call& c);          \
  template void NAME<double>(const Call& c);
RLH_INSTANTIATE(run_paged_attention)
RLH_INSTANTIATE(run_decode_layer_fwd)
RLH_INSTANTIATE(run_kv_cache_write)
RLH_INSTANTIATE(run_rope_kv_cache_write)
RLH_INSTANTIATE(run_sample)
#undef RLH_INSTANTIATE

}  // namespace rlh::kcpu
