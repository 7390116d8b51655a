// gemm's few-row form, C[r, :] = A[r, :] B^T for up to kGemvRows rows of bf16 A (a decoding
// step at batch 1-4 against a weight B [N, K]): a warp a column of C, its lanes walking B's row
// 16 bytes at a time with several loads in flight, the rows of A read alongside (they stay in
// L1), fp32 sums, one warp reduction. cuBLASLt's kernels for these shapes are tiles of 8+ rows
// over few blocks (7 us for a 2048 x 2048 weight that streams in 2.5 us at the H200's bandwidth);
// here every SM streams its share. Not batch-invariant (a row's sums differ from the tiled
// kernels'), so gemm with batch_invariant = 1 never comes here.
#include <algorithm>
#include <cstdlib>
#include <type_traits>
#include <mutex>
#include <vector>

#include "bulk_ring.cuh"
#include "glu_act.cuh"

namespace rlh::kcuda {

namespace {

constexpr int kWarps = 8;
// 16-byte chunks of B each lane has in flight: 8 (4 KiB a warp) covers a K = 2048 row in one
// round, so a 2048-wide weight is one dependent load per warp instead of two; each lane still
// sums its chunks in increasing order, so the results are those of fewer chunks in flight.
constexpr int kAhead = 8;

// A column's sums: each warp's reduced, then (WPC > 1) the parts added in part order through
// shared memory, into the acc of every warp (part 0's is the column's). Every thread calls it.
template <int R, int WPC, int NB>
__device__ __forceinline__ void reduce_column(float (&acc)[NB][R], float (&part_sum)[kWarps][NB][kGemvRows], int lane,
                                              int warp, int part) {
#pragma unroll
  for (int h = 0; h < NB; ++h)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[h][r] = warp_sum(acc[h][r]);
  if constexpr (WPC > 1) {
    if (lane == 0) {
#pragma unroll
      for (int h = 0; h < NB; ++h)
#pragma unroll
        for (int r = 0; r < R; ++r) part_sum[warp][h][r] = acc[h][r];
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < NB; ++h)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float v = 0.f;
#pragma unroll
        for (int q = 0; q < WPC; ++q) v += part_sum[warp - part + q][h][r];  // in part order
        acc[h][r] = v;
      }
  }
}

// Column n of C from its sums (one thread): the GLU of the rounded halves, or the bias added.
template <int R, class TC, int ACT, int NB>
__device__ __forceinline__ void write_column(const GemmArgs& g, const float (&acc)[NB][R], int64_t n) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if constexpr (ACT >= 0) {
      const float gate = __bfloat162float(__float2bfloat16_rn(acc[0][r]));
      const float up = __bfloat162float(__float2bfloat16_rn(acc[1][r]));
      static_cast<TC*>(g.C)[r * g.ldc + n] = from_f<TC>(act_value<ACT>(gate) * up);
    } else {
      float v = acc[0][r];
      if (g.bias) v += g.bias_dt == DType::bf16 ? __bfloat162float(static_cast<const bf16*>(g.bias)[n])
                                                : static_cast<const float*>(g.bias)[n];
      static_cast<TC*>(g.C)[r * g.ldc + n] = from_f<TC>(v);
    }
  }
}

