// The CUDA engine's own kernels: what is not an op of the contract (docs/ops.md).
#include <cuda_bf16.h>

#include <algorithm>
#include <stdexcept>

#include "rlhost/engine_cuda/convert.hpp"
#include "rlhost/engine_cuda/device_memory.hpp"
#include "moe_kernels.hpp"
#include "tp_kernels.hpp"

namespace rlh::engine::cuda {
namespace {

// Refreshes the bf16 working copy from the fp32 master weights after AdamW: 4 elements per
// thread with 16-byte loads (the flat buffers are 256-byte aligned; the tail goes one by one).
__global__ void cast_kernel(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst,
                            int64_t n) {
  const int64_t n4 = n / 4;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += stride) {
    const float4 v = reinterpret_cast<const float4*>(src)[i];
    __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y);
    __nv_bfloat162 hi = __floats2bfloat162_rn(v.z, v.w);
    reinterpret_cast<__nv_bfloat162*>(dst)[2 * i] = lo;
    reinterpret_cast<__nv_bfloat162*>(dst)[2 * i + 1] = hi;
  }
  for (int64_t i = n4 * 4 + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride)
    dst[i] = __float2bfloat16_rn(src[i]);
}

// One row of a strided 2-D block per blockIdx.y (a refit's piece of a fused tensor, or a whole
// tensor as one row), grid-strided along it.
__global__ void convert_2d_kernel(const float* __restrict__ src, int64_t src_ld, __nv_bfloat16* __restrict__ dst,
                                  int64_t dst_ld, int64_t cols) {
  const float* s = src + int64_t(blockIdx.y) * src_ld;
  __nv_bfloat16* d = dst + int64_t(blockIdx.y) * dst_ld;
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < cols; c += int64_t(gridDim.x) * blockDim.x)
    d[c] = __float2bfloat16_rn(s[c]);
}

__global__ void widen_kernel(const __nv_bfloat16* __restrict__ src, float* __restrict__ dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __bfloat162float(src[i]);
}


// The sequence of token t in a packing (cu [S+1], cu[S] == N): the last s with cu[s] <= t.
__device__ __forceinline__ int64_t seq_of(const int32_t* cu, int64_t S, int64_t t) {
  int64_t lo = 0, hi = S;  // cu[lo] <= t < cu[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (cu[mid] <= t) lo = mid; else hi = mid;
  }
  return lo;
}

// Kernel order (entry t predicts token t + 1) -> token-aligned outputs (entry t is about token
// t; 0 at a sequence's first token): shift_to_outputs on the device.
__global__ void shift_to_outputs_kernel(const float* k, float* out, const int32_t* cu, int64_t S, int64_t N) {
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < N; t += int64_t(gridDim.x) * blockDim.x)
    out[t] = t == cu[seq_of(cu, S, t)] ? 0.f : k[t - 1];
}
// Token-aligned gradients -> kernel order (0 at a sequence's last token): shift_to_kernel.
__global__ void shift_to_kernel_kernel(const float* out, float* k, const int32_t* cu, int64_t S, int64_t N) {
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < N; t += int64_t(gridDim.x) * blockDim.x)
    k[t] = t + 1 < cu[seq_of(cu, S, t) + 1] ? out[t + 1] : 0.f;
}
}  // namespace

void convert_f32_to_bf16_2d(const float* src, int64_t src_ld, void* dst, int64_t dst_ld, int64_t rows,
                            int64_t cols, cudaStream_t s) {
  if (rows <= 0 || cols <= 0) return;
  if (rows == 1 && src_ld >= cols && dst_ld >= cols && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(dst) % 8 == 0) {
    cast_to_bf16(src, dst, cols, s);  // the vector path
    return;
  }
  for (int64_t r0 = 0; r0 < rows; r0 += 65535) {  // gridDim.y's limit
    const int64_t r = std::min<int64_t>(rows - r0, 65535);
    const int64_t bx = std::min<int64_t>((cols + 255) / 256, std::max<int64_t>(1, 2048 / r));
    convert_2d_kernel<<<dim3(unsigned(bx), unsigned(r)), 256, 0, s>>>(
        src + r0 * src_ld, src_ld, static_cast<__nv_bfloat16*>(dst) + r0 * dst_ld, dst_ld, cols);
  }
  check(cudaGetLastError(), "convert_f32_to_bf16_2d");
}

