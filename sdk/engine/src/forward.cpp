// The forward pass, in execution order, one op per line (llm.c style). Decoder layer, as the
// description defines it (pre-norm, HF Llama):
//   h   = x + o_proj(attention(rope(qk_norm(qkv_proj(attn_norm(x))))))
//   out = h + down(silu(gate(mlp_norm(h))) * up(mlp_norm(h)))
// then the head: per-token outputs of lm_head(final_norm(x_L)) without materialising logits.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "model.hpp"

namespace rlh::engine {

// ---------------------------------------------------------------------------------------------
// Batch bookkeeping

// K of logprob_at_ids: the ids field's second dimension (0 when not requested).
int64_t Engine::Impl::ids_per_token(const MicroBatch& mb, const OutputRequest& req) const {
  if (!req.logprob_at_ids) return 0;
  const rlh_tensor* f = mb.field(req.ids_field);
  if (!f) throw std::invalid_argument("engine: logprob_at_ids needs the field '" + req.ids_field + "'");
  if ((f->ndim != 1 && f->ndim != 2) || f->shape[0] != mb.num_tokens() ||
      f->dtype.code != RLH_DTYPE_INT || (f->dtype.bits != 32 && f->dtype.bits != 64))
    throw std::invalid_argument("engine: field '" + req.ids_field +
                                "' must be int32/int64 [num_tokens, K]");
  const int64_t K = f->ndim == 2 ? f->shape[1] : 1;
  if ((f->ndim == 2 && K > 1 && f->strides[1] != 1) || (mb.num_tokens() > 1 && f->strides[0] != K))
    throw std::invalid_argument("engine: field '" + req.ids_field + "' must be contiguous");
  return K;
}

// Positions restart at every sequence; the target of token t is token t+1 of the same sequence
// (-1 for the last token: nothing to predict). With logprob_at_ids, row t of the raw pass also
// targets the ids the field gives for position t+1.
void Engine::Impl::prepare_batch(const MicroBatch& mb, const OutputRequest& req) {
  const int64_t N = mb.num_tokens(), S = mb.num_sequences();
  if (S < 1 || mb.cu_seqlens[0] != 0 || mb.cu_seqlens[size_t(S)] != N || N == 0)
    throw std::invalid_argument(
        "engine: a micro-batch needs tokens and cu_seqlens running from 0 to their number");
  for (int64_t s = 0; s < S; ++s) {
    const int32_t b = mb.cu_seqlens[size_t(s)], e = mb.cu_seqlens[size_t(s) + 1];
    if (e < b) throw std::invalid_argument("engine: cu_seqlens must not decrease");
    for (int32_t t = b; t < e; ++t) {
      const int32_t id = mb.input_ids[size_t(t)];
      if (id < 0 || id >= V)
        throw std::invalid_argument("engine: token id " + std::to_string(id) + " outside the vocabulary");
      pos[t] = t - b;
      target[t] = t + 1 < e ? mb.input_ids[size_t(t) + 1] : -1;
    }
  }
  const int64_t kraw = head.kraw, K = kraw - 1;
  if (K == 0) return;
  const rlh_tensor* f = mb.field(req.ids_field);
  const char* base = static_cast<const char*>(f->data) + f->byte_offset;
  auto id_at = [&](int64_t row, int64_t k) -> int64_t {
    return f->dtype.bits == 32 ? reinterpret_cast<const int32_t*>(base)[row * K + k]
                               : reinterpret_cast<const int64_t*>(base)[row * K + k];
  };
  for (int64_t s = 0; s < S; ++s) {
    const int32_t b = mb.cu_seqlens[size_t(s)], e = mb.cu_seqlens[size_t(s) + 1];
    for (int32_t t = b; t < e; ++t) {
      int32_t* row = target_raw + int64_t(t) * kraw;
      row[0] = target[t];
      for (int64_t k = 0; k < K; ++k) {
        const int64_t id = t + 1 < e ? id_at(t + 1, k) : -1;
        if (id >= V)
          throw std::invalid_argument("engine: id " + std::to_string(id) + " in field '" +
                                      req.ids_field + "' outside the vocabulary");
        row[1 + k] = int32_t(id < 0 ? -1 : id);
      }
    }
  }
}

void shift_to_outputs(const float* kernel, int64_t ldk, float* out, int64_t ldo, int64_t width,
                      std::span<const int32_t> cu) {
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    if (cu[s + 1] == cu[s]) continue;
    std::fill(out + int64_t(cu[s]) * ldo, out + int64_t(cu[s]) * ldo + width, 0.f);
    for (int32_t t = cu[s] + 1; t < cu[s + 1]; ++t)
      std::copy(kernel + int64_t(t - 1) * ldk, kernel + int64_t(t - 1) * ldk + width,
                out + int64_t(t) * ldo);
  }
}

