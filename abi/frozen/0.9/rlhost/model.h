/* rlhost C ABI: model families (RLH_KIND_MODEL).
 *
 * A model plugin turns a Hugging Face config.json into a transformer description: per-layer
 * attention, MLP/MoE, norms, RoPE, and a parameter table (HF name, engine name, shape, dtype,
 * layer, role, transform). The description crosses as a JSON document whose schema is
 * sdk/include/rlhost/sdk/model_desc.hpp (field "schema_version", written by
 * rlh::sdk::to_json), so new architecture features are new
 * keys, not new struct layouts. Backends execute descriptions; they never contain per-model code.
 */
#ifndef RLHOST_MODEL_H_
#define RLHOST_MODEL_H_

#include "rlhost/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RLH_MODEL_API_VERSION_MAJOR 0
#define RLH_MODEL_API_VERSION_MINOR 1

typedef struct rlh_model_api {
  size_t struct_size;

  /* HF architecture names ("LlamaForCausalLM", ...) this component describes, NULL-terminated,
   * static. The host uses it to pick a model component for a checkpoint, and to name the
   * architecture when none lists it. */
  const char* const* architectures;

  /* Writes the description (JSON) for the HF config.json text `config_json`. Errors name the
   * offending key. Thread-safe, no state. */
  rlh_status* (*describe)(const rlh_host_api* host, const char* config_json, size_t config_len,
                          rlh_write_fn write, void* user);
} rlh_model_api;

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* RLHOST_MODEL_H_ */
