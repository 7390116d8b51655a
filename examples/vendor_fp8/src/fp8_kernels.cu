// amax and FP8 quantisation on the GPU (fp8_kernels.hpp). Every pass is bandwidth-bound, so the
// kernels are laid out for the memory system: rows walked with 16-byte loads where the source
// allows (bf16, 8-element aligned), and the transposed sources (the backward products' K-major
// copies) staged through shared memory so both the reads of x and the writes of q are coalesced.
// The first version (one element per thread, 64-bit div/mod, transposed reads straight from
// global memory) made the 1B FP8 training step 0.64x of bf16 on the H100 (2026-12-05).
// Quantisation divides by the scale (x / s, rounded once), the definition the tests check codes
// against; a multiply by 1/s would round twice.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>

#include "fp8_kernels.hpp"

namespace vfp8 {
namespace {

__device__ __forceinline__ float load(const Source& s, int64_t r, int64_t c) {
  // (r, c) of x [R, C] itself.
  const int64_t k = r * s.ldx + c;
  return s.type == In::f32 ? static_cast<const float*>(s.x)[k]
                           : __bfloat162float(static_cast<const __nv_bfloat16*>(s.x)[k]);
}

__device__ __forceinline__ unsigned char to_fp8(float v, Fmt f) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, f == Fmt::e4m3 ? __NV_E4M3 : __NV_E5M2);
}

// |v| as ordered bits: non-negative floats order as unsigned integers, and a NaN (positive once
// its sign is cleared) sorts above infinity, so a max over bits propagates NaN.
__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(fabsf(v)); }

__device__ __forceinline__ unsigned warp_max(unsigned b) {
  for (int o = 16; o > 0; o >>= 1) b = max(b, __shfl_xor_sync(0xffffffffu, b, o));
  return b;
}

// The block's max into *bits: one atomic per block. Thousands of blocks sending one atomic per
// warp to one address serialised at L2: that, not the reads, made the amax pass of the 1B FP8
// step 3.6x slower than a quantisation pass over the same data (ncu, H100, 2026-12-06). Every
// thread of the block calls it (it synchronises).
__device__ __forceinline__ void block_max_into(unsigned m, unsigned* bits) {
  __shared__ unsigned part[32];
  m = warp_max(m);
  const int w = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  if (lane == 0) part[w] = m;
  __syncthreads();
  if (w == 0) {
    m = lane < int(blockDim.x >> 5) ? part[lane] : 0u;
    m = warp_max(m);
    if (lane == 0 && m != 0) atomicMax(bits, m);
  }
}

__device__ __forceinline__ float scale_of(float a, float fmax, float mult) {
  return (a > 0.0f && isfinite(a)) ? a / fmax * mult : 1.0f;
}

// A row-walk over x [R, C]: 16-byte loads of 8 bf16 when the source allows it.
__device__ __forceinline__ bool vec8(const Source& s) {
  return s.type == In::bf16 && s.C % 8 == 0 && s.ldx % 8 == 0 && (reinterpret_cast<uintptr_t>(s.x) & 15) == 0;
}

__device__ __forceinline__ void load8(const Source& s, int64_t r, int64_t c, float v[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(s.x) + r * s.ldx + c);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    v[2 * k] = f.x;
    v[2 * k + 1] = f.y;
  }
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
  const float sc = *scale;
  const bool v8 = vec8(s) && ldq % 8 == 0 && (reinterpret_cast<uintptr_t>(q) & 7) == 0;
  unsigned m = 0;
  for (int64_t r = blockIdx.x; r < s.R; r += gridDim.x) {
    if (v8) {
      for (int64_t c = int64_t(threadIdx.x) * 8; c < s.C; c += int64_t(blockDim.x) * 8) {
        float v[8];
        load8(s, r, c, v);
        uint2 out;
        unsigned char* b = reinterpret_cast<unsigned char*>(&out);
        for (int k = 0; k < 8; ++k) {
          m = max(m, abs_bits(v[k]));
          b[k] = to_fp8(v[k] / sc, f);
        }
        *reinterpret_cast<uint2*>(q + r * ldq + c) = out;
      }
    } else {
      for (int64_t c = threadIdx.x; c < s.C; c += blockDim.x) {
        const float v = load(s, r, c);
        m = max(m, abs_bits(v));
        q[r * ldq + c] = to_fp8(v / sc, f);
      }
    }
  }
  if (bits) block_max_into(m, bits);
}

