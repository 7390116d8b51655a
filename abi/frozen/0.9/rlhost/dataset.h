/* rlhost C ABI: datasets (RLH_KIND_DATASET).
 *
 * A dataset is a finite, indexable list of rows, each a JSON object (NeMo-RL's `data` section
 * decides which keys are prompt and answer). Rows are read by index so the data position can be
 * checkpointed and resumed exactly.
 */
#ifndef RLHOST_DATASET_H_
#define RLHOST_DATASET_H_

#include "rlhost/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RLH_DATASET_API_VERSION_MAJOR 0
#define RLH_DATASET_API_VERSION_MINOR 1

typedef struct rlh_dataset rlh_dataset;

typedef struct rlh_dataset_api {
  size_t struct_size;
  /* Opens a dataset described by `config_json` (e.g. {"data_path": "x.jsonl"}). A malformed
   * row is an error naming file and line. */
  rlh_status* (*create)(const rlh_host_api* host, const char* config_json, size_t config_len,
                        rlh_dataset** out);
  void (*destroy)(rlh_dataset* self);
  int64_t (*size)(const rlh_dataset* self);
  /* Writes row `index` as a JSON object. Thread-safe. */
  rlh_status* (*get)(const rlh_dataset* self, int64_t index, rlh_write_fn write, void* user);
} rlh_dataset_api;

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* RLHOST_DATASET_H_ */
