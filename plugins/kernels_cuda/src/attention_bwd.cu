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

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr int BKV = 64, BQ2 = 64, BWARPS = 4, BTHREADS = BWARPS * 32;

template <int D>
constexpr size_t dkdv_smem() {
  return size_t(2 * BKV * D + 4 * BQ2 * D) * sizeof(bf16) + size_t(2 * BQ2) * 3 * sizeof(float);
}

template <int D>
__global__ void __launch_bounds__(BTHREADS)
attn_bwd_dkdv_kernel(const bf16* __restrict__ q, int64_t ldq, const bf16* __restrict__ k,
                     int64_t ldk, const bf16* __restrict__ v, int64_t ldv,
                     const bf16* __restrict__ dout, int64_t lddo, Flex lse,
                     const float* __restrict__ delta, bf16* __restrict__ dk, int64_t lddk,
                     bf16* __restrict__ dv, int64_t lddv, const int32_t* __restrict__ cu,
                     int64_t S, int64_t N, int grp, float scale, int64_t W) {
  constexpr int KS = D / 16, NQ = BQ2 / 8, DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* Ks = reinterpret_cast<bf16*>(smem_raw);
  bf16* Vs = Ks + BKV * D;
  bf16* Qs = Vs + BKV * D;       // [2][BQ2][D]
  bf16* dOs = Qs + 2 * BQ2 * D;  // [2][BQ2][D]
  float* lse2s = reinterpret_cast<float*>(dOs + 2 * BQ2 * D);  // [2][BQ2]
  float* dels = lse2s + 2 * BQ2;                               // [2][BQ2]
  int* los = reinterpret_cast<int*>(dels + 2 * BQ2);           // [2][BQ2], relative to k0

  const int g = blockIdx.y;
  const int64_t k0 = int64_t(blockIdx.x) * BKV;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int64_t klast = min(k0 + BKV, N) - 1;
  const int64_t qend = key_hi(cu, S, klast, W) + 1;
  const int ntq = int((qend - k0 + BQ2 - 1) / BQ2);
  const int iters = ntq * grp;

  load_tile<BKV, D, BTHREADS>(Ks, k + int64_t(g) * D, ldk, k0, N);
  load_tile<BKV, D, BTHREADS>(Vs, v + int64_t(g) * D, ldv, k0, N);

  auto prefetch = [&](int it, int buf) {
    const int hh = it / ntq;
    const int64_t qt = k0 + int64_t(it % ntq) * BQ2;
    const int h = g * grp + hh;
    load_tile<BQ2, D, BTHREADS>(Qs + buf * BQ2 * D, q + int64_t(h) * D, ldq, qt, qend);
    load_tile<BQ2, D, BTHREADS>(dOs + buf * BQ2 * D, dout + int64_t(h) * D, lddo, qt, qend);
    for (int i = threadIdx.x; i < BQ2; i += BTHREADS) {
      const int64_t r = qt + i;
      const bool ok = r < qend;
      lse2s[buf * BQ2 + i] = ok ? ld_flex(lse, int64_t(h) * N + r) * kLog2e : INFINITY;
      dels[buf * BQ2 + i] = ok ? delta[int64_t(h) * N + r] : 0.f;
      los[buf * BQ2 + i] = ok ? int(row_lo(cu, S, r, W) - k0) : (1 << 30);
    }
  };
  prefetch(0, 0);
  cp_commit();

  float dka[DT][4], dva[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dka[i][e] = dva[i][e] = 0.f;

  const float sl2 = scale * kLog2e;
  const int kr0 = warp * 16;
  const int64_t kj_a = k0 + kr0 + gid, kj_b = kj_a + 8;

  for (int it = 0; it < iters; ++it) {
    const int buf = it & 1;
    if (it + 1 < iters) prefetch(it + 1, buf ^ 1);
    cp_commit();
    cp_wait<1>();
    __syncthreads();
    const int64_t qt = k0 + int64_t(it % ntq) * BQ2;
    const bf16* Qb = Qs + buf * BQ2 * D;
    const bf16* dOb = dOs + buf * BQ2 * D;
    const float* lse2 = lse2s + buf * BQ2;
    const float* del = dels + buf * BQ2;
    const int* lo = los + buf * BQ2;

    float st[NQ][4], dpt[NQ][4];
#pragma unroll
    for (int i = 0; i < NQ; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      uint32_t ak[4], av[4];
      frag_a<D>(ak, Ks, kr0, kk * 16);
      frag_a<D>(av, Vs, kr0, kk * 16);
#pragma unroll
      for (int np = 0; np < NQ / 2; ++np) {
        uint32_t b[4];
        frag_b_nk<D>(b, Qb, np * 16, kk * 16);
        mma16816(st[2 * np], ak, b[0], b[1]);
        mma16816(st[2 * np + 1], ak, b[2], b[3]);
        frag_b_nk<D>(b, dOb, np * 16, kk * 16);
        mma16816(dpt[2 * np], av, b[0], b[1]);
        mma16816(dpt[2 * np + 1], av, b[2], b[3]);
      }
    }
    const int64_t qlast_t = min(qt + BQ2, qend) - 1;
    const bool need_mask = (qt < k0 + BKV - 1) || (lo[int(qlast_t - qt)] > 0);
    // P^T and dS^T (rows: keys kj_a / kj_b; columns: queries).
#pragma unroll
    for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = nt * 8 + t4 * 2 + (e & 1);
        float p = fast_exp2(st[nt][e] * sl2 - lse2[c]);
        if (need_mask) {
          const int64_t kj = e < 2 ? kj_a : kj_b, qi = qt + c;
          if (kj > qi || int(kj - k0) < lo[c]) p = 0.f;
        }
        st[nt][e] = p;
        dpt[nt][e] = p * (dpt[nt][e] - del[c]);
      }
    // dV += P^T dO, dK += dS^T Q (k = queries).
#pragma unroll
    for (int j = 0; j < BQ2 / 16; ++j) {
      uint32_t ap[4], as[4];
      ap[0] = pack_bf16(st[2 * j][0], st[2 * j][1]);
      ap[1] = pack_bf16(st[2 * j][2], st[2 * j][3]);
      ap[2] = pack_bf16(st[2 * j + 1][0], st[2 * j + 1][1]);
      ap[3] = pack_bf16(st[2 * j + 1][2], st[2 * j + 1][3]);
      as[0] = pack_bf16(dpt[2 * j][0], dpt[2 * j][1]);
      as[1] = pack_bf16(dpt[2 * j][2], dpt[2 * j][3]);
      as[2] = pack_bf16(dpt[2 * j + 1][0], dpt[2 * j + 1][1]);
      as[3] = pack_bf16(dpt[2 * j + 1][2], dpt[2 * j + 1][3]);
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t b[4];
        frag_b_kn<D>(b, dOb, j * 16, dp * 16);
        mma16816(dva[2 * dp], ap, b[0], b[1]);
        mma16816(dva[2 * dp + 1], ap, b[2], b[3]);
        frag_b_kn<D>(b, Qb, j * 16, dp * 16);
        mma16816(dka[2 * dp], as, b[0], b[1]);
        mma16816(dka[2 * dp + 1], as, b[2], b[3]);
      }
    }
    __syncthreads();
  }
  cp_wait<0>();
  const int off = g * D;
  if (kj_a < N) {
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      *reinterpret_cast<__nv_bfloat162*>(dk + kj_a * lddk + off + i * 8 + t4 * 2) =
          __floats2bfloat162_rn(dka[i][0] * scale, dka[i][1] * scale);
      *reinterpret_cast<__nv_bfloat162*>(dv + kj_a * lddv + off + i * 8 + t4 * 2) =
          __floats2bfloat162_rn(dva[i][0], dva[i][1]);
    }
  }
  if (kj_b < N) {
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      *reinterpret_cast<__nv_bfloat162*>(dk + kj_b * lddk + off + i * 8 + t4 * 2) =
          __floats2bfloat162_rn(dka[i][2] * scale, dka[i][3] * scale);
      *reinterpret_cast<__nv_bfloat162*>(dv + kj_b * lddv + off + i * 8 + t4 * 2) =
          __floats2bfloat162_rn(dva[i][2], dva[i][3]);
    }
  }
}

