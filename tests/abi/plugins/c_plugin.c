/* A plugin written in C alone: proves the ABI needs no C++.
 *
 * Built twice, with gcc and with clang-14, under -std=c99 -Wall -Wextra -pedantic -Werror, from
 * the C headers only (no SDK). It provides two real components through the ABI:
 *   - environment "c_exact_match": reward 1 when the response equals the row's "expected_answer"
 *     (from the sample's metadata JSON), else 0; case-insensitive when the plugin's config
 *     section `c_plugin.case_insensitive` (read through host->config_get at init) or the
 *     instance config {"case_insensitive": true} says so;
 *   - dataset "c_fixed_rows": three fixed rows.
 * and uses the host services: log, make_status, config_get.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rlhost/dataset.h"
#include "rlhost/environment.h"
#include "rlhost/plugin.h"

#if defined(__clang__)
#define C_PLUGIN_NAME "c_plugin_clang"
#elif defined(__GNUC__)
#define C_PLUGIN_NAME "c_plugin_gcc"
#else
#define C_PLUGIN_NAME "c_plugin"
#endif

#define EXPORT __attribute__((visibility("default")))

/* ---------------------------------------------------------------------------------------------
 * Plugin state: set by init, cleared by shutdown. */
static const rlh_host_api* g_host = NULL;
static int g_init_count = 0;
static int g_case_insensitive = 0;

static void plugin_log(const rlh_host_api* host, int32_t level, const char* msg) {
  if (host != NULL && host->log != NULL) host->log(host->ctx, level, msg, strlen(msg));
}

/* A status this plugin allocates itself, destroyed through its own destroy slot (so freed by
 * its creator): used only when there is no host to make one. */
static void local_status_destroy(rlh_status* self) { free(self); }

static rlh_status* local_status(rlh_code code, const char* msg) {
  size_t len = strlen(msg);
  rlh_status* s = (rlh_status*)malloc(sizeof *s + len + 1);
  if (s == NULL) return NULL;
  memcpy((char*)(s + 1), msg, len + 1);
  s->struct_size = RLH_STRUCT_SIZE(rlh_status, destroy);
  s->code = code;
  s->reserved0 = 0;
  s->message = (const char*)(s + 1);
  s->message_len = len;
  s->destroy = local_status_destroy;
  return s;
}

/* Statuses come from the host's factory when there is one (they then outlive the plugin). */
static rlh_status* fail(const rlh_host_api* host, rlh_code code, const char* msg) {
  if (host != NULL && host->make_status != NULL) return host->make_status(code, msg, strlen(msg));
  return local_status(code, msg);
}

/* A growable buffer used as an rlh_write_fn sink. */
typedef struct buffer {
  char* data;
  size_t len;
  size_t cap;
  int oom;
} buffer;

static void buffer_write(void* user, const void* data, size_t len) {
  buffer* b = (buffer*)user;
  if (b->oom) return;
  if (b->len + len + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 64;
    char* p;
    while (cap < b->len + len + 1) cap *= 2;
    p = (char*)realloc(b->data, cap);
    if (p == NULL) {
      b->oom = 1;
      return;
    }
    b->data = p;
    b->cap = cap;
  }
  memcpy(b->data + b->len, data, len);
  b->len += len;
  b->data[b->len] = '\0';
}

/* True when the JSON text `json` (len bytes) has "key": true. Enough for flat fixture configs. */
static int json_flag(const char* json, size_t len, const char* key) {
  size_t klen = strlen(key), i;
  for (i = 0; json != NULL && i + klen + 2 <= len; ++i) {
    if (json[i] == '"' && strncmp(json + i + 1, key, klen) == 0 && json[i + 1 + klen] == '"') {
      size_t j = i + klen + 2;
      while (j < len && (json[j] == ' ' || json[j] == ':')) ++j;
      return j + 4 <= len && strncmp(json + j, "true", 4) == 0;
    }
  }
  return 0;
}

