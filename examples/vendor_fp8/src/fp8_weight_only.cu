// The weight-only FP8 product (fp8_kernels.hpp, gemm_weight_only): C = alpha A (s B)^T + beta C
// with A bf16 [M, K] (a decoding step's activations, a few to 64 rows) and B e4m3 [N, K] (the
// weights' FP8 copy). Why a kernel of our own: a decoding step is bandwidth-bound on the
// weights, and cuBLASLt's FP8 products need A in FP8 too, so every product paid a quantisation
// pass over its activations, a launch-bound kernel of its own at these sizes (four a layer took
// as long as the FP8 products saved at batch 64 on an H100, 2026-12-06). Here the weights are
// read once, as FP8, and dequantised in registers; the activations stay bf16 (W8A16: more exact
// than quantising them too).
//
// Layout. A warp owns 32 weight rows (output columns) and all of a chunk's tokens (up to 64)
// over a range of K. Its products are mma.sync m16n8k16 in bf16 with the weights as the A
// operand (16 rows) and the tokens as B (8 columns). A lane loads 16 V consecutive codes of each
// of its 4 rows per step of 64 V (V = 2 at one token group: whole 128-byte lines of a row; 1
// past that), so the fragments take K in a permuted order: slot (t, p, e) of mma j (t = lane %
// 4, pair p, element e) holds k = 16 V t + 4 j + 2 p + e, on both operands (a dot product does
// not care in which order its terms are paired, only that both sides agree). The activations
// are read with the same permutation: 8 bytes of a token's row a (j, token group).
// Scales (one, or one per 128 x 128 block) multiply the codes as they are converted: a step of
// up to 128 and a warp's 32 rows lie in one block.
//
// Split K. A block is 4 warps (128 rows, one block-scale band); the K range is cut among the
// blocks of a thread-block cluster (up to 8), which add their partial tiles through distributed
// shared memory in rank order (deterministic), each writing its share of C. This keeps a 2048
// x 2048 weight spread over ~128 blocks instead of 16, with no workspace and no second launch.
// The weights' first steps are loaded before griddepcontrol.wait (programmatic dependent launch:
// nothing a decoding step's kernels write is a weight), so they are in flight while the kernel
// before finishes; docs/ops.md's stream-order contract allows it.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "fp8_cluster.cuh"
#include "fp8_kernels.hpp"

