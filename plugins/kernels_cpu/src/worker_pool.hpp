// kernels_cpu's threads for the decode-sized ops (the batch-invariant gemm, paged attention,
// sampling): a pool that runs parallel loops with a short spin before sleeping.
//
// Why not OpenMP, as the other ops: a decoding step is ~20 parallel products a few tens of
// microseconds each (tiny model, batch 1: ~0.5 ms per token for 17 of them), so the cost of
// waking the team decides the speed. libgomp offers two policies, read once from the
// environment when it loads: OMP_WAIT_POLICY=passive sleeps at once (a futex wake per region:
// tiny model at batch 1, 1,360 tok/s), the default spins ~300k iterations (2,120 tok/s) but
// starves the working thread on a loaded machine (117 tok/s measured under load). This pool
// spins for a bounded time (kSpin, ~100 µs: the gaps inside a step are shorter) and then sleeps
// on a futex, whatever the environment says; while it waits for the last task it yields the core
// to a worker that may have been preempted.
//
// Tasks are claimed one at a time from a shared counter, and the calling thread works too, so a
// worker that has not woken yet (or lost its core) holds nothing back: the others take its share.
// Results may depend on which worker runs a task only through the worker index handed to it
// (scratch buffers); every parallel loop here writes disjoint outputs, so results are the same
// bits for any thread count.
//
// One loop at a time per pool: a call made while the pool is busy on another thread, or from
// inside a task, runs serially on the calling thread. An instance created with
// {"num_threads": N} owns a pool of N; otherwise the process-wide one (current()) serves it.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace rlh::kcpu {

class WorkerPool {
 public:
  // threads: workers including the calling thread (< 1: OpenMP's omp_get_max_threads(), so
  // OMP_NUM_THREADS sizes it as it sizes kernels_cpu).
  explicit WorkerPool(int threads = 0);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int threads() const { return int(workers_.size()) + 1; }

  // Calls fn(task, worker) for every task in [0, n), worker in [0, threads()), and returns when
  // all are done; rethrows the first exception a task threw (the other tasks still run).
  template <class F>
  void parallel_for(int64_t n, F&& fn) {
    using Fn = std::remove_reference_t<F>;
    run(n, [](void* ctx, int64_t i, int w) { (*static_cast<Fn*>(ctx))(i, w); }, &fn);
  }

  // The pool bound to this thread by a Scope, else a process-wide pool of
  // omp_get_max_threads() threads made on first use.
  static WorkerPool& current();

  // Makes OpenMP regions opened on the calling thread (kernels_cpu's ops) run on that thread
  // alone for the guard's life: an OpenMP team next to the pool would spin against its workers
  // (libgomp's default wait policy) or pay a futex wake per region (passive). A decoding
  // caller holds one; pool workers are serial for OpenMP from their start.
  class SerialOpenMp {
   public:
    SerialOpenMp();
    ~SerialOpenMp();
    SerialOpenMp(const SerialOpenMp&) = delete;
    SerialOpenMp& operator=(const SerialOpenMp&) = delete;

   private:
    int prev_;
  };

  // Binds a pool to the calling thread for the scope's life (an instance's own pool, per call).
  class Scope {
   public:
    explicit Scope(WorkerPool& p);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    WorkerPool* prev_;
  };

 private:
  using TaskFn = void (*)(void* ctx, int64_t task, int worker);
  struct Job {  // one per epoch parity: a late worker reads a stale slot, never a half-written one
    std::atomic<TaskFn> fn{nullptr};
    std::atomic<void*> ctx{nullptr};
    std::atomic<int64_t> n{0};
    std::atomic<int64_t> completed{0};
  };

  void run(int64_t n, TaskFn fn, void* ctx);
  void work(uint32_t epoch, int worker);  // claims and runs tasks of `epoch` until none is left
  uint32_t next_epoch(uint32_t seen);    // spins, then sleeps, until epoch_ leaves `seen`
  void worker_main(int worker);
  void record(std::exception_ptr e);

  std::vector<std::thread> workers_;
  Job jobs_[2];
  // (epoch << 32) | next task: a task is claimed by one compare-exchange, which fails for a
  // worker still holding an earlier epoch.
  std::atomic<uint64_t> ticket_{0};
  std::atomic<uint32_t> epoch_{0};  // what sleeping workers wait on
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex busy_;  // one loop at a time
  std::mutex error_mu_;
  std::exception_ptr error_;
};

}  // namespace rlh::kcpu