// The transposed passes (x^T: the backward products' K-major operands) stage a tile of 128 rows
// (tokens) x 64 columns of x in shared memory, transposed and as floats, T[column][row]: the
// reads are 16-byte words along x's rows, four per thread issued before any is used (the first
// version's one 2-byte load at a time per thread kept too few bytes in flight: 0.9 TB/s), and a
// warp then writes whole 128-byte rows of q (lane l the tokens l, l + 32, ...). The pitch of 129
// makes the column reads conflict-free and the transposing writes two-way at most.
// Out-of-range elements are staged as 0. Blocks of 256 threads; grid (ceil(C / 64), ceil(R / 128)).
constexpr int kTR = 128, kTC = 64, kTP = kTR + 1;

__device__ __forceinline__ unsigned stage_transposed(const Source& s, int64_t r0, int64_t c0, float (*T)[kTP]) {
  const bool v8 = vec8(s);
  float v[4][8];
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // 128 rows x 8 words of 8 columns: 4 words a thread
    const int e = int(threadIdx.x) + k * 256, a = e >> 3, b = (e & 7) * 8;
    const int64_t r = r0 + a, c = c0 + b;
    if (v8 && r < s.R && c < s.C) {  // (C is a multiple of 8 here)
      load8(s, r, c, v[k]);
    } else {
      for (int t = 0; t < 8; ++t) v[k][t] = (r < s.R && c + t < s.C) ? load(s, r, c + t) : 0.0f;
    }
  }
  unsigned m = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int e = int(threadIdx.x) + k * 256, a = e >> 3, b = (e & 7) * 8;
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      T[b + t][a] = v[k][t];
      m = max(m, abs_bits(v[k][t]));
    }
  }
  return m;
}

// Tensor scale, x^T. `bits` (may be null): the source's amax gathered in the same pass.
__global__ void __launch_bounds__(256) quantize_transposed_kernel(Source s, Fmt f, const float* scale,
                                                                  unsigned char* q, int64_t ldq, unsigned* bits) {
  __shared__ float T[kTC][kTP];
  const float sc = *scale;
  const int64_t c0 = int64_t(blockIdx.x) * kTC, r0 = int64_t(blockIdx.y) * kTR;
  const unsigned m = stage_transposed(s, r0, c0, T);
  __syncthreads();
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  for (int b = warp; b < kTC && c0 + b < s.C; b += 8) {
    unsigned char* qr = q + (c0 + b) * ldq + r0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int a = lane + 32 * i;
      if (r0 + a < s.R) qr[a] = to_fp8(T[b][a] / sc, f);
    }
  }
  if (bits) block_max_into(m, bits);
}

// 1x128 tiles of x itself: one warp per (row, tile), each lane 4 consecutive elements (one
// 8-byte load and one 4-byte store where allowed).
__global__ void tile_rows_kernel(Source s, Fmt f, float fmax, float mult, unsigned char* q, int64_t ldq, float* scale) {
  const int64_t rows = s.R, inner = s.C, nkb = (inner + 127) / 128;
  const int64_t w = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (w >= rows * nkb) return;
  const int64_t i = w % rows, kb = w / rows, j = kb * 128 + lane * 4;
  const bool v4 = s.type == In::bf16 && inner % 4 == 0 && s.ldx % 4 == 0 && (reinterpret_cast<uintptr_t>(s.x) & 7) == 0 &&
                  ldq % 4 == 0 && (reinterpret_cast<uintptr_t>(q) & 3) == 0;
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (v4) {
    if (j < inner) {
      const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(s.x) + i * s.ldx + j);
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
      const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
      v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
    }
  } else {
    for (int t = 0; t < 4; ++t) v[t] = j + t < inner ? load(s, i, j + t) : 0.0f;
  }
  unsigned m = 0;
  for (int t = 0; t < 4; ++t) m = max(m, abs_bits(v[t]));
  const float sc = scale_of(__uint_as_float(warp_max(m)), fmax, mult);
  if (lane == 0) scale[kb * rows + i] = sc;
  if (v4) {
    if (j < inner) {
      unsigned out = 0;
      for (int t = 0; t < 4; ++t) out |= unsigned(to_fp8(v[t] / sc, f)) << (8 * t);
      *reinterpret_cast<unsigned*>(q + i * ldq + j) = out;
    }
  } else {
    for (int t = 0; t < 4; ++t)
      if (j + t < inner) q[i * ldq + j + t] = to_fp8(v[t] / sc, f);
  }
}

