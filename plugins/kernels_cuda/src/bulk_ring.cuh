// mbarriers and 1-D bulk copies (TMA) into shared memory, sm_90: what a ring of weight tiles
// streamed ahead of its consumers is made of (decode_layer.cu's fused layer; a persistent
// few-row gemm on it lost to gemv.cu's and was taken out, docs/kernels_cuda.md).
#pragma once

#include <cstdint>

#include "common.cuh"

namespace rlh::kcuda {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Spins until done() holds. A wait that never ends (a block of the grid not resident, a ring
// slot that never fills or empties) would hang the step: after 5 s the launch traps instead,
// and the caller's next CUDA call reports the error.
template <class Done>
__device__ __forceinline__ void spin_until(Done done) {
  if (done()) return;
  const unsigned long long t0 = now_ns();
  while (!done())  // (signed: a global timer stepped back never reads as a 5 s wait)
    if (static_cast<long long>(now_ns() - t0) > 5000000000ll) __trap();
}
__device__ __forceinline__ bool mbar_try_wait(uint64_t* b, unsigned parity) {
  unsigned ok;
  asm volatile(
      "{\n .reg .pred p;\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}"
      : "=r"(ok)
      : "r"(smem_u32(b)), "r"(parity)
      : "memory");
  return ok != 0;
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, unsigned parity) {
  spin_until([&] { return mbar_try_wait(b, parity); });
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
// The barriers' initialisation made visible to the bulk copies (the async proxy) before any.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

}  // namespace rlh::kcuda
