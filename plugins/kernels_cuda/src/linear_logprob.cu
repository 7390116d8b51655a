// Kernels of the fused linear + logprob head (linear_logprob.cpp runs the chunk GEMMs):
// per-row online log-sum-exp / entropy statistics of a logits tile merged into a running
// state, the final logprob/lse/entropy, and the logits gradient of a tile. fp32 throughout.
#include <algorithm>
#include <cfloat>

#include "common.cuh"

namespace rlh::kcuda {
namespace {

// Running softmax state: max m, s = sum e^(z-m), t = sum e^(z-m) z.
struct Stat {
  float m, s, t;
};
__device__ __forceinline__ Stat merge(Stat a, Stat b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f, 0.f};
  const float ea = a.m == -INFINITY ? 0.f : __expf(a.m - m);
  const float eb = b.m == -INFINITY ? 0.f : __expf(b.m - m);
  return {m, a.s * ea + b.s * eb, a.t * ea + b.t * eb};
}
__device__ __forceinline__ void push(Stat& st, float z) {
  if (z > st.m) {
    const float e = st.m == -INFINITY ? 0.f : __expf(st.m - z);
    st.s = st.s * e + 1.f;
    st.t = st.t * e + z;
    st.m = z;
  } else {
    const float e = __expf(z - st.m);
    st.s += e;
    st.t += e * z;
  }
}

template <bool VEC, bool CAP>
__global__ void __launch_bounds__(256)
tile_stats_kernel(const float* logits, int64_t cols, int64_t ld, int64_t v0,
                  const int32_t* target, int64_t K, float inv_temp, float cap, float* m, float* sum,
                  float* tz, float* zt, bool first, int* err, int64_t V) {
  const int64_t r = blockIdx.x;
  const float* row = logits + r * ld;
  Stat st{-INFINITY, 0.f, 0.f};
  if (VEC) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
    for (int64_t j = threadIdx.x; j < cols / 4; j += blockDim.x) {
      const float4 x = r4[j];
      push(st, soft_cap_if<CAP>(x.x, cap) * inv_temp);
      push(st, soft_cap_if<CAP>(x.y, cap) * inv_temp);
      push(st, soft_cap_if<CAP>(x.z, cap) * inv_temp);
      push(st, soft_cap_if<CAP>(x.w, cap) * inv_temp);
    }
  } else {
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) push(st, soft_cap_if<CAP>(row[j], cap) * inv_temp);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Stat other{__shfl_xor_sync(0xffffffffu, st.m, o), __shfl_xor_sync(0xffffffffu, st.s, o),
               __shfl_xor_sync(0xffffffffu, st.t, o)};
    st = merge(st, other);
  }
  __shared__ Stat sh[8];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sh[warp] = st;
  __syncthreads();
  if (threadIdx.x == 0) {
    Stat acc = sh[0];
    for (int w = 1; w < int(blockDim.x >> 5); ++w) acc = merge(acc, sh[w]);
    if (!first) acc = merge(Stat{m[r], sum[r], tz[r]}, acc);
    m[r] = acc.m;
    sum[r] = acc.s;
    tz[r] = acc.t;
  }
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    const int32_t t = target[r * K + k];
    if (first) zt[r * K + k] = 0.f;
    if (t >= V && err) atomicExch(err, 1);
    if (t >= v0 && t < v0 + cols) zt[r * K + k] = soft_cap_if<CAP>(row[t - v0], cap) * inv_temp;
  }
}

__global__ void finish_kernel(const float* m, const float* sum, const float* tz, const float* zt,
                              const int32_t* target, int64_t N, int64_t K, Flex logprob, Flex lse,
                              Flex entropy) {
  const int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (n >= N) return;
  const float l = m[n] + logf(sum[n]);
  if (logprob.p)
    for (int64_t k = 0; k < K; ++k)
      st_flex(logprob, n * K + k, target[n * K + k] < 0 ? 0.f : zt[n * K + k] - l);
  if (lse.p) st_flex(lse, n, l);
  if (entropy.p) st_flex(entropy, n, l - tz[n] / sum[n]);
}

