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

// The scales of FP8 caches (e4m3: float32 [1] inputs `at` and at + 1), else null.
void fp8_scales(const Call& c, const rlh_tensor& kc, size_t at, const float** ks, const float** vs, const char* op) {
  if (kc.dtype.code != RLH_DTYPE_FLOAT8_E4M3FN) return;
  need_vec(c.in(at), 1, (std::string(op) + " k_scale").c_str());
  need_vec(c.in(at + 1), 1, (std::string(op) + " v_scale").c_str());
  *ks = ptr<float>(c.in(at));
  *vs = ptr<float>(c.in(at + 1));
}

namespace {

// The caches' geometry (the call's last two outputs), the slots (input `slots_at`, the FP8 scales
// after it), the values and the error flag of a cache write whose w.R, w.Hkv, w.Dk and w.Dv are
// set; `op` names the operands in errors.
void cache_write_args(const Call& c, KvWriteArgs& w, const rlh_tensor& v, size_t slots_at, const std::string& op) {
  const rlh_tensor &kc = c.out(c.nout() - 2), &vc = c.out(c.nout() - 1);
  if (kc.ndim != 4) bad(op + ": k_cache must be [B, Hkv, bs, Dk]");
  w.ldv = need_heads(v, w.R, w.Hkv, w.Dv, (op + " v").c_str());
  need_vec(c.in(slots_at), w.R, (op + " slots").c_str());
  w.bs = kc.shape[2];
  w.num_blocks = kc.shape[0];
  cache_strides(kc, w.Hkv, w.bs, w.Dk, w.kc_strides, (op + " k_cache").c_str());
  cache_strides(vc, w.Hkv, w.bs, w.Dv, w.vc_strides, (op + " v_cache").c_str());
  if (vc.shape[0] != w.num_blocks) bad(op + ": the caches hold different numbers of blocks");
  w.v = ptr(v);
  w.slots = ptr<int32_t>(c.in(slots_at));
  w.k_cache = ptr(kc);
  w.v_cache = ptr(vc);
  w.err = c.err();
  fp8_scales(c, kc, slots_at + 1, &w.k_scale, &w.v_scale, op.c_str());
}

}  // namespace

// k [R, Hkv, Dk], v [R, Hkv, Dv], slots int32 [R] (, k_scale, v_scale f32 [1] for e4m3 caches)
// -> k_cache, v_cache (in/out)
void run_kv_cache_write(const Call& c) {
  const rlh_tensor &k = c.in(0), &v = c.in(1);
  if (k.ndim != 3 || v.ndim != 3) bad("kv_cache_write: k and v must be [R, Hkv, D]");
  KvWriteArgs a;
  a.t = c.dt();
  a.R = k.shape[0];
  a.Hkv = k.shape[1];
  a.Dk = k.shape[2];
  a.Dv = v.shape[2];
  a.ldk = need_heads(k, a.R, a.Hkv, a.Dk, "kv_cache_write k");
  a.k = ptr(k);
  cache_write_args(c, a, v, 2, "kv_cache_write");
  kv_cache_write(a, c.stream);
}

