// amax and FP8 quantisation on the GPU (fp8_kernels.hpp). Every pass is bandwidth-bound, so the
// kernels are laid out for the memory system: rows walked with 16-byte loads where the source
// allows (bf16, 8-element aligned), and the transposed sources (the backward products' K-major
// copies) staged through shared memory so both the reads of x and the writes of q are coalesced.
// The first version (one element per thread, 64-bit div/mod, transposed reads straight from
// global memory) made the 1B FP8 training step 0.64x of bf16 on the H100 (2026-12-05).
// Quantisation divides by the scale (x / s rounded to float32, then to the format), the
// definition the tests check codes against: Divisor computes the quotient from the reciprocal
// with one FMA correction (a plain multiply by 1/s would round twice).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>

#include "fp8_codes.cuh"
#include "fp8_kernels.hpp"

namespace vfp8 {
namespace {

__device__ __forceinline__ float load(const Source& s, int64_t r, int64_t c) {
  // (r, c) of x [R, C] itself.
  const int64_t k = r * s.ldx + c;
  return s.type == In::f32 ? static_cast<const float*>(s.x)[k]
                           : __bfloat162float(static_cast<const __nv_bfloat16*>(s.x)[k]);
}

__device__ __forceinline__ unsigned warp_max(unsigned b) {
  for (int o = 16; o > 0; o >>= 1) b = max(b, __shfl_xor_sync(0xffffffffu, b, o));
  return b;
}

// The block's max, in every thread (it synchronises; every thread calls it).
__device__ __forceinline__ unsigned block_max(unsigned m) {
  __shared__ unsigned part[32];
  m = warp_max(m);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = m;
  __syncthreads();
  m = 0;
  for (int k = 0; k < int(blockDim.x >> 5); ++k) m = max(m, part[k]);
  return m;
}

// The block's max into *bits: one atomic per block. Thousands of blocks sending one atomic per
// warp to one address serialised at L2: that, not the reads, made the amax pass of the 1B FP8
// step 3.6x slower than a quantisation pass over the same data (ncu, H100, 2026-12-06). Every
// thread of the block calls it.
__device__ __forceinline__ void block_max_into(unsigned m, unsigned* bits) {
  m = block_max(m);
  if (threadIdx.x == 0 && m != 0) atomicMax(bits, m);
}


// A row-walk over x [R, C]: 16-byte loads of 8 bf16 when the source allows it.
__device__ __forceinline__ bool vec8(const Source& s) {
  return s.type == In::bf16 && s.C % 8 == 0 && s.ldx % 8 == 0 && (reinterpret_cast<uintptr_t>(s.x) & 15) == 0;
}

__device__ __forceinline__ void load8(const Source& s, int64_t r, int64_t c, float v[8]) {
  load8_bf16(static_cast<const __nv_bfloat16*>(s.x) + r * s.ldx + c, v);
}

// amax over x [R, C] (a transposed source has the same elements): blocks take rows, threads
// the columns of a row. For sources the flat kernel below does not take.
__global__ void amax_kernel(Source s, unsigned* bits) {
  unsigned m = 0;
  const bool v8 = vec8(s);
  for (int64_t r = blockIdx.x; r < s.R; r += gridDim.x) {
    if (v8) {
      for (int64_t c = int64_t(threadIdx.x) * 8; c < s.C; c += int64_t(blockDim.x) * 8) {
        float v[8];
        load8(s, r, c, v);
        for (int k = 0; k < 8; ++k) m = max(m, abs_bits(v[k]));
      }
    } else {
      for (int64_t c = threadIdx.x; c < s.C; c += blockDim.x) m = max(m, abs_bits(load(s, r, c)));
    }
  }
  block_max_into(m, bits);
}

// |x| of 8 bf16 (one 16-byte word) as f32 bits: a bf16 is the top half of its f32, and its
// magnitude bits order as unsigned integers (NaN above infinity), so the max is taken on the
// halves (__vmaxu2) and widened once.
__device__ __forceinline__ unsigned absmax8_bf16(uint4 u) {
  const unsigned m = __vmaxu2(__vmaxu2(u.x & 0x7fff7fffu, u.y & 0x7fff7fffu), __vmaxu2(u.z & 0x7fff7fffu, u.w & 0x7fff7fffu));
  return max(m << 16, m & 0xffff0000u);
}

// amax of a contiguous bf16 source (rows back to back, 16-byte aligned, n16 words of 8): a
// grid-stride walk with four independent 16-byte loads in flight per thread.
__global__ void amax_flat_kernel(const uint4* x, int64_t n16, unsigned* bits) {
  unsigned m = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    uint4 u[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) u[k] = __ldg(x + i + k * stride);
#pragma unroll
    for (int k = 0; k < 4; ++k) m = max(m, absmax8_bf16(u[k]));
  }
  for (; i < n16; i += stride) m = max(m, absmax8_bf16(__ldg(x + i)));
  block_max_into(m, bits);
}

__global__ void finish_amax(const unsigned* bits, float* out) { *out = __uint_as_float(*bits); }

__global__ void tensor_scale(const unsigned* bits, float fmax, float mult, float* scale, float* amax_out) {
  const float a = __uint_as_float(*bits);
  *scale = scale_of(a, fmax, mult);
  if (amax_out) *amax_out = a;
}

// Tensor scale, x itself: a row per block, 8 elements (one 16-byte load, one 8-byte store) per
// thread where the source and q allow it.
// `bits` (may be null): the source's amax is gathered in the same pass (delayed scaling's
// history entry, while the scale came from earlier calls).
__global__ void quantize_rows_kernel(Source s, Fmt f, const float* scale, unsigned char* q, int64_t ldq,
                                     unsigned* bits) {
  const Divisor d(*scale);
  const bool v8 = vec8(s) && ldq % 8 == 0 && (reinterpret_cast<uintptr_t>(q) & 7) == 0;
  unsigned m = 0;
  for (int64_t r = blockIdx.x; r < s.R; r += gridDim.x) {
    if (v8) {
      for (int64_t c = int64_t(threadIdx.x) * 8; c < s.C; c += int64_t(blockDim.x) * 8) {
        float v[8];
        load8(s, r, c, v);
        for (int k = 0; k < 8; ++k) m = max(m, abs_bits(v[k]));
        *reinterpret_cast<uint2*>(q + r * ldq + c) = codes8(v, d, f);
      }
    } else {
      for (int64_t c = threadIdx.x; c < s.C; c += blockDim.x) {
        const float v = load(s, r, c);
        m = max(m, abs_bits(v));
        q[r * ldq + c] = to_fp8(d(v), f);
      }
    }
  }
  if (bits) block_max_into(m, bits);
}

// The transposed passes (x^T: the backward products' K-major operands) take a tile of 128 rows
// (tokens) x 64 columns of x: the reads are 16-byte words along x's rows, four per thread issued
// before any is used (the first version's one 2-byte load at a time per thread kept too few
// bytes in flight: 0.9 TB/s). Blocks of 256 threads; grid (ceil(C / 64), ceil(R / 128)).
constexpr int kTR = 128, kTC = 64, kTP = kTR + 1;

// Thread t's four words of the tile at (r0, c0): word k is row a = e / 8, columns b .. b + 7 with
// e = t + 256 k; out-of-range elements are 0.
__device__ __forceinline__ void load_tile(const Source& s, int64_t r0, int64_t c0, float (&v)[4][8]) {
  const bool v8 = vec8(s);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int e = int(threadIdx.x) + k * 256, a = e >> 3, b = (e & 7) * 8;
    const int64_t r = r0 + a, c = c0 + b;
    if (v8 && r < s.R && c < s.C) {  // (C is a multiple of 8 here)
      load8(s, r, c, v[k]);
    } else {
      for (int t = 0; t < 8; ++t) v[k][t] = (r < s.R && c + t < s.C) ? load(s, r, c + t) : 0.0f;
    }
  }
}

