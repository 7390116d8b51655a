/* rlhost C ABI: kernel providers (RLH_KIND_KERNELS).
 *
 * A provider implements ops. An op is named by a string ("gemm", "rmsnorm_fwd", ...; the list
 * and each op's operands, attributes and semantics are in docs/ops.md, the contract every
 * provider implements) and resolved for a device, operand dtypes and optionally operand shapes
 * into an rlh_op handle, which is then run many times. Resolution happens once (at engine
 * setup), so running costs one indirect call. Adding an op or a precision (FP8) changes no
 * struct here: it is a new name or new dtypes that a provider answers for.
 *
 * `kernels_cpu` is the reference: one conformance test runs every op of every loaded provider
 * against it.
 */
#ifndef RLHOST_KERNELS_H_
#define RLHOST_KERNELS_H_

#include "rlhost/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RLH_KERNELS_API_VERSION_MAJOR 0
#define RLH_KERNELS_API_VERSION_MINOR 2

typedef struct rlh_kernels rlh_kernels; /* a provider instance (per device, per engine) */
typedef struct rlh_op rlh_op;           /* a resolved op */

/* What to resolve. Operand descriptors carry dtype, device and (optionally) shapes; their data
 * pointers are ignored. With shapes the provider may refuse shapes it cannot run. */
typedef struct rlh_op_desc {
  size_t struct_size;
  const char* name;            /* op name, docs/ops.md */
  rlh_device device;
  uint32_t reserved0;
  const rlh_tensor* inputs;    /* [num_inputs], may be NULL if num_inputs == 0 */
  size_t num_inputs;
  const rlh_tensor* outputs;   /* [num_outputs] */
  size_t num_outputs;
  uint8_t shapes_valid;        /* 1: shapes above are the ones the op will run with */
  uint8_t reserved1[7];
  const rlh_named_value* attrs; /* static attributes (e.g. "transpose_b"), [num_attrs] */
  size_t num_attrs;
} rlh_op_desc;

/* One execution. Output tensors' data buffers are provided by the caller and written by the
 * op. Attributes may repeat or refine those of the desc (e.g. "temperature"). */
typedef struct rlh_op_call {
  size_t struct_size;
  const rlh_tensor* inputs;
  size_t num_inputs;
  const rlh_tensor* outputs;
  size_t num_outputs;
  const rlh_named_value* attrs;
  size_t num_attrs;
  void* stream;       /* cudaStream_t for CUDA; NULL on CPU */
  void* workspace;    /* scratch provided by the caller, size from workspace_size() */
  size_t workspace_bytes;
} rlh_op_call;

/* memory_copy directions (KERNELS 0.2). */
#define RLH_COPY_HOST_TO_DEVICE 1
#define RLH_COPY_DEVICE_TO_HOST 2
#define RLH_COPY_DEVICE_TO_DEVICE 3

/* Properties of a resolved op. */
typedef struct rlh_op_info {
  size_t struct_size;
  uint8_t batch_invariant; /* 1: a row's result does not depend on the other rows */
  uint8_t deterministic;   /* 1: bitwise identical results on reruns */
  uint8_t stateful;        /* 1: has state (e.g. FP8 amax history); see state_save/load */
  uint8_t reserved0[5];
  size_t workspace_bytes;  /* scratch needed for the shapes of the desc (0 when unknown) */
} rlh_op_info;

typedef struct rlh_kernels_api {
  size_t struct_size;

  /* Creates a provider instance for `device`. `config_json` is the provider's config section
   * (may be "{}"). Thread-safe. */
  rlh_status* (*create)(const rlh_host_api* host, rlh_device device, const char* config_json,
                        size_t config_len, rlh_kernels** out);
  /* Destroys the instance after all its ops are released. NULL is a no-op. */
  void (*destroy)(rlh_kernels* self);

  /* Writes a JSON array describing the ops this provider implements:
   * [{"name": "gemm", "dtypes": ["f32", "bf16"], "backward": "gemm"}, ...]. */
  rlh_status* (*list_ops)(rlh_kernels* self, rlh_write_fn write, void* user);

  /* Resolves an op. RLH_E_UNIMPLEMENTED (with a reason) when this provider does not support the
   * op for these dtypes/shapes; that is an answer, not a failure. Externally synchronised per
   * instance. */
  rlh_status* (*get_op)(rlh_kernels* self, const rlh_op_desc* desc, rlh_op** out);

  /* Properties of a resolved op. */
  rlh_status* (*op_info)(rlh_op* op, rlh_op_info* out);

  /* Runs the op. Thread-safe for distinct calls unless op_info says stateful. */
  rlh_status* (*run)(rlh_op* op, const rlh_op_call* call);

  /* Releases a resolved op. NULL is a no-op. */
  void (*release_op)(rlh_op* op);

  /* (optional) State of a stateful op, for checkpoints: bytes out through `write`, and back. */
  rlh_status* (*state_save)(rlh_op* op, rlh_write_fn write, void* user);
  rlh_status* (*state_load)(rlh_op* op, const void* data, size_t len);

  /* ---- KERNELS 0.2: what a caller needs to drive a provider it knows nothing about (a kernel
   * registry choosing among providers, the conformance runner staging operands on a device). */

  /* (optional) Facts about the instance as a JSON object, through `write`:
   *   {"reference": false,   true only for the contract's reference provider (docs/ops.md),
   *                          which registries order last and the conformance runner checks
   *                          every other provider against
   *    "memory": "host"}     where operands live: "host" (CPU memory) or "device" (the memory
   *                          memory_alloc returns)
   * NULL: {"reference": false, "memory": "host"}. Thread-safe. */
  rlh_status* (*provider_info)(rlh_kernels* self, rlh_write_fn write, void* user);

  /* (optional; required when "memory" is "device") Memory of the instance's device: allocate
   * `bytes` (256-byte aligned), free, copy `bytes` in the direction RLH_COPY_* ordered on
   * `stream` (NULL = the default stream; returns once queued), and wait for everything queued
   * on `stream` (NULL = the whole device). Thread-safe. */
  rlh_status* (*memory_alloc)(rlh_kernels* self, size_t bytes, void** out);
  void (*memory_free)(rlh_kernels* self, void* ptr);
  rlh_status* (*memory_copy)(rlh_kernels* self, void* dst, const void* src, size_t bytes,
                             int32_t direction, void* stream);
  rlh_status* (*synchronize)(rlh_kernels* self, void* stream);

  /* (optional) Scratch bytes a run with these operands and attributes needs (0: none). A caller
   * that passes at least that much in rlh_op_call.workspace lets the provider allocate nothing
   * during the run. The call's stream, workspace and data pointers are not read. NULL: the
   * provider finds its own scratch. */
  rlh_status* (*workspace_size)(rlh_op* op, const rlh_op_call* call, size_t* bytes);
} rlh_kernels_api;

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* RLHOST_KERNELS_H_ */
