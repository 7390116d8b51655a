// Grouped GEMM over experts (docs/ops.md "grouped_gemm"; kernels_cpu's grouped_gemm.cpp is the
// reference), with the group offsets read on the device only:
//   ta = 0  rows r of group g:  C[r] = alpha A[r] op(B_g) + beta C[r]   (forward, dX)
//   ta = 1  C_g = alpha A_g^T B_g + beta C_g                            (dW; empty g: beta C_g)
//
// Scheduling without a host sync. ta = 0: blockIdx.y is a row tile counted across the groups
// (group g owns ceil(rows_g / BM) tiles); the grid has ceil(T / BM) + min(G, T) row tiles, the
// most any partition of T rows into G groups needs, and a block finds its group with one block
// scan of the per-group tile counts (extra blocks find none and leave). ta = 1: blockIdx.z is the
// group, and a block loops over the group's rows as its inner dimension (zero iterations for an
// empty group, which still writes beta C_g). Offsets are clamped to [0, T]; offsets that do not
// partition the rows (offsets[0] != 0, decreasing, offsets[G] != T) raise the error flag.
//
// bf16 (fp32 accumulation): mma.sync m16n8k16 tensor cores, 128x128 block tiles, BK = 64, eight
// warps of 64x32, a three-stage cp.async pipeline in XOR-swizzled shared memory (96 KiB, two
// blocks per SM). The three operand layouts are three ways to fill the tiles: A is stored
// [m][k] (ta = 0) or [k][m] (ta = 1, read with ldmatrix.trans), B [n][k] (tb = 1) or [k][n].
// It needs 16-byte cp.async chunks: the contiguous extents, leading dimensions and the group
// stride multiples of 8 elements and 16-byte aligned pointers; otherwise (and for f32, which is
// true fp32) a CUDA-core kernel with the same scheduling: 64x64 tiles, 4x4 outputs a thread.
// Every output element has one writer and sums its products in a fixed order: deterministic.
// The order depends on K, the path (tensor cores or CUDA cores: chosen from the operands' dtypes,
// inner sizes, leading dimensions and alignment, never from the number of rows) and nothing
// else, and a row's products read only its own row of A: so each row of C is a function of its
// row of A alone, bitwise, whatever the number of rows. With no offsets (one group of every row)
// this is gemm with batch_invariant = 1 (plugin.cpp), the generator's deterministic mode, which
// also splits K (gemm_rows_kchunk) into chunks fixed by N and K alone, so a few rows still fill
// the GPU: each chunk summed from zero, the chunks added in order by gg_split_reduce.
#include <algorithm>

#include "common.cuh"
#include "mma.cuh"