// Tensor scale, x^T into qt, and with q (transpose = 2) x itself in the same pass. The scale is
// known, so values become codes as they are read: x's rows go straight to q from the registers
// (8-byte stores), and the codes are staged transposed as bytes, C8[column][row] (a pitch of 132:
// its 4-byte words one bank apart), from which each warp writes rows of qt, 128 bytes as one
// word a lane. `bits` (may be null): the source's amax gathered in the same pass.
__global__ void __launch_bounds__(256) quantize_tr_kernel(Source s, Fmt f, const float* scale, unsigned char* q,
                                                          int64_t ldq, unsigned char* qt, int64_t ldqt,
                                                          unsigned* bits) {
  constexpr int kP8 = kTR + 4;
  __shared__ __align__(16) unsigned char C8[kTC * kP8];
  const Divisor d(*scale);
  const int64_t c0 = int64_t(blockIdx.x) * kTC, r0 = int64_t(blockIdx.y) * kTR;
  float v[4][8];
  load_tile(s, r0, c0, v);
  const bool v8q = q && ldq % 8 == 0 && (reinterpret_cast<uintptr_t>(q) & 7) == 0;
  unsigned m = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int e = int(threadIdx.x) + k * 256, a = e >> 3, b = (e & 7) * 8;
    for (int t = 0; t < 8; ++t) m = max(m, abs_bits(v[k][t]));
    const uint2 w = codes8(v[k], d, f);
    const unsigned char* o = reinterpret_cast<const unsigned char*>(&w);
    for (int t = 0; t < 8; ++t) C8[(b + t) * kP8 + a] = o[t];
    const int64_t r = r0 + a, c = c0 + b;
    if (q && r < s.R && c < s.C) {
      if (v8q && c + 8 <= s.C) {
        *reinterpret_cast<uint2*>(q + r * ldq + c) = w;
      } else {
        for (int t = 0; t < 8 && c + t < s.C; ++t) q[r * ldq + c + t] = o[t];
      }
    }
  }
  __syncthreads();
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  const bool v4 = ldqt % 4 == 0 && (reinterpret_cast<uintptr_t>(qt) & 3) == 0;
  for (int b = warp; b < kTC && c0 + b < s.C; b += 8) {  // qt row c0 + b: tokens r0 + 4 lane ..
    const unsigned w = *reinterpret_cast<const unsigned*>(C8 + b * kP8 + 4 * lane);
    unsigned char* qr = qt + (c0 + b) * ldqt + r0 + 4 * lane;
    const int64_t left = s.R - (r0 + 4 * lane);
    if (v4 && left >= 4) {
      *reinterpret_cast<unsigned*>(qr) = w;
    } else {
      for (int k = 0; k < 4 && k < left; ++k) qr[k] = (unsigned char)(w >> (8 * k));
    }
  }
  if (bits) block_max_into(m, bits);
}

