// Element-wise and reduction ops: bias_add_fwd, bias_bwd, add_fwd, sumsq, scale, and the
// column reduction that bias_bwd and rmsnorm_bwd share (deterministic: fixed row chunks summed
// in chunk order).
#include <cstdlib>

#include "colreduce.cuh"
#include "multi_tensor.cuh"

namespace rlh::kcuda {

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("kernels_cuda ") + what + ": " + cudaGetErrorString(e));
}

bool env_switch_on(const char* name) {
  const char* e = std::getenv(name);
  return e == nullptr || std::string(e) != "0";
}

bool pdl_enabled() {
  static const bool on = [] {
    if (!env_switch_on("RLH_KCUDA_PDL")) return false;
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
      return false;
    return major >= 9;
  }();
  return on;
}

namespace {

template <class T>
__global__ void bias_add_kernel(T* y, int64_t ldy, const T* b, int64_t N, int64_t M) {
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  const int64_t total = N * M;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / M, c = i - r * M;
    y[r * ldy + c] = from_f<T>(to_f(y[r * ldy + c]) + to_f(b[c]));
  }
}

template <class T>
__global__ void add_kernel(T* y, const T* a, const T* b, int64_t n) {
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] = from_f<T>(to_f(a[i]) + to_f(b[i]));
}

// Vectorised add for bf16 (8 per thread) when everything is 16-byte aligned.
__global__ void add_bf16x8_kernel(uint4* y, const uint4* a, const uint4* b, int64_t n8) {
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n8;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint4 va = a[i], vb = b[i], vy;
    const __nv_bfloat162* pa = reinterpret_cast<const __nv_bfloat162*>(&va);
    const __nv_bfloat162* pb = reinterpret_cast<const __nv_bfloat162*>(&vb);
    __nv_bfloat162* py = reinterpret_cast<__nv_bfloat162*>(&vy);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 fa = __bfloat1622float2(pa[k]), fb = __bfloat1622float2(pb[k]);
      py[k] = __floats2bfloat162_rn(fa.x + fb.x, fa.y + fb.y);
    }
    y[i] = vy;
  }
}

__global__ void sumsq_partial_kernel(MtList l, double* partial) {
  const int64_t b = blockIdx.x;
  const int t = mt_tensor_of(l, b);
  const int64_t i0 = (b - l.block_start[t]) * kMtChunk;
  const int64_t i1 = min(l.n[t], i0 + kMtChunk);
  double acc = 0;
  if (l.bf16[0][t]) {
    const bf16* x = static_cast<const bf16*>(l.p[0][t]);
    for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
      const double v = __bfloat162float(x[i]);
      acc += v * v;
    }
  } else {
    const float* x = static_cast<const float*>(l.p[0][t]);
    for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
      const double v = x[i];
      acc += v * v;
    }
  }
  __shared__ double sh[32];
  acc = block_sum(acc, sh);
  if (threadIdx.x == 0) partial[l.partial_base + b] = acc;
}

__global__ void sum_partials_kernel(const double* partial, int64_t n, float* out) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
  __shared__ double sh[32];
  acc = block_sum(acc, sh);
  if (threadIdx.x == 0) *out = float(acc);
}

__global__ void scale_kernel(MtList l, float factor) {
  const int64_t b = blockIdx.x;
  const int t = mt_tensor_of(l, b);
  const int64_t i0 = (b - l.block_start[t]) * kMtChunk;
  const int64_t i1 = min(l.n[t], i0 + kMtChunk);
  if (l.bf16[0][t]) {
    bf16* x = static_cast<bf16*>(l.p[0][t]);
    for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x)
      x[i] = __float2bfloat16_rn(__bfloat162float(x[i]) * factor);
  } else {
    float* x = static_cast<float*>(l.p[0][t]);
    for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) x[i] *= factor;
  }
}

template <class T>
__global__ void store_rows_kernel(T* dst, const float* src, int64_t n, bool accumulate) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_f<T>(accumulate ? to_f(dst[i]) + src[i] : src[i]);
}

