// The forward pass: the embedding (scaled for Gemma), each layer's program steps in order (one
// kernel call per step, llm.c style; sdk/layer_program.hpp derives them from the description:
// for HF Llama h = x + o_proj(attention(rope(qk_norm(qkv_proj(attn_norm(x)))))), out = h +
// down(act(gate(mlp_norm(h))) * up(mlp_norm(h)))), then the head: per-token outputs of
// lm_head(final_norm(x_L)) without materialising logits, and the value head's score(final_norm(x_L)).
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
      if (id < 0 || id >= Vall)
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
        if (id >= Vall)
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

// RoPE table t on H heads of x (rows ld apart) into y; the transposed rotation when
// `backward`. Kinds whose frequencies depend on the sequence length (dynamic NTK, longrope) are
// applied one sequence at a time with that sequence's own table, so packing never changes a
// result.
void Engine::Impl::apply_rope(int t, float* y, int64_t ldy, const float* x, int64_t ldx, int64_t H,
                              int64_t D, const MicroBatch& mb, bool backward) {
  const RopeState& r = ropes[size_t(t)];
  auto run = [&](int64_t b, const float* f, int64_t n) {
    if (backward)
      ops->rope_bwd(y + b * ldy, ldy, x + b * ldx, ldx, pos + b, f, n, H, D, r.R, r.scale, r.interleaved);
    else
      ops->rope_fwd(y + b * ldy, ldy, x + b * ldx, ldx, pos + b, f, n, H, D, r.R, r.scale, r.interleaved);
  };
  if (!r.per_sequence) {
    run(0, r.inv_freq.data(), mb.num_tokens());
    return;
  }
  Buffer<float> f(*alloc, size_t(r.R / 2));
  for (int64_t s = 0; s < mb.num_sequences(); ++s) {
    const int32_t b = mb.cu_seqlens[size_t(s)], e = mb.cu_seqlens[size_t(s) + 1];
    if (e == b) continue;
    const std::vector<double> fs = sdk::rope_inv_freq(r.table->rope, r.R, e - b);
    for (int64_t i = 0; i < r.R / 2; ++i) f[size_t(i)] = float(fs[size_t(i)]);
    run(b, f.data(), e - b);
  }
}

// ---------------------------------------------------------------------------------------------
// One decoder layer: the program's steps in order (sdk/layer_program.hpp says what each does).

namespace {

// A column block of a layer value: its first element and its row stride.
struct ColsPtr {
  float* p;
  int64_t ld;
};
ColsPtr at(const LayerActs& a, const sdk::LayerProgram& lp, const sdk::Cols& c) {
  return {a.v[size_t(c.value)] + c.col, lp.values[size_t(c.value)].width};
}

}  // namespace

void Engine::Impl::glu_fwd(const std::string& act, float* h, int64_t ldh, const float* gu, int64_t ldgu,
                           int64_t N, int64_t F) {
  if (act == "silu")
    ops->swiglu_fwd(h, ldh, gu, ldgu, gu + F, ldgu, N, F);
  else
    ops->geglu_fwd(h, ldh, gu, ldgu, gu + F, ldgu, N, F, act == "gelu_tanh");
}

void Engine::Impl::glu_bwd(const std::string& act, float* dgu, int64_t lddgu, const float* dh, int64_t lddh,
                           const float* gu, int64_t ldgu, int64_t N, int64_t F) {
  if (act == "silu")
    ops->swiglu_bwd(dgu, lddgu, dgu + F, lddgu, dh, lddh, gu, ldgu, gu + F, ldgu, N, F);
  else
    ops->geglu_bwd(dgu, lddgu, dgu + F, lddgu, dh, lddh, gu, ldgu, gu + F, ldgu, N, F, act == "gelu_tanh");
}

