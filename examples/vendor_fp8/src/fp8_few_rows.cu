// The block-scaled FP8 product of a few rows (fp8_gemm.hpp, gemm_few_rows): C = alpha (sa . A)
// (sb . B)^T + beta C with A e4m3 [M, K] in 1x128 tiles (a decoding step's activations) and B
// e4m3 [N, K] in 128x128 blocks (the weights' FP8 copy), DeepSeek-V3's scaling. Why a kernel of
// our own: at these rows the product is bound by reading the weights, and cuBLASLt's
// block-scaled kernels (128 x 128 tiles, split K through a second reduction kernel) streamed
// them at 0.4-1.0 TB/s at 64 rows (ncu, H100, 2026-12-06), and refuse a single row.
//
// Layout. A block owns one band of 128 weight rows (output columns: one band of block scales) and
// a chunk of up to 64 tokens, over a range of K. K moves a 128-column stage at a time, one scale
// block: the stage's products are summed in fp32 and then promoted, times the band's weight
// scale and each token's tile scale, into the accumulators (what cuBLASLt does with these
// scales, and what keeps the tensor cores' reduced-precision accumulation to 128 terms). Stages
// arrive by cp.async, several in flight, in 128-byte rows whose 16-byte chunks are swizzled by
// the row (chunk ^ row % 8, within 1024-byte groups of 8 rows): the layout Hopper's warpgroup
// products read as 128B swizzle, and one where ldmatrix's eight rows fall in eight bank groups.
// The products (WG): two warpgroups, each wgmma m64nNk32 e4m3 over its 64 weight rows and the N
// tokens, from descriptors over the tiles; or (VFP8_FEW_ROWS_WGMMA=0) mma.sync m16n8k32 e4m3,
// a warp's 16 weight rows from ldmatrix. Either way warp w's fragment holds weight rows 16 w + g
// (+ 8) and tokens 8 j + 2 t (+ 1), so the promotion and the epilogue are shared.
//
// Split K. As in fp8_weight_only.cu: the K range is cut among the blocks of a thread-block
// cluster (up to 8), which add their partial tiles through distributed shared memory in rank
// order (deterministic, no workspace, no second launch). The weights' first stages are queued
// before griddepcontrol.wait (programmatic dependent launch: docs/ops.md's stream-order contract
// lets gemm read B early); the activations and their scales after it.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "fp8_cluster.cuh"
#include "fp8_codes.cuh"
#include "fp8_gemm.hpp"

