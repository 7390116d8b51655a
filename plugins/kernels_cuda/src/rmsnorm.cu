// rmsnorm: y = x * rstd * (w + w_offset), rstd = 1/sqrt(mean(x^2) + eps), fp32 arithmetic.
// One warp per row (a block per row for the forward of up to 128 rows: a decoding step's norms,
// same bits); 16-byte loads when rows and pointers allow. The backward writes dx per row
// (warp) and sums dw over rows with the deterministic column reduction; for bf16 rows of up to
// 4096 values a block of 32 rows does both (rmsnorm_bwd_rows_kernel).
#include <stdexcept>
#include <type_traits>

#include "colreduce.cuh"
#include "norm_math.cuh"

namespace rlh::kcuda {
namespace {

constexpr int kWarps = 8;

// Loads 8 consecutive elements as floats (one 16-byte load for bf16, two for f32).
__device__ __forceinline__ void unpack8(const uint4& u, float* v) {  // 8 bf16 held in a register
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    v[2 * k] = f.x;
    v[2 * k + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const bf16* p, float* v) { unpack8(*reinterpret_cast<const uint4*>(p), v); }
__device__ __forceinline__ void load8(const float* p, float* v) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
__device__ __forceinline__ void store8(bf16* p, const float* v) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}
__device__ __forceinline__ void store8(float* p, const float* v) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
}

// y = x * rstd * (w + woff) over the lane's 8-value chunks (rstd from norm_math.cuh): the
// second half of rmsnorm_fwd_kernel, shared with add_rmsnorm_fwd_kernel so their bits agree.
template <class T, bool VEC>
__device__ __forceinline__ void normalize_row(T* yr, const T* xr, const T* w, int64_t C, float rs, float woff,
                                              int lane) {
  if (VEC) {
    constexpr int kOut = 4;  // x and w chunks in flight together
    for (int64_t c0 = lane * 8; c0 < C; c0 += 256 * kOut) {
      float v[kOut][8], wv[kOut][8];
#pragma unroll
      for (int b = 0; b < kOut; ++b)
        if (c0 + 256 * b < C) {
          load8(xr + c0 + 256 * b, v[b]);
          load8(w + c0 + 256 * b, wv[b]);
        }
#pragma unroll
      for (int b = 0; b < kOut; ++b) {
        if (c0 + 256 * b >= C) break;
#pragma unroll
        for (int k = 0; k < 8; ++k) v[b][k] = v[b][k] * rs * (wv[b][k] + woff);
        store8(yr + c0 + 256 * b, v[b]);
      }
    }
  } else {
    for (int64_t c = lane; c < C; c += 32) yr[c] = from_f<T>(to_f(xr[c]) * rs * (to_f(w[c]) + woff));
  }
}

template <class T, bool VEC>
__global__ void __launch_bounds__(kWarps * 32)
rmsnorm_fwd_kernel(T* y, int64_t ldy, Flex rstd_out, const T* x, int64_t ldx, const T* w,
                   int64_t N, int64_t C, float eps, float woff) {
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * int64_t(kWarps) + (threadIdx.x >> 5);
  if (row >= N) return;
  const T* xr = x + row * ldx;
  T* yr = y + row * ldy;
  float ss = 0.f;
  // A lane's 8-value chunks are 256 apart; kBatch of them are loaded before any is summed, so
  // their loads are in flight together (one at a time, a decoding step's rows of 2048 took 8
  // dependent round trips: ~7 us a norm at batch 1). The sum runs in the same order as before.
  constexpr int kBatch = 8;
  if (VEC) {
    for (int64_t c0 = lane * 8; c0 < C; c0 += 256 * kBatch) {
      float v[kBatch][8];
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (c0 + 256 * b < C) load8(xr + c0 + 256 * b, v[b]);
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (c0 + 256 * b >= C) break;
        sumsq8(ss, v[b]);
      }
    }
  } else {
    for (int64_t c = lane; c < C; c += 32) {
      const float v = to_f(xr[c]);
      ss = fmaf(v, v, ss);
    }
  }
  ss = warp_sum(ss);
  const float rs = rstd_of(ss, C, eps);
  normalize_row<T, VEC>(yr, xr, w, C, rs, woff, lane);
  if (lane == 0 && rstd_out.p) st_flex(rstd_out, row, rs);
}

