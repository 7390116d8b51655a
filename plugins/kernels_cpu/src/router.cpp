// MoE router: scores from router logits, top-k expert choice, routing weights, and the backward.
//
// Forward, per token n (row of logits [N, E]):
//   scores  softmax: p = softmax(z) over all E experts (Mixtral, Qwen-MoE; lse = logsumexp(z))
//           sigmoid: p = sigmoid(z)                     (DeepSeek-V3)
//   choice  top-k of p + bias (bias: DeepSeek's e_score_correction_bias, selection only), in
//           descending order, ties to the lower expert index (torch.topk picks one of the tied;
//           a fixed rule keeps the kernel deterministic). Group-limited routing (n_group > 1,
//           DeepSeek-V3): a group's score is the sum of its two best selection scores; only the
//           topk_group best groups stay eligible and, as HF's masked_fill(~mask, 0.0) does, the
//           other experts compete with score 0. With replay the experts are given, not chosen
//           (routing replay: the choice of an earlier pass is reused; the weights still come from
//           this pass's scores, as Megatron's router replay computes them).
//   weight  w_j = p[e_j]; norm_topk_prob: w_j /= sum_j p[e_j] (+1e-20 for sigmoid, as HF
//           DeepSeek-V3); then w_j *= scaling_factor (routed_scaling_factor).
// Backward: g = dL/dp (dprobs, e.g. of a load-balancing loss, plus the weights' part)
//   no norm: g[e_j] += s dw_j
//   norm:    g[e_j] += (s / S) (dw_j - sum_i dw_i p[e_i] / S),  S = sum_i p[e_i] (+eps)
//   softmax: dz = p (g - <p, g>) + dlse p      (dlse: a loss on lse, the z-loss: 2 coef lse / T)
//   sigmoid: dz = g p (1 - p)                  (dlse needs the softmax: refused)
// Rows are independent: one thread per block of rows, the same result for any thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "rlhost/kernels_cpu/kernels.hpp"

namespace rlh::kcpu {
namespace {

void check_router(int64_t N, int64_t E, int64_t K, const RouterOpts& o) {
  if (N < 0 || E <= 0 || K <= 0 || K > E)
    throw std::invalid_argument("moe_router: need 0 < top_k <= experts");
  if (o.scoring != 0 && o.scoring != 1)
    throw std::invalid_argument("moe_router: scoring must be 0 (softmax) or 1 (sigmoid)");
  if (o.n_group < 1 || E % o.n_group != 0 || o.topk_group < 1 || o.topk_group > o.n_group)
    throw std::invalid_argument("moe_router: n_group must divide the experts, 1 <= topk_group <= n_group");
  if (o.n_group > 1 && K > o.topk_group * (E / o.n_group))
    throw std::invalid_argument("moe_router: top_k exceeds the experts of topk_group groups");
}

// Inserts (value, index) into the descending list best[0..k) if it beats the last entry;
// strictly greater wins, so among equal values the earlier (lower) index stays ahead.
template <class T>
inline void topk_insert(T v, int32_t i, T* bv, int32_t* bi, int64_t k, int64_t* filled) {
  int64_t pos = *filled;
  if (pos == k) {
    if (!(v > bv[k - 1])) return;
    pos = k - 1;
  } else {
    ++*filled;
  }
  while (pos > 0 && v > bv[pos - 1]) {
    bv[pos] = bv[pos - 1];
    bi[pos] = bi[pos - 1];
    --pos;
  }
  bv[pos] = v;
  bi[pos] = i;
}

template <class T>
void router_row(T* w, int32_t* ex, T* p, T* lse, const T* z, const T* bias, int64_t E, int64_t K,
                const RouterOpts& o, T* sel, T* gscore, int32_t* gidx) {
  // Scores.
  if (o.scoring == 0) {
    T mx = z[0];
    for (int64_t e = 1; e < E; ++e) mx = std::max(mx, z[e]);
    T sum = 0;
    for (int64_t e = 0; e < E; ++e) {
      p[e] = std::exp(z[e] - mx);
      sum += p[e];
    }
    const T inv = T(1) / sum;
    for (int64_t e = 0; e < E; ++e) p[e] *= inv;
    if (lse) *lse = mx + std::log(sum);
  } else {
    for (int64_t e = 0; e < E; ++e) p[e] = T(1) / (T(1) + std::exp(-z[e]));
    if (lse) {  // logsumexp of the logits, for a z-loss report
      T mx = z[0];
      for (int64_t e = 1; e < E; ++e) mx = std::max(mx, z[e]);
      T sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += std::exp(z[e] - mx);
      *lse = mx + std::log(sum);
    }
  }
  // Choice.
  if (o.replay) {
    for (int64_t j = 0; j < K; ++j) {
      const int32_t e = ex[j];
      if (e < 0 || e >= E)
        throw std::invalid_argument("moe_router: replayed expert " + std::to_string(e) +
                                    " outside [0, " + std::to_string(E) + ")");
      for (int64_t i = 0; i < j; ++i)
        if (ex[i] == e) throw std::invalid_argument("moe_router: a replayed expert repeats in a row");
    }
  } else {
    for (int64_t e = 0; e < E; ++e) sel[e] = bias ? p[e] + bias[e] : p[e];
    if (o.n_group > 1) {
      const int64_t gs = E / o.n_group;
      for (int64_t g = 0; g < o.n_group; ++g) {  // sum of the group's best two (one if alone)
        T b1 = -std::numeric_limits<T>::infinity(), b2 = b1;
        for (int64_t e = g * gs; e < (g + 1) * gs; ++e) {
          if (sel[e] > b1) {
            b2 = b1;
            b1 = sel[e];
          } else if (sel[e] > b2) {
            b2 = sel[e];
          }
        }
        gscore[g] = gs >= 2 ? b1 + b2 : b1;
      }
      int64_t filled = 0;
      T gv[64];
      for (int64_t g = 0; g < o.n_group; ++g)
        topk_insert(gscore[g], int32_t(g), gv, gidx, o.topk_group, &filled);
      for (int64_t g = 0; g < o.n_group; ++g) {
        bool keep = false;
        for (int64_t i = 0; i < o.topk_group; ++i) keep |= gidx[i] == g;
        if (!keep)
          for (int64_t e = g * gs; e < (g + 1) * gs; ++e) sel[e] = T(0);
      }
    }
    T bv[64];
    int64_t filled = 0;
    for (int64_t e = 0; e < E; ++e) topk_insert(sel[e], int32_t(e), bv, ex, K, &filled);
  }
  // Weights.
  T s = 0;
  for (int64_t j = 0; j < K; ++j) {
    w[j] = p[ex[j]];
    s += w[j];
  }
  T f = T(o.scaling_factor);
  if (o.norm_topk_prob) f /= (o.scoring == 1 ? s + T(1e-20) : s);
  for (int64_t j = 0; j < K; ++j) w[j] *= f;
}

}  // namespace

template <class T>
void moe_router_fwd(T* weights, int32_t* experts, T* probs, T* lse, const T* logits, int64_t ldl,
                    const T* bias, int64_t N, int64_t E, int64_t K, const RouterOpts& o) {
  check_router(N, E, K, o);
  if (ldl < E) throw std::invalid_argument("moe_router_fwd: logits rows overlap");
  if (K > 64 || o.n_group > 64) throw std::invalid_argument("moe_router_fwd: top_k and n_group are at most 64");
  int64_t nerr = 0;
  std::string err;
#pragma omp parallel if (N * E > 8192)
  {
    std::vector<T> sel(static_cast<size_t>(E)), gscore(static_cast<size_t>(o.n_group));
    std::vector<int32_t> gidx(64);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      try {
        router_row<T>(weights + n * K, experts + n * K, probs + n * E, lse ? lse + n : nullptr,
                      logits + n * ldl, bias, E, K, o, sel.data(), gscore.data(), gidx.data());
      } catch (const std::invalid_argument& e) {
#pragma omp critical(rlh_kcpu_router_err)
        if (nerr++ == 0) err = e.what();
      }
    }
  }
  if (nerr) throw std::invalid_argument(err);
}