void Engine::Impl::forward_layer(int64_t l, const MicroBatch& mb, LayerActs& a, bool recompute) {
  const sdk::LayerProgram& lp = prog.layers[size_t(l)];
  const int64_t N = mb.num_tokens(), S = mb.num_sequences();
  const int64_t R = sp_on ? sp_rows : N;  // rows of the residual regions (norms, adds) on this rank
  for (const sdk::LayerStep& st : lp.steps) {
    // Inside the backward only what it reads is rebuilt: values it keeps and the statistics it
    // reads (a post-norm's rstd); the final add and the output itself are not.
    if (recompute && st.op != sdk::StepOp::moe && st.stat < 0 && !lp.values[size_t(lp.root(st.out.value))].saved)
      continue;
    const ColsPtr in = st.in.valid() ? at(a, lp, st.in) : ColsPtr{nullptr, 0};
    const ColsPtr out = st.out.valid() ? at(a, lp, st.out) : ColsPtr{nullptr, 0};
    switch (st.op) {
      case sdk::StepOp::norm:
        ops->rmsnorm_fwd(sp_own(out.p, out.ld), out.ld, sp_own(a.stat[size_t(st.stat)], 1), sp_own(in.p, in.ld), in.ld,
                         w(st.weights[0]), R, st.in.width, float(st.eps), float(st.offset));
        break;
      case sdk::StepOp::head_norm:  // per head over head_dim; rstd [heads, N]
        for (int64_t h = 0; h < st.heads; ++h)
          ops->rmsnorm_fwd(out.p + h * st.head_dim, out.ld, a.stat[size_t(st.stat)] + h * N, in.p + h * st.head_dim,
                           in.ld, w(st.weights[0]), N, st.head_dim, float(st.eps), float(st.offset));
        break;
      case sdk::StepOp::linear: {
        // Sequence parallelism: a column-parallel linear reads every rank's rows.
        if (sp_on && st.tp_reduce_din) sp_gather(in.p, st.in.width);
        // Fused weights adjacent in storage run as one GEMM; otherwise one per piece.
        int64_t row = 0;
        for (size_t i = 0; i < st.weights.size();) {
          size_t j = i + 1;
          int64_t rows = desc.params[size_t(st.weights[i])].shape[0];
          while (j < st.weights.size() && offset[size_t(st.weights[j])] == offset[size_t(st.weights[i])] + rows * st.in.width) {
            rows += desc.params[size_t(st.weights[j])].shape[0];
            ++j;
          }
          ops->gemm(false, true, N, rows, st.in.width, 1.f, in.p, in.ld, w(st.weights[i]), st.in.width, 0.f,
                    out.p + row, out.ld);
          row += rows;
          i = j;
        }
        // Row-parallel (tensor parallelism): each rank's output is a partial sum over its
        // input columns. The output is a whole value, so N x width contiguous. Its bias (whole
        // on every rank) is added after the sum, so once.
        if (st.tp_reduce_out) {
          if (sp_on)
            sp_scatter(out.p, st.out.width);  // this rank's rows of the sum
          else
            tp_reduce(out.p, N * st.out.width);
        }
        row = 0;
        for (size_t i = 0; i < st.weights.size(); ++i) {
          const int64_t rows = desc.params[size_t(st.weights[i])].shape[0];
          if (st.biases[i] >= 0) {
            if (sp_on && st.tp_reduce_out)  // only this rank's rows of the sum are kept
              ops->bias_add_fwd(sp_own(out.p, out.ld) + row, out.ld, w(st.biases[i]), R, rows);
            else
              ops->bias_add_fwd(out.p + row, out.ld, w(st.biases[i]), N, rows);
          }
          row += rows;
        }
        break;
      }
      case sdk::StepOp::rope:
        apply_rope(st.table, in.p, in.ld, in.p, in.ld, st.heads, st.head_dim, mb, false);
        break;
      case sdk::StepOp::attention: {
        const ColsPtr k = at(a, lp, st.in2), v = at(a, lp, st.in3);
        if (cp_on)  // this rank's queries over the group's keys (cp_attention.cpp)
          cp_attention_fwd(st, out.p, out.ld, a.stat[size_t(st.stat)], in.p, in.ld, k.p, k.ld, v.p, v.ld);
        else
          ops->attention_fwd(out.p, out.ld, a.stat[size_t(st.stat)], in.p, in.ld, k.p, k.ld, v.p, v.ld,
                             mb.cu_seqlens.data(), S, N, st.hq, st.hkv, st.dk, st.dv, float(st.scale), st.window,
                             float(st.softcap));
        break;
      }
      case sdk::StepOp::glu:
        glu_fwd(st.act, out.p, out.ld, in.p, in.ld, N, st.out.width);
        break;
      case sdk::StepOp::add: {
        const ColsPtr b = at(a, lp, st.in2);  // whole values: contiguous N x width
        const int64_t W = st.out.width;
        ops->add_fwd(sp_own(out.p, W), sp_own(in.p, W), sp_own(b.p, W), R * W);
        break;
      }
      case sdk::StepOp::moe:
        // The router and the experts read every row (under moe_own_rows only a shared expert).
        if (sp_on && moe_reads_every_row(l)) sp_gather(in.p, st.in.width);
        forward_moe(l, mb, in.p, out.p, recompute);
        break;
      case sdk::StepOp::mla:
        if (sp_on) sp_gather(in.p, st.in.width);  // the latent projections read every row
        forward_mla(l, mb, in.p, at(a, lp, st.out2).p, out.p, a.stat[size_t(st.stat)]);
        break;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The whole forward: embedding, layers, final norm, head outputs (kernel alignment in `head`).

void Engine::Impl::forward(const MicroBatch& mb, const OutputRequest& req, bool save_all) {
  const int64_t N = mb.num_tokens();
  if (mb.cu_seqlens.empty() || N == 0)
    throw std::invalid_argument("engine: empty micro-batch");
  if (req.value && run_head && prog.value_head < 0)
    throw std::invalid_argument("engine: a value output was requested but the model has no value head (score.weight)");
  if (tp_on && req.processed_logprob && (req.top_k > 0 || req.top_p < 1))
    throw std::invalid_argument("engine: processed logprobs with top_k/top_p are not supported under tensor parallelism");
  if (tp_on && req.logits) throw std::invalid_argument("engine: logits are not an output under tensor parallelism");
  if ((cp_on || sp_on) && (req.logits || req.logprob_at_ids))
    throw std::invalid_argument("engine: logits and logprob_at_ids are not outputs under context or sequence parallelism");
  plan_acts(N, save_all, 1 + ids_per_token(mb, req));
  prepare_batch(mb, req);
  // Global positions and targets (mb is this rank's share, or padded, by cp_prepare).
  if (cp_on || sp_on) cp_positions();
  if (sp_on) sp_plan(N);
  prepare_routing(mb, req);
  const int32_t* ids = mb.input_ids.data();

  use_params(L);  // the global unit stays held until the backward (or Engine::forward) ends
  if (!run_embed) {
    // the previous stage's output (this rank's block of rows under sequence parallelism)
    std::memcpy(sp_own(xs[size_t(run_lo)], C), pp_x_in, size_t((sp_on ? sp_rows : N) * C) * sizeof(float));
  } else {
    if (tp_on)
      tp_embedding_fwd(xs[0], ids, N);  // this rank's rows, summed over the group
    else
      ops->embedding_fwd(xs[0], ids, w(prog.embed), N, C, V);  // x0 [N,C]
    if (prog.embed_scale != 1) ops->scale(xs[0], N * C, double(float(prog.embed_scale)));  // Gemma
  }
  for (int64_t l = run_lo; l < run_hi; ++l) {
    LayerActs a = acts_of(l);
    use_params(l);
    forward_layer(l, mb, a, false);
    drop_params(l);  // a UnitStore's unit: gathered again for the backward
  }
  if (!run_head) return;  // xs[run_hi] goes to the next pipeline stage
  ops->rmsnorm_fwd(sp_own(head.xn, C), C, sp_own(head.rstd, 1), sp_own(head.x, C), C, w(prog.final_norm),
                   sp_on ? sp_rows : N, C, float(prog.final_eps), float(prog.final_offset));  // xn [N,C]
  if (sp_on) sp_gather(head.xn, C);  // the vocabulary-parallel head reads every row

  // The value head: val [N] = xn [N,C] score [1,C]^T, one scalar per position (no shift).
  if (req.value) ops->gemm(false, true, N, 1, C, 1.f, head.xn, C, w(prog.value_head), C, 0.f, head.val, 1);

  if (tp_on) {
    // The vocabulary-parallel head; without a top-k / top-p filter the processed logprob is
    // the raw one (the head refuses a filter under tensor parallelism).
    if (req.logprob || req.entropy || req.logprob_at_ids || req.processed_logprob)
      tp_head_fwd(head.lp, head.lse, req.entropy ? head.ent : nullptr, target_raw, N, head.kraw, req.temperature);
    if (req.processed_logprob)
      for (int64_t t = 0; t < N; ++t) head.lp_proc[t] = head.lp[t * head.kraw];
    return;
  }
  LogprobAttrs raw;
  raw.temperature = req.temperature;
  raw.chunk_bytes = opt.logprob_chunk_bytes;
  raw.softcap = prog.logit_softcap;  // Gemma-2: capped before the temperature
  if (req.logprob || req.entropy || req.logprob_at_ids)
    ops->linear_logprob_fwd(head.lp, head.lse, req.entropy ? head.ent : nullptr, head.xn,
                            w(prog.head), target_raw, N, C, V, head.kraw, raw);  // lp [N,kraw]
  if (req.processed_logprob) {
    LogprobAttrs proc = raw;
    proc.top_k = req.top_k;
    proc.top_p = req.top_p;
    ops->linear_logprob_fwd(head.lp_proc, head.lse_proc, nullptr, head.xn, w(prog.head), target,
                            N, C, V, 1, proc);                                   // lp_proc [N]
  }
}

}  // namespace rlh::engine
