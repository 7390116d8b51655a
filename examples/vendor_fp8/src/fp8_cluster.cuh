// What the plugin's split-K products share (fp8_weight_only.cu, fp8_few_rows.cu): programmatic
// dependent launch, the multiprocessor count, and the epilogue that adds the partial tiles of a
// thread-block cluster's blocks through distributed shared memory, in rank order (so the sum is
// the same every run), and writes C.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace vfp8 {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void grid_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void grid_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;"); }

// C[m0 + col, n0 + row] = alpha * (sum over the cluster's blocks of tile[col * stride + row]) +
// beta * C, for col < cols (tokens; those at or past M skipped) and row < rows (C's columns; those
// at or past N skipped). Each block of the cluster writes its share of the elements, four rows a
// thread: rows, stride and N are multiples of 4 and the tile is 16-byte aligned (both callers'
// bands are). A thread's four-row groups from every block of the cluster are loaded at once, then
// added in rank order (the sum is the same every run). The first form loaded one float a block at
// a time: at 64 tokens that was 32 dependent remote loads a thread, ~2-5 us of a 6-17 us product.
// Call with every thread of every block, once each block's tile is written; it returns after the
// cluster's last read of any tile.
__device__ inline void cluster_sum_store(float* tile, int stride, int cols, int rows, int64_t m0, int64_t n0,
                                         int64_t M, int64_t N, void* c, int64_t ldc, bool c_bf16, float alpha,
                                         float beta) {
  namespace cg = cooperative_groups;
  constexpr int kMax = 8;  // blocks of a cluster (the portable maximum)
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int splits = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int quads = rows / 4, groups = cols * quads, per = (groups + splits - 1) / splits;
  const int g_end = (rank + 1) * per < groups ? (rank + 1) * per : groups;
  for (int e = rank * per + int(threadIdx.x); e < g_end; e += int(blockDim.x)) {
    const int col = e / quads, row = (e % quads) * 4;
    const int64_t m = m0 + col, n = n0 + row;
    if (m >= M || n >= N) continue;
    float* const mine = tile + col * stride + row;
    float4 x[kMax];
#pragma unroll
    for (int q = 0; q < kMax; ++q)
      if (q < splits) x[q] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(mine, q));
    float v[4] = {x[0].x, x[0].y, x[0].z, x[0].w};
#pragma unroll
    for (int q = 1; q < kMax; ++q)
      if (q < splits) {
        v[0] += x[q].x;
        v[1] += x[q].y;
        v[2] += x[q].z;
        v[3] += x[q].w;
      }
    if (c_bf16) {
      __nv_bfloat16* p = static_cast<__nv_bfloat16*>(c) + m * ldc + n;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[i] *= alpha;
        if (beta != 0.f) v[i] += beta * __bfloat162float(p[i]);
      }
      if ((reinterpret_cast<uintptr_t>(p) & 7) == 0) {
        const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
        uint2 w;
        w.x = *reinterpret_cast<const uint32_t*>(&lo);
        w.y = *reinterpret_cast<const uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(p) = w;
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) p[i] = __float2bfloat16_rn(v[i]);
      }
    } else {
      float* p = static_cast<float*>(c) + m * ldc + n;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[i] *= alpha;
        if (beta != 0.f) v[i] += beta * p[i];
      }
      if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) p[i] = v[i];
      }
    }
  }
  cluster.sync();  // no block leaves while another reads its tile
}
#endif

// Launches a split-K product: grid (bands, splits, chunks) with the splits of a band in one
// cluster along y, and programmatic dependent launch where `pdl`. Throws std::runtime_error
// naming `what` when the launch fails.
template <class Params>
void launch_split_k(void (*kernel)(Params), const Params& p, dim3 grid, unsigned threads, size_t smem, bool pdl,
                    cudaStream_t st, const char* what) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute at[2];
  at[0].id = cudaLaunchAttributeClusterDimension;
  at[0].val.clusterDim.x = 1;
  at[0].val.clusterDim.y = grid.y;
  at[0].val.clusterDim.z = 1;
  at[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = pdl ? 2 : 1;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, p);
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// The current device's multiprocessor count (kept per device), and the device in *dev.
inline int sm_count(int* dev = nullptr) {
  static std::mutex mu;
  static std::vector<int> counts;
  int d = 0;
  if (cudaGetDevice(&d) != cudaSuccess) d = 0;
  if (dev) *dev = d;
  std::lock_guard<std::mutex> lock(mu);
  if (size_t(d) >= counts.size()) counts.resize(size_t(d) + 1, 0);
  if (counts[size_t(d)] == 0) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, d);
    counts[size_t(d)] = n > 0 ? n : 132;
  }
  return counts[size_t(d)];
}

}  // namespace vfp8
