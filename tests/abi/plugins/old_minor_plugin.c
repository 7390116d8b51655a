/* A plugin built from a frozen copy of older ABI headers (abi/frozen/<version>/), one library per
 * frozen version: when the ABI moves on, these keep proving that plugins built against every
 * earlier minor of the current major still load and work (old plugin x new host).
 *
 * It must only use what its frozen headers declare. Component: environment
 * "old_minor_length_<major>_<minor>", reward = response length in bytes. */
#include <stdio.h>
#include <string.h>

#include "rlhost/environment.h"
#include "rlhost/plugin.h"

#if !defined(RLH_FROZEN_MAJOR) || !defined(RLH_FROZEN_MINOR)
#error "build with -DRLH_FROZEN_MAJOR=<m> -DRLH_FROZEN_MINOR=<n> and -I abi/frozen/<m>.<n> first"
#endif
#if RLH_ABI_VERSION_MAJOR != RLH_FROZEN_MAJOR || RLH_ABI_VERSION_MINOR != RLH_FROZEN_MINOR
#error "old_minor_plugin.c picked up the current headers instead of abi/frozen/<m>.<n>"
#endif

#define STR2(x) #x
#define STR(x) STR2(x)
#define OLD_NAME "old_minor_" STR(RLH_FROZEN_MAJOR) "_" STR(RLH_FROZEN_MINOR)

struct rlh_environment {
  const rlh_host_api* host;
};

static rlh_environment g_env;

static rlh_status* env_create(const rlh_host_api* host, const char* config_json, size_t config_len,
                              rlh_environment** out) {
  (void)config_json;
  (void)config_len;
  g_env.host = host;
  *out = &g_env;
  return NULL;
}

static void env_destroy(rlh_environment* self) { (void)self; }

static rlh_status* env_reward_names(rlh_environment* self, rlh_write_fn write, void* user) {
  (void)self;
  write(user, "[\"reward\"]", 10);
  return NULL;
}

static rlh_status* env_score(rlh_environment* self, const rlh_env_sample* samples, size_t n,
                             rlh_env_result* result) {
  size_t i, r;
  (void)self;
  for (i = 0; i < n; ++i) {
    for (r = 0; r < result->num_rewards; ++r)
      result->rewards[i * result->num_rewards + r] = (double)samples[i].response_len;
    result->done[i] = 1;
  }
  return NULL;
}

static const rlh_environment_api k_api = {RLH_STRUCT_SIZE(rlh_environment_api, score), env_create,
                                          env_destroy, env_reward_names, env_score};

static const rlh_component_desc k_env = {RLH_STRUCT_SIZE(rlh_component_desc, config_keys),
                                         RLH_KIND_ENVIRONMENT,
                                         0,
                                         OLD_NAME "_length",
                                         "1.0.0",
                                         RLH_ENVIRONMENT_API_VERSION_MAJOR,
                                         RLH_ENVIRONMENT_API_VERSION_MINOR,
                                         &k_api,
                                         "reward = response length (built from frozen headers)",
                                         NULL};

static const rlh_component_desc* const k_components[] = {&k_env};

static rlh_status* old_init(const rlh_host_api* host) {
  const char msg[] = OLD_NAME ": init";
  host->log(host->ctx, RLH_LOG_INFO, msg, sizeof msg - 1);
  return NULL;
}

static const rlh_plugin_desc k_desc = {RLH_STRUCT_SIZE(rlh_plugin_desc, shutdown),
                                       RLH_ABI_VERSION_MAJOR,
                                       RLH_ABI_VERSION_MINOR,
                                       OLD_NAME,
                                       "1.0.0",
                                       "rlhost tests",
                                       "Apache-2.0",
                                       "plugin built from frozen ABI headers",
                                       k_components,
                                       1,
                                       NULL,
                                       old_init,
                                       NULL};

__attribute__((visibility("default"))) const rlh_plugin_desc* rlh_plugin_entry(uint32_t major, uint32_t minor);

const rlh_plugin_desc* rlh_plugin_entry(uint32_t major, uint32_t minor) {
  (void)major;
  (void)minor;
  return &k_desc;
}
