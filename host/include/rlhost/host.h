/* librlhost: the embedding C API.
 *
 * Everything `rlhost` (the executable) does is available here, to any language with a C FFI:
 * create a host, point it at plugins, load a configuration, run the job, read metrics, destroy.
 *
 *   rlhost_t* h = NULL;
 *   rlh_status* s = rlhost_create(&h);
 *   if (!s) s = rlhost_load_plugin(h, "grpo");
 *   if (!s) s = rlhost_load_config(h, "my.yaml");
 *   if (!s) s = rlhost_apply_override(h, "grpo.max_num_steps=10");
 *   if (!s) s = rlhost_run(h);
 *   if (s) { fprintf(stderr, "%s\n", s->message); rlh_status_destroy(s); }
 *   rlhost_destroy(h);
 *
 * Statuses returned here are created by librlhost and destroyed with rlh_status_destroy.
 * A host object is externally synchronised (one thread at a time), except rlhost_cancel, which
 * any thread (or a signal handler) may call.
 */
#ifndef RLHOST_HOST_H_
#define RLHOST_HOST_H_

#include "rlhost/core.h"
#include "rlhost/generator.h"
#include "rlhost/plugin.h"
#include "rlhost/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define RLHOST_API __declspec(dllexport)
#else
#define RLHOST_API __attribute__((visibility("default")))
#endif

typedef struct rlhost_t rlhost_t;

/* The ABI version librlhost implements (RLH_ABI_VERSION_MAJOR/MINOR it was built with). */
RLHOST_API void rlhost_abi_version(uint32_t* major, uint32_t* minor);

/* Creates a host. The plugin path starts as: $RLHOST_PLUGIN_PATH (colon-separated), the
 * install's plugin folder, and the build tree's plugin folder when run from a build. */
RLHOST_API rlh_status* rlhost_create(rlhost_t** out);
/* Destroys the host: shuts plugins down in reverse load order. NULL is a no-op. */
RLHOST_API void rlhost_destroy(rlhost_t* host);

/* Appends a folder to the plugin path. */
RLHOST_API rlh_status* rlhost_add_plugin_dir(rlhost_t* host, const char* dir);

/* Loads a plugin: a name found on the plugin path (lib<name>.so), or a path to a .so file
 * (anything containing '/'). Loading reads its descriptor and checks versions; init runs on
 * first use of one of its components. Loading the same plugin twice is a no-op. */
RLHOST_API rlh_status* rlhost_load_plugin(rlhost_t* host, const char* name_or_path);

/* Writes a JSON array describing every plugin on the plugin path and every loaded plugin:
 * name, version, vendor, path, abi, components (kind, name, version, interface version), probe
 * result (can_run, score, reason), and for a plugin that failed to load, the error. */
RLHOST_API rlh_status* rlhost_list_plugins(rlhost_t* host, rlh_write_fn write, void* user);

/* Loads a YAML configuration file (with its `defaults:` chain), replacing any loaded before. */
RLHOST_API rlh_status* rlhost_load_config(rlhost_t* host, const char* path);
/* Loads YAML text as the configuration; `origin` names it in error messages. */
RLHOST_API rlh_status* rlhost_load_config_text(rlhost_t* host, const char* yaml, size_t len,
                                               const char* origin);
/* Applies one command-line style override: `a.b=v` (existing key), `++a.b=v` (add or set),
 * `+a.b=v` (add; error if present), `~a.b` (delete). */
RLHOST_API rlh_status* rlhost_apply_override(rlhost_t* host, const char* override_text);
/* Resolves interpolations and checks every key against the loaded plugins' and NeMo-RL's keys.
 * Writes the resolved configuration as YAML through `write` when it is not NULL. Warnings go to
 * the log. */
RLHOST_API rlh_status* rlhost_resolve_config(rlhost_t* host, rlh_write_fn write, void* user);

/* Resolves and checks the configuration as rlhost_run does before it starts. Writes a JSON object
 * through `write` (when not NULL): {"accepted": ["key=value", ...] (NeMo-RL settings rlhost does
 * not implement, with values that leave its behaviour unchanged), "unused": [...] (NeMo-RL
 * sections only plugins that are not loaded read), "refused": [...] (one message per setting that
 * asks for what rlhost lacks)}. Returns RLH_E_UNIMPLEMENTED naming the first refused setting (the
 * JSON is written first), RLH_E_INVALID_ARGUMENT for an unknown key. (ABI 0.2) */
RLHOST_API rlh_status* rlhost_check_config(rlhost_t* host, rlh_write_fn write, void* user);

