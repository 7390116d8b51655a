// amax and FP8 quantisation on the GPU (fp8_kernels.hpp). Correctness first: one pass for the
// amax, one for the quantisation, a single thread for the scale bookkeeping. The transposed
// source (backward operands) is read uncoalesced; a vendor tuning this would tile it through
// shared memory.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

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

// (i, j) of the quantised matrix [rows, inner].
__device__ __forceinline__ float load_q(const Source& s, int64_t i, int64_t j) {
  return s.transpose ? load(s, j, i) : load(s, i, j);
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

__device__ __forceinline__ float scale_of(float a, float fmax, float mult) {
  return (a > 0.0f && isfinite(a)) ? a / fmax * mult : 1.0f;
}

__global__ void amax_kernel(Source s, unsigned* bits) {
  const int64_t n = s.R * s.C;
  unsigned m = 0;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n; k += int64_t(gridDim.x) * blockDim.x)
    m = max(m, abs_bits(load(s, k / s.C, k % s.C)));
  m = warp_max(m);
  if ((threadIdx.x & 31) == 0 && m != 0) atomicMax(bits, m);
}

__global__ void finish_amax(const unsigned* bits, float* out) { *out = __uint_as_float(*bits); }

__global__ void tensor_scale(const unsigned* bits, float fmax, float mult, float* scale, float* amax_out) {
  const float a = __uint_as_float(*bits);
  *scale = scale_of(a, fmax, mult);
  if (amax_out) *amax_out = a;
}

__global__ void quantize_kernel(Source s, Fmt f, const float* scale, unsigned char* q, int64_t ldq) {
  const float sc = *scale;
  const int64_t rows = s.rows(), inner = s.inner(), n = rows * inner;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n; k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = k / inner, j = k % inner;
    q[i * ldq + j] = to_fp8(load_q(s, i, j) / sc, f);
  }
}

// One warp per (row, 128-element tile).
__global__ void tile_kernel(Source s, Fmt f, float fmax, float mult, unsigned char* q, int64_t ldq, float* scale) {
  const int64_t rows = s.rows(), inner = s.inner(), nkb = (inner + 127) / 128;
  const int64_t w = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (w >= rows * nkb) return;
  const int64_t i = w % rows, kb = w / rows;
  float v[4];
  unsigned m = 0;
  for (int t = 0; t < 4; ++t) {
    const int64_t j = kb * 128 + lane + 32 * t;
    v[t] = j < inner ? load_q(s, i, j) : 0.0f;
    m = max(m, abs_bits(v[t]));
  }
  const float sc = scale_of(__uint_as_float(warp_max(m)), fmax, mult);
  if (lane == 0) scale[kb * rows + i] = sc;
  for (int t = 0; t < 4; ++t) {
    const int64_t j = kb * 128 + lane + 32 * t;
    if (j < inner) q[i * ldq + j] = to_fp8(v[t] / sc, f);
  }
}

// One thread block (256 threads) per 128x128 block; blocks past the last column of blocks write
// the padding scales.
__global__ void block_kernel(Source s, Fmt f, float fmax, float mult, unsigned char* q, int64_t ldq, float* scale) {
  const int64_t rows = s.rows(), inner = s.inner(), nkb = (inner + 127) / 128, kb4 = (nkb + 3) / 4 * 4;
  const int64_t rb = blockIdx.y, kb = blockIdx.x;
  if (kb >= nkb) {
    if (threadIdx.x == 0) scale[rb * kb4 + kb] = 1.0f;
    return;
  }
  const int64_t i0 = rb * 128, j0 = kb * 128;
  unsigned m = 0;
  for (int e = threadIdx.x; e < 128 * 128; e += blockDim.x) {
    const int64_t i = i0 + e / 128, j = j0 + e % 128;
    if (i < rows && j < inner) m = max(m, abs_bits(load_q(s, i, j)));
  }
  __shared__ unsigned part[8];
  __shared__ float sc_shared;
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
  for (int e = threadIdx.x; e < 128 * 128; e += blockDim.x) {
    const int64_t i = i0 + e / 128, j = j0 + e % 128;
    if (i < rows && j < inner) q[i * ldq + j] = to_fp8(load_q(s, i, j) / sc, f);
  }
}

// Delayed scaling's bookkeeping, one thread: the scale from the history of earlier calls, then
// this call's amax into it (a ring of `len` entries; pos_count = {next slot, entries filled}).
__global__ void delayed_kernel(const unsigned* bits, float fmax, float mult, bool most_recent, float* hist, int len,
                               int* pos_count, float* scale, float* amax_out, float* cur_out) {
  const float cur = __uint_as_float(*bits);
  const int pos = pos_count[0], count = pos_count[1];
  float a = cur;
  if (count > 0) {
    if (most_recent) {
      a = hist[(pos - 1 + len) % len];
    } else {
      unsigned b = 0;
      for (int k = 0; k < count; ++k) b = max(b, __float_as_uint(fabsf(hist[k])));
      a = __uint_as_float(b);
    }
  }
  *scale = scale_of(a, fmax, mult);
  hist[pos] = cur;
  pos_count[0] = (pos + 1) % len;
  pos_count[1] = count < len ? count + 1 : len;
  if (amax_out) *amax_out = cur;
  if (cur_out) *cur_out = cur;
}

int grid_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return int(b < 1 ? 1 : b > 4096 ? 4096 : b);
}

void amax_bits(const Source& s, uint32_t* bits, cudaStream_t st) {
  cudaMemsetAsync(bits, 0, sizeof(uint32_t), st);
  if (s.R * s.C > 0) amax_kernel<<<grid_for(s.R * s.C, 256), 256, 0, st>>>(s, bits);
}

}  // namespace

void amax(const Source& s, float* out, uint32_t* bits, cudaStream_t st) {
  amax_bits(s, bits, st);
  finish_amax<<<1, 1, 0, st>>>(bits, out);
}

void quantize_with_scale(const Source& s, Fmt f, const float* scale, void* q, int64_t ldq, cudaStream_t st) {
  const int64_t n = s.rows() * s.inner();
  if (n > 0) quantize_kernel<<<grid_for(n, 256), 256, 0, st>>>(s, f, scale, static_cast<unsigned char*>(q), ldq);
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
      const int64_t warps = rows * ceil_div(inner, 128);
      if (warps > 0) tile_kernel<<<int(ceil_div(warps, 8)), 256, 0, st>>>(s, f, fmax, mult, qb, ldq, scale);
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
                      int32_t* pos_count, void* q, int64_t ldq, float* scale, float* amax_out, float* cur,
                      uint32_t* bits, cudaStream_t st) {
  amax_bits(s, bits, st);
  delayed_kernel<<<1, 1, 0, st>>>(bits, fmt_max(f), float(std::exp2(margin)), most_recent, hist, len, pos_count, scale,
                                  amax_out, cur);
  quantize_with_scale(s, f, scale, q, ldq, st);
}

}  // namespace vfp8