namespace rlh::kcuda {
namespace {

struct GG {
  const int32_t* off;
  int64_t G, T, M, N, K;
  float alpha, beta;
  const void* A;
  int64_t lda;
  const void* B;
  int64_t ldb, sb;
  void* C;
  int64_t ldc, sc;
  bool pair;  // C stores two adjacent columns at once
  int* err;
  // Split K (ta = 0, tensor cores): blockIdx.z takes k-blocks [z kchunk, (z + 1) kchunk) and
  // writes its unscaled sums to part [gridDim.z][T][N] instead of C (0 / null: whole K into C).
  int kchunk;
  float* part;
};

__device__ __forceinline__ int64_t clamp_row(int64_t v, int64_t T) { return v < 0 ? 0 : v > T ? T : v; }
// Group g's rows [lo, hi), clamped to [0, T) and empty when its offsets decrease (check_offsets
// flags those; the kernels stay in bounds meanwhile).
__device__ __forceinline__ void group_rows(const GG& p, int64_t g, int64_t* lo, int64_t* hi) {
  if (!p.off) {  // one group of every row: a plain GEMM (gemm with batch_invariant = 1)
    *lo = 0;
    *hi = p.T;
    return;
  }
  *lo = clamp_row(p.off[g], p.T);
  *hi = clamp_row(p.off[g + 1], p.T);
  if (*hi < *lo) *hi = *lo;
}

// Flags offsets that do not partition [0, T) (block (0,0,0) only).
__device__ void check_offsets(const GG& p) {
  if (blockIdx.x != 0 || blockIdx.y != 0 || blockIdx.z != 0 || !p.err || !p.off) return;
  for (int64_t g = threadIdx.x; g <= p.G; g += blockDim.x) {
    const int64_t v = p.off[g];
    const bool bad = (g == 0 && v != 0) || (g == p.G && v != p.T) || (g > 0 && v < p.off[g - 1]);
    if (bad) atomicExch(p.err, 1);
  }
}

// Finds row tile `tile` of the ta = 0 schedule: its group g, first row r0 and the group's end
// r1 (rows past r1 in the tile belong to later groups and are left alone). Every thread of the block calls it; returns false (for all) when the tile is beyond the
// last group's tiles. Block scan of the per-group tile counts, blockDim.x at a time.
template <int BM>
__device__ bool find_tile(const GG& p, int64_t tile, int64_t* g_out, int64_t* r0, int64_t* r1) {
  __shared__ int64_t s_warp[32];
  __shared__ int64_t s_found[3];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (threadIdx.x == 0) s_found[0] = -1;
  int64_t running = 0;
  for (int64_t base = 0; base < p.G; base += blockDim.x) {
    const int64_t g = base + threadIdx.x;
    int64_t lo = 0, hi = 0, cnt = 0;
    if (g < p.G) {
      group_rows(p, g, &lo, &hi);
      cnt = (hi - lo + BM - 1) / BM;
    }
    int64_t v = cnt;  // inclusive scan: warp, then the warps' totals in order
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t t = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += t;
    }
    if (lane == 31) s_warp[warp] = v;
    __syncthreads();
    int64_t before = 0, total = 0;
    for (int i = 0; i < nw; ++i) {
      if (i < warp) before += s_warp[i];
      total += s_warp[i];
    }
    const int64_t incl = running + before + v, excl = incl - cnt;
    if (cnt > 0 && tile >= excl && tile < incl) {  // exactly one thread
      s_found[0] = lo + (tile - excl) * BM;
      s_found[1] = hi;
      s_found[2] = g;
    }
    running += total;
    __syncthreads();  // s_found visible; s_warp free for the next round
    if (s_found[0] >= 0) break;
  }
  *r0 = s_found[0];
  *r1 = s_found[1];
  *g_out = s_found[2];
  return *r0 >= 0;
}

// The rows this block works on, for both kernels. ta = 0: tile blockIdx.y of the schedule, rows
// [m0, rhi) of group g (rlo = m0; false when there is no such tile). ta = 1 (the weight
// gradient): group blockIdx.z, whose rows [rlo, rhi) are the reduction, output rows from
// m0 = blockIdx.y * BM.
template <int BM, bool TA>
__device__ bool block_rows(const GG& p, int64_t* g, int64_t* m0, int64_t* rlo, int64_t* rhi) {
  if constexpr (!TA) {
    if (!find_tile<BM>(p, blockIdx.y, g, m0, rhi)) return false;
    *rlo = *m0;
  } else {
    *g = blockIdx.z;
    *m0 = int64_t(blockIdx.y) * BM;
    group_rows(p, *g, rlo, rhi);
  }
  return true;
}

template <class TC>
__device__ __forceinline__ void store_c(const GG& p, TC* c, int64_t col, float v0, float v1) {
  // c points at column 0 of the row; col is even.
  if (p.pair && col + 1 < p.N) {
    if (p.beta != 0.f) {
      v0 += p.beta * to_f(c[col]);
      v1 += p.beta * to_f(c[col + 1]);
    }
    if constexpr (std::is_same_v<TC, float>)
      *reinterpret_cast<float2*>(c + col) = make_float2(v0, v1);
    else
      *reinterpret_cast<__nv_bfloat162*>(c + col) = __floats2bfloat162_rn(v0, v1);
    return;
  }
  if (col < p.N) c[col] = from_f<TC>(p.beta != 0.f ? v0 + p.beta * to_f(c[col]) : v0);
  if (col + 1 < p.N) c[col + 1] = from_f<TC>(p.beta != 0.f ? v1 + p.beta * to_f(c[col + 1]) : v1);
}

// ---------------------------------------------------------------------------------------------
// Tensor cores (bf16)

constexpr int BM = 128, BN = 128, BK = 64, STAGES = 3, THREADS = 256;
constexpr int A_TILE = BM * BK, B_TILE = BK * BN;  // elements per stage
constexpr size_t MMA_SMEM = size_t(STAGES) * (A_TILE + B_TILE) * sizeof(bf16);  // 96 KiB

// Two blocks per SM (128 registers; a few spill): measured 283 TFLOP/s at the Qwen3-MoE
// gate+up shape against 248 with one block per SM and no spills.
// f(a, b, c) over a thread's 4 x 4 x 4 accumulators, unrolled.
template <class F>
__device__ __forceinline__ void each_acc(F&& f) {
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b)
#pragma unroll
      for (int c = 0; c < 4; ++c) f(a, b, c);
}

