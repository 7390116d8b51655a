// Multi-head latent attention (DeepSeek-V2/V3), forward and backward, one op per line. As HF's
// DeepseekV3Attention computes it, with H heads, nope/rope/value head dims dn, dr, dv:
//
//   q      = q_b(q_a_norm(q_a(xn)))  [N, H (dn+dr)]     (or q_proj(xn) without q_lora_rank)
//   kva    = kv_a(xn)                [N, rkv + dr]       latent | k_rot
//   kv     = kv_b(kv_a_norm(latent)) [N, H (dn+dv)]     per head: k_nope | v
//   q_rot  = rope(q[.., dn:]),  k_rot = rope(kva[.., rkv:]), shared by every head
//   att    = attention([q_nope | q_rot], [k_nope | k_rot], v)
//
// This is the program's mla step (sdk/layer_program.hpp): xn, the attention norm's output, in;
// att, what o_proj reads, out; the norm, o_proj and the residual add are the program's own steps.
// q, k and v live in the step's qkv value (rows Wqkv = H (2 (dn+dr) + dv) apart), heads
// contiguous, so the attention kernel reads them as any GQA layer's. kv_b's rows are per head
// k_nope | v, so its product is taken head by head straight into k and v (2H GEMMs) instead of
// copying; the rotated key is written into every head by the rope op itself.
//
// RoPE: DeepSeek's interleaved layout (rope_interleave) rotates pairs (2i, 2i+1) here, in place;
// HF de-interleaves first and rotates halves, which permutes the rotated dims of q and k alike and
// so gives the same q.k. The latent norms use eps 1e-6: HF builds them as DeepseekV3RMSNorm(dim)
// with its default eps, not the config's rms_norm_eps (the description carries no eps for them).
//
// Context parallelism: everything but the attention is per token; the attention's k and v
// (after kv_b, so per head) go through the same all-gather and reduce-scatter as a dense layer's.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "model.hpp"

namespace rlh::engine {

namespace {
constexpr float kLatentEps = 1e-6f;

// The attention of an MLA layer as an attention step (H heads of q|k dims D and value dim dv,
// k and v per head), for context parallelism's attention over the group (cp_attention.cpp).
sdk::LayerStep attention_step(const LayerShape& s) {
  sdk::LayerStep st;
  st.op = sdk::StepOp::attention;
  st.hq = st.hkv = s.H;
  st.dk = s.D;
  st.dv = s.dv;
  st.scale = s.scale;
  st.window = s.window;
  st.softcap = s.softcap;
  return st;
}
}  // namespace

void Engine::Impl::describe_mla_layer(const sdk::LayerDesc& ld, const sdk::LayerStep& step, LayerShape& s) {
  const std::string at = "engine: layer " + std::to_string(ld.index) + ": ";
  static_cast<MlaBasics&>(s) = mla_basics(ld, at);
  s.mla = true;
  s.H = step.hq;
  s.D = step.dk;
  s.Wqkv = step.out2.width;
  s.window = step.window;
  s.softcap = float(step.softcap);
  s.scale = float(step.scale);
  s.rope = step.table;
}

// Saved latents per MLA layer (one set with recompute) and the backward's scratch.
void Engine::Impl::plan_mla(int64_t N, bool save_all) {
  mla_acts.clear();
  mla_f.reset();
  mla_scratch = MlaScratch{};
  int64_t mrq = 0, mrkv = 0, mdr = 0, mw = 0, saved = 0, worst = 0;
  auto floats = [&](const LayerShape& s) { return 2 * N * s.rq + N + N * (s.rkv + s.dr) + N * s.rkv + N; };
  for (const LayerShape& s : shapes) {
    if (!s.mla) continue;
    mrq = std::max(mrq, s.rq);
    mrkv = std::max(mrkv, s.rkv);
    mdr = std::max(mdr, s.dr);
    mw = std::max(mw, s.Wqkv);
    saved += floats(s);
    worst = std::max(worst, floats(s));
  }
  if (mrkv == 0) return;
  LayerShape big{};
  big.rq = mrq;
  big.rkv = mrkv;
  big.dr = mdr;
  const int64_t total = (save_all ? saved : floats(big)) + N * mw + N * mrq + 2 * N * mrkv + 2 * N * mdr;
  mla_f = Buffer<float>(*alloc, size_t(total));
  float* at = mla_f.data();
  auto take = [&](int64_t n) {
    float* p = at;
    at += n;
    return p;
  };
  auto carve = [&](const LayerShape& s) {
    MlaActs m;
    m.qa = take(N * s.rq);
    m.qan = take(N * s.rq);
    m.rstd_qa = take(N);
    m.kva = take(N * (s.rkv + s.dr));
    m.ckv = take(N * s.rkv);
    m.rstd_kva = take(N);
    return m;
  };
  if (save_all) {
    mla_acts.assign(size_t(L), MlaActs{});
    for (int64_t l = 0; l < L; ++l)
      if (shapes[size_t(l)].mla) mla_acts[size_t(l)] = carve(shapes[size_t(l)]);
  } else {
    mla_acts.push_back(carve(big));
  }
  mla_scratch.dqkv = take(N * mw);
  mla_scratch.dqan = take(N * mrq);
  mla_scratch.dckv = take(N * mrkv);
  mla_scratch.dkvc = take(N * mrkv);
  mla_scratch.dkrot = take(N * mdr);
  mla_scratch.tmp = take(N * mdr);
  if (at != mla_f.data() + total) throw std::logic_error("engine: MLA activation plan mismatch");
  mla_saved_all = save_all;
}

// The mla step: att [N, H dv] (and q|k|v in qkv, lse [H, N]) from xn.
void Engine::Impl::forward_mla(int64_t l, const MicroBatch& mb, const float* xn, float* qkv, float* att,
                               float* lse) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerParams& p = P[size_t(l)];
  MlaActs& m = mla_of(l);
  const int64_t N = mb.num_tokens(), S = mb.num_sequences(), H = s.H, D = s.D, W = s.Wqkv;
  const int64_t dn = s.dn, dr = s.dr, dv = s.dv, rq = s.rq, rkv = s.rkv;
  float* q = qkv;              // [N, H*D]
  float* k = qkv + H * D;      // [N, H*D]
  float* v = qkv + 2 * H * D;  // [N, H*dv]

