// comm_nccl's communicator: an NCCL communicator on one CUDA device, nonblocking (so that every
// wait is bounded: NCCL's async error state and a CUDA event are polled against a deadline, and
// the communicator is aborted when it passes), with device scratch for host tensors.
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "nccl_loader.hpp"
#include "rlhost/comm.h"

struct rlh_comm {
  const rlh_host_api* host = nullptr;
  ncclComm_t comm = nullptr;
  int device = 0;
  std::string name;              // "world", "world.split(2)"
  std::vector<int> world_ranks;  // world rank of each member
  int rank = 0;
  int size = 1;
  int64_t timeout_ms = 30000;
  int64_t default_timeout_ms = 30000;
  cudaEvent_t done = nullptr;  // recorded after each call, polled until it completes
  void* scratch[2] = {nullptr, nullptr};  // device staging of host tensors, grown on demand
  size_t scratch_bytes[2] = {0, 0};
  void* pinned[2] = {nullptr, nullptr};  // page-locked host staging of the same (see nccl_comm.cpp)
  size_t pinned_bytes[2] = {0, 0};
  bool aborted = false;
};

namespace rlh::comm_nccl {

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
void all_to_all(rlh_comm* c, const rlh_tensor* in, const rlh_tensor* out, void* stream);
void barrier(rlh_comm* c);
void set_timeout(rlh_comm* c, int64_t ms);

// Whether comm_nccl can run here: NCCL loads and a CUDA device is visible ("" when it can).
std::string unavailable_reason();

}  // namespace rlh::comm_nccl
