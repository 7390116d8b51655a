// MoE router on the GPU: scores, top-k expert choice, routing weights (forward) and the gradient
// of the logits (backward), one warp per token row; docs/ops.md "moe_router_fwd" is the contract
// and kernels_cpu's router.cpp the reference, whose arithmetic this follows step by step so the
// choice (an integer output, compared exactly) is the same:
//   softmax  mx = max z, p = exp(z - mx) * (1 / sum), lse = mx + log(sum)
//   sigmoid  p = 1 / (1 + exp(-z))                       (lse, when asked, as above)
//   choice   the K largest of sel = p + bias, ties to the lower index; with n_group > 1 a group
//            scores the sum of its two best sel, the topk_group best groups stay and the other
//            experts compete with sel = 0 (HF's masked_fill)
//   weights  w_j = p[e_j] * f,  f = scaling_factor (/ sum_j p[e_j] (+1e-20 sigmoid) with norm)
// The top-k needs no sort and no marks: round j takes the largest (value, index) pair that
// comes strictly after round j-1's pick in the order (value descending, index ascending), a
// warp argmax per round. Sums that only scale a row (softmax's sum) are warp reductions; sums the
// CPU forms over the K choices (the weights' normaliser, the backward's S and dot) run in the
// CPU's order, j = 0..K-1, on every lane.
// Math is fp32 for f32 and bf16 operands, fp64 for f64 (router_fp64). p lives in shared memory
// (E values per warp) at math precision, so the choice never sees a bf16-rounded score.
#include <cfloat>
#include <type_traits>

#include "common.cuh"

namespace rlh::kcuda {
namespace {

constexpr int kMaxK = 64;  // top_k and n_group bound (kernels_cpu's)

template <class M>
__device__ __forceinline__ M ld_m(const Flex& f, int64_t i) {
  if constexpr (std::is_same_v<M, double>)
    return static_cast<const double*>(f.p)[i];
  else
    return ld_flex(f, i);
}
template <class M>
__device__ __forceinline__ void st_m(const Flex& f, int64_t i, M v) {
  if constexpr (std::is_same_v<M, double>)
    static_cast<double*>(f.p)[i] = v;
  else
    st_flex(f, i, v);
}
template <class M, class T>
__device__ __forceinline__ M ld_t(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, bf16>)
    return M(__bfloat162float(p[i]));
  else
    return M(p[i]);
}
template <class T, class M>
__device__ __forceinline__ void st_t(T* p, int64_t i, M v) {
  if constexpr (std::is_same_v<T, bf16>)
    p[i] = __float2bfloat16_rn(float(v));
  else
    p[i] = T(v);
}
__device__ __forceinline__ float exp_m(float x) { return expf(x); }
__device__ __forceinline__ double exp_m(double x) { return exp(x); }
__device__ __forceinline__ float log_m(float x) { return logf(x); }
__device__ __forceinline__ double log_m(double x) { return log(x); }

template <class M>
__device__ __forceinline__ M warp_max_m(M v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const M w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;  // std::max(a, b) of the CPU keeps a unless b > a
  }
  return v;
}

// (v, i) comes before (bv, bi) in the choice order: larger value first, then lower index.
template <class M>
__device__ __forceinline__ bool before(M v, int i, M bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

// Warp argmax of (v, i, have) in the choice order; every lane gets the winner.
template <class M>
__device__ __forceinline__ void warp_best(M& v, int& i, bool& have) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const M ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    const bool oh = __shfl_xor_sync(0xffffffffu, int(have), o) != 0;
    if (oh && (!have || before(ov, oi, v, i))) {
      v = ov;
      i = oi;
      have = true;
    }
  }
}

struct RouterK {  // kernel parameters (RouterArgs without the host-only fields)
  int64_t N, E, K, ldl, lddl, n_group, topk_group;
  int scoring;
  bool norm, replay;
  double sf;
  const void* logits;
  Flex bias, weights, probs, lse, dweights, dprobs, dlse;
  int32_t* experts;
  void* dlogits;
  int* err;
};

