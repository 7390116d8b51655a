// MLA copies of the CUDA engine (mla_kernels.hpp says what each computes). Memory-bound and
// small (N H (dn + dr + dv) elements); a grid-stride loop, one thread per output element.
#include <cuda_bf16.h>

#include <algorithm>

#include "rlhost/engine_cuda/device_memory.hpp"
#include "mla_kernels.hpp"

namespace rlh::engine::cuda {
namespace {

unsigned grid_for(int64_t n) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, 132 * 32)));
}

__global__ void assemble_kernel(const __nv_bfloat16* __restrict__ kv,
                                const __nv_bfloat16* __restrict__ krot, int64_t ldkrot,
                                __nv_bfloat16* __restrict__ k, __nv_bfloat16* __restrict__ v,
                                int64_t ld, int64_t N, int64_t H, int64_t dn, int64_t dr,
                                int64_t dv) {
  const int64_t D = dn + dr, row = H * (D + dv);  // outputs per token: keys, then values
  const int64_t total = N * row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / row, r = i - n * row;
    const __nv_bfloat16* kvr = kv + n * H * (dn + dv);
    if (r < H * D) {  // key element (h, j)
      const int64_t h = r / D, j = r - h * D;
      k[n * ld + h * D + j] = j < dn ? kvr[h * (dn + dv) + j] : krot[n * ldkrot + (j - dn)];
    } else {  // value element (h, j)
      const int64_t q = r - H * D, h = q / dv, j = q - h * dv;
      v[n * ld + h * dv + j] = kvr[h * (dn + dv) + dn + j];
    }
  }
}

__global__ void split_kernel(const __nv_bfloat16* __restrict__ dk,
                             const __nv_bfloat16* __restrict__ dvv, int64_t ld,
                             __nv_bfloat16* __restrict__ dkv, __nv_bfloat16* __restrict__ dkrot,
                             int64_t lddkrot, int64_t N, int64_t H, int64_t dn, int64_t dr,
                             int64_t dv) {
  const int64_t D = dn + dr, W = H * (dn + dv), row = W + dr;  // dkv's row, then dkrot's
  const int64_t total = N * row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / row, r = i - n * row;
    if (r < W) {
      const int64_t h = r / (dn + dv), j = r - h * (dn + dv);
      dkv[n * W + r] = j < dn ? dk[n * ld + h * D + j] : dvv[n * ld + h * dv + (j - dn)];
    } else {
      const int64_t c = r - W;
      float acc = 0.f;
      for (int64_t h = 0; h < H; ++h) acc += __bfloat162float(dk[n * ld + h * D + dn + c]);
      dkrot[n * lddkrot + c] = __float2bfloat16_rn(acc);
    }
  }
}

}  // namespace

void mla_assemble_kv(const bf16* kv, const bf16* krot, int64_t ldkrot, bf16* k, bf16* v,
                     int64_t ld, int64_t N, int64_t H, int64_t dn, int64_t dr, int64_t dv,
                     cudaStream_t s) {
  const int64_t total = N * H * (dn + dr + dv);
  if (total <= 0) return;
  assemble_kernel<<<grid_for(total), 256, 0, s>>>(
      reinterpret_cast<const __nv_bfloat16*>(kv), reinterpret_cast<const __nv_bfloat16*>(krot),
      ldkrot, reinterpret_cast<__nv_bfloat16*>(k), reinterpret_cast<__nv_bfloat16*>(v), ld, N, H,
      dn, dr, dv);
  check(cudaGetLastError(), "mla_assemble_kv");
}

void mla_split_dkv(const bf16* dk, const bf16* dval, int64_t ld, bf16* dkv, bf16* dkrot,
                   int64_t lddkrot, int64_t N, int64_t H, int64_t dn, int64_t dr, int64_t dv,
                   cudaStream_t s) {
  const int64_t total = N * (H * (dn + dv) + dr);
  if (total <= 0) return;
  split_kernel<<<grid_for(total), 256, 0, s>>>(
      reinterpret_cast<const __nv_bfloat16*>(dk), reinterpret_cast<const __nv_bfloat16*>(dval), ld,
      reinterpret_cast<__nv_bfloat16*>(dkv), reinterpret_cast<__nv_bfloat16*>(dkrot), lddkrot, N,
      H, dn, dr, dv);
  check(cudaGetLastError(), "mla_split_dkv");
}

}  // namespace rlh::engine::cuda
