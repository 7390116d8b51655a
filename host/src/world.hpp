// The host's side of parallel runs: which launcher started this process and as which rank, the
// check of NeMo-RL's `cluster` section against that, and the start of the world communicator
// with a bounded barrier, so a mismatched world fails at start with one line instead of hanging.
#pragma once

#include <string>

#include "config.hpp"
#include "rlhost/sdk/launch_env.hpp"

namespace rlh::host {

// cluster.num_nodes x cluster.gpus_per_node against the launcher's world. Throws
// sdk::Error(INVALID_ARGUMENT) naming both ("cluster.num_nodes x cluster.gpus_per_node = 1 x 4
// = 4 (from FILE), but mpirun (OMPI_COMM_WORLD_SIZE=2) started 2 ranks"). gpus_per_node 0 (a
// CPU job) constrains only the node count. `origin_of` names where a key was set.
void check_cluster(const Json& resolved, const sdk::LaunchEnv& launch,
                   const std::function<std::string(const std::string&)>& origin_of);

// rlhost.comm_timeout_s in milliseconds (0 when unset); throws naming the key when it is not a
// positive number.
int64_t comm_timeout_ms(const Json& resolved);

}  // namespace rlh::host
