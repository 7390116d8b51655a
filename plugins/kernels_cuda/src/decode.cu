// The decode ops on the GPU (docs/ops.md): kv_cache_write, paged_attention and sample, what a
// generator on a CUDA device needs beside the engine's ops. First versions, written for
// correctness against kernels_cpu (tests/kernels_cuda) rather than peak speed; what limits them
// is said at each kernel.
#include <cfloat>
#include <cmath>

#include "common.cuh"

namespace rlh::kcuda {

namespace {

// ---------------------------------------------------------------------------------------------
// kv_cache_write: row r's keys and values into its slot (block slot / bs, offset slot % bs).

template <class T>
__global__ void kv_write_kernel(KvWriteArgs a) {
  const int64_t r = blockIdx.x;
  const int32_t slot = a.slots[r];
  if (slot < 0) return;  // a padding row: nothing to store
  const int64_t b = slot / a.bs, off = slot % a.bs;
  if (b >= a.num_blocks) {
    if (threadIdx.x == 0 && a.err) atomicExch(a.err, 1);
    return;
  }
  const T* k = static_cast<const T*>(a.k) + r * a.ldk;
  const T* v = static_cast<const T*>(a.v) + r * a.ldv;
  T* kc = static_cast<T*>(a.k_cache) + b * a.kc_strides[0] + off * a.kc_strides[2];
  T* vc = static_cast<T*>(a.v_cache) + b * a.vc_strides[0] + off * a.vc_strides[2];
  for (int64_t i = threadIdx.x; i < a.Hkv * a.Dk; i += blockDim.x) {
    const int64_t h = i / a.Dk, d = i % a.Dk;
    kc[h * a.kc_strides[1] + d * a.kc_strides[3]] = k[h * a.Dk + d];
  }
  for (int64_t i = threadIdx.x; i < a.Hkv * a.Dv; i += blockDim.x) {
    const int64_t h = i / a.Dv, d = i % a.Dv;
    vc[h * a.vc_strides[1] + d * a.vc_strides[3]] = v[h * a.Dv + d];
  }
}

// ---------------------------------------------------------------------------------------------
// paged_attention: one block per (row, query head), four warps taking the row's positions in
// turn, each lane a slice of the head dims, an online softmax per warp, the warps combined at the
// end. Keys and values are read once per query head (GQA heads of one kv head read them again:
// L2 serves most of it); a kernel that keeps a kv head's G query heads together is the next step.

constexpr int kWarps = 4;
constexpr int kMaxSlices = 8;  // head dims up to 256 (8 per lane)

template <class T>
__global__ void paged_attention_kernel(PagedAttnArgs a) {
  const int64_t r = blockIdx.x, hq = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t G = a.Hq / a.Hkv, hk = hq / G;
  const int64_t pos = a.pos[r];
  const int64_t lo = a.window > 0 ? (pos - a.window + 1 > 0 ? pos - a.window + 1 : 0) : 0;
  const int32_t* table = a.blocks + r * a.ld_blocks;
  const T* q = static_cast<const T*>(a.q) + r * a.ldq + hq * a.Dk;
  const int nk = int((a.Dk + 31) / 32), nv = int((a.Dv + 31) / 32);
  float qv[kMaxSlices], acc[kMaxSlices];
#pragma unroll
  for (int j = 0; j < kMaxSlices; ++j) {
    const int64_t d = lane + 32 * j;
    qv[j] = (j < nk && d < a.Dk) ? to_f(q[d]) * a.scale : 0.f;
    acc[j] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int64_t p = lo + warp; p <= pos; p += kWarps) {
    const int64_t blk = table[p / a.bs], off = p % a.bs;
    const T* kr = static_cast<const T*>(a.k_cache) + blk * a.kc_strides[0] + hk * a.kc_strides[1] + off * a.kc_strides[2];
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxSlices; ++j) {
      const int64_t d = lane + 32 * j;
      if (j < nk && d < a.Dk) s += qv[j] * to_f(kr[d * a.kc_strides[3]]);
    }
    s = warp_sum(s);
    const float mn = fmaxf(m, s), corr = __expf(m - mn), e = __expf(s - mn);
    l = l * corr + e;
    const T* vr = static_cast<const T*>(a.v_cache) + blk * a.vc_strides[0] + hk * a.vc_strides[1] + off * a.vc_strides[2];
#pragma unroll
    for (int j = 0; j < kMaxSlices; ++j) {
      const int64_t d = lane + 32 * j;
      if (j < nv && d < a.Dv) acc[j] = acc[j] * corr + e * to_f(vr[d * a.vc_strides[3]]);
    }
    m = mn;
  }
  // Combine the warps: out = sum_w acc_w exp(m_w - M) / sum_w l_w exp(m_w - M).
  __shared__ float sm[kWarps], sl[kWarps];
  __shared__ float sacc[kWarps][32 * kMaxSlices];
  if (lane == 0) {
    sm[warp] = m;
    sl[warp] = l;
  }
#pragma unroll
  for (int j = 0; j < kMaxSlices; ++j) sacc[warp][lane + 32 * j] = acc[j];
  __syncthreads();
  float M = -INFINITY;
  for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm[w]);
  float L = 0.f;
  for (int w = 0; w < kWarps; ++w) L += sm[w] == -INFINITY ? 0.f : sl[w] * __expf(sm[w] - M);
  T* o = static_cast<T*>(a.o) + r * a.ldo + hq * a.Dv;
  for (int64_t d = threadIdx.x; d < a.Dv; d += blockDim.x) {
    float v = 0.f;
    for (int w = 0; w < kWarps; ++w)
      if (sm[w] != -INFINITY) v += sacc[w][d] * __expf(sm[w] - M);
    o[d] = from_f<T>(v / L);
  }
}