namespace vfp8 {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kBand = 128;     // weight rows a block: one band of block scales
constexpr int kStageK = 128;   // K a stage: one block of scales
constexpr int kMaxSplits = 8;  // blocks of a cluster (the portable maximum)
constexpr int kTileStride = kBand + 4;  // the partial tile's row, padded off bank conflicts

// A stage of a chunk of 8 NT tokens: the weights' 128 x 128 codes, then the tokens' 8 NT x 128
// codes and their 8 NT tile scales, or with QA (A in bf16, quantised in the kernel) their bf16
// values; padded to 1024 bytes so every tile starts a swizzle group. With QA the stage being
// computed is quantised into one more region (codes and scales) after the ring, which has a
// stage fewer (2 blocks a multiprocessor either way: 101 and 105 KiB at 64 tokens).
template <int NT, bool QA>
struct Stage {
  static constexpr int stages = QA ? 3 : 4;  // in the ring (stages - 1 in flight while one is computed)
  static constexpr int tokens = 8 * NT;
  static constexpr int w_bytes = kBand * kStageK;
  static constexpr int a_bytes = tokens * kStageK * (QA ? 2 : 1);
  static constexpr int s_bytes = QA ? 0 : tokens * 4;
  static constexpr int bytes = (w_bytes + a_bytes + s_bytes + 1023) / 1024 * 1024;
  static constexpr int q_offset = stages * bytes;  // QA: the codes being computed, then their scales
  // (+ 1024: the tiles start 1024-byte aligned, as the tensor cores' swizzle reads them)
  static constexpr int smem = q_offset + (QA ? tokens * kStageK + tokens * 4 : 0) + 1024;
  static_assert(smem >= tokens * kTileStride * 4, "the partial tile reuses the stages' memory");
};

struct Params {
  int64_t M, N, K;
  const uint8_t* a;
  int64_t lda;
  const uint8_t* b;
  int64_t ldb;
  const float* sa;  // s[kb * M + m]
  const float* sb;  // s[band * kb4 + kb]
  int64_t kb4;
  void* c;
  int64_t ldc;
  bool c_bf16;
  float alpha, beta;
  int64_t steps_per_split;
  float qa_mult;  // QA: the scales' 2^margin
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes (or, with n = 0, zeros) into shared memory, through L2 only: each code is read once.
__device__ __forceinline__ void cp16(uint32_t dst, const void* src, int n) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp4(uint32_t dst, const void* src, int n) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldsm4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// Row r's 16-byte chunk ch of a 128-byte-row tile, swizzled.
__device__ __forceinline__ uint32_t swz(int r, int ch) { return uint32_t(r * 128 + ((ch ^ (r & 7)) << 4)); }
#endif

// Hopper's warpgroup products (sm_90a): a warpgroup's 64 weight rows x N tokens x 32 of K from
// shared memory, both operands K-major in 128-byte rows swizzled as swz() lays them (the layout
// wgmma calls 128B swizzle: 16-byte chunk ^ row % 8 within each 1024-byte group of 8 rows).
// The descriptor: start address, stride 1024 bytes between groups of 8 rows, 128B swizzle; K
// advances 32 bytes a step within the rows.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Shared memory written by threads (cp.async, stores) is made visible to the tensor cores' reads.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_n16(float (&d)[2][4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
      : "l"(da), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_n32(float (&d)[4][4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(da), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_n64(float (&d)[8][4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(da), "l"(db), "r"(accumulate));
}
template <int NT>
__device__ __forceinline__ void wgmma_tile(float (&d)[NT][4], uint64_t da, uint64_t db, int accumulate) {
  if constexpr (NT == 2) wgmma_n16(d, da, db, accumulate);
  else if constexpr (NT == 4) wgmma_n32(d, da, db, accumulate);
  else wgmma_n64(d, da, db, accumulate);
}
#endif

// One chunk of 8 NT tokens (blockIdx.z) x one band of 128 weight rows (blockIdx.x) x a range of
// K (blockIdx.y, a block of the cluster). QA: A is bf16, and each stage's tokens are quantised to
// 1x128 tiles here, as quantize_fp8 (grouping 1, current scaling) writes them: the same codes and
// scales, so the same product as the pass followed by the codes' product, without the pass.
template <int NT, bool QA, bool WG>
__global__ void __launch_bounds__(kThreads, 2) few_rows_kernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (WG) {  // (launched only where the host saw compute capability 9.0: sm_90a code)
    __trap();
  } else
#endif
  {
  using S = Stage<NT, QA>;
  constexpr int kRing = S::stages;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* const smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int t = lane & 3;
  const int64_t n0 = int64_t(blockIdx.x) * kBand;
  const int64_t m0 = int64_t(blockIdx.z) * S::tokens;
  const int64_t stages = p.K / kStageK;
  const int64_t s_begin = int64_t(blockIdx.y) * p.steps_per_split;
  const int64_t s_end = s_begin + p.steps_per_split < stages ? s_begin + p.steps_per_split : stages;
  const uint32_t base = smem_addr(smem);

  // A stage's weights: 128 rows x 8 chunks, 4 a thread, 8 threads a 128-byte row (whole lines).
  auto load_w = [&](int slot, int64_t s) {
    const uint32_t dst = base + uint32_t(slot * S::bytes);
#pragma unroll
    for (int i = 0; i < kBand * 8 / kThreads; ++i) {
      const int idx = tid + i * kThreads, r = idx >> 3, ch = idx & 7;
      cp16(dst + swz(r, ch), p.b + (n0 + r) * p.ldb + s * kStageK + ch * 16, 16);
    }
  };
  // The tokens' codes (zeros past M) and tile scales (zeros past M: those columns add nothing);
  // QA: their bf16 values (zeros past M), 256-byte rows whose odd rows swap their halves' 16-byte
  // chunks (quantise's reads then take the banks of 2 rows at once without conflict).
  auto load_a = [&](int slot, int64_t s) {
    const uint32_t dst = base + uint32_t(slot * S::bytes + S::w_bytes);
    if constexpr (QA) {
      const auto* a = reinterpret_cast<const __nv_bfloat16*>(p.a);
      for (int idx = tid; idx < S::tokens * 16; idx += kThreads) {
        const int r = idx >> 4, ch = idx & 15;
        const int64_t m = m0 + r;
        const bool in = m < p.M;
        cp16(dst + uint32_t(r * 256 + ((ch ^ ((r & 1) << 2)) << 4)), a + (in ? m : 0) * p.lda + s * kStageK + ch * 8,
             in ? 16 : 0);
      }
    } else {
      for (int idx = tid; idx < S::tokens * 8; idx += kThreads) {
        const int r = idx >> 3, ch = idx & 7;
        const int64_t m = m0 + r;
        const bool in = m < p.M;
        cp16(dst + swz(r, ch), p.a + (in ? m : 0) * p.lda + s * kStageK + ch * 16, in ? 16 : 0);
      }
      if (tid < S::tokens) {
        const int64_t m = m0 + tid;
        const bool in = m < p.M;
        cp4(dst + uint32_t(S::a_bytes + 4 * tid), p.sa + s * p.M + (in ? m : 0), in ? 4 : 0);
      }
    }
  };

#pragma unroll
  for (int i = 0; i < kRing - 1; ++i)
    if (s_begin + i < s_end) load_w(i, s_begin + i);
  grid_wait();  // A, its scales (and C when beta != 0) may be the kernel before's output
  grid_launch_dependents();
#pragma unroll
  for (int i = 0; i < kRing - 1; ++i) {
    if (s_begin + i < s_end) load_a(i, s_begin + i);
    cp_commit();  // (an empty group where the range is short: the waits count groups)
  }

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
  const float* sw_row = p.sb + (n0 / kBand) * p.kb4;

  // ldmatrix's row addresses: lanes 8q .. 8q + 7 give matrix q's eight rows.
  // Weights (A operand): matrices (rows 0-7, chunk 2ks), (8-15, 2ks), (0-7, 2ks+1), (8-15, 2ks+1).
  const int w_row = 16 * warp + (lane & 7) + 8 * ((lane >> 3) & 1), w_half = lane >> 4;
  // Tokens (B operand), two 8-token tiles j, j+1 a load: (j, 2ks), (j, 2ks+1), (j+1, 2ks), (j+1, 2ks+1).
  const int a_row = 8 * (lane >> 4) + (lane & 7), a_half = (lane >> 3) & 1;

  for (int64_t s = s_begin; s < s_end; ++s) {
    const int slot = int((s - s_begin) % kRing);
    cp_wait<kRing - 2>();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (WG) fence_async_shared();
#endif
    __syncthreads();  // stage s is in, and every warp is done with the slot refilled next
    {
      const int64_t next = s + kRing - 1;
      if (next < s_end) {
        const int ns = int((next - s_begin) % kRing);
        load_w(ns, next);
        load_a(ns, next);
      }
      cp_commit();
    }
    const uint32_t wt = base + uint32_t(slot * S::bytes);
    uint32_t at = wt + uint32_t(S::w_bytes);
    const float* sa = reinterpret_cast<const float*>(smem + slot * S::bytes + S::w_bytes + S::a_bytes);
    if constexpr (QA) {
      // Four threads a token, 32 values each (16-byte chunks l, l + 4, l + 8, l + 12), the
      // tile's amax over the four, then its scale and codes as fp8_kernels.cu's tile pass makes
      // them (fp8_codes.cuh).
      const uint8_t* vals = smem + slot * S::bytes + S::w_bytes;
      uint8_t* codes = smem + S::q_offset;
      float* scales = reinterpret_cast<float*>(smem + S::q_offset + S::tokens * kStageK);
      if (tid < 4 * S::tokens) {  // (whole warps: 4 x 16 tokens at least)
        const int r = tid >> 2, l = tid & 3;
        float v[4][8];
        unsigned mx = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          load8_bf16(vals + r * 256 + (((l + 4 * i) ^ ((r & 1) << 2)) << 4), v[i]);
#pragma unroll
          for (int e = 0; e < 8; ++e) mx = max(mx, abs_bits(v[i][e]));
        }
        mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float sc = scale_of(__uint_as_float(mx), 448.0f, p.qa_mult);
        const Divisor d(sc);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int c = l + 4 * i;  // values 8c .. 8c + 7: half c % 2 of 16-byte chunk c / 2
          *reinterpret_cast<uint2*>(codes + swz(r, c >> 1) + (c & 1) * 8) = codes8(v[i], d, Fmt::e4m3);
        }
        if (l == 0) scales[r] = sc;
      }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
      if constexpr (WG) fence_async_shared();
#endif
      __syncthreads();
      at = smem_addr(codes);
      sa = scales;
    }
    float part[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) part[j][i] = 0.f;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    // Warpgroup products: warpgroup warp / 4 takes weight rows 64 (warp / 4) .. + 63, so warp w's
    // fragment holds rows 16 w + g (+ 8), as the mma.sync form below and the epilogue take them.
    if constexpr (WG) {
      const uint32_t wa = wt + uint32_t((warp >> 2) * 64 * kStageK);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kStageK / 32; ++ks)
        wgmma_tile<NT>(part, sw128_desc(wa + 32 * ks), sw128_desc(at + 32 * ks), ks > 0 ? 1 : 0);
      wgmma_commit();
      wgmma_wait();
    } else
#endif
    {  // mma.sync, 16 rows a warp (VFP8_FEW_ROWS_WGMMA=0: the A/B)
#pragma unroll
    for (int ks = 0; ks < kStageK / 32; ++ks) {
      uint32_t a0, a1, a2, a3;
      ldsm4(wt + swz(w_row, 2 * ks + w_half), a0, a1, a2, a3);
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        uint32_t b0, b1, b2, b3;
        ldsm4(at + swz(8 * j + a_row, 2 * ks + a_half), b0, b1, b2, b3);
        mma_e4m3(part[j], a0, a1, a2, a3, b0, b1);
        mma_e4m3(part[j + 1], a0, a1, a2, a3, b2, b3);
      }
    }
    }
    // Promotion: C fragment (row g | g + 8, tokens 2t, 2t + 1) times the band's scale and the
    // two tokens' tile scales of this stage.
    const float sw = __ldg(sw_row + s);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const float2 x = *reinterpret_cast<const float2*>(sa + 8 * j + 2 * t);
      const float s0 = sw * x.x, s1 = sw * x.y;
      acc[j][0] = fmaf(part[j][0], s0, acc[j][0]);
      acc[j][1] = fmaf(part[j][1], s1, acc[j][1]);
      acc[j][2] = fmaf(part[j][2], s0, acc[j][2]);
      acc[j][3] = fmaf(part[j][3], s1, acc[j][3]);
    }
  }
  cp_wait<0>();
  __syncthreads();  // the stages' memory becomes the partial tile [token][row]
  float* tile = reinterpret_cast<float*>(smem);
  {
    const int row = 16 * warp + (lane >> 2);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int col = 8 * j + 2 * t;
      tile[col * kTileStride + row] = acc[j][0];
      tile[(col + 1) * kTileStride + row] = acc[j][1];
      tile[col * kTileStride + row + 8] = acc[j][2];
      tile[(col + 1) * kTileStride + row + 8] = acc[j][3];
    }
  }
  cluster_sum_store(tile, kTileStride, S::tokens, kBand, m0, n0, p.M, p.N, p.c, p.ldc, p.c_bf16, p.alpha, p.beta);
  }
