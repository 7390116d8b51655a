// The CUDA engine's tensor parallelism (CudaEngineOptions::tp; Megatron's, without sequence
// parallelism), as the CPU engine runs it (sdk/engine/src/forward.cpp, backward.cpp, tp_head.cpp):
// this rank's description (tp->local) and program, whose marks say where the group communicates.
//
//   row-parallel linear (o, down; LayerStep::tp_reduce_out): its GEMMs write an fp32 scratch, the
//     group sums it, one rounding to the bf16 output, then the bias (whole on every rank) once;
//   column-parallel linear (q|k|v, gate|up; tp_reduce_din): its input gradient, accumulated over
//     the fused groups in fp32, is summed likewise before it is rounded;
//   embedding: each rank looks up the ids in its vocabulary rows (zero elsewhere) in fp32 and the
//     group sums: exact, one rank contributes each row;
//   head: the registry's fused logprob op on this rank's rows with its local target gives per
//     token lse_r, entropy_r and the target's z (on its owner); one all-gather and a glue kernel
//     combine them (lse = logsumexp_r lse_r, E[z] = sum_r e^(lse_r - lse) (lse_r - entropy_r)).
//     The backward is the engine's own tile loop (a GEMM for the logits, a glue kernel for
//     d logits, two GEMMs): the op's backward drops a row whose target is < 0 entirely, while a
//     rank that does not hold the target still owes -dlogprob p_j, and its dh is bf16 where the
//     partial sums want fp32.
//
// Replicated tensors (the norms, a row-parallel linear's bias) get the same gradient on every
// rank without a reduction: without sequence parallelism every rank holds every row of the
// residual stream, and the values their gradients read (the norm inputs, d of the summed
// row-parallel outputs, d of the residual) are the group's sums, identical on every rank. The
// q/k norms see only this rank's heads: summed after the micro-batches (TpSplit::replicated_sum).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda_engine_impl.hpp"

