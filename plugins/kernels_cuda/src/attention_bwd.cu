// Attention backward on tensor cores (bf16, head dim 64 or 128, Dk = Dv), recomputing
// P = exp(S - lse) tile by tile, in two passes so that every output row has one writer
// (deterministic, no atomics):
//   dK/dV: a block of 4 warps owns 64 keys of one kv head (16 a warp) and streams the query
//     tiles (64 rows of Q and dO, double-buffered) of every query head of its GQA group:
//     S^T = K Q^T, P^T, dP^T = V dO^T, dS^T = P^T (dP^T - Delta), dV += P^T dO, dK += dS^T Q.
//   dQ: a block of 4 warps owns 64 queries of one head (Q, dO fragments in registers) and
//     streams key/value tiles: S = Q K^T, P, dP = dO V^T, dS, dQ += dS K.
// Delta = rowsum(dO * O) comes from attention_delta (fp32). All products on mma.sync m16n8k16
// with fp32 accumulators.
#include "attention_common.cuh"
#include "mma.cuh"

namespace rlh::kcuda {

using namespace mma;

namespace {

// x clamped to [-1, hi] as an int (mask bounds relative to a tile start).
__device__ __forceinline__ int64_t clamp_rel(int64_t x, int64_t hi) {
  return x < -1 ? -1 : (x > hi ? hi : x);
}

constexpr float kLog2e = 1.4426950408889634f;

// dK/dV: BKV keys per block over WARPS warps (KT = BKV / (16 WARPS) key m-tiles per warp, which
// share each Q / dO fragment), query tiles of BQ rows.
template <int D, int BKV, int BQ, int WARPS>
struct DkdvCfg {
  static constexpr int KT = BKV / (16 * WARPS);
  static constexpr int THREADS = WARPS * 32;
  static constexpr size_t smem =
      size_t(2 * BKV * D + 4 * BQ * D) * sizeof(bf16) + size_t(2 * BQ) * 3 * sizeof(float);
  static_assert(KT >= 1 && BKV == KT * 16 * WARPS, "BKV must be a multiple of 16 * WARPS");
};

template <int D, int BKV, int BQ, int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
attn_bwd_dkdv_kernel(const bf16* __restrict__ q, int64_t ldq, const bf16* __restrict__ k,
                     int64_t ldk, const bf16* __restrict__ v, int64_t ldv,
                     const bf16* __restrict__ dout, int64_t lddo, Flex lse,
                     const float* __restrict__ delta, bf16* __restrict__ dk, int64_t lddk,
                     bf16* __restrict__ dv, int64_t lddv, const int32_t* __restrict__ cu,
                     int64_t S, int64_t N, int grp, float scale, int64_t W) {
  using Cfg = DkdvCfg<D, BKV, BQ, WARPS>;
  constexpr int KS = D / 16, NQ = BQ / 8, DT = D / 8, KT = Cfg::KT, TH = Cfg::THREADS;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* Ks = reinterpret_cast<bf16*>(smem_raw);
  bf16* Vs = Ks + BKV * D;
  bf16* Qs = Vs + BKV * D;      // [2][BQ][D]
  bf16* dOs = Qs + 2 * BQ * D;  // [2][BQ][D]
  float* lse2s = reinterpret_cast<float*>(dOs + 2 * BQ * D);  // [2][BQ]
  float* dels = lse2s + 2 * BQ;                               // [2][BQ]
  int* los = reinterpret_cast<int*>(dels + 2 * BQ);           // [2][BQ], relative to k0

  const int g = blockIdx.y;
  const int64_t k0 = int64_t(blockIdx.x) * BKV;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int64_t klast = min(k0 + BKV, N) - 1;
  const int64_t qend = key_hi(cu, S, klast, W) + 1;
  const int ntq = int((qend - k0 + BQ - 1) / BQ);
  const int iters = ntq * grp;

  load_tile<BKV, D, TH>(Ks, k + int64_t(g) * D, ldk, k0, N);
  load_tile<BKV, D, TH>(Vs, v + int64_t(g) * D, ldv, k0, N);

  auto prefetch = [&](int it, int buf) {
    const int hh = it / ntq;
    const int64_t qt = k0 + int64_t(it % ntq) * BQ;
    const int h = g * grp + hh;
    load_tile<BQ, D, TH>(Qs + buf * BQ * D, q + int64_t(h) * D, ldq, qt, qend);
    load_tile<BQ, D, TH>(dOs + buf * BQ * D, dout + int64_t(h) * D, lddo, qt, qend);
    for (int i = threadIdx.x; i < BQ; i += TH) {
      const int64_t r = qt + i;
      const bool ok = r < qend;
      lse2s[buf * BQ + i] = ok ? ld_flex(lse, int64_t(h) * N + r) * kLog2e : INFINITY;
      dels[buf * BQ + i] = ok ? delta[int64_t(h) * N + r] : 0.f;
      los[buf * BQ + i] = ok ? int(row_lo(cu, S, r, W) - k0) : (1 << 30);
    }
  };
  prefetch(0, 0);
  cp_commit();

  float dka[KT][DT][4], dva[KT][DT][4];
#pragma unroll
  for (int t = 0; t < KT; ++t)
#pragma unroll
    for (int i = 0; i < DT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) dka[t][i][e] = dva[t][i][e] = 0.f;

  const float sl2 = scale * kLog2e;
  const int kr0 = warp * 16 * KT;

  for (int it = 0; it < iters; ++it) {
    const int buf = it & 1;
    if (it + 1 < iters) prefetch(it + 1, buf ^ 1);
    cp_commit();
    cp_wait<1>();
    __syncthreads();
    const int64_t qt = k0 + int64_t(it % ntq) * BQ;
    const bf16* Qb = Qs + buf * BQ * D;
    const bf16* dOb = dOs + buf * BQ * D;
    const float* lse2 = lse2s + buf * BQ;
    const float* del = dels + buf * BQ;
    const int* lo = los + buf * BQ;

    float st[KT][NQ][4], dpt[KT][NQ][4];
#pragma unroll
    for (int t = 0; t < KT; ++t)
#pragma unroll
      for (int i = 0; i < NQ; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[t][i][e] = dpt[t][i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      uint32_t ak[KT][4], av[KT][4];
#pragma unroll
      for (int t = 0; t < KT; ++t) {
        frag_a<D>(ak[t], Ks, kr0 + t * 16, kk * 16);
        frag_a<D>(av[t], Vs, kr0 + t * 16, kk * 16);
      }
#pragma unroll
      for (int np = 0; np < NQ / 2; ++np) {
        uint32_t b[4];
        frag_b_nk<D>(b, Qb, np * 16, kk * 16);
#pragma unroll
        for (int t = 0; t < KT; ++t) {
          mma16816(st[t][2 * np], ak[t], b[0], b[1]);
          mma16816(st[t][2 * np + 1], ak[t], b[2], b[3]);
        }
        frag_b_nk<D>(b, dOb, np * 16, kk * 16);
#pragma unroll
        for (int t = 0; t < KT; ++t) {
          mma16816(dpt[t][2 * np], av[t], b[0], b[1]);
          mma16816(dpt[t][2 * np + 1], av[t], b[2], b[3]);
        }
      }
    }
    const int64_t qlast_t = min(qt + BQ, qend) - 1;
    const bool need_mask = (qt < k0 + BKV - 1) || (lo[int(qlast_t - qt)] > 0);
    const int qrel = int(qt - k0);  // query column c is token k0 + qrel + c
    // P^T and dS^T (rows: keys; columns: queries).
#pragma unroll
    for (int t = 0; t < KT; ++t)
#pragma unroll
      for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = nt * 8 + t4 * 2 + (e & 1);
          float p = fast_exp2(st[t][nt][e] * sl2 - lse2[c]);
          if (need_mask) {
            const int kjr = kr0 + t * 16 + gid + (e >> 1) * 8;  // key relative to k0
            if (kjr > qrel + c || kjr < lo[c]) p = 0.f;
          }
          st[t][nt][e] = p;
          dpt[t][nt][e] = p * (dpt[t][nt][e] - del[c]);
        }
    // dV += P^T dO, dK += dS^T Q (k = queries).
#pragma unroll
    for (int j = 0; j < BQ / 16; ++j) {
      uint32_t ap[KT][4], as[KT][4];
#pragma unroll
      for (int t = 0; t < KT; ++t) {
        ap[t][0] = pack_bf16(st[t][2 * j][0], st[t][2 * j][1]);
        ap[t][1] = pack_bf16(st[t][2 * j][2], st[t][2 * j][3]);
        ap[t][2] = pack_bf16(st[t][2 * j + 1][0], st[t][2 * j + 1][1]);
        ap[t][3] = pack_bf16(st[t][2 * j + 1][2], st[t][2 * j + 1][3]);
        as[t][0] = pack_bf16(dpt[t][2 * j][0], dpt[t][2 * j][1]);
        as[t][1] = pack_bf16(dpt[t][2 * j][2], dpt[t][2 * j][3]);
        as[t][2] = pack_bf16(dpt[t][2 * j + 1][0], dpt[t][2 * j + 1][1]);
        as[t][3] = pack_bf16(dpt[t][2 * j + 1][2], dpt[t][2 * j + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t b[4];
        frag_b_kn<D>(b, dOb, j * 16, dp * 16);
#pragma unroll
        for (int t = 0; t < KT; ++t) {
          mma16816(dva[t][2 * dp], ap[t], b[0], b[1]);
          mma16816(dva[t][2 * dp + 1], ap[t], b[2], b[3]);
        }
        frag_b_kn<D>(b, Qb, j * 16, dp * 16);
#pragma unroll
        for (int t = 0; t < KT; ++t) {
          mma16816(dka[t][2 * dp], as[t], b[0], b[1]);
          mma16816(dka[t][2 * dp + 1], as[t], b[2], b[3]);
        }
      }
    }
    __syncthreads();
  }
  cp_wait<0>();
  const int off = g * D;
#pragma unroll
  for (int t = 0; t < KT; ++t)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int64_t kj = k0 + kr0 + t * 16 + gid + hf * 8;
      if (kj >= N) continue;
#pragma unroll
      for (int i = 0; i < DT; ++i) {
        *reinterpret_cast<__nv_bfloat162*>(dk + kj * lddk + off + i * 8 + t4 * 2) =
            __floats2bfloat162_rn(dka[t][i][2 * hf] * scale, dka[t][i][2 * hf + 1] * scale);
        *reinterpret_cast<__nv_bfloat162*>(dv + kj * lddv + off + i * 8 + t4 * 2) =
            __floats2bfloat162_rn(dva[t][i][2 * hf], dva[t][i][2 * hf + 1]);
      }
    }
}

// dQ: QB queries per block, 16 rows a warp, key tiles of KB.
template <int D, int QB, int KB>
struct DqCfg {
  static constexpr int WARPS = QB / 16;
  static constexpr int THREADS = WARPS * 32;
  static constexpr size_t smem = size_t(2 * QB * D + 4 * KB * D) * sizeof(bf16);
};

template <int D, int QB, int KB>
__global__ void __launch_bounds__(QB * 2)
attn_bwd_dq_kernel(const bf16* __restrict__ q, int64_t ldq, const bf16* __restrict__ k,
                   int64_t ldk, const bf16* __restrict__ v, int64_t ldv,
                   const bf16* __restrict__ dout, int64_t lddo, Flex lse,
                   const float* __restrict__ delta, bf16* __restrict__ dq, int64_t lddq,
                   const int32_t* __restrict__ cu, int64_t S, int64_t N, int grp, float scale,
                   int64_t W) {
  using Cfg = DqCfg<D, QB, KB>;
  constexpr int KS = D / 16, NT = KB / 8, DT = D / 8, TH = Cfg::THREADS;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);
  bf16* dOs = Qs + QB * D;
  bf16* Ks = dOs + QB * D;      // [2][KB][D]
  bf16* Vs = Ks + 2 * KB * D;   // [2][KB][D]
  const int h = blockIdx.y, g = h / grp;
  const int64_t q0 = (int64_t(gridDim.x) - 1 - blockIdx.x) * QB;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const bf16* kb = k + int64_t(g) * D;
  const bf16* vb = v + int64_t(g) * D;
  const int64_t qlast = min(q0 + QB, N) - 1;
  const int64_t kstart = row_lo(cu, S, q0, W), kend = qlast + 1;
  const int64_t lo_last = row_lo(cu, S, qlast, W);
  const int ntiles = int((kend - kstart + KB - 1) / KB);

  load_tile<QB, D, TH>(Qs, q + int64_t(h) * D, ldq, q0, N);
  load_tile<QB, D, TH>(dOs, dout + int64_t(h) * D, lddo, q0, N);
  cp_commit();
  load_tile<KB, D, TH>(Ks, kb, ldk, kstart, kend);
  load_tile<KB, D, TH>(Vs, vb, ldv, kstart, kend);
  cp_commit();

  int64_t row[2], lo[2];
  float lse2[2], del[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    row[hf] = q0 + warp * 16 + gid + hf * 8;
    const bool ok = row[hf] < N;
    lo[hf] = ok ? row_lo(cu, S, row[hf], W) : row[hf];
    lse2[hf] = ok ? ld_flex(lse, int64_t(h) * N + row[hf]) * kLog2e : INFINITY;
    del[hf] = ok ? delta[int64_t(h) * N + row[hf]] : 0.f;
  }

  cp_wait<1>();
  __syncthreads();
  uint32_t qf[KS][4], df[KS][4];
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    frag_a<D>(qf[kk], Qs, warp * 16, kk * 16);
    frag_a<D>(df[kk], dOs, warp * 16, kk * 16);
  }
  const float sl2 = scale * kLog2e;
  float acc[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  for (int it = 0; it < ntiles; ++it) {
    const int64_t kt = kstart + int64_t(it) * KB;
    if (it + 1 < ntiles) {
      const int nb = (it + 1) & 1;
      load_tile<KB, D, TH>(Ks + nb * KB * D, kb, ldk, kt + KB, kend);
      load_tile<KB, D, TH>(Vs + nb * KB * D, vb, ldv, kt + KB, kend);
    }
    cp_commit();
    cp_wait<1>();
    __syncthreads();
    const bf16* Kb = Ks + (it & 1) * KB * D;
    const bf16* Vb = Vs + (it & 1) * KB * D;
    float s[NT][4], dp[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t b[4];
        frag_b_nk<D>(b, Kb, np * 16, kk * 16);
        mma16816(s[2 * np], qf[kk], b[0], b[1]);
        mma16816(s[2 * np + 1], qf[kk], b[2], b[3]);
        frag_b_nk<D>(b, Vb, np * 16, kk * 16);
        mma16816(dp[2 * np], df[kk], b[0], b[1]);
        mma16816(dp[2 * np + 1], df[kk], b[2], b[3]);
      }
    }
    const bool need_mask = (kt + KB - 1 > q0) || (kt < lo_last) || (kt + KB > kend);
    int lo_c[2], hi_c[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      lo_c[hf] = int(clamp_rel(lo[hf] - kt, KB));
      hi_c[hf] = int(clamp_rel(min(row[hf], kend - 1) - kt, KB));
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hf = e >> 1;
        float p = fast_exp2(s[nt][e] * sl2 - lse2[hf]);
        if (need_mask) {
          const int c = nt * 8 + t4 * 2 + (e & 1);
          if (c < lo_c[hf] || c > hi_c[hf]) p = 0.f;
        }
        s[nt][e] = p * (dp[nt][e] - del[hf]);  // dS
      }
#pragma unroll
    for (int j = 0; j < KB / 16; ++j) {
      uint32_t a[4];
      a[0] = pack_bf16(s[2 * j][0], s[2 * j][1]);
      a[1] = pack_bf16(s[2 * j][2], s[2 * j][3]);
      a[2] = pack_bf16(s[2 * j + 1][0], s[2 * j + 1][1]);
      a[3] = pack_bf16(s[2 * j + 1][2], s[2 * j + 1][3]);
#pragma unroll
      for (int dd = 0; dd < DT / 2; ++dd) {
        uint32_t b[4];
        frag_b_kn<D>(b, Kb, j * 16, dd * 16);
        mma16816(acc[2 * dd], a, b[0], b[1]);
        mma16816(acc[2 * dd + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();
  }
  cp_wait<0>();
  const int off = h * D;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    if (row[hf] >= N) continue;
#pragma unroll
    for (int i = 0; i < DT; ++i)
      *reinterpret_cast<__nv_bfloat162*>(dq + row[hf] * lddq + off + i * 8 + t4 * 2) =
          __floats2bfloat162_rn(acc[i][2 * hf] * scale, acc[i][2 * hf + 1] * scale);
  }
}

template <int D, int BKV, int BQ, int WARPS>
void launch_dkdv(const AttnArgs& a, const float* delta, cudaStream_t s) {
  using Cfg = DkdvCfg<D, BKV, BQ, WARPS>;
  auto kernel = attn_bwd_dkdv_kernel<D, BKV, BQ, WARPS>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Cfg::smem)) !=
      cudaSuccess)
    throw std::runtime_error("attention_bwd: cannot raise the shared-memory limit");
  dim3 grid(ceil_div(a.N, BKV), unsigned(a.Hkv));
  kernel<<<grid, Cfg::THREADS, Cfg::smem, s>>>(
      static_cast<const bf16*>(a.q), a.ldq, static_cast<const bf16*>(a.k), a.ldk,
      static_cast<const bf16*>(a.v), a.ldv, static_cast<const bf16*>(a.dout), a.lddo, a.lse, delta,
      static_cast<bf16*>(a.dk), a.lddk, static_cast<bf16*>(a.dv), a.lddv, a.cu, a.S, a.N,
      int(a.Hq / a.Hkv), a.scale, a.window);
  check_launch("attention_bwd (mma dk/dv)");
}

template <int D, int QB, int KB>
void launch_dq(const AttnArgs& a, const float* delta, cudaStream_t s) {
  using Cfg = DqCfg<D, QB, KB>;
  auto kernel = attn_bwd_dq_kernel<D, QB, KB>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Cfg::smem)) !=
      cudaSuccess)
    throw std::runtime_error("attention_bwd: cannot raise the shared-memory limit");
  dim3 grid(ceil_div(a.N, QB), unsigned(a.Hq));
  kernel<<<grid, Cfg::THREADS, Cfg::smem, s>>>(
      static_cast<const bf16*>(a.q), a.ldq, static_cast<const bf16*>(a.k), a.ldk,
      static_cast<const bf16*>(a.v), a.ldv, static_cast<const bf16*>(a.dout), a.lddo, a.lse, delta,
      static_cast<bf16*>(a.dq), a.lddq, a.cu, a.S, a.N, int(a.Hq / a.Hkv), a.scale, a.window);
  check_launch("attention_bwd (mma dq)");
}

}  // namespace

