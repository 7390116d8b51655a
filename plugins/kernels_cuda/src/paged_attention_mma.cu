// paged_attention on tensor cores (docs/ops.md; the SIMT kernel in decode.cu takes every case this
// one does not): bf16, Dk = Dv = 64 or 128, no soft-capping, caches whose rows of D values are
// contiguous and 16-byte aligned (the generator's [block][kv head][slot][D]).
//
// One warp per (row, kv head, partition): the query heads of the kv head's group are the 16 rows
// of an mma m-tile (Llama-3's 4 heads fill a quarter of it: the kernel is bound by the cache's
// bytes, not by the tensor cores, so the idle rows cost nothing that matters), and the keys go by
// in tiles of 64 positions through double-buffered shared memory (cp.async), as in the training
// forward (attention_fwd.cu): S = Q K^T and O += P V on mma.sync m16n8k16 with fp32 accumulators,
// the online softmax in fp32 with exp2 and the scale folded in, P rounded to bf16 for the second
// product. Per row and tile this is the training kernel's arithmetic: same fragments, same
// order, same roundings.
//
// Why: the SIMT kernel gives each lane a key and walks the values with the lanes over the head
// dims. At batch 256 it took ~93 us a layer of Llama-3.2-1B against ~32 us to read the layer's
// cache, about 30% of a decoding step; its loads are 4 bytes a lane and its chains long.
//
// Partitions (flash-decoding): a row's tiles are cut into partitions of PT tiles, aligned to
// multiples of PT; a row whose tiles lie in one partition writes its output directly, longer
// rows write partials (the unnormalised output, the maximum in natural-log units and the sum)
// that a second kernel combines in partition order. PT is chosen per launch so that small
// batches still fill the GPU (batch 1 over many tiles: one tile a warp; over a few hundred
// positions: whole rows, no combine) and large ones skip the combine (batch 256: one partition). A row's output then depends on the launch, so the op promises batch
// invariance only when asked (attribute batch_invariant = 1): then every row is one partition,
// whatever the launch, and its output depends on its own position, window and cache alone.
//
// FP8 caches (vLLM's kv_cache_dtype fp8; docs/ops.md): the codes come in by cp.async into
// double-buffered byte tiles (half a bf16 tile each: a warp takes half the shared memory, so
// twice as many warps are resident), and the products read them straight from there: ldmatrix
// on the bytes taken as 16-bit units, then cvt.rn.f16x2.e4m3x2 (exact: every e4m3 value is an
// fp16 number) into mma.sync's f16 form. Why: widening each tile to bf16 in shared memory first
// (the form before 2026-12-07) cost ~5 instructions an element, more than the products and the
// softmax together; at batch 256 that kernel took 38.7 us a layer against 41.9 for bf16 caches
// of twice the bytes (H100, ncu). The order of a fragment's elements differs from the bf16 form:
//   - S = Q K^T: ldmatrix gives a lane 4 adjacent codes of a key (dims 4 t4 .. 4 t4 + 3 of a
//     16-dim step); they are the mma's k = 2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9, and Q's fragment
//     is read in the same order (a dot product does not care which k is which).
//   - O += P V: ldmatrix.trans gives a lane 2 keys x 2 adjacent dims; the dims are split by a
//     byte permute into two n-tiles, the even and the odd dims of a 16-dim block, so the
//     accumulator acc[2 b + p] holds dims 16 b + 4 t4 + 2 e + p (fp8_dim below).
// Q is rounded to fp16 after a power-of-two scale that puts its largest magnitude in
// [2^14, 2^15) (fp16's range is bf16's only in part; the scale is exact and undone with the key
// scale in the softmax scale); P is rounded to fp16 (finer than bf16's rounding). The key scale
// is folded into the softmax scale, the value scale into the output; both are read before
// pdl_wait (uploaded, never a step's output).
#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "mma.cuh"

