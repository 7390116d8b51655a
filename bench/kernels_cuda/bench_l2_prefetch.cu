// Does warming L2 with a weight during a latency-bound phase speed up the product that streams it
// next? A decoding step at small batch alternates products that stream their weights from HBM
// with kernels that leave HBM idle (norms, RoPE, the cache write, attention over short rows). A
// weight that L2 already holds (50 MiB on an H100 or H200) streams at L2's bandwidth instead. This
// measures, on weights of a Llama-3.2-1B layer's sizes, with L2 flushed first:
//   cold:       idle phase (one block spinning S us), then the product;
//   prefetched: a one-launch L2 prefetch of the weight (cp.async.bulk.prefetch.L2 a chunk a
//               block, or prefetch.global.L2 a line a request; fire and forget), the same idle
//               phase, then the product (the prefetch's launch counted in the product's time);
//   warm:       the product right after itself (the weight in L2: what a repeated microbenchmark
//               measures).
// The product is a bf16 matrix-vector product, a warp a row, 16-byte loads with 8 in flight (a
// stand-in for kernels_cuda's gemv, not it). Prints microseconds for the product alone (the
// sequence's time less the idle phase alone), median of the repeats.
//   bench_l2_prefetch [--reps 30]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "bench_l2_prefetch: %s: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

namespace {

__global__ void flush_kernel(uint4* buf, size_t n, uint32_t v) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    buf[i] = make_uint4(v, v, v, v);
}

// One thread waits `ns` nanoseconds on the global timer: HBM idle, as during a short attention.
__global__ void spin_kernel(uint64_t ns) {
  uint64_t t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 >= ns) break;
  }
}

// Bulk form: block b's first thread asks L2 for chunk b (`chunk` bytes, a multiple of 16) and
// leaves (one chunk a block: each SM's copy engine takes its share; one block for the whole weight
// ran at ~0.2 TB/s, H100, 2026-12-07).
__global__ void prefetch_bulk_kernel(const uint8_t* p, size_t bytes, uint32_t chunk) {
  const size_t off = blockIdx.x * size_t(chunk);
  if (threadIdx.x != 0 || off >= bytes) return;
  const uint32_t n = uint32_t(bytes - off < chunk ? bytes - off : chunk);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(n) : "memory");
#endif
}

// Line form: every thread asks for 4 128-byte lines (prefetch.global.L2).
__global__ void prefetch_lines_kernel(const uint8_t* p, size_t bytes) {
  const size_t base = (blockIdx.x * size_t(blockDim.x) + threadIdx.x) * 512;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    if (base + i * 128 < bytes) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + base + i * 128));
}

constexpr int kAhead = 8;