// CHUNKED (batch-invariant gemm at many rows): the whole K in one block, its sums flushed into a
// running total at every chunk boundary of gemm_rows_kchunk: the split path's arithmetic (each
// chunk from zero, the chunks added in order) without its partial sums in memory. Twice the
// accumulators: one block per SM.
template <bool TA, bool TB, class TC, bool CHUNKED = false>
__global__ void __launch_bounds__(THREADS, CHUNKED ? 1 : 2) gg_mma_kernel(GG p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* As = reinterpret_cast<bf16*>(smem_raw);
  bf16* Bs = As + STAGES * A_TILE;
  check_offsets(p);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;  // 2 x 4 warps of 64 x 32
  const int64_t n0 = int64_t(blockIdx.x) * BN;
  int64_t m0, rlo, rhi, g = 0;  // ta = 0: rows [m0, rhi); ta = 1: group rows [rlo, rhi)
  if (!block_rows<BM, TA>(p, &g, &m0, &rlo, &rhi)) return;
  const bf16* A = static_cast<const bf16*>(p.A);
  const bf16* B = static_cast<const bf16*>(p.B) + (TA ? 0 : g * p.sb);
  const int64_t kdim = TA ? rhi - rlo : p.K;
  int kb0 = 0, nk = int((kdim + BK - 1) / BK);
  if (!TA && !CHUNKED && p.kchunk > 0) {  // this block's chunk of k-blocks (split K)
    kb0 = int(blockIdx.z) * p.kchunk;
    nk = min(nk - kb0, p.kchunk);
  }

  // Copy slots: each thread moves CH 16-byte chunks of A and of B per stage, at the same tile
  // positions every stage; their sources advance by one k-block (BK columns, or BK rows with
  // ta) per stage, so the loop does no 64-bit index arithmetic.
  constexpr int CH = A_TILE / 8 / THREADS;
  static_assert(CH * 8 * THREADS == A_TILE && A_TILE == B_TILE, "tile split");
  const bf16* a_src[CH];
  const bf16* b_src[CH];
  int a_dst[CH], b_dst[CH], a_k[CH], b_k[CH];  // smem offset; k of the chunk within the block
  bool a_ok[CH], b_ok[CH];                    // the fixed (non-k) coordinate is in range
#pragma unroll
  for (int j = 0; j < CH; ++j) {
    const int i = tid + j * THREADS;
    if constexpr (!TA) {  // A [BM][BK]: rows m, k contiguous
      const int r = i / (BK / 8), c = (i % (BK / 8)) * 8;
      a_ok[j] = m0 + r < rhi;
      a_src[j] = a_ok[j] ? A + (m0 + r) * p.lda + c : A;
      a_dst[j] = mma::swz<BK>(r, c);
      a_k[j] = c;
    } else {  // A^T: [BK][BM], rows t (the inner dimension), m contiguous
      const int r = i / (BM / 8), c = (i % (BM / 8)) * 8;
      a_ok[j] = m0 + c < p.M;
      a_src[j] = a_ok[j] ? A + (rlo + r) * p.lda + m0 + c : A;
      a_dst[j] = mma::swz<BM>(r, c);
      a_k[j] = r;
    }
    if constexpr (!TA && TB) {  // B_g [N,K] -> [BN][BK]
      const int r = i / (BK / 8), c = (i % (BK / 8)) * 8;
      b_ok[j] = n0 + r < p.N;
      b_src[j] = b_ok[j] ? B + (n0 + r) * p.ldb + c : B;
      b_dst[j] = mma::swz<BK>(r, c);
      b_k[j] = c;
    } else {  // B_g [K,N] or B [T,N] -> [BK][BN]
      const int r = i / (BN / 8), c = (i % (BN / 8)) * 8;
      b_ok[j] = n0 + c < p.N;
      b_src[j] = b_ok[j] ? B + ((TA ? rlo : 0) + r) * p.ldb + n0 + c : B;
      b_dst[j] = mma::swz<BN>(r, c);
      b_k[j] = r;
    }
  }
  const int64_t a_step = TA ? BK * p.lda : BK, b_step = (TA || !TB) ? BK * p.ldb : BK;
  auto load = [&](int stage, int kb) {
    const int64_t k0 = int64_t(kb) * BK;
    bf16* as = As + stage * A_TILE;
    bf16* bs = Bs + stage * B_TILE;
#pragma unroll
    for (int j = 0; j < CH; ++j) {
      const bool ok = a_ok[j] && k0 + a_k[j] < kdim;
      mma::cp_async16(as + a_dst[j], ok ? a_src[j] + kb * a_step : A, ok);
    }
#pragma unroll
    for (int j = 0; j < CH; ++j) {
      const bool ok = b_ok[j] && k0 + b_k[j] < kdim;
      mma::cp_async16(bs + b_dst[j], ok ? b_src[j] + kb * b_step : B, ok);
    }
  };

  float acc[4][4][4], tot[CHUNKED ? 4 : 1][4][4];
  each_acc([&](int a, int b, int c) { acc[a][b][c] = 0.f; });
  if constexpr (CHUNKED) each_acc([&](int a, int b, int c) { tot[a][b][c] = 0.f; });

#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < nk) load(st, kb0 + st);
    mma::cp_commit();  // empty groups keep the count uniform
  }
  for (int kb = 0; kb < nk; ++kb) {  // the block's kb-th k-block (kb0 + kb of the whole K)
    mma::cp_wait<STAGES - 2>();  // tile kb has landed (this thread's copies)
    __syncthreads();             // everyone's copies; stage (kb-1) % STAGES is free again
    if (kb + STAGES - 1 < nk) load((kb + STAGES - 1) % STAGES, kb0 + kb + STAGES - 1);
    mma::cp_commit();
    const bf16* as = As + (kb % STAGES) * A_TILE;
    const bf16* bs = Bs + (kb % STAGES) * B_TILE;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t af[4][4], bfr[2][4];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        const int mo = wm * 64 + mi * 16;
        if constexpr (!TA)
          mma::ldsm_x4(af[mi], as + mma::swz<BK>(mo + (lane & 15), kk * 16 + (lane >> 4) * 8));
        else  // stored [k][m]: matrices (m0-7,k0-7), (m8-15,k0-7), (m0-7,k8-15), (m8-15,k8-15)
          mma::ldsm_x4_t(af[mi], as + mma::swz<BM>(kk * 16 + (lane & 7) + ((lane >> 4) << 3),
                                                   mo + ((lane >> 3) & 1) * 8));
      }
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {
        const int no = wn * 32 + nj * 16;
        if constexpr (!TA && TB)  // stored [n][k]
          mma::ldsm_x4(bfr[nj], bs + mma::swz<BK>(no + (lane & 7) + ((lane >> 4) << 3),
                                                  kk * 16 + ((lane >> 3) & 1) * 8));
        else  // stored [k][n]
          mma::ldsm_x4_t(bfr[nj], bs + mma::swz<BN>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                                    no + (lane >> 4) * 8));
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
          mma::mma16816(acc[mi][ni], af[mi], bfr[ni >> 1][(ni & 1) * 2], bfr[ni >> 1][(ni & 1) * 2 + 1]);
    }
    if constexpr (CHUNKED) {
      if ((kb + 1) % p.kchunk == 0 || kb + 1 == nk)  // a chunk ends: total += its sums (in order)
        each_acc([&](int a, int b, int c) {
          tot[a][b][c] += acc[a][b][c];
          acc[a][b][c] = 0.f;
        });
    }
  }
  mma::cp_wait<0>();
  if constexpr (CHUNKED) each_acc([&](int a, int b, int c) { acc[a][b][c] = tot[a][b][c]; });

  // Epilogue: c0,c1 at (row g4, cols 2c4, 2c4+1), c2,c3 at row g4 + 8.
  TC* C = static_cast<TC*>(p.C);
  const int g4 = lane >> 2, c4 = lane & 3;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r = m0 + wm * 64 + mi * 16 + g4 + h * 8;
      if (TA ? r >= p.M : r >= rhi) continue;
      if (!TA && p.part) {  // split K: this chunk's sums, unscaled, for gg_split_reduce
        float* prow = p.part + (int64_t(blockIdx.z) * p.T + r) * p.N;
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          const int64_t col = n0 + wn * 32 + ni * 8 + c4 * 2;
          if (col < p.N) prow[col] = acc[mi][ni][h * 2];
          if (col + 1 < p.N) prow[col + 1] = acc[mi][ni][h * 2 + 1];
        }
        continue;
      }
      TC* crow = TA ? C + g * p.sc + r * p.ldc : C + r * p.ldc;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int64_t col = n0 + wn * 32 + ni * 8 + c4 * 2;
        store_c(p, crow, col, p.alpha * acc[mi][ni][h * 2], p.alpha * acc[mi][ni][h * 2 + 1]);
      }
    }
}

