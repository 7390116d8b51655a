// The decode ops on the GPU (docs/ops.md): kv_cache_write, paged_attention and sample, what a
// generator on a CUDA device needs beside the engine's ops. First versions, written for
// correctness against kernels_cpu (tests/kernels_cuda) rather than peak speed; what limits them
// is said at each kernel.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <cuda_fp8.h>

#include "common.cuh"
#include "rope_math.cuh"

namespace rlh::kcuda {

namespace {

// ---------------------------------------------------------------------------------------------
// kv_cache_write: row r's keys and values into its slot (block slot / bs, offset slot % bs).

// The slot's block and offset; false for a padding row (-1) and for a slot outside the cache
// (which also sets the error flag).
__device__ __forceinline__ bool slot_place(const KvWriteArgs& a, int32_t slot, int64_t& b, int64_t& off) {
  if (slot < 0) return false;
  b = slot / a.bs;
  off = slot % a.bs;
  if (b >= a.num_blocks) {
    if (threadIdx.x == 0 && a.err) atomicExch(a.err, 1);
    return false;
  }
  return true;
}

template <class T>
__global__ void kv_write_kernel(KvWriteArgs a) {
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  const int64_t r = blockIdx.x;
  int64_t b, off;
  if (!slot_place(a, a.slots[r], b, off)) return;  // a padding row: nothing to store
  const T* k = static_cast<const T*>(a.k) + r * a.ldk;
  const T* v = static_cast<const T*>(a.v) + r * a.ldv;
  T* kc = static_cast<T*>(a.k_cache) + b * a.kc_strides[0] + off * a.kc_strides[2];
  T* vc = static_cast<T*>(a.v_cache) + b * a.vc_strides[0] + off * a.vc_strides[2];
  for (int64_t i = threadIdx.x; i < a.Hkv * a.Dk; i += blockDim.x) {
    const int64_t h = i / a.Dk, d = i % a.Dk;
    kc[h * a.kc_strides[1] + d * a.kc_strides[3]] = k[h * a.Dk + d];
  }
  for (int64_t i = threadIdx.x; i < a.Hkv * a.Dv; i += blockDim.x) {
    const int64_t h = i / a.Dv, d = i % a.Dv;
    vc[h * a.vc_strides[1] + d * a.vc_strides[3]] = v[h * a.Dv + d];
  }
}

// 8 values' e4m3 codes of x / s as 8 bytes, each the code kv_write_fp8_kernel writes (the same
// conversion of the same quotient).
__device__ __forceinline__ uint2 fp8_codes8(const uint4& u, float s) {
  const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&u);
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h2[k]);
    const uint32_t c0 = __nv_cvt_float_to_fp8(f.x / s, __NV_SATFINITE, __NV_E4M3);
    const uint32_t c1 = __nv_cvt_float_to_fp8(f.y / s, __NV_SATFINITE, __NV_E4M3);
    w[k / 2] |= (c0 | (c1 << 8)) << (16 * (k % 2));
  }
  return make_uint2(w[0], w[1]);
}

// The same for bf16 rows whose head dims are contiguous and 16-byte aligned: 8 values a thread,
// with 32-bit index math (the scalar kernel's 64-bit divisions per value made a write of one
// row's 1024 values take ~6 us, a tenth of a batch-1 layer). FP8: into e4m3 caches, their
// 8 codes stored as 8 bytes (kv_write_fp8_kernel below takes the rest).
template <bool FP8>
__global__ void kv_write_vec_kernel(KvWriteArgs a) {
  // The slot, which no kernel of a step writes (uploaded; docs/kernels_cuda.md "pdl_wait"), is
  // read before pdl_wait (and an FP8 cache's scales: uploaded once, never a step's output); the
  // keys and values, which the kernels before write, after it.
  const int64_t r = blockIdx.x;
  const int32_t slot = a.slots[r];
  const float ks = FP8 ? *a.k_scale : 1.f, vs = FP8 ? *a.v_scale : 1.f;
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  int64_t b, off;
  if (!slot_place(a, slot, b, off)) return;
  using C = std::conditional_t<FP8, uint8_t, bf16>;  // the cache's element
  const int dk8 = int(a.Dk / 8), dv8 = int(a.Dv / 8), nk = int(a.Hkv) * dk8, nv = int(a.Hkv) * dv8;
  const bf16* k = static_cast<const bf16*>(a.k) + r * a.ldk;
  const bf16* v = static_cast<const bf16*>(a.v) + r * a.ldv;
  C* kc = static_cast<C*>(a.k_cache) + b * a.kc_strides[0] + off * a.kc_strides[2];
  C* vc = static_cast<C*>(a.v_cache) + b * a.vc_strides[0] + off * a.vc_strides[2];
  // 8 values: a 16-byte copy, or (FP8) their 8 codes as 8 bytes.
  const auto put = [](C* dst, const bf16* src, float s) {
    const uint4 u = *reinterpret_cast<const uint4*>(src);
    if constexpr (FP8) *reinterpret_cast<uint2*>(dst) = fp8_codes8(u, s);
    else *reinterpret_cast<uint4*>(dst) = u;
  };
  for (int i = threadIdx.x; i < nk + nv; i += blockDim.x) {
    if (i < nk) {
      const int h = i / dk8, d = (i - h * dk8) * 8;
      put(kc + h * a.kc_strides[1] + d, k + h * a.Dk + d, ks);
    } else {
      const int j = i - nk, h = j / dv8, d = (j - h * dv8) * 8;
      put(vc + h * a.vc_strides[1] + d, v + h * a.Dv + d, vs);
    }
  }
}