unsigned grid_for(int64_t n, int threads = 256) {
  return unsigned(std::min<int64_t>((n + threads - 1) / threads, 132 * 16));
}

struct BiasTerm {
  template <class T>
  __device__ float operator()(const T* dy, int64_t lddy, int64_t r, int64_t c) const {
    return to_f(dy[r * lddy + c]);
  }
};

}  // namespace

void bias_add_fwd(DType t, void* y, int64_t ldy, const void* b, int64_t N, int64_t M,
                  cudaStream_t s) {
  if (N * M == 0) return;
  if (t == DType::f32)
    launch_pdl(bias_add_kernel<float>, grid_for(N * M), 256, 0, s, static_cast<float*>(y), ldy,
                                                    static_cast<const float*>(b), N, M);
  else
    launch_pdl(bias_add_kernel<bf16>, grid_for(N * M), 256, 0, s, static_cast<bf16*>(y), ldy,
                                                    static_cast<const bf16*>(b), N, M);
  check_launch("bias_add_fwd");
}

void bias_bwd(DType t, Flex db, const void* dy, int64_t lddy, int64_t N, int64_t M,
              Workspace& ws, cudaStream_t s) {
  if (M == 0) return;
  if (t == DType::f32)
    column_reduce(static_cast<const float*>(dy), lddy, N, M, BiasTerm{}, nullptr, db, true, ws, s);
  else
    column_reduce(static_cast<const bf16*>(dy), lddy, N, M, BiasTerm{}, nullptr, db, true, ws, s);
  check_launch("bias_bwd");
}

void add_fwd(DType t, void* y, const void* a, const void* b, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  if (t == DType::f32) {
    launch_pdl(add_kernel<float>, grid_for(n), 256, 0, s, static_cast<float*>(y), static_cast<const float*>(a),
                                           static_cast<const float*>(b), n);
  } else {
    const bool vec = n % 8 == 0 && (reinterpret_cast<uintptr_t>(y) | reinterpret_cast<uintptr_t>(a) |
                                    reinterpret_cast<uintptr_t>(b)) % 16 == 0;
    if (vec)
      launch_pdl(add_bf16x8_kernel, grid_for(n / 8), 256, 0, s, 
          static_cast<uint4*>(y), static_cast<const uint4*>(a), static_cast<const uint4*>(b), n / 8);
    else
      launch_pdl(add_kernel<bf16>, grid_for(n), 256, 0, s, static_cast<bf16*>(y), static_cast<const bf16*>(a),
                                             static_cast<const bf16*>(b), n);
  }
  check_launch("add_fwd");
}

void sumsq(const TensorList& x, float* out, Workspace& ws, cudaStream_t s) {
  const int64_t total = mt_total_blocks(x);
  if (total == 0) {
    cudaMemsetAsync(out, 0, sizeof(float), s);
    check_launch("sumsq");
    return;
  }
  auto* partial = static_cast<double*>(ws.get(size_t(total) * sizeof(double)));
  mt_for_each(&x, 1, [&](const MtList& l, int64_t blocks) {
    sumsq_partial_kernel<<<unsigned(blocks), 256, 0, s>>>(l, partial);
  });
  sum_partials_kernel<<<1, 1024, 0, s>>>(partial, total, out);
  check_launch("sumsq");
}

void scale(const TensorList& x, float factor, Workspace&, cudaStream_t s) {
  mt_for_each(&x, 1, [&](const MtList& l, int64_t blocks) {
    scale_kernel<<<unsigned(blocks), 256, 0, s>>>(l, factor);
  });
  check_launch("scale");
}

void store_rows(DType t, void* dst, const float* src, int64_t n, bool accumulate, cudaStream_t s) {
  if (n == 0) return;
  if (t == DType::f32)
    store_rows_kernel<<<grid_for(n), 256, 0, s>>>(static_cast<float*>(dst), src, n, accumulate);
  else
    store_rows_kernel<<<grid_for(n), 256, 0, s>>>(static_cast<bf16*>(dst), src, n, accumulate);
  check_launch("store_rows");
}

}  // namespace rlh::kcuda
