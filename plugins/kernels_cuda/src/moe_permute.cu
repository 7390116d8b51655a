// MoE token permutation on the GPU (dropless; docs/ops.md "moe_permute_fwd"; kernels_cpu's
// moe_permute.cpp is the reference):
//   index      a stable radix sort (cub) of the N*K pairs by expert: sorted position r holds pair
//              i = svals[r]; row[i] = r; offsets[e] = the first position whose expert is >= e
//              (a binary search per expert). Stable, so expert e's rows hold its pairs in (n, k)
//              order: exactly kernels_cpu's counting sort, no host sync, no atomics in the order.
//   permute    xp[r] = x[svals[r] / K]                      (a gather: one writer per row)
//   backward   dx[n] (+)= sum_k dxp[row[n, k]]             (k in order, fp32 sums)
//   unpermute  y[n] (+)= sum_k w[n, k] yp[row[n, k]]       (k in order, fp32 sums)
//   backward   dyp[row[n, k]] = w[n, k] dy[n], dw[n, k] = <dy[n], yp[row[n, k]]> (warp per pair,
//              lane partials in a fixed order, then a fixed shuffle tree)
// The ops that read `row` check it is a permutation of 0..N*K-1 on the device (per-row counts,
// integer atomics: order-free) and raise the error flag otherwise; out-of-range rows are skipped.
// Rows move as 16-byte words when C and the row strides allow it.
#include <cub/device/device_radix_sort.cuh>

#include "common.cuh"

namespace rlh::kcuda {
namespace {

constexpr int kThreads = 256;

unsigned grid_for(int64_t n, int64_t cap = 132 * 16) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, cap)));
}

__global__ void pairs_kernel(int32_t* keys, int32_t* vals, const int32_t* experts, int64_t NK,
                             int64_t E, int* err) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < NK;
       i += int64_t(gridDim.x) * blockDim.x) {
    int32_t e = experts[i];
    if (e < 0 || e >= E) {
      if (err) atomicExch(err, 1);
      e = int32_t(E);  // sorts after every expert: outside all of offsets' ranges
    }
    keys[i] = e;
    vals[i] = int32_t(i);
  }
}

__global__ void rows_kernel(int32_t* row, const int32_t* svals, int64_t NK) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < NK;
       r += int64_t(gridDim.x) * blockDim.x)
    row[svals[r]] = int32_t(r);
}

// offsets[e] = lower_bound(skeys, e) for e = 0..E (offsets[E] = the pairs with a valid expert).
__global__ void offsets_kernel(int32_t* offsets, const int32_t* skeys, int64_t NK, int64_t E) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e <= E;
       e += int64_t(gridDim.x) * blockDim.x) {
    int64_t lo = 0, hi = NK;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (skeys[mid] < e)
        lo = mid + 1;
      else
        hi = mid;
    }
    offsets[e] = int32_t(lo);
  }
}

int bits_for(int64_t E) {
  int b = 1;
  while ((int64_t(1) << b) <= E) ++b;  // E itself (the invalid key) must fit
  return b;
}

// Sorted pair indices (svals) of the stable sort by expert; writes row and offsets.
const int32_t* sort_pairs(int32_t* row, int32_t* offsets, const int32_t* experts, int64_t N,
                          int64_t K, int64_t E, int* err, Workspace& ws, cudaStream_t s) {
  if (N < 0 || K <= 0 || E <= 0) throw std::invalid_argument("moe_permute: bad sizes");
  const int64_t NK = N * K;
  if (NK > int64_t(INT32_MAX) || E >= INT32_MAX) throw std::invalid_argument("moe_permute: more than 2^31 rows");
  if (NK == 0) {
    cudaMemsetAsync(offsets, 0, size_t(E + 1) * 4, s);
    return nullptr;
  }
  auto* keys = static_cast<int32_t*>(ws.get(size_t(NK) * 4));
  auto* vals = static_cast<int32_t*>(ws.get(size_t(NK) * 4));
  auto* skeys = static_cast<int32_t*>(ws.get(size_t(NK) * 4));
  auto* svals = static_cast<int32_t*>(ws.get(size_t(NK) * 4));
  const int bits = bits_for(E);
  size_t temp = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, temp, keys, skeys, vals, svals, int(NK), 0, bits, s);
  void* tmp = ws.get(std::max<size_t>(temp, 16));
  pairs_kernel<<<grid_for(NK), kThreads, 0, s>>>(keys, vals, experts, NK, E, err);
  const cudaError_t e =
      cub::DeviceRadixSort::SortPairs(tmp, temp, keys, skeys, vals, svals, int(NK), 0, bits, s);
  if (e != cudaSuccess) throw std::runtime_error(std::string("moe_permute sort: ") + cudaGetErrorString(e));
  rows_kernel<<<grid_for(NK), kThreads, 0, s>>>(row, svals, NK);
  offsets_kernel<<<grid_for(E + 1), kThreads, 0, s>>>(offsets, skeys, NK, E);
  check_launch("moe_permute_index");
  return svals;
}