// add_rmsnorm_fwd: y = a + b (rounded to T), then rmsnorm_fwd_kernel's arithmetic on y, in its
// order: the same lane walks the same 8-value chunks, summing squares in chunk and element order,
// so yn is bitwise what add_fwd then rmsnorm_fwd give (y is re-read from the lane's own writes).
template <class T, bool VEC>
__global__ void __launch_bounds__(kWarps * 32)
add_rmsnorm_fwd_kernel(T* y, T* yn, const T* a, const T* b, const T* w, int64_t N, int64_t C, float eps,
                       float woff) {
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * int64_t(kWarps) + (threadIdx.x >> 5);
  if (row >= N) return;
  const T* ar = a + row * C;
  const T* br = b + row * C;
  T* yr = y + row * C;
  T* nr = yn + row * C;
  float ss = 0.f;
  if (VEC) {
    constexpr int kBatch = 4;  // chunks of a and b in flight together
    for (int64_t c0 = lane * 8; c0 < C; c0 += 256 * kBatch) {
      float va[kBatch][8], vb[kBatch][8];
#pragma unroll
      for (int q = 0; q < kBatch; ++q)
        if (c0 + 256 * q < C) {
          load8(ar + c0 + 256 * q, va[q]);
          load8(br + c0 + 256 * q, vb[q]);
        }
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
        if (c0 + 256 * q >= C) break;
        float v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = to_f(from_f<T>(va[q][k] + vb[q][k]));  // y as stored
        store8(yr + c0 + 256 * q, v);
        sumsq8(ss, v);
      }
    }
  } else {
    for (int64_t c = lane; c < C; c += 32) {
      const T yv = from_f<T>(to_f(ar[c]) + to_f(br[c]));
      yr[c] = yv;
      const float v = to_f(yv);
      ss = fmaf(v, v, ss);
    }
  }
  ss = warp_sum(ss);
  normalize_row<T, VEC>(nr, yr, w, C, rstd_of(ss, C, eps), woff, lane);  // y as the lane stored it
}

// Few rows (a decoding step: the norms before each product, batch 1-128): one block a row, a
// thread per 8-value chunk (C / 8 threads, C <= 8192), the weight loaded before pdl_wait and the
// row (or a and b) in one round, where one warp a row made four dependent rounds (~7 us for one
// row of 2048 under ncu on an H100). The values go through shared memory so that lane l of warp
// 0 sums chunks l, l + 32, ... in the warp kernel's order, then the same warp_sum: rstd, y and yn
// are bitwise the warp kernels' (a row's result does not depend on the batch, which the
// deterministic mode needs; tested). ADD: y = a + b as stored, then the norm of y into yn.
template <class T, bool ADD>
__global__ void __launch_bounds__(1024) rmsnorm_row_block_kernel(T* y, int64_t ldy, T* yn, Flex rstd_out, const T* a,
                                                                 int64_t lda, const T* b, const T* w, int64_t C,
                                                                 float eps, float woff) {
  extern __shared__ float vals[];  // [C] the row's values (y as stored), then rstd
  const int t = threadIdx.x;
  const int64_t row = blockIdx.x, c = int64_t(t) * 8;
  const bool live = c < C;
  float wv[8], v[8];
  if (live) load8(w + c, wv);  // the weight: not written by the kernel before
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  if (live) {
    load8(a + row * lda + c, v);
    if constexpr (ADD) {
      float vb[8];
      load8(b + row * C + c, vb);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = to_f(from_f<T>(v[k] + vb[k]));  // y as stored
      store8(y + row * ldy + c, v);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) vals[c + k] = v[k];
  }
  __syncthreads();
  if (t < 32) {
    float ss = 0.f;
    for (int64_t ch = t; ch * 8 < C; ch += 32) sumsq8(ss, vals + ch * 8);
    ss = warp_sum(ss);
    if (t == 0) vals[C] = rstd_of(ss, C, eps);
  }
  __syncthreads();
  const float rs = vals[C];
  if (live) {
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = v[k] * rs * (wv[k] + woff);
    store8((ADD ? yn + row * C : y + row * ldy) + c, v);
  }
  if (t == 0 && rstd_out.p) st_flex(rstd_out, row, rs);
}

