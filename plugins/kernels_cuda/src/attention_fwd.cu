// Attention forward on tensor cores (bf16, head dim 64 or 128, Dk = Dv): FlashAttention-2
// style. A block of 8 warps holds 128 queries of one head (16 rows a warp, Q fragments in
// registers); key/value tiles of 64 rows stream through double-buffered shared memory with
// cp.async; S = Q K^T and O += P V on mma.sync m16n8k16 with fp32 accumulators; online softmax
// in fp32 (exp2 with the scale folded in). Masks (causal, packed sequences, window) are applied
// only on tiles that need them. lse is written in fp32 (or bf16 if that is what was passed).
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

constexpr int FBQ = 128, FBK = 64, FWARPS = 8, FTHREADS = FWARPS * 32;

template <int D>
constexpr size_t fwd_smem() { return size_t(FBQ * D + 4 * FBK * D) * sizeof(bf16); }

template <int D>
__global__ void __launch_bounds__(FTHREADS)
attn_fwd_mma_kernel(const bf16* __restrict__ q, int64_t ldq, const bf16* __restrict__ k,
                    int64_t ldk, const bf16* __restrict__ v, int64_t ldv, bf16* __restrict__ o,
                    int64_t ldo, Flex lse, const int32_t* __restrict__ cu, int64_t S, int64_t N,
                    int grp, float scale, int64_t W) {
  constexpr int KS = D / 16, NT = FBK / 8, DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);
  bf16* Ks = Qs + FBQ * D;      // [2][FBK][D]
  bf16* Vs = Ks + 2 * FBK * D;  // [2][FBK][D]
  const int h = blockIdx.y, g = h / grp;
  const int64_t q0 = (int64_t(gridDim.x) - 1 - blockIdx.x) * FBQ;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const bf16* qb = q + int64_t(h) * D;
  const bf16* kb = k + int64_t(g) * D;
  const bf16* vb = v + int64_t(g) * D;

  const int64_t qlast = min(q0 + FBQ, N) - 1;
  const int64_t kstart = row_lo(cu, S, q0, W), kend = qlast + 1;
  const int64_t lo_last = row_lo(cu, S, qlast, W);
  const int ntiles = int((kend - kstart + FBK - 1) / FBK);

  load_tile<FBQ, D, FTHREADS>(Qs, qb, ldq, q0, N);
  cp_commit();
  load_tile<FBK, D, FTHREADS>(Ks, kb, ldk, kstart, kend);
  load_tile<FBK, D, FTHREADS>(Vs, vb, ldv, kstart, kend);
  cp_commit();

  const int64_t ra = q0 + warp * 16 + gid, rb = ra + 8;
  const int64_t lo_a = ra < N ? row_lo(cu, S, ra, W) : ra;
  const int64_t lo_b = rb < N ? row_lo(cu, S, rb, W) : rb;

  cp_wait<1>();
  __syncthreads();
  uint32_t qf[KS][4];
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) frag_a<D>(qf[kk], Qs, warp * 16, kk * 16);

  const float sl2 = scale * 1.4426950408889634f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
  float acc[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  for (int it = 0; it < ntiles; ++it) {
    const int64_t kt = kstart + int64_t(it) * FBK;
    if (it + 1 < ntiles) {
      const int nb = (it + 1) & 1;
      load_tile<FBK, D, FTHREADS>(Ks + nb * FBK * D, kb, ldk, kt + FBK, kend);
      load_tile<FBK, D, FTHREADS>(Vs + nb * FBK * D, vb, ldv, kt + FBK, kend);
    }
    cp_commit();
    cp_wait<1>();
    __syncthreads();
    const bf16* Kb = Ks + (it & 1) * FBK * D;
    const bf16* Vb = Vs + (it & 1) * FBK * D;

    float s[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t b[4];
        frag_b_nk<D>(b, Kb, np * 16, kk * 16);
        mma16816(s[2 * np], qf[kk], b[0], b[1]);
        mma16816(s[2 * np + 1], qf[kk], b[2], b[3]);
      }
    }
    const bool need_mask = (kt + FBK - 1 > q0) || (kt < lo_last) || (kt + FBK > kend);
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t kj = kt + nt * 8 + t4 * 2 + (e & 1);
          const int64_t r = e < 2 ? ra : rb, lo = e < 2 ? lo_a : lo_b;
          if (kj < lo || kj > r || kj >= kend) s[nt][e] = -INFINITY;
        }
    }
    // Online softmax, rows a (e = 0, 1) and b (e = 2, 3).
    float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      mx_a = fmaxf(mx_a, fmaxf(s[nt][0], s[nt][1]));
      mx_b = fmaxf(mx_b, fmaxf(s[nt][2], s[nt][3]));
    }
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
    const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
    const float ms_a = mn_a == -INFINITY ? 0.f : mn_a * sl2;
    const float ms_b = mn_b == -INFINITY ? 0.f : mn_b * sl2;
    const float al_a = fast_exp2(m_a * sl2 - ms_a), al_b = fast_exp2(m_b * sl2 - ms_b);
    m_a = mn_a;
    m_b = mn_b;
    float ps_a = 0.f, ps_b = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][0] = fast_exp2(s[nt][0] * sl2 - ms_a);
      s[nt][1] = fast_exp2(s[nt][1] * sl2 - ms_a);
      s[nt][2] = fast_exp2(s[nt][2] * sl2 - ms_b);
      s[nt][3] = fast_exp2(s[nt][3] * sl2 - ms_b);
      ps_a += s[nt][0] + s[nt][1];
      ps_b += s[nt][2] + s[nt][3];
    }
    l_a = l_a * al_a + ps_a;
    l_b = l_b * al_b + ps_b;
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      acc[i][0] *= al_a;
      acc[i][1] *= al_a;
      acc[i][2] *= al_b;
      acc[i][3] *= al_b;
    }
    // O += P V
