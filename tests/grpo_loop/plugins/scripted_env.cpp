// A test ENVIRONMENT `scripted` whose turns follow the row (metadata), for the multi-turn rollout
// tests: each turn scores `reward`, answers `obs` (with the turn number appended when `numbered`)
// and ends the episode after `done_after` turns. `bad` makes it misbehave the way a broken
// environment could: "nan" (a NaN reward), "done7" (done = 7), "index" (an observation for a
// sample outside the batch), "huge" (a 2 MiB observation), "garbage_done" (done left unwritten),
// "empty_stop" (an empty stop string). `stop`: a stop string for the next turn.
#include <cmath>
#include <string>

#include <nlohmann/json.hpp>

#include "rlhost/environment.h"
#include "rlhost/sdk/plugin.hpp"

namespace {

using json = nlohmann::json;
using rlh::sdk::Error;

struct Env {
  rlh::sdk::MakeStatusFn make = nullptr;
};

rlh_status* create(const rlh_host_api* host, const char*, size_t, rlh_environment** out) {
  auto* e = new Env;
  e->make = host != nullptr ? host->make_status : nullptr;
  *out = reinterpret_cast<rlh_environment*>(e);
  return nullptr;
}

void destroy(rlh_environment* self) { delete reinterpret_cast<Env*>(self); }

rlh_status* reward_names(rlh_environment* self, rlh_write_fn write, void* user) {
  (void)self;
  write(user, "[\"reward\"]", 10);
  return nullptr;
}

rlh_status* score(rlh_environment* self, const rlh_env_sample* samples, size_t n, rlh_env_result* result) {
  auto* env = reinterpret_cast<Env*>(self);
  return rlh::sdk::guard(env->make, [&] {
    for (size_t i = 0; i < n; ++i) {
      const json meta = json::parse(std::string(samples[i].metadata_json, samples[i].metadata_len));
      const int64_t turn = static_cast<int64_t>(meta.value("rlh_history", json::array()).size());
      const std::string bad = meta.value("bad", "");
      double reward = meta.value("reward", 0.0);
      if (bad == "nan") reward = std::nan("");
      for (size_t r = 0; r < result->num_rewards; ++r) result->rewards[i * result->num_rewards + r] = reward;
      if (bad != "garbage_done") result->done[i] = turn + 1 >= meta.value("done_after", 1000) ? 1 : 0;
      if (bad == "done7") result->done[i] = 7;
      std::string obs = meta.value("obs", "");
      if (meta.value("numbered", false)) obs += std::to_string(turn);
      if (bad == "huge") obs.assign(size_t{2} << 20, '1');
      if (result->observation != nullptr && !obs.empty())
        result->observation(result->user, bad == "index" ? n + 5 : i, obs.data(), obs.size());
      if (meta.contains("stop") && RLH_HAS_FIELD(result, rlh_env_result, stop_strings) && result->stop_strings != nullptr) {
        const std::string stop = meta["stop"].get<std::string>();
        const char* p = stop.c_str();
        const size_t len = bad == "empty_stop" ? 0 : stop.size();
        result->stop_strings(result->user, i, &p, &len, 1);
      }
    }
  });
}

constexpr rlh_environment_api kApi = {RLH_STRUCT_SIZE(rlh_environment_api, score), create, destroy, reward_names,
                                      score};
const rlh_component_desc kEnv = rlh::sdk::component_desc(RLH_KIND_ENVIRONMENT, "scripted", "0.1.0",
                                                         RLH_ENVIRONMENT_API_VERSION_MAJOR,
                                                         RLH_ENVIRONMENT_API_VERSION_MINOR, &kApi, "test: scripted turns");
const rlh_component_desc* const kComponents[] = {&kEnv};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("scripted_env", "0.1.0", "rlhost tests", kComponents, "scripted multi-turn env"))