void convert_bf16_to_f32(const void* src, float* dst, int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 132 * 16);
  widen_kernel<<<unsigned(blocks), 256, 0, s>>>(static_cast<const __nv_bfloat16*>(src), dst, n);
  check(cudaGetLastError(), "convert_bf16_to_f32");
}

void cast_to_bf16(const float* src, void* dst, int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  const int64_t blocks = std::min<int64_t>((n / 4 + 255) / 256 + 1, 132 * 16);
  cast_kernel<<<unsigned(blocks), 256, 0, s>>>(src, static_cast<__nv_bfloat16*>(dst), n);
  check(cudaGetLastError(), "cast_to_bf16");
}

namespace {
__global__ void add_f32_kernel(float* __restrict__ dst, const float* __restrict__ src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] += src[i];
}
}  // namespace

void add_f32(float* dst, const float* src, int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 132 * 16);
  add_f32_kernel<<<unsigned(blocks), 256, 0, s>>>(dst, src, n);
  check(cudaGetLastError(), "add_f32");
}

}  // namespace rlh::engine::cuda

// ---------------------------------------------------------------------------------------------
// MoE helpers (cuda_engine_impl.hpp): the fp64 router's GEMMs, conversions, the auxiliary
// losses. None of them is a hot path (router-sized: N x E x C), so they are written for
// clarity and determinism (fixed summation order, no atomics on floats), not speed.
namespace rlh::engine::cuda {
namespace {

__device__ inline double ld(const double* p, int64_t i) { return p[i]; }
__device__ inline double ld(const float* p, int64_t i) { return double(p[i]); }
__device__ inline double ld(const __nv_bfloat16* p, int64_t i) {
  return double(__bfloat162float(p[i]));
}
// MODE 0: write (+ bias[n]); MODE 1: accumulate, rounding the fp64 sum to the output's
// precision first (the CPU engine: out += float(sum)).
__device__ inline void st(double* p, int64_t i, double v, bool acc) { p[i] = acc ? p[i] + v : v; }
__device__ inline void st(float* p, int64_t i, double v, bool acc) {
  p[i] = acc ? p[i] + float(v) : float(v);
}
__device__ inline void st(__nv_bfloat16* p, int64_t i, double v, bool acc) {
  p[i] = __float2bfloat16_rn(acc ? __bfloat162float(p[i]) + float(v) : float(v));
}

// C[m, n] (=|+=) sum_k A(m, k) B(k, n) in fp64; 32 x 32 tiles, 256 threads (4 outputs each),
// operands staged through shared memory with the unit-stride index on the thread lanes.
template <class TA, class TB, class TO>
__global__ void f64_gemm_kernel(int64_t M, int64_t Nn, int64_t K, const TA* A, int64_t sam,
                                int64_t sak, const TB* B, int64_t sbk, int64_t sbn, TO* Cp,
                                int64_t ldc, const float* bias, bool acc) {
  __shared__ double As[32][33], Bs[32][33];  // As[m][k], Bs[k][n]
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const int64_t m0 = int64_t(blockIdx.y) * 32, n0 = int64_t(blockIdx.x) * 32;
  double s[4] = {0, 0, 0, 0};
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    for (int i = 0; i < 4; ++i) {
      const int r = ty + 8 * i;
      if (sak == 1) {  // lanes along k
        const int64_t m = m0 + r, k = k0 + tx;
        As[r][tx] = (m < M && k < K) ? ld(A, m * sam + k) : 0.0;
      } else {         // lanes along m
        const int64_t m = m0 + tx, k = k0 + r;
        As[tx][r] = (m < M && k < K) ? ld(A, m * sam + k * sak) : 0.0;
      }
      if (sbn == 1) {  // lanes along n
        const int64_t k = k0 + r, n = n0 + tx;
        Bs[r][tx] = (k < K && n < Nn) ? ld(B, k * sbk + n) : 0.0;
      } else {         // lanes along k
        const int64_t k = k0 + tx, n = n0 + r;
        Bs[tx][r] = (k < K && n < Nn) ? ld(B, k * sbk + n * sbn) : 0.0;
      }
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < 32; ++kk) {
      const double b = Bs[kk][tx];
      for (int i = 0; i < 4; ++i) s[i] += As[ty + 8 * i][kk] * b;
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i) {
    const int64_t m = m0 + ty + 8 * i, n = n0 + tx;
    if (m < M && n < Nn) st(Cp, m * ldc + n, s[i] + (bias ? double(bias[n]) : 0.0), acc);
  }
}

template <class TA, class TB, class TO>
void f64_gemm(int64_t M, int64_t Nn, int64_t K, const TA* A, int64_t sam, int64_t sak,
              const TB* B, int64_t sbk, int64_t sbn, TO* Cp, int64_t ldc, const float* bias,
              bool acc, cudaStream_t s) {
  if (M <= 0 || Nn <= 0) return;
  const dim3 grid(unsigned((Nn + 31) / 32), unsigned((M + 31) / 32));
  f64_gemm_kernel<<<grid, 256, 0, s>>>(M, Nn, K, A, sam, sak, B, sbk, sbn, Cp, ldc, bias, acc);
  check(cudaGetLastError(), "f64 router gemm");
}

template <class S, class D>
__global__ void convert_kernel(const S* src, D* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = D(src[i]);
}

unsigned blocks_for(int64_t n) { return unsigned(std::min<int64_t>((n + 255) / 256, 132 * 8)); }

__global__ void iota_kernel(int32_t* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    p[i] = int32_t(i);
}

// Column sums of dz [N, E] in fp64 in row order, added to an fp32 bias gradient.
__global__ void colsum_kernel(const double* dz, float* gb, int64_t N, int64_t E) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (e >= E) return;
  double acc = 0;
  for (int64_t n = 0; n < N; ++n) acc += dz[n * E + e];
  gb[e] += float(acc);
}

constexpr int kLossThreads = 512;  // a power of two (the tree sums)

__device__ double block_sum(double v, double* part) {
  part[threadIdx.x] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (int(threadIdx.x) < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  const double r = part[0];
  __syncthreads();
  return r;
}

// One block: the values of one layer's auxiliary losses for one micro-batch (moe.cpp's
// moe_losses with grads = false), in a fixed order.
template <class T>
__global__ void loss_values_kernel(MoeLossArgs a, const T* probs, const T* lse, double* stats) {
  extern __shared__ double smem[];
  double* part = smem;                                     // [blockDim]
  int* counts = reinterpret_cast<int*>(smem + blockDim.x);  // [E]
  const int tid = threadIdx.x, bd = blockDim.x;
  const int64_t E = a.E, K = a.K, N = a.N;
  double acc = 0;
  const int64_t segments = a.mode == 1 ? 1 : a.mode == 2 ? a.S : 0;
  for (int64_t q = 0; q < segments; ++q) {
    const int64_t b = a.mode == 1 ? 0 : a.cu[q], e_ = a.mode == 1 ? N : a.cu[q + 1];
    if (e_ <= b) continue;  // the same for every thread
    const double Ts = double(e_ - b);
    const double f = a.mode == 1 ? a.aux_coef * double(E) / (double(K) * double(N) * a.tokens)
                                 : a.aux_coef * double(E) / (double(K) * Ts * Ts * a.seqs);
    for (int64_t e = tid; e < E; e += bd)
      counts[e] = a.mode == 1 ? a.offsets[e + 1] - a.offsets[e] : 0;
    __syncthreads();
    if (a.mode == 2)
      for (int64_t i = b * K + tid; i < e_ * K; i += bd) {
        const int32_t x = a.experts[i];
        if (x >= 0 && x < E) atomicAdd(&counts[x], 1);  // integers: the order cannot show
      }
    __syncthreads();
    const int64_t cols = E < bd ? E : bd, slices = bd / cols;
    for (int64_t e0 = 0; e0 < E; e0 += cols) {
      const int64_t e = e0 + tid % cols, sl = tid / cols;
      double P = 0;
      if (sl < slices && e < E)
        for (int64_t n = b + sl; n < e_; n += slices) P += double(probs[n * E + e]);
      part[tid] = P;
      __syncthreads();
      if (tid < cols && e0 + tid < E) {
        double tot = 0;
        for (int64_t s = 0; s < slices; ++s) tot += part[s * cols + tid];
        acc += f * double(counts[e0 + tid]) * tot;
      }
      __syncthreads();
    }
  }
  double z = 0;
  if (a.z_coef != 0)
    for (int64_t n = tid; n < N; n += bd) z += double(lse[n]) * double(lse[n]);
  const double aux_total = block_sum(acc, part);
  const double z_total = block_sum(z, part);
  if (tid == 0) {
    stats[0] += aux_total;
    stats[1] += a.z_coef / a.tokens * z_total;
    int32_t mx = 0;
    for (int64_t e = 0; e < E; ++e) mx = max(mx, a.offsets[e + 1] - a.offsets[e]);
    stats[2] = fmax(stats[2], double(mx) / double(N * K));
  }
}

// aux_loss: d/dp_ne = f c_e for every token (counts from the offsets).
template <class T>
__global__ void aux_grad_kernel(MoeLossArgs a, T* dprobs) {
  const double f = a.aux_coef * double(a.E) / (double(a.K) * double(a.N) * a.tokens);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < a.N * a.E;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = i % a.E;
    dprobs[i] = T(f * double(a.offsets[e + 1] - a.offsets[e]));
  }
}

// seq_aux_loss: one block per sequence, d/dp_ne = f_s c_se for its tokens.
template <class T>
__global__ void seq_grad_kernel(MoeLossArgs a, T* dprobs) {
  extern __shared__ int cnt[];  // [E]
  const int64_t q = blockIdx.x, b = a.cu[q], e_ = a.cu[q + 1], E = a.E, K = a.K;
  if (e_ <= b) return;  // the whole block
  const double Ts = double(e_ - b);
  const double f = a.aux_coef * double(E) / (double(K) * Ts * Ts * a.seqs);
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int64_t i = b * K + threadIdx.x; i < e_ * K; i += blockDim.x) {
    const int32_t x = a.experts[i];
    if (x >= 0 && x < E) atomicAdd(&cnt[x], 1);
  }
  __syncthreads();
  for (int64_t i = b * E + threadIdx.x; i < e_ * E; i += blockDim.x)
    dprobs[i] = T(f * double(cnt[i % E]));
}