template <class T, bool VEC>
__global__ void __launch_bounds__(kWarps * 32)
rmsnorm_bwd_kernel(T* dx, int64_t lddx, const T* dy, int64_t lddy, const T* x, int64_t ldx,
                   const T* w, Flex rstd, int64_t N, int64_t C, float woff, bool accumulate) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * int64_t(kWarps) + (threadIdx.x >> 5);
  if (row >= N) return;
  const T* xr = x + row * ldx;
  const T* dyr = dy + row * lddy;
  T* dxr = dx + row * lddx;
  const float rs = ld_flex(rstd, row);
  float dot = 0.f;
  if (VEC) {
    for (int64_t c = lane * 8; c < C; c += 256) {
      float xv[8], gv[8], wv[8];
      load8(xr + c, xv);
      load8(dyr + c, gv);
      load8(w + c, wv);
#pragma unroll
      for (int k = 0; k < 8; ++k) dot += gv[k] * (wv[k] + woff) * xv[k];
    }
  } else {
    for (int64_t c = lane; c < C; c += 32) dot += to_f(dyr[c]) * (to_f(w[c]) + woff) * to_f(xr[c]);
  }
  dot = warp_sum(dot);
  const float coef = rs * rs * rs / float(C) * dot;
  if (VEC) {
    for (int64_t c = lane * 8; c < C; c += 256) {
      float xv[8], gv[8], wv[8], o[8];
      load8(xr + c, xv);
      load8(dyr + c, gv);
      load8(w + c, wv);
      if (accumulate) load8(dxr + c, o);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float d = rs * (wv[k] + woff) * gv[k] - xv[k] * coef;
        o[k] = accumulate ? o[k] + d : d;
      }
      store8(dxr + c, o);
    }
  } else {
    for (int64_t c = lane; c < C; c += 32) {
      const float d = rs * (to_f(w[c]) + woff) * to_f(dyr[c]) - to_f(xr[c]) * coef;
      dxr[c] = from_f<T>(accumulate ? to_f(dxr[c]) + d : d);
    }
  }
}

// The backward of bf16 rows of C = 256 NC values (NC <= MAXNC), dw fused: a block of kWarps
// warps takes kBwdRows consecutive rows, a warp kBwdRows / kWarps of them. A warp loads its row's
// x and dy in one round (held in registers as bf16), so a row costs one memory round trip instead
// of the row kernel's dependent chunk loads; dx's arithmetic and order are rmsnorm_bwd_kernel's
// (equal bits are not tested: the compiler may contract the two kernels' products differently).
// dw: each warp adds its rows' dy x rstd into its own shared-memory row of sums, in row order;
// the block's partial is the warps' rows added in warp order, and colreduce_finish adds the
// blocks' partials (deterministic; other chunks than column_reduce5's, so dw's last bits may
// differ from the unfused path's).
constexpr int kBwdRows = 32;

