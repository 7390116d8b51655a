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

// x clamped to [-1, hi] as an int (mask bounds relative to a tile start).
__device__ __forceinline__ int64_t clamp_rel(int64_t x, int64_t hi) {
  return x < -1 ? -1 : (x > hi ? hi : x);
}

// Tile configurations: BQ queries per block over WARPS warps (MT = BQ / (16 WARPS) m-tiles of
// 16 rows per warp, which share each K/V fragment read from shared memory), BK keys per tile.
template <int D, int BQ, int BK, int WARPS>
struct FwdCfg {
  static constexpr int MT = BQ / (16 * WARPS);
  static constexpr int THREADS = WARPS * 32;
  static constexpr size_t smem = size_t(BQ * D + 4 * BK * D) * sizeof(bf16);
  static_assert(MT >= 1 && BQ == MT * 16 * WARPS, "BQ must be a multiple of 16 * WARPS");
};

template <int D, int BQ, int BK, int WARPS, int MINB>
__global__ void __launch_bounds__(WARPS * 32, MINB)
attn_fwd_mma_kernel(const bf16* __restrict__ q, int64_t ldq, const bf16* __restrict__ k,
                    int64_t ldk, const bf16* __restrict__ v, int64_t ldv, bf16* __restrict__ o,
                    int64_t ldo, Flex lse, const int32_t* __restrict__ cu, int64_t S, int64_t N,
                    int grp, float scale, int64_t W) {
  using Cfg = FwdCfg<D, BQ, BK, WARPS>;
  constexpr int KS = D / 16, NT = BK / 8, DT = D / 8, MT = Cfg::MT, TH = Cfg::THREADS;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);
  bf16* Ks = Qs + BQ * D;      // [2][BK][D]
  bf16* Vs = Ks + 2 * BK * D;  // [2][BK][D]
  const int h = blockIdx.y, g = h / grp;
  const int64_t q0 = (int64_t(gridDim.x) - 1 - blockIdx.x) * BQ;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const bf16* qb = q + int64_t(h) * D;
  const bf16* kb = k + int64_t(g) * D;
  const bf16* vb = v + int64_t(g) * D;

  const int64_t qlast = min(q0 + BQ, N) - 1;
  const int64_t kstart = row_lo(cu, S, q0, W), kend = qlast + 1;
  const int64_t lo_last = row_lo(cu, S, qlast, W);
  const int ntiles = int((kend - kstart + BK - 1) / BK);

  load_tile<BQ, D, TH>(Qs, qb, ldq, q0, N);
  cp_commit();
  load_tile<BK, D, TH>(Ks, kb, ldk, kstart, kend);
  load_tile<BK, D, TH>(Vs, vb, ldv, kstart, kend);
  cp_commit();

  // Rows of this thread: m-tile mt, half 0 (gid) and 1 (gid + 8).
  int64_t row[MT][2], lo[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      row[mt][hf] = q0 + warp * 16 * MT + mt * 16 + gid + hf * 8;
      lo[mt][hf] = row[mt][hf] < N ? row_lo(cu, S, row[mt][hf], W) : row[mt][hf];
    }

  cp_wait<1>();
  __syncthreads();
  uint32_t qf[MT][KS][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) frag_a<D>(qf[mt][kk], Qs, warp * 16 * MT + mt * 16, kk * 16);

  const float sl2 = scale * 1.4426950408889634f;
  float m[MT][2], l[MT][2];
  float acc[MT][DT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
#pragma unroll
    for (int i = 0; i < DT; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;
  }

  for (int it = 0; it < ntiles; ++it) {
    const int64_t kt = kstart + int64_t(it) * BK;
    if (it + 1 < ntiles) {
      const int nb = (it + 1) & 1;
      load_tile<BK, D, TH>(Ks + nb * BK * D, kb, ldk, kt + BK, kend);
      load_tile<BK, D, TH>(Vs + nb * BK * D, vb, ldv, kt + BK, kend);
    }
    cp_commit();
    cp_wait<1>();
    __syncthreads();
    const bf16* Kb = Ks + (it & 1) * BK * D;
    const bf16* Vb = Vs + (it & 1) * BK * D;

    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < NT; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t b[4];
        frag_b_nk<D>(b, Kb, np * 16, kk * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(s[mt][2 * np], qf[mt][kk], b[0], b[1]);
          mma16816(s[mt][2 * np + 1], qf[mt][kk], b[2], b[3]);
        }
      }
    }
    const bool need_mask = (kt + BK - 1 > q0) || (kt < lo_last) || (kt + BK > kend);
    if (need_mask) {
      // Relative to kt in 32-bit: key kt + c is valid for row r iff lo - kt <= c <= r - kt.
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int64_t lo_r = lo[mt][hf] - kt, hi_r = min(row[mt][hf], kend - 1) - kt;
          const int lo_c = int(clamp_rel(lo_r, BK));
          const int hi_c = int(clamp_rel(hi_r, BK));
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int c = nt * 8 + t4 * 2 + e;
              if (c < lo_c || c > hi_c) s[mt][nt][hf * 2 + e] = -INFINITY;
            }
        }
    }
    // Online softmax per row (half hf of m-tile mt holds elements 2 hf, 2 hf + 1).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m[mt][hf], mx);
        const float ms = mn == -INFINITY ? 0.f : mn * sl2;
        const float al = fast_exp2(m[mt][hf] * sl2 - ms);
        m[mt][hf] = mn;
        float ps = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          s[mt][nt][2 * hf] = fast_exp2(s[mt][nt][2 * hf] * sl2 - ms);
          s[mt][nt][2 * hf + 1] = fast_exp2(s[mt][nt][2 * hf + 1] * sl2 - ms);
          ps += s[mt][nt][2 * hf] + s[mt][nt][2 * hf + 1];
        }
        l[mt][hf] = l[mt][hf] * al + ps;