template <class T, class M>
__global__ void router_fwd_kernel(RouterK a, int warps) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t n = int64_t(blockIdx.x) * warps + w;
  if (n >= a.N) return;  // whole warps leave; nothing below synchronises the block
  const int64_t E = a.E, K = a.K;
  M* p = reinterpret_cast<M*>(smem_raw) + int64_t(w) * E;
  const T* z = static_cast<const T*>(a.logits) + n * a.ldl;

  // Scores (and the logits' log-sum-exp).
  M mx = M(0), sum = M(0);
  const bool want_lse = a.lse.p != nullptr;
  if (a.scoring == 0 || want_lse) {
    mx = ld_t<M>(z, 0);
    for (int64_t e = lane; e < E; e += 32) {
      const M v = ld_t<M>(z, e);
      mx = v > mx ? v : mx;
    }
    mx = warp_max_m(mx);
  }
  if (a.scoring == 0) {
    for (int64_t e = lane; e < E; e += 32) {
      const M v = exp_m(ld_t<M>(z, e) - mx);
      p[e] = v;
      sum += v;
    }
    sum = warp_sum(sum);
    const M inv = M(1) / sum;
    for (int64_t e = lane; e < E; e += 32) p[e] *= inv;
  } else {
    for (int64_t e = lane; e < E; e += 32) p[e] = M(1) / (M(1) + exp_m(-ld_t<M>(z, e)));
    if (want_lse) {
      for (int64_t e = lane; e < E; e += 32) sum += exp_m(ld_t<M>(z, e) - mx);
      sum = warp_sum(sum);
    }
  }
  for (int64_t e = lane; e < E; e += 32) st_m<M>(a.probs, n * E + e, p[e]);
  if (want_lse && lane == 0) st_m<M>(a.lse, n, mx + log_m(sum));
  __syncwarp();

  // Choice: lane j (and j + 32) keeps pick j.
  int pick0 = 0, pick1 = 0;
  bool bad = false;
  if (a.replay) {
    int32_t* ex = a.experts + n * K;
    if (lane < K) pick0 = ex[lane];
    if (lane + 32 < K) pick1 = ex[lane + 32];
    for (int64_t j = 0; j < K; ++j) {  // range and repeats, as the CPU refuses them
      const int ej = __shfl_sync(0xffffffffu, j < 32 ? pick0 : pick1, int(j & 31));
      if (ej < 0 || ej >= E) bad = true;
      for (int64_t i = 0; i < j; ++i)
        if (__shfl_sync(0xffffffffu, i < 32 ? pick0 : pick1, int(i & 31)) == ej) bad = true;
    }
  } else {
    const bool has_bias = a.bias.p != nullptr;
    auto sel_raw = [&](int64_t e) -> M { return has_bias ? p[e] + ld_m<M>(a.bias, e) : p[e]; };
    uint64_t keep = ~uint64_t(0);  // groups still eligible
    if (a.n_group > 1) {
      const int64_t gs = E / a.n_group;
      M gsc[2] = {M(0), M(0)};
      for (int r = 0; r < 2; ++r) {
        const int64_t g = lane + 32 * r;
        if (g >= a.n_group) continue;
        M b1 = -M(INFINITY), b2 = b1;
        for (int64_t e = g * gs; e < (g + 1) * gs; ++e) {
          const M v = sel_raw(e);
          if (v > b1) {
            b2 = b1;
            b1 = v;
          } else if (v > b2) {
            b2 = v;
          }
        }
        gsc[r] = gs >= 2 ? b1 + b2 : b1;
      }
      keep = 0;
      M pv = M(0);
      int pi = -1;
      for (int64_t j = 0; j < a.topk_group; ++j) {
        M bv = M(0);
        int bi = 0;
        bool have = false;
        for (int r = 0; r < 2; ++r) {
          const int g = lane + 32 * r;
          if (g >= a.n_group) continue;
          const M v = gsc[r];
          if (j > 0 && !before(pv, pi, v, g)) continue;  // not after the previous pick
          if (!have || before(v, g, bv, bi)) {
            bv = v;
            bi = g;
            have = true;
          }
        }
        warp_best(bv, bi, have);
        if (!have) break;
        keep |= uint64_t(1) << bi;
        pv = bv;
        pi = bi;
      }
    }
    const int64_t gs = E / a.n_group;
    auto sel = [&](int64_t e) -> M {
      return (keep >> (e / gs)) & 1 ? sel_raw(e) : M(0);
    };
    M pv = M(0);
    int pi = -1;
    for (int64_t j = 0; j < K; ++j) {
      M bv = M(0);
      int bi = 0;
      bool have = false;
      for (int64_t e = lane; e < E; e += 32) {
        const M v = sel(e);
        if (j > 0 && !before(pv, pi, v, int(e))) continue;
        if (!have || before(v, int(e), bv, bi)) {
          bv = v;
          bi = int(e);
          have = true;
        }
      }
      warp_best(bv, bi, have);
      if (!have) {  // fewer than K comparable scores (NaN): the row is refused
        bad = true;
        bi = 0;
      }
      if (lane == (j & 31)) (j < 32 ? pick0 : pick1) = bi;
      pv = bv;
      pi = bi;
    }
    if (lane < K) a.experts[n * K + lane] = pick0;
    if (lane + 32 < K) a.experts[n * K + lane + 32] = pick1;
  }

  // Weights, the normaliser summed in the CPU's order.
  M s = M(0);
  for (int64_t j = 0; j < K && !bad; ++j) s += p[__shfl_sync(0xffffffffu, j < 32 ? pick0 : pick1, int(j & 31))];
  M f = M(a.sf);
  if (a.norm) f /= (a.scoring == 1 ? s + M(1e-20) : s);
  if (bad) {
    if (lane == 0 && a.err) atomicExch(a.err, 1);
    f = M(0);
  }
  if (lane < K) st_m<M>(a.weights, n * K + lane, bad ? M(0) : p[pick0] * f);
  if (lane + 32 < K) st_m<M>(a.weights, n * K + lane + 32, bad ? M(0) : p[pick1] * f);
}

