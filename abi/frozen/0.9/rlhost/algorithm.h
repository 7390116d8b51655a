/* rlhost C ABI: algorithms (RLH_KIND_ALGORITHM).
 *
 * An algorithm (GRPO, SFT, DPO, RM, ...) drives the job: it finds the backend, generator,
 * environments, tokenizer and dataset it needs through rlh_host_api.find_component, runs its
 * loop, reports metrics through the host and returns when done, cancelled or failed. The host's
 * `rlhost --config ...` and librlhost's rlhost_run both end in run().
 */
#ifndef RLHOST_ALGORITHM_H_
#define RLHOST_ALGORITHM_H_

#include "rlhost/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RLH_ALGORITHM_API_VERSION_MAJOR 0
#define RLH_ALGORITHM_API_VERSION_MINOR 1

typedef struct rlh_algorithm rlh_algorithm;

typedef struct rlh_algorithm_api {
  size_t struct_size;
  /* Creates the algorithm with the WHOLE resolved configuration (JSON): algorithms read the
   * sections of the components they drive (policy, data, env, checkpointing, logger). */
  rlh_status* (*create)(const rlh_host_api* host, const char* config_json, size_t config_len,
                        rlh_algorithm** out);
  void (*destroy)(rlh_algorithm* self);
  /* Runs the job to completion. Polls host->is_cancelled and returns RLH_E_CANCELLED. */
  rlh_status* (*run)(rlh_algorithm* self);
} rlh_algorithm_api;

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* RLHOST_ALGORITHM_H_ */
