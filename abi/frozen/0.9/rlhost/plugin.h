/* rlhost C ABI: plugins, components and the host services table.
 *
 * A plugin is a shared library that exports exactly one symbol, rlh_plugin_entry. The host calls
 * it right after loading; it returns a static descriptor and must be cheap (no threads, no device
 * context, no files), so `rlhost --list-plugins` can call it on every library it finds. Work
 * happens in init(), undone by shutdown().
 *
 * A plugin carries one or more components. A component has a kind (backend, model, ...), a name,
 * its own version, the version of the kind's interface it implements, and a kind-specific table
 * of functions (backend.h, model.h, ...). Interfaces are versioned per kind, so the backend
 * interface can grow without disturbing environment plugins.
 *
 * Plugins never link librlhost: everything they need from the host (logging, allocation,
 * configuration, metrics, finding other components, communicators, cancellation) reaches them
 * through rlh_host_api. In-tree plugins are linked with -Wl,--no-undefined to prove it.
 */
#ifndef RLHOST_PLUGIN_H_
#define RLHOST_PLUGIN_H_

#include "rlhost/core.h"
#include "rlhost/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Component kinds. Append-only. */
#define RLH_KIND_BACKEND 1
#define RLH_KIND_MODEL 2
#define RLH_KIND_GENERATOR 3
#define RLH_KIND_ALGORITHM 4
#define RLH_KIND_ENVIRONMENT 5
#define RLH_KIND_KERNELS 6
#define RLH_KIND_COMM 7
#define RLH_KIND_TOKENIZER 8
#define RLH_KIND_DATASET 9

typedef struct rlh_host_api rlh_host_api;
typedef struct rlh_host_ctx rlh_host_ctx; /* opaque, owned by the host */
typedef struct rlh_comm rlh_comm;         /* opaque communicator, see comm.h */
typedef struct rlh_comm_api rlh_comm_api;

/* ---------------------------------------------------------------------------------------------
 * Component descriptor: static data, lives as long as the plugin is loaded. */
typedef struct rlh_component_desc {
  size_t struct_size;
  int32_t kind;          /* RLH_KIND_* */
  uint32_t reserved0;
  const char* name;      /* e.g. "megatron", "grpo", "math"; unique per kind in a process */
  const char* version;   /* semver of this implementation, e.g. "0.1.0" */
  uint32_t iface_major;  /* version of the kind's interface it implements, e.g. */
  uint32_t iface_minor;  /*   RLH_BACKEND_API_VERSION_MAJOR/MINOR at compile time */
  const void* api;       /* the kind's table, e.g. const rlh_backend_api*; static lifetime */
  const char* description; /* one line, may be NULL */
  /* Config keys this component owns, NULL-terminated, may be NULL. A pattern is a dotted path;
   * a trailing ".*" owns the whole subtree ("policy.megatron_cfg.*"). The host checks the whole
   * configuration against the union of these and its list of known NeMo-RL keys. */
  const char* const* config_keys;
} rlh_component_desc;

/* ---------------------------------------------------------------------------------------------
 * Plugin descriptor: static data returned by rlh_plugin_entry. */
typedef struct rlh_plugin_desc {
  size_t struct_size;
  uint32_t abi_major;    /* RLH_ABI_VERSION_MAJOR the plugin was compiled with */
  uint32_t abi_minor;    /* RLH_ABI_VERSION_MINOR the plugin was compiled with */
  const char* name;      /* e.g. "megatron"; what --plugin NAME finds */
  const char* version;   /* semver */
  const char* vendor;
  const char* license;   /* SPDX id, may be NULL */
  const char* description; /* one line, may be NULL */
  /* Components: an array of pointers, so each descriptor can grow on its own. */
  const rlh_component_desc* const* components;
  size_t num_components;

  /* (optional) Says whether the plugin can run here. Writes a reason (UTF-8 text) through
   * `write` when it cannot, and sets *score: 0 = cannot run here, higher = better suited.
   * Must be cheap and must not keep resources. Called before init; thread-safe.
   * NULL: the plugin can always run (score 1). */
  rlh_status* (*probe)(const rlh_host_api* host, int32_t* score, rlh_write_fn write, void* user);

  /* (optional) One-time initialisation, called by the host before any component is created,
   * at most once, from one thread. `host` lives until shutdown returns. NULL: nothing to do. */
  rlh_status* (*init)(const rlh_host_api* host);

  /* (optional) Undoes init: joins threads, frees device resources. Called once, after every
   * object the plugin created has been destroyed. NULL: nothing to do. */
  void (*shutdown)(void);
} rlh_plugin_desc;

