// Device tensors through host memory: comm_mpi copies a CUDA tensor into a pinned host buffer
// (after its stream has produced it), runs the collective there, and copies the result back on
// the same stream. Slower than NCCL, but it works for any number of ranks on one GPU, which
// NCCL refuses. Built with the CUDA runtime linked statically when the toolkit is there (the
// plugin still loads without a GPU or driver); without it, device tensors are refused with
// UNAVAILABLE naming why.
#pragma once

#include <cstddef>

#include "rlhost/tensor.h"

namespace rlh::comm_mpi {

// Two staging slots per process (in and out of one call), reused across calls; callers hold
// mpi_lock(). Every function throws rlh::sdk::Error naming `call` on failure.
// Copies `bytes` of device memory at `src` into slot `slot` after synchronising `stream`;
// returns the host pointer.
void* stage_from_device(int slot, const void* src, size_t bytes, const rlh_device& dev, void* stream, const char* call);
// A host buffer of `bytes` in slot `slot` (contents undefined).
void* staging_buffer(int slot, size_t bytes, const char* call);
// Copies host `src` to device `dst` on `stream` and waits for it.
void stage_to_device(void* dst, const void* src, size_t bytes, const rlh_device& dev, void* stream, const char* call);
// Device-to-device copy on `stream`, waited for (a group of one).
void copy_on_device(void* dst, const void* src, size_t bytes, const rlh_device& dev, void* stream, const char* call);

}  // namespace rlh::comm_mpi
