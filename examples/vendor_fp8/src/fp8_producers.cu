// Quantisation fused into the kernels that produce a product's input (fp8_kernels.hpp,
// ProducerArgs): RMSNorm, a residual add and RMSNorm, and SwiGLU, each writing the FP8 codes and
// 1x128 tile scales of what it produces. Why: at a decoding step's 64-256 rows the quantisation
// passes were launch- and latency-bound (~5 us each, four a layer: 12-14% of an FP8 step's kernel
// time on an H100, 2026-12-06), and the produced bf16 values were written only to be read again.
//
// Layout: 16 lanes hold a 128-element tile, 8 consecutive values each (16-byte loads), so a
// tile's amax is a half-warp's max and its codes are 8 bytes a lane, as fp8_kernels.cu's
// tile_rows_kernel writes them (the same Divisor, codes and scale: fp8_codes.cuh).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "fp8_codes.cuh"
#include "fp8_kernels.hpp"

namespace vfp8 {
namespace {

using bf16 = __nv_bfloat16;

// Rounds v to bf16 in place and stores it (p may be null: rounded only).
__device__ __forceinline__ void round_store8(void* p, float v[8]) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    h[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
    const float2 f = __bfloat1622float2(h[k]);
    v[2 * k] = f.x;
    v[2 * k + 1] = f.y;
  }
  if (p) *static_cast<uint4*>(p) = u;
}

// The tile's scale and this lane's 8 codes of v (already rounded to bf16). Every lane of the
// half-warp calls it (valid = false: a lane past the row's end, amax 0, nothing written).
__device__ __forceinline__ void quantise8(const float v[8], bool valid, unsigned char* q, float* scale, int hl,
                                          unsigned mask, Fmt f, float fmax, float mult) {
  unsigned m = 0;
  if (valid)
#pragma unroll
    for (int k = 0; k < 8; ++k) m = max(m, abs_bits(v[k]));
  for (int o = 8; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(mask, m, o));
  const float sc = scale_of(__uint_as_float(m), fmax, mult);
  if (hl == 0 && valid) *scale = sc;  // (a half-warp wholly past the row's end has no tile)
  if (valid) *reinterpret_cast<uint2*>(q) = codes8(v, Divisor(sc), f);
}

constexpr int kNormThreads = 256;  // a row's block: 2048 values a sweep

// One row a block (grid-stride over rows). Pass 1: the squares (of a + b rounded to bf16, which
// is written, for the add form). Pass 2: the normalised values, rounded, stored (y) and
// quantised per tile. x (or the sum) is read twice; the second read hits L1/L2 (a row is 4 KiB at
// C = 2048).
template <bool ADD>
__global__ void __launch_bounds__(kNormThreads) norm_quant_kernel(ProducerArgs p, float fmax, float mult) {
  __shared__ float part[kNormThreads / 32];
  const int tid = int(threadIdx.x), hl = tid & 15;
  const unsigned mask = 0xffffu << (tid & 16);
  for (int64_t r = blockIdx.x; r < p.R; r += gridDim.x) {
    const bf16* xr = static_cast<const bf16*>(p.x) + r * p.ldx;
    const bf16* br = ADD ? static_cast<const bf16*>(p.b) + r * p.ldb : nullptr;
    bf16* sr = ADD ? static_cast<bf16*>(p.sum) + r * p.ld_sum : nullptr;
    float ss = 0.f;
    for (int64_t c = int64_t(tid) * 8; c < p.C; c += kNormThreads * 8) {
      float v[8];
      load8_bf16(xr + c, v);
      if (ADD) {
        float u[8];
        load8_bf16(br + c, u);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] += u[k];
        round_store8(sr + c, v);
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) ss = fmaf(v[k], v[k], ss);
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((tid & 31) == 0) part[tid >> 5] = ss;
    __syncthreads();  // (also makes the sum's writes visible to the block's second pass)
    ss = 0.f;
#pragma unroll
    for (int k = 0; k < kNormThreads / 32; ++k) ss += part[k];
    const float mean = ss / float(p.C) + p.eps;
    float rs = rsqrtf(mean);
    rs = rs * (1.5f - 0.5f * mean * rs * rs);  // one Newton step: 1/sqrtf to rounding
    const bf16* src = ADD ? sr : xr;
    const bf16* w = static_cast<const bf16*>(p.w);
    for (int64_t c0 = 0; c0 < p.C; c0 += kNormThreads * 8) {  // uniform trip count: the shuffles
      const int64_t c = c0 + int64_t(tid) * 8;
      const bool valid = c < p.C;
      float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (valid) {
        float wv[8];
        load8_bf16(src + c, v);
        load8_bf16(w + c, wv);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = v[k] * rs * (wv[k] + p.offset);
        round_store8(p.y ? static_cast<bf16*>(p.y) + r * p.ldy + c : nullptr, v);
      }
      quantise8(v, valid, static_cast<unsigned char*>(p.q) + r * p.ldq + c, p.scale + (c / 128) * p.R + r, hl, mask,
                p.fmt, fmax, mult);
    }
    __syncthreads();  // part[] is rewritten by the next row
  }
}

// A (row, tile) unit a half-warp, grid-stride: silu(gate) up as kernels compute SwiGLU
// (g / (1 + e^-g) as g * sigmoid(g), times up), rounded, stored and quantised.
__global__ void __launch_bounds__(256) swiglu_quant_kernel(ProducerArgs p, float fmax, float mult) {
  const int hl = int(threadIdx.x & 15);
  const unsigned mask = 0xffffu << (threadIdx.x & 16);
  const int64_t tiles = (p.C + 127) / 128, units = p.R * tiles;
  const int64_t stride = int64_t(gridDim.x) * (blockDim.x >> 4);
  for (int64_t u = int64_t(blockIdx.x) * (blockDim.x >> 4) + (threadIdx.x >> 4); u < units; u += stride) {
    const int64_t r = u % p.R, kb = u / p.R, c = kb * 128 + hl * 8;
    const bool valid = c < p.C;
    float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (valid) {
      const bf16* gr = static_cast<const bf16*>(p.x) + r * p.ldx;
      float up[8];
      load8_bf16(gr + c, v);
      load8_bf16(gr + p.C + c, up);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = v[k] * (1.f / (1.f + expf(-v[k]))) * up[k];
      round_store8(p.y ? static_cast<bf16*>(p.y) + r * p.ldy + c : nullptr, v);
    }
    quantise8(v, valid, static_cast<unsigned char*>(p.q) + r * p.ldq + c, p.scale + kb * p.R + r, hl, mask, p.fmt,
              fmax, mult);
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

std::string producer_unsupported(const ProducerArgs& p) {
  if (p.kind != Producer::rmsnorm && p.kind != Producer::add_rmsnorm && p.kind != Producer::swiglu)
    return "an unknown producer";
  if (p.C % 8 != 0) return "the produced rows must be a multiple of 8 wide (got " + std::to_string(p.C) + ")";
  if (p.ldx % 8 != 0 || p.ldq % 8 != 0 || (p.y && p.ldy % 8 != 0) ||
      (p.kind == Producer::add_rmsnorm && (p.ldb % 8 != 0 || p.ld_sum % 8 != 0)))
    return "row strides must be multiples of 8 elements";
  return "";
}

void quantize_producer(const ProducerArgs& p, cudaStream_t st) {
  if (p.R <= 0 || p.C <= 0) return;
  // Pointers are checked here as well as strides: a call's tensors, not its handle's shapes.
  if (!aligned16(p.x) || !aligned16(p.q) || (p.y && !aligned16(p.y)) ||
      (p.kind != Producer::swiglu && !aligned16(p.w)) ||
      (p.kind == Producer::add_rmsnorm && (!aligned16(p.b) || !aligned16(p.sum))))
    throw std::invalid_argument("the producer's operands must be 16-byte aligned");
  const float fmax = fmt_max(p.fmt), mult = float(std::exp2(p.margin));
  switch (p.kind) {
    case Producer::rmsnorm:
      norm_quant_kernel<false><<<int(std::min<int64_t>(p.R, 65535)), kNormThreads, 0, st>>>(p, fmax, mult);
      return;
    case Producer::add_rmsnorm:
      norm_quant_kernel<true><<<int(std::min<int64_t>(p.R, 65535)), kNormThreads, 0, st>>>(p, fmax, mult);
      return;
    case Producer::swiglu: {
      const int64_t units = p.R * ((p.C + 127) / 128);
      swiglu_quant_kernel<<<int(std::min<int64_t>(ceil_div(units, 16), 4096)), 256, 0, st>>>(p, fmax, mult);
      return;
    }
    case Producer::none: break;
  }
  throw std::invalid_argument("an unknown producer");
}

}  // namespace vfp8
