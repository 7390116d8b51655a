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
#include "rlhost/plugin.h"

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

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* RLHOST_HOST_H_ */
