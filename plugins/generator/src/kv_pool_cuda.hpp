// The CUDA generator's KV cache memory: one device allocation, which can also sleep (vLLM's
// sleep mode for the KV cache, NeMo-RL's colocated choreography): between generate() calls its
// physical memory goes back to the device, so a colocated trainer can use it, and the next call
// takes memory again at the same virtual address.
//
// Why the CUDA virtual memory API (cuMemAddressReserve / cuMemCreate / cuMemMap) and not
// cudaFree + cudaMalloc: the decode graphs hold the pool's addresses. A reserved address range
// outlives its physical memory, so the captured graphs stay valid across a sleep, with no
// recapture (vLLM's CuMemAllocator keeps its addresses for the same reason). The driver's entry
// points come through the runtime (cudaGetDriverEntryPointByVersion): the plugin does not link
// libcuda, so it still loads on a machine without a driver.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace rlh::gen {

class KvPoolCuda {
 public:
  KvPoolCuda() = default;
  ~KvPoolCuda() { reset(); }
  KvPoolCuda(const KvPoolCuda&) = delete;
  KvPoolCuda& operator=(const KvPoolCuda&) = delete;

  // At least `bytes` on `device` (a sleepable pool rounds up to the allocation granularity);
  // an allocation that does not fit is a one-line RESOURCE_EXHAUSTED naming `what`.
  void alloc(int device, size_t bytes, bool sleepable, const std::string& what);
  // Sleepable pools: the physical memory released, the address range kept (contents lost).
  void sleep();
  // Memory mapped again at the same address (contents undefined: the caller clears it).
  void wake(const std::string& what);
  void reset();

  void* get() const { return p_; }
  size_t size() const { return n_; }
  bool sleepable() const { return sleepable_; }
  bool asleep() const { return asleep_; }

 private:
  void map(const std::string& what);
  void unmap();

  void* p_ = nullptr;
  size_t n_ = 0;
  int device_ = 0;
  bool sleepable_ = false, asleep_ = false;
  unsigned long long handle_ = 0;  // CUmemGenericAllocationHandle while mapped
};

}  // namespace rlh::gen
