// The CUDA engine's own MLA kernels (mla_kernels.cu): the copies between kv_b's product and the
// per-head keys and values the attention kernels read, which are not ops of the contract
// (docs/ops.md). Apart from cuda_engine_impl.hpp for the same reason as moe_kernels.hpp: the .cu
// is compiled as C++17.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace rlh::engine::cuda {

using bf16 = uint16_t;  // storage of __nv_bfloat16

// Forward, per token n and head h (rows of k and v are ld apart; head h's key at k + h (dn+dr),
// its value at v + h dv):
//   k[n, h, 0:dn]     = kv[n, h (dn+dv) + 0:dn]       (k_nope)
//   k[n, h, dn:dn+dr] = krot[n, 0:dr]                 (the rotated key, shared by every head)
//   v[n, h, 0:dv]     = kv[n, h (dn+dv) + dn:dn+dv]
// kv is [N, H (dn+dv)] dense; krot has row stride ldkrot. Copies only (bitwise).
void mla_assemble_kv(const bf16* kv, const bf16* krot, int64_t ldkrot, bf16* k, bf16* v,
                     int64_t ld, int64_t N, int64_t H, int64_t dn, int64_t dr, int64_t dv,
                     cudaStream_t s);

// Backward, the transpose: dkv[n, h (dn+dv) + j] = dk[n, h, j] (j < dn) or dval[n, h, j - dn];
// dkrot[n, i] = sum over h, in head order, of dk[n, h, dn + i] (fp32 sum, one rounding to bf16).
// Deterministic: one thread per output element, no atomics.
void mla_split_dkv(const bf16* dk, const bf16* dval, int64_t ld, bf16* dkv, bf16* dkrot,
                   int64_t lddkrot, int64_t N, int64_t H, int64_t dn, int64_t dr, int64_t dv,
                   cudaStream_t s);

}  // namespace rlh::engine::cuda