constexpr int QB = 64, KB2 = 64;  // dQ: queries per block, keys per tile

template <int D>
constexpr size_t dq_smem() { return size_t(2 * QB * D + 4 * KB2 * D) * sizeof(bf16); }

template <int D>
__global__ void __launch_bounds__(BTHREADS)
attn_bwd_dq_kernel(const bf16* __restrict__ q, int64_t ldq, const bf16* __restrict__ k,
                   int64_t ldk, const bf16* __restrict__ v, int64_t ldv,
                   const bf16* __restrict__ dout, int64_t lddo, Flex lse,
                   const float* __restrict__ delta, bf16* __restrict__ dq, int64_t lddq,
                   const int32_t* __restrict__ cu, int64_t S, int64_t N, int grp, float scale,
                   int64_t W) {
  constexpr int KS = D / 16, NT = KB2 / 8, DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);
  bf16* dOs = Qs + QB * D;
  bf16* Ks = dOs + QB * D;       // [2][KB2][D]
  bf16* Vs = Ks + 2 * KB2 * D;   // [2][KB2][D]
  const int h = blockIdx.y, g = h / grp;
  const int64_t q0 = (int64_t(gridDim.x) - 1 - blockIdx.x) * QB;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const bf16* kb = k + int64_t(g) * D;
  const bf16* vb = v + int64_t(g) * D;
  const int64_t qlast = min(q0 + QB, N) - 1;
  const int64_t kstart = row_lo(cu, S, q0, W), kend = qlast + 1;
  const int64_t lo_last = row_lo(cu, S, qlast, W);
  const int ntiles = int((kend - kstart + KB2 - 1) / KB2);

  load_tile<QB, D, BTHREADS>(Qs, q + int64_t(h) * D, ldq, q0, N);
  load_tile<QB, D, BTHREADS>(dOs, dout + int64_t(h) * D, lddo, q0, N);
  cp_commit();
  load_tile<KB2, D, BTHREADS>(Ks, kb, ldk, kstart, kend);
  load_tile<KB2, D, BTHREADS>(Vs, vb, ldv, kstart, kend);
  cp_commit();

  const int64_t ra = q0 + warp * 16 + gid, rb = ra + 8;
  const int64_t lo_a = ra < N ? row_lo(cu, S, ra, W) : ra;
  const int64_t lo_b = rb < N ? row_lo(cu, S, rb, W) : rb;
  const float lse_a = ra < N ? ld_flex(lse, int64_t(h) * N + ra) * kLog2e : INFINITY;
  const float lse_b = rb < N ? ld_flex(lse, int64_t(h) * N + rb) * kLog2e : INFINITY;
  const float del_a = ra < N ? delta[int64_t(h) * N + ra] : 0.f;
  const float del_b = rb < N ? delta[int64_t(h) * N + rb] : 0.f;

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
    const int64_t kt = kstart + int64_t(it) * KB2;
    if (it + 1 < ntiles) {
      const int nb = (it + 1) & 1;
      load_tile<KB2, D, BTHREADS>(Ks + nb * KB2 * D, kb, ldk, kt + KB2, kend);
      load_tile<KB2, D, BTHREADS>(Vs + nb * KB2 * D, vb, ldv, kt + KB2, kend);
    }
    cp_commit();
    cp_wait<1>();
    __syncthreads();
    const bf16* Kb = Ks + (it & 1) * KB2 * D;
    const bf16* Vb = Vs + (it & 1) * KB2 * D;
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
    const bool need_mask = (kt + KB2 - 1 > q0) || (kt < lo_last) || (kt + KB2 > kend);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool ra_row = e < 2;
        float p = fast_exp2(s[nt][e] * sl2 - (ra_row ? lse_a : lse_b));
        if (need_mask) {
          const int64_t kj = kt + nt * 8 + t4 * 2 + (e & 1);
          const int64_t r = ra_row ? ra : rb, lo = ra_row ? lo_a : lo_b;
          if (kj < lo || kj > r || kj >= kend) p = 0.f;
        }
        s[nt][e] = p * (dp[nt][e] - (ra_row ? del_a : del_b));  // dS
      }