template <class T>
void moe_router_bwd(T* dlogits, int64_t lddl, const T* dweights, const T* probs,
                    const int32_t* experts, const T* dprobs, const T* dlse, int64_t N, int64_t E,
                    int64_t K, const RouterOpts& o) {
  check_router(N, E, K, o);
  if (lddl < E) throw std::invalid_argument("moe_router_bwd: dlogits rows overlap");
  if (dlse && o.scoring != 0)
    throw std::invalid_argument("moe_router_bwd: a gradient of lse needs softmax scoring");
  for (int64_t i = 0; i < N * K; ++i)
    if (experts[i] < 0 || experts[i] >= E)
      throw std::invalid_argument("moe_router_bwd: expert index outside [0, E)");
#pragma omp parallel if (N * E > 8192)
  {
    std::vector<T> g(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const T* p = probs + n * E;
      const T* dw = dweights + n * K;
      const int32_t* ex = experts + n * K;
      T* dz = dlogits + n * lddl;
      for (int64_t e = 0; e < E; ++e) g[size_t(e)] = dprobs ? dprobs[n * E + e] : T(0);
      const T s = T(o.scaling_factor);
      if (!o.norm_topk_prob) {
        for (int64_t j = 0; j < K; ++j) g[size_t(ex[j])] += s * dw[j];
      } else {
        T S = 0;
        for (int64_t j = 0; j < K; ++j) S += p[ex[j]];
        if (o.scoring == 1) S += T(1e-20);
        T dot = 0;  // sum_i dw_i p[e_i] / S
        for (int64_t j = 0; j < K; ++j) dot += dw[j] * p[ex[j]];
        dot /= S;
        for (int64_t j = 0; j < K; ++j) g[size_t(ex[j])] += s / S * (dw[j] - dot);
      }
      if (o.scoring == 0) {
        T pg = 0;
        for (int64_t e = 0; e < E; ++e) pg += p[e] * g[size_t(e)];
        const T zl = dlse ? dlse[n] : T(0);
        for (int64_t e = 0; e < E; ++e) dz[e] = p[e] * (g[size_t(e)] - pg) + zl * p[e];
      } else {
        for (int64_t e = 0; e < E; ++e) dz[e] = g[size_t(e)] * p[e] * (T(1) - p[e]);
      }
    }
  }
}

template void moe_router_fwd<float>(float*, int32_t*, float*, float*, const float*, int64_t,
                                    const float*, int64_t, int64_t, int64_t, const RouterOpts&);
template void moe_router_fwd<double>(double*, int32_t*, double*, double*, const double*, int64_t,
                                     const double*, int64_t, int64_t, int64_t, const RouterOpts&);
template void moe_router_bwd<float>(float*, int64_t, const float*, const float*, const int32_t*,
                                    const float*, const float*, int64_t, int64_t, int64_t,
                                    const RouterOpts&);
template void moe_router_bwd<double>(double*, int64_t, const double*, const double*,
                                     const int32_t*, const double*, const double*, int64_t,
                                     int64_t, int64_t, const RouterOpts&);

}  // namespace rlh::kcpu
