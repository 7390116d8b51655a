// Scratch memory for kernels that need workspace (attention tiles, logprob chunks).
//
// Kernels never call malloc for anything that grows with the problem: they take their workspace
// from a Scratch the caller hands in, so the caller's allocator sees (and can bound) every byte.
// The engine passes its counting allocator; the C ABI will pass the host's allocation service.
// Only fixed-size buffers independent of the problem (the builtin GEMM's packing panels,
// OpenBLAS's own buffer pool) live outside it.
#pragma once

#include <cstddef>
#include <new>
#include <utility>

namespace rlh::kcpu {

struct Scratch {
  // Returns 64-byte aligned memory or nullptr on failure. Called from the calling thread only
  // (kernels allocate before they fork threads).
  void* (*alloc)(void* ctx, size_t bytes) = nullptr;
  void (*free)(void* ctx, void* ptr, size_t bytes) = nullptr;
  void* ctx = nullptr;
};

// aligned_alloc / free.
const Scratch& scratch_default();

// An owning array of n T from a Scratch, freed at scope exit.
template <class T>
class ScratchArray {
 public:
  ScratchArray(const Scratch& s, size_t n) : s_(&s), n_(n) {
    if (n_ == 0) return;
    p_ = static_cast<T*>(s_->alloc(s_->ctx, n_ * sizeof(T)));
    if (!p_) throw std::bad_alloc();
  }
  ~ScratchArray() {
    if (p_) s_->free(s_->ctx, p_, n_ * sizeof(T));
  }
  ScratchArray(const ScratchArray&) = delete;
  ScratchArray& operator=(const ScratchArray&) = delete;
  T* data() const { return p_; }
  T& operator[](size_t i) const { return p_[i]; }
  size_t size() const { return n_; }

 private:
  const Scratch* s_;
  size_t n_;
  T* p_ = nullptr;
};

}  // namespace rlh::kcpu