namespace rlh::kcuda {

using namespace mma;

namespace {

constexpr int kBK = 64;                                // keys per tile (attention_fwd's BK)
constexpr int64_t kChunkBytes = int64_t(16) << 20;     // partials of one launch's rows at most
constexpr int64_t kTargetWarps = 2048;                 // enough warps to fill an H200 a few times
constexpr size_t kMaxBlockSmem = 220 * 1024;           // shared memory a block may take (sm_90: 227 KiB)
constexpr int64_t kBlockCombineUnits = 32;             // (rows x kv heads x m-tiles) combined in the block

__host__ __device__ inline int64_t partial_floats(int64_t Dv) { return Dv + 2; }

// The first key a row at `pos` sees: HF's sliding window keeps p - W + 1 .. p.
__device__ __forceinline__ int64_t first_key(const PagedAttnArgs& a, int64_t pos) {
  return a.window > 0 && pos - a.window + 1 > 0 ? pos - a.window + 1 : 0;
}

// A warp's shared memory: bf16, Q [16][D] and K, V [2][64][D]; FP8, K and V codes [2][64][D].
template <int D, bool FP8 = false>
constexpr size_t smem_bytes() {
  return FP8 ? size_t(4 * kBK * D) : size_t(16 * D + 4 * kBK * D) * sizeof(bf16);
}

// Positions [64 j, 64 j + 64) of kv head hk into shared memory, 16 bytes a cp.async, element
// (r, c) of the tile at dst(r, c); positions outside [lo, hi] are zero-filled (their scores are
// masked). T: the cache's element (bf16, or an FP8 cache's byte codes).
template <int D, class T, class Dst>
__device__ __forceinline__ void load_kv_rows(T* Kt, T* Vt, const PagedAttnArgs& a, const int32_t* table, int64_t hk,
                                             int64_t j, int64_t lo, int64_t hi, Dst dst) {
  constexpr int E = 16 / int(sizeof(T));  // elements a copy
  constexpr int CH = D / E;               // copies a row
  constexpr int STEP = 32 / CH;           // rows a pass of the warp covers
  const int lane = threadIdx.x & 31, c = (lane % CH) * E;
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);
  const T* kh = kc + hk * a.kc_strides[1] + c;  // this kv head's rows, this lane's columns
  const T* vh = vc + hk * a.vc_strides[1] + c;
  // A position's block and slot in 32-bit arithmetic (positions and block sizes fit), by shift
  // and mask for a power-of-two block size (the generator's): a 64-bit division by a run-time
  // value is a long subroutine, and these are 16 a tile a lane, most of the loads' instructions.
  const uint32_t bsu = uint32_t(a.bs);
  const bool pow2 = (bsu & (bsu - 1)) == 0;
  const int sh = __ffs(int(bsu)) - 1;
#pragma unroll 4
  for (int r0 = 0; r0 < kBK; r0 += STEP) {
    const int r = r0 + lane / CH;
    const int64_t p = j * kBK + r;
    const bool ok = p >= lo && p <= hi;
    const T* kp = kc;
    const T* vp = vc;
    if (ok) {
      const uint32_t pu = uint32_t(p);
      uint32_t bi, off;
      if (pow2) {
        bi = pu >> sh;
        off = pu & (bsu - 1);
      } else {
        bi = pu / bsu;
        off = pu - bi * bsu;
      }
      const int64_t blk = table[bi];
      kp = kh + blk * a.kc_strides[0] + int64_t(off) * a.kc_strides[2];
      vp = vh + blk * a.vc_strides[0] + int64_t(off) * a.vc_strides[2];
    }
    cp_async16(Kt + dst(r, c), kp, ok);
    cp_async16(Vt + dst(r, c), vp, ok);
  }
}

// bf16 rows into swizzled [64][D] tiles (the products read them with ldmatrix).
template <int D>
__device__ __forceinline__ void load_kv_tile(bf16* Kt, bf16* Vt, const PagedAttnArgs& a, const int32_t* table,
                                             int64_t hk, int64_t j, int64_t lo, int64_t hi) {
  load_kv_rows<D>(Kt, Vt, a, table, hk, j, lo, hi, [](int r, int c) { return swz<D>(r, c); });
}

// Byte offset of (row, byte col) in a [64][D] tile of FP8 codes, its 16-byte chunks swizzled so
// that the 8 rows an ldmatrix reads at one chunk meet on 8 different groups of 4 banks (rows of
// 64 bytes: chunk c ^ ((row >> 1) & 3); of 128: c ^ (row & 7)).
template <int D>
__device__ __forceinline__ int swz8(int row, int col) {
  const int c = col >> 4;
  const int cs = D == 64 ? c ^ ((row >> 1) & 3) : c ^ (row & 7);
  return row * D + (cs << 4) + (col & 15);
}

template <int D>
__device__ __forceinline__ void load_kv_tile8(uint8_t* K8, uint8_t* V8, const PagedAttnArgs& a, const int32_t* table,
                                              int64_t hk, int64_t j, int64_t lo, int64_t hi) {
  load_kv_rows<D>(K8, V8, a, table, hk, j, lo, hi, [](int r, int c) { return swz8<D>(r, c); });
}

// Two pairs of e4m3 codes (bytes 0-1 and 2-3 of v) as two fp16x2 registers.
__device__ __forceinline__ void e4m3x4_to_f16x2(uint32_t v, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(v));
}