// 1x128 tiles of x itself: a half-warp per (row, tile), each lane 8 consecutive elements (one
// 16-byte load and one 8-byte store where allowed), each half-warp two tiles a pass with both
// loads issued first (the first version, a warp per tile and an 8-byte load a lane, kept too few
// bytes in flight: 2.4x the time of a per-tensor pass over the same data). Tile u is row
// u % rows, tile u / rows: neighbouring half-warps read neighbouring rows and write neighbouring
// scales s[kb * rows + r].
__global__ void __launch_bounds__(256) tile_rows_kernel(Source s, Fmt f, float fmax, float mult, unsigned char* q,
                                                        int64_t ldq, float* scale) {
  const int64_t rows = s.R, inner = s.C, units = rows * ((inner + 127) / 128);
  const int hl = int(threadIdx.x & 15);
  const unsigned mask = 0xffffu << (threadIdx.x & 16);  // this half-warp's lanes
  const int64_t stride = int64_t(gridDim.x) * (blockDim.x >> 4);
  const bool v8 = vec8(s) && ldq % 8 == 0 && (reinterpret_cast<uintptr_t>(q) & 7) == 0;
  for (int64_t u0 = int64_t(blockIdx.x) * (blockDim.x >> 4) + (threadIdx.x >> 4); u0 < units; u0 += 2 * stride) {
    float v[2][8];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int64_t u = u0 + k * stride, i = u % rows, j = (u / rows) * 128 + hl * 8;
      if (u < units && v8 && j < inner) {  // (inner is a multiple of 8 here)
        load8(s, i, j, v[k]);
      } else {
        for (int t = 0; t < 8; ++t) v[k][t] = (u < units && j + t < inner) ? load(s, i, j + t) : 0.0f;
      }
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int64_t u = u0 + k * stride, i = u % rows, kb = u / rows, j = kb * 128 + hl * 8;
      unsigned m = 0;
      for (int t = 0; t < 8; ++t) m = max(m, abs_bits(v[k][t]));
      for (int o = 8; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(mask, m, o));
      if (u >= units) continue;  // (the half-warp's lanes agree: u is theirs alike)
      const float sc = scale_of(__uint_as_float(m), fmax, mult);
      const Divisor d(sc);
      if (hl == 0) scale[kb * rows + i] = sc;
      if (v8 && j < inner) {
        *reinterpret_cast<uint2*>(q + i * ldq + j) = codes8(v[k], d, f);
      } else {
        for (int t = 0; t < 8; ++t)
          if (j + t < inner) q[i * ldq + j + t] = to_fp8(d(v[k][t]), f);
      }
    }
  }
}

