/* rlhost C ABI: environments (RLH_KIND_ENVIRONMENT).
 *
 * Score a batch: responses with their prompts and metadata in; rewards (one or several named
 * rewards per sample) out, and for multi-turn environments an observation, a done flag and the
 * next turn's stop strings. In a multi-turn rollout the response is the turn's generated text and
 * the metadata holds, besides the dataset row, "rlh_history": the earlier turns of the sample as
 * a list of {"response", "observation"} texts.
 */
#ifndef RLHOST_ENVIRONMENT_H_
#define RLHOST_ENVIRONMENT_H_

#include "rlhost/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RLH_ENVIRONMENT_API_VERSION_MAJOR 0
#define RLH_ENVIRONMENT_API_VERSION_MINOR 2

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
  /* (optional, ENVIRONMENT 0.2) receives the stop strings of sample i's next turn (NeMo-RL's
   * next_stop_strings), used on top of the run's own; `lengths[k]` is strings[k]'s length. A
   * sample it is not called for keeps the run's own. NULL: the caller runs no further turns. */
  void (*stop_strings)(void* user, size_t index, const char* const* strings, const size_t* lengths,
                       size_t count);
} rlh_env_result;

typedef struct rlh_environment_api {
  size_t struct_size;
  rlh_status* (*create)(const rlh_host_api* host, const char* config_json, size_t config_len,
                        rlh_environment** out);
  void (*destroy)(rlh_environment* self);
  /* Writes a JSON array of the reward names this environment produces. "reward" is the main
   * one; a name starting with "count/" is not a reward but a 0/1 event per sample (e.g.
   * "count/score_budget_exceeded": the response exceeded the scoring budget and scored 0), which
   * algorithms log summed over a step rather than averaged. */
  rlh_status* (*reward_names)(rlh_environment* self, rlh_write_fn write, void* user);
  /* Scores samples [num_samples]. Thread-safe for distinct calls. */
  rlh_status* (*score)(rlh_environment* self, const rlh_env_sample* samples, size_t num_samples,
                       rlh_env_result* result);
} rlh_environment_api;

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* RLHOST_ENVIRONMENT_H_ */