// dz_j = sum_k dlp_k (1[j = t_k] - p_j) - dent p_j (z_j - E[z]); targets < 0 take no part.
// The tile holds the uncapped logits x (softcap c > 0: z = c tanh(x / c) / temperature, and
// dx = dz / temperature / cosh^2(x / c)).
template <class T, bool CAP>
__global__ void tile_grad_kernel(const float* logits, int64_t rows, int64_t cols, int64_t ld,
                                 int64_t v0, const int32_t* target, int64_t K, float inv_temp,
                                 float cap, Flex lse, Flex dlogprob, Flex entropy, Flex dentropy,
                                 T* dlogits, int64_t ldd) {
  const int64_t r = blockIdx.y;
  const float l = ld_flex(lse, r);
  float dlp = 0.f;  // sum of the gradients of the row's present targets
  for (int64_t k = 0; k < K && dlogprob.p; ++k)
    if (target[r * K + k] >= 0) dlp += ld_flex(dlogprob, r * K + k);
  const float dent = dentropy.p ? ld_flex(dentropy, r) : 0.f;
  const float ez = (dentropy.p && entropy.p) ? l - ld_flex(entropy, r) : 0.f;
  const float* row = logits + r * ld;
  T* drow = dlogits + r * ldd;
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < cols;
       j += int64_t(gridDim.x) * blockDim.x) {
    const float z = soft_cap_if<CAP>(row[j], cap) * inv_temp;
    const float p = __expf(z - l);
    float dz = -dlp * p;
    if (dlogprob.p)
      for (int64_t k = 0; k < K; ++k)
        if (v0 + j == target[r * K + k]) dz += ld_flex(dlogprob, r * K + k);
    if (dent != 0.f) dz -= dent * p * (z - ez);
    drow[j] = from_f<T>(dz * inv_temp * soft_cap_grad_if<CAP>(row[j], cap));
  }
}

// The same, 4 columns a thread (16-byte loads, 8- or 16-byte stores), with the row's targets
// and their gradients read once into shared memory (K <= kMaxK) instead of once per element:
// the per-element math and its order are tile_grad_kernel's, so the results are bitwise equal.
// One pass reads the f32 tile and writes the gradient, so it runs at memory bandwidth.
constexpr int kMaxK = 32;

template <class T>
__device__ __forceinline__ void store4(T* p, float a, float b, float c, float d);
template <>
__device__ __forceinline__ void store4<float>(float* p, float a, float b, float c, float d) {
  *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
}
template <>
__device__ __forceinline__ void store4<bf16>(bf16* p, float a, float b, float c, float d) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
  uint2 v;
  v.x = *reinterpret_cast<uint32_t*>(&lo);
  v.y = *reinterpret_cast<uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(p) = v;
}

template <class T, bool CAP>
__global__ void __launch_bounds__(256)
tile_grad_vec_kernel(const float* logits, int64_t cols, int64_t ld, int64_t v0, const int32_t* target, int64_t K,
                     float inv_temp, float cap, Flex lse, Flex dlogprob, Flex entropy, Flex dentropy, T* dlogits,
                     int64_t ldd) {
  const int64_t r = blockIdx.y;
  __shared__ int64_t tcol[kMaxK];  // target column in this tile (-1: none)
  __shared__ float tgrad[kMaxK];
  __shared__ float row_dlp;
  if (threadIdx.x < K) {
    const int32_t t = target[r * K + threadIdx.x];
    tcol[threadIdx.x] = (dlogprob.p && t >= 0) ? int64_t(t) - v0 : -1;
    tgrad[threadIdx.x] = dlogprob.p ? ld_flex(dlogprob, r * K + threadIdx.x) : 0.f;
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // in k order, as tile_grad_kernel sums it
    float dlp = 0.f;
    for (int64_t k = 0; k < K && dlogprob.p; ++k)
      if (target[r * K + k] >= 0) dlp += tgrad[k];
    row_dlp = dlp;
  }
  __syncthreads();
  const float dlp = row_dlp;
  const float l = ld_flex(lse, r);
  const float dent = dentropy.p ? ld_flex(dentropy, r) : 0.f;
  const float ez = (dentropy.p && entropy.p) ? l - ld_flex(entropy, r) : 0.f;
  const float4* row = reinterpret_cast<const float4*>(logits + r * ld);
  T* drow = dlogits + r * ldd;
  const int64_t n4 = cols / 4;
  // Unrolled so that a thread has several 16-byte loads in flight (a block walks a wide tile).
#pragma unroll 4
  for (int64_t q = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; q < n4; q += int64_t(gridDim.x) * blockDim.x) {
    const float4 x = row[q];
    float out[4];
    const float in[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float z = soft_cap_if<CAP>(in[e], cap) * inv_temp;
      const float p = __expf(z - l);
      float dz = -dlp * p;
      for (int64_t k = 0; k < K; ++k)
        if (tcol[k] == 4 * q + e) dz += tgrad[k];
      if (dent != 0.f) dz -= dent * p * (z - ez);
      out[e] = dz * inv_temp * soft_cap_grad_if<CAP>(in[e], cap);
    }
    store4<T>(drow + 4 * q, out[0], out[1], out[2], out[3]);
  }
}

}  // namespace