// One scale per row of x (Grouping::row: per token for activations, per output channel for
// weights, cuBLASLt's OUTER_VEC_32F): a warp a row, the row's amax gathered over 16-byte words,
// then the row quantised from a second read (the row is in L1 by then). Rows of a decoding
// step's activations are 2-8K elements, so a warp's two walks are its whole work.
__global__ void __launch_bounds__(256) row_scaled_kernel(Source s, Fmt f, float fmax, float mult, unsigned char* q,
                                                         int64_t ldq, float* scale) {
  const int lane = int(threadIdx.x & 31);
  const bool v8 = vec8(s) && ldq % 8 == 0 && (reinterpret_cast<uintptr_t>(q) & 7) == 0;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); r < s.R; r += warps) {
    unsigned m = 0;
    if (v8) {
      for (int64_t c = int64_t(lane) * 8; c < s.C; c += 256) {
        float v[8];
        load8(s, r, c, v);
        for (int t = 0; t < 8; ++t) m = max(m, abs_bits(v[t]));
      }
    } else {
      for (int64_t c = lane; c < s.C; c += 32) m = max(m, abs_bits(load(s, r, c)));
    }
    const float sc = scale_of(__uint_as_float(warp_max(m)), fmax, mult);
    if (lane == 0) scale[r] = sc;
    const Divisor d(sc);
    if (v8) {
      for (int64_t c = int64_t(lane) * 8; c < s.C; c += 256) {
        float v[8];
        load8(s, r, c, v);
        *reinterpret_cast<uint2*>(q + r * ldq + c) = codes8(v, d, f);
      }
    } else {
      for (int64_t c = lane; c < s.C; c += 32) q[r * ldq + c] = to_fp8(d(load(s, r, c)), f);
    }
  }
}

// 1x128 tiles of x^T: the tiles run along x's rows (the tokens), so a staged tile of 128 rows
// is one tile per column: a warp takes a column's 128 values (lane l rows l, l + 32, ...), their
// max gives the scale s[blockIdx.y * rows + column], and the warp writes the 128 codes.
__global__ void __launch_bounds__(256) tile_transposed_kernel(Source s, Fmt f, float fmax, float mult,
                                                              unsigned char* q, int64_t ldq, float* scale) {
  __shared__ float T[kTC][kTP];  // T[column][row]: the column reads below conflict-free
  const int64_t c0 = int64_t(blockIdx.x) * kTC, r0 = int64_t(blockIdx.y) * kTR, rows = s.C;
  {
    float v[4][8];
    load_tile(s, r0, c0, v);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int e = int(threadIdx.x) + k * 256, a = e >> 3, b = (e & 7) * 8;
      for (int t = 0; t < 8; ++t) T[b + t][a] = v[k][t];
    }
  }
  __syncthreads();
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  for (int b = warp; b < kTC && c0 + b < s.C; b += 8) {
    float v[4];
    unsigned m = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = T[b][lane + 32 * i];  // 0 past the last row: it leaves the max alone
      m = max(m, abs_bits(v[i]));
    }
    const float sc = scale_of(__uint_as_float(warp_max(m)), fmax, mult);
    const Divisor d(sc);
    if (lane == 0) scale[blockIdx.y * rows + c0 + b] = sc;
    unsigned char* qr = q + (c0 + b) * ldq + r0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int a = lane + 32 * i;
      if (r0 + a < s.R) qr[a] = to_fp8(d(v[i]), f);
    }
  }
}