// qk [R, Hq + Hkv, D], v [R, Hkv, Dv], positions int32 [R], inv_freq f32 [rot / 2], slots int32
// [R] (, k_scale, v_scale f32 [1] for e4m3 caches) -> y [R, Hq + Hkv, D] (may be qk), k_cache,
// v_cache (in/out): rope_fwd of every head, then kv_cache_write of the rotated key heads and v.
void run_rope_kv_cache_write(const Call& c) {
  const rlh_tensor &qk = c.in(0), &v = c.in(1), &y = c.out(0), &kc = c.out(1), &vc = c.out(2);
  if (qk.ndim != 3 || v.ndim != 3 || kc.ndim != 4 || vc.ndim != 4)
    bad("rope_kv_cache_write: qk [R, Hq + Hkv, D], v [R, Hkv, Dv], caches [B, Hkv, bs, D]");
  RopeKvArgs a;
  KvWriteArgs& w = a.kv;
  w.t = c.dt();
  w.R = qk.shape[0];
  w.Hkv = kc.shape[1];
  w.Dk = qk.shape[2];
  w.Dv = v.shape[2];
  if (w.Hkv <= 0 || w.Hkv >= qk.shape[1] || v.shape[1] != w.Hkv)
    bad("rope_kv_cache_write: qk must hold the query heads, then the caches' " + std::to_string(w.Hkv) + " key heads");
  a.Hq = qk.shape[1] - w.Hkv;
  a.ldx = need_heads(qk, w.R, a.Hq + w.Hkv, w.Dk, "rope_kv_cache_write qk");
  a.ldy = need_heads(y, w.R, a.Hq + w.Hkv, w.Dk, "rope_kv_cache_write y");
  need_vec(c.in(2), w.R, "rope_kv_cache_write positions");
  a.rot = 2 * numel(c.in(3));
  need_vec(c.in(3), a.rot / 2, "rope_kv_cache_write inv_freq");
  if (a.rot > w.Dk) bad("rope_kv_cache_write: more rotary dims than the head's");
  cache_write_args(c, w, v, 4, "rope_kv_cache_write");
  a.x = ptr(qk);
  a.y = ptr(y);
  a.pos = ptr<int32_t>(c.in(2));
  a.inv_freq = ptr<float>(c.in(3));
  a.scale = c.num("scale", 1);
  a.interleaved = c.flag("interleaved");
  rope_kv_cache_write(a, c.stream);
}

// q [R, Hq, Dk], k_cache, v_cache, block_table int32 [R, T], positions int32 [R] (, k_scale,
// v_scale f32 [1] for e4m3 caches) -> o [R, Hq, Dv]
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
  fp8_scales(c, kc, 5, &a.k_scale, &a.v_scale, "paged_attention");
  if ((a.k_scale != nullptr) && !paged_attention_mma_ok(a))
    bad("paged_attention: FP8 caches need Dk = Dv = 64 or 128, no soft-cap, rows of a cache contiguous and 16-byte aligned");
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