// rope_kv_cache_write in one launch (bf16 rows, half-split, 8-value chunks): a block a row. Its
// pairs' cos and sin go to shared memory before pdl_wait (positions and frequencies are uploaded),
// as the slot and an FP8 cache's scales; then each thread rotates a chunk pair of a query or key
// head (rope_vec_kernel's arithmetic: rope_math.cuh) and stores it, a key head's chunks also into
// the cache from its registers (kv_write_vec_kernel's stores), and the value heads are copied
// into their cache. Why: at batch 1 the RoPE and the cache write were two launches of a few
// microseconds a layer, each waiting for the one before.
template <bool FP8>
__global__ void __launch_bounds__(256) rope_kv_write_kernel(RopeKvArgs a) {
  extern __shared__ float csn[];  // [half] cos, then [half] sin
  const int64_t r = blockIdx.x, half = a.rot / 2;
  const int32_t p = a.pos[r], slot = a.kv.slots[r];
  const float ks = FP8 ? *a.kv.k_scale : 1.f, vs = FP8 ? *a.kv.v_scale : 1.f;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x)
    rope_cos_sin(a.inv_freq, i, p, float(a.scale), 1.f, csn[i], csn[half + i]);
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  __syncthreads();
  int64_t b = 0, off = 0;
  const bool store = slot_place(a.kv, slot, b, off);
  using C = std::conditional_t<FP8, uint8_t, bf16>;  // the cache's element
  const int D = int(a.kv.Dk), dv8 = int(a.kv.Dv / 8), Hq = int(a.Hq), Hkv = int(a.kv.Hkv);
  const int pairs8 = int(half / 8), copies8 = int((D - a.rot) / 8), per_head = pairs8 + copies8;
  const int nqk = (Hq + Hkv) * per_head, nv = Hkv * dv8;
  const bf16* x = static_cast<const bf16*>(a.x) + r * a.ldx;
  bf16* y = static_cast<bf16*>(a.y) + r * a.ldy;
  const bool in_place = a.x == a.y && a.ldx == a.ldy;
  C* kc = static_cast<C*>(a.kv.k_cache) + b * a.kv.kc_strides[0] + off * a.kv.kc_strides[2];
  C* vc = static_cast<C*>(a.kv.v_cache) + b * a.kv.vc_strides[0] + off * a.kv.vc_strides[2];
  const auto put = [](C* dst, const uint4& u, float s) {
    if constexpr (FP8) *reinterpret_cast<uint2*>(dst) = fp8_codes8(u, s);
    else *reinterpret_cast<uint4*>(dst) = u;
  };
  for (int it = threadIdx.x; it < nqk + nv; it += blockDim.x) {
    if (it < nqk) {
      const int h = it / per_head, c = it - h * per_head;
      const bool key = h >= Hq;
      C* kh = kc + (h - Hq) * a.kv.kc_strides[1];
      if (c < pairs8) {
        const int d0 = c * 8, d1 = d0 + int(half);
        uint4 ua = *reinterpret_cast<const uint4*>(x + h * D + d0), ub = *reinterpret_cast<const uint4*>(x + h * D + d1);
        bf16* va = reinterpret_cast<bf16*>(&ua);
        bf16* vb = reinterpret_cast<bf16*>(&ub);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          float ya, yb;
          rope_rotate(__bfloat162float(va[e]), __bfloat162float(vb[e]), csn[d0 + e], csn[half + d0 + e], ya, yb);
          va[e] = __float2bfloat16_rn(ya);
          vb[e] = __float2bfloat16_rn(yb);
        }
        *reinterpret_cast<uint4*>(y + h * D + d0) = ua;
        *reinterpret_cast<uint4*>(y + h * D + d1) = ub;
        if (key && store) {
          put(kh + d0, ua, ks);
          put(kh + d1, ub, ks);
        }
      } else {  // dims past the rotary ones: copied
        const int d = int(a.rot) + (c - pairs8) * 8;
        const uint4 u = *reinterpret_cast<const uint4*>(x + h * D + d);
        if (!in_place) *reinterpret_cast<uint4*>(y + h * D + d) = u;
        if (key && store) put(kh + d, u, ks);
      }
    } else if (store) {
      const int j = it - nqk, h = j / dv8, d = (j - h * dv8) * 8;
      put(vc + h * a.kv.vc_strides[1] + d,
          *reinterpret_cast<const uint4*>(static_cast<const bf16*>(a.kv.v) + r * a.kv.ldv + h * a.kv.Dv + d), vs);
    }
  }
}