// 1x128 tiles of x^T: the tiles run along x's rows (the tokens), so a staged tile of 128 rows
// is one tile per column: a warp takes a column's 128 values (lane l rows l, l + 32, ...), their
// max gives the scale s[blockIdx.y * rows + column], and the warp writes the 128 codes.
__global__ void __launch_bounds__(256) tile_transposed_kernel(Source s, Fmt f, float fmax, float mult,
                                                              unsigned char* q, int64_t ldq, float* scale) {
  __shared__ float T[kTC][kTP];
  const int64_t c0 = int64_t(blockIdx.x) * kTC, r0 = int64_t(blockIdx.y) * kTR, rows = s.C;
  stage_transposed(s, r0, c0, T);
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
    if (lane == 0) scale[blockIdx.y * rows + c0 + b] = sc;
    unsigned char* qr = q + (c0 + b) * ldq + r0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int a = lane + 32 * i;
      if (r0 + a < s.R) qr[a] = to_fp8(v[i] / sc, f);
    }
  }
}

// One thread block (256 threads) per 128x128 block of q; blocks past the last column of blocks
// write the padding scales. The block's amax is a pass read along x's rows (coalesced in either
// orientation); the quantisation then goes 32 rows of x at a time through shared memory, so a
// transposed copy is written along q's rows too.
__global__ void block_kernel(Source s, Fmt f, float fmax, float mult, unsigned char* q, int64_t ldq, float* scale) {
  const int64_t rows = s.rows(), inner = s.inner(), nkb = (inner + 127) / 128, kb4 = (nkb + 3) / 4 * 4;
  const int64_t rb = blockIdx.y, kb = blockIdx.x;
  if (kb >= nkb) {
    if (threadIdx.x == 0) scale[rb * kb4 + kb] = 1.0f;
    return;
  }
  // The block of q is rows i0.., inner j0..; in x that is rows xr0.. and columns xc0.. .
  const int64_t i0 = rb * 128, j0 = kb * 128;
  const int64_t xr0 = s.transpose ? j0 : i0, xc0 = s.transpose ? i0 : j0;
  unsigned m = 0;
  for (int e = threadIdx.x; e < 128 * 128; e += blockDim.x) {
    const int64_t r = xr0 + e / 128, c = xc0 + e % 128;
    if (r < s.R && c < s.C) m = max(m, abs_bits(load(s, r, c)));
  }
  __shared__ unsigned part[8];
  __shared__ float sc_shared;
  __shared__ float stage[32][129];
  m = warp_max(m);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned b = 0;
    for (int k = 0; k < int(blockDim.x / 32); ++k) b = max(b, part[k]);
    sc_shared = scale_of(__uint_as_float(b), fmax, mult);
    scale[rb * kb4 + kb] = sc_shared;
  }
  __syncthreads();
  const float sc = sc_shared;
  for (int a0 = 0; a0 < 128; a0 += 32) {
    for (int e = threadIdx.x; e < 32 * 128; e += blockDim.x) {
      const int a = e / 128, b = e % 128;
      const int64_t r = xr0 + a0 + a, c = xc0 + b;
      stage[a][b] = (r < s.R && c < s.C) ? load(s, r, c) : 0.0f;
    }
    __syncthreads();
    if (!s.transpose) {  // q rows = x rows: 32 rows of 128
      for (int e = threadIdx.x; e < 32 * 128; e += blockDim.x) {
        const int a = e / 128, b = e % 128;
        if (i0 + a0 + a < rows && j0 + b < inner) q[(i0 + a0 + a) * ldq + j0 + b] = to_fp8(stage[a][b] / sc, f);
      }
    } else {  // q rows = x columns: 128 rows of 32
      for (int e = threadIdx.x; e < 32 * 128; e += blockDim.x) {
        const int b = e / 32, a = e % 32;
        if (i0 + b < rows && j0 + a0 + a < inner) q[(i0 + b) * ldq + j0 + a0 + a] = to_fp8(stage[a][b] / sc, f);
      }
    }
    __syncthreads();
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

void quantize_scaled(const Source& s, Fmt f, const float* scale, void* q, int64_t ldq, unsigned* bits, cudaStream_t st) {
  if (s.R * s.C == 0) return;
  auto* qb = static_cast<unsigned char*>(q);
  if (s.transpose)
    quantize_transposed_kernel<<<dim3(unsigned(ceil_div(s.C, kTC)), unsigned(ceil_div(s.R, kTR))), 256, 0, st>>>(
        s, f, scale, qb, ldq, bits);
  else
    quantize_rows_kernel<<<row_blocks(s.R), 256, 0, st>>>(s, f, scale, qb, ldq, bits);
}

}  // namespace