#pragma unroll
    for (int j = 0; j < KB2 / 16; ++j) {
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
  if (ra < N)
#pragma unroll
    for (int i = 0; i < DT; ++i)
      *reinterpret_cast<__nv_bfloat162*>(dq + ra * lddq + off + i * 8 + t4 * 2) =
          __floats2bfloat162_rn(acc[i][0] * scale, acc[i][1] * scale);
  if (rb < N)
#pragma unroll
    for (int i = 0; i < DT; ++i)
      *reinterpret_cast<__nv_bfloat162*>(dq + rb * lddq + off + i * 8 + t4 * 2) =
          __floats2bfloat162_rn(acc[i][2] * scale, acc[i][3] * scale);
}

template <int D>
void launch_bwd(const AttnArgs& a, const float* delta, cudaStream_t s) {
  const int grp = int(a.Hq / a.Hkv);
  {
    constexpr size_t smem = dkdv_smem<D>();
    if (cudaFuncSetAttribute(attn_bwd_dkdv_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(smem)) != cudaSuccess)
      throw std::runtime_error("attention_bwd: cannot raise the shared-memory limit");
    dim3 grid(ceil_div(a.N, BKV), unsigned(a.Hkv));
    attn_bwd_dkdv_kernel<D><<<grid, BTHREADS, smem, s>>>(
        static_cast<const bf16*>(a.q), a.ldq, static_cast<const bf16*>(a.k), a.ldk,
        static_cast<const bf16*>(a.v), a.ldv, static_cast<const bf16*>(a.dout), a.lddo, a.lse,
        delta, static_cast<bf16*>(a.dk), a.lddk, static_cast<bf16*>(a.dv), a.lddv, a.cu, a.S, a.N,
        grp, a.scale, a.window);
    check_launch("attention_bwd (mma dk/dv)");
  }
  {
    constexpr size_t smem = dq_smem<D>();
    if (cudaFuncSetAttribute(attn_bwd_dq_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(smem)) != cudaSuccess)
      throw std::runtime_error("attention_bwd: cannot raise the shared-memory limit");
    dim3 grid(ceil_div(a.N, QB), unsigned(a.Hq));
    attn_bwd_dq_kernel<D><<<grid, BTHREADS, smem, s>>>(
        static_cast<const bf16*>(a.q), a.ldq, static_cast<const bf16*>(a.k), a.ldk,
        static_cast<const bf16*>(a.v), a.ldv, static_cast<const bf16*>(a.dout), a.lddo, a.lse,
        delta, static_cast<bf16*>(a.dq), a.lddq, a.cu, a.S, a.N, grp, a.scale, a.window);
    check_launch("attention_bwd (mma dq)");
  }
}

}  // namespace

void attention_bwd_mma(const AttnArgs& a, const DeviceInfo&, float* delta, cudaStream_t s) {
  if (a.Dk == 64) launch_bwd<64>(a, delta, s); else launch_bwd<128>(a, delta, s);
}

}  // namespace rlh::kcuda