// One block of 256 threads per 128x128 block of q; blocks past the last column of blocks write
// the padding scales. The block's 128 x 128 elements of x are read once: thread t holds rows
// 8 (t / 16) .. + 7 of the 8-column chunk t % 16 (16-byte loads where the source allows, all
// eight in flight together; a warp reads two rows' 256 bytes per load). Their max gives the
// scale; q is then written from the registers (q = x: 8-byte stores along q's rows) or, for
// x^T, through shared memory as codes, T[x column][x row], each thread storing a column's 8 rows
// as two 4-byte words and each warp then writing whole 128-byte rows of q. (The first version
// read x one element at a time, twice: 0.4 TB/s, 7% of a blockwise 1B step in weights alone.)
__global__ void __launch_bounds__(256) block_kernel(Source s, Fmt f, float fmax, float mult, unsigned char* q,
                                                    int64_t ldq, float* scale) {
  constexpr int kP = 132;  // bytes a staged row: 4-byte aligned, its words one bank apart
  __shared__ __align__(16) unsigned char T[128 * kP];
  const int64_t rows = s.rows(), inner = s.inner(), nkb = (inner + 127) / 128, kb4 = (nkb + 3) / 4 * 4;
  const int64_t rb = blockIdx.y, kb = blockIdx.x;
  if (kb >= nkb) {
    if (threadIdx.x == 0) scale[rb * kb4 + kb] = 1.0f;
    return;
  }
  // The block of q is rows i0.., inner j0..; in x that is rows xr0.. and columns xc0.. .
  const int64_t i0 = rb * 128, j0 = kb * 128;
  const int64_t xr0 = s.transpose ? j0 : i0, xc0 = s.transpose ? i0 : j0;
  const int b = int(threadIdx.x & 15) * 8, a0 = int(threadIdx.x >> 4) * 8;  // x column / row offsets
  const bool v8 = vec8(s);
  float v[8][8];
  unsigned m = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int64_t r = xr0 + a0 + k, c = xc0 + b;
    if (v8 && r < s.R && c < s.C) {  // (C is a multiple of 8 here)
      load8(s, r, c, v[k]);
    } else {
      for (int t = 0; t < 8; ++t) v[k][t] = (r < s.R && c + t < s.C) ? load(s, r, c + t) : 0.0f;
    }
  }
#pragma unroll
  for (int k = 0; k < 8; ++k)
    for (int t = 0; t < 8; ++t) m = max(m, abs_bits(v[k][t]));
  const float sc = scale_of(__uint_as_float(block_max(m)), fmax, mult);
  const Divisor d(sc);
  if (threadIdx.x == 0) scale[rb * kb4 + kb] = sc;
  if (!s.transpose) {  // q row i0 + a0 + k, inner j0 + b ..
    const bool v8q = ldq % 8 == 0 && (reinterpret_cast<uintptr_t>(q) & 7) == 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t i = i0 + a0 + k, j = j0 + b;
      if (i >= rows) break;
      const uint2 out = codes8(v[k], d, f);
      const unsigned char* o = reinterpret_cast<const unsigned char*>(&out);
      if (v8q && j + 8 <= inner) {
        *reinterpret_cast<uint2*>(q + i * ldq + j) = out;
      } else {
        for (int t = 0; t < 8; ++t)
          if (j + t < inner) q[i * ldq + j + t] = o[t];
      }
    }
    return;
  }
#pragma unroll
  for (int t = 0; t < 8; ++t) {  // x column b + t: rows a0 .. a0 + 7 as two words
    unsigned lo = 0, hi = 0;
    for (int k = 0; k < 4; ++k) {
      lo |= unsigned(to_fp8(d(v[k][t]), f)) << (8 * k);
      hi |= unsigned(to_fp8(d(v[k + 4][t]), f)) << (8 * k);
    }
    *reinterpret_cast<unsigned*>(T + (b + t) * kP + a0) = lo;
    *reinterpret_cast<unsigned*>(T + (b + t) * kP + a0 + 4) = hi;
  }
  __syncthreads();
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  const bool v4q = ldq % 4 == 0 && (reinterpret_cast<uintptr_t>(q) & 3) == 0;
  for (int cc = warp; cc < 128 && i0 + cc < rows; cc += 8) {  // q row i0 + cc: x column xc0 + cc
    const unsigned w = *reinterpret_cast<const unsigned*>(T + cc * kP + 4 * lane);
    unsigned char* qr = q + (i0 + cc) * ldq + j0;
    const int64_t j = 4 * lane;
    if (v4q && j0 + j + 4 <= inner) {
      *reinterpret_cast<unsigned*>(qr + j) = w;
    } else {
      for (int k = 0; k < 4; ++k)
        if (j0 + j + k < inner) qr[j + k] = (unsigned char)(w >> (8 * k));
    }
  }
}