// ---------------------------------------------------------------------------------------------
// sample: one block per row. The kept set is kernels_cpu's (min_p, then top_k's k-th largest
// value with ties kept, then top_p's smallest kept value): each threshold is found by a binary
// search over the order-preserving 32-bit keys of the floats (32 passes over the row, counts or
// masses reduced over the block), which needs no sort. The draw walks the kept weights in id
// order: per-thread contiguous chunks, their sums scanned in thread order.

constexpr int kSampleThreads = 512;

__device__ __forceinline__ uint32_t key_of(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float value_of(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

template <class T>
__device__ T block_reduce_sum(T v, T* sh) {
  return block_sum(v, sh);
}

__device__ float block_reduce_max(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  float r = -INFINITY;
  for (int i = 0; i < nw; ++i) r = fmaxf(r, sh[i]);
  return r;
}

__global__ void sample_kernel(SampleArgs a) {
  __shared__ double shd[32];
  __shared__ float shf[32];
  __shared__ double scan[kSampleThreads];
  const int64_t row = blockIdx.x, V = a.V;
  const float* logits = a.logits + row * a.ld;
  const bool greedy = a.temperature == 0.0;
  const float inv_t = greedy ? 1.f : float(1.0 / a.temperature);
  const int t = threadIdx.x, T = blockDim.x;
  // max of z = logits * inv_t, and whether any is NaN or infinite
  float mx = -INFINITY;
  int bad = 0;
  for (int64_t j = t; j < V; j += T) {
    const float z = logits[j] * inv_t;
    bad |= !isfinite(z);
    mx = fmaxf(mx, z);
  }
  mx = block_reduce_max(mx, shf);
  const double nbad = block_reduce_sum<double>(double(bad), shd);
  if (nbad > 0) {  // broken weights must not sample quietly: no token
    if (t == 0) {
      a.tokens[row] = -1;
      a.logprobs[row] = NAN;
    }
    return;
  }
  auto z_of = [&](int64_t j) { return logits[j] * inv_t; };
  float tau = -INFINITY;
  if (!greedy) {
    if (a.min_p > 0) tau = mx + float(log(a.min_p));
    // z' = z, or -inf below min_p's cut (what top-k / top-p see)
    auto zc = [&](int64_t j) {
      const float z = z_of(j);
      return z < tau ? -INFINITY : z;
    };
    uint32_t kcut = 0;  // top-k's threshold key (0: none)
    if (a.top_k > 0 && a.top_k < V) {
      // smallest key c with count(key > c) < k: the k-th largest value (ties kept)
      uint32_t lo = 0, hi = 0xffffffffu;
      while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        double n = 0;
        for (int64_t j = t; j < V; j += T) n += key_of(zc(j)) > mid ? 1.0 : 0.0;
        n = block_reduce_sum<double>(n, shd);
        if (n < double(a.top_k)) hi = mid; else lo = mid + 1;
      }
      kcut = lo;
      tau = fmaxf(tau, value_of(kcut));
    }
    if (a.top_p < 1.0) {
      // over the top-k set: total mass, then the smallest key c with mass(key > c) < p total
      double total = 0;
      for (int64_t j = t; j < V; j += T) {
        const float z = zc(j);
        if (key_of(z) >= kcut && z != -INFINITY) total += exp(double(z - mx));
      }
      total = block_reduce_sum<double>(total, shd);
      uint32_t lo = 0, hi = 0xffffffffu;
      while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        double mass = 0;
        for (int64_t j = t; j < V; j += T) {
          const float z = zc(j);
          const uint32_t k = key_of(z);
          if (k >= kcut && k > mid && z != -INFINITY) mass += exp(double(z - mx));
        }
        mass = block_reduce_sum<double>(mass, shd);
        if (mass < a.top_p * total) hi = mid; else lo = mid + 1;
      }
      tau = fmaxf(tau, value_of(lo));
    }
  }
  // kept weights, their float sum, the log-sum-exp
  const int64_t chunk = (V + T - 1) / T, b = t * chunk, e = b + chunk < V ? b + chunk : V;
  float fsum = 0.f;
  double csum = 0;
  for (int64_t j = b; j < e; ++j) {
    const float z = z_of(j);
    const float w = z >= tau ? __expf(z - mx) : 0.f;
    fsum += w;
    csum += double(w);
  }
  const double total = block_reduce_sum<double>(double(fsum), shd);
  const double lse = double(mx) + log(total);
  int64_t tok = -1;
  if (greedy) {
    // the lowest id among equal maxima
    int64_t first = V;
    for (int64_t j = t; j < V; j += T)
      if (z_of(j) == mx && j < first) first = j;
    double f = double(first);
    // block min through the max of -f
    const float neg = block_reduce_max(-float(f), shf);
    tok = int64_t(-neg);
  } else {
    // inverse CDF in id order: exclusive scan of the chunk sums in thread order
    scan[t] = csum;
    __syncthreads();
    if (t == 0) {
      double acc = 0;
      for (int i = 0; i < T; ++i) {
        const double c = scan[i];
        scan[i] = acc;
        acc += c;
      }
    }
    __syncthreads();
    const double target = a.u[row] * total;
    __shared__ unsigned long long found;  // the drawn id; all ones: none
    if (t == 0) found = ~0ull;
    __syncthreads();
    double acc = scan[t];
    if (acc <= target && b < e) {
      for (int64_t j = b; j < e; ++j) {
        const float z = z_of(j);
        const float w = z >= tau ? __expf(z - mx) : 0.f;
        if (w <= 0.f) continue;
        acc += double(w);
        if (acc > target) {
          atomicMin(&found, (unsigned long long)j);  // one thread's chunk holds it
          break;
        }
      }
    }
    __syncthreads();
    tok = found == ~0ull ? -1 : int64_t(found);
    if (tok < 0) {  // a target rounded past the end: the last token with weight
      int64_t last = -1;
      for (int64_t j = t; j < V; j += T)
        if (z_of(j) >= tau && j > last) last = j;
      const float l = block_reduce_max(float(last), shf);
      tok = int64_t(l);
    }
  }
  if (t == 0) {
    a.tokens[row] = int32_t(tok);
    a.logprobs[row] = tok >= 0 ? float(double(z_of(tok)) - lse) : NAN;
  }
}

}  // namespace