// WPC warps share a column, each summing a contiguous part of K (WPC = 1: the whole row), their
// sums added in part order through shared memory. Why: a warp walks its part in rounds of
// kAhead chunks a lane, each round one memory round trip; a 8192-wide row (a 1B model's down
// projection) was four dependent rounds per warp and streamed at ~1.3 TB/s on an H100, where four
// warps a column keep the whole weight in flight at once.
// ACT >= 0 (gemm_glu_fwd): B is gate | up [2N, K]; a warp sums column n of both halves (rows n
// and N + n of B) and writes h = act(gate) * up from the two sums rounded to bf16, as gemm then
// swiglu_fwd / geglu_fwd compute it (glu_act.cuh): a decoding step's GLU launch fewer a layer.
template <int R, class TC, int WPC, int ACT, bool PRE>
__global__ void __launch_bounds__(kWarps * 32) gemv_kernel(GemmArgs g) {
  constexpr int kCols = kWarps / WPC;  // columns a block
  constexpr int NB = ACT >= 0 ? 2 : 1;  // rows of B a column reads
  __shared__ float part_sum[kWarps][NB][kGemvRows];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = warp % WPC;
  const int64_t n = int64_t(blockIdx.x) * kCols + warp / WPC;
  const bool live = n < g.N;  // (no early exit: the block meets at the part sums)
  const uint4* b[NB];
#pragma unroll
  for (int h = 0; h < NB; ++h)
    b[h] = reinterpret_cast<const uint4*>(static_cast<const bf16*>(g.B) + ((live ? n : 0) + h * g.N) * g.ldb);
  const int64_t chunks = g.K / 8;
  const int64_t per = (chunks + WPC - 1) / WPC;
  const int64_t c_begin = part * per, c_end = c_begin + per < chunks ? c_begin + per : chunks;
  // The weight does not depend on the kernel before (launched with launch_pdl), so this warp's
  // first round of it is loaded before pdl_wait (PRE; else only its first 4 KiB into L2): a
  // 2048-wide weight is then wholly in flight while the norm, RoPE or attention before it
  // finishes. A, which that kernel writes, is read only after pdl_wait. Either way a lane sums
  // the same chunks in the same order.
  uint4 bv[NB][kAhead];
  auto load_round = [&](int64_t c0) {
#pragma unroll
    for (int h = 0; h < NB; ++h)
#pragma unroll
      for (int u = 0; u < kAhead; ++u)
        if (c0 + 32 * u < c_end) bv[h][u] = __ldcs(b[h] + c0 + 32 * u);  // streamed: read once
  };
  int64_t c0 = c_begin + lane;
  if constexpr (PRE) {
    if (live) load_round(c0);
  } else if (live && c_begin + lane * 8 < c_end) {
#pragma unroll
    for (int h = 0; h < NB; ++h) prefetch_l2(b[h] + c_begin + lane * 8);
  }
  pdl_wait();
  pdl_trigger();
  float acc[NB][R];
#pragma unroll
  for (int h = 0; h < NB; ++h)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[h][r] = 0.f;
  if (live) {
    if constexpr (!PRE) load_round(c0);
    for (; c0 < c_end; c0 += 32 * kAhead) {
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        if (c0 + 32 * u >= c_end) break;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint4 av = reinterpret_cast<const uint4*>(static_cast<const bf16*>(g.A) + r * g.lda)[c0 + 32 * u];
#pragma unroll
          for (int h = 0; h < NB; ++h) fma8(acc[h][r], av, bv[h][u]);
        }
      }
      if (c0 + 32 * kAhead < c_end) load_round(c0 + 32 * kAhead);
    }
  }
  reduce_column<R, WPC, NB>(acc, part_sum, lane, warp, part);
  if (lane == 0 && part == 0 && live) write_column<R, TC, ACT, NB>(g, acc, n);
}

