// Memory for the engine: every byte it holds (parameters, gradients, optimizer state,
// activations, kernel workspace, outputs) comes from one Allocator, so a test can read the peak
// and hold it against an analytic bound.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <utility>

namespace rlh::engine {

class Allocator {
 public:
  virtual ~Allocator() = default;
  // 64-byte aligned, never nullptr (throws std::bad_alloc).
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p, size_t bytes) = 0;
};

// Aligned heap memory with byte counts: live bytes now and the high-water mark.
class CountingAllocator : public Allocator {
 public:
  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) override;
  size_t live_bytes() const { return live_.load(); }
  size_t peak_bytes() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }

 private:
  std::atomic<size_t> live_{0}, peak_{0};
};

// An owning array of n T (n * sizeof(T) bytes from an Allocator), zero-initialised on request.
template <class T>
class Buffer {
 public:
  Buffer() = default;
  Buffer(Allocator& a, size_t n) : a_(&a), n_(n) {
    if (n_) p_ = static_cast<T*>(a_->allocate(n_ * sizeof(T)));
  }
  ~Buffer() { reset(); }
  Buffer(Buffer&& o) noexcept
      : a_(o.a_), n_(std::exchange(o.n_, 0)), p_(std::exchange(o.p_, nullptr)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      a_ = o.a_;
      n_ = std::exchange(o.n_, 0);
      p_ = std::exchange(o.p_, nullptr);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void reset() {
    if (p_) a_->deallocate(p_, n_ * sizeof(T));
    p_ = nullptr;
    n_ = 0;
  }
  T* data() const { return p_; }
  size_t size() const { return n_; }
  T& operator[](size_t i) const { return p_[i]; }
  std::span<T> span() const { return {p_, n_}; }

 private:
  Allocator* a_ = nullptr;
  size_t n_ = 0;
  T* p_ = nullptr;
};

}  // namespace rlh::engine
