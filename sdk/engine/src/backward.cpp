// The backward pass: forward.cpp in reverse, one op per line. Parameter gradients accumulate
// (+=) into the gradient storage, so micro-batches add up; activation gradients flow through the
// GradActs scratch. `dres` carries d loss / d residual stream from the head down to the
// embedding.
#include "model.hpp"

namespace rlh::engine {

// dres holds d loss / d (layer output) on entry and d loss / d (layer input) on exit.
void Engine::Impl::backward_layer(int64_t l, const MicroBatch& mb, LayerActs& a) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerParams& p = P.layers[size_t(l)];
  const LayerParams& gp = G.layers[size_t(l)];
  GradActs& g = grad_acts;
  const int64_t N = mb.num_tokens(), S = mb.num_sequences();
  const int64_t Hq = s.Hq, Hkv = s.Hkv, D = s.D, Wqkv = s.Wqkv, F = s.F;
  const int32_t* cu = mb.cu_seqlens.data();

  // MLP block: out = h + down(a) (+ b_down), or the MoE block (moe.cpp)
  if (s.moe) {
    backward_moe(l, mb, a);
  } else {
  if (gp.bdown) ops->bias_bwd(gp.bdown, g.dres, C, N, C);
  ops->gemm(false, false, N, F, C, 1.f, g.dres, C, p.wdown, F, 0.f, g.da, F);       // da [N,F]
  ops->gemm(true, false, C, F, N, 1.f, g.dres, C, a.a, F, 1.f, gp.wdown, F);        // dW_down [C,F]
  ops->swiglu_bwd(g.dgu, 2 * F, g.dgu + F, 2 * F, g.da, F, a.gu, 2 * F, a.gu + F, 2 * F, N,
                  F);                                                               // dgu [N,2F]
  if (gp.bgate) ops->bias_bwd(gp.bgate, g.dgu, 2 * F, N, F);
  if (gp.bup) ops->bias_bwd(gp.bup, g.dgu + F, 2 * F, N, F);
  ops->gemm(false, false, N, C, 2 * F, 1.f, g.dgu, 2 * F, p.wgu, C, 0.f, g.dxn, C);   // dxn2 [N,C]
  ops->gemm(true, false, 2 * F, C, N, 1.f, g.dgu, 2 * F, a.xn2, C, 1.f, gp.wgu, C);   // dW_gu [2F,C]
  ops->rmsnorm_bwd(g.dres, C, gp.mlp_norm, g.dxn, C, a.h, C, p.mlp_norm, a.rstd2, N, C,
                   s.off_mlp, true);                                                // dres = dh
  }