  if (rq > 0) {
    ops->gemm(false, true, N, rq, C, 1.f, xn, C, p.q_a, C, 0.f, m.qa, rq);                  // qa [N,rq]
    ops->rmsnorm_fwd(m.qan, rq, m.rstd_qa, m.qa, rq, p.q_a_norm, N, rq, kLatentEps, 0.f);
    ops->gemm(false, true, N, H * D, rq, 1.f, m.qan, rq, p.q_b, rq, 0.f, q, W);           // q [N,H*D]
  } else {
    ops->gemm(false, true, N, H * D, C, 1.f, xn, C, p.wq, C, 0.f, q, W);
  }
  ops->gemm(false, true, N, rkv + dr, C, 1.f, xn, C, p.kv_a, C, 0.f, m.kva, rkv + dr);      // kva
  ops->rmsnorm_fwd(m.ckv, rkv, m.rstd_kva, m.kva, rkv + dr, p.kv_a_norm, N, rkv, kLatentEps,
                   0.f);                                                              // ckv [N,rkv]
  for (int64_t h = 0; h < H; ++h) {  // kv_b per head, straight into k_nope and v
    const float* wk = p.kv_b + h * (dn + dv) * rkv;
    if (dn > 0) ops->gemm(false, true, N, dn, rkv, 1.f, m.ckv, rkv, wk, rkv, 0.f, k + h * D, W);
    ops->gemm(false, true, N, dv, rkv, 1.f, m.ckv, rkv, wk + dn * rkv, rkv, 0.f, v + h * dv, W);
  }
  if (s.rope >= 0) {
    for (int64_t h = 0; h < H; ++h) {
      apply_rope(s.rope, q + h * D + dn, W, q + h * D + dn, W, 1, dr, mb, false);       // q_rot
      apply_rope(s.rope, k + h * D + dn, W, m.kva + rkv, rkv + dr, 1, dr, mb, false);   // k_rot
    }
  } else {
    for (int64_t h = 0; h < H; ++h)  // the shared key part into every head, unrotated
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < dr; ++i) k[n * W + h * D + dn + i] = m.kva[n * (rkv + dr) + rkv + i];
  }
  if (cp_on)  // this rank's queries over the group's keys and values
    cp_attention_fwd(attention_step(s), att, H * dv, lse, q, W, k, W, v, W);
  else
    ops->attention_fwd(att, H * dv, lse, q, W, k, W, v, W, mb.cu_seqlens.data(), S, N, H, H, D, dv, s.scale,
                       s.window, s.softcap);                                           // att [N,H*dv]
}