#endif
}

// The kernel's dynamic shared memory past 48 KiB is an attribute set once a device.
template <int NT, bool QA, bool WG>
void allow_smem(int dev) {
  static std::mutex mu;
  static std::set<int> done;
  std::lock_guard<std::mutex> lock(mu);
  if (done.count(dev)) return;
  const cudaError_t e =
      cudaFuncSetAttribute(few_rows_kernel<NT, QA, WG>, cudaFuncAttributeMaxDynamicSharedMemorySize, Stage<NT, QA>::smem);
  if (e != cudaSuccess) throw std::runtime_error(std::string("few-row FP8 product: ") + cudaGetErrorString(e));
  done.insert(dev);
}

template <int NT, bool QA, bool WG>
void launch_one(const Params& p, int splits, int64_t chunks, int dev, cudaStream_t st) {
  allow_smem<NT, QA, WG>(dev);
  launch_split_k(few_rows_kernel<NT, QA, WG>, p, dim3(unsigned(p.N / kBand), unsigned(splits), unsigned(chunks)),
                 kThreads, Stage<NT, QA>::smem, true, st, "few-row FP8 product");
}

// The warpgroup products by default; VFP8_FEW_ROWS_WGMMA=0 takes mma.sync (the A/B). mma.sync's
// e4m3 products bounded the kernel past 16 rows; wgmma's were faster at every row count (a
// Llama-3.2-1B layer's four products: 27.7 against 32.7 us at 1 row, 30.2 / 34.7 at 16, 46.4 /
// 69.2 at 64; H100, 2026-12-07).
bool use_wgmma() {
  static const bool on = [] {
    const char* e = std::getenv("VFP8_FEW_ROWS_WGMMA");
    return !(e && std::string(e) == "0");
  }();
  return on;
}