__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// c += a (16x16, row) * b (16x8, col), fp16 operands.
__device__ __forceinline__ void mma16816_f16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The head dim of accumulator element (i, e) (e = 0, 1: its columns 2 t4 + e) of a lane: the
// bf16 form's n-tiles are dims 8 i ..; the FP8 form's are the even (i = 2 b) and odd (2 b + 1)
// dims of 16-dim block b.
template <bool FP8>
__device__ __forceinline__ int acc_dim(int i, int e, int t4) {
  return FP8 ? 16 * (i >> 1) + 4 * t4 + 2 * e + (i & 1) : 8 * i + 2 * t4 + e;
}

// The FP8 form's Q fragments: rows g0 .. g0 + gn - 1 of the group (zero past gn), dims in the
// order of the keys' fragments (see the file's comment), times qscale, a power of two that puts
// the largest magnitude in [2^14, 2^15) (1 when Q is all zeros). Returns qscale.
template <int D>
__device__ __forceinline__ float load_q_f16(uint32_t (&qf)[D / 16][4], const bf16* qb, int gn) {
  constexpr int KS = D / 16;
  const int lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  float q[KS][2][4];
  float amax = 0.f;
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = gid + 8 * h;
      uint2 u = make_uint2(0u, 0u);
      if (row < gn) u = *reinterpret_cast<const uint2*>(qb + row * D + kk * 16 + t4 * 4);
      const __nv_bfloat162 p0 = *reinterpret_cast<const __nv_bfloat162*>(&u.x);
      const __nv_bfloat162 p1 = *reinterpret_cast<const __nv_bfloat162*>(&u.y);
      q[kk][h][0] = __low2float(p0), q[kk][h][1] = __high2float(p0);
      q[kk][h][2] = __low2float(p1), q[kk][h][3] = __high2float(p1);
#pragma unroll
      for (int e = 0; e < 4; ++e) amax = fmaxf(amax, fabsf(q[kk][h][e]));
    }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  // 2^(14 - floor(log2 amax)), built from amax's exponent (at most 2^126, which 1 / qscale
  // keeps a normal float; a non-finite Q makes non-finite scores either way).
  const int ex = int((__float_as_uint(amax) >> 23) & 0xff) - 127;
  const float qscale = amax > 0.f && ex < 128 ? ldexpf(1.f, min(14 - ex, 126)) : 1.f;
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    qf[kk][0] = pack_f16(q[kk][0][0] * qscale, q[kk][0][1] * qscale);
    qf[kk][1] = pack_f16(q[kk][1][0] * qscale, q[kk][1][1] * qscale);
    qf[kk][2] = pack_f16(q[kk][0][2] * qscale, q[kk][0][3] * qscale);
    qf[kk][3] = pack_f16(q[kk][1][2] * qscale, q[kk][1][3] * qscale);
  }
  return qscale;
}

// S (16 x 64 keys) += Q K^T from a tile of key codes.
template <int D>
__device__ __forceinline__ void scores_fp8(float (&s)[kBK / 8][4], const uint32_t (&qf)[D / 16][4], const uint8_t* K8) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int ng = 0; ng < kBK / 32; ++ng) {
      uint32_t r[4];  // keys 32 ng + 8 m + gid, dims 16 kk + 4 t4 .. + 3
      ldsm_x4(r, K8 + swz8<D>(ng * 32 + lane, kk * 16));
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        uint32_t b0, b1;
        e4m3x4_to_f16x2(r[m], b0, b1);
        mma16816_f16(s[ng * 4 + m], qf[kk], b0, b1);
      }
    }
}

// O += P V over a tile of value codes; pa: P's fragments (fp16) of keys 16 jj ..
template <int D>
__device__ __forceinline__ void pv_fp8(float (&acc)[D / 8][4], const uint32_t (&pa)[4], const uint8_t* V8, int jj) {
  const int lane = threadIdx.x & 31, m = lane >> 3;
#pragma unroll
  for (int db = 0; db < D / 32; ++db) {
    uint32_t r[4];  // [keys 16 jj + 2 t4, +1 | +8, +9] x [dims 2 gid, 2 gid + 1] of chunks 2 db, 2 db + 1
    ldsm_x4_t(r, V8 + swz8<D>(jj * 16 + (m & 1) * 8 + (lane & 7), (2 * db + (m >> 1)) * 16));
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      // bytes (key, dim): (k, 2g) (k, 2g+1) (k+1, 2g) (k+1, 2g+1) -> (k, 2g) (k+1, 2g) | (k, 2g+1) (k+1, 2g+1)
      uint32_t ev0, od0, ev1, od1;
      e4m3x4_to_f16x2(__byte_perm(r[2 * c], 0u, 0x3120), ev0, od0);
      e4m3x4_to_f16x2(__byte_perm(r[2 * c + 1], 0u, 0x3120), ev1, od1);
      const int b = 2 * db + c;
      mma16816_f16(acc[2 * b], pa, ev0, ev1);
      mma16816_f16(acc[2 * b + 1], pa, od0, od1);
    }
  }
}

