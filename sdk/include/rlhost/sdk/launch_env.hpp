// Who started this process, and as which rank: read from the launcher's environment variables
// (static library rlh_parallel). rlhost has no launcher of its own; it runs under
//
//   mpirun -np N rlhost ...        OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE
//   srun rlhost ...                SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID,
//                                  SLURM_STEP_NUM_NODES (srun steps only: a batch script's own
//                                  SLURM_NTASKS describes the allocation, not this process)
//   torchrun / env rendezvous      RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
//                                  MASTER_PORT
//
// or alone (rank 0 of 1). The first that is present wins, in that order. A pure function of an
// environment lookup, so it is unit-tested without launching anything.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace rlh::sdk {

enum class Launcher { none, mpirun, srun, env };

struct LaunchEnv {
  Launcher launcher = Launcher::none;
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;  // ranks on this node; 0 when the launcher does not say
  int num_nodes = 0;   // 0 when the launcher does not say
  // An MPI runtime can start here (mpirun, or srun with a PMIx/PMI-2 plugin).
  bool mpi_runtime = false;
  // The rendezvous address of env launches (MASTER_ADDR / MASTER_PORT), when set.
  std::string master_addr;
  int master_port = 0;
  // Variables of another launcher that disagree with the one used ("RANK=3 is ignored: ...").
  std::vector<std::string> notes;

  // "mpirun (OMPI_COMM_WORLD_SIZE=4)", "srun (SLURM_STEP_NUM_TASKS=8)", "torchrun-style env
  // (WORLD_SIZE=2)", "no launcher".
  std::string describe() const;
};

const char* launcher_name(Launcher l);

using GetEnv = std::function<const char*(const char*)>;

// Reads the environment through `getenv` (default: the process's). Throws
// rlh::sdk::Error(INVALID_ARGUMENT) naming the variable when a value is not a number in range
// ("environment variable WORLD_SIZE='x' is not a positive integer", "RANK=4 is not below
// WORLD_SIZE=4"). Whether an env launch has the MASTER_ADDR/MASTER_PORT it needs is for the
// communicator that rendezvous there to check.
LaunchEnv detect_launch(const GetEnv& getenv = nullptr);

// The accelerator a process takes when its config names a kind of device without an index
// (`policy.device: cuda`, or `auto` choosing the GPU): its local rank on the node modulo the
// devices it sees, so `mpirun -np 8` / `srun` / torchrun on an 8-GPU node puts one rank on each
// GPU (torchrun's LOCAL_RANK convention), ranks beyond the devices share them in turn (several
// ranks on one GPU, as the tests run), and a launcher that hides all but one device from each
// process (CUDA_VISIBLE_DEVICES, srun --gpus-per-task) gets device 0. 0 without devices.
int local_device(int device_count, const LaunchEnv& env);

}  // namespace rlh::sdk