// The same product, persistent, its weights streamed through shared memory (RLH_KCUDA_GEMV_BULK).
// Why: gemv_kernel holds its weights in flight in registers, so a block is a few warps' rounds
// and a weight is ~4 waves of blocks, each draining the memory pipe before the next starts; it
// streamed a 1B model's gate|up at ~2.35 TB/s and its 2048-wide weights at 1-1.5 TB/s on an H100
// (ncu, 2026-12-06). Here a block per multiprocessor walks tiles (kCols columns: their NB rows of
// B, whole) through a ring of shared-memory stages filled by 1-D bulk copies, ~192 KiB in
// flight a multiprocessor whatever the registers, and the first stages are requested before
// pdl_wait, so a small weight is wholly in flight while the kernel before finishes.
// Each warp sums exactly gemv_kernel's chunks in gemv_kernel's order (lane l: chunks c_begin + l,
// + 32, ...; then the warp reduction; parts added in order), so C is bitwise gemv_kernel's.
template <int R, class TC, int WPC, int ACT>
__global__ void __launch_bounds__(kWarps * 32, 1) gemv_bulk_kernel(GemmArgs g, int64_t tiles, int stages,
                                                                   unsigned stage_bytes) {
  constexpr int kCols = kWarps / WPC;
  constexpr int NB = ACT >= 0 ? 2 : 1;
  extern __shared__ __align__(128) char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);  // [stages], then the stages from byte 128
  char* ring = smem + 128;
  __shared__ float part_sum[kWarps][NB][kGemvRows];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = warp % WPC, col = warp / WPC;
  const int64_t chunks = g.K / 8;
  const int64_t per = (chunks + WPC - 1) / WPC;
  const int64_t c_begin = part * per, c_end = c_begin + per < chunks ? c_begin + per : chunks;
  const unsigned row_bytes = unsigned(g.K) * 2;
  const bf16* B = static_cast<const bf16*>(g.B);
  // Tile t's rows into stage `slot` (one thread): per half h, columns n0 .. n0 + kCols - 1 as one
  // copy where B's rows are contiguous, else a copy a row.
  auto issue = [&](int64_t t, int slot) {
    const int64_t n0 = t * kCols;
    const int cols = int(g.N - n0 < kCols ? g.N - n0 : kCols);
    mbar_expect_tx(&full[slot], unsigned(NB * cols) * row_bytes);
#pragma unroll
    for (int h = 0; h < NB; ++h) {
      char* dst = ring + size_t(slot) * stage_bytes + size_t(h) * kCols * row_bytes;
      const bf16* src = B + (n0 + h * g.N) * g.ldb;
      if (g.ldb == g.K) {
        bulk_copy(dst, src, unsigned(cols) * row_bytes, &full[slot]);
      } else {
        for (int c = 0; c < cols; ++c) bulk_copy(dst + size_t(c) * row_bytes, src + c * g.ldb, row_bytes, &full[slot]);
      }
    }
  };
  if (threadIdx.x == 0) {
    for (int k = 0; k < stages; ++k) mbar_init(&full[k], 1);
    mbar_init_fence();
  }
  __syncthreads();
  // The weights do not depend on the kernel before: the first stages are requested before
  // pdl_wait. A, which that kernel writes, is read only after it.
  if (threadIdx.x == 0)
    for (int k = 0; k < stages; ++k) {
      const int64_t t = int64_t(blockIdx.x) + int64_t(k) * gridDim.x;
      if (t < tiles) issue(t, k);
    }
  pdl_wait();
  pdl_trigger();
  int it = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x, ++it) {
    const int slot = it % stages;
    mbar_wait(&full[slot], unsigned(it / stages) & 1u);
    const int64_t n = t * kCols + col;
    const bool live = n < g.N;
    float acc[NB][R];
#pragma unroll
    for (int h = 0; h < NB; ++h)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[h][r] = 0.f;
    if (live) {
      const uint4* b[NB];
#pragma unroll
      for (int h = 0; h < NB; ++h)
        b[h] = reinterpret_cast<const uint4*>(ring + size_t(slot) * stage_bytes + (size_t(h) * kCols + col) * row_bytes);
      for (int64_t c = c_begin + lane; c < c_end; c += 32) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint4 av = reinterpret_cast<const uint4*>(static_cast<const bf16*>(g.A) + r * g.lda)[c];
#pragma unroll
          for (int h = 0; h < NB; ++h) fma8(acc[h][r], av, b[h][c]);
        }
      }
    }
    reduce_column<R, WPC, NB>(acc, part_sum, lane, warp, part);
    if (lane == 0 && part == 0 && live) write_column<R, TC, ACT, NB>(g, acc, n);
    __syncthreads();  // the stage is read (and part_sum may be written again)
    if (threadIdx.x == 0) {
      const int64_t next = t + int64_t(stages) * gridDim.x;
      if (next < tiles) issue(next, slot);
    }
  }
}

