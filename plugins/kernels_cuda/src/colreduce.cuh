// Deterministic column sums over rows: out[c] (+)= sum_r term(r, c). Rows are cut into fixed
// chunks of kColChunk; one thread per column sums its chunk (coalesced across the warp), the
// partials go to the workspace, and colreduce_finish adds them in a fixed order.
#pragma once

#include <algorithm>

#include "common.cuh"

namespace rlh::kcuda {

constexpr int64_t kColChunk = 64;

template <class T, class Term, class Extra>
__global__ void colreduce_partial_kernel(const T* a, int64_t lda, int64_t N, int64_t C,
                                         Term term, Extra extra, float* partial) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  if (c >= C) return;
  const int64_t r0 = chunk * kColChunk, r1 = min(N, r0 + kColChunk);
  float acc = 0.f;
  for (int64_t r = r0; r < r1; ++r) acc += term(a, lda, r, c, extra);
  partial[chunk * C + c] = acc;
}

// Adds the partial rows (chunks of them, C wide) into out: a block takes 32 columns, warp w sums
// partial rows w, w + 8, ... in order (8 loads in flight a lane), and warp 0 adds the 8 warps'
// sums in warp order (deterministic). One thread a column over every partial row ran on C / 256
// blocks, ~32 us a call at C = 2048 (H100 ncu, 2026-12-07).
constexpr int kFinishWarps = 8;

template <int = 0>
__global__ void __launch_bounds__(kFinishWarps * 32)
colreduce_finish_kernel(const float* partial, int64_t chunks, int64_t C, Flex out, bool accumulate) {
  __shared__ float sums[kFinishWarps][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t c = blockIdx.x * int64_t(32) + lane;
  float acc = 0.f;
  if (c < C) {
    int64_t k = warp;
    for (; k + 7 * kFinishWarps < chunks; k += 8 * kFinishWarps) {
      float v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = partial[(k + u * kFinishWarps) * C + c];
#pragma unroll
      for (int u = 0; u < 8; ++u) acc += v[u];
    }
    for (; k < chunks; k += kFinishWarps) acc += partial[k * C + c];
  }
  sums[warp][lane] = acc;
  __syncthreads();
  if (warp == 0 && c < C) {
    float t = 0.f;
    for (int w = 0; w < kFinishWarps; ++w) t += sums[w][lane];
    st_flex(out, c, accumulate ? ld_flex(out, c) + t : t);
  }
}

// colreduce_finish_kernel's launch.
inline void colreduce_finish(const float* partial, int64_t chunks, int64_t C, Flex out, bool accumulate,
                             cudaStream_t s) {
  colreduce_finish_kernel<0><<<ceil_div(C, 32), kFinishWarps * 32, 0, s>>>(partial, chunks, C, out, accumulate);
}

// Adapts a 4-argument term (no extra state) to the 5-argument form.
template <class Term>
struct NoExtra {
  Term t;
  template <class T>
  __device__ float operator()(const T* a, int64_t lda, int64_t r, int64_t c, const void*) const {
    return t(a, lda, r, c);
  }
};

template <class T, class Term, class Extra>
void column_reduce5(const T* a, int64_t lda, int64_t N, int64_t C, Term term, Extra extra,
                    Flex out, bool accumulate, Workspace& ws, cudaStream_t s) {
  const int64_t chunks = std::max<int64_t>(1, (N + kColChunk - 1) / kColChunk);
  float* partial = static_cast<float*>(ws.get(size_t(chunks * C) * sizeof(float)));
  if (N == 0) {
    cudaMemsetAsync(partial, 0, size_t(C) * sizeof(float), s);
  } else {
    dim3 grid(ceil_div(C, 256), unsigned(chunks));
    colreduce_partial_kernel<<<grid, 256, 0, s>>>(a, lda, N, C, term, extra, partial);
  }
  colreduce_finish(partial, chunks, C, out, accumulate, s);
}

template <class T, class Term>
void column_reduce(const T* a, int64_t lda, int64_t N, int64_t C, Term term, const void* extra,
                   Flex out, bool accumulate, Workspace& ws, cudaStream_t s) {
  column_reduce5(a, lda, N, C, NoExtra<Term>{term}, extra, out, accumulate, ws, s);
}

}  // namespace rlh::kcuda