// ---------------------------------------------------------------------------------------------
// CUDA cores (f32, and bf16 operands the tensor-core path cannot take)

constexpr int SBM = 64, SBN = 64, SBK = 16;

template <bool TA, bool TB, class TI, class TC>
__global__ void __launch_bounds__(256) gg_simt_kernel(GG p) {
  __shared__ float As[SBK][SBM + 4], Bs[SBK][SBN + 4];
  check_offsets(p);
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;  // outputs (ty + 16i, tx + 16j)
  const int64_t n0 = int64_t(blockIdx.x) * SBN;
  int64_t m0, rlo, rhi, g = 0;
  if (!block_rows<SBM, TA>(p, &g, &m0, &rlo, &rhi)) return;
  const TI* A = static_cast<const TI*>(p.A);
  const TI* B = static_cast<const TI*>(p.B) + (TA ? 0 : g * p.sb);
  const int64_t kdim = TA ? rhi - rlo : p.K;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < kdim; k0 += SBK) {
    // op(A)[m][k] -> As[k][m]; the contiguous index runs over consecutive threads.
    for (int i = tid; i < SBK * SBM; i += 256) {
      int kk, mm;
      if constexpr (!TA) { mm = i / SBK; kk = i % SBK; } else { kk = i / SBM; mm = i % SBM; }
      const int64_t k = k0 + kk, m = m0 + mm;
      float v = 0.f;
      if constexpr (!TA) {
        if (m < rhi && k < p.K) v = to_f(A[m * p.lda + k]);
      } else {
        if (rlo + k < rhi && m < p.M) v = to_f(A[(rlo + k) * p.lda + m]);
      }
      As[kk][mm] = v;
    }
    // op(B)[k][n] -> Bs[k][n]
    for (int i = tid; i < SBK * SBN; i += 256) {
      int kk, nn;
      if constexpr (!TA && TB) { nn = i / SBK; kk = i % SBK; } else { kk = i / SBN; nn = i % SBN; }
      const int64_t k = k0 + kk, n = n0 + nn;
      float v = 0.f;
      if constexpr (TA) {
        if (rlo + k < rhi && n < p.N) v = to_f(B[(rlo + k) * p.ldb + n]);
      } else if constexpr (TB) {
        if (n < p.N && k < p.K) v = to_f(B[n * p.ldb + k]);
      } else {
        if (k < p.K && n < p.N) v = to_f(B[k * p.ldb + n]);
      }
      Bs[kk][nn] = v;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < SBK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
  TC* C = static_cast<TC*>(p.C);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t r = m0 + ty + 16 * i;
    if (TA ? r >= p.M : r >= rhi) continue;
    TC* crow = TA ? C + g * p.sc + r * p.ldc : C + r * p.ldc;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t col = n0 + tx + 16 * j;
      if (col >= p.N) continue;
      float v = p.alpha * acc[i][j];
      if (p.beta != 0.f) v += p.beta * to_f(crow[col]);
      crow[col] = from_f<TC>(v);
    }
  }
}

