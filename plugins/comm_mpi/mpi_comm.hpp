// comm_mpi's communicator: a group of ranks over an MPI communicator (or, for a process that
// runs alone, a local group of one), with its twin for failure queries, its timeout and its
// call count. The collectives are nonblocking MPI calls driven to completion by MPI_Test
// against a deadline (mpi_comm.cpp).
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "mpi_runtime.hpp"
#include "rlhost/comm.h"

struct rlh_comm {
  const rlh_host_api* host = nullptr;
  MPI_Comm comm = MPI_COMM_NULL;  // MPI_COMM_NULL: a local group of one (no MPI in this process)
  MPI_Comm diag = MPI_COMM_NULL;  // the twin that carries failure queries
  std::string name;               // "world", "world.split(3)", for messages
  std::vector<int> world_ranks;   // world rank of each member
  int rank = 0;
  int size = 1;
  int64_t timeout_ms = 30000;
  int64_t default_timeout_ms = 30000;
  uint64_t calls = 0;  // calls entered on this group (the number peers report when asked)
  rlh::comm_mpi::Op current = rlh::comm_mpi::Op::none;
  rlh::comm_mpi::DiagState diag_state;
};

namespace rlh::comm_mpi {

// The default timeout of a collective when neither the config nor the caller sets one.
inline constexpr int64_t kDefaultTimeoutMs = 30000;

rlh_comm* create_world(const rlh_host_api* host, const nlohmann::json& config);
rlh_comm* split(rlh_comm* c, int32_t color, int32_t key);
void destroy(rlh_comm* c);
void all_reduce(rlh_comm* c, const rlh_tensor* t, int32_t op, void* stream);
void all_gather(rlh_comm* c, const rlh_tensor* in, const rlh_tensor* out, void* stream);
void reduce_scatter(rlh_comm* c, const rlh_tensor* in, const rlh_tensor* out, int32_t op, void* stream);
void broadcast(rlh_comm* c, const rlh_tensor* t, int32_t root, void* stream);
void send(rlh_comm* c, const rlh_tensor* t, int32_t peer, void* stream);
void recv(rlh_comm* c, const rlh_tensor* t, int32_t peer, void* stream);
// The next message from any other rank of the group (COMM 0.2); *peer: its sender's group rank.
void recv_any(rlh_comm* c, const rlh_tensor* t, int32_t* peer, void* stream);
void all_to_all(rlh_comm* c, const rlh_tensor* in, const rlh_tensor* out, void* stream);
void barrier(rlh_comm* c);

// "'world' (4 ranks)", "'world.split(1)' (2 ranks: world ranks 1, 3)".
std::string describe_group(const rlh_comm& c);
// World rank of this process (0 in local mode).
int world_rank();

}  // namespace rlh::comm_mpi