#pragma unroll
    for (int j = 0; j < FBK / 16; ++j) {
      uint32_t a[4];
      a[0] = pack_bf16(s[2 * j][0], s[2 * j][1]);
      a[1] = pack_bf16(s[2 * j][2], s[2 * j][3]);
      a[2] = pack_bf16(s[2 * j + 1][0], s[2 * j + 1][1]);
      a[3] = pack_bf16(s[2 * j + 1][2], s[2 * j + 1][3]);
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t b[4];
        frag_b_kn<D>(b, Vb, j * 16, dp * 16);
        mma16816(acc[2 * dp], a, b[0], b[1]);
        mma16816(acc[2 * dp + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();
  }
  cp_wait<0>();

  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
  const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f, inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
  const int h_off = h * D;
  if (ra < N) {
    bf16* orow = o + ra * ldo + h_off;
#pragma unroll
    for (int i = 0; i < DT; ++i)
      *reinterpret_cast<__nv_bfloat162*>(orow + i * 8 + t4 * 2) =
          __floats2bfloat162_rn(acc[i][0] * inv_a, acc[i][1] * inv_a);
    if (t4 == 0) st_flex(lse, int64_t(h) * N + ra, m_a * scale + logf(l_a));
  }
  if (rb < N) {
    bf16* orow = o + rb * ldo + h_off;
#pragma unroll
    for (int i = 0; i < DT; ++i)
      *reinterpret_cast<__nv_bfloat162*>(orow + i * 8 + t4 * 2) =
          __floats2bfloat162_rn(acc[i][2] * inv_b, acc[i][3] * inv_b);
    if (t4 == 0) st_flex(lse, int64_t(h) * N + rb, m_b * scale + logf(l_b));
  }
}

template <int D>
void launch_fwd(const AttnArgs& a, cudaStream_t s) {
  constexpr size_t smem = fwd_smem<D>();
  if (cudaFuncSetAttribute(attn_fwd_mma_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           int(smem)) != cudaSuccess)
    throw std::runtime_error("attention_fwd: cannot raise the shared-memory limit");
  dim3 grid(ceil_div(a.N, FBQ), unsigned(a.Hq));
  attn_fwd_mma_kernel<D><<<grid, FTHREADS, smem, s>>>(
      static_cast<const bf16*>(a.q), a.ldq, static_cast<const bf16*>(a.k), a.ldk,
      static_cast<const bf16*>(a.v), a.ldv, static_cast<bf16*>(a.o), a.ldo, a.lse, a.cu, a.S, a.N,
      int(a.Hq / a.Hkv), a.scale, a.window);
}

bool al16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool attention_mma_ok(const AttnArgs& a, bool backward) {
  if (a.t != DType::bf16 || a.Dk != a.Dv || (a.Dk != 64 && a.Dk != 128)) return false;
  const bool base = al16(a.q) && al16(a.k) && al16(a.v) && a.ldq % 8 == 0 && a.ldk % 8 == 0 &&
                    a.ldv % 8 == 0 && a.ldo % 2 == 0 && reinterpret_cast<uintptr_t>(a.o) % 4 == 0;
  if (!base) return false;
  if (!backward) return true;
  return al16(a.o) && a.ldo % 8 == 0 && al16(a.dout) && a.lddo % 8 == 0 && a.lddq % 2 == 0 &&
         a.lddk % 2 == 0 && a.lddv % 2 == 0 && reinterpret_cast<uintptr_t>(a.dq) % 4 == 0 &&
         reinterpret_cast<uintptr_t>(a.dk) % 4 == 0 && reinterpret_cast<uintptr_t>(a.dv) % 4 == 0;
}

void attention_fwd_mma(const AttnArgs& a, const DeviceInfo&, cudaStream_t s) {
  if (a.Dk == 64) launch_fwd<64>(a, s); else launch_fwd<128>(a, s);
  check_launch("attention_fwd (mma)");
}

}  // namespace rlh::kcuda