// z-loss: d/dlse_n = 2 coef / T lse_n.
template <class T>
__global__ void z_grad_kernel(MoeLossArgs a, const T* lse, T* dlse) {
  for (int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; n < a.N;
       n += int64_t(gridDim.x) * blockDim.x)
    dlse[n] = T(2 * a.z_coef / a.tokens * double(lse[n]));
}

}  // namespace

void f64_gemm_logits(const bf16* x, int64_t ldx, const float* W, const float* bias, double* z,
                     int64_t N, int64_t E, int64_t C, cudaStream_t s) {
  // z(n, e) = sum_c x(n, c) W(e, c): A = x (m = n, k = c), B(k = c, n = e) = W[e C + c]
  f64_gemm(N, E, C, reinterpret_cast<const __nv_bfloat16*>(x), ldx, int64_t(1), W, int64_t(1), C,
           z, E, bias, false, s);
}
void f64_gemm_dx(const double* dz, const float* W, bf16* dx, int64_t N, int64_t E, int64_t C,
                 cudaStream_t s) {
  // dx(n, c) += sum_e dz(n, e) W(e, c)
  f64_gemm(N, C, E, dz, E, int64_t(1), W, C, int64_t(1), reinterpret_cast<__nv_bfloat16*>(dx), C,
           nullptr, true, s);
}
void f64_gemm_dw(const double* dz, const bf16* x, float* gW, int64_t N, int64_t E, int64_t C,
                 cudaStream_t s) {
  // gW(e, c) += sum_n dz(n, e) x(n, c): A(m = e, k = n) = dz[n E + e], B(k = n, c) = x[n C + c]
  f64_gemm(E, C, N, dz, int64_t(1), E, reinterpret_cast<const __nv_bfloat16*>(x), C, int64_t(1),
           gW, C, nullptr, true, s);
}
void f64_colsum_acc(const double* dz, float* gb, int64_t N, int64_t E, cudaStream_t s) {
  if (E <= 0) return;
  colsum_kernel<<<unsigned((E + 127) / 128), 128, 0, s>>>(dz, gb, N, E);
  check(cudaGetLastError(), "router bias gradient");
}
void f64_to_f32(const double* src, float* dst, int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  convert_kernel<<<blocks_for(n), 256, 0, s>>>(src, dst, n);
  check(cudaGetLastError(), "f64_to_f32");
}
void f32_to_f64(const float* src, double* dst, int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  convert_kernel<<<blocks_for(n), 256, 0, s>>>(src, dst, n);
  check(cudaGetLastError(), "f32_to_f64");
}
void shift_to_outputs_device(const float* kernel, float* out, const int32_t* cu, int64_t S, int64_t N,
                             cudaStream_t s) {
  if (N <= 0) return;
  shift_to_outputs_kernel<<<blocks_for(N), 256, 0, s>>>(kernel, out, cu, S, N);
  check(cudaGetLastError(), "shift to outputs");
}
void shift_to_kernel_device(const float* out, float* kernel, const int32_t* cu, int64_t S, int64_t N,
                            cudaStream_t s) {
  if (N <= 0) return;
  shift_to_kernel_kernel<<<blocks_for(N), 256, 0, s>>>(out, kernel, cu, S, N);
  check(cudaGetLastError(), "shift to kernel");
}
void iota_i32(int32_t* p, int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  iota_kernel<<<blocks_for(n), 256, 0, s>>>(p, n);
  check(cudaGetLastError(), "iota");
}