// y[n] = W[n, :] . x, a warp a row, lanes reading 16 bytes each with kAhead loads in flight.
__global__ void gemv_kernel(const uint4* w, const uint4* x, float* y, int64_t N, int64_t K) {
  const int lane = threadIdx.x & 31;
  const int64_t n = blockIdx.x * int64_t(blockDim.x / 32) + (threadIdx.x >> 5);
  if (n >= N) return;
  const int64_t chunks = K / 8;
  const uint4* row = w + n * chunks;
  float acc = 0.f;
  for (int64_t c0 = 0; c0 < chunks; c0 += 32 * kAhead) {
    uint4 b[kAhead];
#pragma unroll
    for (int i = 0; i < kAhead; ++i) {
      const int64_t c = c0 + i * 32 + lane;
      b[i] = c < chunks ? __ldcs(row + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kAhead; ++i) {
      const int64_t c = c0 + i * 32 + lane;
      if (c >= chunks) continue;
      const uint4 a = __ldg(x + c);
      const __nv_bfloat162* bw = reinterpret_cast<const __nv_bfloat162*>(&b[i]);
      const __nv_bfloat162* ax = reinterpret_cast<const __nv_bfloat162*>(&a);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 p = __bfloat1622float2(bw[j]), q = __bfloat1622float2(ax[j]);
        acc = fmaf(p.x, q.x, fmaf(p.y, q.y, acc));
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) y[n] = acc;
}

struct Bufs {
  uint4* flush;
  size_t flush_n;
  uint8_t* w;
  uint4* x;
  float* y;
};

void gemv(const Bufs& b, int64_t N, int64_t K, cudaStream_t s) {
  gemv_kernel<<<unsigned((N + 7) / 8), 256, 0, s>>>(reinterpret_cast<const uint4*>(b.w), b.x, b.y, N, K);
}

void prefetch(const Bufs& b, size_t bytes, int form, cudaStream_t s) {
  if (form == 0) {
    const uint32_t chunk = 32 << 10;
    prefetch_bulk_kernel<<<unsigned((bytes + chunk - 1) / chunk), 32, 0, s>>>(b.w, bytes, chunk);
  } else {
    prefetch_lines_kernel<<<unsigned((bytes + 256 * 512 - 1) / (256 * 512)), 256, 0, s>>>(b.w, bytes);
  }
}

// Median over `reps` of the sequence's time in us: flush L2, then events around `body`.
template <class F>
double timed(const Bufs& b, int reps, cudaStream_t s, F body) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<double> us;
  for (int r = 0; r < reps + 2; ++r) {
    flush_kernel<<<1024, 256, 0, s>>>(b.flush, b.flush_n, uint32_t(r));
    CK(cudaEventRecord(e0, s));
    body();
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (r >= 2) us.push_back(1e3 * ms);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 30;
  for (int i = 1; i + 1 < argc; i += 2)
    if (!std::strcmp(argv[i], "--reps")) reps = std::max(3, std::atoi(argv[i + 1]));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, L2 %d MiB\n", prop.name, prop.l2CacheSize >> 20);
  Bufs b{};
  b.flush_n = (size_t(256) << 20) / sizeof(uint4);
  CK(cudaMalloc(&b.flush, b.flush_n * sizeof(uint4)));
  const size_t w_max = size_t(16384) * 2048 * 2;
  CK(cudaMalloc(&b.w, w_max));
  CK(cudaMemset(b.w, 0x3c, w_max));
  CK(cudaMalloc(&b.x, 8192 * 2));
  CK(cudaMemset(b.x, 0x3c, 8192 * 2));
  CK(cudaMalloc(&b.y, 16384 * 4));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  // (name, N, K) in bf16: the sizes of a 1B layer's q|k|v, o, down and half of gate|up; o's
  // bytes again as an FP8 weight's (N halved: the same bytes).
  struct Shape {
    const char* name;
    int64_t N, K;
  };
  const Shape shapes[] = {{"o_fp8_bytes", 1024, 2048}, {"o", 2048, 2048}, {"qkv", 3072, 2048},
                          {"down", 2048, 8192},       {"gate_up_half", 8192, 2048}};
  for (const uint64_t idle_us : {5, 10, 20}) {
    const double spin_us = timed(b, reps, s, [&] { spin_kernel<<<1, 32, 0, s>>>(idle_us * 1000); });
    for (const Shape& sh : shapes) {
      const size_t bytes = size_t(sh.N * sh.K) * 2;
      const double cold = timed(b, reps, s, [&] {
        spin_kernel<<<1, 32, 0, s>>>(idle_us * 1000);
        gemv(b, sh.N, sh.K, s);
      });
      double pre[2], issue[2];
      for (int form = 0; form < 2; ++form) {
        pre[form] = timed(b, reps, s, [&] {
          prefetch(b, bytes, form, s);
          spin_kernel<<<1, 32, 0, s>>>(idle_us * 1000);
          gemv(b, sh.N, sh.K, s);
        });
        issue[form] = timed(b, reps, s, [&] { prefetch(b, bytes, form, s); });
      }
      const double warm = timed(b, reps, s, [&] {
        gemv(b, sh.N, sh.K, s);
        gemv(b, sh.N, sh.K, s);
      });
      const double once = timed(b, reps, s, [&] { gemv(b, sh.N, sh.K, s); });
      std::printf(
          "RESULT name=l2_prefetch idle_us=%llu shape=%s MiB=%.1f product_cold_us=%.2f product_bulk_prefetched_us=%.2f "
          "product_line_prefetched_us=%.2f product_warm_us=%.2f bulk_issue_us=%.2f line_issue_us=%.2f cold_GBs=%.0f "
          "speedup_bulk=%.2fx speedup_line=%.2fx\n",
          (unsigned long long)idle_us, sh.name, bytes / 1048576.0, cold - spin_us, pre[0] - spin_us, pre[1] - spin_us,
          warm - once, issue[0], issue[1], bytes / (cold - spin_us) / 1e3, (cold - spin_us) / (pre[0] - spin_us),
          (cold - spin_us) / (pre[1] - spin_us));
    }
  }
  return 0;
}