/* The entry symbol. Returns the plugin's static descriptor (never freed), or NULL if the plugin
 * cannot describe itself to a host of this ABI version. host_abi_major/minor let a plugin that
 * supports several ABI versions pick the matching descriptor. Thread-safe, cheap, idempotent. */
#define RLH_PLUGIN_ENTRY_SYMBOL "rlh_plugin_entry"
typedef const rlh_plugin_desc* (*rlh_plugin_entry_fn)(uint32_t host_abi_major,
                                                       uint32_t host_abi_minor);

/* ---------------------------------------------------------------------------------------------
 * Host services. One table per loaded plugin (its ctx identifies the plugin, so logs carry the
 * plugin's name and rank prefix). Valid from init until shutdown returns. Every slot is
 * thread-safe unless it says otherwise. Slots added in later minors must be checked with
 * RLH_HAS_FIELD before use. */
struct rlh_host_api {
  size_t struct_size;
  uint32_t abi_major; /* the host's RLH_ABI_VERSION_MAJOR */
  uint32_t abi_minor; /* the host's RLH_ABI_VERSION_MINOR */
  rlh_host_ctx* ctx;  /* first argument of every slot below */

  /* Logs one message (UTF-8, `len` bytes, no trailing newline needed) at RLH_LOG_* level. */
  void (*log)(rlh_host_ctx* ctx, int32_t level, const char* msg, size_t len);

  /* Creates a status the caller owns (destroy with rlh_status_destroy). Never returns NULL for
   * code != RLH_OK; returns NULL for RLH_OK. Plugins use it so statuses outlive them. */
  rlh_status* (*make_status)(rlh_code code, const char* msg, size_t len);

  /* Allocates `bytes` on `device` aligned to `alignment` (a power of two, 0 = default 64).
   * The memory is freed with free_memory on the same device. The host counts allocations per
   * device (tests and benchmarks read the counts). */
  rlh_status* (*alloc)(rlh_host_ctx* ctx, rlh_device device, size_t bytes, size_t alignment,
                       void** out);
  void (*free_memory)(rlh_host_ctx* ctx, rlh_device device, void* ptr);

  /* Writes the resolved configuration subtree at `path` (dotted, "" = whole tree) as JSON
   * through `write`. RLH_E_NOT_FOUND if the path does not exist. */
  rlh_status* (*config_get)(rlh_host_ctx* ctx, const char* path, rlh_write_fn write, void* user);

  /* Records a scalar metric ("train/loss") at a step. The host fans it out to its loggers
   * (console, JSONL, TensorBoard), one row per step. Two names are control values, not metrics:
   * "rlhost/total_steps" (value = the job's step count, sent before the first metric, for the
   * progress line's ETA) and "rlhost/step_finished" (emits the row of `step` now). */
  void (*metric)(rlh_host_ctx* ctx, const char* name, double value, int64_t step);

  /* Finds a component of `kind` by name (NULL = the best-scoring one of that kind), initialising
   * its plugin on first use. *out is valid while the host lives. RLH_E_NOT_FOUND names what was
   * asked for and what exists. */
  rlh_status* (*find_component)(rlh_host_ctx* ctx, int32_t kind, const char* name,
                                const rlh_component_desc** out);

  /* The world communicator of this process group (size 1 when run without a launcher), with
   * its table. Both stay valid until shutdown. */
  rlh_status* (*get_comm)(rlh_host_ctx* ctx, const rlh_comm_api** api, rlh_comm** comm);

  /* 1 once the user asked to stop (SIGINT/SIGTERM, or rlhost_cancel from an embedder). Long
   * loops poll it and return RLH_E_CANCELLED. */
  uint8_t (*is_cancelled)(rlh_host_ctx* ctx);

  /* ---- ABI 0.2 ---- */

  /* Writes a JSON array of the usable components of `kind` through `write`, best first:
   * [{"name": "kernels_cuda", "plugin": "kernels_cuda", "score": 8}, ...]. The score is the
   * plugin's probe (1 without one); components whose plugin scores 0 here, or that failed the
   * host's checks, are left out; ties keep load order. Listing does not initialise plugins
   * (find_component does). Lets a caller use every provider of a kind (kernel registries). */
  rlh_status* (*list_components)(rlh_host_ctx* ctx, int32_t kind, rlh_write_fn write, void* user);
};

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* RLHOST_PLUGIN_H_ */
