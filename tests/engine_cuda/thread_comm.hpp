// An in-process engine::DeviceDpComm for the CUDA engine's parallel tests (test_cuda_engine_fsdp,
// test_cuda_engine_tp): several engines on one GPU, one per thread, whose collectives meet on the
// host and sum there in rank order (deterministic, so runs repeat bit for bit).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "rlhost/engine_cuda/cuda_engine.hpp"

namespace rlh::test {

// The threads of one group meet here. A peer that never comes (a rank stopped by an exception,
// or collectives out of order) aborts the test after a minute instead of hanging it.
class Rendezvous {
 public:
  explicit Rendezvous(int n) : n_(n), slots_(size_t(n)) {}
  int size() const { return n_; }
  std::vector<char>& slot(int r) { return slots_[size_t(r)]; }
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    const int64_t gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return gen_ != gen; })) {
      std::fprintf(stderr, "thread_comm: a rank did not reach a collective within 60 s\n");
      std::abort();
    }
  }

 private:
  int n_;
  std::vector<std::vector<char>> slots_;  // each rank's contribution, on the host
  std::mutex m_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int64_t gen_ = 0;
};

// engine::DeviceDpComm over a Rendezvous: each collective waits for the engine's stream, brings
// this rank's part to the host, meets the peers, and writes its result back (sums in rank order).
class ThreadDp final : public engine::DeviceDpComm {
 public:
  ThreadDp(Rendezvous& group, int rank) : g_(group), rank_(rank) {}
  int size() const override { return g_.size(); }
  int rank() const override { return rank_; }
  void all_reduce_sum(float* data, int64_t n, void* stream) override {
    publish(data, n * 4, stream);
    std::vector<float> sum = summed(0, n);
    g_.wait();
    to_device(data, sum.data(), n * 4, stream);
  }
  void reduce_scatter_sum(const float* in, float* out, int64_t block, void* stream) override {
    publish(in, block * size() * 4, stream);
    std::vector<float> sum = summed(rank_ * block, block);
    g_.wait();
    to_device(out, sum.data(), block * 4, stream);
  }
  void all_gather(const void* mine, void* all, int64_t block, int element_bytes, void* stream) override {
    const int64_t bytes = block * element_bytes;
    publish(mine, bytes, stream);  // (read before anyone writes: `mine` may lie inside `all`)
    for (int r = 0; r < size(); ++r)
      to_device(static_cast<char*>(all) + r * bytes, g_.slot(r).data(), bytes, stream);
    g_.wait();
  }

 private:
  void publish(const void* src, int64_t bytes, void* stream) {
    ok(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
    std::vector<char>& s = g_.slot(rank_);
    s.resize(size_t(bytes));
    ok(cudaMemcpy(s.data(), src, size_t(bytes), cudaMemcpyDefault));
    g_.wait();
  }
  std::vector<float> summed(int64_t first, int64_t n) {
    std::vector<float> sum(size_t(n), 0.f);
    for (int r = 0; r < size(); ++r) {
      const float* p = reinterpret_cast<const float*>(g_.slot(r).data()) + first;
      for (int64_t i = 0; i < n; ++i) sum[size_t(i)] += p[i];
    }
    return sum;
  }
  // On the engine's stream and waited for: what the engine launches next reads the result
  // (a plain cudaMemcpy from pageable memory may return before its data lands, and the legacy
  // stream does not order the engine's non-blocking one).
  static void to_device(void* dst, const void* src, int64_t bytes, void* stream) {
    const auto s = static_cast<cudaStream_t>(stream);
    ok(cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyHostToDevice, s));
    ok(cudaStreamSynchronize(s));
  }
  static void ok(cudaError_t e) {
    if (e != cudaSuccess) throw std::runtime_error(std::string("test comm: ") + cudaGetErrorString(e));
  }
  Rendezvous& g_;
  int rank_;
};

}  // namespace rlh::test