// ---------------------------------------------------------------------------------------------

bool a16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool mma_ok(const GroupedGemmArgs& a) {
  if (a.ab != DType::bf16 || a.force_simt) return false;
  auto m8 = [](int64_t v) { return v % 8 == 0; };
  if (!a16(a.A) || !a16(a.B)) return false;
  if (!a.ta)
    return m8(a.K) && m8(a.lda) && m8(a.ldb) && m8(a.stride_b) && (a.tb || m8(a.N));
  return m8(a.M) && m8(a.N) && m8(a.lda) && m8(a.ldb);
}

// C[r, n] = alpha (sum over z in order of part[z][r][n]) for the T x N of a split-K launch.
template <class TC>
__global__ void gg_split_reduce(const float* part, int Z, int64_t T, int64_t N, TC* C, int64_t ldc, float alpha) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * N) return;
  const int64_t r = i / N, n = i % N;
  float acc = 0.f;
  for (int z = 0; z < Z; ++z) acc += part[(int64_t(z) * T + r) * N + n];
  C[r * ldc + n] = from_f<TC>(alpha * acc);
}

template <bool TA, bool TB, class TC, bool CHUNKED = false>
void launch_mma(const GG& p, dim3 grid, cudaStream_t s) {
  // Per device, so on every launch (it costs a driver call, not a sync).
  const cudaError_t attr = cudaFuncSetAttribute(
      gg_mma_kernel<TA, TB, TC, CHUNKED>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(MMA_SMEM));
  if (attr != cudaSuccess)
    throw std::runtime_error(std::string("grouped_gemm: shared memory: ") + cudaGetErrorString(attr));
  gg_mma_kernel<TA, TB, TC, CHUNKED><<<grid, THREADS, MMA_SMEM, s>>>(p);
}

