// Staging of device tensors through pinned host buffers (device_staging.hpp).
#include "device_staging.hpp"

#include <cstdlib>
#include <string>
#include <vector>

#include "rlhost/sdk/comm_args.hpp"
#include "rlhost/sdk/status.hpp"

#ifdef RLH_COMM_MPI_CUDA
#include <cuda_runtime_api.h>
#endif

namespace rlh::comm_mpi {
namespace {

using sdk::Error;

#ifdef RLH_COMM_MPI_CUDA

void cuda_check(cudaError_t e, const char* call, const char* what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clear a sticky-free error so later calls start clean
  const rlh_code code = (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) ? RLH_E_UNAVAILABLE : RLH_E_INTERNAL;
  throw Error(code, std::string("comm_mpi: ") + call + ": " + what + ": " + cudaGetErrorString(e));
}

// Makes `dev` current for the copy and restores the caller's device afterwards.
struct DeviceScope {
  int previous = -1;
  DeviceScope(const rlh_device& dev, const char* call) {
    cuda_check(cudaGetDevice(&previous), call, "cudaGetDevice");
    if (dev.device_id != previous) cuda_check(cudaSetDevice(dev.device_id), call, "cudaSetDevice");
  }
  ~DeviceScope() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous && previous >= 0) cudaSetDevice(previous);
  }
};

// A growable host buffer: pinned when cudaMallocHost agrees, pageable otherwise (slower
// copies, same results).
struct Slot {
  void* ptr = nullptr;
  size_t bytes = 0;
  bool pinned = false;
};
Slot g_slots[2];

void* slot_buffer(int i, size_t bytes, const char* call) {
  Slot& s = g_slots[i];
  if (s.bytes >= bytes && s.ptr != nullptr) return s.ptr;
  if (s.ptr != nullptr) {
    if (s.pinned) cudaFreeHost(s.ptr);
    else std::free(s.ptr);
    s = Slot{};
  }
  const size_t want = std::max<size_t>(bytes, 1 << 20);
  if (cudaMallocHost(&s.ptr, want) == cudaSuccess) {
    s.pinned = true;
  } else {
    cudaGetLastError();
    s.ptr = std::malloc(want);
    if (s.ptr == nullptr)
      throw Error(RLH_E_RESOURCE_EXHAUSTED, std::string("comm_mpi: ") + call + ": cannot allocate a staging buffer of " +
                                                std::to_string(want) + " bytes");
  }
  s.bytes = want;
  return s.ptr;
}

#endif

}  // namespace

#ifdef RLH_COMM_MPI_CUDA

void* staging_buffer(int slot, size_t bytes, const char* call) { return slot_buffer(slot, bytes, call); }

void* stage_from_device(int slot, const void* src, size_t bytes, const rlh_device& dev, void* stream, const char* call) {
  void* host = slot_buffer(slot, bytes, call);
  if (bytes == 0) return host;
  DeviceScope scope(dev, call);
  auto s = static_cast<cudaStream_t>(stream);
  cuda_check(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDefault, s), call, "copying the device tensor to the host");
  cuda_check(cudaStreamSynchronize(s), call, "waiting for the device-to-host copy");
  return host;
}

void stage_to_device(void* dst, const void* src, size_t bytes, const rlh_device& dev, void* stream, const char* call) {
  if (bytes == 0) return;
  DeviceScope scope(dev, call);
  auto s = static_cast<cudaStream_t>(stream);
  cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s), call, "copying the result to the device");
  cuda_check(cudaStreamSynchronize(s), call, "waiting for the host-to-device copy");
}

void copy_on_device(void* dst, const void* src, size_t bytes, const rlh_device& dev, void* stream, const char* call) {
  if (bytes == 0 || dst == src) return;
  DeviceScope scope(dev, call);
  auto s = static_cast<cudaStream_t>(stream);
  cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s), call, "copying on the device");
  cuda_check(cudaStreamSynchronize(s), call, "waiting for the device copy");
}

#else

namespace {
[[noreturn]] void no_cuda(const rlh_device& dev, const char* call) {
  throw Error(RLH_E_UNAVAILABLE, std::string("comm_mpi: ") + call + ": the tensor is on " + sdk::comm::device_name(dev) +
                                     ", but this comm_mpi was built without the CUDA toolkit and cannot stage device memory");
}
std::vector<char> g_host_slots[2];
}  // namespace

void* staging_buffer(int slot, size_t bytes, const char*) {
  if (g_host_slots[slot].size() < bytes) g_host_slots[slot].resize(bytes);
  return g_host_slots[slot].data();
}
void* stage_from_device(int, const void*, size_t, const rlh_device& dev, void*, const char* call) { no_cuda(dev, call); }
void stage_to_device(void*, const void*, size_t, const rlh_device& dev, void*, const char* call) { no_cuda(dev, call); }
void copy_on_device(void*, const void*, size_t, const rlh_device& dev, void*, const char* call) { no_cuda(dev, call); }

#endif

}  // namespace rlh::comm_mpi
