// Fixture: a C++ plugin written with the SDK whose component callbacks throw. Every C entry point
// goes through rlh::sdk::guard, which must turn the exception into a status (code from the
// exception type, message from what()) so nothing unwinds across the C boundary; the host and
// the caller keep running.
//
// Components: environment "throwing_env" (score throws std::runtime_error, reward_names throws
// rlh::sdk::Error(FAILED_PRECONDITION), create with {"throw": true} throws std::bad_alloc) and
// dataset "throwing_rows" (get throws std::out_of_range for every row, size works).
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>

#include "rlhost/dataset.h"
#include "rlhost/environment.h"
#include "rlhost/sdk/plugin.hpp"
#include "rlhost/sdk/status.hpp"

namespace {

using rlh::sdk::guard;

struct Env {
  const rlh_host_api* host;
};

rlh::sdk::MakeStatusFn make_of(const rlh_host_api* host) { return rlh::sdk::Host(host).make_status(); }

}  // namespace

struct rlh_environment : Env {};
struct rlh_dataset : Env {};

namespace {

rlh_status* env_create(const rlh_host_api* host, const char* cfg, size_t len, rlh_environment** out) noexcept {
  return guard(make_of(host), [&] {
    *out = nullptr;
    if (std::string_view(cfg != nullptr ? cfg : "", cfg != nullptr ? len : 0).find("\"throw\": true") !=
        std::string_view::npos)
      throw std::bad_alloc();
    *out = new rlh_environment{{host}};
  });
}

void env_destroy(rlh_environment* self) noexcept { delete self; }

rlh_status* env_reward_names(rlh_environment* self, rlh_write_fn, void*) noexcept {
  return guard(make_of(self->host), [&] {
    throw rlh::sdk::Error(RLH_E_FAILED_PRECONDITION, "throwing_env: reward_names refuses on purpose");
  });
}

rlh_status* env_score(rlh_environment* self, const rlh_env_sample*, size_t n, rlh_env_result*) noexcept {
  return guard(make_of(self->host), [&]() -> rlh_status* {
    throw std::runtime_error("throwing_env: score exploded on " + std::to_string(n) + " samples");
  });
}

constexpr rlh_environment_api kEnvApi = {RLH_STRUCT_SIZE(rlh_environment_api, score), env_create, env_destroy,
                                         env_reward_names, env_score};

rlh_status* ds_create(const rlh_host_api* host, const char*, size_t, rlh_dataset** out) noexcept {
  return guard(make_of(host), [&] { *out = new rlh_dataset{{host}}; });
}
void ds_destroy(rlh_dataset* self) noexcept { delete self; }
int64_t ds_size(const rlh_dataset*) noexcept { return 2; }
rlh_status* ds_get(const rlh_dataset* self, int64_t index, rlh_write_fn, void*) noexcept {
  return guard(make_of(self->host), [&] {
    throw std::out_of_range("throwing_rows: row " + std::to_string(index) + " is cursed");
  });
}

constexpr rlh_dataset_api kDsApi = {RLH_STRUCT_SIZE(rlh_dataset_api, get), ds_create, ds_destroy, ds_size,
                                    ds_get};

constexpr rlh_component_desc kEnv = rlh::sdk::component_desc(
    RLH_KIND_ENVIRONMENT, "throwing_env", "1.0.0", RLH_ENVIRONMENT_API_VERSION_MAJOR,
    RLH_ENVIRONMENT_API_VERSION_MINOR, &kEnvApi, "callbacks throw; the SDK guard converts");
constexpr rlh_component_desc kDs = rlh::sdk::component_desc(RLH_KIND_DATASET, "throwing_rows", "1.0.0",
                                                            RLH_DATASET_API_VERSION_MAJOR,
                                                            RLH_DATASET_API_VERSION_MINOR, &kDsApi);
constexpr const rlh_component_desc* kComponents[] = {&kEnv, &kDs};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("throwing", "1.0.0", "rlhost tests", kComponents,
                                        "C++ plugin whose callbacks throw"))