namespace vfp8 {
namespace {

constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 32;
constexpr int kBlockRows = kWarps * kRowsPerWarp;  // 128: one band of block scales
// K a step: V 16-byte loads of a row a lane (16 V consecutive codes; 4 lanes a row cover 64 V
// bytes of it). V = 2 reads whole 128-byte lines of each row.
template <int V>
constexpr int kStep = 64 * V;
// Steps of weights in flight a lane (4 x 16 V bytes a row): 256 bytes a row for up to 16
// tokens, half past that, where the products' registers would otherwise spill.
template <int G, int V>
constexpr int kAhead = (G <= 2 ? 4 : 2) / V;
constexpr int kMaxSplits = 8;                       // blocks of a cluster (the portable maximum)
constexpr int kTileStride = kBlockRows + 4;         // the partial tile's row, padded off bank conflicts

struct Params {
  int64_t M, N, K;
  const __nv_bfloat16* a;
  int64_t lda;
  const uint8_t* b;
  int64_t ldb;
  const float* sb;
  int64_t kb4;  // block scales: the row of the scale matrix (0: one scale)
  void* c;
  int64_t ldc;
  bool c_bf16;
  float alpha, beta;
  int64_t steps_per_split;
};


// Two e4m3 codes (a 16-bit word) to two bf16 values times s: the codes convert exactly to half
// (hardware pair conversion), the product with s rounds once, to bf16.
__device__ __forceinline__ uint32_t codes_to_bf16x2(uint32_t two, float s) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  const __nv_bfloat162 r = __floats2bfloat162_rn(f.x * s, f.y * s);
  return *reinterpret_cast<const uint32_t*>(&r);
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One step of K for a warp: per mma j, its rows' codes 4 j .. 4 j + 3 (word j of the lane's
// 16 V codes) as two bf16 pairs a row (af), then the products with each token group's 4 values
// at 16 V t + 4 j.
// One token group (batch 1 to 8): j outer, each j's 8 bytes of the token row loaded as it comes.
// Several groups: the step's weights converted first (af for every j), then per group the
// lane's 16 V activations at once (2 V 16-byte loads: 4 lanes read 128 contiguous bytes of a
// token row, whole sectors) instead of 4 V 8-byte loads strided 32 bytes apart (a quarter of
// each sector used; L1 was 57% busy at 64 rows, ncu, H100, 2026-12-06). Same products in the
// same order: the result is bitwise the same.
template <int G, int V>
__device__ __forceinline__ void step(const uint4 (&w)[4][V], int64_t s, float sc, float (&acc)[2][G][4],
                                     const __nv_bfloat16* const (&arow)[G], const bool (&tok)[G]) {
  auto word_of = [](const uint4& q, int i) { return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w; };
  if constexpr (G == 1) {
#pragma unroll
    for (int j = 0; j < 4 * V; ++j) {
      uint32_t af[4][2];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const uint32_t word = word_of(w[r][j / 4], j % 4);
        af[r][0] = codes_to_bf16x2(word, sc);
        af[r][1] = codes_to_bf16x2(word >> 16, sc);
      }
      uint2 x = make_uint2(0, 0);
      if (tok[0]) x = __ldg(reinterpret_cast<const uint2*>(arow[0] + s * kStep<V> + 4 * j));
#pragma unroll
      for (int h = 0; h < 2; ++h)  // rows n0 + 16 h + gi (r = 2 h) and + 8 (r = 2 h + 1)
        mma_bf16(acc[h][0], af[2 * h][0], af[2 * h + 1][0], af[2 * h][1], af[2 * h + 1][1], x.x, x.y);
    }
  } else {
    uint32_t af[4 * V][4][2];
#pragma unroll
    for (int j = 0; j < 4 * V; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const uint32_t word = word_of(w[r][j / 4], j % 4);
        af[j][r][0] = codes_to_bf16x2(word, sc);
        af[j][r][1] = codes_to_bf16x2(word >> 16, sc);
      }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      uint4 x[2 * V];  // values 16 V t .. 16 V t + 16 V - 1 of token row 8 g + gi
#pragma unroll
      for (int v = 0; v < 2 * V; ++v)
        x[v] = tok[g] ? __ldg(reinterpret_cast<const uint4*>(arow[g] + s * kStep<V>) + v) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int j = 0; j < 4 * V; ++j) {
        const uint32_t b0 = word_of(x[j / 2], (j % 2) * 2), b1 = word_of(x[j / 2], (j % 2) * 2 + 1);
#pragma unroll
        for (int h = 0; h < 2; ++h)
          mma_bf16(acc[h][g], af[j][2 * h][0], af[j][2 * h + 1][0], af[j][2 * h][1], af[j][2 * h + 1][1], b0, b1);
      }
    }
  }
}

// Blocks a multiprocessor each form is compiled to hold (the registers a thread: 128 at G = 1,
// ~168 at 2 and 4, 255 at 8). Stated, not left to ptxas: the cluster sum's wider epilogue took
// the G = 1 kernels to 134-136 registers, 3 blocks an SM instead of 4, and a 1B model's gate|up
// at 1 row from 16 to 22 us (H100, 2026-12-07).
template <int G>
constexpr int kMinBlocks = G == 1 ? 4 : G == 8 ? 2 : 3;

