// Device-side conversions for a refit: a generator fills its bf16 weight arena from a trainer's
// fp32 (or bf16) device views without a host round trip (rlh_backend_api.visit_weights_on).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace rlh::engine::cuda {

// dst[r * dst_ld + c] = bf16(src[r * src_ld + c]) for r < rows, c < cols: round to nearest even
// (NaN stays NaN), the same rounding as the engine's working copy and the host path's.
void convert_f32_to_bf16_2d(const float* src, int64_t src_ld, void* dst, int64_t dst_ld, int64_t rows,
                            int64_t cols, cudaStream_t s);
// dst[i] = float(src[i]) (exact) for i < n.
void convert_bf16_to_f32(const void* src, float* dst, int64_t n, cudaStream_t s);

}  // namespace rlh::engine::cuda