namespace rlh::engine {

using sdk::StepOp;

void CudaEngine::Impl::tp_check() {
  tp_on = opt.tp != nullptr && opt.tp->size > 1;
  if (!tp_on) return;
  const sdk::TpLayout& T = *opt.tp;
  const auto refuse = [](const std::string& what) {
    throw std::invalid_argument("cuda engine: tensor parallelism with " + what + " is not supported");
  };
  if (opt.tp_comm == nullptr) throw std::invalid_argument("cuda engine: tensor parallelism needs its group (tp_comm)");
  if (opt.tp_comm->size() != T.size || opt.tp_comm->rank() != T.rank)
    throw std::invalid_argument("cuda engine: the tensor-parallel group is rank " + std::to_string(opt.tp_comm->rank()) +
                                " of " + std::to_string(opt.tp_comm->size()) + ", the layout rank " +
                                std::to_string(T.rank) + " of " + std::to_string(T.size));
  if (desc.params.size() != T.full.params.size())
    throw std::invalid_argument("cuda engine: the tensor-parallel layout is of another model");
  if (opt.shard_masters) refuse("FSDP (shard_masters)");
  if (opt.fp8.enabled) refuse("FP8 linears");
  if (opt.batch_invariant) refuse("batch_invariant (the group's fp32 sums are not the generator's products)");
  for (size_t i = 0; i < T.pieces.size(); ++i) {
    const sdk::TpPiece& pc = T.pieces[i];
    if (pc.split == sdk::TpSplit::kv_rows && pc.sum_grads)
      refuse("fewer key/value heads than ranks (" + T.full.params[i].name + " replicated over ranks)");
    if (pc.split != sdk::TpSplit::replicated && pc.split != sdk::TpSplit::replicated_sum &&
        pc.split != sdk::TpSplit::rows && pc.split != sdk::TpSplit::cols && pc.split != sdk::TpSplit::kv_rows &&
        pc.split != sdk::TpSplit::vocab_rows)
      refuse("MoE experts (" + T.full.params[i].name + ")");
  }
  if (T.vocab_count < 1) refuse("a rank holding no vocabulary rows (vocabulary " + std::to_string(T.vocab) + ")");
  for (const sdk::LayerDesc& l : T.full.layers) {
    if (l.mlp.kind == sdk::MlpKind::moe) refuse("MoE layers");
    if (l.attention.kind == sdk::AttentionKind::mla) refuse("MLA layers");
  }
  desc = T.local;
  tp_size = T.size;
  Vall = T.vocab;
  vlo = T.vocab_begin;
  vcount = T.vocab_count;
}

void CudaEngine::Impl::tp_check_program() {
  if (!tp_on) return;
  sdk::mark_tensor_parallel(prog, *opt.tp);
  if (prog.value_head >= 0) throw std::invalid_argument("cuda engine: tensor parallelism with a value head is not supported");
  tp_width = C;  // the embedding and the head's d input
  for (const sdk::LayerProgram& lp : prog.layers)
    for (const sdk::LayerStep& st : lp.steps) {
      if (st.op == StepOp::moe || st.op == StepOp::mla)
        throw std::invalid_argument("cuda engine: tensor parallelism with MoE and MLA layers is not supported");
      if (st.tp_reduce_out) tp_width = std::max(tp_width, st.out.width);
      if (st.tp_reduce_din) tp_width = std::max(tp_width, st.in.width);
    }
}

void CudaEngine::Impl::carve_tp(cuda::Carver& c, int64_t N, bool train) {
  if (!tp_on) return;
  tp32 = c.take<float>(N * tp_width);
  tp_target = c.take<int32_t>(N);
  tp_mine = c.take<float>(3 * N);
  tp_all = c.take<float>(3 * N * tp_size);
  // The backward's tile: rows of this rank's logits (f32) and their gradient (bf16) within the
  // head's tile budget.
  const int64_t budget = opt.logprob_chunk_bytes > 0 ? opt.logprob_chunk_bytes : int64_t(512) << 20;
  // (rows tp_ld apart: 16-byte rows in both, as the GEMMs' operands want them)
  tp_ld = (vcount + 7) / 8 * 8;
  tp_rows = std::clamp<int64_t>(budget / (std::max<int64_t>(tp_ld, 8) * 6), 1, std::max<int64_t>(N, 1));
  tp_tile = train ? c.take<float>(tp_rows * tp_ld) : nullptr;
  tp_dtile = train ? c.take<bf16>(tp_rows * tp_ld) : nullptr;
}

void CudaEngine::Impl::tp_embedding_fwd(int64_t N) {
  cuda::tp_embedding_fwd(tp32, ids, wp(prog.embed), N, C, vlo, vcount, stream);
  tp_sum(tp32, N * C);
  cuda::tp_store_bf16(xs[0], C, tp32, N, C, false, stream);
}

void CudaEngine::Impl::tp_embedding_bwd(const bf16* dres, int64_t N) {
  cuda::tp_embedding_bwd(gp(prog.embed), ids, dres, N, C, vlo, vcount, stream);
}

void CudaEngine::Impl::tp_head_fwd(const OutputRequest& req, int64_t N) {
  cuda::tp_local_target(tp_target, target, N, vlo, vcount, stream);
  cuda::DeviceOps::Logprob h = head_args(req, N, false);
  h.V = vcount;  // the block's padding rows (the last rank's) are no vocabulary
  h.target = tp_target;
  h.entropy = ent;  // always: the group's entropy and lse need every rank's
  h.cache = nullptr;
  ops->logprob_fwd(h);
  cuda::tp_head_pack(tp_mine, lp, lse, ent, tp_target, N, stream);
  tp_timed(3 * N * 4 * (tp_size - 1), [&] { opt.tp_comm->all_gather(tp_mine, tp_all, 3 * N, 4, stream); });
  cuda::tp_head_combine(tp_all, tp_size, target, N, lp, lse, ent, stream);
}

void CudaEngine::Impl::tp_head_bwd(const OutputRequest& req, int64_t N) {
  const float inv_t = float(1.0 / req.temperature), cap = float(prog.logit_softcap);
  const bf16* W = wp(prog.head);
  float* dW = gp(prog.head);
  for (int64_t n0 = 0; n0 < N; n0 += tp_rows) {
    const int64_t rows = std::min(tp_rows, N - n0);
    const bf16* h = xn + n0 * C;
    ops->gemm(false, true, rows, vcount, C, h, C, W, C, 0, tp_tile, tp_ld, true);  // raw products
    cuda::tp_head_grad_tile(tp_tile, tp_dtile, tp_ld, rows, vcount, n0, target, vlo, lse, ent, dlp,
                            req.entropy ? dent : nullptr, inv_t, cap, stream);
    ops->gemm(false, false, rows, C, vcount, tp_dtile, tp_ld, W, C, 0, tp32 + n0 * C, C, true);  // partial dh
    ops->gemm(true, false, vcount, C, rows, tp_dtile, tp_ld, h, C, 1, dW, C, true);
  }
  tp_sum(tp32, N * C);
  cuda::tp_store_bf16(dxn, C, tp32, N, C, false, stream);
}

void CudaEngine::Impl::tp_sync_grads() {
  if (!tp_on) return;
  for (size_t i = 0; i < desc.params.size(); ++i)
    if (opt.tp->pieces[i].sum_grads) tp_sum(gp(int64_t(i)), place[i].piece);  // replicated_sum (q/k norms)
}

}  // namespace rlh::engine