// The four lanes of an mma row group (lanes 4 gid .. 4 gid + 3) summed, as they hold a row's
// columns.
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// The in-block combine (paged_mma_kernel with WARPS > 1): each warp puts its rows' unnormalised
// output, maximum and sum in its own buffer (`mine`, in its tiles: its loads are done), then the
// block computes, for each of the group's rows and dims, sum_w acc_w e^(m_w - M) / sum_w l_w
// e^(m_w - M) with M the largest m_w, warps in partition order (as the combine kernel).
template <int D, int WARPS, bool FP8>
__device__ __forceinline__ void combine_in_block(const PagedAttnArgs& a, int64_t r, int64_t hq0, int gn, float sl2,
                                                 const float (&acc)[D / 8][4], const float (&m)[2], const float (&l)[2],
                                                 float* mine) {
  constexpr int DT = D / 8;
  constexpr int64_t WARP_FLOATS = int64_t(smem_bytes<D, FP8>() / sizeof(float));  // a warp's shared memory
  const int lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  // mine: [16 rows][D] outputs, then [16] maxima, [16] sums (16 D + 32 floats <= the tiles)
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const float lr = quad_sum(l[hf]);  // the row's sum over its four lanes
    const int g = gid + 8 * hf;
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      mine[g * D + acc_dim<FP8>(i, 0, t4)] = acc[i][2 * hf];
      mine[g * D + acc_dim<FP8>(i, 1, t4)] = acc[i][2 * hf + 1];
    }
    if (t4 == 0) {
      mine[16 * D + g] = m[hf];
      mine[16 * D + 16 + g] = lr;
    }
  }
  __syncthreads();
  // The buffers sit WARP_FLOATS apart, each at the same offset from its warp's start.
  const float* first = mine - int64_t(threadIdx.x >> 5) * WARP_FLOATS;
  for (int e = threadIdx.x; e < gn * D; e += 32 * WARPS) {
    const int g = e / D, d = e % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) M = fmaxf(M, first[w * WARP_FLOATS + 16 * D + g]);
    float L = 0.f, v = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float* b = first + w * WARP_FLOATS;
      const float mw = b[16 * D + g];
      const float f = mw == -INFINITY ? 0.f : fast_exp2((mw - M) * sl2);
      L += b[16 * D + 16 + g] * f;
      v += b[g * D + d] * f;
    }
    static_cast<bf16*>(a.o)[r * a.ldo + (hq0 + g) * D + d] = __float2bfloat16_rn(L > 0.f ? v / L : 0.f);
  }
}

