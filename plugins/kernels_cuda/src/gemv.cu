// gemm's few-row form, C[r, :] = A[r, :] B^T for up to kGemvRows rows of bf16 A (a decoding
// step at batch 1-4 against a weight B [N, K]): a warp a column of C, its lanes walking B's row
// 16 bytes at a time with several loads in flight, the rows of A read alongside (they stay in
// L1), fp32 sums, one warp reduction. cuBLASLt's kernels for these shapes are tiles of 8+ rows
// over few blocks (7 us for a 2048 x 2048 weight that streams in 2.5 us at the H200's bandwidth);
// here every SM streams its share. Not batch-invariant (a row's sums differ from the tiled
// kernels'), so gemm with batch_invariant = 1 never comes here.
#include <cstdlib>

#include "glu_act.cuh"
#include "norm_math.cuh"

namespace rlh::kcuda {

namespace {

constexpr int kWarps = 8;
// 16-byte chunks of B each lane has in flight: 8 (4 KiB a warp) covers a K = 2048 row in one
// round, so a 2048-wide weight is one dependent load per warp instead of two; each lane still
// sums its chunks in increasing order, so the results are those of fewer chunks in flight.
constexpr int kAhead = 8;

// WPC warps share a column, each summing a contiguous part of K (WPC = 1: the whole row), their
// sums added in part order through shared memory. Why: a warp walks its part in rounds of
// kAhead chunks a lane, each round one memory round trip; a 8192-wide row (a 1B model's down
// projection) was four dependent rounds per warp and streamed at ~1.3 TB/s on an H100, where four
// warps a column keep the whole weight in flight at once.
// ACT >= 0 (gemm_glu_fwd): B is gate | up [2N, K]; a warp sums column n of both halves (rows n
// and N + n of B) and writes h = act(gate) * up from the two sums rounded to bf16, as gemm then
// swiglu_fwd / geglu_fwd compute it (glu_act.cuh): a decoding step's GLU launch fewer a layer.
// NORM (rmsnorm_gemm_fwd): A is RMS-normalised on the way in. Every warp computes the rows' rstd
// itself, as rmsnorm_fwd's warp does (its lane's chunks lane * 8 + 256 i in order, warp_sum,
// rstd_of), and each chunk of A is taken as bf16(a * rstd * (w + woff)), rmsnorm_fwd's value: the
// product is bitwise the norm then the product, without the norm's launch.
// RES (gemm_add_fwd): C = bf16(res + bf16(A B^T)), add_fwd's value of the product rounded as
// gemm rounds it: the residual add's launch saved. res may be C (each element is read and
// written by the one lane that owns it).
template <int R, class TC, int WPC, int ACT, bool PRE, bool NORM = false, bool RES = false>
__global__ void __launch_bounds__(kWarps * 32) gemv_kernel(GemmArgs g, GemvExtra ex) {
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
  float rs[R];  // NORM: the rows' rstd
  if constexpr (NORM) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const bf16* ar = static_cast<const bf16*>(g.A) + r * g.lda;
      float ss = 0.f;
      for (int64_t c = int64_t(lane) * 8; c < g.K; c += 256) {
        const uint4 u = *reinterpret_cast<const uint4*>(ar + c);
        const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&u);
        float v[8];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float2 f = __bfloat1622float2(h2[k]);
          v[2 * k] = f.x;
          v[2 * k + 1] = f.y;
        }
        sumsq8(ss, v);
      }
      rs[r] = rstd_of(warp_sum(ss), g.K, ex.eps);
    }
  }
  // A's chunk c of row r as the product reads it (NORM: normalised and rounded as rmsnorm_fwd).
  auto a_chunk = [&](int r, int64_t c) -> uint4 {
    const uint4 av = reinterpret_cast<const uint4*>(static_cast<const bf16*>(g.A) + r * g.lda)[c];
    if constexpr (!NORM) {
      return av;
    } else {
      const uint4 wv = reinterpret_cast<const uint4*>(ex.norm_w)[c];
      const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&av);
      const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv);
      uint4 out;
      __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 x = __bfloat1622float2(a2[k]), w = __bfloat1622float2(w2[k]);
        o2[k] = __floats2bfloat162_rn(x.x * rs[r] * (w.x + ex.woff), x.y * rs[r] * (w.y + ex.woff));
      }
      return out;
    }
  };
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
          const uint4 av = a_chunk(r, c0 + 32 * u);
#pragma unroll
          for (int h = 0; h < NB; ++h) fma8(acc[h][r], av, bv[h][u]);
        }
      }
      if (c0 + 32 * kAhead < c_end) load_round(c0 + 32 * kAhead);
    }
  }
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
    if (part != 0) return;
#pragma unroll
    for (int h = 0; h < NB; ++h)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float v = 0.f;
