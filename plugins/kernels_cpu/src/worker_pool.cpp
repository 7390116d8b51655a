// WorkerPool (why a pool of our own: worker_pool.hpp).
#include "worker_pool.hpp"

#include <omp.h>
#include <sched.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <system_error>

namespace rlh::kcpu {

namespace {

// How long an idle worker spins before it sleeps, and how long the caller spins on the last
// tasks before it starts yielding its core. The gaps between the parallel loops of a decoding
// step (norms, RoPE, sampling bookkeeping) are a few to a few tens of microseconds.
// Measured on the 2-core VM, tiny model: 100 µs keeps batch 1 at ~2,000 tok/s quiet (20 µs:
// 1,420) and costs nothing under two competing busy loops (1,470 vs 1,460 for passive OpenMP);
// 300 µs drops that to 990.
constexpr auto kSpin = std::chrono::microseconds(100);
constexpr auto kSpinBeforeYield = std::chrono::microseconds(20);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

thread_local WorkerPool* bound = nullptr;
thread_local bool in_task = false;

}  // namespace

WorkerPool::WorkerPool(int threads) {
  if (threads < 1) threads = omp_get_max_threads();
  try {
    for (int w = 1; w < threads; ++w) workers_.emplace_back([this, w] { worker_main(w); });
  } catch (const std::system_error& e) {
    // The system refused a thread (limits): stop the ones started, then report, instead of
    // destroying joinable threads (std::terminate).
    const size_t started = workers_.size() + 1;
    stop_.store(true);
    epoch_.fetch_add(1);
    epoch_.notify_all();
    for (std::thread& t : workers_) t.join();
    throw std::runtime_error("kernels_cpu: cannot start decode thread " + std::to_string(started) + " of " +
                             std::to_string(threads) + ": " + e.what());
  }
}

WorkerPool::~WorkerPool() {
  stop_.store(true);
  epoch_.fetch_add(1);
  epoch_.notify_all();
  for (std::thread& t : workers_) t.join();
}

WorkerPool& WorkerPool::current() {
  if (bound) return *bound;
  static WorkerPool process_pool(0);
  return process_pool;
}

WorkerPool::SerialOpenMp::SerialOpenMp() : prev_(omp_get_max_threads()) { omp_set_num_threads(1); }
WorkerPool::SerialOpenMp::~SerialOpenMp() { omp_set_num_threads(prev_); }

WorkerPool::Scope::Scope(WorkerPool& p) : prev_(bound) { bound = &p; }
WorkerPool::Scope::~Scope() { bound = prev_; }

void WorkerPool::record(std::exception_ptr e) {
  std::lock_guard<std::mutex> lock(error_mu_);
  if (!error_) error_ = std::move(e);
}

void WorkerPool::work(uint32_t epoch, int worker) {
  Job& job = jobs_[epoch & 1];
  for (;;) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    if (uint32_t(t >> 32) != epoch) return;
    // Read before the claim; a successful claim proves the slot still held this epoch's job.
    const int64_t n = job.n.load(std::memory_order_relaxed);
    const TaskFn fn = job.fn.load(std::memory_order_relaxed);
    void* const ctx = job.ctx.load(std::memory_order_relaxed);
    const int64_t i = int64_t(uint32_t(t));
    if (i >= n) return;
    if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
    in_task = true;
    try {
      fn(ctx, i, worker);
    } catch (...) {
      record(std::current_exception());
    }
    in_task = false;
    job.completed.fetch_add(1, std::memory_order_release);
  }
}

uint32_t WorkerPool::next_epoch(uint32_t seen) {
  auto until = std::chrono::steady_clock::now() + kSpin;
  for (int spins = 1;; ++spins) {
    const uint32_t e = epoch_.load(std::memory_order_acquire);
    if (e != seen) return e;
    cpu_relax();
    if (spins % 64 || std::chrono::steady_clock::now() < until) continue;
    // Counted before wait() checks the value once more: the publisher either sees a sleeper and
    // wakes it, or stored the new epoch before that check.
    sleepers_.fetch_add(1);
    epoch_.wait(seen);
    sleepers_.fetch_sub(1);
    until = std::chrono::steady_clock::now() + kSpin;  // a spurious wake spins again first
  }
}

void WorkerPool::worker_main(int worker) {
  omp_set_num_threads(1);  // an OpenMP region inside a task stays on this worker
  for (uint32_t seen = 0;;) {
    seen = next_epoch(seen);
    if (stop_.load()) return;
    work(seen, worker);
  }
}

void WorkerPool::run(int64_t n, TaskFn fn, void* ctx) {
  if (n <= 0) return;
  std::unique_lock<std::mutex> lock(busy_, std::defer_lock);
  if (n == 1 || workers_.empty() || in_task || n > int64_t(UINT32_MAX) || !lock.try_lock()) {
    for (int64_t i = 0; i < n; ++i) fn(ctx, i, 0);
    return;
  }
  const uint32_t e = epoch_.load(std::memory_order_relaxed) + 1;
  Job& job = jobs_[e & 1];
  job.fn.store(fn, std::memory_order_relaxed);
  job.ctx.store(ctx, std::memory_order_relaxed);
  job.n.store(n, std::memory_order_relaxed);
  job.completed.store(0, std::memory_order_relaxed);
  error_ = nullptr;
  ticket_.store(uint64_t(e) << 32, std::memory_order_release);
  epoch_.store(e);
  if (sleepers_.load() > 0) epoch_.notify_all();

  {
    const SerialOpenMp serial;  // as on the workers
    work(e, 0);
  }
  // The rest are running on workers: spin briefly, then give the core away between checks so a
  // preempted worker can finish its task.
  if (job.completed.load(std::memory_order_acquire) < n) {
    const auto until = std::chrono::steady_clock::now() + kSpinBeforeYield;
    bool yield = false;
    for (int spins = 1; job.completed.load(std::memory_order_acquire) < n; ++spins) {
      if (yield) {
        sched_yield();
        continue;
      }
      cpu_relax();
      if (spins % 64 == 0) yield = std::chrono::steady_clock::now() >= until;
    }
  }
  if (error_) {
    std::exception_ptr e2 = std::move(error_);
    error_ = nullptr;
    std::rethrow_exception(e2);
  }
}

}  // namespace rlh::kcpu