template <int NT, bool QA>
void launch(const Params& p, int splits, int64_t chunks, int dev, cudaStream_t st) {
  if (use_wgmma())
    launch_one<NT, QA, true>(p, splits, chunks, dev, st);
  else
    launch_one<NT, QA, false>(p, splits, chunks, dev, st);
}

template <int NT, bool QA>
void allow_both(int dev) {
  allow_smem<NT, QA, true>(dev);
  allow_smem<NT, QA, false>(dev);
}

}  // namespace

void few_rows_prepare() {
  int dev = 0;
  sm_count(&dev);
  allow_both<2, false>(dev);
  allow_both<4, false>(dev);
  allow_both<8, false>(dev);
  allow_both<2, true>(dev);
  allow_both<4, true>(dev);
  allow_both<8, true>(dev);
}

int64_t few_rows_bound() {
  static const int64_t bound = [] {
    const char* e = std::getenv("VFP8_FEW_ROWS_MAX");
    return e && *e ? int64_t(std::atoll(e)) : int64_t(16);
  }();
  return bound;
}

std::string few_rows_unsupported(const GemmArgs& g) {
  if (g.scaling != Scaling::tiles_blocks) return "only 1x128 x 128x128 block scaling";
  if ((!g.a_bf16 && g.fa != Fmt::e4m3) || g.fb != Fmt::e4m3) return "e4m3 operands only";
  if (g.K % kStageK != 0 || g.N % kBand != 0)
    return "N and K must be multiples of 128 (N " + std::to_string(g.N) + ", K " + std::to_string(g.K) + ")";
  if ((g.a_bf16 ? g.lda % 8 : g.lda % 16) != 0 || g.ldb % 16 != 0)
    return "A's and B's row strides must be multiples of 16 bytes";
  return "";
}