// Whether the first round of the weight is loaded before pdl_wait (RLH_KCUDA_GEMV_PRELOAD=0:
// only prefetched into L2, as before 2026-12-06; the A/B of device_gpu.sh decodeab).
bool gemv_preload() {
  static const bool v = env_switch_on("RLH_KCUDA_GEMV_PRELOAD");
  return v;
}

// The persistent form (gemv_bulk_kernel): RLH_KCUDA_GEMV_BULK=1 (off by default until measured).
bool gemv_bulk() {
  static const bool v = [] {
    const char* e = std::getenv("RLH_KCUDA_GEMV_BULK");
    return e && std::string(e) == "1";
  }();
  return v;
}

// Shared memory a block of gemv_bulk_kernel may take (of the H100's 227 KiB): the ring's stages.
constexpr size_t kBulkRing = size_t(192) << 10;

// The current device's multiprocessors, and whether `kernel` may take the ring's shared memory
// there (the attribute is set once a device and kernel).
int bulk_grid_limit(const void* kernel) {
  static std::mutex mu;
  static std::vector<int> counts;
  static std::vector<std::pair<int, const void*>> allowed;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  std::lock_guard<std::mutex> lock(mu);
  if (size_t(dev) >= counts.size()) counts.resize(size_t(dev) + 1, 0);
  if (counts[size_t(dev)] == 0) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    counts[size_t(dev)] = n > 0 ? n : 132;
  }
  if (std::find(allowed.begin(), allowed.end(), std::make_pair(dev, kernel)) == allowed.end()) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(128 + kBulkRing)) != cudaSuccess) {
      cudaGetLastError();  // not this device's to give: gemv_kernel runs instead
      return 0;
    }
    allowed.emplace_back(dev, kernel);
  }
  return counts[size_t(dev)];
}

template <int R, class TC, int WPC, int ACT>
bool launch_bulk(const GemmArgs& g, cudaStream_t s) {
  constexpr int kCols = kWarps / WPC;
  constexpr int NB = ACT >= 0 ? 2 : 1;
  if constexpr (ACT >= 0 && !std::is_same_v<TC, bf16>) {
    return false;  // the GLU writes bf16 only
  } else {
    const size_t stage = size_t(NB) * kCols * size_t(g.K) * 2;
    const int stages = int(std::min<size_t>(8, kBulkRing / stage));
    if (stages < 2) return false;  // rows too wide for two stages: gemv_kernel
    const size_t smem = 128 + size_t(stages) * stage;
    const int sms = bulk_grid_limit(reinterpret_cast<const void*>(gemv_bulk_kernel<R, TC, WPC, ACT>));
    if (sms == 0) return false;
    const int64_t tiles = (g.N + kCols - 1) / kCols;
    const unsigned grid = unsigned(std::min<int64_t>(tiles, sms));
    launch_pdl(gemv_bulk_kernel<R, TC, WPC, ACT>, grid, kWarps * 32, smem, s, g, tiles, stages, unsigned(stage));
    return true;
  }
}