/* Runs the job: resolves and checks the configuration (rlhost_check_config), creates the
 * algorithm component (config key `rlhost.algorithm`, else the only loaded algorithm) and runs it
 * to completion. */
RLHOST_API rlh_status* rlhost_run(rlhost_t* host);
/* Asks a running job to stop; thread- and signal-safe. */
RLHOST_API void rlhost_cancel(rlhost_t* host);

/* Called for each metric a running job records (name, value, step), on the thread that records
 * it, after it is stored. It must not call into the host except rlhost_cancel (which stops the
 * job). (ABI 0.2) */
typedef void (*rlhost_metric_fn)(void* user, const char* name, double value, int64_t step);
/* Sets (or, with fn NULL, clears) the metrics callback. Not while a job runs. (ABI 0.2) */
RLHOST_API rlh_status* rlhost_set_metric_callback(rlhost_t* host, rlhost_metric_fn fn, void* user);

/* Writes all metrics recorded so far as JSON lines {"name": ..., "value": ..., "step": ...}. */
RLHOST_API rlh_status* rlhost_read_metrics(rlhost_t* host, rlh_write_fn write, void* user);

/* The services table the host would hand to a plugin, for embedders that drive components
 * directly (tests, Python). Valid until rlhost_destroy. */
RLHOST_API const rlh_host_api* rlhost_services(rlhost_t* host);

/* Sets the minimum log level printed to stderr (RLH_LOG_*; default INFO). */
RLHOST_API void rlhost_set_log_level(rlhost_t* host, int32_t level);

/* ---- Components with tensors in and out (ABI 0.4) ----------------------------------------------
 *
 * Handles over a tokenizer, a model in a backend (logprobs) and a generator, for embedders that
 * score and sample without a job (the Python package's DLPack tensors). Their components come from
 * the plugins the host has loaded (rlhost_load_plugin first: tokenizer_hf; model_llama and a
 * backend; model_llama and generator); a missing one is RLH_E_NOT_FOUND naming it.
 *
 * Tensors in are borrowed `const rlh_tensor*` (DLPack's DLTensor) in CPU memory with any strides
 * (NULL strides: row-major, as DLPack < 1.2 allowed); a wrong dtype, rank, shape or device is
 * RLH_E_INVALID_ARGUMENT naming the argument. Token ids are int32 or int64. Tensors out are
 * `rlh_managed_tensor*` (DLManagedTensorVersioned, DLPack 1.x): row-major, CPU, owned by the
 * caller, who calls their deleter exactly once. A handle is used by one thread at a time and
 * lives until its close call or rlhost_destroy (which closes what is still open). */

typedef struct rlhost_tokenizer_t rlhost_tokenizer_t;
typedef struct rlhost_model_t rlhost_model_t;
typedef struct rlhost_generator_t rlhost_generator_t;

/* A tokenizer: `path` is a tokenizer.json, a model folder or a hub id in the local HF cache.
 * Uses the host's TOKENIZER component (tokenizer_hf). (ABI 0.4) */
RLHOST_API rlh_status* rlhost_tokenizer_open(rlhost_t* host, const char* path, rlhost_tokenizer_t** out);
RLHOST_API void rlhost_tokenizer_close(rlhost_tokenizer_t* tokenizer); /* NULL is a no-op */
/* Encodes UTF-8 text into int64 ids [n]. flags: RLH_ENCODE_* (tokenizer.h). (ABI 0.4) */
RLHOST_API rlh_status* rlhost_tokenize(rlhost_tokenizer_t* tokenizer, const char* text, size_t len,
                                       uint64_t flags, rlh_managed_tensor** ids);
/* Decodes ids (1-D) into UTF-8 text written through `write`. flags: RLH_DECODE_*. (ABI 0.4) */
RLHOST_API rlh_status* rlhost_detokenize(rlhost_tokenizer_t* tokenizer, const rlh_tensor* ids, uint64_t flags,
                                         rlh_write_fn write, void* user);

typedef struct rlhost_model_args {
  size_t struct_size;
  const char* path;        /* HF model folder, or a hub id in the local HF cache */
  const char* backend;     /* BACKEND component; NULL = "dtensor" */
  const char* config_json; /* the backend's config section (a job's `policy`: device, precision,
                              logprob_batch_size, ...); NULL = {} */
  size_t config_len;
} rlhost_model_args;

/* Loads a model, frozen, into a new instance of a backend, for logprobs. (ABI 0.4) */
RLHOST_API rlh_status* rlhost_model_open(rlhost_t* host, const rlhost_model_args* args, rlhost_model_t** out);
RLHOST_API void rlhost_model_close(rlhost_model_t* model); /* NULL is a no-op */