template <int MAXNC>
__global__ void __launch_bounds__(kWarps * 32)
rmsnorm_bwd_rows_kernel(bf16* dx, int64_t lddx, const bf16* dy, int64_t lddy, const bf16* x, int64_t ldx,
                        const bf16* w, Flex rstd, int64_t N, int64_t C, float woff, bool accumulate,
                        float* partial) {
  extern __shared__ float sm[];
  float* wf = sm;                                  // w + woff, C floats
  float* acc = sm + C + (threadIdx.x >> 5) * C;    // this warp's dw sums (when partial)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nc = int(C / 256);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    wf[c] = to_f(w[c]) + woff;
    if (partial)
      for (int k = 0; k < kWarps; ++k) sm[C + k * C + c] = 0.f;
  }
  __syncthreads();
  const int64_t r0 = blockIdx.x * int64_t(kBwdRows);
  for (int64_t row = r0 + warp; row < min(N, r0 + kBwdRows); row += kWarps) {
    uint4 xu[MAXNC], gu[MAXNC];
#pragma unroll
    for (int i = 0; i < MAXNC; ++i)
      if (i < nc) {
        xu[i] = *reinterpret_cast<const uint4*>(x + row * ldx + lane * 8 + 256 * i);
        gu[i] = *reinterpret_cast<const uint4*>(dy + row * lddy + lane * 8 + 256 * i);
      }
    const float rs = ld_flex(rstd, row);
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < MAXNC; ++i)
      if (i < nc) {
        float xv[8], gv[8];
        unpack8(xu[i], xv);
        unpack8(gu[i], gv);
        const float* wv = wf + lane * 8 + 256 * i;
        float* ac = acc + lane * 8 + 256 * i;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          dot += gv[k] * wv[k] * xv[k];
          if (partial) ac[k] += gv[k] * xv[k] * rs;
        }
      }
    dot = warp_sum(dot);
    const float coef = rs * rs * rs / float(C) * dot;
    bf16* dxr = dx + row * lddx;
#pragma unroll
    for (int i = 0; i < MAXNC; ++i)
      if (i < nc) {
        float xv[8], gv[8], o[8];
        unpack8(xu[i], xv);
        unpack8(gu[i], gv);
        const float* wv = wf + lane * 8 + 256 * i;
        if (accumulate) load8(dxr + lane * 8 + 256 * i, o);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float d = rs * wv[k] * gv[k] - xv[k] * coef;
          o[k] = accumulate ? o[k] + d : d;
        }
        store8(dxr + lane * 8 + 256 * i, o);
      }
  }
  if (!partial) return;
  __syncthreads();
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float s = 0.f;
    for (int k = 0; k < kWarps; ++k) s += sm[C + k * C + c];
    partial[blockIdx.x * C + c] = s;
  }
}