#pragma unroll
        for (int i = 0; i < DT; ++i) {
          acc[mt][i][2 * hf] *= al;
          acc[mt][i][2 * hf + 1] *= al;
        }
      }
    // O += P V
#pragma unroll
    for (int j = 0; j < BK / 16; ++j) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = pack_bf16(s[mt][2 * j][0], s[mt][2 * j][1]);
        a[mt][1] = pack_bf16(s[mt][2 * j][2], s[mt][2 * j][3]);
        a[mt][2] = pack_bf16(s[mt][2 * j + 1][0], s[mt][2 * j + 1][1]);
        a[mt][3] = pack_bf16(s[mt][2 * j + 1][2], s[mt][2 * j + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t b[4];
        frag_b_kn<D>(b, Vb, j * 16, dp * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(acc[mt][2 * dp], a[mt], b[0], b[1]);
          mma16816(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();
  }
  cp_wait<0>();

  const int h_off = h * D;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float lr = l[mt][hf];
      lr += __shfl_xor_sync(0xffffffffu, lr, 1);
      lr += __shfl_xor_sync(0xffffffffu, lr, 2);
      const int64_t r = row[mt][hf];
      if (r >= N) continue;
      const float inv = lr > 0.f ? 1.f / lr : 0.f;
      bf16* orow = o + r * ldo + h_off;
#pragma unroll
      for (int i = 0; i < DT; ++i)
        *reinterpret_cast<__nv_bfloat162*>(orow + i * 8 + t4 * 2) =
            __floats2bfloat162_rn(acc[mt][i][2 * hf] * inv, acc[mt][i][2 * hf + 1] * inv);
      if (t4 == 0) st_flex(lse, int64_t(h) * N + r, m[mt][hf] * scale + logf(lr));
    }
}

// MINB: blocks per SM asked of the register allocator (__launch_bounds__).
template <int D, int BQ, int BK, int WARPS, int MINB = 1>
void launch_fwd(const AttnArgs& a, cudaStream_t s) {
  using Cfg = FwdCfg<D, BQ, BK, WARPS>;
  auto kernel = attn_fwd_mma_kernel<D, BQ, BK, WARPS, MINB>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Cfg::smem)) !=
      cudaSuccess)
    throw std::runtime_error("attention_fwd: cannot raise the shared-memory limit");
  dim3 grid(ceil_div(a.N, BQ), unsigned(a.Hq));
  kernel<<<grid, Cfg::THREADS, Cfg::smem, s>>>(
      static_cast<const bf16*>(a.q), a.ldq, static_cast<const bf16*>(a.k), a.ldk,
      static_cast<const bf16*>(a.v), a.ldv, static_cast<bf16*>(a.o), a.ldo, a.lse, a.cu, a.S, a.N,
      int(a.Hq / a.Hkv), a.scale, a.window);
}

bool al16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool attention_mma_ok(const AttnArgs& a, bool backward) {
  if (a.t != DType::bf16 || a.Dk != a.Dv || (a.Dk != 64 && a.Dk != 128) || a.softcap != 0) return false;
  const bool base = al16(a.q) && al16(a.k) && al16(a.v) && a.ldq % 8 == 0 && a.ldk % 8 == 0 &&
                    a.ldv % 8 == 0 && a.ldo % 2 == 0 && reinterpret_cast<uintptr_t>(a.o) % 4 == 0;
  if (!base) return false;
  if (!backward) return true;
  return al16(a.o) && a.ldo % 8 == 0 && al16(a.dout) && a.lddo % 8 == 0 && a.lddq % 2 == 0 &&
         a.lddk % 2 == 0 && a.lddv % 2 == 0 && reinterpret_cast<uintptr_t>(a.dq) % 4 == 0 &&
         reinterpret_cast<uintptr_t>(a.dk) % 4 == 0 && reinterpret_cast<uintptr_t>(a.dv) % 4 == 0;
}

// Variants (AttnArgs::variant; 0 = the default, chosen by measurement on an H200, see
// docs/kernels_cuda.md): BQ x BK tiles over WARPS warps.
//   D = 64:  1: 128x64/8w (16 rows a warp)  2: 128x64/4w (32 rows a warp)  3: 64x64/4w
//            4: 128x128/8w  5: 128x64/8w, 2 blocks/SM  6: 64x64/4w, 4 blocks/SM
//   D = 128: 1: 128x64/8w  2: 128x32/4w (32 rows a warp)  3: 64x64/4w
void attention_fwd_mma(const AttnArgs& a, const DeviceInfo&, cudaStream_t s) {
  const int v = a.variant;
  if (a.Dk == 64) {
    switch (v) {
      case 1: launch_fwd<64, 128, 64, 8>(a, s); break;
      case 3: launch_fwd<64, 64, 64, 4>(a, s); break;
      case 4: launch_fwd<64, 128, 128, 8>(a, s); break;
      case 5: launch_fwd<64, 128, 64, 8, 2>(a, s); break;
      case 6: launch_fwd<64, 64, 64, 4, 4>(a, s); break;
      case 2: default: launch_fwd<64, 128, 64, 4>(a, s); break;
    }
  } else {
    switch (v) {
      case 2: launch_fwd<128, 128, 32, 4>(a, s); break;
      case 3: launch_fwd<128, 64, 64, 4>(a, s); break;
      case 1: default: launch_fwd<128, 128, 64, 8>(a, s); break;
    }
  }
  check_launch("attention_fwd (mma)");
}

}  // namespace rlh::kcuda