// Variants (AttnArgs::variant; 0 = the default, chosen by measurement on an H200, see
// docs/kernels_cuda.md). dK/dV: keys x query tile / warps; dQ: queries x key tile.
//   D = 64:  1: dkdv 64x64/4w,  dq 64x64      2: dkdv 128x64/8w, dq 128x64
//            3: dkdv 128x32/4w (32 keys a warp), dq 64x64
//   D = 128: 1: dkdv 64x64/4w,  dq 64x64      2: dkdv 128x64/8w, dq 128x64
//            3: dkdv 64x32/4w, dq 64x32
void attention_bwd_mma(const AttnArgs& a, const DeviceInfo&, float* delta, cudaStream_t s) {
  const int v = a.variant;
  if (a.Dk == 64) {
    switch (v) {
      case 2: launch_dkdv<64, 128, 64, 8>(a, delta, s); launch_dq<64, 128, 64>(a, delta, s); break;
      case 3: launch_dkdv<64, 128, 32, 4>(a, delta, s); launch_dq<64, 64, 64>(a, delta, s); break;
      case 1: default: launch_dkdv<64, 64, 64, 4>(a, delta, s); launch_dq<64, 64, 64>(a, delta, s); break;
    }
  } else {
    switch (v) {
      case 2: launch_dkdv<128, 128, 64, 8>(a, delta, s); launch_dq<128, 128, 64>(a, delta, s); break;
      case 3: launch_dkdv<128, 64, 32, 4>(a, delta, s); launch_dq<128, 64, 32>(a, delta, s); break;
      case 1: default: launch_dkdv<128, 64, 64, 4>(a, delta, s); launch_dq<128, 64, 64>(a, delta, s); break;
    }
  }
}

}  // namespace rlh::kcuda