// dw term: dy[r,c] * x[r,c] * rstd[r]; dy, x and rstd travel in the extra struct.
template <class T>
struct DwExtra {
  const T* x;
  int64_t ldx;
  Flex rstd;
};
struct DwTerm {
  template <class T>
  __device__ float operator()(const T* dy, int64_t lddy, int64_t r, int64_t c,
                              const DwExtra<T>& e) const {
    return to_f(dy[r * lddy + c]) * to_f(e.x[r * e.ldx + c]) * ld_flex(e.rstd, r);
  }
};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether the forward norms take a block a row (rmsnorm_row_block_kernel): few rows (up to 128;
// RLH_KCUDA_NORM_ROW_BLOCKS=0: never, the A/B), rows of at most 8192 values. Either kernel gives
// the same bits.
bool row_blocks(int64_t N, int64_t C) {
  static const bool on = env_switch_on("RLH_KCUDA_NORM_ROW_BLOCKS");
  return on && N <= 128 && C <= 8192;
}
unsigned row_block_threads(int64_t C) { return unsigned((C / 8 + 31) / 32 * 32); }

template <class T>
void fwd_t(T* y, int64_t ldy, Flex rstd, const T* x, int64_t ldx, const T* w, int64_t N,
           int64_t C, float eps, float woff, cudaStream_t s) {
  const bool vec = C % 8 == 0 && ldx % 8 == 0 && ldy % 8 == 0 && aligned16(x) &&
                   aligned16(y) && aligned16(w);
  if (vec && row_blocks(N, C)) {
    launch_pdl(rmsnorm_row_block_kernel<T, false>, unsigned(N), row_block_threads(C), size_t(C + 1) * 4, s, y, ldy,
               static_cast<T*>(nullptr), rstd, x, ldx, static_cast<const T*>(nullptr), w, C, eps, woff);
    return;
  }
  const unsigned grid = ceil_div(N, kWarps);
  if (vec)
    launch_pdl(rmsnorm_fwd_kernel<T, true>, grid, kWarps * 32, 0, s, y, ldy, rstd, x, ldx, w, N, C, eps, woff);
  else
    launch_pdl(rmsnorm_fwd_kernel<T, false>, grid, kWarps * 32, 0, s, y, ldy, rstd, x, ldx, w, N, C, eps, woff);
}

template <class T>
void add_fwd_t(T* y, T* yn, const T* a, const T* b, const T* w, int64_t N, int64_t C, float eps, float woff,
               cudaStream_t s) {
  // The norm's lanes must walk y as rmsnorm_fwd would (its vector test: y, yn and w); where that
  // is the vector walk but a or b cannot be read 16 bytes at a time, the two ops run as they are.
  const bool vec = C % 8 == 0 && aligned16(y) && aligned16(yn) && aligned16(w);
  if (vec && !(aligned16(a) && aligned16(b))) {
    add_fwd(std::is_same_v<T, float> ? DType::f32 : DType::bf16, y, a, b, N * C, s);
    fwd_t(yn, C, Flex{}, static_cast<const T*>(y), C, w, N, C, eps, woff, s);
    return;
  }
  if (vec && row_blocks(N, C)) {
    launch_pdl(rmsnorm_row_block_kernel<T, true>, unsigned(N), row_block_threads(C), size_t(C + 1) * 4, s, y, C, yn,
               Flex{}, a, C, b, w, C, eps, woff);
    return;
  }
  const unsigned grid = ceil_div(N, kWarps);
  if (vec)
    launch_pdl(add_rmsnorm_fwd_kernel<T, true>, grid, kWarps * 32, 0, s, y, yn, a, b, w, N, C, eps, woff);
  else
    launch_pdl(add_rmsnorm_fwd_kernel<T, false>, grid, kWarps * 32, 0, s, y, yn, a, b, w, N, C, eps, woff);
}

// Whether the bf16 backward takes rmsnorm_bwd_rows_kernel (RLH_KCUDA_NORM_BWD_ROWS=0: never, the
// A/B). With the wide head-gradient blocks it took the 1B step from 60.6-60.8K to 61.3-61.4K tok/s
// (H100, 2026-12-07, bench/results/h100-2026-12-07-s29-steptune.log).
bool bwd_rows_on() {
  static const bool on = env_switch_on("RLH_KCUDA_NORM_BWD_ROWS");
  return on;
}

// rmsnorm_bwd_rows_kernel's launch: dw (when asked) from its per-block partials.
void bwd_rows(bf16* dx, int64_t lddx, Flex dw, const bf16* dy, int64_t lddy, const bf16* x, int64_t ldx,
              const bf16* w, Flex rstd, int64_t N, int64_t C, float woff, bool accumulate, Workspace& ws,
              cudaStream_t s) {
  const int64_t blocks = (N + kBwdRows - 1) / kBwdRows;
  float* partial = dw.p ? static_cast<float*>(ws.get(size_t(blocks * C) * sizeof(float))) : nullptr;
  const size_t smem = size_t(C) * 4 * (dw.p ? 1 + kWarps : 1);
  // The shared memory past 48 KiB, asked for once for both instantiations (they share a type,
  // so a flag per lambda instantiation would cover only the first one launched).
  static const bool opted = [] {
    const int most = int(size_t(4096) * 4 * (1 + kWarps));
    return cudaFuncSetAttribute(rmsnorm_bwd_rows_kernel<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, most) ==
               cudaSuccess &&
           cudaFuncSetAttribute(rmsnorm_bwd_rows_kernel<16>, cudaFuncAttributeMaxDynamicSharedMemorySize, most) ==
               cudaSuccess;
  }();
  if (!opted) throw std::runtime_error("rmsnorm_bwd: cannot opt in to shared memory");
  auto launch = [&](auto kernel) {
    kernel<<<unsigned(blocks), kWarps * 32, smem, s>>>(dx, lddx, dy, lddy, x, ldx, w, rstd, N, C, woff, accumulate,
                                                        partial);
  };
  if (C <= 2048)
    launch(rmsnorm_bwd_rows_kernel<8>);
  else
    launch(rmsnorm_bwd_rows_kernel<16>);
  if (dw.p) colreduce_finish(partial, blocks, C, dw, true, s);
}

template <class T>
void bwd_t(T* dx, int64_t lddx, Flex dw, const T* dy, int64_t lddy, const T* x, int64_t ldx,
           const T* w, Flex rstd, int64_t N, int64_t C, float woff, bool accumulate,
           Workspace& ws, cudaStream_t s) {
  const bool vec = C % 8 == 0 && ldx % 8 == 0 && lddy % 8 == 0 && lddx % 8 == 0 &&
                   aligned16(x) && aligned16(dy) && aligned16(dx) && aligned16(w);
  if constexpr (std::is_same_v<T, bf16>) {
    if (vec && C % 256 == 0 && C <= 4096 && N > 0 && bwd_rows_on()) {
      bwd_rows(dx, lddx, dw, dy, lddy, x, ldx, w, rstd, N, C, woff, accumulate, ws, s);
      return;
    }
  }
  // dw first: dx may alias dy (in place), and dw reads dy.
  if (dw.p) column_reduce5(dy, lddy, N, C, DwTerm{}, DwExtra<T>{x, ldx, rstd}, dw, true, ws, s);
  const unsigned grid = ceil_div(N, kWarps);
  if (N == 0) return;
  if (vec)
    rmsnorm_bwd_kernel<T, true><<<grid, kWarps * 32, 0, s>>>(dx, lddx, dy, lddy, x, ldx, w, rstd,
                                                             N, C, woff, accumulate);
  else
    rmsnorm_bwd_kernel<T, false><<<grid, kWarps * 32, 0, s>>>(dx, lddx, dy, lddy, x, ldx, w, rstd,
                                                              N, C, woff, accumulate);
}

}  // namespace