// datt = d loss / d att in; dxn = d loss / d xn out (added to it with accumulate).
void Engine::Impl::backward_mla(int64_t l, const MicroBatch& mb, const float* xn, const float* qkv,
                                const float* att, const float* lse, const float* datt, float* dxn,
                                bool accumulate) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerParams& p = P[size_t(l)];
  const LayerParams& gp = G[size_t(l)];
  MlaActs& m = mla_of(l);
  MlaScratch& x = mla_scratch;
  const int64_t N = mb.num_tokens(), S = mb.num_sequences(), H = s.H, D = s.D, W = s.Wqkv;
  const int64_t dn = s.dn, dr = s.dr, dv = s.dv, rq = s.rq, rkv = s.rkv;
  const float* q = qkv;
  const float* k = qkv + H * D;
  const float* v = qkv + 2 * H * D;
  float* dq = x.dqkv;
  float* dk = x.dqkv + H * D;
  float* dvv = x.dqkv + 2 * H * D;

  if (cp_on)  // d k and d v of every rank's queries, reduce-scattered onto this rank's rows
    cp_attention_bwd(attention_step(s), dq, W, dk, W, dvv, W, datt, H * dv, q, W, k, W, v, W, att, H * dv, lse);
  else
    ops->attention_bwd(dq, W, dk, W, dvv, W, datt, H * dv, q, W, k, W, v, W, att, H * dv, lse,
                       mb.cu_seqlens.data(), S, N, H, H, D, dv, s.scale, s.window, s.softcap);  // dq, dk, dv

  // Rotated parts: q's in place; k's summed over the heads that share it.
  for (int64_t h = 0; h < H; ++h) {
    if (s.rope >= 0) {
      apply_rope(s.rope, dq + h * D + dn, W, dq + h * D + dn, W, 1, dr, mb, true);
      apply_rope(s.rope, h == 0 ? x.dkrot : x.tmp, dr, dk + h * D + dn, W, 1, dr, mb, true);
    } else {
      float* dst = h == 0 ? x.dkrot : x.tmp;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < dr; ++i) dst[n * dr + i] = dk[n * W + h * D + dn + i];
    }
    if (h > 0) ops->add_fwd(x.dkrot, x.dkrot, x.tmp, N * dr);
  }
  // kv_b per head: d latent (normed) and its weight gradient.
  for (int64_t h = 0; h < H; ++h) {
    const float* wk = p.kv_b + h * (dn + dv) * rkv;
    float* gk = gp.kv_b + h * (dn + dv) * rkv;
    if (dn > 0) {
      ops->gemm(false, false, N, rkv, dn, 1.f, dk + h * D, W, wk, rkv, h == 0 ? 0.f : 1.f, x.dckv,
                rkv);
      ops->gemm(true, false, dn, rkv, N, 1.f, dk + h * D, W, m.ckv, rkv, 1.f, gk, rkv);
    }
    ops->gemm(false, false, N, rkv, dv, 1.f, dvv + h * dv, W, wk + dn * rkv, rkv,
              (h == 0 && dn == 0) ? 0.f : 1.f, x.dckv, rkv);
    ops->gemm(true, false, dv, rkv, N, 1.f, dvv + h * dv, W, m.ckv, rkv, 1.f, gk + dn * rkv, rkv);
  }
  ops->rmsnorm_bwd(x.dkvc, rkv, gp.kv_a_norm, x.dckv, rkv, m.kva, rkv + dr, p.kv_a_norm,
                   m.rstd_kva, N, rkv, 0.f, false);                                   // d latent
  // kv_a: its two row blocks (latent, k_rot) from their gradients.
  ops->gemm(false, false, N, C, rkv, 1.f, x.dkvc, rkv, p.kv_a, C, accumulate ? 1.f : 0.f, dxn, C);  // dxn
  ops->gemm(false, false, N, C, dr, 1.f, x.dkrot, dr, p.kv_a + rkv * C, C, 1.f, dxn, C);
  ops->gemm(true, false, rkv, C, N, 1.f, x.dkvc, rkv, xn, C, 1.f, gp.kv_a, C);         // dW_kv_a
  ops->gemm(true, false, dr, C, N, 1.f, x.dkrot, dr, xn, C, 1.f, gp.kv_a + rkv * C, C);
  // q path
  if (rq > 0) {
    ops->gemm(false, false, N, rq, H * D, 1.f, dq, W, p.q_b, rq, 0.f, x.dqan, rq);         // dqan
    ops->gemm(true, false, H * D, rq, N, 1.f, dq, W, m.qan, rq, 1.f, gp.q_b, rq);          // dW_q_b
    ops->rmsnorm_bwd(x.dqan, rq, gp.q_a_norm, x.dqan, rq, m.qa, rq, p.q_a_norm, m.rstd_qa, N, rq,
                     0.f, false);                                                     // dqa (in place)
    ops->gemm(false, false, N, C, rq, 1.f, x.dqan, rq, p.q_a, C, 1.f, dxn, C);           // dxn1 +=
    ops->gemm(true, false, rq, C, N, 1.f, x.dqan, rq, xn, C, 1.f, gp.q_a, C);           // dW_q_a
  } else {
    ops->gemm(false, false, N, C, H * D, 1.f, dq, W, p.wq, C, 1.f, dxn, C);
    ops->gemm(true, false, H * D, C, N, 1.f, dq, W, xn, C, 1.f, gp.wq, C);
  }
}

}  // namespace rlh::engine