// ---------------------------------------------------------------------------------------------
// Row movement. VEC elements per step: 16-byte words (8 bf16 / 4 f32) when aligned, else 1.

template <class T, int VEC>
struct Chunk {
  float v[VEC];
  __device__ void load(const T* p) {
    if constexpr (VEC == 1) {
      v[0] = to_f(p[0]);
    } else {
      const uint4 u = *reinterpret_cast<const uint4*>(p);
      const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = to_f(e[i]);
    }
  }
  __device__ void store(T* p) const {
    if constexpr (VEC == 1) {
      p[0] = from_f<T>(v[0]);
    } else {
      uint4 u;
      T* e = reinterpret_cast<T*>(&u);
#pragma unroll
      for (int i = 0; i < VEC; ++i) e[i] = from_f<T>(v[i]);
      *reinterpret_cast<uint4*>(p) = u;
    }
  }
};

template <class T>
constexpr int vec_of() { return 16 / int(sizeof(T)); }

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// 16-byte steps possible: C and the row strides multiples of the word, pointers aligned.
bool can_vec(DType t, int64_t C, std::initializer_list<std::pair<const void*, int64_t>> rows) {
  const int64_t w = 16 / int64_t(dtype_size(t));
  if (C % w != 0) return false;
  for (auto [p, ld] : rows)
    if (!aligned16(p) || ld % w != 0) return false;
  return true;
}

// xp[r] = x[svals[r] / K]: a plain copy, in 16-byte words when possible.
template <class W>
__global__ void gather_kernel(W* xp, int64_t ldxp, const W* x, int64_t ldx, const int32_t* svals,
                              int64_t NK, int64_t K, int64_t CW) {
  const int64_t total = NK * CW;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / CW, c = i - r * CW;
    const int64_t n = svals[r] / K;
    xp[r * ldxp + c] = x[n * ldx + c];
  }
}

// y[n] (+)= sum_k w[n,k] src[row[n,k]] (w absent: 1), one thread per (token, chunk).
template <class T, int VEC>
__global__ void combine_kernel(T* y, int64_t ldy, const T* src, int64_t lds, const int32_t* row,
                               Flex w, int64_t N, int64_t K, int64_t C, bool accumulate) {
  const int64_t per_row = C / VEC, total = N * per_row, NK = N * K;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / per_row, c = (i - n * per_row) * VEC;
    Chunk<T, VEC> acc;
    if (accumulate)
      acc.load(y + n * ldy + c);
    else
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc.v[j] = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = row[n * K + k];
      if (r < 0 || r >= NK) continue;  // flagged by check_rows
      Chunk<T, VEC> x;
      x.load(src + r * lds + c);
      if (w.p) {
        const float wk = ld_flex(w, n * K + k);
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc.v[j] += wk * x.v[j];
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc.v[j] += x.v[j];
      }
    }
    acc.store(y + n * ldy + c);
  }
}