template <class T>
void moe_loss_values(const MoeLossArgs& a, const T* probs, const T* lse, double* stats,
                     cudaStream_t s) {
  const size_t smem = kLossThreads * sizeof(double) + size_t(a.E) * sizeof(int);
  if (smem > 48 * 1024) throw std::invalid_argument("cuda engine: too many experts for the MoE loss kernel");
  loss_values_kernel<T><<<1, kLossThreads, smem, s>>>(a, probs, lse, stats);
  check(cudaGetLastError(), "moe loss values");
}

template <class T>
void moe_loss_grads(const MoeLossArgs& a, const T* lse, T* dprobs, T* dlse, cudaStream_t s) {
  if (dprobs && a.mode == 1) aux_grad_kernel<T><<<blocks_for(a.N * a.E), 256, 0, s>>>(a, dprobs);
  if (dprobs && a.mode == 2 && a.S > 0) {
    // every row belongs to one sequence (cu runs 0 .. N), so every row is written
    seq_grad_kernel<T><<<unsigned(a.S), 256, size_t(a.E) * sizeof(int), s>>>(a, dprobs);
  }
  if (dlse) z_grad_kernel<T><<<blocks_for(a.N), 256, 0, s>>>(a, lse, dlse);
  check(cudaGetLastError(), "moe loss gradients");
}

