/* rlhost C ABI: versions, struct sizing, status objects, named values, write sinks.
 *
 * Rules every rlhost header follows (docs/abi.md has the long form):
 *  - Pure C99, usable from C, C++ and any language with a C FFI. Fixed-width integers only;
 *    enum-valued fields are int32_t (C enum size is implementation-defined); booleans uint8_t.
 *  - Every struct that crosses the boundary begins with `size_t struct_size` and grows only at the
 *    end. Writers set struct_size = RLH_STRUCT_SIZE(type, last_field) of the header they were
 *    compiled with; readers use a field only when RLH_HAS_FIELD says it lies inside struct_size.
 *    Exception: the tensor types in tensor.h mirror DLPack byte for byte and carry no size.
 *  - Fallible calls return rlh_status*: NULL means success. A status is destroyed through its own
 *    destroy slot, so it is always freed by the side that created it.
 *  - No exceptions, no C++ types, no thread-local "last error" cross the boundary.
 *  - Strings are UTF-8. Borrowed pointers are valid for the duration of the call unless a field
 *    says otherwise. Output text and arrays are handed to caller-provided write callbacks, so no
 *    memory changes owner.
 *  - Tables of function pointers are append-only within a major version. Every slot of an
 *    interface's first version is required unless its comment says "(optional)"; the host refuses
 *    a component that leaves a required slot NULL. A NULL optional slot, and any slot beyond the
 *    table's struct_size, means "not implemented": the caller reports RLH_E_UNIMPLEMENTED.
 *  - An array of size-prefixed structs (rlh_named_value[], rlh_output_spec[], rlh_env_sample[])
 *    cannot grow within a major: readers index it with their own sizeof. New per-element data
 *    goes into a new, parallel array field instead.
 */
#ifndef RLHOST_CORE_H_
#define RLHOST_CORE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * Versions. MAJOR changes break (removing, reordering or retyping a field or slot); MINOR only
 * appends fields, slots or enum values. The host refuses a plugin of another MAJOR, naming both
 * versions, and accepts any MINOR (reading only the fields both sides know).
 * Each component interface (backend.h, kernels.h, ...) has its own version too, so a change to
 * one interface does not disturb plugins that implement the others. */
#define RLH_ABI_VERSION_MAJOR 0
#define RLH_ABI_VERSION_MINOR 9

/* Size of a struct up to and including `field`: what a writer compiled against a header whose
 * last field is `field` puts into struct_size. */
#define RLH_STRUCT_SIZE(type, field) (offsetof(type, field) + sizeof(((type*)0)->field))

/* True when `ptr` (non-NULL) is large enough to contain `field`. Readers guard every field
 * added after a struct's first version with this. */
#define RLH_HAS_FIELD(ptr, type, field) \
  ((ptr) != NULL && (ptr)->struct_size >= RLH_STRUCT_SIZE(type, field))

/* ---------------------------------------------------------------------------------------------
 * Status codes: fixed values, never renumbered (0-16 follow absl/gRPC). */
typedef int32_t rlh_code;
#define RLH_OK 0
#define RLH_E_CANCELLED 1
#define RLH_E_UNKNOWN 2
#define RLH_E_INVALID_ARGUMENT 3
#define RLH_E_DEADLINE_EXCEEDED 4
#define RLH_E_NOT_FOUND 5
#define RLH_E_ALREADY_EXISTS 6
#define RLH_E_PERMISSION_DENIED 7
#define RLH_E_RESOURCE_EXHAUSTED 8
#define RLH_E_FAILED_PRECONDITION 9
#define RLH_E_ABORTED 10
#define RLH_E_OUT_OF_RANGE 11
#define RLH_E_UNIMPLEMENTED 12
#define RLH_E_INTERNAL 13
#define RLH_E_UNAVAILABLE 14
#define RLH_E_DATA_LOSS 15
#define RLH_E_UNAUTHENTICATED 16
#define RLH_E_ABI_MISMATCH 100

/* An error. Created by whichever side failed (usually through rlh_host_api.make_status), handed
 * to the caller, who must destroy it exactly once with rlh_status_destroy. */
typedef struct rlh_status rlh_status;
struct rlh_status {
  size_t struct_size;
  rlh_code code;
  uint32_t reserved0;
  const char* message;  /* UTF-8, NUL-terminated; lives until destroy */
  size_t message_len;   /* bytes, without the NUL */
  void (*destroy)(rlh_status* self); /* frees with the creator's allocator; never NULL */
};

/* Destroys a status; NULL is a no-op. */
static inline void rlh_status_destroy(rlh_status* s) {
  if (s != NULL && s->destroy != NULL) s->destroy(s);
}

/* Human-readable name of a status code ("INVALID_ARGUMENT"); never NULL. */
static inline const char* rlh_code_name(rlh_code c) {
  switch (c) {
    case RLH_OK: return "OK";
    case RLH_E_CANCELLED: return "CANCELLED";
    case RLH_E_UNKNOWN: return "UNKNOWN";
    case RLH_E_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case RLH_E_DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case RLH_E_NOT_FOUND: return "NOT_FOUND";
    case RLH_E_ALREADY_EXISTS: return "ALREADY_EXISTS";
    case RLH_E_PERMISSION_DENIED: return "PERMISSION_DENIED";
    case RLH_E_RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case RLH_E_FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case RLH_E_ABORTED: return "ABORTED";
    case RLH_E_OUT_OF_RANGE: return "OUT_OF_RANGE";
    case RLH_E_UNIMPLEMENTED: return "UNIMPLEMENTED";
    case RLH_E_INTERNAL: return "INTERNAL";
    case RLH_E_UNAVAILABLE: return "UNAVAILABLE";
    case RLH_E_DATA_LOSS: return "DATA_LOSS";
    case RLH_E_UNAUTHENTICATED: return "UNAUTHENTICATED";
    case RLH_E_ABI_MISMATCH: return "ABI_MISMATCH";
    default: return "UNKNOWN_CODE";
  }
}

/* ---------------------------------------------------------------------------------------------
 * Output through callbacks. A function that produces text or an array calls `write` one or more
 * times (the pieces concatenate); the data is valid only during the call. This keeps every
 * allocation on the side that made it and suits ctypes/cffi callers. */
typedef void (*rlh_write_fn)(void* user, const void* data, size_t len);

/* ---------------------------------------------------------------------------------------------
 * Named values: attributes of ops, plugin self-description, small settings. */
#define RLH_VALUE_INT64 0
#define RLH_VALUE_DOUBLE 1
#define RLH_VALUE_STRING 2
#define RLH_VALUE_BOOL 3
#define RLH_VALUE_INT64_LIST 4
#define RLH_VALUE_DOUBLE_LIST 5

typedef struct rlh_named_value {
  size_t struct_size;
  const char* name;      /* NUL-terminated */
  int32_t type;          /* RLH_VALUE_* */
  uint32_t reserved0;
  int64_t int64_value;   /* INT64, BOOL (0/1) */
  double double_value;   /* DOUBLE */
  const char* string_value;      /* STRING, NUL-terminated */
  const int64_t* int64_list;     /* INT64_LIST */
  const double* double_list;     /* DOUBLE_LIST */
  size_t size;                   /* string length in bytes, or list length */
} rlh_named_value;

/* Log levels for rlh_host_api.log. */
#define RLH_LOG_TRACE 0
#define RLH_LOG_DEBUG 1
#define RLH_LOG_INFO 2
#define RLH_LOG_WARN 3
#define RLH_LOG_ERROR 4

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* RLHOST_CORE_H_ */
