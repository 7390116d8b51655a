// The launcher's environment (launch_env.hpp).
#include "rlhost/sdk/launch_env.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include "rlhost/sdk/status.hpp"

namespace rlh::sdk {
namespace {

struct Reader {
  const GetEnv& get;

  const char* raw(const char* name) const {
    const char* v = get(name);
    return (v != nullptr && *v != '\0') ? v : nullptr;
  }
  bool has(const char* name) const { return raw(name) != nullptr; }

  // A non-negative integer (min 1 when `positive`), or `fallback` when unset.
  int integer(const char* name, int fallback, bool positive) const {
    const char* v = raw(name);
    if (v == nullptr) return fallback;
    errno = 0;
    char* end = nullptr;
    const long long x = std::strtoll(v, &end, 10);
    if (errno != 0 || end == v || *end != '\0' || x < (positive ? 1 : 0) || x > (1 << 24))
      throw Error(RLH_E_INVALID_ARGUMENT, std::string("environment variable ") + name + "='" + v + "' is not a " +
                                              (positive ? "positive" : "non-negative") + " integer");
    return static_cast<int>(x);
  }
};

void check_below(const char* a, int av, const char* b, int bv) {
  if (av >= bv)
    throw Error(RLH_E_INVALID_ARGUMENT, std::string("environment variable ") + a + "=" + std::to_string(av) +
                                            " is not below " + b + "=" + std::to_string(bv));
}

}  // namespace

int local_device(int device_count, const LaunchEnv& env) {
  if (device_count <= 0) return 0;
  return std::max(env.local_rank, 0) % device_count;
}

const char* launcher_name(Launcher l) {
  switch (l) {
    case Launcher::none: return "no launcher";
    case Launcher::mpirun: return "mpirun";
    case Launcher::srun: return "srun";
    case Launcher::env: return "torchrun-style env";
  }
  return "?";
}

std::string LaunchEnv::describe() const {
  switch (launcher) {
    case Launcher::none: return "no launcher (one rank)";
    case Launcher::mpirun: return "mpirun (OMPI_COMM_WORLD_SIZE=" + std::to_string(size) + ")";
    case Launcher::srun: return "srun (SLURM_STEP_NUM_TASKS=" + std::to_string(size) + ")";
    case Launcher::env: return "torchrun-style env (WORLD_SIZE=" + std::to_string(size) + ")";
  }
  return "?";
}

LaunchEnv detect_launch(const GetEnv& getenv_fn) {
  const GetEnv get = getenv_fn ? getenv_fn : GetEnv([](const char* n) { return std::getenv(n); });
  const Reader r{get};
  LaunchEnv e;
  if (r.has("OMPI_COMM_WORLD_SIZE")) {
    e.launcher = Launcher::mpirun;
    e.size = r.integer("OMPI_COMM_WORLD_SIZE", 1, true);
    e.rank = r.integer("OMPI_COMM_WORLD_RANK", 0, false);
    e.local_rank = r.integer("OMPI_COMM_WORLD_LOCAL_RANK", 0, false);
    e.local_size = r.integer("OMPI_COMM_WORLD_LOCAL_SIZE", 0, true);
    e.mpi_runtime = true;
    check_below("OMPI_COMM_WORLD_RANK", e.rank, "OMPI_COMM_WORLD_SIZE", e.size);
    if (e.local_size > 0) check_below("OMPI_COMM_WORLD_LOCAL_RANK", e.local_rank, "OMPI_COMM_WORLD_LOCAL_SIZE", e.local_size);
  } else if (r.has("SLURM_STEP_NUM_TASKS") && r.has("SLURM_PROCID")) {
    e.launcher = Launcher::srun;
    e.size = r.integer("SLURM_STEP_NUM_TASKS", 1, true);
    e.rank = r.integer("SLURM_PROCID", 0, false);
    e.local_rank = r.integer("SLURM_LOCALID", 0, false);
    e.num_nodes = r.integer("SLURM_STEP_NUM_NODES", 0, true);
    // Tasks per node only when uniform ("4", not "4(x2),3").
    const char* tpn = r.raw("SLURM_STEP_TASKS_PER_NODE");
    if (tpn != nullptr && std::string(tpn).find_first_not_of("0123456789") == std::string::npos)
      e.local_size = r.integer("SLURM_STEP_TASKS_PER_NODE", 0, true);
    else if (tpn != nullptr && std::string(tpn).find("(x") != std::string::npos && std::string(tpn).find(',') == std::string::npos)
      e.local_size = std::atoi(tpn);  // "4(x2)": 4 on each of 2 nodes
    else
      e.local_size = 0;
    // srun starts MPI ranks only through a PMIx or PMI-2 plugin (srun --mpi=pmix).
    e.mpi_runtime = r.has("PMIX_RANK") || r.has("PMI_RANK");
    check_below("SLURM_PROCID", e.rank, "SLURM_STEP_NUM_TASKS", e.size);
  } else if (r.has("WORLD_SIZE") || r.has("RANK")) {
    e.launcher = Launcher::env;
    e.size = r.integer("WORLD_SIZE", 1, true);
    e.rank = r.integer("RANK", 0, false);
    e.local_rank = r.integer("LOCAL_RANK", 0, false);
    e.local_size = r.integer("LOCAL_WORLD_SIZE", 0, true);
    check_below("RANK", e.rank, "WORLD_SIZE", e.size);
    if (e.local_size > 0) check_below("LOCAL_RANK", e.local_rank, "LOCAL_WORLD_SIZE", e.local_size);
  }
  if (e.launcher == Launcher::none) e.num_nodes = 1;  // one process, on this node
  if (e.num_nodes == 0 && e.local_size > 0 && e.size % e.local_size == 0 && e.launcher != Launcher::none)
    e.num_nodes = e.size / e.local_size;
  if (const char* a = r.raw("MASTER_ADDR")) e.master_addr = a;
  if (r.has("MASTER_PORT")) {
    e.master_port = r.integer("MASTER_PORT", 0, true);
    if (e.master_port > 65535)
      throw Error(RLH_E_INVALID_ARGUMENT, "environment variable MASTER_PORT=" + std::to_string(e.master_port) + " is not a TCP port");
  }
  // Another launcher's variables that say something else are noted (not errors: a shell may
  // carry stale exports), so the log shows which one was believed.
  if (e.launcher != Launcher::env && r.has("WORLD_SIZE")) {
    const int ws = r.integer("WORLD_SIZE", 1, true);
    if (ws != e.size)
      e.notes.push_back("WORLD_SIZE=" + std::to_string(ws) + " is ignored: the job was started by " + e.describe());
  }
  return e;
}

}  // namespace rlh::sdk