template void moe_loss_values<float>(const MoeLossArgs&, const float*, const float*, double*,
                                     cudaStream_t);
template void moe_loss_values<double>(const MoeLossArgs&, const double*, const double*, double*,
                                      cudaStream_t);
template void moe_loss_grads<float>(const MoeLossArgs&, const float*, float*, float*,
                                    cudaStream_t);
template void moe_loss_grads<double>(const MoeLossArgs&, const double*, double*, double*,
                                     cudaStream_t);

}  // namespace rlh::engine::cuda

// ---------------------------------------------------------------------------------------------
// Tensor parallelism's glue (tp_kernels.hpp)

namespace rlh::engine::cuda {
namespace {

unsigned grid_for(int64_t n) { return unsigned(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, 132 * 16))); }

__global__ void tp_embedding_fwd_kernel(float* out, const int32_t* ids, const __nv_bfloat16* table, int64_t N,
                                        int64_t C, int64_t vlo, int64_t vcount) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < N * C; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / C, c = i - n * C, id = int64_t(ids[n]) - vlo;
    out[i] = id >= 0 && id < vcount ? __bfloat162float(table[id * C + c]) : 0.f;
  }
}

__global__ void tp_embedding_bwd_kernel(float* dtable, const int32_t* ids, const __nv_bfloat16* dout, int64_t N,
                                        int64_t C, int64_t vlo, int64_t vcount) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t id = int64_t(ids[n]) - vlo;
    if (id >= 0 && id < vcount) dtable[id * C + c] += __bfloat162float(dout[n * C + c]);
  }
}

