// comm_mpi's process-wide state (mpi_runtime.hpp).
#include "mpi_runtime.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "mpi_comm.hpp"
#include "rlhost/sdk/comm_args.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::comm_mpi {
namespace {

using sdk::Error;

constexpr int kTagQuery = 1;
constexpr int kTagReply = 2;

// Everything here lives until the process ends (never destroyed: atexit and detached threads
// may still reach it).
struct Runtime {
  std::mutex mpi;  // held around every MPI call
  std::mutex state;
  std::condition_variable cv;
  // MPI_Init runs on its own thread, which later runs MPI_Finalize (MPI wants both on one
  // thread) when the exit is clean.
  bool init_started = false, init_done = false, init_timed_out = false;
  int init_rc = MPI_SUCCESS, provided = 0;
  bool finalize_requested = false, do_finalize = false, finalized = false;
  // Joined at a clean exit: a thread still ending while the process exits races with exit-time
  // tools (LeakSanitizer's stop-the-world crashed on it). Left detached where MPI_Init never
  // returned (the job fails and leaves by _Exit).
  std::thread thread;
  MPI_Comm exit_comm = MPI_COMM_NULL;  // for the bounded barrier before MPI_Finalize
  int64_t exit_timeout_ms = 120000;
  bool failed = false;
  std::string failure;
  std::vector<rlh_comm*> live;
  const rlh_comm* waiting_comm = nullptr;
  Op waiting_op = Op::none;
};

Runtime& rt() {
  static Runtime* r = new Runtime();
  return *r;
}

// At a clean exit: every rank meets at a barrier bounded in time, then MPI_Finalize (whose
// own fence would wait forever for a rank that is gone). A rank that does not come means
// a peer failed or is stuck: leave without finalizing rather than hang.
void finish_at_exit() {
  Runtime& r = rt();
  {
    std::lock_guard<std::mutex> lk(r.state);
    if (!r.init_done || r.init_rc != MPI_SUCCESS || r.finalize_requested) return;
  }
  bool clean = false;
  {
    std::lock_guard<std::mutex> lk(r.mpi);
    if (!r.failed && r.exit_comm != MPI_COMM_NULL) {
      MPI_Request req = MPI_REQUEST_NULL;
      const auto deadline = Clock::now() + std::chrono::milliseconds(r.exit_timeout_ms);
      if (MPI_Ibarrier(r.exit_comm, &req) == MPI_SUCCESS) {
        int done = 0;
        unsigned nap = 0;
        while (!done && Clock::now() < deadline) {
          if (MPI_Test(&req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
          if (done) break;
          serve_queries();
          nap = std::min<unsigned>(nap + 20, 1000);
          std::this_thread::sleep_for(std::chrono::microseconds(nap));
        }
        clean = done != 0;
      }
      if (!clean)
        std::fprintf(stderr, "comm_mpi: rank %d: not every rank reached the end of the job within %s; leaving without MPI_Finalize\n",
                     world_rank(), sdk::comm::seconds_text(r.exit_timeout_ms).c_str());
    }
  }
  std::unique_lock<std::mutex> lk(r.state);
  r.finalize_requested = true;
  r.do_finalize = clean;
  r.cv.notify_all();
  const bool ended = r.cv.wait_for(lk, std::chrono::milliseconds(clean ? r.exit_timeout_ms : 10000), [&] { return r.finalized; });
  lk.unlock();
  if (ended && r.thread.joinable()) r.thread.join();
}

}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::none: return "none";
    case Op::all_reduce: return "all_reduce";
    case Op::all_gather: return "all_gather";
    case Op::reduce_scatter: return "reduce_scatter";
    case Op::broadcast: return "broadcast";
    case Op::send: return "send";
    case Op::recv: return "recv";
    case Op::all_to_all: return "all_to_all";
    case Op::barrier: return "barrier";
    case Op::split: return "split";
    case Op::exit: return "the end-of-job barrier";
    case Op::recv_any: return "recv_any";
  }
  return "?";
}

std::mutex& mpi_lock() { return rt().mpi; }

const sdk::LaunchEnv& launch() {
  // Read once; a malformed variable is reported by create_world (detect_launch throws there).
  static const sdk::LaunchEnv env = [] {
    try {
      return sdk::detect_launch();
    } catch (const Error&) {
      return sdk::LaunchEnv{};
    }
  }();
  return env;
}

bool local_mode() {
  const sdk::LaunchEnv& e = launch();
  return e.launcher == sdk::Launcher::none || (!e.mpi_runtime && e.size == 1);
}