#pragma unroll
        for (int q = 0; q < WPC; ++q) v += part_sum[warp + q][h][r];  // in part order
        acc[h][r] = v;
      }
  }
  if (lane == 0 && live) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if constexpr (ACT >= 0) {
        const float gate = __bfloat162float(__float2bfloat16_rn(acc[0][r]));
        const float up = __bfloat162float(__float2bfloat16_rn(acc[1][r]));
        static_cast<TC*>(g.C)[r * g.ldc + n] = from_f<TC>(act_value<ACT>(gate) * up);
      } else if constexpr (RES) {
        const float p = __bfloat162float(__float2bfloat16_rn(acc[0][r]));  // the product as stored
        const float res = __bfloat162float(reinterpret_cast<const bf16*>(ex.res)[r * ex.ldres + n]);
        static_cast<TC*>(g.C)[r * g.ldc + n] = from_f<TC>(res + p);
      } else {
        float v = acc[0][r];
        if (g.bias) v += g.bias_dt == DType::bf16 ? __bfloat162float(static_cast<const bf16*>(g.bias)[n])
                                                  : static_cast<const float*>(g.bias)[n];
        static_cast<TC*>(g.C)[r * g.ldc + n] = from_f<TC>(v);
      }
    }
  }
}

// Whether the first round of the weight is loaded before pdl_wait (RLH_KCUDA_GEMV_PRELOAD=0:
// only prefetched into L2, as before 2026-12-06; the A/B of device_gpu.sh decodeab).
bool gemv_preload() {
  static const bool v = env_switch_on("RLH_KCUDA_GEMV_PRELOAD");
  return v;
}

// EX: 0 plain, 1 NORM, 2 RES (the fused forms run with the weight's first round preloaded
// only, and bf16 C).
template <int R, int WPC, int ACT, int EX>
void launch_wpc(const GemmArgs& g, const GemvExtra& ex, cudaStream_t s) {
  constexpr int kCols = kWarps / WPC;
  const unsigned grid = unsigned((g.N + kCols - 1) / kCols);
  if constexpr (EX != 0) {
    launch_pdl(gemv_kernel<R, bf16, WPC, ACT, true, EX == 1, EX == 2>, grid, kWarps * 32, 0, s, g, ex);
  } else {
    const bool pre = gemv_preload();
    if (g.c_dt == DType::bf16) {
      if (pre)
        launch_pdl(gemv_kernel<R, bf16, WPC, ACT, true>, grid, kWarps * 32, 0, s, g, ex);
      else
        launch_pdl(gemv_kernel<R, bf16, WPC, ACT, false>, grid, kWarps * 32, 0, s, g, ex);
    } else if constexpr (ACT < 0) {
      if (pre)
        launch_pdl(gemv_kernel<R, float, WPC, ACT, true>, grid, kWarps * 32, 0, s, g, ex);
      else
        launch_pdl(gemv_kernel<R, float, WPC, ACT, false>, grid, kWarps * 32, 0, s, g, ex);
    }
  }
}

// Warps a column: enough that each warp's part is about one round (32 lanes x kAhead chunks
// of 8 = 2048 elements), at most a block's 8.
template <int R, int ACT, int EX>
void launch(const GemmArgs& g, const GemvExtra& ex, cudaStream_t s) {
  const int64_t rounds = (g.K + 32 * kAhead * 8 - 1) / (32 * kAhead * 8);
  if (rounds >= 8)
    launch_wpc<R, 8, ACT, EX>(g, ex, s);
  else if (rounds >= 4)
    launch_wpc<R, 4, ACT, EX>(g, ex, s);
  else if (rounds >= 2)
    launch_wpc<R, 2, ACT, EX>(g, ex, s);
  else
    launch_wpc<R, 1, ACT, EX>(g, ex, s);
}

template <int ACT, int EX = 0>
void launch_rows(const GemmArgs& g, cudaStream_t s, const GemvExtra& ex = GemvExtra{}) {
  switch (g.M) {
    case 1: launch<1, ACT, EX>(g, ex, s); break;
    case 2: launch<2, ACT, EX>(g, ex, s); break;
    case 3: launch<3, ACT, EX>(g, ex, s); break;
    default: launch<4, ACT, EX>(g, ex, s); break;
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

bool gemv_rows(const GemmArgs& g, cudaStream_t s) {
  if (!gemv_fits(g, g.N)) return false;
  launch_rows<-1>(g, s);
  check_launch("gemm (few rows)");
  return true;
}

bool gemv_glu_rows(const GemmArgs& g, int act, cudaStream_t s) {
  if (!gemv_fits(g, 2 * g.N) || g.c_dt != DType::bf16 || g.bias || act < 0 || act > 2) return false;
  if (act == 0)
    launch_rows<0>(g, s);
  else if (act == 1)
    launch_rows<1>(g, s);
  else
    launch_rows<2>(g, s);
  check_launch("gemm_glu (few rows)");
  return true;
}

bool gemv_norm_rows(const GemmArgs& g, int act, const GemvExtra& ex, cudaStream_t s) {
  if (!gemv_fits(g, act >= 0 ? 2 * g.N : g.N) || g.c_dt != DType::bf16 || g.bias || !ex.norm_w || ex.res ||
      !aligned16(ex.norm_w) || act < -1 || act > 0 || !gemv_preload())
    return false;
  if (act == 0)
    launch_rows<0, 1>(g, s, ex);
  else
    launch_rows<-1, 1>(g, s, ex);
  check_launch("rmsnorm_gemm (few rows)");
  return true;
}

bool gemv_add_rows(const GemmArgs& g, const GemvExtra& ex, cudaStream_t s) {
  if (!gemv_fits(g, g.N) || g.c_dt != DType::bf16 || g.bias || !ex.res || ex.norm_w || !gemv_preload()) return false;
  launch_rows<-1, 2>(g, s, ex);
  check_launch("gemm_add (few rows)");
  return true;
}

}  // namespace rlh::kcuda
