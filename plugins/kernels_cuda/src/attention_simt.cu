// Attention on CUDA cores: any head dims (<= 256), f32 or bf16 operands, fp32 arithmetic with
// precise exp/log. The path for f32 (where the contract asks for float32 results) and for
// bf16 head dims the tensor-core kernels do not cover. Also the dispatch between the paths and
// the Delta = rowsum(dO * O) pre-pass of the backward.
//
// Soft-capping (softcap > 0, Gemma-2) runs here only: the tensor-core kernels do not cap.
//
// Forward: a block holds 16 queries (4 per warp) of one head; keys are staged 32 at a time in
// shared memory; lane j scores key j of the tile; online softmax per row.
// Backward, two passes so every output row has one writer (deterministic, as kernels_cpu):
// dK/dV per block of 32 keys of one kv head (a thread per key, summing over every query head
// of its group and every query that sees the key), then dQ per block of 32 queries of one head
// (a thread per query).
#include <cmath>

#include "attention_common.cuh"

namespace rlh::kcuda {
namespace {

constexpr int kMaxD = 256;
constexpr int FQ = 16, FK = 32;  // forward: queries per block, keys per tile

template <class T, bool CAP>
__global__ void __launch_bounds__(128)
attn_fwd_simt(const T* q, int64_t ldq, const T* k, int64_t ldk, const T* v, int64_t ldv, T* o,
              int64_t ldo, Flex lse, const int32_t* cu, int64_t S, int64_t N, int Hq, int Hkv,
              int Dk, int Dv, float scale, int64_t W, float cap) {
  extern __shared__ float sm[];
  float* Ks = sm;                      // [FK][Dk+1]
  float* Vs = Ks + FK * (Dk + 1);      // [FK][Dv+1]
  float* Qs = Vs + FK * (Dv + 1);      // [FQ][Dk]
  const int h = blockIdx.y, g = h / (Hq / Hkv);
  const int64_t q0 = (int64_t(gridDim.x) - 1 - blockIdx.x) * FQ;  // long tiles first
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t qlast = min(q0 + FQ, N) - 1;
  for (int i = threadIdx.x; i < FQ * Dk; i += blockDim.x) {
    const int64_t r = q0 + i / Dk;
    Qs[i] = r < N ? to_f(q[r * ldq + int64_t(h) * Dk + i % Dk]) * scale : 0.f;
  }
  float m[4], l[4], acc[4][kMaxD / 32];
  int64_t lo[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.f;
    const int64_t qi = q0 + warp * 4 + j;
    lo[j] = qi < N ? row_lo(cu, S, qi, W) : qi;
#pragma unroll
    for (int u = 0; u < kMaxD / 32; ++u) acc[j][u] = 0.f;
  }
  const int64_t kstart = row_lo(cu, S, q0, W), kend = qlast + 1;
  for (int64_t kt = kstart; kt < kend; kt += FK) {
    __syncthreads();
    for (int i = threadIdx.x; i < FK * Dk; i += blockDim.x) {
      const int64_t kj = kt + i / Dk;
      Ks[(i / Dk) * (Dk + 1) + i % Dk] = kj < kend ? to_f(k[kj * ldk + int64_t(g) * Dk + i % Dk]) : 0.f;
    }
    for (int i = threadIdx.x; i < FK * Dv; i += blockDim.x) {
      const int64_t kj = kt + i / Dv;
      Vs[(i / Dv) * (Dv + 1) + i % Dv] = kj < kend ? to_f(v[kj * ldv + int64_t(g) * Dv + i % Dv]) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = warp * 4 + j;
      const int64_t qi = q0 + r, kj = kt + lane;
      if (qi >= N) continue;
      const bool valid = kj >= lo[j] && kj <= qi;
      float s = -INFINITY;
      if (valid) {
        s = 0.f;
        const float* qr = Qs + r * Dk;
        const float* kr = Ks + lane * (Dk + 1);
        for (int d = 0; d < Dk; ++d) s += qr[d] * kr[d];
        s = soft_cap_if<CAP>(s, cap);  // the scaled score, capped before the softmax (HF's order)
      }
      const float mt = warp_max(s);
      const float mn = fmaxf(m[j], mt);
      if (mn == -INFINITY) continue;
      const float alpha = expf(m[j] - mn);
      const float p = valid ? expf(s - mn) : 0.f;
      l[j] = l[j] * alpha + warp_sum(p);
      m[j] = mn;
#pragma unroll
      for (int u = 0; u < kMaxD / 32; ++u) acc[j][u] *= alpha;
      for (int jj = 0; jj < FK; ++jj) {
        const float pj = __shfl_sync(0xffffffffu, p, jj);
        if (pj == 0.f) continue;
        const float* vr = Vs + jj * (Dv + 1);
#pragma unroll
        for (int u = 0; u < kMaxD / 32; ++u) {
          const int d = lane + 32 * u;
          if (d < Dv) acc[j][u] += pj * vr[d];
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t qi = q0 + warp * 4 + j;
    if (qi >= N) continue;
    const float inv = 1.f / l[j];
#pragma unroll
    for (int u = 0; u < kMaxD / 32; ++u) {
      const int d = lane + 32 * u;
      if (d < Dv) o[qi * ldo + int64_t(h) * Dv + d] = from_f<T>(acc[j][u] * inv);
    }
    if (lane == 0) st_flex(lse, int64_t(h) * N + qi, m[j] + logf(l[j]));
  }
}

constexpr int BK = 32;  // backward: keys (dK/dV) or queries (dQ) per block, a thread each
constexpr int QC = 16;  // dK/dV: queries staged per step

template <class T, bool CAP>
__global__ void __launch_bounds__(32)
attn_bwd_dkdv_simt(const T* q, int64_t ldq, const T* k, int64_t ldk, const T* v, int64_t ldv,
                   const T* dout, int64_t lddo, Flex lse, const float* delta, T* dk,
                   int64_t lddk, T* dv, int64_t lddv, const int32_t* cu, int64_t S, int64_t N,
                   int Hq, int Hkv, int Dk, int Dv, float scale, int64_t W, float cap) {
  extern __shared__ float sm[];
  float* Kr = sm;                        // [BK][Dk+1]
  float* Vr = Kr + BK * (Dk + 1);        // [BK][Dv+1]
  float* dK = Vr + BK * (Dv + 1);        // [BK][Dk+1]
  float* dV = dK + BK * (Dk + 1);        // [BK][Dv+1]
  float* Qc = dV + BK * (Dv + 1);        // [QC][Dk]
  float* dOc = Qc + QC * Dk;             // [QC][Dv]
  float* rowv = dOc + QC * Dv;           // [QC][3]: lse, delta, lo
  const int g = blockIdx.y, grp = Hq / Hkv;
  const int64_t k0 = int64_t(blockIdx.x) * BK;
  const int t = threadIdx.x;
  const int64_t kj = k0 + t;
  const int64_t klast = min(k0 + BK, N) - 1;
  for (int i = t; i < BK * Dk; i += 32) {
    const int64_t r = k0 + i / Dk;
    Kr[(i / Dk) * (Dk + 1) + i % Dk] = r < N ? to_f(k[r * ldk + int64_t(g) * Dk + i % Dk]) : 0.f;
    dK[(i / Dk) * (Dk + 1) + i % Dk] = 0.f;
  }
  for (int i = t; i < BK * Dv; i += 32) {
    const int64_t r = k0 + i / Dv;
    Vr[(i / Dv) * (Dv + 1) + i % Dv] = r < N ? to_f(v[r * ldv + int64_t(g) * Dv + i % Dv]) : 0.f;
    dV[(i / Dv) * (Dv + 1) + i % Dv] = 0.f;
  }
  // Queries that can see some key of this block: k0 .. key_hi(klast).
  const int64_t qend = key_hi(cu, S, klast, W) + 1;
  float* myK = Kr + t * (Dk + 1);
  float* myV = Vr + t * (Dv + 1);
  float* mydK = dK + t * (Dk + 1);
  float* mydV = dV + t * (Dv + 1);
  for (int hh = 0; hh < grp; ++hh) {
    const int h = g * grp + hh;
    for (int64_t qc = k0; qc < qend; qc += QC) {
      __syncthreads();
      for (int i = t; i < QC * Dk; i += 32) {
        const int64_t r = qc + i / Dk;
        Qc[i] = r < qend ? to_f(q[r * ldq + int64_t(h) * Dk + i % Dk]) : 0.f;
      }
      for (int i = t; i < QC * Dv; i += 32) {
        const int64_t r = qc + i / Dv;
        dOc[i] = r < qend ? to_f(dout[r * lddo + int64_t(h) * Dv + i % Dv]) : 0.f;
      }
      if (t < QC) {
        const int64_t r = qc + t;
        rowv[t * 3 + 0] = r < qend ? ld_flex(lse, int64_t(h) * N + r) : 0.f;
        rowv[t * 3 + 1] = r < qend ? delta[int64_t(h) * N + r] : 0.f;
        rowv[t * 3 + 2] = r < qend ? float(row_lo(cu, S, r, W) - k0) : 1e30f;  // relative
      }
      __syncthreads();
      if (kj >= N) continue;
      for (int rr = 0; rr < QC; ++rr) {
        const int64_t qi = qc + rr;
        if (qi >= qend) break;
        if (kj > qi || float(kj - k0) < rowv[rr * 3 + 2]) continue;
        const float* qr = Qc + rr * Dk;
        const float* dor = dOc + rr * Dv;
        float s = 0.f, dp = 0.f;
        for (int d = 0; d < Dk; ++d) s += qr[d] * myK[d];
        for (int d = 0; d < Dv; ++d) dp += dor[d] * myV[d];
        const float p = expf(soft_cap_if<CAP>(s * scale, cap) - rowv[rr * 3 + 0]);
        const float ds = p * (dp - rowv[rr * 3 + 1]) * scale * soft_cap_grad_if<CAP>(s * scale, cap);
        for (int d = 0; d < Dv; ++d) mydV[d] += p * dor[d];
        for (int d = 0; d < Dk; ++d) mydK[d] += ds * qr[d];
      }
    }
  }
  __syncthreads();
  for (int i = t; i < BK * Dk; i += 32) {
    const int64_t r = k0 + i / Dk;
    if (r < N) dk[r * lddk + int64_t(g) * Dk + i % Dk] = from_f<T>(dK[(i / Dk) * (Dk + 1) + i % Dk]);
  }
  for (int i = t; i < BK * Dv; i += 32) {
    const int64_t r = k0 + i / Dv;
    if (r < N) dv[r * lddv + int64_t(g) * Dv + i % Dv] = from_f<T>(dV[(i / Dv) * (Dv + 1) + i % Dv]);
  }
}

template <class T, bool CAP>
__global__ void __launch_bounds__(32)
attn_bwd_dq_simt(const T* q, int64_t ldq, const T* k, int64_t ldk, const T* v, int64_t ldv,
                 const T* dout, int64_t lddo, Flex lse, const float* delta, T* dq, int64_t lddq,
                 const int32_t* cu, int64_t S, int64_t N, int Hq, int Hkv, int Dk, int Dv,
                 float scale, int64_t W, float cap) {
  extern __shared__ float sm[];
  float* Qr = sm;                      // [BK][Dk+1]
  float* dOr = Qr + BK * (Dk + 1);     // [BK][Dv+1]
  float* dQ = dOr + BK * (Dv + 1);     // [BK][Dk+1]
  float* Kt = dQ + BK * (Dk + 1);      // [BK][Dk]
  float* Vt = Kt + BK * Dk;            // [BK][Dv]
  const int h = blockIdx.y, g = h / (Hq / Hkv);
  const int64_t q0 = (int64_t(gridDim.x) - 1 - blockIdx.x) * BK;
  const int t = threadIdx.x;
  const int64_t qi = q0 + t;
  for (int i = t; i < BK * Dk; i += 32) {
    const int64_t r = q0 + i / Dk;
    Qr[(i / Dk) * (Dk + 1) + i % Dk] = r < N ? to_f(q[r * ldq + int64_t(h) * Dk + i % Dk]) : 0.f;
    dQ[(i / Dk) * (Dk + 1) + i % Dk] = 0.f;
  }
  for (int i = t; i < BK * Dv; i += 32) {
    const int64_t r = q0 + i / Dv;
    dOr[(i / Dv) * (Dv + 1) + i % Dv] = r < N ? to_f(dout[r * lddo + int64_t(h) * Dv + i % Dv]) : 0.f;
  }
  const bool live = qi < N;
  const float my_lse = live ? ld_flex(lse, int64_t(h) * N + qi) : 0.f;
  const float my_delta = live ? delta[int64_t(h) * N + qi] : 0.f;
  const int64_t my_lo = live ? row_lo(cu, S, qi, W) : 0;
  const int64_t qlast = min(q0 + BK, N) - 1;
  const int64_t kstart = row_lo(cu, S, q0, W);
  float* myQ = Qr + t * (Dk + 1);
  float* mydO = dOr + t * (Dv + 1);
  float* mydQ = dQ + t * (Dk + 1);
  for (int64_t kt = kstart; kt <= qlast; kt += BK) {
    __syncthreads();
    for (int i = t; i < BK * Dk; i += 32) {
      const int64_t r = kt + i / Dk;
      Kt[i] = r <= qlast ? to_f(k[r * ldk + int64_t(g) * Dk + i % Dk]) : 0.f;
    }
    for (int i = t; i < BK * Dv; i += 32) {
      const int64_t r = kt + i / Dv;
      Vt[i] = r <= qlast ? to_f(v[r * ldv + int64_t(g) * Dv + i % Dv]) : 0.f;
    }
    __syncthreads();
    if (!live) continue;
    for (int jj = 0; jj < BK; ++jj) {
      const int64_t kj = kt + jj;
      if (kj < my_lo || kj > qi) continue;
      const float* kr = Kt + jj * Dk;
      const float* vr = Vt + jj * Dv;
      float s = 0.f, dp = 0.f;
      for (int d = 0; d < Dk; ++d) s += myQ[d] * kr[d];
      for (int d = 0; d < Dv; ++d) dp += mydO[d] * vr[d];
      const float p = expf(soft_cap_if<CAP>(s * scale, cap) - my_lse);
      const float ds = p * (dp - my_delta) * scale * soft_cap_grad_if<CAP>(s * scale, cap);
      for (int d = 0; d < Dk; ++d) mydQ[d] += ds * kr[d];
    }
  }
  if (!live) return;
  for (int d = 0; d < Dk; ++d) dq[qi * lddq + int64_t(h) * Dk + d] = from_f<T>(mydQ[d]);
}

template <class T>
__global__ void attn_delta_kernel(const T* dout, int64_t lddo, const T* o, int64_t ldo,
                                  float* delta, int64_t N, int Hq, int Dv) {
  const int64_t w = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= N * Hq) return;
  const int64_t i = w / Hq;
  const int h = int(w - i * Hq);
  float acc = 0.f;
  for (int d = lane; d < Dv; d += 32)
    acc += to_f(dout[i * lddo + int64_t(h) * Dv + d]) * to_f(o[i * ldo + int64_t(h) * Dv + d]);
  acc = warp_sum(acc);
  if (lane == 0) delta[int64_t(h) * N + i] = acc;
}

template <class K>
void set_smem(K kernel, size_t bytes) {
  if (bytes > 48 * 1024) {
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    if (e != cudaSuccess) throw std::runtime_error(std::string("attention smem: ") + cudaGetErrorString(e));
  }
}

template <class T, bool CAP>
void fwd_simt_t(const AttnArgs& a, cudaStream_t s) {
  const int Dk = int(a.Dk), Dv = int(a.Dv);
  const size_t smem = sizeof(float) * (FK * (Dk + 1) + FK * (Dv + 1) + FQ * Dk);
  set_smem(attn_fwd_simt<T, CAP>, smem);
  dim3 grid(ceil_div(a.N, FQ), unsigned(a.Hq));
  attn_fwd_simt<T, CAP><<<grid, 128, smem, s>>>(
      static_cast<const T*>(a.q), a.ldq, static_cast<const T*>(a.k), a.ldk,
      static_cast<const T*>(a.v), a.ldv, static_cast<T*>(a.o), a.ldo, a.lse, a.cu, a.S, a.N,
      int(a.Hq), int(a.Hkv), Dk, Dv, a.scale, a.window, a.softcap);
}

template <class T, bool CAP>
void bwd_simt_t(const AttnArgs& a, const float* delta, cudaStream_t s) {
  const int Dk = int(a.Dk), Dv = int(a.Dv);
  const size_t smem1 = sizeof(float) * (2 * BK * (Dk + 1) + 2 * BK * (Dv + 1) + QC * (Dk + Dv) + QC * 3);
  set_smem(attn_bwd_dkdv_simt<T, CAP>, smem1);
  dim3 g1(ceil_div(a.N, BK), unsigned(a.Hkv));
  attn_bwd_dkdv_simt<T, CAP><<<g1, 32, smem1, s>>>(
      static_cast<const T*>(a.q), a.ldq, static_cast<const T*>(a.k), a.ldk,
      static_cast<const T*>(a.v), a.ldv, static_cast<const T*>(a.dout), a.lddo, a.lse, delta,
      static_cast<T*>(a.dk), a.lddk, static_cast<T*>(a.dv), a.lddv, a.cu, a.S, a.N, int(a.Hq),
      int(a.Hkv), Dk, Dv, a.scale, a.window, a.softcap);
  check_launch("attention_bwd (dk/dv)");
  const size_t smem2 = sizeof(float) * (2 * BK * (Dk + 1) + BK * (Dv + 1) + BK * (Dk + Dv));
  set_smem(attn_bwd_dq_simt<T, CAP>, smem2);
  dim3 g2(ceil_div(a.N, BK), unsigned(a.Hq));
  attn_bwd_dq_simt<T, CAP><<<g2, 32, smem2, s>>>(
      static_cast<const T*>(a.q), a.ldq, static_cast<const T*>(a.k), a.ldk,
      static_cast<const T*>(a.v), a.ldv, static_cast<const T*>(a.dout), a.lddo, a.lse, delta,
      static_cast<T*>(a.dq), a.lddq, a.cu, a.S, a.N, int(a.Hq), int(a.Hkv), Dk, Dv, a.scale,
      a.window, a.softcap);
}

void check_dims(const AttnArgs& a) {
  if (a.Hkv <= 0 || a.Hq % a.Hkv != 0)
    throw std::invalid_argument("attention: Hq must be a multiple of Hkv");
  if (a.Dk <= 0 || a.Dv <= 0 || a.Dk > kMaxD || a.Dv > kMaxD)
    throw std::invalid_argument("attention: head dims must be in 1..256");
  if (a.S < 1) throw std::invalid_argument("attention: cu_seqlens needs at least 2 entries");
  if (!(a.softcap >= 0) || !std::isfinite(a.softcap)) throw std::invalid_argument("attention: softcap must be a finite number >= 0");
  if (a.Hq > 65535 || a.Hkv > 65535) throw std::invalid_argument("attention: too many heads");
}

}  // namespace

void attention_fwd_simt(const AttnArgs& a, const DeviceInfo&, cudaStream_t s) {
  const bool cap = a.softcap > 0;  // compiled in only where asked
  if (a.t == DType::f32) cap ? fwd_simt_t<float, true>(a, s) : fwd_simt_t<float, false>(a, s);
  else cap ? fwd_simt_t<bf16, true>(a, s) : fwd_simt_t<bf16, false>(a, s);
  check_launch("attention_fwd (simt)");
}

void attention_bwd_simt(const AttnArgs& a, const DeviceInfo&, float* delta, cudaStream_t s) {
  const bool cap = a.softcap > 0;
  if (a.t == DType::f32) cap ? bwd_simt_t<float, true>(a, delta, s) : bwd_simt_t<float, false>(a, delta, s);
  else cap ? bwd_simt_t<bf16, true>(a, delta, s) : bwd_simt_t<bf16, false>(a, delta, s);
  check_launch("attention_bwd (simt)");
}

void attention_delta(const AttnArgs& a, float* delta, cudaStream_t s) {
  const int64_t warps = a.N * a.Hq;
  const unsigned grid = ceil_div(warps * 32, 256);
  if (a.t == DType::f32)
    attn_delta_kernel<<<grid, 256, 0, s>>>(static_cast<const float*>(a.dout), a.lddo,
                                           static_cast<const float*>(a.o), a.ldo, delta, a.N,
                                           int(a.Hq), int(a.Dv));
  else
    attn_delta_kernel<<<grid, 256, 0, s>>>(static_cast<const bf16*>(a.dout), a.lddo,
                                           static_cast<const bf16*>(a.o), a.ldo, delta, a.N,
                                           int(a.Hq), int(a.Dv));
  check_launch("attention_bwd (delta)");
}

const char* attention_path(const AttnArgs& a) {
  if (a.force_simt || !attention_mma_ok(a, false)) return "simt";
  return a.Dk == 64 ? "mma_d64" : "mma_d128";
}

void attention_fwd(const AttnArgs& a, const DeviceInfo& dev, cudaStream_t s) {
  check_dims(a);
  if (a.N == 0) return;
  if (!a.force_simt && attention_mma_ok(a, false))
    attention_fwd_mma(a, dev, s);
  else
    attention_fwd_simt(a, dev, s);
}

void attention_bwd(const AttnArgs& a, const DeviceInfo& dev, Workspace& ws, cudaStream_t s) {
  check_dims(a);
  if (a.N == 0) return;
  auto* delta = static_cast<float*>(ws.get(size_t(a.N * a.Hq) * sizeof(float)));
  attention_delta(a, delta, s);
  if (!a.force_simt && attention_mma_ok(a, true))
    attention_bwd_mma(a, dev, delta, s);
  else
    attention_bwd_simt(a, dev, delta, s);
}

}  // namespace rlh::kcuda