// dyp[row[n,k]] = w[n,k] dy[n]; dw[n,k] = <dy[n], yp[row[n,k]]>. One warp per pair (n, k).
template <class T, int VEC>
__global__ void unpermute_bwd_kernel(T* dyp, int64_t lddyp, Flex dw, const T* dy, int64_t lddy,
                                     const T* yp, int64_t ldyp, const int32_t* row, Flex w,
                                     int64_t N, int64_t K, int64_t C) {
  const int lane = threadIdx.x & 31;
  const int64_t NK = N * K;
  const int64_t pair = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  if (pair >= NK) return;  // whole warps
  const int64_t n = pair / K, r = row[pair];
  if (r < 0 || r >= NK) {  // flagged by check_rows
    if (dw.p && lane == 0) st_flex(dw, pair, 0.f);
    return;
  }
  const float wk = ld_flex(w, pair);
  float dot = 0.f;
  for (int64_t c = int64_t(lane) * VEC; c < C; c += 32 * VEC) {
    Chunk<T, VEC> d, o;
    d.load(dy + n * lddy + c);
#pragma unroll
    for (int j = 0; j < VEC; ++j) o.v[j] = wk * d.v[j];
    o.store(dyp + r * lddyp + c);
    if (dw.p) {
      Chunk<T, VEC> x;
      x.load(yp + r * ldyp + c);
#pragma unroll
      for (int j = 0; j < VEC; ++j) dot += d.v[j] * x.v[j];
    }
  }
  if (dw.p) {
    dot = warp_sum(dot);
    if (lane == 0) st_flex(dw, pair, dot);
  }
}

__global__ void count_rows_kernel(int* seen, const int32_t* row, int64_t NK, int* err) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < NK;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t r = row[i];
    if (r < 0 || r >= NK)
      atomicExch(err, 1);
    else
      atomicAdd(&seen[r], 1);
  }
}
__global__ void verify_rows_kernel(const int* seen, int64_t NK, int* err) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < NK;
       i += int64_t(gridDim.x) * blockDim.x)
    if (seen[i] != 1) atomicExch(err, 1);
}

// row must be a permutation of 0..N*K-1 (kernels_cpu refuses anything else): each row counted
// once, then every count must be 1. Skipped without an error flag.
void check_rows(const int32_t* row, int64_t NK, int* err, Workspace& ws, cudaStream_t s) {
  if (!err || NK == 0) return;
  int* seen = static_cast<int*>(ws.get(size_t(NK) * 4));
  cudaMemsetAsync(seen, 0, size_t(NK) * 4, s);
  count_rows_kernel<<<grid_for(NK), kThreads, 0, s>>>(seen, row, NK, err);
  verify_rows_kernel<<<grid_for(NK), kThreads, 0, s>>>(seen, NK, err);
}

void check_sizes(int64_t N, int64_t K, int64_t C, const char* what) {
  if (N < 0 || K <= 0 || C < 0) throw std::invalid_argument(std::string(what) + ": bad sizes");
  if (N * K > int64_t(INT32_MAX)) throw std::invalid_argument(std::string(what) + ": more than 2^31 rows");
}

template <class T>
void combine(DType t, void* y, int64_t ldy, const void* src, int64_t lds, const int32_t* row,
             Flex w, int64_t N, int64_t K, int64_t C, bool accumulate, cudaStream_t s) {
  constexpr int V = vec_of<T>();
  if (can_vec(t, C, {{y, ldy}, {src, lds}}))
    combine_kernel<T, V><<<grid_for(N * (C / V)), kThreads, 0, s>>>(
        static_cast<T*>(y), ldy, static_cast<const T*>(src), lds, row, w, N, K, C, accumulate);
  else
    combine_kernel<T, 1><<<grid_for(N * C), kThreads, 0, s>>>(
        static_cast<T*>(y), ldy, static_cast<const T*>(src), lds, row, w, N, K, C, accumulate);
}

}  // namespace

void moe_permute_index(int32_t* row, int32_t* offsets, const int32_t* experts, int64_t N,
                       int64_t K, int64_t E, int* err, Workspace& ws, cudaStream_t s) {
  sort_pairs(row, offsets, experts, N, K, E, err, ws, s);
}

