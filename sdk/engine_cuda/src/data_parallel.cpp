// The CUDA engine under data parallelism (CudaEngineOptions::dp): the gradient reduction after
// the backward, Megatron's distributed optimizer (AdamW on this rank's block of the flat
// storage, then the updated weights gathered) and dtensor's FSDP (ZeRO-3: every unit's
// parameters, gradients and AdamW state kept as this rank's block of it; a unit's bf16 weights
// all-gathered into a staging slot before it runs, its gradients reduce-scattered after its
// backward; HSDP sums the gradient blocks over the replicas as well). The collectives are the
// backend's (DeviceDpComm); this file decides what moves and where it lands.
//
// Why blocks of the flat storage and not whole tensors: the reduce-scatter and the all-gather
// then move equal contiguous blocks (what NCCL wants), a tensor cut by a block boundary is
// simply two pieces in the AdamW lists, and the CPU backend cuts the same way (backend_common's
// ShardLayout: one segment for the distributed optimizer, one per unit for FSDP).
//
// FSDP's units follow FSDP2 as torchtitan wraps a decoder: one per layer, resharded after its
// forward and gathered again for its backward, and the root (embedding, final norm, head) held
// from the first micro-batch's forward to the end of the step, its gradients reduced once per
// step. Layer gradients are reduced after every micro-batch's backward (FSDP2 with gradient sync
// on each micro-batch; NeMo-RL's defer_fsdp_grad_sync would keep them whole instead, which is
// the memory this mode exists to save), so a rank holds 2 + 4 bytes of two layers and of the
// root beside its 2/S + 16/S bytes a parameter.
//
// Overlap: the collectives run on their own stream (fsdp_comm_stream), each slot's use fenced by
// events, so layer l + 1's gather runs during layer l's forward, and in the backward layer
// l - 1's gather and layer l + 1's reduce-scatter during layer l's. The reduce-scatter is issued
// one layer late on purpose: a communicator that blocks the host (comm_mpi's staging) then waits
// for work the GPU finished while it computes the next layer, instead of idling it (comm_nccl,
// too, returns once its collective is done). Whenever the
// two streams hand over (a call's first gather, the step's last reduction, a call's end) one
// waits for the other, so every collective of a communicator runs in issue order, as NCCL needs.
#include <algorithm>
#include <vector>

#include "cuda_engine_impl.hpp"