void amax(const Source& s, float* out, uint32_t* bits, cudaStream_t st) {
  amax_bits(s, bits, st);
  finish_amax<<<1, 1, 0, st>>>(bits, out);
}

void quantize_with_scale(const Source& s, Fmt f, const float* scale, void* q, int64_t ldq, cudaStream_t st) {
  quantize_scaled(s, f, scale, q, ldq, nullptr, st);
}

void quantize_current(const Source& s, Fmt f, Grouping g, double margin, void* q, int64_t ldq, float* scale,
                      float* amax_out, uint32_t* bits, cudaStream_t st) {
  const float fmax = fmt_max(f), mult = float(std::exp2(margin));
  auto* qb = static_cast<unsigned char*>(q);
  const int64_t rows = s.rows(), inner = s.inner();
  switch (g) {
    case Grouping::tensor:
      amax_bits(s, bits, st);
      tensor_scale<<<1, 1, 0, st>>>(bits, fmax, mult, scale, amax_out);
      quantize_with_scale(s, f, scale, q, ldq, st);
      return;
    case Grouping::tile1x128: {
      if (rows == 0 || inner == 0) return;
      if (s.transpose) {
        tile_transposed_kernel<<<dim3(unsigned(ceil_div(s.C, kTC)), unsigned(ceil_div(s.R, kTR))), 256, 0, st>>>(
            s, f, fmax, mult, qb, ldq, scale);
      } else {
        const int64_t warps = rows * ceil_div(inner, 128);
        tile_rows_kernel<<<int(ceil_div(warps, 8)), 256, 0, st>>>(s, f, fmax, mult, qb, ldq, scale);
      }
      return;
    }
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
                      float* cur, uint32_t* bits, cudaStream_t st) {
  if (history_filled) {  // one pass over the source
    cudaMemsetAsync(bits, 0, sizeof(uint32_t), st);
    history_scale_kernel<<<1, 1, 0, st>>>(fmt_max(f), float(std::exp2(margin)), most_recent, hist, len, pos_count, scale);
    quantize_scaled(s, f, scale, q, ldq, bits, st);
    history_push_kernel<<<1, 1, 0, st>>>(bits, hist, len, pos_count, amax_out, cur);
    return;
  }
  amax_bits(s, bits, st);
  delayed_kernel<<<1, 1, 0, st>>>(bits, fmt_max(f), float(std::exp2(margin)), most_recent, hist, len, pos_count, scale,
                                  amax_out, cur);
  quantize_with_scale(s, f, scale, q, ldq, st);
}

}  // namespace vfp8