// False (launching nothing) only when the bulk form was asked for by name and cannot run.
template <int R, int WPC, int ACT>
bool launch_wpc(const GemmArgs& g, cudaStream_t s, GemvForm form) {
  constexpr int kCols = kWarps / WPC;
  const unsigned grid = unsigned((g.N + kCols - 1) / kCols);
  if (form == GemvForm::bulk || (form == GemvForm::automatic && gemv_bulk())) {
    if (g.c_dt == DType::bf16 ? launch_bulk<R, bf16, WPC, ACT>(g, s) : launch_bulk<R, float, WPC, ACT>(g, s))
      return true;
    if (form == GemvForm::bulk) return false;
  }
  const bool pre = gemv_preload();
  if (g.c_dt == DType::bf16) {
    if (pre)
      launch_pdl(gemv_kernel<R, bf16, WPC, ACT, true>, grid, kWarps * 32, 0, s, g);
    else
      launch_pdl(gemv_kernel<R, bf16, WPC, ACT, false>, grid, kWarps * 32, 0, s, g);
  } else if constexpr (ACT < 0) {
    if (pre)
      launch_pdl(gemv_kernel<R, float, WPC, ACT, true>, grid, kWarps * 32, 0, s, g);
    else
      launch_pdl(gemv_kernel<R, float, WPC, ACT, false>, grid, kWarps * 32, 0, s, g);
  }
  return true;
}

// Warps a column: enough that each warp's part is about one round (32 lanes x kAhead chunks
// of 8 = 2048 elements), at most a block's 8.
template <int R, int ACT>
bool launch(const GemmArgs& g, cudaStream_t s, GemvForm form) {
  const int64_t rounds = (g.K + 32 * kAhead * 8 - 1) / (32 * kAhead * 8);
  if (rounds >= 8) return launch_wpc<R, 8, ACT>(g, s, form);
  if (rounds >= 4) return launch_wpc<R, 4, ACT>(g, s, form);
  if (rounds >= 2) return launch_wpc<R, 2, ACT>(g, s, form);
  return launch_wpc<R, 1, ACT>(g, s, form);
}

template <int ACT>
bool launch_rows(const GemmArgs& g, cudaStream_t s, GemvForm form) {
  switch (g.M) {
    case 1: return launch<1, ACT>(g, s, form);
    case 2: return launch<2, ACT>(g, s, form);
    case 3: return launch<3, ACT>(g, s, form);
    default: return launch<4, ACT>(g, s, form);
  }
}

// Weights (elements) up to which the few-row path runs: 64 Mi by default, so a fused gate|up
// of a 1B model (33.5 Mi) streams here in the chain of PDL launches; a vocabulary head (262 Mi)
// stays on cuBLASLt's tiles, which stream it near the bandwidth. RLH_KCUDA_GEMV_MAX sets it
// (the A/B of bench_generator_cuda).
int64_t gemv_max_weight() {
  static const int64_t v = [] {
    if (const char* e = std::getenv("RLH_KCUDA_GEMV_MAX"); e && *e) return int64_t(std::atoll(e));
    return int64_t(64) << 20;
  }();
  return v;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

// The few-row path's conditions: M <= kGemvRows rows of bf16 A, C = A B^T with B a
// contiguous-row, 16-byte aligned bf16 weight of at most gemv_max_weight() elements.
static bool gemv_fits(const GemmArgs& g, int64_t b_rows) {
  return g.M >= 1 && g.M <= kGemvRows && g.batch == 1 && !g.ta && g.tb && g.ab == DType::bf16 && g.alpha == 1 &&
         g.beta == 0 && g.K % 8 == 0 && g.lda % 8 == 0 && g.ldb % 8 == 0 && aligned16(g.A) && aligned16(g.B) &&
         b_rows * g.K <= gemv_max_weight();
}

bool gemv_rows(const GemmArgs& g, cudaStream_t s, GemvForm form) {
  if (!gemv_fits(g, g.N) || !launch_rows<-1>(g, s, form)) return false;
  check_launch("gemm (few rows)");
  return true;
}

bool gemv_glu_rows(const GemmArgs& g, int act, cudaStream_t s, GemvForm form) {
  if (!gemv_fits(g, 2 * g.N) || g.c_dt != DType::bf16 || g.bias || act < 0 || act > 2) return false;
  if (!(act == 0 ? launch_rows<0>(g, s, form) : act == 1 ? launch_rows<1>(g, s, form) : launch_rows<2>(g, s, form)))
    return false;
  check_launch("gemm_glu (few rows)");
  return true;
}

}  // namespace rlh::kcuda
