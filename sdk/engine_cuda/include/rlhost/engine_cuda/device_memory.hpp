// Device and pinned host memory for the CUDA engine, counted: every cudaMalloc and every host
// wait goes through here, so CudaEngine::stats() can report allocations and synchronisations
// per step (the goal in steady state is none of the first and as few as possible of the second).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>


namespace rlh::engine::cuda {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("cuda engine: ") + what + ": " + cudaGetErrorString(e));
}

struct Counters {
  int64_t allocations = 0;
  int64_t bytes = 0;
  int64_t syncs = 0;
};

// One cudaMalloc'ed block, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Counters& c, size_t bytes) : c_(&c), bytes_(bytes) {
    if (bytes == 0) return;
    check(cudaMalloc(&p_, bytes), "cudaMalloc");
    ++c.allocations;
    c.bytes += int64_t(bytes);
  }
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      c_ = o.c_;
      p_ = o.p_;
      bytes_ = o.bytes_;
      o.p_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  void reset() {
    if (p_) {
      cudaFree(p_);  // synchronises the device: only ever on growth or teardown
      c_->bytes -= int64_t(bytes_);
    }
    p_ = nullptr;
    bytes_ = 0;
  }
  template <class T = void>
  T* get() const { return static_cast<T*>(p_); }
  size_t size() const { return bytes_; }

 private:
  Counters* c_ = nullptr;
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// Page-locked host staging (batch uploads, output downloads), so copies are asynchronous.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes) {
    if (bytes) check(cudaMallocHost(&p_, bytes), "cudaMallocHost");
    bytes_ = bytes;
  }
  ~PinnedBuffer() {
    if (p_) cudaFreeHost(p_);
  }
  PinnedBuffer(PinnedBuffer&& o) noexcept { *this = std::move(o); }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      if (p_) cudaFreeHost(p_);
      p_ = o.p_;
      bytes_ = o.bytes_;
      o.p_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  template <class T = void>
  T* get() const { return static_cast<T*>(p_); }
  size_t size() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// Kernels of the engine itself (cuda_engine_kernels.cu).
// dst[i] = bf16(src[i]), round to nearest even.
void cast_to_bf16(const float* src, void* dst, int64_t n, cudaStream_t s);
// dst[i] += src[i] in fp32 (FSDP: a reduce-scattered gradient block into the accumulated one).
void add_f32(float* dst, const float* src, int64_t n, cudaStream_t s);

}  // namespace rlh::engine::cuda