// The same into FP8 e4m3 caches: each value's code of x / scale (docs/ops.md: nearest even,
// finite values past 448 saturate, NaN stays NaN: cuda_fp8's SATFINITE conversion). The scales
// are read before pdl_wait (uploaded once, never a step's output), as the slot. bf16 rows. A code
// a thread: for rows and caches the vector form (kv_write_vec_kernel<true>, 8 values a thread)
// does not take; it took 7.5 us a layer at batch 256 of Llama-3.2-1B against 4.0 for the bf16
// cache's vector write (ncu, H100, 2026-12-06).
__global__ void kv_write_fp8_kernel(KvWriteArgs a) {
  const int64_t r = blockIdx.x;
  const int32_t slot = a.slots[r];
  const float ks = *a.k_scale, vs = *a.v_scale;
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  int64_t b, off;
  if (!slot_place(a, slot, b, off)) return;
  const bf16* k = static_cast<const bf16*>(a.k) + r * a.ldk;
  const bf16* v = static_cast<const bf16*>(a.v) + r * a.ldv;
  uint8_t* kc = static_cast<uint8_t*>(a.k_cache) + b * a.kc_strides[0] + off * a.kc_strides[2];
  uint8_t* vc = static_cast<uint8_t*>(a.v_cache) + b * a.vc_strides[0] + off * a.vc_strides[2];
  const int dk = int(a.Dk), dv = int(a.Dv), nk = int(a.Hkv) * dk, nv = int(a.Hkv) * dv;  // (< 2^31: checked)
  for (int i = threadIdx.x; i < nk + nv; i += blockDim.x) {
    if (i < nk) {
      const int h = i / dk, d = i - h * dk;
      kc[h * a.kc_strides[1] + d * a.kc_strides[3]] =
          __nv_cvt_float_to_fp8(__bfloat162float(k[h * dk + d]) / ks, __NV_SATFINITE, __NV_E4M3);
    } else {
      const int j = i - nk, h = j / dv, d = j - h * dv;
      vc[h * a.vc_strides[1] + d * a.vc_strides[3]] =
          __nv_cvt_float_to_fp8(__bfloat162float(v[h * dv + d]) / vs, __NV_SATFINITE, __NV_E4M3);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// paged_attention, split over the keys (flash-decoding). The keys of a row are cut into
// partitions of kPaPart = 128 absolute positions (partition z holds positions [128 z, 128 z + 128)
// within the row's causal / window range); one block of 4 warps computes one (row, kv head,
// partition), each warp one 32-key tile with a key per lane, and every query head of that kv
// head at once (up to 8 per block), so a key and value are read once per kv head, not once per
// query head. Each lane dots its key with the group's queries (kept in shared memory), the warp
// takes the tile's max and weights, then walks the tile's 32 values with the lanes over the head
// dims, loading them ahead in batches. The warps are combined in warp order. A row whose range
// lies in one partition writes its output there; longer rows write partials that a second
// kernel combines in partition order. Blocks of partitions a row does not reach exit at once.
//
// Why this shape: the first kernel (one block per query head, one key per warp step, a chain of
// dependent loads and shuffles per key) was latency-bound, ~50 us a layer at batch 1, the
// largest cost of a decoding step. Here every lane has its own key in flight and a batch-1 step
// still spreads over Hkv x ceil(context / 128) blocks. Each block is a short chain of dependent
// loads, so what hides their latency is many blocks at once: registers matter more than work
// per block. (256-key partitions of 8 warps, loading 16 values ahead, took 126 registers and
// measured 20% slower at batch 256 on the H200.)
//
// Batch invariance: the partitions are fixed in absolute positions and combined in a fixed
// order over the row's own partitions, and the direct write computes exactly what the combine
// does for one partition (its weight is expf(0) = 1). So a row's output depends on its position,
// window and cache only, never on the other rows, the launch's widest table or how rows were
// chunked (a sequence decoded in a batch equals itself decoded alone, bitwise).

constexpr int kPaWarps = 4;
constexpr int kPaPart = 32 * kPaWarps;  // keys per partition: one 32-key tile per warp
constexpr int kPaHeads = 8;             // query heads per block (a kv head's group, in pieces of 8)
constexpr int kPaMaxD = 256;
constexpr int64_t kPaChunkBytes = int64_t(16) << 20;  // partials of one launch's rows at most

// The partials' floats per (row, query head, partition): the unnormalised output, then max and sum.
__host__ __device__ inline int64_t pa_partial_floats(int64_t Dv) { return Dv + 2; }

inline int64_t pa_partitions(const PagedAttnArgs& a) {
  const int64_t width = a.table_width > 0 ? a.table_width : a.ld_blocks;
  return std::max<int64_t>(1, (width * a.bs + kPaPart - 1) / kPaPart);
}

// Rows per launch so that their partials fit kPaChunkBytes.
inline int64_t pa_rows_per_launch(const PagedAttnArgs& a, int64_t Z) {
  const int64_t per_row = a.Hq * Z * pa_partial_floats(a.Dv) * int64_t(sizeof(float));
  return std::max<int64_t>(1, std::min<int64_t>(a.R, kPaChunkBytes / per_row));
}

// The first key a row at `pos` sees: HF's sliding window keeps p - W + 1 .. p.
__device__ __forceinline__ int64_t pa_first_key(const PagedAttnArgs& a, int64_t pos) {
  return a.window > 0 && pos - a.window + 1 > 0 ? pos - a.window + 1 : 0;
}

// Whether row r's keys (causal, within its window) lie in one partition.
__device__ __forceinline__ bool pa_one_partition(const PagedAttnArgs& a, int64_t r) {
  const int64_t pos = a.pos[r];
  return pa_first_key(a, pos) / kPaPart == pos / kPaPart;
}

// Loads 8 consecutive bf16 (16-byte aligned) as floats.
__device__ __forceinline__ void load8_bf16(const bf16* p, float f[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __bfloat1622float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

// Loads NV consecutive bf16 (aligned to their size) as floats.
template <int NV>
__device__ __forceinline__ void loadn_bf16(const bf16* p, float f[NV]) {
  if constexpr (NV == 8) {
    load8_bf16(p, f);
  } else if constexpr (NV == 4) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
    const float2 x = __bfloat1622float2(h[0]), y = __bfloat1622float2(h[1]);
    f[0] = x.x, f[1] = x.y, f[2] = y.x, f[3] = y.y;
  } else if constexpr (NV == 2) {
    const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
    f[0] = x.x, f[1] = x.y;
  } else {
    f[0] = __bfloat162float(*p);
  }
}

// The head dim that lane `lane`'s k-th value slot holds: contiguous per lane with vector loads,
// interleaved (coalesced scalar loads) otherwise.
template <int NV, bool VEC>
__device__ __forceinline__ int pa_dim(int lane, int k) {
  return VEC ? lane * NV + k : lane + 32 * k;
}

// grid (rows, Hkv * groups, partitions); rows row0 .. row0 + gridDim.x of the launch. WIDE:
// value rows loaded ahead in larger batches (small launches: fewer round trips per tile, at
// more registers, which large launches pay for in occupancy). The sums are the same either way.
// CAP: Gemma-2's soft-capping compiled in only where asked (an uncapped launch keeps its
// registers and its speed).
template <class T, int NV, bool VEC, bool WIDE, bool CAP>
__global__ void __launch_bounds__(32 * kPaWarps) paged_attention_kernel(PagedAttnArgs a, int64_t row0,
                                                                        int64_t groups, int64_t Z) {
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  const int64_t r = row0 + blockIdx.x, rc = blockIdx.x;
  const int64_t G = a.Hq / a.Hkv, hk = blockIdx.y / groups, g0 = (blockIdx.y % groups) * kPaHeads;
  const int gn = int(G - g0 < kPaHeads ? G - g0 : kPaHeads);  // query heads of this block
  const int64_t hq0 = hk * G + g0;
  const int64_t z = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t pos = a.pos[r];
  const int64_t lo = pa_first_key(a, pos);
  // a partition this row does not reach: nothing (the combine reads only the row's own)
  if (z < lo / kPaPart || z > pos / kPaPart) return;
  // this warp's tile: positions [t0, t0 + 32) within [lo, pos]
  const int64_t t0 = z * kPaPart + int64_t(warp) * 32;
  const int64_t first = t0 > lo ? t0 : lo, last = t0 + 31 < pos ? t0 + 31 : pos;

  __shared__ __align__(16) float qs[kPaHeads][kPaMaxD];
  __shared__ float sm[kPaWarps][kPaHeads], sl[kPaWarps][kPaHeads];
  __shared__ float sacc[kPaWarps][kPaHeads][32 * NV];
  if (VEC && a.ldq % 8 == 0 && reinterpret_cast<uintptr_t>(a.q) % 16 == 0) {
    // 8 values a thread: the group's queries in one round of loads (a value at a time was
    // four dependent round trips per block at batch 1)
    const int d8 = int(a.Dk) / 8;
    for (int i = threadIdx.x; i < kPaHeads * d8; i += blockDim.x) {
      const int g = i / d8, d = (i - g * d8) * 8;
      float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (g < gn) load8_bf16(reinterpret_cast<const bf16*>(a.q) + r * a.ldq + (hq0 + g) * a.Dk + d, f);
#pragma unroll
      for (int k = 0; k < 8; ++k) qs[g][d + k] = g < gn ? f[k] * a.scale : 0.f;
    }
  } else {
    for (int i = threadIdx.x; i < kPaHeads * int(a.Dk); i += blockDim.x) {
      const int g = i / int(a.Dk), d = i % int(a.Dk);
      qs[g][d] = g < gn ? to_f(static_cast<const T*>(a.q)[r * a.ldq + (hq0 + g) * a.Dk + d]) * a.scale : 0.f;
    }
  }
  __syncthreads();

  float m[kPaHeads], l[kPaHeads], acc[kPaHeads][NV];
#pragma unroll
  for (int g = 0; g < kPaHeads; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k) acc[g][k] = 0.f;
  }
  if (first <= last) {
    const int64_t p = t0 + lane;
    const bool valid = p >= first && p <= last;
    int32_t blk = 0, off = 0;
    if (valid) {
      blk = a.blocks[r * a.ld_blocks + p / a.bs];
      off = int32_t(p % a.bs);
    }
    // scores of this lane's key against every query head of the group
    float s[kPaHeads];
#pragma unroll
    for (int g = 0; g < kPaHeads; ++g) s[g] = 0.f;
    if (valid) {
      const T* kr = static_cast<const T*>(a.k_cache) + blk * a.kc_strides[0] + hk * a.kc_strides[1] +
                    off * a.kc_strides[2];
      if constexpr (VEC) {
#pragma unroll 4
        for (int64_t c = 0; c < a.Dk; c += 8) {
          float kf[8];
          load8_bf16(reinterpret_cast<const bf16*>(kr) + c, kf);
#pragma unroll
          for (int g = 0; g < kPaHeads; ++g) {
            if (g >= gn) break;
            const float4 qa = *reinterpret_cast<const float4*>(&qs[g][c]);
            const float4 qb = *reinterpret_cast<const float4*>(&qs[g][c + 4]);
            s[g] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4] + qb.y * kf[5] +
                    qb.z * kf[6] + qb.w * kf[7];
          }
        }
      } else {
        for (int64_t d = 0; d < a.Dk; ++d) {
          const float kf = to_f(kr[d * a.kc_strides[3]]);
#pragma unroll
          for (int g = 0; g < kPaHeads; ++g)
            if (g < gn) s[g] += qs[g][d] * kf;
        }
      }
    }
    // the tile's online-softmax update (one tile per warp: m starts at -inf)
    float w[kPaHeads];
#pragma unroll
    for (int g = 0; g < kPaHeads; ++g) {
      const float sg = valid ? soft_cap_if<CAP>(s[g], a.softcap) : -INFINITY;
      m[g] = warp_max(sg);
      w[g] = valid ? __expf(sg - m[g]) : 0.f;
      l[g] = w[g];
    }
    // the values: lanes over the head dims, keys of the tile in order, UB rows loaded ahead
    // (their loads in flight together: one at a time left the loop latency-bound)
    constexpr int UB = NV >= 8 ? 4 : WIDE && NV <= 2 ? 16 : 8;
    const int nk = int(last - t0 + 1);
    for (int jb = int(first - t0); jb < nk; jb += UB) {
      float vf[UB][NV];
#pragma unroll
      for (int u = 0; u < UB; ++u) {
        const int j = jb + u < nk ? jb + u : nk - 1;  // past the tile: reload the last row, weight unused
        const int32_t vb = __shfl_sync(0xffffffffu, blk, j), vo = __shfl_sync(0xffffffffu, off, j);
        const T* vr = static_cast<const T*>(a.v_cache) + vb * a.vc_strides[0] + hk * a.vc_strides[1] +
                      vo * a.vc_strides[2];
        if constexpr (VEC) {
          loadn_bf16<NV>(reinterpret_cast<const bf16*>(vr) + lane * NV, vf[u]);
        } else {
#pragma unroll
          for (int k = 0; k < NV; ++k) {
            const int d = pa_dim<NV, VEC>(lane, k);
            vf[u][k] = d < a.Dv ? to_f(vr[d * a.vc_strides[3]]) : 0.f;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < UB; ++u) {
        if (jb + u >= nk) break;
#pragma unroll
        for (int g = 0; g < kPaHeads; ++g) {
          if (g >= gn) break;
          const float wj = __shfl_sync(0xffffffffu, w[g], jb + u);
#pragma unroll
          for (int k = 0; k < NV; ++k) acc[g][k] += wj * vf[u][k];
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kPaHeads; ++g) l[g] = warp_sum(l[g]);
  }
  // the warps, in warp order
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < kPaHeads; ++g) {
      sm[warp][g] = m[g];
      sl[warp][g] = l[g];
    }
  }
#pragma unroll
  for (int g = 0; g < kPaHeads; ++g)
#pragma unroll
    for (int k = 0; k < NV; ++k) sacc[warp][g][pa_dim<NV, VEC>(lane, k)] = acc[g][k];
  __syncthreads();
  const int64_t F = pa_partial_floats(a.Dv);
  // one partition: the output itself, no partials (worked out again here rather than kept
  // live through the kernel: registers decide how many blocks run at once)
  const bool direct = pa_one_partition(a, r);
  for (int i = threadIdx.x; i < gn * int(a.Dv); i += blockDim.x) {
    const int g = i / int(a.Dv), d = i % int(a.Dv);
    float M = -INFINITY;
    for (int wi = 0; wi < kPaWarps; ++wi) M = fmaxf(M, sm[wi][g]);
    float L = 0.f, v = 0.f;
    for (int wi = 0; wi < kPaWarps; ++wi) {
      if (sm[wi][g] == -INFINITY) continue;  // an empty tile adds nothing, not even a +0
      const float e = __expf(sm[wi][g] - M);
      L += sl[wi][g] * e;
      v += sacc[wi][g][d] * e;
    }
    if (direct) {
      static_cast<T*>(a.o)[r * a.ldo + (hq0 + g) * a.Dv + d] = from_f<T>(v / L);
    } else {
      float* part = a.partials + ((rc * a.Hq + hq0 + g) * Z + z) * F;
      part[d] = v;
      if (d == 0) {
        part[a.Dv] = M;
        part[a.Dv + 1] = L;
      }
    }
  }
}

// The partitions of each (row, query head), in partition order: grid (rows, Hq). The
// partitions' maxima and sums are read once into shared memory, kPaCombineZ at a time, by as many
// threads (a thread walking them alone was three chains of dependent loads, ~15 us a layer at
// batch 256); the sums then run in partition order exactly as before, so the output is bitwise
// the same.
constexpr int kPaCombineZ = 128;

template <class T>
__global__ void paged_combine_kernel(PagedAttnArgs a, int64_t row0, int64_t Z) {
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  const int64_t rc = blockIdx.x, r = row0 + rc, h = blockIdx.y, F = pa_partial_floats(a.Dv);
  if (pa_one_partition(a, r)) return;  // written directly by the first kernel
  const int64_t pos = a.pos[r];
  const int64_t lo = pa_first_key(a, pos);
  const int64_t zlo = lo / kPaPart, zhi = pos / kPaPart;
  const float* part = a.partials + (rc * a.Hq + h) * Z * F;
  __shared__ float sm[kPaCombineZ], sl[kPaCombineZ], se[kPaCombineZ];
  __shared__ float sL;
  // the maximum over the row's partitions
  float M = -INFINITY;
  for (int64_t z0 = zlo; z0 <= zhi; z0 += kPaCombineZ) {
    const int64_t n = zhi - z0 + 1 < kPaCombineZ ? zhi - z0 + 1 : kPaCombineZ;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sm[i] = part[(z0 + i) * F + a.Dv];
    __syncthreads();
    for (int64_t i = 0; i < n; ++i) M = fmaxf(M, sm[i]);
    __syncthreads();
  }
  float L = 0.f;
  float v[2] = {0.f, 0.f};  // head dims threadIdx.x and threadIdx.x + blockDim.x (Dv <= 256)
  for (int64_t z0 = zlo; z0 <= zhi; z0 += kPaCombineZ) {
    const int64_t n = zhi - z0 + 1 < kPaCombineZ ? zhi - z0 + 1 : kPaCombineZ;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const float m = part[(z0 + i) * F + a.Dv];
      sm[i] = m;
      sl[i] = part[(z0 + i) * F + a.Dv + 1];
      se[i] = m != -INFINITY ? expf(m - M) : 0.f;
    }
    __syncthreads();
    if (threadIdx.x == 0)
      for (int64_t i = 0; i < n; ++i)
        if (sm[i] != -INFINITY) L += sl[i] * se[i];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int64_t d = threadIdx.x + int64_t(k) * blockDim.x;
      if (d >= a.Dv) continue;
      for (int64_t i = 0; i < n; ++i)
        if (sm[i] != -INFINITY) v[k] += part[(z0 + i) * F + d] * se[i];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) sL = L;
  __syncthreads();
  L = sL;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int64_t d = threadIdx.x + int64_t(k) * blockDim.x;
    if (d < a.Dv) static_cast<T*>(a.o)[r * a.ldo + h * a.Dv + d] = from_f<T>(v[k] / L);
  }
}

// ---------------------------------------------------------------------------------------------
// sample: one block per row. The kept set is kernels_cpu's (min_p, then top_k's k-th largest
// value with ties kept, then top_p's smallest kept value): each threshold is found by a binary
// search over the order-preserving 32-bit keys of the floats (32 passes over the row, counts or
// masses reduced over the block), which needs no sort. The draw walks the kept weights in id
// order: per-thread contiguous chunks, their sums scanned in thread order. Loads are float4 and
// streamed (no early exits) where the row allows: one block per row was latency-bound, about
// 200 us for a row of 128K logits, a tenth of a batch-1 decoding step.

constexpr int kSampleThreads = 512;

__device__ __forceinline__ uint32_t key_of(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float value_of(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

template <class T>
__device__ T block_reduce_sum(T v, T* sh) {
  return block_sum(v, sh);
}

__device__ float block_reduce_max(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  float r = -INFINITY;
  for (int i = 0; i < nw; ++i) r = fmaxf(r, sh[i]);
  return r;
}

// A row's z = logits * inv_t (the logits capped first with CAP: the threshold searches' 32
// passes would otherwise pay tanh on every one), each id once, in id order per thread: strided over the block
// (coalesced; float4 when the row allows), or over this thread's contiguous chunk [b, e).
template <bool CAP, class F>
__device__ __forceinline__ void strided_each(const float* row, int64_t V, bool vec, float inv_t, float cap, F&& f) {
  const int t = threadIdx.x, T = blockDim.x;
  if (vec) {
#pragma unroll 4
    for (int64_t q = t; q < V / 4; q += T) {
      const float4 x = *reinterpret_cast<const float4*>(row + 4 * q);
      f(4 * q, soft_cap_if<CAP>(x.x, cap) * inv_t);
      f(4 * q + 1, soft_cap_if<CAP>(x.y, cap) * inv_t);
      f(4 * q + 2, soft_cap_if<CAP>(x.z, cap) * inv_t);
      f(4 * q + 3, soft_cap_if<CAP>(x.w, cap) * inv_t);
    }
  } else {
    for (int64_t j = t; j < V; j += T) f(j, soft_cap_if<CAP>(row[j], cap) * inv_t);
  }
}
template <bool CAP, class F>
__device__ __forceinline__ void chunk_each(const float* row, int64_t b, int64_t e, bool vec, float inv_t, float cap,
                                           F&& f) {
  if (vec) {  // b and e multiples of 4 (the chunk is; V is)
#pragma unroll 4
    for (int64_t j = b; j < e; j += 4) {
      const float4 x = *reinterpret_cast<const float4*>(row + j);
      f(j, soft_cap_if<CAP>(x.x, cap) * inv_t);
      f(j + 1, soft_cap_if<CAP>(x.y, cap) * inv_t);
      f(j + 2, soft_cap_if<CAP>(x.z, cap) * inv_t);
      f(j + 3, soft_cap_if<CAP>(x.w, cap) * inv_t);
    }
  } else {
    for (int64_t j = b; j < e; ++j) f(j, soft_cap_if<CAP>(row[j], cap) * inv_t);
  }
}

// Exclusive prefix sum of one double per thread, in thread order (deterministic).
__device__ double block_exclusive_scan(double v, double* sh32) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();
  if (lane == 31) sh32[warp] = x;
  __syncthreads();
  double before = 0;
  for (int i = 0; i < warp; ++i) before += sh32[i];
  return before + x - v;
}

template <bool CAP>
__global__ void sample_kernel(SampleArgs a) {
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  __shared__ double shd[32];
  __shared__ float shf[32];
  const int64_t row = blockIdx.x, V = a.V;
  const float* logits = a.logits + row * a.ld;
  const bool greedy = a.temperature == 0.0;
  const float inv_t = greedy ? 1.f : float(1.0 / a.temperature);
  const float cap = a.softcap;
  const int t = threadIdx.x, T = blockDim.x;
  // float4 loads: V and the row stride multiples of 4, rows 16-byte aligned
  const bool vec = V % 4 == 0 && a.ld % 4 == 0 && reinterpret_cast<uintptr_t>(a.logits) % 16 == 0;
  // max of z = logits * inv_t, its lowest id (greedy's token), and whether any is NaN or infinite
  float mx = -INFINITY;
  int64_t first = V;
  int bad = 0;
  strided_each<CAP>(logits, V, vec, inv_t, cap, [&](int64_t j, float z) {
    bad |= !isfinite(z);
    if (z > mx) {  // ids come in increasing order per thread: the first of equal maxima stays
      mx = z;
      first = j;
    }
  });
  const float my_mx = mx;
  mx = block_reduce_max(mx, shf);
  const double nbad = block_reduce_sum<double>(double(bad), shd);
  if (nbad > 0) {  // broken weights must not sample quietly: no token
    if (t == 0) {
      a.tokens[row] = -1;
      a.logprobs[row] = NAN;
    }
    return;
  }
  auto z_of = [&](int64_t j) { return soft_cap_if<CAP>(logits[j], cap) * inv_t; };
  float tau = -INFINITY;
  if (!greedy) {
    if (a.min_p > 0) tau = mx + float(log(a.min_p));
    // z' = z, or -inf below min_p's cut, is what top-k / top-p see
    uint32_t kcut = 0;  // top-k's threshold key (0: none)
    if (a.top_k > 0 && a.top_k < V) {
      // smallest key c with count(key > c) < k: the k-th largest value (ties kept)
      uint32_t lo = 0, hi = 0xffffffffu;
      while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        double n = 0;
        strided_each<CAP>(logits, V, vec, inv_t, cap, [&](int64_t, float z) { n += key_of(z < tau ? -INFINITY : z) > mid ? 1.0 : 0.0; });
        n = block_reduce_sum<double>(n, shd);
        if (n < double(a.top_k)) hi = mid; else lo = mid + 1;
      }
      kcut = lo;
      tau = fmaxf(tau, value_of(kcut));
    }
    if (a.top_p < 1.0) {
      // over the top-k set: total mass, then the smallest key c with mass(key > c) < p total
      double total = 0;
      strided_each<CAP>(logits, V, vec, inv_t, cap, [&](int64_t, float z0) {
        const float z = z0 < tau ? -INFINITY : z0;
        if (key_of(z) >= kcut && z != -INFINITY) total += exp(double(z - mx));
      });
      total = block_reduce_sum<double>(total, shd);
      uint32_t lo = 0, hi = 0xffffffffu;
      while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        double mass = 0;
        strided_each<CAP>(logits, V, vec, inv_t, cap, [&](int64_t, float z0) {
          const float z = z0 < tau ? -INFINITY : z0;
          const uint32_t k = key_of(z);
          if (k >= kcut && k > mid && z != -INFINITY) mass += exp(double(z - mx));
        });
        mass = block_reduce_sum<double>(mass, shd);
        if (mass < a.top_p * total) hi = mid; else lo = mid + 1;
      }
      tau = fmaxf(tau, value_of(lo));
    }
  }
  // kept weights, their float sum, the log-sum-exp; thread t's ids are the chunk [b, e)
  int64_t chunk = (V + T - 1) / T;
  if (vec) chunk = (chunk + 3) / 4 * 4;
  const int64_t b = t * chunk < V ? t * chunk : V, e = b + chunk < V ? b + chunk : V;
  float fsum = 0.f;
  double csum = 0;
  chunk_each<CAP>(logits, b, e, vec, inv_t, cap, [&](int64_t, float z) {
    const float w = z >= tau ? __expf(z - mx) : 0.f;
    fsum += w;
    csum += double(w);
  });
  const double total = block_reduce_sum<double>(double(fsum), shd);
  const double lse = double(mx) + log(total);
  if (a.given) {  // score the given id (uniform over the block: every thread returns here)
    if (t == 0) {
      const int32_t g = a.given[row];
      const bool in = g >= 0 && g < V;
      a.tokens[row] = in ? g : -1;
      a.logprobs[row] = !in ? 0.f : z_of(g) >= tau ? float(double(z_of(g)) - lse) : -INFINITY;
    }
    return;
  }
  int64_t tok = -1;
  if (greedy) {
    // the lowest id among equal maxima (block min through the max of -id)
    const float neg = block_reduce_max(my_mx == mx ? -float(first) : -float(V), shf);
    tok = int64_t(-neg);
  } else {
    // inverse CDF in id order: exclusive scan of the chunk sums in thread order
    const double before = block_exclusive_scan(csum, shd);
    const double target = a.u[row] * total;
    __shared__ unsigned long long found;  // the drawn id; all ones: none
    if (t == 0) found = ~0ull;
    __syncthreads();
    double acc = before;
    if (acc <= target && b < e) {
      // this thread's first id where the running sum passes the target (the whole chunk is
      // walked, without an early exit, so its loads stream); the lowest over threads is drawn
      int64_t hit = -1;
      chunk_each<CAP>(logits, b, e, vec, inv_t, cap, [&](int64_t j, float z) {
        const float w = z >= tau ? __expf(z - mx) : 0.f;
        if (w > 0.f) {
          acc += double(w);
          if (hit < 0 && acc > target) hit = j;
        }
      });
      if (hit >= 0) atomicMin(&found, (unsigned long long)hit);
    }
    __syncthreads();
    tok = found == ~0ull ? -1 : int64_t(found);
    if (tok < 0) {  // a target rounded past the end: the last token with weight
      int64_t last = -1;
      for (int64_t j = t; j < V; j += T)
        if (z_of(j) >= tau && j > last) last = j;
      const float l = block_reduce_max(float(last), shf);
      tok = int64_t(l);
    }
  }
  if (t == 0) {
    a.tokens[row] = int32_t(tok);
    a.logprobs[row] = tok >= 0 ? float(double(z_of(tok)) - lse) : NAN;
  }
}

// The plain draw (no top-k, top-p or min-p cut: every weight kept; or greedy) over partitions of
// a row: a grid (S, P) of blocks, each over kSamplePart ids, writes its partition's maximum, the
// lowest id holding it, a non-finite flag and the sum of exp(z - its maximum); one block a row
// then combines them in partition order, picks the partition where u * total falls and walks
// only that partition's ids. Why: one block a row reads 128K logits three times on one SM, ~50 us
// of a batch-1 decoding step (1/3 of a layer's weights' time); partitions spread it over the GPU.
// The partitions are fixed by V alone, so a row's token and logprob do not depend on the other
// rows (batch invariance) or on S.
constexpr int kSamplePart = 4096;
constexpr int kSamplePartThreads = 256;

struct SamplePartial {
  double sum;   // sum over the partition of exp(z - mx), each weight rounded to float first
  float mx;     // the partition's maximum z
  int32_t first;  // its lowest id holding mx
  int32_t bad;  // a non-finite z in the partition
  int32_t pad;
};

inline int64_t sample_parts(int64_t V) { return (V + kSamplePart - 1) / kSamplePart; }

// Whether a call takes the partitioned path: no thresholds; ids exact as floats (the lowest
// maximum's id goes through a float reduction) and the grid's rows x partitions in range.
inline bool sample_split_ok(const SampleArgs& a) {
  return (a.top_k <= 0 || a.top_k >= a.V) && a.top_p >= 1.0 && a.min_p <= 0.0 && a.V < (int64_t(1) << 24) &&
         a.S * sample_parts(a.V) < (int64_t(1) << 31);
}

// A thread's ids of partition p, in id order: [b, e), 16 apiece.
__device__ __forceinline__ void part_chunk(int64_t V, int64_t p, int64_t& b, int64_t& e) {
  constexpr int per = kSamplePart / kSamplePartThreads;
  const int64_t p0 = p * kSamplePart, p1 = p0 + kSamplePart < V ? p0 + kSamplePart : V;
  b = p0 + int64_t(threadIdx.x) * per;
  if (b > p1) b = p1;
  e = b + per < p1 ? b + per : p1;
}

template <bool CAP>
__global__ void __launch_bounds__(kSamplePartThreads) sample_part_kernel(SampleArgs a, SamplePartial* parts) {
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  __shared__ double shd[32];
  __shared__ float shf[32];
  const int64_t row = blockIdx.x, p = blockIdx.y, P = gridDim.y, V = a.V;
  const float* logits = a.logits + row * a.ld;
  const float inv_t = a.temperature == 0.0 ? 1.f : float(1.0 / a.temperature);
  const float cap = a.softcap;
  const bool vec = V % 4 == 0 && a.ld % 4 == 0 && reinterpret_cast<uintptr_t>(a.logits) % 16 == 0;
  int64_t b, e;
  part_chunk(V, p, b, e);
  // the thread's 16 ids in registers (four float4 loads for a whole chunk), read once
  constexpr int kPer = kSamplePart / kSamplePartThreads;
  float z[kPer];
  const int n = int(e - b);
  if (vec && n == kPer) {
#pragma unroll
    for (int k = 0; k < kPer; k += 4) {
      const float4 x = *reinterpret_cast<const float4*>(logits + b + k);
      z[k] = soft_cap_if<CAP>(x.x, cap) * inv_t;
      z[k + 1] = soft_cap_if<CAP>(x.y, cap) * inv_t;
      z[k + 2] = soft_cap_if<CAP>(x.z, cap) * inv_t;
      z[k + 3] = soft_cap_if<CAP>(x.w, cap) * inv_t;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kPer; ++k) z[k] = k < n ? soft_cap_if<CAP>(logits[b + k], cap) * inv_t : -INFINITY;
  }
  float mx = -INFINITY;
  int64_t first = V;
  int bad = 0;
#pragma unroll
  for (int k = 0; k < kPer; ++k)
    if (k < n) {
      bad |= !isfinite(z[k]);
      if (z[k] > mx) {
        mx = z[k];
        first = b + k;
      }
    }
  const float my_mx = mx;
  mx = block_reduce_max(mx, shf);
  const float neg = block_reduce_max(my_mx == mx ? -float(first) : -float(V), shf);
  const double nbad = block_reduce_sum<double>(double(bad), shd);
  double csum = 0;
#pragma unroll
  for (int k = 0; k < kPer; ++k)
    if (k < n) csum += double(__expf(z[k] - mx));
  const double sum = block_reduce_sum<double>(csum, shd);
  if (threadIdx.x == 0) {
    SamplePartial& o = parts[row * P + p];
    o.sum = sum;
    o.mx = mx;
    o.first = int32_t(-neg);
    o.bad = nbad > 0;
  }
}

template <bool CAP>
__global__ void __launch_bounds__(kSamplePartThreads) sample_final_kernel(SampleArgs a, const SamplePartial* parts,
                                                                         int64_t P) {
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  __shared__ double shd[32];
  __shared__ unsigned long long found;
  __shared__ int64_t pick;
  __shared__ double local_target;
  __shared__ int32_t token;
  __shared__ float lse_sh;
  __shared__ bool unscored;
  const int64_t row = blockIdx.x, V = a.V;
  const SamplePartial* pr = parts + row * P;
  const float* logits = a.logits + row * a.ld;
  const bool greedy = a.temperature == 0.0;
  const float inv_t = greedy ? 1.f : float(1.0 / a.temperature);
  const float cap = a.softcap;
  const bool vec = V % 4 == 0 && a.ld % 4 == 0 && reinterpret_cast<uintptr_t>(a.logits) % 16 == 0;
  if (threadIdx.x == 0) {
    // the partitions in order: any non-finite, the maximum and its lowest id, the total mass
    bool bad = false;
    float M = -INFINITY;
    int32_t first = int32_t(V);
    for (int64_t q = 0; q < P; ++q) {
      bad |= pr[q].bad != 0;
      if (pr[q].mx > M) {
        M = pr[q].mx;
        first = pr[q].first;
      }
    }
    double total = 0;
    for (int64_t q = 0; q < P; ++q) total += pr[q].sum * exp(double(pr[q].mx) - double(M));
    lse_sh = float(double(M) + log(total));
    token = bad ? -1 : first;
    pick = -1;
    unscored = false;
    if (!bad && a.given) {  // no draw: the given id (outside [0, V): token -1, logprob 0)
      const int32_t g = a.given[row];
      token = g >= 0 && g < V ? g : -1;
      unscored = token < 0;
    } else if (!bad && !greedy) {
      // the partition where the target falls, and the target within it in its own units
      const double target = a.u[row] * total;
      double before = 0;
      int64_t last = -1;
      for (int64_t q = 0; q < P; ++q) {
        const double w = pr[q].sum * exp(double(pr[q].mx) - double(M));
        if (w > 0) last = q;
        if (w > 0 && before + w > target) {
          pick = q;
          local_target = (target - before) / exp(double(pr[q].mx) - double(M));
          break;
        }
        before += w;
      }
      if (pick < 0) {  // a target rounded past the end: the last partition's last weight
        pick = last;
        local_target = INFINITY;
      }
    }
    found = ~0ull;
  }
  __syncthreads();
  if (pick >= 0) {
    // inverse CDF within the partition, in id order: per-thread chunk sums scanned in thread order
    const float mx = pr[pick].mx;
    int64_t b, e;
    part_chunk(V, pick, b, e);
    double csum = 0;
    chunk_each<CAP>(logits, b, e, vec, inv_t, cap, [&](int64_t, float z) { csum += double(__expf(z - mx)); });
    double acc = block_exclusive_scan(csum, shd);
    int64_t hit = -1, last = -1;
    chunk_each<CAP>(logits, b, e, vec, inv_t, cap, [&](int64_t j, float z) {
      const float w = __expf(z - mx);
      if (w > 0.f) {
        acc += double(w);
        last = j;
        if (hit < 0 && acc > local_target) hit = j;
      }
    });
    if (hit >= 0) atomicMin(&found, (unsigned long long)hit);
    __syncthreads();
    if (found == ~0ull) {  // past the end: the partition's last id with weight
      __shared__ float shf[32];
      const float l = block_reduce_max(float(last), shf);
      if (threadIdx.x == 0) token = int32_t(l);
    } else if (threadIdx.x == 0) {
      token = int32_t(found);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    a.tokens[row] = token;
    a.logprobs[row] = token >= 0 ? float(double(soft_cap_if<CAP>(logits[token], cap) * inv_t) - double(lse_sh))
                      : unscored ? 0.f
                                 : NAN;
  }
}

}  // namespace

// Whether kv_write_vec_kernel takes the call: bf16 rows whose head dims are contiguous and 16-byte
// aligned, caches of elem-byte elements whose 8-value runs are aligned (16 bytes for bf16, 8 for
// FP8 codes), and 32-bit index math.
static bool vec_rows(const KvWriteArgs& a, uintptr_t elem) {
  const auto at = [](const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; };
  return a.t == DType::bf16 && a.Dk % 8 == 0 && a.Dv % 8 == 0 && a.ldk % 8 == 0 && a.ldv % 8 == 0 &&
         a.kc_strides[3] == 1 && a.vc_strides[3] == 1 && at(a.k, 16) && at(a.v, 16) && at(a.k_cache, 8 * elem) &&
         at(a.v_cache, 8 * elem) && a.kc_strides[0] % 8 == 0 && a.kc_strides[1] % 8 == 0 &&
         a.kc_strides[2] % 8 == 0 && a.vc_strides[0] % 8 == 0 && a.vc_strides[1] % 8 == 0 &&
         a.vc_strides[2] % 8 == 0 && a.Hkv * (a.Dk + a.Dv) / 8 < (int64_t(1) << 30);
}

void rope_kv_cache_write(const RopeKvArgs& a, cudaStream_t s) {
  if (a.kv.R == 0) return;
  if (a.rot < 0 || a.rot > a.kv.Dk || a.rot % 2) throw std::invalid_argument("rope_kv_cache_write: rotary dims must be even, <= D");
  const bool fp8 = a.kv.k_scale || a.kv.v_scale;
  if (fp8 && (!a.kv.k_scale || !a.kv.v_scale)) throw std::invalid_argument("rope_kv_cache_write: FP8 caches need both scales");
  KvWriteArgs kv = a.kv;  // the keys: y's heads Hq ..
  kv.k = static_cast<const char*>(a.y) + a.Hq * a.kv.Dk * (a.kv.t == DType::f32 ? 4 : 2);
  kv.ldk = a.ldy;
  const auto at16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const int64_t half = a.rot / 2;
  if (a.kv.t == DType::bf16 && !a.interleaved && half >= 8 && half % 8 == 0 && half <= 4096 && a.ldx % 8 == 0 &&
      a.ldy % 8 == 0 && at16(a.x) && at16(a.y) && vec_rows(kv, fp8 ? 1 : 2) &&
      (a.Hq + a.kv.Hkv) * a.kv.Dk / 8 + a.kv.Hkv * a.kv.Dv / 8 < (int64_t(1) << 30)) {
    const size_t smem = size_t(a.rot) * sizeof(float);
    if (fp8)
      launch_pdl(rope_kv_write_kernel<true>, unsigned(a.kv.R), 256, smem, s, a);
    else
      launch_pdl(rope_kv_write_kernel<false>, unsigned(a.kv.R), 256, smem, s, a);
    check_launch("rope_kv_cache_write");
    return;
  }
  rope(a.kv.t, a.y, a.ldy, a.x, a.ldx, a.pos, a.inv_freq, a.kv.R, a.Hq + a.kv.Hkv, a.kv.Dk, a.rot, a.scale,
       a.interleaved, false, s);
  kv_cache_write(kv, s);
}

void kv_cache_write(const KvWriteArgs& a, cudaStream_t s) {
  if (a.R == 0) return;
  if (a.k_scale || a.v_scale) {
    if (!a.k_scale || !a.v_scale) throw std::invalid_argument("kv_cache_write: FP8 caches need both scales");
    if (a.Hkv * (a.Dk + a.Dv) >= (int64_t(1) << 31)) throw std::invalid_argument("kv_cache_write: rows too wide");
    if (a.t != DType::bf16) throw std::invalid_argument("kv_cache_write: FP8 caches from bf16 keys and values only");
    launch_pdl(vec_rows(a, 1) ? kv_write_vec_kernel<true> : kv_write_fp8_kernel, unsigned(a.R), 128, 0, s, a);
    check_launch("kv_cache_write (fp8)");
    return;
  }
  if (vec_rows(a, 2))
    launch_pdl(kv_write_vec_kernel<false>, unsigned(a.R), 128, 0, s, a);
  else if (a.t == DType::bf16)
    launch_pdl(kv_write_kernel<bf16>, unsigned(a.R), 128, 0, s, a);
  else
    launch_pdl(kv_write_kernel<float>, unsigned(a.R), 128, 0, s, a);
  check_launch("kv_cache_write");
}

// The tensor-core kernel is the default where it applies since it ran on a GPU (2026-12-05, H100:
// the generator's tests and check-kernels pass; decoding at batch 256 72.3K tok/s against the
// SIMT kernel's 53.0K). RLH_KCUDA_PAGED_MMA=0 keeps the SIMT kernel (docs/kernels_cuda.md).
static bool use_mma(const PagedAttnArgs& a) {
  static const bool on = env_switch_on("RLH_KCUDA_PAGED_MMA");
  return on && paged_attention_mma_ok(a);
}

int64_t paged_attention_workspace_bytes(const PagedAttnArgs& a) {
  if (a.k_scale || use_mma(a)) return paged_attention_mma_workspace_bytes(a);
  const int64_t Z = pa_partitions(a);
  if (Z == 1 || a.R == 0) return 0;
  return pa_rows_per_launch(a, Z) * a.Hq * Z * pa_partial_floats(a.Dv) * int64_t(sizeof(float));
}

namespace {

template <class T, int NV, bool VEC, bool CAP>
void launch_paged(const PagedAttnArgs& a, int64_t Z, cudaStream_t s) {
  const int64_t groups = (a.Hq / a.Hkv + kPaHeads - 1) / kPaHeads;
  const int64_t rows = Z == 1 ? a.R : pa_rows_per_launch(a, Z);
  // Blocks beyond about 16 per SM of an H200: the narrow variant (occupancy first).
  constexpr int64_t kWideBlocks = 2048;
  for (int64_t r0 = 0; r0 < a.R; r0 += rows) {
    const int64_t n = std::min(rows, a.R - r0);
    const dim3 grid(unsigned(n), unsigned(a.Hkv * groups), unsigned(Z));
    if (n * a.Hkv * groups * Z <= kWideBlocks)
      launch_pdl(paged_attention_kernel<T, NV, VEC, true, CAP>, grid, 32 * kPaWarps, 0, s, a, r0, groups, Z);
    else
      launch_pdl(paged_attention_kernel<T, NV, VEC, false, CAP>, grid, 32 * kPaWarps, 0, s, a, r0, groups, Z);
    if (Z > 1) launch_pdl(paged_combine_kernel<T>, dim3(unsigned(n), unsigned(a.Hq)), 128, 0, s, a, r0, Z);
  }
}

template <int NV, bool CAP>
void launch_paged_nv(const PagedAttnArgs& a, int64_t Z, bool vec, cudaStream_t s) {
  if (a.t == DType::f32)
    launch_paged<float, NV, false, CAP>(a, Z, s);
  else if (vec)
    launch_paged<bf16, NV, true, CAP>(a, Z, s);
  else
    launch_paged<bf16, NV, false, CAP>(a, Z, s);
}
template <int NV>
void launch_paged_nv(const PagedAttnArgs& a, int64_t Z, bool vec, cudaStream_t s) {
  if (a.softcap > 0)
    launch_paged_nv<NV, true>(a, Z, vec, s);
  else
    launch_paged_nv<NV, false>(a, Z, vec, s);
}

}  // namespace

void paged_attention(const PagedAttnArgs& a, cudaStream_t s) {
  if (a.Dk > kPaMaxD || a.Dv > kPaMaxD)
    throw std::invalid_argument("paged_attention: head dims above 256 are not offered");
  if (a.Hkv < 1 || a.Hq % a.Hkv) throw std::invalid_argument("paged_attention: Hq must be a multiple of Hkv");
  if (!(a.softcap >= 0) || !std::isfinite(a.softcap))
    throw std::invalid_argument("paged_attention: softcap must be a finite number >= 0");
  if (a.R == 0) return;
  if (a.k_scale || a.v_scale) {  // FP8 caches: the tensor-core kernel alone reads them
    if (!a.k_scale || !a.v_scale || !paged_attention_mma_ok(a))
      throw std::invalid_argument("paged_attention: FP8 caches need both scales, bf16 q, Dk = Dv = 64 or 128, no "
                                  "soft-cap, rows of a cache contiguous and 16-byte aligned");
    return paged_attention_mma(a, s);
  }
  if (use_mma(a)) return paged_attention_mma(a, s);
  const int64_t Z = pa_partitions(a);
  if (Z > 65535) throw std::invalid_argument("paged_attention: block tables wider than 65535 x 128 positions");
  if (Z > 1 && !a.partials)
    throw std::invalid_argument("paged_attention: no workspace for the partitions' partials");
  const int NV = a.Dv <= 32 ? 1 : a.Dv <= 64 ? 2 : a.Dv <= 128 ? 4 : 8;
  // 16-byte key loads and NV-wide value loads: bf16, head dims contiguous, every row aligned.
  auto aligned = [](const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % uintptr_t(bytes) == 0; };
  bool vec = a.t == DType::bf16 && a.kc_strides[3] == 1 && a.vc_strides[3] == 1 && a.Dk % 8 == 0 &&
             a.Dv == 32 * NV && aligned(a.k_cache, 16) && aligned(a.v_cache, 2 * NV);
  for (int i = 0; i < 3 && vec; ++i) vec = a.kc_strides[i] % 8 == 0 && a.vc_strides[i] % NV == 0;
  switch (NV) {
    case 1: launch_paged_nv<1>(a, Z, vec, s); break;
    case 2: launch_paged_nv<2>(a, Z, vec, s); break;
    case 4: launch_paged_nv<4>(a, Z, vec, s); break;
    default: launch_paged_nv<8>(a, Z, vec, s); break;
  }
  check_launch("paged_attention");
}

void sample(const SampleArgs& a, cudaStream_t s) {
  if (a.S == 0) return;
  if (!(a.temperature >= 0) || !std::isfinite(a.temperature))
    throw std::invalid_argument("sample: temperature must be a finite number >= 0");
  if (!(a.top_p > 0 && a.top_p <= 1)) throw std::invalid_argument("sample: top_p must be in (0, 1]");
  if (!(a.min_p >= 0 && a.min_p <= 1)) throw std::invalid_argument("sample: min_p must be in [0, 1]");
  if (!(a.softcap >= 0) || !std::isfinite(a.softcap)) throw std::invalid_argument("sample: softcap must be a finite number >= 0");
  if (sample_split_ok(a) && a.parts) {
    const int64_t P = sample_parts(a.V);
    auto* parts = static_cast<SamplePartial*>(a.parts);
    const dim3 grid(unsigned(a.S), unsigned(P));
    if (a.softcap > 0) {
      launch_pdl(sample_part_kernel<true>, grid, kSamplePartThreads, 0, s, a, parts);
      launch_pdl(sample_final_kernel<true>, unsigned(a.S), kSamplePartThreads, 0, s, a, parts, P);
    } else {
      launch_pdl(sample_part_kernel<false>, grid, kSamplePartThreads, 0, s, a, parts);
      launch_pdl(sample_final_kernel<false>, unsigned(a.S), kSamplePartThreads, 0, s, a, parts, P);
    }
  } else if (a.softcap > 0) {
    launch_pdl(sample_kernel<true>, unsigned(a.S), kSampleThreads, 0, s, a);
  } else {
    launch_pdl(sample_kernel<false>, unsigned(a.S), kSampleThreads, 0, s, a);
  }
  check_launch("sample");
}

int64_t sample_workspace_bytes(const SampleArgs& a) {
  return sample_split_ok(a) ? a.S * sample_parts(a.V) * int64_t(sizeof(SamplePartial)) : 0;
}

}  // namespace rlh::kcuda