// G groups of 8 tokens a chunk (M <= 8 G, or 64 a chunk with G = 8 and blockIdx.z the chunk).
template <int G, int V>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks<G>) weight_only_kernel(Params p) {
  constexpr int A = kAhead<G, V>;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ __align__(16) float tile[8 * G][kTileStride];  // this block's partial sums [token][row]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gi = lane >> 2, t = lane & 3;
  const int64_t band = int64_t(blockIdx.x) * kBlockRows;
  const int64_t n0 = band + warp * kRowsPerWarp;
  const bool live = n0 < p.N;  // N % 32 == 0: a warp's rows are all in or all out
  const int64_t steps = p.K / kStep<V>;
  const int64_t s_begin = int64_t(blockIdx.y) * p.steps_per_split;
  const int64_t s_end = s_begin + p.steps_per_split < steps ? s_begin + p.steps_per_split : steps;
  const int64_t m0 = int64_t(blockIdx.z) * (8 * G);

  // Rows n0 + gi + 8 r (r = 0..3), this lane's 16 V codes at 16 V t within each step.
  const uint8_t* brow[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) brow[r] = p.b + (live ? n0 + gi + 8 * r : 0) * p.ldb + 16 * V * t;
  uint4 w[A][4][V];
  auto load = [&](int slot, int64_t s) {
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int v = 0; v < V; ++v)
        w[slot][r][v] = __ldcs(reinterpret_cast<const uint4*>(brow[r] + s * kStep<V>) + v);
  };
  if (live) {
#pragma unroll
    for (int u = 0; u < A; ++u)
      if (s_begin + u < s_end) load(u, s_begin + u);
  }
  grid_wait();  // A (and C when beta != 0) may be the kernel before's output
  grid_launch_dependents();

  float acc[2][G][4];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[h][g][i] = 0.f;

  // Token rows of this lane's B fragments: m0 + 8 g + gi.
  const __nv_bfloat16* arow[G];
  bool tok[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int64_t m = m0 + 8 * g + gi;
    tok[g] = m < p.M;
    arow[g] = p.a + (tok[g] ? m : 0) * p.lda + 16 * V * t;
  }
  const float* srow = p.kb4 ? p.sb + (n0 / kBlockRows) * p.kb4 : p.sb;

  if (live) {
    for (int64_t s0 = s_begin; s0 < s_end; s0 += A) {
#pragma unroll
      for (int u = 0; u < A; ++u) {
        const int64_t s = s0 + u;
        if (s >= s_end) break;
        const float sc = p.kb4 ? srow[(s * kStep<V>) / 128] : srow[0];
        if (s + A < s_end) {  // the slot's codes move to registers first, then it refills
          uint4 cur[4][V];
#pragma unroll
          for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int v = 0; v < V; ++v) cur[r][v] = w[u][r][v];
          load(u, s + A);
          step<G, V>(cur, s, sc, acc, arow, tok);
        } else {
          step<G, V>(w[u], s, sc, acc, arow, tok);
        }
      }
    }
  }
  // The partial tile: acc[h][g] = rows (16 h + gi, + 8) x tokens (8 g + 2 t, + 1) of this warp.
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int row = warp * kRowsPerWarp + 16 * h + gi, col = 8 * g + 2 * t;
      tile[col][row] = acc[h][g][0];
      tile[col + 1][row] = acc[h][g][1];
      tile[col][row + 8] = acc[h][g][2];
      tile[col + 1][row + 8] = acc[h][g][3];
    }
  cluster_sum_store(&tile[0][0], kTileStride, 8 * G, kBlockRows, m0, band, p.M, p.N, p.c, p.ldc, p.c_bf16, p.alpha,
                    p.beta);
#endif
}

// VFP8_W8_SPLITS=n caps the split of K (1..8) and VFP8_W8_PDL=0 launches without programmatic
// dependent launch: the A/B switches of bench_fp8_gemm --decode.
int env_int(const char* name, int dflt) {
  const char* e = std::getenv(name);
  return e && *e ? std::atoi(e) : dflt;
}

template <int G, int V>
void launch(const Params& p, int splits, int64_t chunks, cudaStream_t st) {
  static const bool pdl = env_int("VFP8_W8_PDL", 1) != 0;
  launch_split_k(weight_only_kernel<G, V>, p,
                 dim3(unsigned((p.N + kBlockRows - 1) / kBlockRows), unsigned(splits), unsigned(chunks)), kWarps * 32, 0,
                 pdl, st, "weight-only FP8 product");
}

}  // namespace

