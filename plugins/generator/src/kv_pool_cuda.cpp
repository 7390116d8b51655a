// kv_pool_cuda.hpp says what and why.
#include "kv_pool_cuda.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <string>
#include <type_traits>

#include "rlhost/sdk/status.hpp"

namespace rlh::gen {

using sdk::Error;

namespace {

std::string mib(size_t b) { return std::to_string((b + (size_t(1) << 19)) >> 20) + " MiB"; }

// The driver calls a sleepable pool needs, resolved once through the runtime.
struct Driver {
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 reserve = nullptr;
  PFN_cuMemAddressFree_v10020 free_range = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuGetErrorString_v6000 error_string = nullptr;
  std::string missing;  // the first entry point the driver did not give

  Driver() {
    auto get = [&](const char* name, auto& fn) {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult q{};
      if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
          q != cudaDriverEntryPointSuccess || p == nullptr) {
        cudaGetLastError();
        if (missing.empty()) missing = name;
        return;
      }
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    get("cuMemGetAllocationGranularity", granularity);
    get("cuMemAddressReserve", reserve);
    get("cuMemAddressFree", free_range);
    get("cuMemCreate", create);
    get("cuMemRelease", release);
    get("cuMemMap", map);
    get("cuMemUnmap", unmap);
    get("cuMemSetAccess", set_access);
    get("cuGetErrorString", error_string);
  }
  static const Driver& get() {
    static const Driver d;
    return d;
  }
  std::string text(CUresult r) const {
    const char* s = nullptr;
    if (error_string) error_string(r, &s);
    return s ? s : "CUDA driver error " + std::to_string(int(r));
  }
};

CUmemAllocationProp device_memory(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

}  // namespace

void KvPoolCuda::alloc(int device, size_t bytes, bool sleepable, const std::string& what) {
  reset();
  if (bytes == 0) return;
  device_ = device;
  sleepable_ = sleepable;
  if (!sleepable) {
    const cudaError_t e = cudaMalloc(&p_, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      p_ = nullptr;
      throw Error(RLH_E_RESOURCE_EXHAUSTED, "generator (cuda): cannot allocate " + mib(bytes) + " for " + what + ": " +
                                                cudaGetErrorString(e));
    }
    n_ = bytes;
    return;
  }
  const Driver& d = Driver::get();
  if (!d.missing.empty())
    throw Error(RLH_E_UNAVAILABLE, "generator (cuda): kv_cache_sleep needs the CUDA driver's virtual memory calls, and "
                                   "the driver does not give " + d.missing);
  const CUmemAllocationProp prop = device_memory(device);
  size_t g = 0;
  CUresult r = d.granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (r != CUDA_SUCCESS || g == 0)
    throw Error(RLH_E_UNAVAILABLE, "generator (cuda): the allocation granularity of cuda:" + std::to_string(device) +
                                       ": " + d.text(r));
  n_ = (bytes + g - 1) / g * g;
  CUdeviceptr va = 0;
  r = d.reserve(&va, n_, g, 0, 0);
  if (r != CUDA_SUCCESS) {
    n_ = 0;
    throw Error(RLH_E_RESOURCE_EXHAUSTED, "generator (cuda): cannot reserve " + mib(bytes) + " of addresses for " +
                                              what + ": " + d.text(r));
  }
  p_ = reinterpret_cast<void*>(va);
  asleep_ = true;  // reserved, nothing mapped yet
  wake(what);
}

void KvPoolCuda::map(const std::string& what) {
  const Driver& d = Driver::get();
  const CUmemAllocationProp prop = device_memory(device_);
  CUmemGenericAllocationHandle h = 0;
  CUresult r = d.create(&h, n_, &prop, 0);
  if (r != CUDA_SUCCESS)
    throw Error(RLH_E_RESOURCE_EXHAUSTED, "generator (cuda): cannot allocate " + mib(n_) + " for " + what + ": " +
                                              d.text(r));
  const CUdeviceptr va = reinterpret_cast<CUdeviceptr>(p_);
  r = d.map(va, n_, 0, h, 0);
  if (r != CUDA_SUCCESS) {
    d.release(h);
    throw Error(RLH_E_INTERNAL, "generator (cuda): cannot map " + what + ": " + d.text(r));
  }
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = d.set_access(va, n_, &access, 1);
  if (r != CUDA_SUCCESS) {
    d.unmap(va, n_);
    d.release(h);
    throw Error(RLH_E_INTERNAL, "generator (cuda): cannot give access to " + what + ": " + d.text(r));
  }
  handle_ = h;
}

void KvPoolCuda::unmap() {
  const Driver& d = Driver::get();
  d.unmap(reinterpret_cast<CUdeviceptr>(p_), n_);
  d.release(CUmemGenericAllocationHandle(handle_));
  handle_ = 0;
}

void KvPoolCuda::sleep() {
  if (!sleepable_ || asleep_ || p_ == nullptr) return;
  // The caller has synchronised its stream: nothing still reads or writes the pool.
  unmap();
  asleep_ = true;
}

void KvPoolCuda::wake(const std::string& what) {
  if (!sleepable_ || !asleep_ || p_ == nullptr) return;
  map(what);
  asleep_ = false;
}

void KvPoolCuda::reset() {
  if (p_ == nullptr) return;
  if (!sleepable_) {
    cudaFree(p_);
  } else {
    if (!asleep_) unmap();
    Driver::get().free_range(reinterpret_cast<CUdeviceptr>(p_), n_);
  }
  p_ = nullptr;
  n_ = 0;
  asleep_ = false;
}

}  // namespace rlh::gen