void moe_permute_fwd(DType t, void* xp, int64_t ldxp, int32_t* row, int32_t* offsets,
                     const void* x, int64_t ldx, const int32_t* experts, int64_t N, int64_t K,
                     int64_t C, int64_t E, int* err, Workspace& ws, cudaStream_t s) {
  check_sizes(N, K, C, "moe_permute_fwd");
  const int32_t* svals = sort_pairs(row, offsets, experts, N, K, E, err, ws, s);
  const int64_t NK = N * K;
  if (NK == 0 || C == 0) return;
  const int64_t es = int64_t(dtype_size(t));
  if (can_vec(t, C, {{xp, ldxp}, {x, ldx}})) {
    const int64_t w = 16 / es;
    gather_kernel<<<grid_for(NK * (C / w)), kThreads, 0, s>>>(
        static_cast<uint4*>(xp), ldxp / w, static_cast<const uint4*>(x), ldx / w, svals, NK, K, C / w);
  } else if (t == DType::f32) {
    gather_kernel<<<grid_for(NK * C), kThreads, 0, s>>>(static_cast<float*>(xp), ldxp,
                                                        static_cast<const float*>(x), ldx, svals,
                                                        NK, K, C);
  } else {
    gather_kernel<<<grid_for(NK * C), kThreads, 0, s>>>(static_cast<uint16_t*>(xp), ldxp,
                                                        static_cast<const uint16_t*>(x), ldx,
                                                        svals, NK, K, C);
  }
  check_launch("moe_permute_fwd");
}

void moe_permute_bwd(DType t, void* dx, int64_t lddx, const void* dxp, int64_t lddxp,
                     const int32_t* row, int64_t N, int64_t K, int64_t C, bool accumulate,
                     int* err, Workspace& ws, cudaStream_t s) {
  check_sizes(N, K, C, "moe_permute_bwd");
  check_rows(row, N * K, err, ws, s);
  if (N == 0 || C == 0) return;
  if (t == DType::f32)
    combine<float>(t, dx, lddx, dxp, lddxp, row, Flex{}, N, K, C, accumulate, s);
  else
    combine<bf16>(t, dx, lddx, dxp, lddxp, row, Flex{}, N, K, C, accumulate, s);
  check_launch("moe_permute_bwd");
}

void moe_unpermute_fwd(DType t, void* y, int64_t ldy, const void* yp, int64_t ldyp,
                       const int32_t* row, Flex weights, int64_t N, int64_t K, int64_t C,
                       bool accumulate, int* err, Workspace& ws, cudaStream_t s) {
  check_sizes(N, K, C, "moe_unpermute_fwd");
  if (!weights.p) throw std::invalid_argument("moe_unpermute_fwd: weights are required");
  check_rows(row, N * K, err, ws, s);
  if (N == 0 || C == 0) return;
  if (t == DType::f32)
    combine<float>(t, y, ldy, yp, ldyp, row, weights, N, K, C, accumulate, s);
  else
    combine<bf16>(t, y, ldy, yp, ldyp, row, weights, N, K, C, accumulate, s);
  check_launch("moe_unpermute_fwd");
}

void moe_unpermute_bwd(DType t, void* dyp, int64_t lddyp, Flex dweights, const void* dy,
                       int64_t lddy, const void* yp, int64_t ldyp, const int32_t* row,
                       Flex weights, int64_t N, int64_t K, int64_t C, int* err, Workspace& ws,
                       cudaStream_t s) {
  check_sizes(N, K, C, "moe_unpermute_bwd");
  if (!weights.p) throw std::invalid_argument("moe_unpermute_bwd: weights are required");
  check_rows(row, N * K, err, ws, s);
  const int64_t NK = N * K;
  if (NK == 0) return;
  const unsigned grid = ceil_div(NK * 32, kThreads);
  // C == 0: no row moves, dweights are empty dots (0).
  auto run = [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = vec_of<T>();
    if (can_vec(t, C, {{dyp, lddyp}, {dy, lddy}, {yp, ldyp}}))
      unpermute_bwd_kernel<T, V><<<grid, kThreads, 0, s>>>(
          static_cast<T*>(dyp), lddyp, dweights, static_cast<const T*>(dy), lddy,
          static_cast<const T*>(yp), ldyp, row, weights, N, K, C);
    else
      unpermute_bwd_kernel<T, 1><<<grid, kThreads, 0, s>>>(
          static_cast<T*>(dyp), lddyp, dweights, static_cast<const T*>(dy), lddy,
          static_cast<const T*>(yp), ldyp, row, weights, N, K, C);
  };
  if (t == DType::f32)
    run(float{});
  else
    run(bf16{});
  check_launch("moe_unpermute_bwd");
}

}  // namespace rlh::kcuda
