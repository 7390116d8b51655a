// The CUDA engine's own tensor-parallel glue (cuda_engine_kernels.cu; tensor_parallel.cpp runs
// them): the vocabulary-parallel embedding, the fused head's per-rank statistics combined over
// the group, the head's backward tile, and the fp32 partial sums' casts. Not ops of the contract
// (docs/ops.md): each reads this rank's vocabulary block, which an op has no notion of. Apart from
// cuda_engine_impl.hpp for the reason moe_kernels.hpp gives (the .cu is compiled as C++17).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace rlh::engine::cuda {

using bf16 = uint16_t;  // storage of __nv_bfloat16

// out[n, :] (f32, [N, C]) = float(table[ids[n] - vlo, :]) when vlo <= ids[n] < vlo + vcount,
// else 0: this rank's part of the lookup, which summed over the group is one rank's exactly.
void tp_embedding_fwd(float* out, const int32_t* ids, const bf16* table, int64_t N, int64_t C, int64_t vlo,
                      int64_t vcount, cudaStream_t s);
// dtable[ids[n] - vlo, :] += dout[n, :] for the tokens whose id is this rank's, in token order
// (one thread a column walks the tokens: deterministic, no atomics).
void tp_embedding_bwd(float* dtable, const int32_t* ids, const bf16* dout, int64_t N, int64_t C, int64_t vlo,
                      int64_t vcount, cudaStream_t s);
// The head's local target: target[n] - vlo when this rank holds it, else -1 (no target here).
void tp_local_target(int32_t* local, const int32_t* target, int64_t N, int64_t vlo, int64_t vcount, cudaStream_t s);
// mine [3, N] = this rank's lse, entropy and the target's z (lp + lse where the local target is
// present, else 0), what the group all-gathers.
void tp_head_pack(float* mine, const float* lp, const float* lse, const float* ent, const int32_t* local,
                  int64_t N, cudaStream_t s);
// From all [T, 3, N] (every rank's pack, rank order): lse = logsumexp_r lse_r,
// logprob = sum_r z_r - lse (0 where the global target is < 0), entropy = lse - sum_r w_r (lse_r -
// entropy_r), w_r = exp(lse_r - lse). `ent` may be null.
void tp_head_combine(const float* all, int64_t T, const int32_t* target, int64_t N, float* lp, float* lse,
                     float* ent, cudaStream_t s);
// The head's backward on a tile of rows [n0, n0 + rows) of the raw products x = h W_r^T (f32,
// [rows, vcount], rows ld apart) into d x (bf16, the same layout): with z = x / temperature (capped: c tanh(x / c) /
// temperature) and the group's lse / entropy,
//   dz_j = a (1[j = t] - p_j) - b p_j (z_j - (lse - entropy)),  p_j = exp(z_j - lse),
// a = dlogprob (0 without a target anywhere), b = dentropy (null: 0), t the local target (none
// when another rank holds it: only the -a p_j part), times dz/dx.
void tp_head_grad_tile(const float* x, bf16* dx, int64_t ld, int64_t rows, int64_t vcount, int64_t n0, const int32_t* target,
                       int64_t vlo, const float* lse, const float* ent, const float* dlp, const float* dent,
                       float inv_temp, float cap, cudaStream_t s);
// dst [rows, cols] (rows ldd apart, bf16) = src (f32, contiguous [rows, cols]), or += with add.
void tp_store_bf16(bf16* dst, int64_t ldd, const float* src, int64_t rows, int64_t cols, bool add, cudaStream_t s);

}  // namespace rlh::engine::cuda
