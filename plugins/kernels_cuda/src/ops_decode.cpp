// kernels_cuda's op entry points for decoding (decode.cu, paged_attention_mma.cu): the KV cache
// write, paged attention and sampling; caches [B, Hkv, bs, D] with strides of their own.

#include <cmath>
#include <cstring>
#include <memory>

#include "op_call.hpp"

namespace rlh::kcuda {

namespace {

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

}  // namespace

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

// logits f32 [S, V], u f64 [S], given int32 [S] (optional: score these ids, no draw) -> tokens
// int32 [S], logprobs f32 [S]
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
  if (c.has_in(2)) {
    need_vec(c.in(2), a.S, "sample given ids");
    a.given = ptr<int32_t>(c.in(2));
  }
  a.temperature = c.num("temperature", 1.0);
  a.top_k = c.integer("top_k", 0);
  a.top_p = c.num("top_p", 1.0);
  a.min_p = c.num("min_p", 0.0);
  a.softcap = float(c.num("softcap", 0.0));
  if (const int64_t bytes = sample_workspace_bytes(a)) a.parts = c.ws->get(size_t(bytes));
  sample(a, c.stream);
}

}  // namespace rlh::kcuda