std::string weight_only_unsupported(const WeightOnlyArgs& w) {
  if (w.K % kStep<1> != 0) return "K must be a multiple of 64 (got " + std::to_string(w.K) + ")";
  if (w.N % kRowsPerWarp != 0) return "N must be a multiple of 32 (got " + std::to_string(w.N) + ")";
  if (w.lda % 8 != 0 || w.ldb % 16 != 0)
    return "A's and B's row strides must be multiples of 16 bytes (lda " + std::to_string(w.lda) + ", ldb " +
           std::to_string(w.ldb) + ")";
  return "";
}

void gemm_weight_only(const WeightOnlyArgs& w, cudaStream_t st) {
  if (w.M <= 0 || w.N <= 0 || w.K <= 0) return;
  Params p{};
  p.M = w.M;
  p.N = w.N;
  p.K = w.K;
  p.a = static_cast<const __nv_bfloat16*>(w.a);
  p.lda = w.lda;
  p.b = static_cast<const uint8_t*>(w.b);
  p.ldb = w.ldb;
  p.sb = w.sb;
  p.kb4 = w.block_scales ? ceil_div(ceil_div(w.K, 128), 4) * 4 : 0;
  p.c = w.c;
  p.ldc = w.ldc;
  p.c_bf16 = w.c_bf16;
  p.alpha = w.alpha;
  p.beta = w.beta;
  // Tokens: G groups of 8 (the fewest that hold M, at most 4), chunks of 32 past that: 64 rows
  // as two chunks, each warp's accumulators and activation loads half as many (168 registers
  // against 254), more blocks an SM, the weights read once a chunk (the second time mostly from
  // L2). At 64 rows the four products of a Llama-3.2-1B layer took 89 us against 106 with one
  // chunk of 8 groups (gate|up 46.6 / 51.9, down 21.2 / 29.4; H100, 2026-12-06,
  // bench/results/h100-2026-12-06-s22-kvfp8-w8-fusedlayer-profile.log). VFP8_W8_MAXG=8 (or 2,
  // 1) is the A/B.
  static const int max_g = [] {
    const int g = env_int("VFP8_W8_MAXG", 4);
    return g >= 8 ? 8 : g >= 4 ? 4 : g >= 2 ? 2 : 1;
  }();
  const int G = std::min(max_g, w.M <= 8 ? 1 : w.M <= 16 ? 2 : w.M <= 32 ? 4 : 8);
  const int64_t chunks = ceil_div(w.M, 8 * G);
  // Whole 128-byte lines of each row a step for up to 8 rows of A (H100, 2026-12-06: a 1B
  // model's gate|up at 1 row in 17.1 us against 23.8 with 64 bytes); 64 bytes past that, where
  // the activations' loads, not the weights', bound the kernel (27.0 against 31.8 us at 16
  // rows). VFP8_W8_V=1 takes 64 bytes at one token group too (the A/B; 128 bytes past one group
  // was measured slower and is not offered).
  static const int vsel = env_int("VFP8_W8_V", 0);
  const int V = vsel != 1 && G == 1 && w.K % kStep<2> == 0 ? 2 : 1;
  // Splits of K: enough blocks for ~2 a multiprocessor, at most a cluster's 8 and a step each.
  const int64_t bands = ceil_div(w.N, kBlockRows) * chunks, steps = w.K / (64 * V);
  static const int64_t max_splits = std::clamp(env_int("VFP8_W8_SPLITS", kMaxSplits), 1, kMaxSplits);
  int64_t splits = std::clamp<int64_t>(ceil_div(2 * int64_t(sm_count()), bands), 1, std::min<int64_t>(max_splits, steps));
  p.steps_per_split = ceil_div(steps, splits);
  splits = ceil_div(steps, p.steps_per_split);  // no split left without a step
  const int sp = int(splits);
  if (V == 2) {
    launch<1, 2>(p, sp, chunks, st);  // (one token group only)
  } else {
    switch (G) {
      case 1: launch<1, 1>(p, sp, chunks, st); break;
      case 2: launch<2, 1>(p, sp, chunks, st); break;
      case 4: launch<4, 1>(p, sp, chunks, st); break;
      default: launch<8, 1>(p, sp, chunks, st); break;
    }
  }
}

}  // namespace vfp8
