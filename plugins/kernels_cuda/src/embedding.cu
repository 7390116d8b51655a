// embedding: out[n] = table[ids[n]]; backward dtable[ids[n]] += dout[n], deterministic: the
// (id, token) pairs are stably radix-sorted by id (cub), then one block per distinct id sums its
// rows in token order and adds the sum to the table row once.
#include <cub/device/device_radix_sort.cuh>

#include "common.cuh"

namespace rlh::kcuda {
namespace {

template <class T>
__global__ void embedding_fwd_kernel(T* out, const int32_t* ids, const T* table, int64_t N,
                                     int64_t C, int64_t V, int* err) {
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  const int64_t total = N * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / C, c = i - n * C;
    const int32_t id = ids[n];
    if (id < 0 || id >= V) {
      out[i] = from_f<T>(0.f);
      if (err && c == 0) atomicExch(err, 1);
    } else {
      out[i] = table[int64_t(id) * C + c];
    }
  }
}

// 16-byte rows (C % 8 == 0 for bf16, % 4 for f32, aligned pointers).
__global__ void embedding_fwd_vec_kernel(uint4* out, const int32_t* ids, const uint4* table,
                                         int64_t N, int64_t C16, int64_t V, int* err) {
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  const int64_t total = N * C16;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / C16, c = i - n * C16;
    const int32_t id = ids[n];
    if (id < 0 || id >= V) {
      out[i] = make_uint4(0, 0, 0, 0);
      if (err && c == 0) atomicExch(err, 1);
    } else {
      out[i] = table[int64_t(id) * C16 + c];
    }
  }
}

__global__ void iota_kernel(int32_t* v, int64_t n, const int32_t* ids, int32_t* keys, int64_t V,
                            int* err) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    v[i] = int32_t(i);
    int32_t id = ids[i];
    if (id < 0 || id >= V) {
      if (err) atomicExch(err, 1);
      id = int32_t(V);  // sorts last; skipped
    }
    keys[i] = id;
  }
}

// Block b handles sorted position b if it starts a run of equal ids.
template <class T>
__global__ void embedding_bwd_kernel(Flex dtable, const int32_t* skeys, const int32_t* stok,
                                     const T* dout, int64_t N, int64_t C, int64_t V) {
  const int64_t b = blockIdx.x;
  const int32_t id = skeys[b];
  if (id >= V || (b > 0 && skeys[b - 1] == id)) return;
  int64_t e = b + 1;
  while (e < N && skeys[e] == id) ++e;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = 0.f;
    for (int64_t p = b; p < e; ++p) acc += to_f(dout[int64_t(stok[p]) * C + c]);
    const int64_t o = int64_t(id) * C + c;
    st_flex(dtable, o, ld_flex(dtable, o) + acc);
  }
}

int bits_for(int64_t V) {
  int b = 1;
  while ((int64_t(1) << b) <= V) ++b;  // V itself (the "invalid" key) must fit
  return b;
}

}  // namespace

void embedding_fwd(DType t, void* out, const int32_t* ids, const void* table, int64_t N,
                   int64_t C, int64_t V, int* err, cudaStream_t s) {
  if (N * C == 0) return;
  const size_t es = dtype_size(t);
  const bool vec = (C * es) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(table) % 16 == 0;
  if (vec) {
    const int64_t C16 = C * es / 16;
    const unsigned grid = unsigned(std::min<int64_t>((N * C16 + 255) / 256, 132 * 32));
    launch_pdl(embedding_fwd_vec_kernel, grid, 256, 0, s, static_cast<uint4*>(out), ids,
                                                  static_cast<const uint4*>(table), N, C16, V, err);
  } else {
    const unsigned grid = unsigned(std::min<int64_t>((N * C + 255) / 256, 132 * 32));
    if (t == DType::f32)
      launch_pdl(embedding_fwd_kernel<float>, grid, 256, 0, s, static_cast<float*>(out), ids,
                                                static_cast<const float*>(table), N, C, V, err);
    else
      launch_pdl(embedding_fwd_kernel<bf16>, grid, 256, 0, s, static_cast<bf16*>(out), ids,
                                                static_cast<const bf16*>(table), N, C, V, err);
  }
  check_launch("embedding_fwd");
}

void embedding_bwd(DType t, Flex dtable, const int32_t* ids, const void* dout, int64_t N,
                   int64_t C, int64_t V, int* err, Workspace& ws, cudaStream_t s) {
  if (N == 0 || C == 0) return;
  if (N > INT32_MAX || V >= INT32_MAX) throw std::invalid_argument("embedding_bwd: too many tokens");
  auto* keys = static_cast<int32_t*>(ws.get(size_t(N) * 4));
  auto* vals = static_cast<int32_t*>(ws.get(size_t(N) * 4));
  auto* skeys = static_cast<int32_t*>(ws.get(size_t(N) * 4));
  auto* svals = static_cast<int32_t*>(ws.get(size_t(N) * 4));
  size_t temp = 0;
  const int bits = bits_for(V);
  cub::DeviceRadixSort::SortPairs(nullptr, temp, keys, skeys, vals, svals, int(N), 0, bits, s);
  void* tmp = ws.get(std::max<size_t>(temp, 16));
  iota_kernel<<<unsigned(std::min<int64_t>((N + 255) / 256, 1024)), 256, 0, s>>>(vals, N, ids, keys, V, err);
  const cudaError_t e =
      cub::DeviceRadixSort::SortPairs(tmp, temp, keys, skeys, vals, svals, int(N), 0, bits, s);
  if (e != cudaSuccess) throw std::runtime_error(std::string("embedding_bwd sort: ") + cudaGetErrorString(e));
  const int threads = int(std::min<int64_t>(256, (C + 31) / 32 * 32));
  if (t == DType::f32)
    embedding_bwd_kernel<<<unsigned(N), threads, 0, s>>>(dtable, skeys, svals,
                                                         static_cast<const float*>(dout), N, C, V);
  else
    embedding_bwd_kernel<<<unsigned(N), threads, 0, s>>>(dtable, skeys, svals,
                                                         static_cast<const bf16*>(dout), N, C, V);
  check_launch("embedding_bwd");
}

}  // namespace rlh::kcuda