void rmsnorm_fwd(DType t, void* y, int64_t ldy, Flex rstd, const void* x, int64_t ldx,
                 const void* w, int64_t N, int64_t C, float eps, float w_offset, cudaStream_t s) {
  if (N == 0) return;
  if (t == DType::f32)
    fwd_t(static_cast<float*>(y), ldy, rstd, static_cast<const float*>(x), ldx,
          static_cast<const float*>(w), N, C, eps, w_offset, s);
  else
    fwd_t(static_cast<bf16*>(y), ldy, rstd, static_cast<const bf16*>(x), ldx,
          static_cast<const bf16*>(w), N, C, eps, w_offset, s);
  check_launch("rmsnorm_fwd");
}

void add_rmsnorm_fwd(DType t, void* y, void* yn, const void* a, const void* b, const void* w, int64_t N, int64_t C,
                     float eps, float w_offset, cudaStream_t s) {
  if (N == 0) return;
  if (t == DType::f32)
    add_fwd_t(static_cast<float*>(y), static_cast<float*>(yn), static_cast<const float*>(a),
              static_cast<const float*>(b), static_cast<const float*>(w), N, C, eps, w_offset, s);
  else
    add_fwd_t(static_cast<bf16*>(y), static_cast<bf16*>(yn), static_cast<const bf16*>(a),
              static_cast<const bf16*>(b), static_cast<const bf16*>(w), N, C, eps, w_offset, s);
  check_launch("add_rmsnorm_fwd");
}

void rmsnorm_bwd(DType t, void* dx, int64_t lddx, Flex dw, const void* dy, int64_t lddy,
                 const void* x, int64_t ldx, const void* w, Flex rstd, int64_t N, int64_t C,
                 float w_offset, bool accumulate, Workspace& ws, cudaStream_t s) {
  if (t == DType::f32)
    bwd_t(static_cast<float*>(dx), lddx, dw, static_cast<const float*>(dy), lddy,
          static_cast<const float*>(x), ldx, static_cast<const float*>(w), rstd, N, C, w_offset,
          accumulate, ws, s);
  else
    bwd_t(static_cast<bf16*>(dx), lddx, dw, static_cast<const bf16*>(dy), lddy,
          static_cast<const bf16*>(x), ldx, static_cast<const bf16*>(w), rstd, N, C, w_offset,
          accumulate, ws, s);
  check_launch("rmsnorm_bwd");
}

}  // namespace rlh::kcuda