namespace {

template <bool CAP>
void launch_tile_stats(const float* logits, int64_t rows, int64_t cols, int64_t ld, int64_t v0,
                       const int32_t* target, int64_t K, float inv_temp, float cap, float* m, float* sum,
                       float* tz, float* zt, bool first, int* err, int64_t V, cudaStream_t s) {
  const bool vec = cols % 4 == 0 && ld % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  if (vec)
    tile_stats_kernel<true, CAP><<<unsigned(rows), 256, 0, s>>>(logits, cols, ld, v0, target, K, inv_temp, cap, m,
                                                                sum, tz, zt, first, err, V);
  else
    tile_stats_kernel<false, CAP><<<unsigned(rows), 256, 0, s>>>(logits, cols, ld, v0, target, K, inv_temp, cap, m,
                                                                 sum, tz, zt, first, err, V);
}

template <class T, bool CAP>
void launch_tile_grad(const float* logits, int64_t rows, int64_t cols, int64_t ld, int64_t v0, const int32_t* target,
                      int64_t K, float inv_temp, float cap, Flex lse, Flex dlogprob, Flex entropy, Flex dentropy,
                      T* dlogits, int64_t ldd, cudaStream_t s) {
  const size_t out_align = sizeof(T) == 4 ? 16 : 8;
  if (K <= kMaxK && cols % 4 == 0 && ld % 4 == 0 && ldd % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(dlogits) % out_align == 0) {
    // Blocks a row: enough for the GPU when rows are few, one when they are many (a block then
    // walks the row's whole tile, so its per-row setup, the targets and two barriers, is paid
    // once per row instead of once per 4 KiB).
    // At the 1B step's 4096 x 32768 tiles: ~409 -> ~298 us a tile (1.9 -> 2.6 TB/s, H100 ncu,
    // 2026-12-07). RLH_KCUDA_HEAD_WIDE=0: 32 blocks a row as before (the A/B).
    static const bool wide = env_switch_on("RLH_KCUDA_HEAD_WIDE");
    const int64_t want = wide ? std::max<int64_t>(1, 2048 / rows) : 32;
    dim3 grid(unsigned(std::min<int64_t>({(cols / 4 + 255) / 256, want, 32})), unsigned(rows));
    tile_grad_vec_kernel<T, CAP><<<grid, 256, 0, s>>>(logits, cols, ld, v0, target, K, inv_temp, cap, lse, dlogprob,
                                                      entropy, dentropy, dlogits, ldd);
    return;
  }
  dim3 grid(unsigned(std::min<int64_t>((cols + 255) / 256, 64)), unsigned(rows));
  tile_grad_kernel<T, CAP><<<grid, 256, 0, s>>>(logits, rows, cols, ld, v0, target, K, inv_temp, cap, lse, dlogprob,
                                                entropy, dentropy, dlogits, ldd);
}

}  // namespace

void logprob_tile_stats(const float* logits, int64_t rows, int64_t cols, int64_t ld, int64_t v0,
                        const int32_t* target, int64_t K, float inv_temp, float cap, float* m,
                        float* sum, float* tz, float* zt, bool first, int* err, int64_t V,
                        cudaStream_t s) {
  if (rows == 0) return;
  if (cap > 0)
    launch_tile_stats<true>(logits, rows, cols, ld, v0, target, K, inv_temp, cap, m, sum, tz, zt, first, err, V, s);
  else
    launch_tile_stats<false>(logits, rows, cols, ld, v0, target, K, inv_temp, cap, m, sum, tz, zt, first, err, V, s);
  check_launch("linear_logprob (stats)");
}

void logprob_finish(const float* m, const float* sum, const float* tz, const float* zt,
                    const int32_t* target, int64_t N, int64_t K, Flex logprob, Flex lse,
                    Flex entropy, cudaStream_t s) {
  if (N == 0) return;
  finish_kernel<<<ceil_div(N, 256), 256, 0, s>>>(m, sum, tz, zt, target, N, K, logprob, lse,
                                                 entropy);
  check_launch("linear_logprob (finish)");
}

void logprob_tile_grad(DType t, const float* logits, int64_t rows, int64_t cols, int64_t ld,
                       int64_t v0, const int32_t* target, int64_t K, float inv_temp, float cap,
                       Flex lse, Flex dlogprob, Flex entropy, Flex dentropy, void* dlogits, int64_t ldd,
                       cudaStream_t s) {
  if (rows == 0 || cols == 0) return;
  auto* d32 = static_cast<float*>(dlogits);
  auto* d16 = static_cast<bf16*>(dlogits);
  if (t == DType::f32 && cap > 0)
    launch_tile_grad<float, true>(logits, rows, cols, ld, v0, target, K, inv_temp, cap, lse, dlogprob, entropy,
                                  dentropy, d32, ldd, s);
  else if (t == DType::f32)
    launch_tile_grad<float, false>(logits, rows, cols, ld, v0, target, K, inv_temp, cap, lse, dlogprob, entropy,
                                   dentropy, d32, ldd, s);
  else if (cap > 0)
    launch_tile_grad<bf16, true>(logits, rows, cols, ld, v0, target, K, inv_temp, cap, lse, dlogprob, entropy,
                                 dentropy, d16, ldd, s);
  else
    launch_tile_grad<bf16, false>(logits, rows, cols, ld, v0, target, K, inv_temp, cap, lse, dlogprob, entropy,
                                  dentropy, d16, ldd, s);
  check_launch("linear_logprob (grad)");
}

}  // namespace rlh::kcuda