// grid (rows, Hkv * mtiles, Z / WARPS), WARPS warps a block, each with its own shared memory
// (smem_bytes): rows row0 .. row0 + gridDim.x of the launch; warp w of block z takes partition
// z WARPS + w. WARPS = 1: a partition a block, partials through global memory to the combine
// kernel. WARPS > 1 (all of a row's partitions in one block, Z = WARPS): the warps combine
// their partitions through shared memory, in partition order, and write the output: the
// combine kernel's launch saved (small batches, few tiles a row).
template <int D, int WARPS, bool FP8>
__global__ void __launch_bounds__(32 * WARPS) paged_mma_kernel(PagedAttnArgs a, int64_t row0, int64_t mtiles,
                                                               int64_t PT, int64_t Z) {
  // The row's position, which no kernel of a step writes (uploaded; docs/kernels_cuda.md
  // "pdl_wait"), is read before pdl_wait; the cache (the kernel before wrote the new key) after.
  const int64_t pos = a.pos[row0 + blockIdx.x];
  const float ks = FP8 ? *a.k_scale : 1.f, vs = FP8 ? *a.v_scale : 1.f;
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  constexpr int KS = D / 16, NT = kBK / 8, DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int warp = WARPS > 1 ? int(threadIdx.x >> 5) : 0;
  unsigned char* mem = smem_raw + warp * smem_bytes<D, FP8>();
  bf16* Qs = reinterpret_cast<bf16*>(mem);  // bf16 caches: Q, then K and V [2][64][D]
  bf16* Ks = Qs + 16 * D;
  bf16* Vs = Ks + 2 * kBK * D;
  uint8_t* K8 = mem;  // FP8 caches: K and V codes [2][64][D]
  uint8_t* V8 = K8 + 2 * kBK * D;
  const int64_t rc = blockIdx.x, r = row0 + rc;
  const int64_t G = a.Hq / a.Hkv, hk = blockIdx.y / mtiles, g0 = (blockIdx.y % mtiles) * 16;
  const int gn = int(G - g0 < 16 ? G - g0 : 16);
  const int64_t hq0 = hk * G + g0;
  const int lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int64_t lo = first_key(a, pos);
  const int64_t tlo = lo / kBK, thi = pos / kBK;  // the row's tiles
  const int64_t z = int64_t(blockIdx.z) * WARPS + warp;
  const int64_t j0 = tlo > z * PT ? tlo : z * PT, j1 = thi < z * PT + PT - 1 ? thi : z * PT + PT - 1;
  if constexpr (WARPS == 1) {
    if (j0 > j1) return;  // a partition this row does not reach (the combine reads only its own)
  }
  const int ntiles = j0 > j1 ? 0 : int(j1 - j0 + 1);  // (WARPS > 1: a warp without tiles still meets)
  const int32_t* table = a.blocks + r * a.ld_blocks;

  uint32_t qf[KS][4];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float acc[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  if (ntiles > 0) {
    if constexpr (!FP8) {  // Q: the group's gn heads as the rows of an m-tile (rows past gn zero), this warp's copy
      constexpr int CH = D / 8;
      const bf16* qb = static_cast<const bf16*>(a.q) + r * a.ldq + hq0 * D;
#pragma unroll
      for (int i = lane; i < 16 * CH; i += 32) {
        const int qr = i / CH, c = (i % CH) * 8;
        cp_async16(Qs + swz<D>(qr, c), qr < gn ? qb + qr * D + c : qb, qr < gn);
      }
    }
    cp_commit();
    if constexpr (FP8) load_kv_tile8<D>(K8, V8, a, table, hk, j0, lo, pos);
    else load_kv_tile<D>(Ks, Vs, a, table, hk, j0, lo, pos);
    cp_commit();
    if constexpr (!FP8) {
      cp_wait<1>();
      __syncwarp();
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) frag_a<D>(qf[kk], Qs, 0, kk * 16);
    }
  }
  // FP8: Q's fragments straight from global memory while the first tile comes in, read by every
  // warp (a block's warps must agree on the scale: their maxima are combined).
  const float qscale = FP8 ? load_q_f16<D>(qf, static_cast<const bf16*>(a.q) + r * a.ldq + hq0 * D, gn) : 1.f;
  const float sc = a.scale * ks / qscale;  // the scores' scale (FP8: the key scale and Q's scale folded in)
  const float sl2 = sc * 1.4426950408889634f;

  for (int it = 0; it < ntiles; ++it) {
    const int64_t j = j0 + it;
    if (it + 1 < ntiles) {
      const int nb = (it + 1) & 1;
      if constexpr (FP8) load_kv_tile8<D>(K8 + nb * kBK * D, V8 + nb * kBK * D, a, table, hk, j + 1, lo, pos);
      else load_kv_tile<D>(Ks + nb * kBK * D, Vs + nb * kBK * D, a, table, hk, j + 1, lo, pos);
    }
    cp_commit();
    cp_wait<1>();
    __syncwarp();  // (the warp's own buffers: warps of a block walk different numbers of tiles)
    const bf16* Kb = Ks + (it & 1) * kBK * D;
    const bf16* Vb = Vs + (it & 1) * kBK * D;
    const uint8_t* Kc = K8 + (it & 1) * kBK * D;
    const uint8_t* Vc = V8 + (it & 1) * kBK * D;

    float s[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
    if constexpr (FP8) {
      scores_fp8<D>(s, qf, Kc);
    } else {
#pragma unroll
      for (int kk = 0; kk < KS; ++kk)
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t b[4];
          frag_b_nk<D>(b, Kb, np * 16, kk * 16);
          mma16816(s[2 * np], qf[kk], b[0], b[1]);
          mma16816(s[2 * np + 1], qf[kk], b[2], b[3]);
        }
    }
    // Every head of the group has the row's position: key j kBK + c is valid iff lo <= . <= pos.
    if (j * kBK < lo || j * kBK + kBK - 1 > pos) {
      const int64_t lo_c = lo - j * kBK, hi_c = pos - j * kBK;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = nt * 8 + t4 * 2 + e;
          if (c < lo_c || c > hi_c) s[nt][e] = s[nt][2 + e] = -INFINITY;
        }
    }
    // Online softmax per row (half hf holds elements 2 hf, 2 hf + 1), as attention_fwd.
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * hf], s[nt][2 * hf + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mn = fmaxf(m[hf], mx);
      const float ms = mn == -INFINITY ? 0.f : mn * sl2;
      const float al = fast_exp2(m[hf] * sl2 - ms);
      m[hf] = mn;
      float ps = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        s[nt][2 * hf] = fast_exp2(s[nt][2 * hf] * sl2 - ms);
        s[nt][2 * hf + 1] = fast_exp2(s[nt][2 * hf + 1] * sl2 - ms);
        ps += s[nt][2 * hf] + s[nt][2 * hf + 1];
      }
      l[hf] = l[hf] * al + ps;