  // Attention block: h = x + o_proj(att) (+ b_o), or multi-head latent attention (mla.cpp)
  if (s.mla) {
    backward_mla(l, mb, a);
    return;
  }
  if (gp.bo) ops->bias_bwd(gp.bo, g.dres, C, N, C);
  ops->gemm(false, false, N, Hq * D, C, 1.f, g.dres, C, p.wo, Hq * D, 0.f, g.datt, Hq * D);  // datt
  ops->gemm(true, false, C, Hq * D, N, 1.f, g.dres, C, a.att, Hq * D, 1.f, gp.wo, Hq * D);   // dW_o
  const float* q = s.qk_norm ? a.qk : a.qkv;
  const float* k = s.qk_norm ? a.qk + Hq * D : a.qkv + Hq * D;
  const int64_t ldqk = s.qk_norm ? (Hq + Hkv) * D : Wqkv;
  const float* v = a.qkv + (Hq + Hkv) * D;
  float* dq = g.dqkv;                   // [N, Hq*D]  (rows Wqkv apart)
  float* dk = g.dqkv + Hq * D;          // [N, Hkv*D]
  float* dv = g.dqkv + (Hq + Hkv) * D;  // [N, Hkv*D]
  ops->attention_bwd(dq, Wqkv, dk, Wqkv, dv, Wqkv, g.datt, Hq * D, q, ldqk, k, ldqk, v, Wqkv,
                     a.att, Hq * D, a.lse, cu, S, N, Hq, Hkv, D, D, s.scale, s.window);  // dqkv
  if (s.use_rope) {
    apply_rope(dq, Wqkv, Hq, D, mb, true);  // transposed rotation, in place
    apply_rope(dk, Wqkv, Hkv, D, mb, true);
  }
  if (s.qk_norm) {  // in place: d(normed q) -> d(projected q), per head
    for (int64_t h = 0; h < Hq; ++h)
      ops->rmsnorm_bwd(dq + h * D, Wqkv, gp.q_norm, dq + h * D, Wqkv, a.qkv + h * D, Wqkv,
                       p.q_norm, a.rstd_q + h * N, N, D, s.off_attn, false);
    for (int64_t h = 0; h < Hkv; ++h)
      ops->rmsnorm_bwd(dk + h * D, Wqkv, gp.k_norm, dk + h * D, Wqkv, a.qkv + (Hq + h) * D, Wqkv,
                       p.k_norm, a.rstd_k + h * N, N, D, s.off_attn, false);
  }
  if (gp.bq) ops->bias_bwd(gp.bq, dq, Wqkv, N, Hq * D);
  if (gp.bk) ops->bias_bwd(gp.bk, dk, Wqkv, N, Hkv * D);
  if (gp.bv) ops->bias_bwd(gp.bv, dv, Wqkv, N, Hkv * D);
  ops->gemm(false, false, N, C, Wqkv, 1.f, g.dqkv, Wqkv, p.wqkv, C, 0.f, g.dxn, C);  // dxn1 [N,C]
  ops->gemm(true, false, Wqkv, C, N, 1.f, g.dqkv, Wqkv, a.xn1, C, 1.f, gp.wqkv, C);  // dW_qkv
  ops->rmsnorm_bwd(g.dres, C, gp.attn_norm, g.dxn, C, a.x, C, p.attn_norm, a.rstd1, N, C,
                   s.off_attn, true);                                               // dres = dx
}

// Output gradients are in head.dlp / dent / dlp_proc (kernel alignment).
void Engine::Impl::backward(const MicroBatch& mb, const OutputRequest& req) {
  const int64_t N = mb.num_tokens();
  GradActs& g = grad_acts;

  // Head: dxn [N,C] from the requested outputs; d lm_head accumulated (into d embed when tied).
  LogprobAttrs raw;
  raw.temperature = req.temperature;
  raw.chunk_bytes = opt.logprob_chunk_bytes;
  bool have_dxn = false;
  if (req.logprob || req.entropy || req.logprob_at_ids) {
    ops->linear_logprob_bwd(g.dxn, G.lm_head, head.dlp, req.entropy ? head.dent : nullptr,
                            head.xn, P.lm_head, target_raw, head.lse,
                            req.entropy ? head.ent : nullptr, N, C, V, head.kraw, raw, false);
    have_dxn = true;
  }
  if (req.processed_logprob) {
    LogprobAttrs proc = raw;
    proc.top_k = req.top_k;
    proc.top_p = req.top_p;
    ops->linear_logprob_bwd(g.dxn, G.lm_head, head.dlp_proc, nullptr, head.xn, P.lm_head, target,
                            head.lse_proc, nullptr, N, C, V, 1, proc, have_dxn);
    have_dxn = true;
  }
  ops->rmsnorm_bwd(g.dres, C, G.final_norm, g.dxn, C, head.x, C, P.final_norm, head.rstd, N, C,
                   float(desc.final_norm.weight_offset), false);  // dres = d x_L

  for (int64_t l = L - 1; l >= 0; --l) {
    LayerActs& a = acts_of(l);
    a.x = xs[size_t(l)];
    if (!acts_saved_all) forward_layer(l, mb, a, nullptr);  // recompute from the layer input
    backward_layer(l, mb, a);
  }
  ops->embedding_bwd(G.embed, mb.input_ids.data(), g.dres, N, C, V);
}

}  // namespace rlh::engine