template <class TI, class TC>
void launch_simt(bool ta, bool tb, const GG& p, dim3 grid, cudaStream_t s) {
  if (ta)
    gg_simt_kernel<true, false, TI, TC><<<grid, 256, 0, s>>>(p);
  else if (tb)
    gg_simt_kernel<false, true, TI, TC><<<grid, 256, 0, s>>>(p);
  else
    gg_simt_kernel<false, false, TI, TC><<<grid, 256, 0, s>>>(p);
}

}  // namespace

const char* grouped_gemm_path(const GroupedGemmArgs& a) { return mma_ok(a) ? "mma" : "simt"; }

// The split of K for gemm with batch_invariant = 1 (one group, ta = 0, tb = 1, tensor cores): a
// function of N and K alone, never of the rows, so every M sums a row's products in the same
// chunks and adds the chunks in the same order. Enough chunks that a few rows still give about
// kSplitBlocks blocks (a decoding step's o_proj at N = 2048 is 16 column tiles: 16 blocks of 132
// SMs without a split); at most one chunk per k-block. Returns the k-blocks per chunk (0: none).
int64_t gemm_rows_kchunk(const GroupedGemmArgs& a) {
  if (!a.invariant_split || a.offsets || a.ta || !a.tb || !mma_ok(a)) return 0;
  constexpr int64_t kSplitBlocks = 256;
  const int64_t tiles = ceil_div(a.N, BN), nk = (a.K + BK - 1) / BK;
  const int64_t want = std::min<int64_t>(nk, (kSplitBlocks + tiles - 1) / tiles);
  if (want <= 1) return 0;
  return (nk + want - 1) / want;
}