#pragma unroll
      for (int i = 0; i < DT; ++i) {
        acc[i][2 * hf] *= al;
        acc[i][2 * hf + 1] *= al;
      }
    }
    // O += P V
#pragma unroll
    for (int jj = 0; jj < kBK / 16; ++jj) {
      uint32_t pa[4];
      if constexpr (FP8) {
        pa[0] = pack_f16(s[2 * jj][0], s[2 * jj][1]);
        pa[1] = pack_f16(s[2 * jj][2], s[2 * jj][3]);
        pa[2] = pack_f16(s[2 * jj + 1][0], s[2 * jj + 1][1]);
        pa[3] = pack_f16(s[2 * jj + 1][2], s[2 * jj + 1][3]);
        pv_fp8<D>(acc, pa, Vc, jj);
        continue;
      }
      pa[0] = pack_bf16(s[2 * jj][0], s[2 * jj][1]);
      pa[1] = pack_bf16(s[2 * jj][2], s[2 * jj][3]);
      pa[2] = pack_bf16(s[2 * jj + 1][0], s[2 * jj + 1][1]);
      pa[3] = pack_bf16(s[2 * jj + 1][2], s[2 * jj + 1][3]);
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t b[4];
        frag_b_kn<D>(b, Vb, jj * 16, dp * 16);
        mma16816(acc[2 * dp], pa, b[0], b[1]);
        mma16816(acc[2 * dp + 1], pa, b[2], b[3]);
      }
    }
    __syncwarp();  // the next iteration's loads overwrite this buffer
  }
  cp_wait<0>();
  if constexpr (FP8) {  // the value scale: o = vs sum p code / sum p
#pragma unroll
    for (int i = 0; i < DT; ++i) acc[i][0] *= vs, acc[i][1] *= vs, acc[i][2] *= vs, acc[i][3] *= vs;
  }

  if constexpr (WARPS > 1) {
    combine_in_block<D, WARPS, FP8>(a, r, hq0, gn, sl2, acc, m, l, reinterpret_cast<float*>(FP8 ? mem : reinterpret_cast<unsigned char*>(Ks)));
    return;
  }
  const bool direct = tlo / PT == thi / PT;
  const int64_t F = partial_floats(D);
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const float lr = quad_sum(l[hf]);  // the row's sum over its four lanes
    const int g = gid + 8 * hf;
    if (g >= gn) continue;
    if (direct) {
      const float inv = lr > 0.f ? 1.f / lr : 0.f;
      bf16* orow = static_cast<bf16*>(a.o) + r * a.ldo + (hq0 + g) * D;
#pragma unroll
      for (int i = 0; i < DT; ++i) {
        // bf16: pair (acc[i][.], e = 0, 1) is dims 8 i + 2 t4, +1; FP8: (acc[2 b][e], acc[2 b + 1][e])
        // is 16 b + 4 t4 + 2 e, +1 (i = 2 b + e)
        const float v0 = FP8 ? acc[i & ~1][2 * hf + (i & 1)] : acc[i][2 * hf];
        const float v1 = FP8 ? acc[i | 1][2 * hf + (i & 1)] : acc[i][2 * hf + 1];
        *reinterpret_cast<__nv_bfloat162*>(orow + acc_dim<FP8>(FP8 ? i & ~1 : i, FP8 ? i & 1 : 0, t4)) =
            __floats2bfloat162_rn(v0 * inv, v1 * inv);
      }
    } else {
      float* part = a.partials + ((rc * a.Hq + hq0 + g) * Z + z) * F;
#pragma unroll
      for (int i = 0; i < DT; ++i) {  // (the pairs as above)
        const float v0 = FP8 ? acc[i & ~1][2 * hf + (i & 1)] : acc[i][2 * hf];
        const float v1 = FP8 ? acc[i | 1][2 * hf + (i & 1)] : acc[i][2 * hf + 1];
        *reinterpret_cast<float2*>(part + acc_dim<FP8>(FP8 ? i & ~1 : i, FP8 ? i & 1 : 0, t4)) = make_float2(v0, v1);
      }
      if (t4 == 0) {
        part[D] = m[hf] * sc;  // exp2((s - m) sl2) = exp((s - m) sc): natural-log units
        part[D + 1] = lr;
      }
    }
  }
}

