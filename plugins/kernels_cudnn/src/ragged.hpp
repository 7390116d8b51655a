// Small CUDA kernels around cuDNN's packed (THD) attention: the per-sequence lengths and the
// ragged offset arrays cuDNN reads, made from the contract's cu_seqlens on the call's stream (no
// host sync), and the layout change of the softmax statistics between cuDNN's packed [N, H] and
// the contract's lse [H, N].
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace rlh::kcudnn {

constexpr int kMaxMultipliers = 12;
struct Multipliers {
  int64_t m[kMaxMultipliers];
  int n = 0;
};

// For i in [0, B]: offsets[j * (B + 1) + i] = mult.m[j] * cu[min(i, S)], and for i in [0, B):
// seqlens[i] = cu[i + 1] - cu[i] for i < S, 0 past S (sequences added to reach the plan's batch
// bucket are empty). Values are clamped to [0, N] (lengths to [0, T]) so that malformed
// cu_seqlens give wrong rows, never reads outside the operands.
void ragged_setup(const int32_t* cu, int64_t S, int64_t B, int64_t N, int64_t T, const Multipliers& mult,
                  int64_t* offsets, int32_t* seqlens, cudaStream_t stream);

// lse[h * N + n] = packed[n * H + h] (forward), and the reverse (backward).
void stats_to_lse(const float* packed, float* lse, int64_t N, int64_t H, cudaStream_t stream);
void lse_to_stats(const float* lse, float* packed, int64_t N, int64_t H, cudaStream_t stream);

}  // namespace rlh::kcudnn