void shift_to_kernel(const float* out, int64_t ldo, float* kernel, int64_t ldk, int64_t width,
                     std::span<const int32_t> cu) {
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    if (cu[s + 1] == cu[s]) continue;
    for (int32_t t = cu[s]; t + 1 < cu[s + 1]; ++t)
      std::copy(out + int64_t(t + 1) * ldo, out + int64_t(t + 1) * ldo + width,
                kernel + int64_t(t) * ldk);
    const int64_t last = cu[s + 1] - 1;
    std::fill(kernel + last * ldk, kernel + last * ldk + width, 0.f);
  }
}

// RoPE on H heads of x (rows ld apart), in place; the transposed rotation when `backward`.
// Kinds whose frequencies depend on the sequence length (dynamic NTK, longrope) are applied one
// sequence at a time with that sequence's own table, so packing never changes a result.
void Engine::Impl::apply_rope(float* x, int64_t ld, int64_t H, int64_t D, const MicroBatch& mb,
                              bool backward) {
  apply_rope_to(x, ld, x, ld, H, D, mb, backward);
}

// The same from x into y (MLA writes the shared rotated key into every head).
void Engine::Impl::apply_rope_to(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t H,
                                 int64_t D, const MicroBatch& mb, bool backward) {
  auto run = [&](int64_t b, const float* f, int64_t n) {
    if (backward)
      ops->rope_bwd(y + b * ldy, ldy, x + b * ldx, ldx, pos + b, f, n, H, D, R, rope_scale,
                    rope_interleaved);
    else
      ops->rope_fwd(y + b * ldy, ldy, x + b * ldx, ldx, pos + b, f, n, H, D, R, rope_scale,
                    rope_interleaved);
  };
  if (!rope_per_sequence) {
    run(0, inv_freq.data(), mb.num_tokens());
    return;
  }
  Buffer<float> f(*alloc, size_t(R / 2));
  for (int64_t s = 0; s < mb.num_sequences(); ++s) {
    const int32_t b = mb.cu_seqlens[size_t(s)], e = mb.cu_seqlens[size_t(s) + 1];
    if (e == b) continue;
    const std::vector<double> fs = sdk::rope_inv_freq(desc.rope, R, e - b);
    for (int64_t i = 0; i < R / 2; ++i) f[size_t(i)] = float(fs[size_t(i)]);
    run(b, f.data(), e - b);
  }
}

// ---------------------------------------------------------------------------------------------
// One decoder layer. Writes the layer output into x_out (nullptr: stop after the MLP activation,
// which is all a recompute inside the backward needs).