void kv_cache_write(const KvWriteArgs& a, cudaStream_t s) {
  if (a.R == 0) return;
  if (a.t == DType::bf16)
    kv_write_kernel<bf16><<<unsigned(a.R), 128, 0, s>>>(a);
  else
    kv_write_kernel<float><<<unsigned(a.R), 128, 0, s>>>(a);
  check_launch("kv_cache_write");
}

void paged_attention(const PagedAttnArgs& a, cudaStream_t s) {
  if (a.Dk > 32 * kMaxSlices || a.Dv > 32 * kMaxSlices)
    throw std::invalid_argument("paged_attention: head dims above 256 are not offered");
  if (a.Hkv < 1 || a.Hq % a.Hkv) throw std::invalid_argument("paged_attention: Hq must be a multiple of Hkv");
  if (a.R == 0) return;
  const dim3 grid(unsigned(a.R), unsigned(a.Hq));
  if (a.t == DType::bf16)
    paged_attention_kernel<bf16><<<grid, 32 * kWarps, 0, s>>>(a);
  else
    paged_attention_kernel<float><<<grid, 32 * kWarps, 0, s>>>(a);
  check_launch("paged_attention");
}

void sample(const SampleArgs& a, cudaStream_t s) {
  if (a.S == 0) return;
  if (!(a.temperature >= 0) || !std::isfinite(a.temperature))
    throw std::invalid_argument("sample: temperature must be a finite number >= 0");
  if (!(a.top_p > 0 && a.top_p <= 1)) throw std::invalid_argument("sample: top_p must be in (0, 1]");
  if (!(a.min_p >= 0 && a.min_p <= 1)) throw std::invalid_argument("sample: min_p must be in [0, 1]");
  sample_kernel<<<unsigned(a.S), kSampleThreads, 0, s>>>(a);
  check_launch("sample");
}

}  // namespace rlh::kcuda