void gemm_few_rows(const GemmArgs& g, cudaStream_t st) {
  if (g.M <= 0) return;
  Params p{};
  p.M = g.M;
  p.N = g.N;
  p.K = g.K;
  p.a = static_cast<const uint8_t*>(g.a);
  p.lda = g.lda;
  p.b = static_cast<const uint8_t*>(g.b);
  p.ldb = g.ldb;
  p.sa = g.sa;
  p.sb = g.sb;
  p.kb4 = ceil_div(ceil_div(g.K, 128), 4) * 4;
  p.c = g.c;
  p.ldc = g.ldc;
  p.c_bf16 = g.c_bf16;
  p.alpha = g.alpha;
  p.beta = g.beta;
  // Tokens: the fewest 8-token tiles that hold M (2, 4 or 8), chunks of 64 past that.
  const int NT = g.M <= 16 ? 2 : g.M <= 32 ? 4 : 8;
  const int64_t chunks = ceil_div(g.M, 8 * NT);
  // Splits of K: as many as keep every block in one wave of 2 a multiprocessor (a second wave
  // would run a fraction of the SMs for a whole block's time), at most a cluster's 8 and a stage
  // each.
  int dev = 0;
  const int sms = sm_count(&dev);
  const int64_t tiles = (g.N / kBand) * chunks, stages = g.K / kStageK;
  // VFP8_FEW_ROWS_SPLITS caps them (the A/B: fewer blocks a cluster, a smaller sum through
  // distributed shared memory, more K a block).
  static const int64_t max_splits = [] {
    const char* e = std::getenv("VFP8_FEW_ROWS_SPLITS");
    return e && *e ? std::clamp<int64_t>(std::atoll(e), 1, kMaxSplits) : int64_t(kMaxSplits);
  }();
  int64_t splits = std::clamp<int64_t>(2 * int64_t(sms) / tiles, 1, std::min<int64_t>(max_splits, stages));
  p.steps_per_split = ceil_div(stages, splits);
  splits = ceil_div(stages, p.steps_per_split);  // no split left without a stage
  p.qa_mult = g.a_margin_mult;
  const int sp = int(splits);
  if (g.a_bf16) {
    switch (NT) {
      case 2: launch<2, true>(p, sp, chunks, dev, st); break;
      case 4: launch<4, true>(p, sp, chunks, dev, st); break;
      default: launch<8, true>(p, sp, chunks, dev, st); break;
    }
  } else {
    switch (NT) {
      case 2: launch<2, false>(p, sp, chunks, dev, st); break;
      case 4: launch<4, false>(p, sp, chunks, dev, st); break;
      default: launch<8, false>(p, sp, chunks, dev, st); break;
    }
  }
}

}  // namespace vfp8
