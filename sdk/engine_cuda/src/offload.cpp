// The CUDA engine with its optimizer state offloaded to the host (CudaEngineOptions::
// offload_state; dtensor's cpu_offload, FSDP2's CPUOffloadPolicy).
//
// What moves: the fp32 masters and both AdamW moments, 12 bytes a parameter (12/S under FSDP),
// the largest part of a trainer's memory. The bf16 weights and the fp32 gradients stay on the
// device (under FSDP this rank's blocks and the units' staging): the forward and backward read
// and write them every micro-batch.
//
// Why stream the update through a device staging buffer instead of running AdamW on the CPU:
// the update then runs the registry's AdamW kernel on the same values in the same order, so an
// offloaded run computes the same bits as one that is not (tests/engine_cuda
// test_cuda_engine_offload.cpp checks it), and the host needs no optimizer of its own. The price
// is 24 bytes a parameter over PCIe per step (12 up, 12 down), which FSDP2's offload pays too
// (its gradients down, its parameters up, and a CPU AdamW between).
//
// Chunks start at multiples of 64 elements and the staging parts are 256-byte aligned, so every
// pointer the AdamW kernel sees has the same alignment as in the device-resident layout.
#include <algorithm>
#include <cstring>
#include <utility>

#include "cuda_engine_impl.hpp"

namespace rlh::engine {

using cuda::check;

void CudaEngine::Impl::carve_offload(size_t master_b, size_t moment_b) {
  if (opt.offload_chunk_elems < 1)
    throw std::invalid_argument("cuda engine: offload_chunk_elems must be at least 1, got " +
                                std::to_string(opt.offload_chunk_elems));
  h_master = cuda::PinnedBuffer(master_b);
  h_adam_m = cuda::PinnedBuffer(moment_b);
  h_adam_v = cuda::PinnedBuffer(moment_b);
  for (cuda::PinnedBuffer* b : {&h_master, &h_adam_m, &h_adam_v})
    if (b->size() > 0) std::memset(b->get(), 0, b->size());
  const int64_t len = int64_t(master_b / sizeof(float));
  ostage_elems = (std::min(opt.offload_chunk_elems, std::max<int64_t>(len, 1)) + 63) / 64 * 64;
  ostage = cuda::DeviceBuffer(counters, size_t(3 * ostage_elems) * sizeof(float));
}

void CudaEngine::Impl::stage_masters_whole() {
  if (fsdp()) throw std::logic_error("cuda engine: FSDP keeps no whole masters; they move unit by unit");
  check(cudaMemcpyAsync(grads.get(), master32(), master_bytes(), cudaMemcpyDefault, stream), "upload");
}

void CudaEngine::Impl::offloaded_update(const std::vector<Piece>& pieces, const StepOptions& so, double clip) {
  const int64_t len = int64_t(h_master.size() / sizeof(float));
  float* sp = ostage.get<float>();
  float* sm = sp + ostage_elems;
  float* sv = sm + ostage_elems;
  // Each staged part beside its host copy.
  const std::pair<float*, float*> parts[] = {{sp, h_master.get<float>()}, {sm, h_adam_m.get<float>()},
                                             {sv, h_adam_v.get<float>()}};
  for (int64_t a = 0; a < len; a += ostage_elems) {
    const int64_t b = std::min(len, a + ostage_elems);
    const bool any = std::any_of(pieces.begin(), pieces.end(),
                                 [&](const Piece& p) { return p.local < b && p.local + p.n > a; });
    if (!any) continue;  // padding, frozen tensors: nothing to move
    const size_t bytes = size_t(b - a) * sizeof(float);
    // Stream order keeps the chunks apart: the next upload into the staging buffer follows
    // this chunk's download.
    for (const auto& [dev, host] : parts)
      check(cudaMemcpyAsync(dev, host + a, bytes, cudaMemcpyHostToDevice, stream), "offloaded state upload");
    adamw_pieces(pieces, sp, sm, sv, a, a, b, so, clip);
    for (const auto& [dev, host] : parts)
      check(cudaMemcpyAsync(host + a, dev, bytes, cudaMemcpyDeviceToHost, stream), "offloaded state download");
  }
}

}  // namespace rlh::engine
