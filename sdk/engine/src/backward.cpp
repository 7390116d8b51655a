// The backward pass: the forward's program steps in reverse, one kernel call per step.
// Parameter gradients accumulate (+=) into the gradient storage, so micro-batches add up;
// activation gradients flow through the program's gradient buffers (gbuf), each written by the
// first step that produces it and accumulated by the rest, as the program planned
// (LayerStep::accumulate*). gbuf[0] carries d loss / d residual stream from the head down to
// the embedding: the residual adds pass it on unchanged.
#include "model.hpp"

#include <cstring>

namespace rlh::engine {

namespace {

struct ColsPtr {
  float* p;
  int64_t ld;
};

}  // namespace

// gbuf[0] holds d loss / d (layer output) on entry and d loss / d (layer input) on exit.
void Engine::Impl::backward_layer(int64_t l, const MicroBatch& mb, LayerActs& a) {
  const sdk::LayerProgram& lp = prog.layers[size_t(l)];
  const int64_t N = mb.num_tokens(), S = mb.num_sequences();
  const int64_t R = sp_on ? sp_rows : N;  // rows of the residual regions on this rank
  auto val = [&](const sdk::Cols& c) {
    return ColsPtr{a.v[size_t(c.value)] + c.col, lp.values[size_t(c.value)].width};
  };
  auto grad = [&](const sdk::Cols& c) {
    const sdk::LayerValue& v = lp.values[size_t(c.value)];
    return ColsPtr{gbuf[size_t(v.grad)] + c.col, v.width};
  };
  for (auto it = lp.steps.rbegin(); it != lp.steps.rend(); ++it) {
    const sdk::LayerStep& st = *it;
    switch (st.op) {
      case sdk::StepOp::add:
        break;  // both operands take the output's gradient buffer as it is
      case sdk::StepOp::norm: {
        const ColsPtr x = val(st.in), dy = grad(st.out), dx = grad(st.in);
        ops->rmsnorm_bwd(sp_own(dx.p, dx.ld), dx.ld, g(st.weights[0]), sp_own(dy.p, dy.ld), dy.ld, sp_own(x.p, x.ld), x.ld,
                         w(st.weights[0]), sp_own(a.stat[size_t(st.stat)], 1), R, st.in.width, float(st.offset),
                         st.accumulate);
        break;
      }
      case sdk::StepOp::head_norm: {
        const ColsPtr x = val(st.in), dy = grad(st.out), dx = grad(st.in);
        for (int64_t h = 0; h < st.heads; ++h)
          ops->rmsnorm_bwd(dx.p + h * st.head_dim, dx.ld, g(st.weights[0]), dy.p + h * st.head_dim, dy.ld,
                           x.p + h * st.head_dim, x.ld, w(st.weights[0]), a.stat[size_t(st.stat)] + h * N, N,
                           st.head_dim, float(st.offset), st.accumulate);
        break;
      }
      case sdk::StepOp::linear: {
        const ColsPtr x = val(st.in), dy = grad(st.out), dx = grad(st.in);
        const int64_t K = st.in.width;
        // Sequence parallelism: a row-parallel linear's output gradient from every rank's rows.
        if (sp_on && st.tp_reduce_out) sp_gather(dy.p, st.out.width);
        int64_t row = 0;
        for (size_t i = 0; i < st.weights.size(); ++i) {
          const int64_t rows = desc.params[size_t(st.weights[i])].shape[0];
          if (st.biases[i] >= 0) {
            // Sequence parallelism: a row-parallel bias's gradient from this rank's rows, summed
            // over the group with the norms' (tp_sync_grads).
            if (sp_on && st.tp_reduce_out)
              ops->bias_bwd(g(st.biases[i]), sp_own(dy.p, dy.ld) + row, dy.ld, R, rows);
            else
              ops->bias_bwd(g(st.biases[i]), dy.p + row, dy.ld, N, rows);
          }
          row += rows;
        }
        // dX (+)= dY W over the fused rows (one GEMM when adjacent), dW += dY^T X per group.
        row = 0;
        bool first = true;
        for (size_t i = 0; i < st.weights.size();) {
          size_t j = i + 1;
          int64_t rows = desc.params[size_t(st.weights[i])].shape[0];
          while (j < st.weights.size() && offset[size_t(st.weights[j])] == offset[size_t(st.weights[i])] + rows * K) {
            rows += desc.params[size_t(st.weights[j])].shape[0];
            ++j;
          }
          ops->gemm(false, false, N, K, rows, 1.f, dy.p + row, dy.ld, w(st.weights[i]), K,
                    (st.accumulate || !first) ? 1.f : 0.f, dx.p, dx.ld);
          ops->gemm(true, false, rows, K, N, 1.f, dy.p + row, dy.ld, x.p, x.ld, 1.f, g(st.weights[i]), K);
          first = false;
          row += rows;
          i = j;
        }
        // Column-parallel (tensor parallelism): each rank's d input covers its output rows only.
        if (st.tp_reduce_din) {
          if (sp_on)
            sp_scatter(dx.p, st.in.width);
          else
            tp_reduce(dx.p, N * st.in.width);
        }
        break;
      }
      case sdk::StepOp::rope: {
        const ColsPtr d = grad(st.in);  // the transposed rotation, in place
        apply_rope(st.table, d.p, d.ld, d.p, d.ld, st.heads, st.head_dim, mb, true);
        break;
      }
      case sdk::StepOp::attention: {
        const ColsPtr q = val(st.in), k = val(st.in2), v = val(st.in3), o = val(st.out);
        const ColsPtr dq = grad(st.in), dk = grad(st.in2), dv = grad(st.in3), dout = grad(st.out);
        if (cp_on)
          cp_attention_bwd(st, dq.p, dq.ld, dk.p, dk.ld, dv.p, dv.ld, dout.p, dout.ld, q.p, q.ld, k.p, k.ld, v.p, v.ld,
                           o.p, o.ld, a.stat[size_t(st.stat)]);
        else
          ops->attention_bwd(dq.p, dq.ld, dk.p, dk.ld, dv.p, dv.ld, dout.p, dout.ld, q.p, q.ld, k.p, k.ld, v.p, v.ld,
                             o.p, o.ld, a.stat[size_t(st.stat)], mb.cu_seqlens.data(), S, N, st.hq, st.hkv, st.dk,
                             st.dv, float(st.scale), st.window, float(st.softcap));
        break;
      }
      case sdk::StepOp::glu: {
        const ColsPtr gu = val(st.in), dh = grad(st.out), dgu = grad(st.in);
        glu_bwd(st.act, dgu.p, dgu.ld, dh.p, dh.ld, gu.p, gu.ld, N, st.out.width);
        break;
      }
      case sdk::StepOp::moe:
        if (sp_on && moe_reads_every_row(l))  // d out of every row (its own rows on each rank)
          sp_gather(grad(st.out).p, st.out.width);
        backward_moe(l, mb, val(st.in).p, grad(st.out).p, grad(st.in).p, st.accumulate);
        break;
      case sdk::StepOp::mla:
        backward_mla(l, mb, val(st.in).p, val(st.out2).p, val(st.out).p, a.stat[size_t(st.stat)],
                     grad(st.out).p, grad(st.in).p, st.accumulate);
        if (st.tp_reduce_din) {  // this rank's heads' part
          if (sp_on)
            sp_scatter(grad(st.in).p, st.in.width);
          else
            tp_reduce(grad(st.in).p, N * st.in.width);
        }
        break;
    }
  }
}

// Output gradients are in head.dlp / dent / dlp_proc (kernel alignment).
void Engine::Impl::backward(const MicroBatch& mb, const OutputRequest& req) {
  const int64_t N = mb.num_tokens();
  float* dres = gbuf[0];
  float* dxn = head.dxn;

  // Head: dxn [N,C] from the requested outputs; d lm_head accumulated (into d embed when tied).
  LogprobAttrs raw;
  raw.temperature = req.temperature;
  raw.chunk_bytes = opt.logprob_chunk_bytes;
  raw.softcap = prog.logit_softcap;
  bool have_dxn = false;
  use_grads(L);
  if (!run_head) {
    // from the next pipeline stage (this rank's block of rows under sequence parallelism)
    std::memcpy(sp_own(dres, C), pp_dy, size_t((sp_on ? sp_rows : N) * C) * sizeof(float));
  } else if (tp_on) {
    // One vocabulary-parallel backward for the raw outputs; the unfiltered processed logprob
    // is the raw one, so its gradient adds to the next token's.
    if (req.processed_logprob)
      for (int64_t t = 0; t < N; ++t) head.dlp[t * head.kraw] += head.dlp_proc[t];
    tp_head_bwd(dxn, head.dlp, req.entropy ? head.dent : nullptr, target_raw, head.lse, req.entropy ? head.ent : nullptr, N,
                head.kraw, req.temperature);
    have_dxn = true;
  } else if (req.logprob || req.entropy || req.logprob_at_ids) {
    ops->linear_logprob_bwd(dxn, g(prog.head), head.dlp, req.entropy ? head.dent : nullptr, head.xn, w(prog.head),
                            target_raw, head.lse, req.entropy ? head.ent : nullptr, N, C, V, head.kraw, raw,
                            false);
    have_dxn = true;
  }
  if (req.processed_logprob && !tp_on && run_head) {
    LogprobAttrs proc = raw;
    proc.top_k = req.top_k;
    proc.top_p = req.top_p;
    ops->linear_logprob_bwd(dxn, g(prog.head), head.dlp_proc, nullptr, head.xn, w(prog.head), target,
                            head.lse_proc, nullptr, N, C, V, 1, proc, have_dxn);
    have_dxn = true;
  }
  if (req.value && run_head) {
    // val = xn score^T: d xn += dval score, d score += dval^T xn (accumulated over micro-batches).
    ops->gemm(false, false, N, C, 1, 1.f, head.dval, 1, w(prog.value_head), C, have_dxn ? 1.f : 0.f, dxn, C);
    ops->gemm(true, false, 1, C, N, 1.f, head.dval, 1, head.xn, C, 1.f, g(prog.value_head), C);
    have_dxn = true;
  }
  if (run_head)
    ops->rmsnorm_bwd(sp_own(dres, C), C, g(prog.final_norm), sp_own(dxn, C), C, sp_own(head.x, C), C,
                     w(prog.final_norm), sp_own(head.rstd, 1), sp_on ? sp_rows : N, C, float(prog.final_offset),
                     false);  // dres = d x_L

  for (int64_t l = run_hi - 1; l >= run_lo; --l) {
    LayerActs a = acts_of(l);
    use_params(l);
    use_grads(l);
    if (!acts_saved_all) forward_layer(l, mb, a, true);  // recompute from the layer input
    backward_layer(l, mb, a);
    drop_grads(l);  // a UnitStore reduces them away here
    drop_params(l);
  }
  if (!run_embed) {
    std::memcpy(pp_dx, sp_own(dres, C), size_t((sp_on ? sp_rows : N) * C) * sizeof(float));  // to the previous stage
  } else {
    if (prog.embed_scale != 1) ops->scale(dres, N * C, double(float(prog.embed_scale)));
    if (sp_on) sp_gather(dres, C);  // the lookup's gradient for every row
    if (tp_on)
      tp_embedding_bwd(mb.input_ids.data(), dres, N);
    else
      ops->embedding_bwd(g(prog.embed), mb.input_ids.data(), dres, N, C, V);
  }
  drop_grads(L);
  drop_params(L);
}

}  // namespace rlh::engine
