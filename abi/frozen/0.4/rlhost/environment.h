/* rlhost C ABI: environments (RLH_KIND_ENVIRONMENT).
 *
 * Score a batch: responses with their prompts and metadata in; rewards (one or several named
 * rewards per sample) out, and for multi-turn environments an observation and a done flag.
 */
#ifndef RLHOST_ENVIRONMENT_H_
#define RLHOST_ENVIRONMENT_H_

#include "rlhost/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RLH_ENVIRONMENT_API_VERSION_MAJOR 0
#define RLH_ENVIRONMENT_API_VERSION_MINOR 1

typedef struct rlh_environment rlh_environment;

/* One sample to score. Strings are UTF-8 with explicit lengths, borrowed for the call. */
typedef struct rlh_env_sample {
  size_t struct_size;
  const char* prompt;
  size_t prompt_len;
  const char* response;
  size_t response_len;
  const char* metadata_json;  /* the dataset row's extra fields (e.g. ground truth), may be NULL */
  size_t metadata_len;
} rlh_env_sample;

/* Results for the batch, written by the environment into caller-provided arrays. */
typedef struct rlh_env_result {
  size_t struct_size;
  size_t num_rewards;          /* reward names the caller asked for (see reward_names) */
  const char* const* reward_names; /* [num_rewards]; "reward" is the main one */
  double* rewards;             /* [num_samples * num_rewards], row-major, written */
  uint8_t* done;               /* [num_samples], written (1 for single-turn environments) */
  /* (optional) receives the observation text of sample i for multi-turn environments. */
  void (*observation)(void* user, size_t index, const char* text, size_t len);
  void* user;
} rlh_env_result;

typedef struct rlh_environment_api {
  size_t struct_size;
  rlh_status* (*create)(const rlh_host_api* host, const char* config_json, size_t config_len,
                        rlh_environment** out);
  void (*destroy)(rlh_environment* self);
  /* Writes a JSON array of the reward names this environment produces. */
  rlh_status* (*reward_names)(rlh_environment* self, rlh_write_fn write, void* user);
  /* Scores samples [num_samples]. Thread-safe for distinct calls. */
  rlh_status* (*score)(rlh_environment* self, const rlh_env_sample* samples, size_t num_samples,
                       rlh_env_result* result);
} rlh_environment_api;

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* RLHOST_ENVIRONMENT_H_ */