// The partitions of each (row, query head), in partition order: grid (rows, Hq), Dv threads.
__global__ void paged_mma_combine_kernel(PagedAttnArgs a, int64_t row0, int64_t PT, int64_t Z) {
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  const int64_t rc = blockIdx.x, r = row0 + rc, h = blockIdx.y, Dv = a.Dv, F = partial_floats(Dv);
  const int64_t pos = a.pos[r];
  const int64_t zlo = first_key(a, pos) / kBK / PT, zhi = pos / kBK / PT;
  if (zlo == zhi) return;  // written directly
  const float* part = a.partials + (rc * a.Hq + h) * Z * F;
  float M = -INFINITY;
  for (int64_t z = zlo; z <= zhi; ++z) M = fmaxf(M, part[z * F + Dv]);
  const int64_t d = threadIdx.x;
  float L = 0.f, v = 0.f;
  for (int64_t z = zlo; z <= zhi; ++z) {
    const float e = __expf(part[z * F + Dv] - M);
    L += part[z * F + Dv + 1] * e;
    v += part[z * F + d] * e;
  }
  static_cast<bf16*>(a.o)[r * a.ldo + h * Dv + d] = __float2bfloat16_rn(v / L);
}

// Tiles of the launch's widest block table.
int64_t table_tiles(const PagedAttnArgs& a) {
  const int64_t width = a.table_width > 0 ? a.table_width : a.ld_blocks;
  return std::max<int64_t>(1, (width * a.bs + kBK - 1) / kBK);
}

int64_t mtiles_of(const PagedAttnArgs& a) { return (a.Hq / a.Hkv + 15) / 16; }

// Rows per launch whose partials at Z partitions fit `bytes`.
int64_t rows_fitting(const PagedAttnArgs& a, int64_t Z, int64_t bytes) {
  const int64_t per_row = a.Hq * Z * partial_floats(a.Dv) * int64_t(sizeof(float));
  return std::max<int64_t>(1, std::min<int64_t>(a.R, bytes / per_row));
}

// Rows of at most this many tiles stay whole when one tile a warp would not fill the GPU anyway:
// one warp per kv head walks the row's tiles double-buffered, instead of one tile a warp and then
// the combine kernel. Off by default (1: split): under ncu (kernels serialised) whole rows looked
// faster at batch 1 (8.4 + 6.0 us a layer split), but in the replayed decoding graphs the split
// launch wins: batch-1 Llama-3.2-1B decoding ran 741 tok/s split against 664 with rows of up to 8
// tiles whole (H100, 2026-12-06, scripts/device_gpu.sh decodeab). RLH_KCUDA_PAGED_MIN_TILES=8
// keeps the A/B.
int64_t min_tiles_per_warp() {
  static const int64_t v = [] {
    const char* e = std::getenv("RLH_KCUDA_PAGED_MIN_TILES");
    return e && *e ? std::max<int64_t>(1, std::atoll(e)) : int64_t(1);
  }();
  return v;
}

// Whether a launch whose partitions fit one block's warps combines them in the block
// (RLH_KCUDA_PAGED_BLOCK_COMBINE=0: through global memory and the combine kernel, the A/B).
bool block_combine() {
  static const bool v = env_switch_on("RLH_KCUDA_PAGED_BLOCK_COMBINE");
  return v;
}

// The warps a block may hold: each has its own Q and double-buffered K/V tiles (smem_bytes).
template <int D, bool FP8>
constexpr int64_t max_block_warps() {
  return std::min<int64_t>(6, int64_t(kMaxBlockSmem / smem_bytes<D, FP8>()));
}

template <int D, int W, bool FP8>
void launch_block(const PagedAttnArgs& a, int64_t mt, int64_t PT, cudaStream_t s) {
  if constexpr (W <= max_block_warps<D, FP8>()) {
    auto kernel = paged_mma_kernel<D, W, FP8>;
    constexpr size_t smem = W * smem_bytes<D, FP8>();
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) != cudaSuccess)
      throw std::runtime_error("paged_attention: cannot raise the shared-memory limit");
    launch_pdl(kernel, dim3(unsigned(a.R), unsigned(a.Hkv * mt), 1u), 32 * W, smem, s, a, int64_t(0), mt, PT,
               int64_t(W));
  } else {
    throw std::logic_error("paged_attention: more partitions than a block holds at this head dim");
  }
}

