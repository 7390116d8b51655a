// The CUDA engine under data parallelism (CudaEngineOptions::dp): the gradient reduction after
// the backward, Megatron's distributed optimizer (AdamW on this rank's block of the flat
// storage, then the updated weights gathered) and dtensor's FSDP (the same blocks, the fp32
// masters kept as this rank's block too, only the bf16 copy gathered; HSDP sums the gradient
// blocks over the replicas as well). The collectives are the backend's (DeviceDpComm); this
// file decides what moves and where it lands.
//
// Why blocks of the flat storage and not whole tensors: the reduce-scatter and the all-gather
// then move equal contiguous blocks (what NCCL wants), a tensor cut by a block boundary is
// simply two pieces in the AdamW lists, and the CPU backend's distributed optimizer cuts the
// same way (backend_common's ShardLayout), so both shard alike.
#include <algorithm>

#include "cuda_engine_impl.hpp"

namespace rlh::engine {

using cuda::check;

std::vector<CudaEngine::Impl::Piece> CudaEngine::Impl::optimizer_pieces() const {
  std::vector<Piece> out;
  const bool shard = sharded();
  const int64_t lo = shard ? shard_lo : 0, hi = shard ? shard_lo + block : total;
  for (const Range& r : storage_ranges()) {
    const sdk::ParamDesc& pd = desc.params[r.param];
    if (!pd.trainable || router_frozen(pd.role)) continue;  // a frozen router is a buffer
    const int64_t a = std::max(r.off, lo), b = std::min(r.off + r.n, hi);
    if (a >= b) continue;
    out.push_back({a, a - (shard ? lo : 0), b - a, r.param});
  }
  return out;
}

void CudaEngine::Impl::sync_gradients() {
  const int S = dp_size;
  if (!sharded()) {
    // Ring all-reduce: 2 (S-1)/S of the buffer sent per rank.
    dp_timed(2 * total * 4 * (S - 1) / S, [&] { opt.dp->all_reduce_sum(grads.get<float>(), total, stream); });
    return;
  }
  dp_timed(block * S * 4 * (S - 1) / S,
           [&] { opt.dp->reduce_scatter_sum(grads.get<float>(), gshard.get<float>(), block, stream); });
  // HSDP: the replicas of this shard hold other ranks' sums of the same block.
  if (opt.dp_replicate != nullptr && opt.dp_replicate->size() > 1) {
    const int R = opt.dp_replicate->size();
    dp_timed(2 * block * 4 * (R - 1) / R,
             [&] { opt.dp_replicate->all_reduce_sum(gshard.get<float>(), block, stream); });
  }
  // The full buffer is spent: clear it now so the next step accumulates from zero (the
  // update clears gshard as it reads it).
  check(cudaMemsetAsync(grads.get(), 0, grads.size(), stream), "memset");
}

void CudaEngine::Impl::gather_weights() {
  const int S = dp_size;
  if (fsdp()) {
    // FSDP: only the bf16 copy is whole (2 bytes a parameter moved), and the router's fp32
    // side copy follows its updated masters.
    dp_timed(block * S * 2 * (S - 1) / S,
             [&] { opt.dp->all_gather(master_bf16() + shard_lo, master_bf16(), block, 2, stream); });
    kept_from_blocks();
    return;
  }
  // Every rank's updated block of the fp32 masters and of their bf16 copy (6 bytes a
  // parameter; the copy is gathered rather than recomputed so all ranks hold identical bits).
  dp_timed(block * S * 4 * (S - 1) / S,
           [&] { opt.dp->all_gather(master.get<float>() + shard_lo, master.get<float>(), block, 4, stream); });
  dp_timed(block * S * 2 * (S - 1) / S,
           [&] { opt.dp->all_gather(master_bf16() + shard_lo, master_bf16(), block, 2, stream); });
}

void CudaEngine::Impl::gather_moment(const float* shard) {
  check(cudaMemcpyAsync(grads.get<float>() + shard_lo, shard, size_t(block) * 4, cudaMemcpyDefault, stream), "copy");
  dp_timed(block * dp_size * 4 * (dp_size - 1) / dp_size,
           [&] { opt.dp->all_gather(grads.get<float>() + shard_lo, grads.get<float>(), block, 4, stream); });
}

void CudaEngine::Impl::scatter_moment(float* shard) {
  check(cudaMemcpyAsync(shard, grads.get<float>() + shard_lo, size_t(block) * 4, cudaMemcpyDefault, stream), "copy");
}

// ---------------------------------------------------------------------------------------------
// FSDP: the masters as this rank's block (and the offloaded masters' side copy)

void CudaEngine::Impl::plan_kept() {
  // The MoE router reads these fp32 tensors from the masters (moe_layer.cpp): the router's
  // bias and the selection bias always, the router weight itself when it runs in fp64.
  kept.clear();
  kept_elems = 0;
  const auto keep = [&](int64_t off, int64_t n) {
    if (off < 0 || n <= 0) return;
    kept.push_back({off, n, kept_elems});
    kept_elems += (n + 63) / 64 * 64;
  };
  for (int64_t l = 0; l < L; ++l) {
    const LayerShape& s = shapes[size_t(l)];
    if (!s.moe) continue;
    const LayerOffsets& o = lo[size_t(l)];
    if (opt.moe.router_fp64) keep(o.router, s.E * C);
    keep(o.router_b, s.E);
    keep(o.score_bias, s.E);
  }
  if (kept_elems > 0) kept32 = cuda::DeviceBuffer(counters, size_t(kept_elems) * sizeof(float));
}

void CudaEngine::Impl::kept_from_whole(const float* whole) {
  for (const Kept& k : kept)
    check(cudaMemcpyAsync(kept32.get<float>() + k.at, whole + k.off, size_t(k.n) * 4, cudaMemcpyDefault, stream),
          "copy");
}

void CudaEngine::Impl::kept_from_blocks() {
  if (kept_elems == 0) return;  // the same answer on every rank: no collective
  // Each element lies in exactly one rank's block: that rank writes it, the others zeros, and
  // the sum is the value (x + 0 = x exactly; only a -0.0 would come back as +0.0).
  check(cudaMemsetAsync(kept32.get(), 0, kept32.size(), stream), "memset");
  for (const Kept& k : kept) {
    const int64_t a = std::max(k.off, shard_lo), b = std::min(k.off + k.n, shard_lo + block);
    if (a >= b) continue;
    check(cudaMemcpyAsync(kept32.get<float>() + k.at + (a - k.off), master32() + (a - shard_lo),
                          size_t(b - a) * 4, cudaMemcpyDefault, stream), "copy");
  }
  const int S = dp_size;
  dp_timed(2 * kept_elems * 4 * (S - 1) / S, [&] { opt.dp->all_reduce_sum(kept32.get<float>(), kept_elems, stream); });
}

void CudaEngine::Impl::gather_masters() {
  const int S = dp_size;
  if (offload()) {  // the host block uploaded into its place, then gathered in place
    check(cudaMemcpyAsync(grads.get<float>() + shard_lo, h_master.get(), size_t(block) * 4, cudaMemcpyDefault, stream),
          "upload");
    dp_timed(block * S * 4 * (S - 1) / S,
             [&] { opt.dp->all_gather(grads.get<float>() + shard_lo, grads.get<float>(), block, 4, stream); });
    return;
  }
  dp_timed(block * S * 4 * (S - 1) / S,
           [&] { opt.dp->all_gather(master.get<float>(), grads.get<float>(), block, 4, stream); });
}

}  // namespace rlh::engine