namespace rlh::engine {

using cuda::check;

std::vector<CudaEngine::Impl::Piece> CudaEngine::Impl::optimizer_pieces() const {
  std::vector<Piece> out;
  const bool shard = sharded();
  for (const Range& r : storage_ranges()) {
    const sdk::ParamDesc& pd = desc.params[r.param];
    if (!pd.trainable || router_frozen(pd.role)) continue;  // a frozen router is a buffer
    // This rank's part of the range: of its unit's block (FSDP), of its block of the whole
    // storage (distributed optimizer), or all of it; `origin` is where that part starts locally.
    int64_t lo = 0, hi = total, origin = 0;
    if (fsdp()) {
      const size_t u = unit_of(r.off);
      lo = mine_lo(u);
      hi = lo + units[u].block;
      origin = units[u].at;
    } else if (shard) {
      lo = shard_lo;
      hi = shard_lo + block;
    }
    const int64_t a = std::max(r.off, lo), b = std::min(r.off + r.n, hi);
    if (a >= b) continue;
    out.push_back({a, origin + (a - (shard ? lo : 0)), b - a, r.param});
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
  if (fsdp()) {
    reduce_root_grads();  // summed over the step's micro-batches (the layers' were reduced after each)
  } else {
    dp_timed(block * S * 4 * (S - 1) / S,
             [&] { opt.dp->reduce_scatter_sum(grads.get<float>(), gshard.get<float>(), block, stream); });
    // The full buffer is spent: clear it now so the next step accumulates from zero (the
    // update clears gshard as it reads it).
    check(cudaMemsetAsync(grads.get(), 0, grads.size(), stream), "memset");
  }
  // HSDP: the replicas of this shard hold other ranks' sums of the same block.
  if (opt.dp_replicate != nullptr && opt.dp_replicate->size() > 1) {
    const int R = opt.dp_replicate->size();
    dp_timed(2 * block * 4 * (R - 1) / R,
             [&] { opt.dp_replicate->all_reduce_sum(gshard.get<float>(), block, stream); });
  }
}

void CudaEngine::Impl::gather_weights() {
  const int S = dp_size;
  if (fsdp()) {
    // FSDP: AdamW wrote this rank's bf16 blocks with its masters; the units are gathered when
    // they next run. Only the router's fp32 side copy follows the updated masters now.
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

void CudaEngine::Impl::kept_from_whole(const float* whole, int64_t origin, int64_t end) {
  for (const Kept& k : kept) {
    if (k.off < origin || (end >= 0 && k.off >= end)) continue;  // another unit's
    check(cudaMemcpyAsync(kept32.get<float>() + k.at, whole + (k.off - origin), size_t(k.n) * 4, cudaMemcpyDefault,
                          stream), "copy");
  }
}

void CudaEngine::Impl::kept_from_blocks() {
  if (kept_elems == 0) return;  // the same answer on every rank: no collective
  // Each element lies in exactly one rank's block: that rank writes it, the others zeros, and
  // the sum is the value (x + 0 = x exactly; only a -0.0 would come back as +0.0).
  check(cudaMemsetAsync(kept32.get(), 0, kept32.size(), stream), "memset");
  for (const Kept& k : kept) {
    const size_t u = unit_of(k.off);
    const int64_t lo = mine_lo(u);
    const int64_t a = std::max(k.off, lo), b = std::min(k.off + k.n, lo + units[u].block);
    if (a >= b) continue;
    check(cudaMemcpyAsync(kept32.get<float>() + k.at + (a - k.off), master32() + units[u].at + (a - lo),
                          size_t(b - a) * 4, cudaMemcpyDefault, stream), "copy");
  }
  const int S = dp_size;
  dp_timed(2 * kept_elems * 4 * (S - 1) / S, [&] { opt.dp->all_reduce_sum(kept32.get<float>(), kept_elems, stream); });
}

// ---------------------------------------------------------------------------------------------
// FSDP's units

void CudaEngine::Impl::plan_units() {
  // The stages: the root's slot, then two layer slots (a layer runs while the next one is
  // gathered, or the previous one's gradients are reduced); one block reduced at a time.
  int64_t layer_slot = 0, widest = 0;
  for (int64_t u = 0; u <= L; ++u) {
    widest = std::max(widest, units[size_t(u)].block);
    if (u < L) layer_slot = std::max(layer_slot, units[size_t(u)].block * dp_size);
  }
  layer_slot_elems = layer_slot;
  const int64_t slots = units[size_t(L)].block * dp_size + (L > 1 ? 2 : 1) * layer_slot;  // (one layer: one slot)
  wstage = cuda::DeviceBuffer(counters, size_t(slots) * sizeof(bf16));
  gstage = cuda::DeviceBuffer(counters, size_t(slots) * sizeof(float));
  gred = cuda::DeviceBuffer(counters, size_t(widest) * sizeof(float));
  counts = cuda::DeviceBuffer(counters, size_t(dp_size) * sizeof(float));
  unit_params.assign(size_t(L + 1), {});
  for (size_t i = 0; i < place.size(); ++i) unit_params[unit_of(place[i].off)].push_back(i);
  if (opt.fsdp_comm_stream) check(cudaStreamCreateWithFlags(&cstream, cudaStreamNonBlocking), "cudaStreamCreate");
  for (cudaEvent_t* e : {&ev_ready[0], &ev_ready[1], &ev_free[0], &ev_free[1], &ev_gdone[0], &ev_gdone[1],
                         &ev_rsdone[0], &ev_rsdone[1], &ev_root, &ev_compute, &ev_comm})
    check(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreate");
}

void CudaEngine::Impl::release_units(bool loud) {
  gathered[0] = gathered[1] = grad_in[0] = grad_in[1] = pending_rs = -1;
  held_global = grad_global = false;
  // Nothing the collectives' stream still does may overlap what the compute stream does next
  // (an update writes the blocks a gather reads; a load refills them).
  if (cstream == nullptr) return;
  const cudaError_t a = cudaEventRecord(ev_comm, cstream);
  const cudaError_t b = a == cudaSuccess ? cudaStreamWaitEvent(stream, ev_comm, 0) : a;
  if (loud) check(b, "ordering the compute stream after the collectives");
}

void CudaEngine::Impl::gather_unit(size_t u, bf16* slot, cudaEvent_t after, cudaEvent_t done) {
  const Unit& U = units[u];
  const int S = dp_size;
  cudaStream_t cs = comm_stream();
  if (after != nullptr) check(cudaStreamWaitEvent(cs, after, 0), "wait");  // the slot's last reader is done
  dp_timed(U.block * S * 2 * (S - 1) / S, [&] { opt.dp->all_gather(master_bf16() + U.at, slot, U.block, 2, cs); });
  check(cudaEventRecord(done, cs), "event");
}

void CudaEngine::Impl::hold_global() {
  if (held_global) return;
  // The first collective of a call: what the compute stream wrote before it (an update, a load)
  // is in the blocks the gathers read.
  check(cudaEventRecord(ev_compute, stream), "event");
  check(cudaStreamWaitEvent(comm_stream(), ev_compute, 0), "wait");
  gather_unit(size_t(L), wstage.get<bf16>() + slot_of(size_t(L)), nullptr, ev_root);
  check(cudaStreamWaitEvent(stream, ev_root, 0), "wait");
  held_global = true;
}

void CudaEngine::Impl::prefetch_layer(int64_t l) {
  const int p = int(l % 2);
  if (l < 0 || l >= L || gathered[p] == l) return;  // none, or still in its slot
  gather_unit(size_t(l), wstage.get<bf16>() + slot_of(size_t(l)), ev_free[p], ev_ready[p]);
  gathered[p] = l;
}

void CudaEngine::Impl::hold_layer(int64_t l) {
  prefetch_layer(l);  // (a gather now where no prefetch came before it)
  check(cudaStreamWaitEvent(stream, ev_ready[l % 2], 0), "wait");
}

void CudaEngine::Impl::layer_forward_end(int64_t l) {
  check(cudaEventRecord(ev_free[l % 2], stream), "event");  // its slot's readers so far
  prefetch_layer(l + 1);
}

void CudaEngine::Impl::layer_backward_begin(int64_t l) {
  hold_layer(l);
  const int q = int(l % 2);
  // The slot's previous layer (l + 2) is reduced (its reduce-scatter was issued after l + 1).
  check(cudaStreamWaitEvent(stream, ev_rsdone[q], 0), "wait");
  check(cudaMemsetAsync(gstage.get<float>() + slot_of(size_t(l)), 0, size_t(units[size_t(l)].block * dp_size) * 4,
                        stream), "memset");
  grad_in[q] = l;
}

void CudaEngine::Impl::layer_backward_end(int64_t l) {
  const int q = int(l % 2);
  check(cudaEventRecord(ev_free[q], stream), "event");
  check(cudaEventRecord(ev_gdone[q], stream), "event");
  // Layer l - 1 gathered (the next backward needs it first), then, one layer behind, layer
  // l + 1's gradients reduced: both while layer l's backward runs (a blocking communicator then
  // waits only for work already done).
  prefetch_layer(l - 1);
  if (pending_rs >= 0) reduce_layer(pending_rs);
  pending_rs = l;
}

void CudaEngine::Impl::backward_units_end() {
  if (pending_rs >= 0) reduce_layer(pending_rs);
  pending_rs = -1;
}

void CudaEngine::Impl::reduce_layer(int64_t l) {
  const int q = int(l % 2);
  const Unit& U = units[size_t(l)];
  const int S = dp_size;
  cudaStream_t cs = comm_stream();
  check(cudaStreamWaitEvent(cs, ev_gdone[q], 0), "wait");
  dp_timed(U.block * S * 4 * (S - 1) / S, [&] {
    opt.dp->reduce_scatter_sum(gstage.get<float>() + slot_of(size_t(l)), gred.get<float>(), U.block, cs);
  });
  cuda::add_f32(gshard.get<float>() + U.at, gred.get<float>(), U.block, cs);  // micro-batches accumulate
  check(cudaEventRecord(ev_rsdone[q], cs), "event");
  if (grad_in[q] == l) grad_in[q] = -1;
}

void CudaEngine::Impl::open_root_grads() {
  const Unit& U = units[size_t(L)];
  check(cudaMemsetAsync(gstage.get<float>() + slot_of(size_t(L)), 0, size_t(U.block * dp_size) * 4, stream), "memset");
  grad_global = true;
}

void CudaEngine::Impl::reduce_root_grads() {
  const Unit& U = units[size_t(L)];
  const int S = dp_size;
  cudaStream_t cs = comm_stream();
  check(cudaEventRecord(ev_compute, stream), "event");  // the step's last backward wrote them
  check(cudaStreamWaitEvent(cs, ev_compute, 0), "wait");
  dp_timed(U.block * S * 4 * (S - 1) / S, [&] {
    opt.dp->reduce_scatter_sum(gstage.get<float>() + slot_of(size_t(L)), gred.get<float>(), U.block, cs);
  });
  cuda::add_f32(gshard.get<float>() + U.at, gred.get<float>(), U.block, cs);
  // The gradient blocks are complete: the norm, HSDP's sum and the update read them.
  check(cudaEventRecord(ev_comm, cs), "event");
  check(cudaStreamWaitEvent(stream, ev_comm, 0), "wait");
  grad_global = false;
}

void CudaEngine::Impl::idle_microbatch(bool train) {
  // The same calls as a micro-batch's forward and backward (cuda_engine.cpp), without compute.
  hold_global();
  for (int64_t l = 0; l < L; ++l) {
    hold_layer(l);
    layer_forward_end(l);
  }
  if (!train) return;
  for (int64_t l = L - 1; l >= 0; --l) {
    layer_backward_begin(l);  // zeros: this rank adds nothing to its peers' sums
    layer_backward_end(l);
  }
  backward_units_end();
}

int64_t CudaEngine::Impl::group_count(int64_t mine) {
  // Counts are small integers: exact in float.
  float* c = counts.get<float>();
  const float f = float(mine);
  check(cudaMemcpyAsync(c + dp_rank, &f, sizeof(float), cudaMemcpyHostToDevice, stream), "upload");
  dp_timed(4 * (dp_size - 1), [&] { opt.dp->all_gather(c + dp_rank, c, 1, 4, stream); });
  std::vector<float> all(static_cast<size_t>(dp_size));
  check(cudaMemcpyAsync(all.data(), c, all.size() * 4, cudaMemcpyDeviceToHost, stream), "download");
  sync();
  return int64_t(*std::max_element(all.begin(), all.end()));
}

float* CudaEngine::Impl::stage_unit(size_t u, const float* local) {
  const Unit& U = units[u];
  const int S = dp_size;
  float* st = gstage.get<float>();
  check(cudaMemcpyAsync(st + int64_t(dp_rank) * U.block, local + U.at, size_t(U.block) * 4, cudaMemcpyDefault, stream),
        "copy");
  dp_timed(U.block * S * 4 * (S - 1) / S,
           [&] { opt.dp->all_gather(st + int64_t(dp_rank) * U.block, st, U.block, 4, stream); });
  return st;
}

void CudaEngine::Impl::keep_block(size_t u, float* local) {
  const Unit& U = units[u];
  check(cudaMemcpyAsync(local + U.at, gstage.get<float>() + int64_t(dp_rank) * U.block, size_t(U.block) * 4,
                        cudaMemcpyDefault, stream), "copy");
}

}  // namespace rlh::engine