void Engine::Impl::forward_layer(int64_t l, const MicroBatch& mb, LayerActs& a, float* x_out) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerParams& p = P.layers[size_t(l)];
  const int64_t N = mb.num_tokens(), S = mb.num_sequences();
  const int64_t Hq = s.Hq, Hkv = s.Hkv, D = s.D, Wqkv = s.Wqkv, F = s.F;
  const int32_t* cu = mb.cu_seqlens.data();
  float* q = a.qkv;                   // [N, Hq*D]  (rows Wqkv apart)
  float* k = a.qkv + Hq * D;          // [N, Hkv*D]
  float* v = a.qkv + (Hq + Hkv) * D;  // [N, Hkv*D]
  int64_t ldqk = Wqkv;

  // attention block
  if (s.mla) {  // multi-head latent attention (mla.cpp): a.h = x + o_proj(mla(attn_norm(x)))
    forward_mla(l, mb, a);
  } else {
    ops->rmsnorm_fwd(a.xn1, C, a.rstd1, a.x, C, p.attn_norm, N, C, s.eps_attn, s.off_attn);  // xn1 [N,C]
    ops->gemm(false, true, N, Wqkv, C, 1.f, a.xn1, C, p.wqkv, C, 0.f, a.qkv, Wqkv);           // qkv [N,Wqkv]
    if (p.bq) ops->bias_add_fwd(q, Wqkv, p.bq, N, Hq * D);
    if (p.bk) ops->bias_add_fwd(k, Wqkv, p.bk, N, Hkv * D);
    if (p.bv) ops->bias_add_fwd(v, Wqkv, p.bv, N, Hkv * D);
    if (s.qk_norm) {  // per head over D; q|k move to a.qk [N, (Hq+Hkv) D] so qkv keeps the inputs
      const int64_t W2 = (Hq + Hkv) * D;
      for (int64_t h = 0; h < Hq; ++h)
        ops->rmsnorm_fwd(a.qk + h * D, W2, a.rstd_q + h * N, q + h * D, Wqkv, p.q_norm, N, D,
                         s.eps_attn, 0.f);
      for (int64_t h = 0; h < Hkv; ++h)
        ops->rmsnorm_fwd(a.qk + (Hq + h) * D, W2, a.rstd_k + h * N, k + h * D, Wqkv, p.k_norm, N,
                         D, s.eps_attn, 0.f);
      q = a.qk;
      k = a.qk + Hq * D;
      ldqk = W2;
    }
    if (s.use_rope) {
      apply_rope(q, ldqk, Hq, D, mb, false);  // q, k rotated in place
      apply_rope(k, ldqk, Hkv, D, mb, false);
    }
    ops->attention_fwd(a.att, Hq * D, a.lse, q, ldqk, k, ldqk, v, Wqkv, cu, S, N, Hq, Hkv, D, D,
                       s.scale, s.window);                                                  // att [N,Hq*D]
    ops->gemm(false, true, N, C, Hq * D, 1.f, a.att, Hq * D, p.wo, Hq * D, 0.f, a.h, C);      // h [N,C]
    if (p.bo) ops->bias_add_fwd(a.h, C, p.bo, N, C);
    ops->add_fwd(a.h, a.x, a.h, N * C);                                                      // h = x + attn
  }

  // MLP block
  ops->rmsnorm_fwd(a.xn2, C, a.rstd2, a.h, C, p.mlp_norm, N, C, s.eps_mlp, s.off_mlp);      // xn2 [N,C]
  if (s.moe) {  // mixture of experts (moe.cpp)
    forward_moe(l, mb, a, x_out);
    return;
  }
  ops->gemm(false, true, N, 2 * F, C, 1.f, a.xn2, C, p.wgu, C, 0.f, a.gu, 2 * F);           // gu [N,2F]
  if (p.bgate) ops->bias_add_fwd(a.gu, 2 * F, p.bgate, N, F);
  if (p.bup) ops->bias_add_fwd(a.gu + F, 2 * F, p.bup, N, F);
  ops->swiglu_fwd(a.a, F, a.gu, 2 * F, a.gu + F, 2 * F, N, F);                              // a [N,F]
  if (!x_out) return;
  ops->gemm(false, true, N, C, F, 1.f, a.a, F, p.wdown, F, 0.f, x_out, C);                  // out [N,C]
  if (p.bdown) ops->bias_add_fwd(x_out, C, p.bdown, N, C);
  ops->add_fwd(x_out, a.h, x_out, N * C);                                                   // out = h + mlp
}

// ---------------------------------------------------------------------------------------------
// The whole forward: embedding, layers, final norm, head outputs (kernel alignment in `head`).

void Engine::Impl::forward(const MicroBatch& mb, const OutputRequest& req, bool save_all) {
  const int64_t N = mb.num_tokens();
  if (mb.cu_seqlens.empty() || N == 0)
    throw std::invalid_argument("engine: empty micro-batch");
  plan_acts(N, save_all, 1 + ids_per_token(mb, req));
  prepare_batch(mb, req);
  prepare_routing(mb, req);
  const int32_t* ids = mb.input_ids.data();

  ops->embedding_fwd(xs[0], ids, P.embed, N, C, V);  // x0 [N,C]
  for (int64_t l = 0; l < L; ++l) {
    LayerActs& a = acts_of(l);
    a.x = xs[size_t(l)];
    forward_layer(l, mb, a, xs[size_t(l) + 1]);
  }
  ops->rmsnorm_fwd(head.xn, C, head.rstd, head.x, C, P.final_norm, N, C,
                   float(desc.final_norm.eps), float(desc.final_norm.weight_offset));  // xn [N,C]

  LogprobAttrs raw;
  raw.temperature = req.temperature;
  raw.chunk_bytes = opt.logprob_chunk_bytes;
  if (req.logprob || req.entropy || req.logprob_at_ids)
    ops->linear_logprob_fwd(head.lp, head.lse, req.entropy ? head.ent : nullptr, head.xn,
                            P.lm_head, target_raw, N, C, V, head.kraw, raw);  // lp [N,kraw]
  if (req.processed_logprob) {
    LogprobAttrs proc = raw;
    proc.top_k = req.top_k;
    proc.top_p = req.top_p;
    ops->linear_logprob_fwd(head.lp_proc, head.lse_proc, nullptr, head.xn, P.lm_head, target, N,
                            C, V, 1, proc);                                   // lp_proc [N]
  }
}

}  // namespace rlh::engine