namespace rlh::kcuda {

namespace {

// decode_layer_fwd's sizes (sdk::decode_layer_sizes: the contract's, as every provider reads them).
DecodeLayerArgs decode_layer_sizes(const rlh_tensor* in, const rlh_tensor* out) {
  const sdk::DecodeLayerSizes z = sdk::decode_layer_sizes(in, out);
  DecodeLayerArgs a;
  a.C = z.C;
  a.F = z.F;
  a.Hq = z.Hq;
  a.Hkv = z.Hkv;
  a.D = z.D;
  a.bs = z.bs;
  a.num_blocks = z.num_blocks;
  return a;
}

}  // namespace

std::string decode_layer_shape_refusal(const rlh_tensor* in, size_t nin, const rlh_tensor* out, size_t nout) {
  if (nin < 11 || nout < 3) return "11 inputs and 3 outputs";
  const DecodeLayerArgs a = decode_layer_sizes(in, out);
  if (in[0].shape[0] != 1) return "one row a call";
  return decode_layer_refusal(a);
}

void run_decode_layer_fwd(const Call& c) {
  if (c.dt() != DType::bf16) bad("decode_layer_fwd: bf16 only");
  const rlh_tensor* in = c.call->inputs;
  const rlh_tensor* out = c.call->outputs;
  DecodeLayerArgs a = decode_layer_sizes(in, out);
  const int64_t R = in[0].shape[0];
  if (R != 1) bad("decode_layer_fwd: kernels_cuda runs one row a call");
  const std::string why = decode_layer_refusal(a);
  if (!why.empty()) bad("decode_layer_fwd: " + why);
  need_rows(in[0], 1, a.C, "decode_layer_fwd x");
  need_vec(in[1], a.C, "decode_layer_fwd norm1");
  need_rows(in[2], (a.Hq + 2 * a.Hkv) * a.D, a.C, "decode_layer_fwd W_qkv");
  need_rows(in[3], a.C, a.Hq * a.D, "decode_layer_fwd W_o");
  need_vec(in[4], a.C, "decode_layer_fwd norm2");
  // the weights stream whole (bulk copies of contiguous rows, 16-byte aligned)
  for (int i : {2, 3, 5, 6}) {
    need_vec(in[i], in[i].shape[0] * in[i].shape[1], "decode_layer_fwd weight");
    if (reinterpret_cast<uintptr_t>(ptr(in[i])) % 16) bad("decode_layer_fwd: weights must be 16-byte aligned");
  }
  need_vec(in[7], 1, "decode_layer_fwd positions");
  need_vec(in[8], 1, "decode_layer_fwd slots");
  const rlh_tensor& bt = in[9];
  if (bt.ndim != 2 || bt.shape[0] != 1) bad("decode_layer_fwd: block_table must be [1, T]");
  need_rows(bt, 1, bt.shape[1], "decode_layer_fwd block_table");
  need_vec(in[10], a.D / 2, "decode_layer_fwd inv_freq");
  need_rows(out[0], 1, a.C, "decode_layer_fwd y");
  if (ptr(out[0]) == ptr(in[0])) bad("decode_layer_fwd: y may not be x");
  int64_t kcs[4], vcs[4];
  cache_strides(out[1], a.Hkv, a.bs, a.D, kcs, "decode_layer_fwd k_cache");
  cache_strides(out[2], a.Hkv, a.bs, a.D, vcs, "decode_layer_fwd v_cache");
  for (int i = 0; i < 4; ++i) {
    a.kc[i] = kcs[i];
    a.vc[i] = vcs[i];
  }
  // 16-byte loads of x, y and the cache rows
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (!aligned(ptr(in[0])) || !aligned(ptr(in[1])) || !aligned(ptr(in[4])) || !aligned(ptr(out[0])) ||
      !aligned(ptr(out[1])) || !aligned(ptr(out[2])) ||
      a.kc[0] % 8 || a.kc[1] % 8 || a.kc[2] % 8 || a.vc[0] % 8 || a.vc[1] % 8 || a.vc[2] % 8)
    bad("decode_layer_fwd: x, y, the norms' weights and the caches' rows must be 16-byte aligned");
  a.x = ptr<const __nv_bfloat16>(in[0]);
  a.w_norm1 = ptr<const __nv_bfloat16>(in[1]);
  a.w_qkv = ptr<const __nv_bfloat16>(in[2]);
  a.w_o = ptr<const __nv_bfloat16>(in[3]);
  a.w_norm2 = ptr<const __nv_bfloat16>(in[4]);
  a.w_gu = ptr<const __nv_bfloat16>(in[5]);
  a.w_down = ptr<const __nv_bfloat16>(in[6]);
  a.pos = ptr<int32_t>(in[7]);
  a.slots = ptr<int32_t>(in[8]);
  a.blocks = ptr<int32_t>(bt);
  a.max_positions = bt.shape[1] * a.bs;
  a.inv_freq = ptr<float>(in[10]);
  a.y = ptr<__nv_bfloat16>(out[0]);
  a.k_cache = ptr<__nv_bfloat16>(out[1]);
  a.v_cache = ptr<__nv_bfloat16>(out[2]);
  a.eps1 = float(c.num("eps", 1e-6));
  a.eps2 = float(c.num("eps2", c.num("eps", 1e-6)));
  a.woff1 = a.woff2 = float(c.num("weight_offset", 0));
  a.rope_scale = float(c.num("rope_scale", 1));
  a.scale = float(c.num("scale", 1.0 / std::sqrt(double(a.D))));
  if (c.num("activation", 0) != 0 || c.num("window", 0) != 0 || c.num("softcap", 0) != 0)
    bad("decode_layer_fwd: silu, no window and no soft-cap only");
  a.sync = c.op->sync;
  a.err = c.err();
  a.sms = c.op->inst->info.sm_count;
  decode_layer_carve(a, c.ws->get(size_t(decode_layer_workspace_bytes(a))));
  decode_layer(a, c.stream);
}

}  // namespace rlh::kcuda