__global__ void tp_local_target_kernel(int32_t* local, const int32_t* target, int64_t N, int64_t vlo, int64_t vcount) {
  for (int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = int64_t(target[n]) - vlo;
    local[n] = target[n] >= 0 && t >= 0 && t < vcount ? int32_t(t) : -1;
  }
}

__global__ void tp_head_pack_kernel(float* mine, const float* lp, const float* lse, const float* ent,
                                    const int32_t* local, int64_t N) {
  for (int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x) {
    mine[n] = lse[n];
    mine[N + n] = ent[n];
    mine[2 * N + n] = local[n] >= 0 ? lp[n] + lse[n] : 0.f;
  }
}

__global__ void tp_head_combine_kernel(const float* all, int64_t T, const int32_t* target, int64_t N, float* lp,
                                       float* lse, float* ent) {
  for (int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x) {
    // In double: the statistics are of T blocks whose lse may lie far apart.
    double m = -INFINITY;
    for (int64_t r = 0; r < T; ++r) m = fmax(m, double(all[r * 3 * N + n]));
    double sum = 0, zt = 0;
    for (int64_t r = 0; r < T; ++r) {
      sum += exp(double(all[r * 3 * N + n]) - m);
      zt += double(all[r * 3 * N + 2 * N + n]);
    }
    const double l = m + log(sum);
    double ez = 0;  // E[z] = sum_r w_r E_r[z], E_r[z] = lse_r - entropy_r
    for (int64_t r = 0; r < T; ++r) {
      const double lr = all[r * 3 * N + n];
      ez += exp(lr - l) * (lr - double(all[r * 3 * N + N + n]));
    }
    lse[n] = float(l);
    lp[n] = target[n] < 0 ? 0.f : float(zt - l);
    if (ent) ent[n] = float(l - ez);
  }
}

template <bool CAP>
__global__ void tp_head_grad_kernel(const float* x, __nv_bfloat16* dx, int64_t ld, int64_t rows, int64_t vcount, int64_t n0,
                                    const int32_t* target, int64_t vlo, const float* lse, const float* ent,
                                    const float* dlp, const float* dent, float inv_temp, float cap) {
  const int64_t r = blockIdx.x;
  if (r >= rows) return;
  const int64_t n = n0 + r;
  const float a = target[n] >= 0 ? dlp[n] : 0.f, b = dent ? dent[n] : 0.f, l = lse[n];
  const float ez = dent ? l - ent[n] : 0.f;
  const int64_t t = target[n] >= 0 ? int64_t(target[n]) - vlo : -1;
  const float* xr = x + r * ld;
  __nv_bfloat16* dr = dx + r * ld;
  for (int64_t j = threadIdx.x; j < vcount; j += blockDim.x) {
    float z, f;
    if (CAP) {
      const float u = tanhf(xr[j] / cap);
      z = cap * u * inv_temp;
      f = (1.f - u * u) * inv_temp;
    } else {
      z = xr[j] * inv_temp;
      f = inv_temp;
    }
    const float p = expf(z - l);
    float dz = -a * p - b * p * (z - ez);
    if (j == t) dz += a;
    dr[j] = __float2bfloat16(dz * f);
  }
}

