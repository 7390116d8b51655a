/* rlhost C ABI: generators (RLH_KIND_GENERATOR).
 *
 * Batched autoregressive decoding with sampling. Weights arrive by version (refit): the backend
 * visits its weights and the generator copies them into buffers it owns, in its dtype and
 * layout, or keeps views when layout and device agree. Outputs carry the weight version they were
 * made with, and the same processed logprobs the backend computes.
 */
#ifndef RLHOST_GENERATOR_H_
#define RLHOST_GENERATOR_H_

#include "rlhost/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RLH_GENERATOR_API_VERSION_MAJOR 0
#define RLH_GENERATOR_API_VERSION_MINOR 2

typedef struct rlh_generator rlh_generator;

typedef struct rlh_sampling {
  size_t struct_size;
  double temperature;      /* 0 = greedy */
  int32_t top_k;           /* 0 = off */
  uint32_t reserved0;
  double top_p;            /* 1 = off */
  double min_p;            /* 0 = off */
  int64_t max_new_tokens;
  uint64_t seed;           /* with (step, prompt index, sample index) keys a counter-based RNG */
  int64_t step;
  const int32_t* stop_token_ids; /* [num_stop_token_ids] */
  size_t num_stop_token_ids;
  const char* const* stop_strings; /* [num_stop_strings], matched on decoded text */
  size_t num_stop_strings;
} rlh_sampling;

typedef struct rlh_generate_args {
  size_t struct_size;
  const int32_t* prompt_ids;     /* all prompts concatenated */
  const int64_t* prompt_offsets; /* [num_prompts + 1] */
  int64_t num_prompts;
  int64_t samples_per_prompt;
  int64_t first_prompt_index;    /* global index of prompt 0 (RNG key across ranks) */
  const rlh_sampling* sampling;
} rlh_generate_args;

/* One finished sample, delivered through the result callback (possibly out of order). Arrays
 * are valid during the callback only. logprobs[t] belongs to new token t. */
typedef struct rlh_sample {
  size_t struct_size;
  int64_t prompt_index;
  int64_t sample_index;
  const int32_t* ids;       /* new tokens only */
  const float* logprobs;    /* processed logprobs of the new tokens */
  int64_t num_tokens;
  uint8_t truncated;        /* hit max_new_tokens without a stop */
  uint8_t reserved0[7];
  int64_t weight_version;
} rlh_sample;

typedef rlh_status* (*rlh_sample_fn)(void* user, const rlh_sample* sample);

typedef struct rlh_weight_update {
  size_t struct_size;
  int64_t version;
  const rlh_named_tensor* weights; /* HF names; [num_weights]; borrowed for the call */
  size_t num_weights;
  uint8_t may_alias;  /* 1: the generator may keep views of these buffers (same device and */
  uint8_t reserved0[7]; /*  layout; the owner keeps them alive and unchanged until the next update) */
} rlh_weight_update;

typedef struct rlh_generator_api {
  size_t struct_size;
  /* Creates a generator for the model at `model_path` (config and, unless weights come by
   * refit, weights) with its config section. */
  rlh_status* (*create)(const rlh_host_api* host, const char* model_path, const char* config_json,
                        size_t config_len, rlh_generator** out);
  void (*destroy)(rlh_generator* self);
  /* Installs weights of a version (a whole set, or the next bucket of one). */
  rlh_status* (*update_weights)(rlh_generator* self, const rlh_weight_update* update);
  /* Generates; calls `fn` once per finished sample. Externally synchronised. */
  rlh_status* (*generate)(rlh_generator* self, const rlh_generate_args* args, rlh_sample_fn fn,
                          void* user);
  /* (GENERATOR 0.2; optional: check RLH_HAS_FIELD(api, rlh_generator_api, weights_device) and
   * NULL) The device whose memory update_weights reads besides host memory ({RLH_DEVICE_CPU, 0}:
   * host memory only). Tensors on it are copied (and converted) device-side before
   * update_weights returns, so they need to outlive the call only; may_alias applies to host
   * tensors. A refit caller offers this device to the backend's visit_weights_on. */
  rlh_status* (*weights_device)(rlh_generator* self, rlh_device* out);
} rlh_generator_api;

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* RLHOST_GENERATOR_H_ */