void start_mpi(std::chrono::milliseconds timeout) {
  Runtime& r = rt();
  std::unique_lock<std::mutex> lk(r.state);
  const sdk::LaunchEnv& env = launch();
  if (r.init_timed_out)
    throw Error(RLH_E_DEADLINE_EXCEEDED, "comm_mpi: MPI did not start earlier in this process (" + env.describe() + ")");
  if (r.finalize_requested) throw Error(RLH_E_FAILED_PRECONDITION, "comm_mpi: MPI was already finished in this process");
  if (!r.init_started) {
    r.init_started = true;
    r.thread = std::thread([] {
      Runtime& r = rt();
      int provided = 0;
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
      std::unique_lock<std::mutex> lk(r.state);
      r.init_rc = rc;
      r.provided = provided;
      r.init_done = true;
      r.cv.notify_all();
      r.cv.wait(lk, [&] { return r.finalize_requested; });
      if (r.do_finalize) {
        lk.unlock();
        MPI_Finalize();
        lk.lock();
      }
      r.finalized = true;
      r.cv.notify_all();
    });
  }
  if (!r.cv.wait_for(lk, timeout, [&] { return r.init_done; })) {
    r.init_timed_out = true;
    const std::string msg = "comm_mpi: MPI did not start within " + sdk::comm::seconds_text(timeout.count()) + " on rank " +
                            std::to_string(env.rank) + " of " + std::to_string(env.size) + " (" + env.describe() +
                            "): MPI_Init waits for every rank of the job, so a rank did not start, or stopped before "
                            "creating its communicator";
    r.failed = true;
    r.failure = msg;
    throw Error(RLH_E_DEADLINE_EXCEEDED, msg);
  }
  if (r.init_rc != MPI_SUCCESS) throw Error(RLH_E_UNAVAILABLE, "comm_mpi: MPI_Init failed (error " + std::to_string(r.init_rc) + ")");
  if (r.provided < MPI_THREAD_SERIALIZED)
    throw Error(RLH_E_UNAVAILABLE, "comm_mpi: this MPI provides thread level " + std::to_string(r.provided) +
                                       "; comm_mpi needs MPI_THREAD_SERIALIZED");
  if (r.exit_comm == MPI_COMM_NULL) {
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_dup(MPI_COMM_WORLD, &r.exit_comm);  // every rank has just left MPI_Init together
    MPI_Comm_set_errhandler(r.exit_comm, MPI_ERRORS_RETURN);
    r.exit_timeout_ms = std::max<int64_t>(120000, 4 * timeout.count());
    std::atexit(finish_at_exit);
  }
}

bool failed() { return rt().failed; }
bool finished() {
  Runtime& r = rt();
  std::lock_guard<std::mutex> lk(r.state);
  return r.finalize_requested;
}
const std::string& failure() { return rt().failure; }
void set_failed(const std::string& why) {
  Runtime& r = rt();
  if (r.failed) return;
  r.failed = true;
  r.failure = why;
}

void register_comm(rlh_comm* c) { rt().live.push_back(c); }

void unregister_comm(rlh_comm* c) {
  Runtime& r = rt();
  r.live.erase(std::remove(r.live.begin(), r.live.end(), c), r.live.end());
  if (r.waiting_comm == c) r.waiting_comm = nullptr;
  if (c->diag == MPI_COMM_NULL || r.failed) return;  // after a failure nothing is freed
  if (finished()) return;  // destroyed after MPI_Finalize (a static owner at exit)
  DiagState& d = c->diag_state;
  if (d.query_req != MPI_REQUEST_NULL) {
    MPI_Cancel(&d.query_req);
    MPI_Request_free(&d.query_req);
  }
  for (Reply& rep : d.replies)
    if (rep.req != MPI_REQUEST_NULL) MPI_Request_free(&rep.req);  // small sends finish on their own
  d.replies.clear();
}

void set_waiting(const rlh_comm* c, Op op) {
  rt().waiting_comm = c;
  rt().waiting_op = op;
}

void serve_queries() {
  Runtime& r = rt();
  for (rlh_comm* c : r.live) {
    if (c->diag == MPI_COMM_NULL) continue;
    DiagState& d = c->diag_state;
    while (true) {
      if (d.query_req == MPI_REQUEST_NULL &&
          MPI_Irecv(d.query, 2, MPI_UINT64_T, MPI_ANY_SOURCE, kTagQuery, c->diag, &d.query_req) != MPI_SUCCESS)
        break;
      int flag = 0;
      MPI_Status st;
      if (MPI_Test(&d.query_req, &flag, &st) != MPI_SUCCESS || !flag) break;
      d.query_req = MPI_REQUEST_NULL;
      // The answer: calls entered on this group, the call waiting now on it (or -1), and the
      // call waiting on another group (or -1).
      Reply& rep = d.replies.emplace_back();
      rep.values[0] = static_cast<int64_t>(c->calls);
      rep.values[1] = static_cast<int64_t>(c->current);
      rep.values[2] = (r.waiting_comm != nullptr && r.waiting_comm != c) ? static_cast<int64_t>(r.waiting_op) : -1;
      MPI_Isend(rep.values, 3, MPI_INT64_T, st.MPI_SOURCE, kTagReply, c->diag, &rep.req);
    }
    while (!d.replies.empty()) {
      int flag = 0;
      if (MPI_Test(&d.replies.front().req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || !flag) break;
      d.replies.pop_front();
    }
  }
}

}  // namespace rlh::comm_mpi