template <class T, class M>
__global__ void router_bwd_kernel(RouterK a, int warps) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t n = int64_t(blockIdx.x) * warps + w;
  if (n >= a.N) return;
  const int64_t E = a.E, K = a.K;
  M* g = reinterpret_cast<M*>(smem_raw) + int64_t(w) * E;  // dL/dp
  for (int64_t e = lane; e < E; e += 32) g[e] = a.dprobs.p ? ld_m<M>(a.dprobs, n * E + e) : M(0);
  const int32_t* ex = a.experts + n * K;
  int e0 = 0, e1 = 0;
  M dw0 = M(0), dw1 = M(0);
  if (lane < K) {
    e0 = ex[lane];
    dw0 = ld_m<M>(a.dweights, n * K + lane);
  }
  if (lane + 32 < K) {
    e1 = ex[lane + 32];
    dw1 = ld_m<M>(a.dweights, n * K + lane + 32);
  }
  bool bad = false;
  for (int64_t j = 0; j < K; ++j) {
    const int ej = __shfl_sync(0xffffffffu, j < 32 ? e0 : e1, int(j & 31));
    if (ej < 0 || ej >= E) bad = true;
  }
  __syncwarp();  // g initialised before lane 0 adds to it
  if (bad) {  // kernels_cpu refuses such a row; here it gets no gradient from its choice
    if (lane == 0 && a.err) atomicExch(a.err, 1);
  } else {
    const M sfac = M(a.sf);
    M S = M(0), dot = M(0);
    if (a.norm) {  // every lane, the CPU's order
      for (int64_t j = 0; j < K; ++j) {
        const int ej = __shfl_sync(0xffffffffu, j < 32 ? e0 : e1, int(j & 31));
        S += ld_m<M>(a.probs, n * E + ej);
      }
      if (a.scoring == 1) S += M(1e-20);
      for (int64_t j = 0; j < K; ++j) {
        const int ej = __shfl_sync(0xffffffffu, j < 32 ? e0 : e1, int(j & 31));
        const M dwj = __shfl_sync(0xffffffffu, j < 32 ? dw0 : dw1, int(j & 31));
        dot += dwj * ld_m<M>(a.probs, n * E + ej);
      }
      dot /= S;
    }
    for (int64_t j = 0; j < K; ++j) {  // lane 0 adds in j order (a repeated expert sums)
      const int ej = __shfl_sync(0xffffffffu, j < 32 ? e0 : e1, int(j & 31));
      const M dwj = __shfl_sync(0xffffffffu, j < 32 ? dw0 : dw1, int(j & 31));
      if (lane == 0) g[ej] += a.norm ? sfac / S * (dwj - dot) : sfac * dwj;
    }
  }
  __syncwarp();
  T* dz = static_cast<T*>(a.dlogits) + n * a.lddl;
  if (a.scoring == 0) {
    M pg = M(0);
    for (int64_t e = lane; e < E; e += 32) pg += ld_m<M>(a.probs, n * E + e) * g[e];
    pg = warp_sum(pg);
    const M zl = a.dlse.p ? ld_m<M>(a.dlse, n) : M(0);
    for (int64_t e = lane; e < E; e += 32) {
      const M pe = ld_m<M>(a.probs, n * E + e);
      st_t(dz, e, pe * (g[e] - pg) + zl * pe);
    }
  } else {
    for (int64_t e = lane; e < E; e += 32) {
      const M pe = ld_m<M>(a.probs, n * E + e);
      st_t(dz, e, g[e] * pe * (M(1) - pe));
    }
  }
}

