/* A plugin from the future: built for a newer minor of this major (abi_minor = current + 1),
 * whose plugin descriptor, component descriptors and interface tables are all LARGER than the
 * host knows, with struct_size saying so. Declares local struct types that embed the current ones
 * and append fields, exactly as the next minor's headers would.
 *
 * The host must accept it (same major), read only the fields it knows, and use its components.
 * Run under ASan, a host that copies `struct_size` bytes into its own smaller struct, or trusts
 * sizeof() of its own types for the plugin's arrays, is caught.
 *
 * It also carries a component of a kind this host does not know yet (kind 1000): the host must
 * list it as unusable and still load the plugin. And it plays the reader side of the rule: a
 * 0.(n+1) plugin checks RLH_HAS_FIELD before using a host-services slot a newer host would have.
 */
#include <string.h>

#include "rlhost/environment.h"
#include "rlhost/plugin.h"

/* What the next minor's headers would declare. */
typedef struct future_host_api {
  rlh_host_api base;
  void (*trace_event)(rlh_host_ctx* ctx, const char* name, size_t len); /* a newer slot */
} future_host_api;

typedef struct future_environment_api {
  rlh_environment_api base;
  rlh_status* (*score_streaming)(rlh_environment* self, const char* text, size_t len); /* newer slot */
  uint64_t capabilities;
} future_environment_api;

typedef struct future_component_desc {
  rlh_component_desc base;
  const rlh_named_value* attributes; /* newer field */
  size_t num_attributes;
  uint64_t future_flags;
} future_component_desc;

typedef struct future_plugin_desc {
  rlh_plugin_desc base;
  const rlh_named_value* attributes; /* newer fields */
  size_t num_attributes;
  const char* homepage;
  uint64_t future_flags;
} future_plugin_desc;

#define FUTURE_KIND_UNKNOWN 1000

static int g_host_has_trace_event = -1;

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
/* reward = 1 for a non-empty response; 0.5 when the host (wrongly) claimed the newer slot. */
static rlh_status* env_score(rlh_environment* self, const rlh_env_sample* samples, size_t n,
                             rlh_env_result* result) {
  size_t i, r;
  (void)self;
  for (i = 0; i < n; ++i) {
    double v = samples[i].response_len > 0 ? 1.0 : 0.0;
    if (g_host_has_trace_event != 0) v *= 0.5;
    for (r = 0; r < result->num_rewards; ++r) result->rewards[i * result->num_rewards + r] = v;
    result->done[i] = 1;
  }
  return NULL;
}
static rlh_status* env_score_streaming(rlh_environment* self, const char* text, size_t len) {
  (void)self;
  (void)text;
  (void)len;
  return NULL;
}

static const future_environment_api k_env_api = {
    {sizeof(future_environment_api), env_create, env_destroy, env_reward_names, env_score},
    env_score_streaming,
    0xffu};

static const rlh_named_value k_attr = {sizeof(rlh_named_value), "future_attribute", RLH_VALUE_INT64, 0,
                                       42, 0.0, NULL, NULL, NULL, 0};

static const future_component_desc k_env = {
    {sizeof(future_component_desc), RLH_KIND_ENVIRONMENT, 0, "future_env", "2.0.0",
     RLH_ENVIRONMENT_API_VERSION_MAJOR, RLH_ENVIRONMENT_API_VERSION_MINOR + 1, &k_env_api,
     "environment of a newer minor", NULL},
    &k_attr,
    1,
    0x1u};

static const uint64_t k_unknown_table[4] = {sizeof k_unknown_table, 0, 0, 0};
static const future_component_desc k_unknown = {
    {sizeof(future_component_desc), FUTURE_KIND_UNKNOWN, 0, "future_kind_component", "1.0.0", 0, 1,
     k_unknown_table, "a component of a kind this host does not know", NULL},
    NULL,
    0,
    0};

static const rlh_component_desc* const k_components[] = {&k_env.base, &k_unknown.base};

static rlh_status* future_init(const rlh_host_api* host) {
  const future_host_api* fh = (const future_host_api*)host;
  /* The reader-side rule: a slot the host may not have is used only when struct_size covers it
   * (RLH_HAS_FIELD, spelled out because the local type nests the 0.1 struct). */
  g_host_has_trace_event =
      host != NULL && host->struct_size >= RLH_STRUCT_SIZE(future_host_api, trace_event) ? 1 : 0;
  if (g_host_has_trace_event) fh->trace_event(host->ctx, "init", 4);
  return NULL;
}

static const future_plugin_desc k_desc = {
    {sizeof(future_plugin_desc), RLH_ABI_VERSION_MAJOR, RLH_ABI_VERSION_MINOR + 1, "future_minor",
     "9.0.0", "rlhost tests", "Apache-2.0", "plugin of a newer ABI minor (larger structs)",
     k_components, sizeof k_components / sizeof k_components[0], NULL, future_init, NULL},
    &k_attr,
    1,
    "https://example.invalid/future",
    0x2u};

__attribute__((visibility("default"))) const rlh_plugin_desc* rlh_plugin_entry(uint32_t major, uint32_t minor);

const rlh_plugin_desc* rlh_plugin_entry(uint32_t major, uint32_t minor) {
  (void)major;
  (void)minor;
  return &k_desc.base;
}
