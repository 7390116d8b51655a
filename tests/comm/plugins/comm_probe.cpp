// A test algorithm for the failure tests: `comm_probe.steps` steps of collectives on the
// host's world communicator and on tp/dp groups split from it (sdk::make_parallel_comms),
// checking every result, with a rank told to misbehave at `comm_probe.at_step`:
//   sleep_rank / sleep_s   sleeps before the step's collective (a stuck rank)
//   kill_rank              kills itself with SIGKILL (a dead rank)
//   fail_rank              returns an error (a rank that stops with its own message)
// With `comm_probe.recv_any: true` every step starts with each rank but 0 sending rank 0 a message,
// which rank 0 takes with recv_any (COMM 0.2) in whatever order they come.
// Run by rlhost under mpirun (tests/comm/run_failure_tests.sh).
#include <csignal>
#include <memory>
#include <string>
#include <thread>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "rlhost/algorithm.h"
#include "rlhost/sdk/comm.hpp"
#include "rlhost/sdk/plugin.hpp"

namespace {

using rlh::sdk::Error;

struct Probe {
  rlh::sdk::Host host;
  int64_t steps = 3, at_step = 1, tp = 1;
  int64_t sleep_rank = -1, kill_rank = -1, fail_rank = -1;
  double sleep_s = 0;
  bool recv_any = false;
};

rlh_status* create(const rlh_host_api* host, const char* cfg, size_t len, rlh_algorithm** out) {
  return rlh::sdk::guard(host->make_status, [&] {
    auto a = std::make_unique<Probe>();
    a->host = rlh::sdk::Host(host);
    const auto j = nlohmann::json::parse(std::string(cfg, len));
    if (j.contains("comm_probe")) {
      const auto& p = j["comm_probe"];
      a->steps = p.value("steps", a->steps);
      a->at_step = p.value("at_step", a->at_step);
      a->tp = p.value("tp", a->tp);
      a->sleep_rank = p.value("sleep_rank", a->sleep_rank);
      a->sleep_s = p.value("sleep_s", a->sleep_s);
      a->kill_rank = p.value("kill_rank", a->kill_rank);
      a->fail_rank = p.value("fail_rank", a->fail_rank);
      a->recv_any = p.value("recv_any", a->recv_any);
    }
    *out = reinterpret_cast<rlh_algorithm*>(a.release());
  });
}

void destroy(rlh_algorithm* self) { delete reinterpret_cast<Probe*>(self); }

void expect(bool ok, const std::string& what) {
  if (!ok) throw Error(RLH_E_INTERNAL, "comm_probe: wrong result: " + what);
}

rlh_status* run(rlh_algorithm* self) {
  auto* a = reinterpret_cast<Probe*>(self);
  return rlh::sdk::guard(a->host.make_status(), [&] {
    const rlh::sdk::Comm world = rlh::sdk::Comm::world(a->host);
    const int rank = world.rank(), size = world.size();
    rlh::sdk::ParallelSizes sizes;
    sizes.tp = a->tp;
    const auto groups = rlh::sdk::make_parallel_comms(world, sizes, {rlh::sdk::GroupKind::tp, rlh::sdk::GroupKind::dp});
    const auto& tp = groups.of(rlh::sdk::GroupKind::tp);
    const auto& dp = groups.of(rlh::sdk::GroupKind::dp);
    a->host.metric("rlhost/total_steps", static_cast<double>(a->steps), 0);
    for (int64_t step = 0; step < a->steps; ++step) {
      if (step == a->at_step) {
        if (rank == a->sleep_rank) std::this_thread::sleep_for(std::chrono::duration<double>(a->sleep_s));
        if (rank == a->kill_rank) ::raise(SIGKILL);
        if (rank == a->fail_rank) throw Error(RLH_E_ABORTED, "comm_probe: rank " + std::to_string(rank) + " was told to fail");
      }
      if (a->recv_any && size > 1) {
        // Rank 0 serves every other rank, whichever sends first: each exactly once a step.
        std::vector<int64_t> m{rank, step};
        const int64_t two = 2;
        const rlh_tensor t = rlh::sdk::host_tensor(m.data(), rlh::sdk::dtype_of<int64_t>(), std::span<const int64_t>(&two, 1));
        if (rank != 0) {
          world.send(t, 0);
        } else {
          std::vector<int> seen(static_cast<size_t>(size), 0);
          for (int i = 1; i < size; ++i) {
            const int from = world.recv_any(t);
            expect(from > 0 && from < size && m[0] == from && m[1] == step && seen[static_cast<size_t>(from)]++ == 0,
                   "recv_any: message (" + std::to_string(m[0]) + ", " + std::to_string(m[1]) + ") from rank " +
                       std::to_string(from) + " at step " + std::to_string(step));
          }
        }
      }
      std::vector<double> v(1024, static_cast<double>(rank + step));
      world.all_reduce(std::span<double>(v), RLH_REDUCE_SUM);
      const double want = size * (size - 1) / 2.0 + static_cast<double>(size * step);
      expect(v.front() == want && v.back() == want, "world sum " + std::to_string(v.front()) + " != " + std::to_string(want));
      std::vector<int64_t> t{rank};
      tp.all_reduce(std::span<int64_t>(t), RLH_REDUCE_SUM);
      int64_t tp_want = 0;
      for (int r : groups.mine.of(rlh::sdk::GroupKind::tp).ranks) tp_want += r;
      expect(t[0] == tp_want, "tp sum");
      std::vector<int64_t> d{rank};
      dp.all_reduce(std::span<int64_t>(d), RLH_REDUCE_MAX);
      expect(d[0] == groups.mine.of(rlh::sdk::GroupKind::dp).ranks.back(), "dp max");
      a->host.metric("probe/sum", v.front(), step);
      a->host.metric("rlhost/step_finished", 0, step);
    }
    a->host.info("comm_probe: rank " + std::to_string(rank) + " of " + std::to_string(size) + " finished " +
                 std::to_string(a->steps) + " steps");
  });
}

const rlh_algorithm_api kApi = {RLH_STRUCT_SIZE(rlh_algorithm_api, run), create, destroy, run};
const char* const kKeys[] = {"comm_probe.*", nullptr};
const rlh_component_desc kAlgo = rlh::sdk::component_desc(RLH_KIND_ALGORITHM, "comm_probe", "0.1.0",
    RLH_ALGORITHM_API_VERSION_MAJOR, RLH_ALGORITHM_API_VERSION_MINOR, &kApi, "collectives with a misbehaving rank", kKeys);
const rlh_component_desc* const kComponents[] = {&kAlgo};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("comm_probe", "0.1.0", "rlhost tests", kComponents))