// The amax delayed scaling takes from a history holding `count` > 0 entries: its max, or its
// most recent (pos_count = {next slot, entries filled} of a ring of `len`).
__device__ float history_amax(const float* hist, int len, const int* pos_count, bool most_recent) {
  const int pos = pos_count[0], count = pos_count[1];
  if (most_recent) return hist[(pos - 1 + len) % len];
  unsigned b = 0;
  for (int k = 0; k < count; ++k) b = max(b, __float_as_uint(fabsf(hist[k])));
  return __uint_as_float(b);
}

// This call's amax into the history.
__device__ void history_push(float cur, float* hist, int len, int* pos_count, float* amax_out, float* cur_out) {
  const int pos = pos_count[0], count = pos_count[1];
  hist[pos] = cur;
  pos_count[0] = (pos + 1) % len;
  pos_count[1] = count < len ? count + 1 : len;
  if (amax_out) *amax_out = cur;
  if (cur_out) *cur_out = cur;
}

// Delayed scaling in one pass, once the history holds an entry: the scale from the history
// alone, the quantisation gathering this call's amax, then that amax into the history.
__global__ void history_scale_kernel(float fmax, float mult, bool most_recent, const float* hist, int len,
                                     const int* pos_count, float* scale) {
  *scale = scale_of(history_amax(hist, len, pos_count, most_recent), fmax, mult);
}

__global__ void history_push_kernel(const unsigned* bits, float* hist, int len, int* pos_count, float* amax_out,
                                    float* cur_out) {
  history_push(__uint_as_float(*bits), hist, len, pos_count, amax_out, cur_out);
}

// Delayed scaling's bookkeeping in the two-pass path, one thread: the scale from the history of
// earlier calls (the first call, with none, from its own amax), then this call's amax into it.
__global__ void delayed_kernel(const unsigned* bits, float fmax, float mult, bool most_recent, float* hist, int len,
                               int* pos_count, float* scale, float* amax_out, float* cur_out) {
  const float cur = __uint_as_float(*bits);
  *scale = scale_of(pos_count[1] > 0 ? history_amax(hist, len, pos_count, most_recent) : cur, fmax, mult);
  history_push(cur, hist, len, pos_count, amax_out, cur_out);
}

// Blocks for a row-walk over R rows: one row each, at most 16384 (each then loops over rows).
int row_blocks(int64_t R) { return int(R < 1 ? 1 : R > 16384 ? 16384 : R); }

void amax_bits(const Source& s, uint32_t* bits, cudaStream_t st) {
  cudaMemsetAsync(bits, 0, sizeof(uint32_t), st);
  if (s.R * s.C == 0) return;
  const int64_t n = s.R * s.C;
  if (s.type == In::bf16 && (s.ldx == s.C || s.R == 1) && n % 8 == 0 && (reinterpret_cast<uintptr_t>(s.x) & 15) == 0) {
    // about two waves of resident blocks (132 SMs x 8 on an H100): few atomics, every SM busy
    const int blocks = int(std::min<int64_t>(ceil_div(n / 8, 256), 2048));
    amax_flat_kernel<<<blocks, 256, 0, st>>>(static_cast<const uint4*>(s.x), n / 8, bits);
  } else {
    amax_kernel<<<int(std::min<int64_t>(s.R, 2048)), 256, 0, st>>>(s, bits);
  }
}

