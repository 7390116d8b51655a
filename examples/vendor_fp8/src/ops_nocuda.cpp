// vendor_fp8 built without the CUDA toolkit: the plugin loads and lists its ops, and probe and
// create say why it cannot run. No instance can exist, so the other slots are never reached with
// one; they answer UNAVAILABLE all the same.
#include <string>

#include "ops.hpp"

namespace vendor_fp8 {
namespace {

rlh::sdk::MakeStatusFn g_make = nullptr;
constexpr char kNoCuda[] =
    "vendor_fp8 was built without the CUDA toolkit (no nvcc or cuBLASLt header when it was configured); "
    "rebuild it where CUDA 12.9+ is installed";

rlh_status* unavailable() { return rlh::sdk::to_status(g_make, RLH_E_UNAVAILABLE, kNoCuda); }

}  // namespace

rlh::sdk::MakeStatusFn make_status() { return g_make; }

rlh_status* probe(const rlh_host_api* host, int32_t* score, rlh_write_fn write, void* user) {
  if (host && !g_make) g_make = host->make_status;
  *score = 0;
  if (write) write(user, kNoCuda, sizeof(kNoCuda) - 1);
  return nullptr;
}
rlh_status* k_create(const rlh_host_api* host, rlh_device, const char*, size_t, rlh_kernels** out) {
  if (host && !g_make) g_make = host->make_status;
  if (out) *out = nullptr;
  return unavailable();
}
void k_destroy(rlh_kernels*) {}
rlh_status* k_get_op(rlh_kernels*, const rlh_op_desc*, rlh_op**) { return unavailable(); }
rlh_status* k_op_info(rlh_op*, rlh_op_info*) { return unavailable(); }
rlh_status* k_run(rlh_op*, const rlh_op_call*) { return unavailable(); }
void k_release_op(rlh_op*) {}
rlh_status* k_state_save(rlh_op*, rlh_write_fn, void*) { return unavailable(); }
rlh_status* k_state_load(rlh_op*, const void*, size_t) { return unavailable(); }
rlh_status* k_memory_alloc(rlh_kernels*, size_t, void**) { return unavailable(); }
void k_memory_free(rlh_kernels*, void*) {}
rlh_status* k_memory_copy(rlh_kernels*, void*, const void*, size_t, int32_t, void*) { return unavailable(); }
rlh_status* k_synchronize(rlh_kernels*, void*) { return unavailable(); }
rlh_status* k_workspace_size(rlh_op*, const rlh_op_call*, size_t*) { return unavailable(); }

}  // namespace vendor_fp8
