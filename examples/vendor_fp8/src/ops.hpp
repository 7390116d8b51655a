// The KERNELS slots that need the device (ops_cuda.cpp; ops_nocuda.cpp in a build without the
// CUDA toolkit), for plugin.cpp's table.
#pragma once

#include "rlhost/kernels.h"
#include "rlhost/sdk/status.hpp"

namespace vendor_fp8 {

// The host's make_status once an instance was created or probed (statuses outlive the plugin).
rlh::sdk::MakeStatusFn make_status();

rlh_status* probe(const rlh_host_api* host, int32_t* score, rlh_write_fn write, void* user);
rlh_status* k_create(const rlh_host_api* host, rlh_device device, const char* config, size_t len, rlh_kernels** out);
void k_destroy(rlh_kernels* k);
rlh_status* k_get_op(rlh_kernels* k, const rlh_op_desc* d, rlh_op** out);
rlh_status* k_op_info(rlh_op* op, rlh_op_info* out);
rlh_status* k_run(rlh_op* op, const rlh_op_call* call);
void k_release_op(rlh_op* op);
rlh_status* k_state_save(rlh_op* op, rlh_write_fn write, void* user);
rlh_status* k_state_load(rlh_op* op, const void* data, size_t len);
rlh_status* k_memory_alloc(rlh_kernels* k, size_t bytes, void** out);
void k_memory_free(rlh_kernels* k, void* p);
rlh_status* k_memory_copy(rlh_kernels* k, void* dst, const void* src, size_t bytes, int32_t dir, void* stream);
rlh_status* k_synchronize(rlh_kernels* k, void* stream);
rlh_status* k_workspace_size(rlh_op* op, const rlh_op_call* call, size_t* bytes);

}  // namespace vendor_fp8