// From this many rows the chunks run inside one block (CHUNKED): the row tiles alone fill the
// GPU, and the split's partial sums (Z x rows x N floats written and read) would cost more than
// one block per SM does.
constexpr int64_t kChunkedRows = 1024;

namespace {
// The chunks of K at kc k-blocks each (the last may be shorter).
int64_t k_chunks(const GroupedGemmArgs& a, int64_t kc) { return ((a.K + BK - 1) / BK + kc - 1) / kc; }
}  // namespace

int64_t gemm_rows_partial_bytes(const GroupedGemmArgs& a, int64_t rows) {
  const int64_t kc = gemm_rows_kchunk(a);
  if (kc == 0 || a.T >= kChunkedRows) return 0;
  return k_chunks(a, kc) * rows * a.N * int64_t(sizeof(float));
}

void grouped_gemm(const GroupedGemmArgs& a, cudaStream_t s) {
  auto bad = [](const std::string& m) { throw std::invalid_argument("grouped_gemm: " + m); };
  if (a.G < 1) bad("need at least one group");
  if (!a.offsets && (a.G != 1 || a.ta)) bad("offsets are required (absent only for one group of rows)");
  if (a.ta && a.tb) bad("transpose_b with transpose_a is not offered");
  if (a.T < 0 || a.M < 0 || a.N < 0 || a.K < 0) bad("negative dimension");
  if (a.T > INT32_MAX) bad("more than 2^31 rows");
  if (a.ab == DType::f32 && a.c_dt != DType::f32) bad("an f32 gemm writes an f32 C");
  if (a.ab == DType::f64 || a.c_dt == DType::f64) bad("f64 is not offered");
  const int64_t a_cols = a.ta ? a.M : a.K, b_cols = a.ta ? a.N : (a.tb ? a.K : a.N);
  if (a.lda < std::max<int64_t>(1, a_cols) || a.ldb < std::max<int64_t>(1, b_cols) ||
      a.ldc < std::max<int64_t>(1, a.N))
    bad("leading dimension smaller than the row");
  if (a.N == 0 || (a.ta ? a.M == 0 : a.T == 0)) return;
  GG p{};
  p.off = a.offsets;
  p.G = a.G;
  p.T = a.T;
  p.M = a.M;
  p.N = a.N;
  p.K = a.K;
  p.alpha = float(a.alpha);
  p.beta = float(a.beta);
  p.A = a.A;
  p.lda = a.lda;
  p.B = a.B;
  p.ldb = a.ldb;
  p.sb = a.stride_b;
  p.C = a.C;
  p.ldc = a.ldc;
  p.sc = a.stride_c;
  p.err = a.err;
  const size_t cs = dtype_size(a.c_dt);
  p.pair = a.ldc % 2 == 0 && (!a.ta || a.stride_c % 2 == 0) &&
           reinterpret_cast<uintptr_t>(a.C) % (2 * cs) == 0;
  const bool mma = mma_ok(a);
  const int64_t bm = mma ? BM : SBM, bn = mma ? BN : SBN;
  dim3 grid;
  grid.x = ceil_div(a.N, bn);
  if (!a.ta) {
    const int64_t tiles = (a.T + bm - 1) / bm + std::min(a.G, a.T);  // worst case over partitions
    if (tiles > 65535) bad("too many rows for one launch");
    grid.y = unsigned(tiles);
    grid.z = 1;
  } else {
    if (a.G > 65535) bad("more than 65535 groups");
    grid.y = ceil_div(a.M, bm);
    grid.z = unsigned(a.G);
    if (grid.y > 65535) bad("M too large");
  }
  const bool cf = a.c_dt == DType::f32;
  const int64_t kc = gemm_rows_kchunk(a);
  // gg_split_reduce has no beta; run_gemm_rows refuses beta != 0 before this
  if (kc && a.beta != 0) bad("the batch-invariant split takes beta = 0 only");
  if (kc && a.T >= kChunkedRows) {  // the chunks in one block, added as the split path adds them
    GG q = p;
    q.kchunk = int(kc);
    cf ? launch_mma<false, true, float, true>(q, grid, s) : launch_mma<false, true, bf16, true>(q, grid, s);
    check_launch("grouped_gemm (chunked K)");
    return;
  }
  if (kc) {
    if (!a.split_ws) bad("the split-K workspace is missing (gemm_rows_partial_bytes)");
    // Split K in bands of rows whose partial sums fit the workspace: each band's chunks, then
    // their sum in chunk order (what every M computes for a row: batch-invariant).
    const int64_t Z = k_chunks(a, kc);
    const int64_t per_row = Z * a.N * int64_t(sizeof(float));
    const int64_t band = std::min<int64_t>(a.T, int64_t(a.split_ws_bytes) / per_row);
    if (band < 1) bad("the split-K workspace holds less than one row");
    for (int64_t r0 = 0; r0 < a.T; r0 += band) {
      GG q = p;
      q.T = std::min(band, a.T - r0);
      q.A = static_cast<const bf16*>(a.A) + r0 * a.lda;
      q.kchunk = int(kc);
      q.part = static_cast<float*>(a.split_ws);
      const dim3 g(grid.x, unsigned((q.T + BM - 1) / BM + 1), unsigned(Z));
      cf ? launch_mma<false, true, float>(q, g, s) : launch_mma<false, true, bf16>(q, g, s);
      const int64_t n = q.T * a.N;
      const unsigned blocks = unsigned((n + 255) / 256);
      if (cf)
        gg_split_reduce<float><<<blocks, 256, 0, s>>>(q.part, int(Z), q.T, a.N,
                                                      static_cast<float*>(a.C) + r0 * a.ldc, a.ldc, p.alpha);
      else
        gg_split_reduce<bf16><<<blocks, 256, 0, s>>>(q.part, int(Z), q.T, a.N,
                                                     static_cast<bf16*>(a.C) + r0 * a.ldc, a.ldc, p.alpha);
    }
    check_launch("grouped_gemm (split K)");
    return;
  }
  if (mma) {
    if (a.ta)
      cf ? launch_mma<true, false, float>(p, grid, s) : launch_mma<true, false, bf16>(p, grid, s);
    else if (a.tb)
      cf ? launch_mma<false, true, float>(p, grid, s) : launch_mma<false, true, bf16>(p, grid, s);
    else
      cf ? launch_mma<false, false, float>(p, grid, s) : launch_mma<false, false, bf16>(p, grid, s);
  } else if (a.ab == DType::f32) {
    launch_simt<float, float>(a.ta, a.tb, p, grid, s);
  } else if (cf) {
    launch_simt<bf16, float>(a.ta, a.tb, p, grid, s);
  } else {
    launch_simt<bf16, bf16>(a.ta, a.tb, p, grid, s);
  }
  check_launch("grouped_gemm");
}

}  // namespace rlh::kcuda
