// An environment plugin written against the installed rlhost SDK: rewards a response with 1 when
// it contains the row's keyword (metadata {"keyword": "..."}), else 0. It shows the whole recipe:
// a C table of functions, C++ inside behind rlh::sdk::guard, and one RLH_DEFINE_PLUGIN.
#include <string>

#include <nlohmann/json.hpp>

#include "rlhost/environment.h"
#include "rlhost/sdk/plugin.hpp"

namespace {

// The instance behind the opaque rlh_environment handle.
struct KeywordEnv {
  rlh::sdk::Host host;
  bool case_sensitive = true;
};

rlh_status* create(const rlh_host_api* host, const char* config_json, size_t config_len, rlh_environment** out) {
  return rlh::sdk::guard(host ? host->make_status : nullptr, [&] {
    auto env = std::make_unique<KeywordEnv>();
    env->host = rlh::sdk::Host(host);
    auto cfg = nlohmann::json::parse(std::string(config_json ? config_json : "{}", config_json ? config_len : 2));
    env->case_sensitive = cfg.value("case_sensitive", true);
    *out = reinterpret_cast<rlh_environment*>(env.release());
  });
}

void destroy(rlh_environment* self) { delete reinterpret_cast<KeywordEnv*>(self); }

rlh_status* reward_names(rlh_environment* self, rlh_write_fn write, void* user) {
  (void)self;
  static const char kNames[] = "[\"reward\"]";
  write(user, kNames, sizeof(kNames) - 1);
  return nullptr;
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

rlh_status* score(rlh_environment* self, const rlh_env_sample* samples, size_t n, rlh_env_result* result) {
  auto* env = reinterpret_cast<KeywordEnv*>(self);
  return rlh::sdk::guard(env->host.make_status(), [&] {
    for (size_t i = 0; i < n; ++i) {
      const rlh_env_sample& s = samples[i];
      std::string keyword;
      if (s.metadata_json != nullptr)
        keyword = nlohmann::json::parse(std::string(s.metadata_json, s.metadata_len)).value("keyword", "");
      if (keyword.empty()) throw rlh::sdk::Error(RLH_E_INVALID_ARGUMENT, "sample " + std::to_string(i) + " has no 'keyword' in its metadata");
      std::string response(s.response, s.response_len);
      if (!env->case_sensitive) { response = lower(response); keyword = lower(keyword); }
      for (size_t r = 0; r < result->num_rewards; ++r) result->rewards[i * result->num_rewards + r] = response.find(keyword) != std::string::npos ? 1.0 : 0.0;
      result->done[i] = 1;
    }
  });
}

const rlh_environment_api kApi = {
    RLH_STRUCT_SIZE(rlh_environment_api, score), create, destroy, reward_names, score,
};
const char* const kKeys[] = {"env.keyword.*", nullptr};
const rlh_component_desc kEnv = rlh::sdk::component_desc(
    RLH_KIND_ENVIRONMENT, "keyword", "1.0.0", RLH_ENVIRONMENT_API_VERSION_MAJOR, RLH_ENVIRONMENT_API_VERSION_MINOR,
    &kApi, "reward 1 when the response contains the row's keyword", kKeys);
const rlh_component_desc* const kComponents[] = {&kEnv};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("keyword_env", "1.0.0", "rlhost examples", kComponents,
                                        "an out-of-tree example plugin"))