template <int D, bool FP8>
void launch(const PagedAttnArgs& a, cudaStream_t s) {
  const int64_t tiles = table_tiles(a), mt = mtiles_of(a);
  const int64_t units = a.R * a.Hkv * mt;
  const int64_t fill = (units * tiles + kTargetWarps - 1) / kTargetWarps;  // tiles a warp to fill the GPU
  const bool whole_rows = a.batch_invariant || (2 * units * tiles <= kTargetWarps && tiles <= min_tiles_per_warp());
  const int64_t PT = whole_rows ? tiles : std::clamp<int64_t>(fill, 1, tiles);
  const int64_t Z = (tiles + PT - 1) / PT;
  // In the block only at small batch: batch 1 ran 735-741 tok/s against 729 through global
  // memory, batch 64 29.8K against 31.6K (H100, 2026-12-06: fewer, fatter blocks; decodeab).
  // (D = 128 only when asked for: test_cuda_decode's batch-1 check passed on an H100 on
  // 2026-12-06, but no D = 128 decoding shape has been timed with it.)
  const bool in_block =
      a.block_combine < 0 ? D == 64 && block_combine() && units <= kBlockCombineUnits : a.block_combine != 0;
  if (Z > 1 && Z <= max_block_warps<D, FP8>() && in_block) {
    switch (Z) {
      case 2: launch_block<D, 2, FP8>(a, mt, PT, s); return;
      case 3: launch_block<D, 3, FP8>(a, mt, PT, s); return;
      case 4: launch_block<D, 4, FP8>(a, mt, PT, s); return;
      case 5: launch_block<D, 5, FP8>(a, mt, PT, s); return;
      default: launch_block<D, 6, FP8>(a, mt, PT, s); return;
    }
  }
  if (Z > 65535) throw std::invalid_argument("paged_attention: block tables too wide for the tensor-core kernel");
  if (Z > 1 && !a.partials) throw std::invalid_argument("paged_attention: no workspace for the partitions' partials");
  const int64_t rows = Z == 1 ? a.R : rows_fitting(a, Z, paged_attention_mma_workspace_bytes(a));
  auto kernel = paged_mma_kernel<D, 1, FP8>;
  constexpr size_t smem = smem_bytes<D, FP8>();
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) != cudaSuccess)
    throw std::runtime_error("paged_attention: cannot raise the shared-memory limit");
  for (int64_t r0 = 0; r0 < a.R; r0 += rows) {
    const int64_t n = std::min(rows, a.R - r0);
    launch_pdl(kernel, dim3(unsigned(n), unsigned(a.Hkv * mt), unsigned(Z)), 32, smem, s, a, r0, mt, PT, Z);
    if (Z > 1) launch_pdl(paged_mma_combine_kernel, dim3(unsigned(n), unsigned(a.Hq)), unsigned(D), 0, s, a, r0, PT, Z);
  }
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

bool paged_attention_mma_ok(const PagedAttnArgs& a) {
  if (a.t != DType::bf16 || a.Dk != a.Dv || (a.Dk != 64 && a.Dk != 128) || a.softcap != 0) return false;
  if (a.kc_strides[3] != 1 || a.vc_strides[3] != 1 || !aligned(a.k_cache, 16) || !aligned(a.v_cache, 16))
    return false;
  const int64_t per16 = a.k_scale ? 16 : 8;  // elements of a 16-byte chunk (FP8 codes: bytes)
  for (int i = 0; i < 3; ++i)
    if (a.kc_strides[i] % per16 != 0 || a.vc_strides[i] % per16 != 0) return false;
  return aligned(a.q, 16) && a.ldq % 8 == 0 && aligned(a.o, 4) && a.ldo % 2 == 0;
}

int64_t paged_attention_mma_workspace_bytes(const PagedAttnArgs& a) {
  const int64_t Z = table_tiles(a);  // the most partitions a launch can choose (one tile each)
  if (Z == 1 || a.R == 0 || a.batch_invariant) return 0;
  return rows_fitting(a, Z, kChunkBytes) * a.Hq * Z * partial_floats(a.Dv) * int64_t(sizeof(float));
}

void paged_attention_mma(const PagedAttnArgs& a, cudaStream_t s) {
  if (a.R == 0) return;
  const bool fp8 = a.k_scale != nullptr;
  if (a.Dk == 64)
    fp8 ? launch<64, true>(a, s) : launch<64, false>(a, s);
  else
    fp8 ? launch<128, true>(a, s) : launch<128, false>(a, s);
  check_launch("paged_attention (mma)");
}

}  // namespace rlh::kcuda