typedef struct rlhost_logprobs_args {
  size_t struct_size;
  const rlh_tensor* ids;     /* int32/int64, [T] or [B, T] */
  const rlh_tensor* lengths; /* int32/int64 [B]: tokens of each row (the rest is padding);
                                NULL = every row is T long */
  double temperature;        /* > 0: logits are divided by it */
} rlhost_logprobs_args;

/* Log-probabilities of each sequence's tokens: float32 of ids' shape, out[b, t] =
 * log p(ids[b, t] | ids[b, <t]) for 0 < t < lengths[b], 0 at t = 0 and on padding (NeMo-RL's
 * get_logprobs layout; `rlhost logprobs` prints out[1:]). (ABI 0.4) */
RLHOST_API rlh_status* rlhost_logprobs(rlhost_model_t* model, const rlhost_logprobs_args* args,
                                       rlh_managed_tensor** out);

typedef struct rlhost_generator_args {
  size_t struct_size;
  const char* path;        /* HF model folder, or a hub id in the local HF cache */
  const char* generator;   /* GENERATOR component; NULL = the best loaded one */
  const char* config_json; /* the generator's config section (a job's policy.generation); NULL = {} */
  size_t config_len;
} rlhost_generator_args;

/* A generator with the model's weights. (ABI 0.4) */
RLHOST_API rlh_status* rlhost_generator_open(rlhost_t* host, const rlhost_generator_args* args,
                                             rlhost_generator_t** out);
RLHOST_API void rlhost_generator_close(rlhost_generator_t* generator); /* NULL is a no-op */

/* rlhost_generate_args.flags */
#define RLHOST_GENERATE_IGNORE_EOS (1ull << 0) /* do not stop at the model's EOS ids */

typedef struct rlhost_generate_args {
  size_t struct_size;
  const rlh_tensor* prompt_ids;     /* int32/int64, [T] (one prompt) or [B, T] */
  const rlh_tensor* prompt_lengths; /* int32/int64 [B], each >= 1; NULL = every row is T long */
  int64_t samples_per_prompt;       /* >= 1 */
  const rlh_sampling* sampling;     /* generator.h; its stop ids are joined by the model's EOS
                                       ids (generation_config.json, else config.json, and the
                                       tokenizer's) unless RLHOST_GENERATE_IGNORE_EOS */
  uint64_t flags;                   /* RLHOST_GENERATE_* */
} rlhost_generate_args;

/* What rlhost_generate returns: N = B * samples_per_prompt rows, row = prompt * samples + sample;
 * L = the longest row. The caller sets struct_size; every tensor up to it is filled. */
typedef struct rlhost_generation {
  size_t struct_size;
  rlh_managed_tensor* ids;       /* int64 [N, L]: the prompt then the new tokens, 0 after lengths */
  rlh_managed_tensor* logprobs;  /* float32 [N, L]: 0 on the prompt and after lengths, then the
                                    processed logprob of each new token */
  rlh_managed_tensor* lengths;   /* int64 [N]: prompt + new tokens of each row */
  rlh_managed_tensor* truncated; /* bool (uint8) [N]: stopped by max_new_tokens, not a stop */
} rlhost_generation;

/* Samples continuations (`rlhost generate`). On error nothing is returned. (ABI 0.4) */
RLHOST_API rlh_status* rlhost_generate(rlhost_generator_t* generator, const rlhost_generate_args* args,
                                       rlhost_generation* out);

/* Another owner of a tensor librlhost made: a new managed tensor over the same memory, which is
 * freed when the last of them is deleted (from any thread). A binding exports a tensor it keeps
 * this way. Any other tensor is RLH_E_INVALID_ARGUMENT. (ABI 0.4) */
RLHOST_API rlh_status* rlhost_tensor_share(rlh_managed_tensor* tensor, rlh_managed_tensor** out);

/* DLPack before 1.0: DLManagedTensor, which the "dltensor" capsule holds (all that numpy < 2.1
 * and torch < 2.3 read). */
typedef struct rlhost_legacy_tensor {
  rlh_tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(struct rlhost_legacy_tensor* self);
} rlhost_legacy_tensor;

/* Wraps `tensor` in a legacy DLManagedTensor over the same memory, taking ownership of it: the
 * wrapper's deleter frees both. On error the caller still owns `tensor`. (ABI 0.4) */
RLHOST_API rlh_status* rlhost_tensor_to_legacy(rlh_managed_tensor* tensor, rlhost_legacy_tensor** out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* RLHOST_HOST_H_ */