/* Copies the unescaped JSON string value of "key" into out (cap bytes). 1 on success. */
static int json_string(const char* json, size_t len, const char* key, char* out, size_t cap) {
  size_t klen = strlen(key), i, o = 0;
  for (i = 0; json != NULL && i + klen + 2 <= len; ++i) {
    if (json[i] == '"' && strncmp(json + i + 1, key, klen) == 0 && json[i + 1 + klen] == '"') {
      size_t j = i + klen + 2;
      while (j < len && (json[j] == ' ' || json[j] == ':')) ++j;
      if (j >= len || json[j] != '"') return 0;
      for (++j; j < len && json[j] != '"'; ++j) {
        char c = json[j];
        if (c == '\\' && j + 1 < len) {
          c = json[++j];
          if (c == 'n') c = '\n';
          else if (c == 't') c = '\t';
        }
        if (o + 1 >= cap) return 0;
        out[o++] = c;
      }
      out[o] = '\0';
      return j < len;
    }
  }
  return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Plugin lifecycle. */

static rlh_status* c_probe(const rlh_host_api* host, int32_t* score, rlh_write_fn write, void* user) {
  (void)host;
  (void)write;
  (void)user;
  *score = 2; /* can run anywhere; 2 so listings show the plugin's own score, not the default */
  return NULL;
}

static rlh_status* c_init(const rlh_host_api* host) {
  buffer cfg = {NULL, 0, 0, 0};
  rlh_status* s;
  char line[160];
  if (host == NULL) return local_status(RLH_E_INVALID_ARGUMENT, C_PLUGIN_NAME ": init without host services");
  if (host->struct_size < RLH_STRUCT_SIZE(rlh_host_api, is_cancelled))
    return local_status(RLH_E_ABI_MISMATCH, C_PLUGIN_NAME ": host services table too small");
  if (g_init_count++ != 0) return fail(host, RLH_E_FAILED_PRECONDITION, C_PLUGIN_NAME ": init called twice");
  g_host = host;
  s = host->config_get(host->ctx, "c_plugin", buffer_write, &cfg);
  if (s != NULL && s->code != RLH_E_NOT_FOUND) {
    free(cfg.data);
    return s; /* the host's status, handed on unchanged */
  }
  rlh_status_destroy(s);
  g_case_insensitive = json_flag(cfg.data, cfg.len, "case_insensitive");
  free(cfg.data);
  sprintf(line, C_PLUGIN_NAME ": init (case_insensitive=%d)", g_case_insensitive);
  plugin_log(host, RLH_LOG_INFO, line);
  return NULL;
}

static void c_shutdown(void) {
  plugin_log(g_host, RLH_LOG_INFO, C_PLUGIN_NAME ": shutdown");
  g_host = NULL;
  g_init_count = 0;
}

/* ---------------------------------------------------------------------------------------------
 * Environment "c_exact_match". */

struct rlh_environment {
  const rlh_host_api* host;
  int case_insensitive;
};

static rlh_status* env_create(const rlh_host_api* host, const char* config_json, size_t config_len,
                              rlh_environment** out) {
  rlh_environment* e;
  if (out == NULL) return fail(host, RLH_E_INVALID_ARGUMENT, "c_exact_match: out is NULL");
  *out = NULL;
  if (g_host == NULL) return fail(host, RLH_E_FAILED_PRECONDITION, "c_exact_match: plugin not initialised");
  e = (rlh_environment*)malloc(sizeof *e);
  if (e == NULL) return fail(host, RLH_E_RESOURCE_EXHAUSTED, "c_exact_match: out of memory");
  e->host = host;
  e->case_insensitive = g_case_insensitive || json_flag(config_json, config_len, "case_insensitive");
  *out = e;
  return NULL;
}

static void env_destroy(rlh_environment* self) { free(self); }

static rlh_status* env_reward_names(rlh_environment* self, rlh_write_fn write, void* user) {
  (void)self;
  write(user, "[\"reward\"]", 10);
  return NULL;
}

static int equal_answer(const char* a, size_t alen, const char* b, int fold) {
  size_t i, blen = strlen(b);
  while (alen > 0 && isspace((unsigned char)a[alen - 1])) --alen;
  while (alen > 0 && isspace((unsigned char)*a)) ++a, --alen;
  if (alen != blen) return 0;
  for (i = 0; i < alen; ++i) {
    int x = (unsigned char)a[i], y = (unsigned char)b[i];
    if (fold) x = tolower(x), y = tolower(y);
    if (x != y) return 0;
  }
  return 1;
}

static rlh_status* env_score(rlh_environment* self, const rlh_env_sample* samples, size_t num_samples,
                             rlh_env_result* result) {
  size_t i, r;
  char expected[256], msg[320];
  if (!RLH_HAS_FIELD(result, rlh_env_result, user))
    return fail(self->host, RLH_E_ABI_MISMATCH, "c_exact_match: result struct too small");
  for (r = 0; r < result->num_rewards; ++r) {
    if (strcmp(result->reward_names[r], "reward") != 0) {
      sprintf(msg, "c_exact_match: unknown reward '%.200s' (this environment produces \"reward\")",
              result->reward_names[r]);
      return fail(self->host, RLH_E_INVALID_ARGUMENT, msg);
    }
  }
  for (i = 0; i < num_samples; ++i) {
    const rlh_env_sample* s = &samples[i];
    double reward;
    if (!RLH_HAS_FIELD(s, rlh_env_sample, metadata_len))
      return fail(self->host, RLH_E_ABI_MISMATCH, "c_exact_match: sample struct too small");
    if (!json_string(s->metadata_json, s->metadata_len, "expected_answer", expected, sizeof expected)) {
      sprintf(msg, "c_exact_match: sample %lu: metadata has no string \"expected_answer\"", (unsigned long)i);
      return fail(self->host, RLH_E_INVALID_ARGUMENT, msg);
    }
    reward = equal_answer(s->response, s->response_len, expected, self->case_insensitive) ? 1.0 : 0.0;
    for (r = 0; r < result->num_rewards; ++r) result->rewards[i * result->num_rewards + r] = reward;
    result->done[i] = 1;
  }
  return NULL;
}

static const rlh_environment_api k_env_api = {
    RLH_STRUCT_SIZE(rlh_environment_api, score), env_create, env_destroy, env_reward_names, env_score};

static const char* const k_config_keys[] = {"c_plugin.*", NULL};

static const rlh_component_desc k_env = {
    RLH_STRUCT_SIZE(rlh_component_desc, config_keys),
    RLH_KIND_ENVIRONMENT,
    0,
    "c_exact_match",
    "1.0.0",
    RLH_ENVIRONMENT_API_VERSION_MAJOR,
    RLH_ENVIRONMENT_API_VERSION_MINOR,
    &k_env_api,
    "reward 1 when the response equals the row's expected_answer (C99 fixture)",
    k_config_keys};

/* ---------------------------------------------------------------------------------------------
 * Dataset "c_fixed_rows". */

static const char* const k_rows[] = {
    "{\"prompt\": \"2+2=\", \"expected_answer\": \"4\"}",
    "{\"prompt\": \"Capital of France?\", \"expected_answer\": \"Paris\"}",
    "{\"prompt\": \"Say \\\"hi\\\"\", \"expected_answer\": \"\\\"hi\\\"\"}",
};
#define NUM_ROWS ((int64_t)(sizeof k_rows / sizeof k_rows[0]))

struct rlh_dataset {
  const rlh_host_api* host;
};

static rlh_status* ds_create(const rlh_host_api* host, const char* config_json, size_t config_len,
                             rlh_dataset** out) {
  rlh_dataset* d;
  (void)config_json;
  (void)config_len;
  *out = NULL;
  d = (rlh_dataset*)malloc(sizeof *d);
  if (d == NULL) return fail(host, RLH_E_RESOURCE_EXHAUSTED, "c_fixed_rows: out of memory");
  d->host = host;
  *out = d;
  plugin_log(host, RLH_LOG_DEBUG, "c_fixed_rows: created");
  return NULL;
}

static void ds_destroy(rlh_dataset* self) { free(self); }

static int64_t ds_size(const rlh_dataset* self) {
  (void)self;
  return NUM_ROWS;
}

static rlh_status* ds_get(const rlh_dataset* self, int64_t index, rlh_write_fn write, void* user) {
  char msg[128];
  if (index < 0 || index >= NUM_ROWS) {
    sprintf(msg, "c_fixed_rows: row %ld out of range [0, %ld)", (long)index, (long)NUM_ROWS);
    return fail(self->host, RLH_E_OUT_OF_RANGE, msg);
  }
  write(user, k_rows[index], strlen(k_rows[index]));
  return NULL;
}

static const rlh_dataset_api k_ds_api = {RLH_STRUCT_SIZE(rlh_dataset_api, get), ds_create, ds_destroy,
                                         ds_size, ds_get};

static const rlh_component_desc k_ds = {
    RLH_STRUCT_SIZE(rlh_component_desc, config_keys),
    RLH_KIND_DATASET,
    0,
    "c_fixed_rows",
    "1.0.0",
    RLH_DATASET_API_VERSION_MAJOR,
    RLH_DATASET_API_VERSION_MINOR,
    &k_ds_api,
    NULL,
    NULL};

/* ---------------------------------------------------------------------------------------------
 * The descriptor and the one exported symbol. */

static const rlh_component_desc* const k_components[] = {&k_env, &k_ds};

static const rlh_plugin_desc k_desc = {
    RLH_STRUCT_SIZE(rlh_plugin_desc, shutdown),
    RLH_ABI_VERSION_MAJOR,
    RLH_ABI_VERSION_MINOR,
    C_PLUGIN_NAME,
    "1.0.0",
    "rlhost tests",
    "Apache-2.0",
    "C99-only ABI fixture: an exact-match environment and a fixed dataset",
    k_components,
    sizeof k_components / sizeof k_components[0],
    c_probe,
    c_init,
    c_shutdown};

EXPORT const rlh_plugin_desc* rlh_plugin_entry(uint32_t host_abi_major, uint32_t host_abi_minor);

const rlh_plugin_desc* rlh_plugin_entry(uint32_t host_abi_major, uint32_t host_abi_minor) {
  (void)host_abi_minor;
  return host_abi_major == RLH_ABI_VERSION_MAJOR ? &k_desc : NULL;
}
