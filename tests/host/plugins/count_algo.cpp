// A test algorithm: runs `count_algo.steps` steps, each reporting train/loss = 1/step and
// train/reward = step through the host's metric service, and polls cancellation. Used to test
// rlhost_run, the key check for algorithm-owned keys, and the host's metric loggers.
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "rlhost/algorithm.h"
#include "rlhost/sdk/plugin.hpp"

namespace {

struct CountAlgo {
  rlh::sdk::Host host;
  int64_t steps = 3;
  bool fail = false;
};

rlh_status* create(const rlh_host_api* host, const char* cfg, size_t len, rlh_algorithm** out) {
  return rlh::sdk::guard(host->make_status, [&] {
    auto a = std::make_unique<CountAlgo>();
    a->host = rlh::sdk::Host(host);
    auto j = nlohmann::json::parse(std::string(cfg, len));
    if (j.contains("count_algo")) {
      a->steps = j["count_algo"].value("steps", int64_t{3});
      a->fail = j["count_algo"].value("fail", false);
    }
    *out = reinterpret_cast<rlh_algorithm*>(a.release());
  });
}

void destroy(rlh_algorithm* self) { delete reinterpret_cast<CountAlgo*>(self); }

rlh_status* run(rlh_algorithm* self) {
  auto* a = reinterpret_cast<CountAlgo*>(self);
  return rlh::sdk::guard(a->host.make_status(), [&] {
    a->host.metric("rlhost/total_steps", static_cast<double>(a->steps), 0);
    for (int64_t step = 1; step <= a->steps; ++step) {
      if (a->host.cancelled()) throw rlh::sdk::Error(RLH_E_CANCELLED, "cancelled at step " + std::to_string(step));
      a->host.metric("train/loss", 1.0 / static_cast<double>(step), step);
      a->host.metric("train/reward", static_cast<double>(step), step);
      a->host.metric("rlhost/step_finished", 0, step);
    }
    if (a->fail) throw rlh::sdk::Error(RLH_E_ABORTED, "count_algo was told to fail");
  });
}

const rlh_algorithm_api kApi = {RLH_STRUCT_SIZE(rlh_algorithm_api, run), create, destroy, run};
const char* const kKeys[] = {"count_algo.*", nullptr};
const rlh_component_desc kAlgo = rlh::sdk::component_desc(RLH_KIND_ALGORITHM, "count", "0.1.0",
    RLH_ALGORITHM_API_VERSION_MAJOR, RLH_ALGORITHM_API_VERSION_MINOR, &kApi, "test algorithm", kKeys);
const rlh_component_desc* const kComponents[] = {&kAlgo};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("count_algo", "0.1.0", "rlhost tests", kComponents))
