// The launcher's environment (sdk/launch_env.hpp) and the TCP rendezvous (sdk/rendezvous.hpp):
// ranks as threads on the loopback interface, a missing rank, a mismatched world.
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <thread>

#include "rlhost/sdk/launch_env.hpp"
#include "rlhost/sdk/rendezvous.hpp"
#include "rlhost/sdk/status.hpp"

namespace {

using rlh::sdk::Error;
using rlh::sdk::Launcher;
using Env = std::map<std::string, std::string>;

rlh::sdk::LaunchEnv detect(const Env& env) {
  return rlh::sdk::detect_launch([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

std::string error_of(const Env& env) {
  try {
    detect(env);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), RLH_E_INVALID_ARGUMENT);
    return e.what();
  }
  return "(no error)";
}

TEST(LaunchEnv, NoLauncher) {
  const auto e = detect({});
  EXPECT_EQ(e.launcher, Launcher::none);
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.size, 1);
  EXPECT_FALSE(e.mpi_runtime);
  EXPECT_EQ(e.num_nodes, 1);
  EXPECT_EQ(e.describe(), "no launcher (one rank)");
}

TEST(LaunchEnv, Mpirun) {
  const auto e = detect({{"OMPI_COMM_WORLD_SIZE", "4"},
                         {"OMPI_COMM_WORLD_RANK", "3"},
                         {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                         {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                         {"WORLD_SIZE", "8"}});
  EXPECT_EQ(e.launcher, Launcher::mpirun);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_size, 2);
  EXPECT_EQ(e.num_nodes, 2);
  EXPECT_TRUE(e.mpi_runtime);
  EXPECT_EQ(e.describe(), "mpirun (OMPI_COMM_WORLD_SIZE=4)");
  ASSERT_EQ(e.notes.size(), 1u);
  EXPECT_EQ(e.notes[0], "WORLD_SIZE=8 is ignored: the job was started by mpirun (OMPI_COMM_WORLD_SIZE=4)");
}

TEST(LaunchEnv, Srun) {
  const Env base = {{"SLURM_STEP_NUM_TASKS", "8"}, {"SLURM_PROCID", "5"},          {"SLURM_LOCALID", "1"},
                    {"SLURM_STEP_NUM_NODES", "2"}, {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"}, {"SLURM_NTASKS", "8"}};
  auto e = detect(base);
  EXPECT_EQ(e.launcher, Launcher::srun);
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_size, 4);
  EXPECT_EQ(e.num_nodes, 2);
  EXPECT_FALSE(e.mpi_runtime);  // srun without --mpi=pmix
  Env pmix = base;
  pmix["PMIX_RANK"] = "5";
  EXPECT_TRUE(detect(pmix).mpi_runtime);
  // A batch script's own environment (no srun step) is not a launch.
  EXPECT_EQ(detect({{"SLURM_NTASKS", "8"}, {"SLURM_PROCID", "0"}}).launcher, Launcher::none);
  // Uneven tasks per node: not stated.
  Env uneven = base;
  uneven["SLURM_STEP_TASKS_PER_NODE"] = "4(x1),3";
  EXPECT_EQ(detect(uneven).local_size, 0);
}

TEST(LaunchEnv, TorchrunStyle) {
  const auto e = detect({{"RANK", "2"},
                         {"WORLD_SIZE", "4"},
                         {"LOCAL_RANK", "0"},
                         {"LOCAL_WORLD_SIZE", "2"},
                         {"MASTER_ADDR", "node7"},
                         {"MASTER_PORT", "29500"}});
  EXPECT_EQ(e.launcher, Launcher::env);
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.size, 4);
  EXPECT_EQ(e.num_nodes, 2);
  EXPECT_EQ(e.master_addr, "node7");
  EXPECT_EQ(e.master_port, 29500);
  EXPECT_FALSE(e.mpi_runtime);
  EXPECT_EQ(e.describe(), "torchrun-style env (WORLD_SIZE=4)");
}

// "cuda" without an index: one rank a GPU by local rank, in turn when ranks outnumber the GPUs,
// device 0 where the launcher leaves each process one GPU or none is seen.
TEST(LaunchEnv, LocalDeviceFollowsTheLocalRank) {
  const auto on = [](const Env& env, int devices) { return rlh::sdk::local_device(devices, detect(env)); };
  const Env mpirun = {{"OMPI_COMM_WORLD_SIZE", "16"}, {"OMPI_COMM_WORLD_RANK", "13"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", "5"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "8"}};
  EXPECT_EQ(on(mpirun, 8), 5);
  EXPECT_EQ(on(mpirun, 4), 1);  // two ranks a GPU
  EXPECT_EQ(on(mpirun, 1), 0);  // CUDA_VISIBLE_DEVICES=one per process
  EXPECT_EQ(on(mpirun, 0), 0);
  const Env srun = {{"SLURM_STEP_NUM_TASKS", "8"}, {"SLURM_PROCID", "7"}, {"SLURM_LOCALID", "3"},
                    {"SLURM_STEP_NUM_NODES", "2"}};
  EXPECT_EQ(on(srun, 4), 3);
  const Env torchrun = {{"WORLD_SIZE", "4"}, {"RANK", "2"}, {"LOCAL_RANK", "2"}, {"MASTER_ADDR", "h"},
                        {"MASTER_PORT", "29500"}};
  EXPECT_EQ(on(torchrun, 8), 2);
  EXPECT_EQ(on({}, 8), 0);  // alone
}

TEST(LaunchEnv, BadValuesNameTheVariable) {
  EXPECT_EQ(error_of({{"WORLD_SIZE", "x"}, {"RANK", "0"}}), "environment variable WORLD_SIZE='x' is not a positive integer");
  EXPECT_EQ(error_of({{"WORLD_SIZE", "0"}, {"RANK", "0"}}), "environment variable WORLD_SIZE='0' is not a positive integer");
  EXPECT_EQ(error_of({{"WORLD_SIZE", "4"}, {"RANK", "4"}}), "environment variable RANK=4 is not below WORLD_SIZE=4");
  EXPECT_EQ(error_of({{"WORLD_SIZE", "4"}, {"RANK", "-1"}}), "environment variable RANK='-1' is not a non-negative integer");
  EXPECT_EQ(error_of({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "2"}}),
            "environment variable OMPI_COMM_WORLD_RANK=2 is not below OMPI_COMM_WORLD_SIZE=2");
  EXPECT_EQ(error_of({{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "2"}}),
            "environment variable LOCAL_RANK=3 is not below LOCAL_WORLD_SIZE=2");
  EXPECT_EQ(error_of({{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"MASTER_PORT", "70000"}}),
            "environment variable MASTER_PORT=70000 is not a TCP port");
  EXPECT_EQ(error_of({{"WORLD_SIZE", "99999999999"}}), "environment variable WORLD_SIZE='99999999999' is not a positive integer");
}

// ---- rendezvous ---------------------------------------------------------------------------------

int free_port() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  ::close(s);
  return port;
}

struct Outcome {
  std::vector<std::string> blobs;
  rlh_code code = RLH_OK;
  std::string error;
};

// Runs `ranks` of a world of `size` as threads; rank r sends "blob-r" (rank 2 a long one).
std::map<int, Outcome> run_ranks(const std::vector<int>& ranks, int size, std::chrono::milliseconds timeout,
                                 const std::map<int, int>& size_override = {}, const std::map<int, std::string>& tag_override = {}) {
  const int port = free_port();
  std::map<int, Outcome> out;
  for (int r : ranks) out[r];
  std::vector<std::thread> threads;
  for (int r : ranks) {
    threads.emplace_back([&, r] {
      rlh::sdk::RendezvousOptions o;
      o.addr = "127.0.0.1";
      o.port = port;
      o.rank = r;
      o.size = size_override.count(r) ? size_override.at(r) : size;
      o.timeout = timeout;
      o.tag = tag_override.count(r) ? tag_override.at(r) : "test";
      const std::string mine = r == 2 ? std::string(200000, 'x') : "blob-" + std::to_string(r);
      try {
        out[r].blobs = rlh::sdk::rendezvous_all_gather(o, mine);
      } catch (const Error& e) {
        out[r].code = e.code();
        out[r].error = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST(Rendezvous, AllGatherOfFourRanks) {
  const auto out = run_ranks({3, 1, 0, 2}, 4, std::chrono::seconds(20));
  for (const auto& [r, o] : out) {
    ASSERT_EQ(o.code, RLH_OK) << "rank " << r << ": " << o.error;
    ASSERT_EQ(o.blobs.size(), 4u);
    EXPECT_EQ(o.blobs[0], "blob-0");
    EXPECT_EQ(o.blobs[1], "blob-1");
    EXPECT_EQ(o.blobs[2], std::string(200000, 'x'));
    EXPECT_EQ(o.blobs[3], "blob-3");
  }
}

TEST(Rendezvous, OneRankNeedsNoNetwork) {
  rlh::sdk::RendezvousOptions o;
  o.tag = "solo";
  EXPECT_EQ(rlh::sdk::rendezvous_all_gather(o, "me"), std::vector<std::string>{"me"});
}

TEST(Rendezvous, MissingRankIsNamedOnEveryRank) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto out = run_ranks({0, 1, 3}, 4, std::chrono::milliseconds(1500));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 10.0);
  for (const auto& [r, o] : out) {
    EXPECT_EQ(o.code, RLH_E_DEADLINE_EXCEEDED) << "rank " << r;
    EXPECT_NE(o.error.find(": rank 2 of 4 did not arrive within 1.5 s"), std::string::npos) << "rank " << r << ": " << o.error;
  }
}

TEST(Rendezvous, NoRankZero) {
  const auto out = run_ranks({1}, 2, std::chrono::milliseconds(800));
  EXPECT_EQ(out.at(1).code, RLH_E_DEADLINE_EXCEEDED);
  EXPECT_NE(out.at(1).error.find("rank 1 of 2: rank 0 could not be reached within 0.8 s"), std::string::npos) << out.at(1).error;
  EXPECT_NE(out.at(1).error.find("MASTER_ADDR / MASTER_PORT"), std::string::npos);
}

TEST(Rendezvous, MismatchedWorldSizeIsNamed) {
  const auto out = run_ranks({0, 1, 2}, 3, std::chrono::seconds(3), {{2, 4}});
  EXPECT_EQ(out.at(0).code, RLH_E_INVALID_ARGUMENT);
  EXPECT_NE(out.at(0).error.find("rank 2 says the world has 4 ranks, rank 0 says 3"), std::string::npos) << out.at(0).error;
  // Rank 1 either registered before the mismatch (and hears it) or finds rank 0 gone.
  EXPECT_NE(out.at(1).code, RLH_OK);
  EXPECT_NE(out.at(2).code, RLH_OK);
}

TEST(Rendezvous, AnotherExchangeOnThePortIsRefused) {
  const auto out = run_ranks({0, 1}, 2, std::chrono::seconds(20), {}, {{1, "other job"}});
  EXPECT_EQ(out.at(0).code, RLH_E_INVALID_ARGUMENT);
  EXPECT_NE(out.at(0).error.find("rank 1 came for rendezvous 'other job'"), std::string::npos) << out.at(0).error;
  EXPECT_EQ(out.at(1).code, RLH_E_INVALID_ARGUMENT);
  EXPECT_EQ(out.at(1).error, out.at(0).error);
}

TEST(Rendezvous, BadOptions) {
  rlh::sdk::RendezvousOptions o;
  o.size = 2;
  o.rank = 2;
  EXPECT_THROW(rlh::sdk::rendezvous_all_gather(o, ""), Error);
  o.rank = 1;
  o.port = 0;
  try {
    rlh::sdk::rendezvous_all_gather(o, "");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("port 0 is not a TCP port (MASTER_PORT)"), std::string::npos);
  }
  o.port = 1234;
  try {
    rlh::sdk::rendezvous_all_gather(o, "");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no address for rank 0 (set MASTER_ADDR)"), std::string::npos);
  }
}

}  // namespace