RouterK params(const RouterArgs& a) {
  RouterK k{};
  k.N = a.N;
  k.E = a.E;
  k.K = a.K;
  k.ldl = a.ldl;
  k.lddl = a.lddl;
  k.n_group = a.n_group;
  k.topk_group = a.topk_group;
  k.scoring = a.scoring;
  k.norm = a.norm_topk_prob;
  k.replay = a.replay;
  k.sf = a.scaling_factor;
  k.logits = a.logits;
  k.bias = a.bias;
  k.weights = a.weights;
  k.probs = a.probs;
  k.lse = a.lse;
  k.dweights = a.dweights;
  k.dprobs = a.dprobs;
  k.dlse = a.dlse;
  k.experts = a.experts;
  k.dlogits = a.dlogits;
  k.err = a.err;
  return k;
}

void check_router(const RouterArgs& a, const char* what) {
  auto bad = [&](const std::string& m) { throw std::invalid_argument(std::string(what) + ": " + m); };
  if (a.N < 0 || a.E <= 0 || a.K <= 0 || a.K > a.E) bad("need 0 < top_k <= experts");
  if (a.scoring != 0 && a.scoring != 1) bad("scoring must be 0 (softmax) or 1 (sigmoid)");
  if (a.n_group < 1 || a.E % a.n_group != 0 || a.topk_group < 1 || a.topk_group > a.n_group)
    bad("n_group must divide the experts, 1 <= topk_group <= n_group");
  if (a.n_group > 1 && a.K > a.topk_group * (a.E / a.n_group))
    bad("top_k exceeds the experts of topk_group groups");
  if (a.K > kMaxK || a.n_group > kMaxK) bad("top_k and n_group are at most 64");
  if (a.E > INT32_MAX / 2) bad("too many experts");
}

// Warps per block and dynamic shared memory: E math values per warp; 4 warps when they fit in
// the default 48 KiB, else one warp with up to 200 KiB (E up to 25600 in fp64).
template <class K2>
void launch(K2 kernel, const RouterK& k, int64_t N, int64_t E, size_t msize, const char* what,
            cudaStream_t s) {
  const size_t per_warp = size_t(E) * msize;
  int warps = 4;
  while (warps > 1 && per_warp * warps > 48 * 1024) warps /= 2;
  const size_t smem = per_warp * warps;
  if (smem > 200 * 1024)
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(E) +
                                " experts exceed the shared memory of one warp's scores");
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
  }
  kernel<<<ceil_div(N, warps), 32 * warps, smem, s>>>(k, warps);
  check_launch(what);
}

}  // namespace

void moe_router_fwd(const RouterArgs& a, cudaStream_t s) {
  check_router(a, "moe_router_fwd");
  if (a.ldl < a.E) throw std::invalid_argument("moe_router_fwd: logits rows overlap");
  if (a.N == 0) return;
  const RouterK k = params(a);
  if (a.t == DType::f64)
    launch(router_fwd_kernel<double, double>, k, a.N, a.E, 8, "moe_router_fwd", s);
  else if (a.t == DType::bf16)
    launch(router_fwd_kernel<bf16, float>, k, a.N, a.E, 4, "moe_router_fwd", s);
  else
    launch(router_fwd_kernel<float, float>, k, a.N, a.E, 4, "moe_router_fwd", s);
}

void moe_router_bwd(const RouterArgs& a, cudaStream_t s) {
  check_router(a, "moe_router_bwd");
  if (a.lddl < a.E) throw std::invalid_argument("moe_router_bwd: dlogits rows overlap");
  if (a.dlse.p && a.scoring != 0)
    throw std::invalid_argument("moe_router_bwd: a gradient of lse needs softmax scoring");
  if (a.N == 0) return;
  const RouterK k = params(a);
  if (a.t == DType::f64)
    launch(router_bwd_kernel<double, double>, k, a.N, a.E, 8, "moe_router_bwd", s);
  else if (a.t == DType::bf16)
    launch(router_bwd_kernel<bf16, float>, k, a.N, a.E, 4, "moe_router_bwd", s);
  else
    launch(router_bwd_kernel<float, float>, k, a.N, a.E, 4, "moe_router_bwd", s);
}

}  // namespace rlh::kcuda
