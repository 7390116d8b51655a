/* rlhost C ABI: communicators (RLH_KIND_COMM).
 *
 * Collectives over a group of ranks on tensors in host (comm_mpi) or device (comm_nccl) memory,
 * behind one table. Groups are created explicitly (split) and passed explicitly: there is no
 * global parallel state. Every call honours the communicator's timeout: a failed or absent rank
 * makes the call return RLH_E_DEADLINE_EXCEEDED or RLH_E_ABORTED on every rank, never hang.
 */
#ifndef RLHOST_COMM_H_
#define RLHOST_COMM_H_

#include "rlhost/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RLH_COMM_API_VERSION_MAJOR 0
#define RLH_COMM_API_VERSION_MINOR 1

#define RLH_REDUCE_SUM 0
#define RLH_REDUCE_MAX 1
#define RLH_REDUCE_MIN 2
#define RLH_REDUCE_AVG 3

/* rlh_comm and rlh_comm_api are declared in plugin.h (the host hands out the world comm). */
struct rlh_comm_api {
  size_t struct_size;
  /* Creates the world communicator for this process (bootstrap from the launcher's
   * environment: OMPI_COMM_WORLD_*, or size 1). */
  rlh_status* (*create_world)(const rlh_host_api* host, const char* config_json,
                              size_t config_len, rlh_comm** out);
  void (*destroy)(rlh_comm* self);
  int32_t (*rank)(const rlh_comm* self);
  int32_t (*size)(const rlh_comm* self);
  /* Splits into sub-groups: ranks with equal `color` form a group, ordered by `key`. Collective. */
  rlh_status* (*split)(rlh_comm* self, int32_t color, int32_t key, rlh_comm** out);
  /* In-place all-reduce of `tensor` (same shape and dtype on every rank). */
  rlh_status* (*all_reduce)(rlh_comm* self, const rlh_tensor* tensor, int32_t op, void* stream);
  /* out = concat over ranks of in along dim 0. */
  rlh_status* (*all_gather)(rlh_comm* self, const rlh_tensor* in, const rlh_tensor* out,
                            void* stream);
  /* out = this rank's slice (dim 0) of the reduction of in. */
  rlh_status* (*reduce_scatter)(rlh_comm* self, const rlh_tensor* in, const rlh_tensor* out,
                                int32_t op, void* stream);
  rlh_status* (*broadcast)(rlh_comm* self, const rlh_tensor* tensor, int32_t root, void* stream);
  rlh_status* (*send)(rlh_comm* self, const rlh_tensor* tensor, int32_t peer, void* stream);
  rlh_status* (*recv)(rlh_comm* self, const rlh_tensor* tensor, int32_t peer, void* stream);
  /* Equal splits of dim 0: block i of in goes to rank i, block j of out comes from rank j. */
  rlh_status* (*all_to_all)(rlh_comm* self, const rlh_tensor* in, const rlh_tensor* out,
                            void* stream);
  rlh_status* (*barrier)(rlh_comm* self);
  /* Sets the timeout for subsequent calls (milliseconds, 0 = default). */
  void (*set_timeout_ms)(rlh_comm* self, int64_t timeout_ms);
};

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* RLHOST_COMM_H_ */
