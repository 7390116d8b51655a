// The CUDA engine under data parallelism (CudaEngineOptions::dp): the gradient reduction after
// the backward, and Megatron's distributed optimizer (AdamW on this rank's block of the flat
// storage, then the updated weights gathered). The collectives are the backend's
// (DeviceDpComm); this file decides what moves and where it lands.
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
  // The full buffer is spent: clear it now so the next step accumulates from zero (the
  // update clears gshard as it reads it).
  check(cudaMemsetAsync(grads.get(), 0, grads.size(), stream), "memset");
}

void CudaEngine::Impl::gather_weights() {
  const int S = dp_size;
  // Every rank's updated block of the fp32 masters and of their bf16 copy (6 bytes a
  // parameter; the copy is gathered rather than recomputed so all ranks hold identical bits).
  dp_timed(block * S * 4 * (S - 1) / S,
           [&] { opt.dp->all_gather(master.get<float>() + shard_lo, master.get<float>(), block, 4, stream); });
  dp_timed(block * S * 2 * (S - 1) / S,
           [&] { opt.dp->all_gather(master_bf16() + shard_lo, master_bf16(), block, 2, stream); });
}

void CudaEngine::Impl::gather_moment(const cuda::DeviceBuffer& shard) {
  check(cudaMemcpyAsync(grads.get<float>() + shard_lo, shard.get(), size_t(block) * 4, cudaMemcpyDeviceToDevice, stream),
        "copy");
  dp_timed(block * dp_size * 4 * (dp_size - 1) / dp_size,
           [&] { opt.dp->all_gather(grads.get<float>() + shard_lo, grads.get<float>(), block, 4, stream); });
}

void CudaEngine::Impl::scatter_moment(cuda::DeviceBuffer& shard) {
  check(cudaMemcpyAsync(shard.get(), grads.get<float>() + shard_lo, size_t(block) * 4, cudaMemcpyDeviceToDevice, stream),
        "copy");
}

}  // namespace rlh::engine