void quantize_scaled(const Source& s, Fmt f, const float* scale, void* q, int64_t ldq, unsigned* bits, cudaStream_t st,
                     void* qt = nullptr, int64_t ldqt = 0) {
  if (s.R * s.C == 0) return;
  auto* qb = static_cast<unsigned char*>(q);
  const dim3 tiles(unsigned(ceil_div(s.C, kTC)), unsigned(ceil_div(s.R, kTR)));
  if (qt)  // x into q, x^T into qt
    quantize_tr_kernel<<<tiles, 256, 0, st>>>(s, f, scale, qb, ldq, static_cast<unsigned char*>(qt), ldqt, bits);
  else if (s.transpose)  // x^T into q
    quantize_tr_kernel<<<tiles, 256, 0, st>>>(s, f, scale, nullptr, 0, qb, ldq, bits);
  else
    quantize_rows_kernel<<<row_blocks(s.R), 256, 0, st>>>(s, f, scale, qb, ldq, bits);
}

}  // namespace

void amax(const Source& s, float* out, uint32_t* bits, cudaStream_t st) {
  amax_bits(s, bits, st);
  finish_amax<<<1, 1, 0, st>>>(bits, out);
}

void quantize_with_scale(const Source& s, Fmt f, const float* scale, void* q, int64_t ldq, cudaStream_t st, void* qt,
                         int64_t ldqt) {
  quantize_scaled(s, f, scale, q, ldq, nullptr, st, qt, ldqt);
}

void quantize_current(const Source& s, Fmt f, Grouping g, double margin, void* q, int64_t ldq, float* scale,
                      float* amax_out, uint32_t* bits, cudaStream_t st, void* qt, int64_t ldqt) {
  const float fmax = fmt_max(f), mult = float(std::exp2(margin));
  auto* qb = static_cast<unsigned char*>(q);
  const int64_t rows = s.rows(), inner = s.inner();
  switch (g) {
    case Grouping::tensor:
      amax_bits(s, bits, st);
      tensor_scale<<<1, 1, 0, st>>>(bits, fmax, mult, scale, amax_out);
      quantize_with_scale(s, f, scale, q, ldq, st, qt, ldqt);
      return;
    case Grouping::tile1x128: {
      if (rows == 0 || inner == 0) return;
      if (s.transpose) {
        tile_transposed_kernel<<<dim3(unsigned(ceil_div(s.C, kTC)), unsigned(ceil_div(s.R, kTR))), 256, 0, st>>>(
            s, f, fmax, mult, qb, ldq, scale);
      } else {
        // 16 half-warps a block, two tiles each a pass
        const int64_t units = rows * ceil_div(inner, 128);
        tile_rows_kernel<<<int(std::min<int64_t>(ceil_div(units, 32), 4096)), 256, 0, st>>>(s, f, fmax, mult, qb, ldq,
                                                                                          scale);
      }
      return;
    }
    case Grouping::row:
      if (rows > 0 && inner > 0)
        row_scaled_kernel<<<int(std::min<int64_t>(ceil_div(rows, 8), 4096)), 256, 0, st>>>(s, f, fmax, mult, qb, ldq,
                                                                                          scale);
      return;
    case Grouping::block128: {
      const int64_t kb4 = ceil_div(ceil_div(inner, 128), 4) * 4;
      if (rows > 0 && inner > 0) block_kernel<<<dim3(unsigned(kb4), unsigned(ceil_div(rows, 128))), 256, 0, st>>>(
          s, f, fmax, mult, qb, ldq, scale);
      return;
    }
  }
}

void quantize_delayed(const Source& s, Fmt f, double margin, bool most_recent, float* hist, int32_t len,
                      int32_t* pos_count, bool history_filled, void* q, int64_t ldq, float* scale, float* amax_out,
                      float* cur, uint32_t* bits, cudaStream_t st, void* qt, int64_t ldqt) {
  if (history_filled) {  // one pass over the source
    cudaMemsetAsync(bits, 0, sizeof(uint32_t), st);
    history_scale_kernel<<<1, 1, 0, st>>>(fmt_max(f), float(std::exp2(margin)), most_recent, hist, len, pos_count, scale);
    quantize_scaled(s, f, scale, q, ldq, bits, st, qt, ldqt);
    history_push_kernel<<<1, 1, 0, st>>>(bits, hist, len, pos_count, amax_out, cur);
    return;
  }
  amax_bits(s, bits, st);
  delayed_kernel<<<1, 1, 0, st>>>(bits, fmt_max(f), float(std::exp2(margin)), most_recent, hist, len, pos_count, scale,
                                  amax_out, cur);
  quantize_with_scale(s, f, scale, q, ldq, st, qt, ldqt);
}

}  // namespace vfp8
