// The process-wide side of comm_mpi: starting MPI within a deadline, the one lock every MPI call
// takes, the failure that poisons every communicator of the process, answering peers' "where
// are you?" queries while waiting, and finishing MPI at exit only when that cannot hang.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "rlhost/plugin.h"
#include "rlhost/sdk/launch_env.hpp"

struct rlh_comm;

namespace rlh::comm_mpi {

using Clock = std::chrono::steady_clock;

// What a rank is doing, for the answers to queries (and the failure messages).
enum class Op : int64_t {
  none = -1, all_reduce, all_gather, reduce_scatter, broadcast, send, recv, all_to_all, barrier, split, exit, recv_any
};
const char* op_name(Op op);

// The lock every MPI call of the plugin holds (MPI is initialised MPI_THREAD_SERIALIZED).
std::mutex& mpi_lock();

// The launcher's environment, read once.
const sdk::LaunchEnv& launch();

// True when this process runs without MPI: no launcher, or an env launch of one rank. Its
// communicators are local (every collective of one rank is a copy).
bool local_mode();

// Starts MPI once per process, waiting at most `timeout` (MPI_Init waits for every rank of
// the job; a rank that never starts would hang it). Throws Error: DEADLINE_EXCEEDED naming the
// launch, UNAVAILABLE when this launch cannot start MPI. Caller holds mpi_lock().
void start_mpi(std::chrono::milliseconds timeout);

// ---- failure ----------------------------------------------------------------------------------
// After the first failure (a timeout, a cancelled wait, an MPI error) every communicator of the
// process refuses further calls: the collective left pending cannot be resumed, and a rank that
// carried on would only wait on peers that have stopped.
bool failed();
// MPI is finished (or finishing) for this process: communicators destroyed now make no MPI call.
bool finished();
const std::string& failure();
void set_failed(const std::string& why);

// ---- queries ----------------------------------------------------------------------------------
// Each communicator has a twin (diag) on which peers ask each other, when a wait times out,
// what they are doing. A rank answers while it waits on any communicator: its call count and
// current call on the asked communicator. A rank that does not answer is dead, or busy outside
// MPI (computing, sleeping).
struct Reply {
  int64_t values[3] = {0, 0, 0};
  MPI_Request req = MPI_REQUEST_NULL;
};

struct DiagState {
  uint64_t query[2] = {0, 0};
  MPI_Request query_req = MPI_REQUEST_NULL;
  std::deque<Reply> replies;
};

void register_comm(rlh_comm* c);
void unregister_comm(rlh_comm* c);
// Answers pending queries on every live communicator. Caller holds mpi_lock().
void serve_queries();

// The communicator and call this rank is waiting in now (for answers about other groups).
void set_waiting(const rlh_comm* c, Op op);

}  // namespace rlh::comm_mpi