__global__ void tp_store_bf16_kernel(__nv_bfloat16* dst, int64_t ldd, const float* src, int64_t rows, int64_t cols,
                                     bool add) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * cols;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    __nv_bfloat16& d = dst[r * ldd + c];
    d = __float2bfloat16(add ? __bfloat162float(d) + src[i] : src[i]);
  }
}

}  // namespace

void tp_embedding_fwd(float* out, const int32_t* ids, const bf16* table, int64_t N, int64_t C, int64_t vlo,
                      int64_t vcount, cudaStream_t s) {
  if (N * C <= 0) return;
  tp_embedding_fwd_kernel<<<grid_for(N * C), 256, 0, s>>>(out, ids, reinterpret_cast<const __nv_bfloat16*>(table), N,
                                                           C, vlo, vcount);
  check(cudaGetLastError(), "tp_embedding_fwd");
}

void tp_embedding_bwd(float* dtable, const int32_t* ids, const bf16* dout, int64_t N, int64_t C, int64_t vlo,
                      int64_t vcount, cudaStream_t s) {
  if (N * C <= 0) return;
  tp_embedding_bwd_kernel<<<unsigned((C + 127) / 128), 128, 0, s>>>(
      dtable, ids, reinterpret_cast<const __nv_bfloat16*>(dout), N, C, vlo, vcount);
  check(cudaGetLastError(), "tp_embedding_bwd");
}

void tp_local_target(int32_t* local, const int32_t* target, int64_t N, int64_t vlo, int64_t vcount, cudaStream_t s) {
  if (N <= 0) return;
  tp_local_target_kernel<<<grid_for(N), 256, 0, s>>>(local, target, N, vlo, vcount);
  check(cudaGetLastError(), "tp_local_target");
}

void tp_head_pack(float* mine, const float* lp, const float* lse, const float* ent, const int32_t* local,
                  int64_t N, cudaStream_t s) {
  if (N <= 0) return;
  tp_head_pack_kernel<<<grid_for(N), 256, 0, s>>>(mine, lp, lse, ent, local, N);
  check(cudaGetLastError(), "tp_head_pack");
}

void tp_head_combine(const float* all, int64_t T, const int32_t* target, int64_t N, float* lp, float* lse,
                     float* ent, cudaStream_t s) {
  if (N <= 0) return;
  tp_head_combine_kernel<<<grid_for(N), 256, 0, s>>>(all, T, target, N, lp, lse, ent);
  check(cudaGetLastError(), "tp_head_combine");
}

void tp_head_grad_tile(const float* x, bf16* dx, int64_t ld, int64_t rows, int64_t vcount, int64_t n0, const int32_t* target,
                       int64_t vlo, const float* lse, const float* ent, const float* dlp, const float* dent,
                       float inv_temp, float cap, cudaStream_t s) {
  if (rows <= 0 || vcount <= 0) return;
  auto* d = reinterpret_cast<__nv_bfloat16*>(dx);
  if (cap > 0)
    tp_head_grad_kernel<true><<<unsigned(rows), 256, 0, s>>>(x, d, ld, rows, vcount, n0, target, vlo, lse, ent, dlp,
                                                             dent, inv_temp, cap);
  else
    tp_head_grad_kernel<false><<<unsigned(rows), 256, 0, s>>>(x, d, ld, rows, vcount, n0, target, vlo, lse, ent, dlp,
                                                              dent, inv_temp, cap);
  check(cudaGetLastError(), "tp_head_grad_tile");
}

void tp_store_bf16(bf16* dst, int64_t ldd, const float* src, int64_t rows, int64_t cols, bool add, cudaStream_t s) {
  if (rows * cols <= 0) return;
  tp_store_bf16_kernel<<<grid_for(rows * cols), 256, 0, s>>>(reinterpret_cast<__nv_bfloat16*>(dst), ldd, src, rows,
                                                             cols, add);
  check(cudaGetLastError(), "tp_store_bf16");
}

}  // namespace rlh::engine::cuda
