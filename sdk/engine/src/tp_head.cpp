// Tensor parallelism's vocabulary-parallel pieces (sdk/tensor_parallel.hpp): the embedding
// (each rank looks up the ids in its rows, zero elsewhere, and the group sums), the fused
// logprob head, and the gradients the group shares.
//
// The head never forms the full [N, V] logits, on any rank: rank r computes its tile z = xn
// W_r^T / temperature of its vocabulary rows, in row chunks, and keeps per token its max m_r,
// l_r = sum e^(z - m_r), s_r = sum e^(z - m_r) (z - m_r) and its targets' logits. One max
// all-reduce gives M, one sum all-reduce of the rescaled statistics (l_r e^(m_r - M),
// e^(m_r - M) (s_r + (m_r - M) l_r), target logits) gives L, S and z_t; then
//   lse = M + log L,  entropy = log L - S / L,  logprob = z_t - lse.
// The backward recomputes each tile and writes this rank's part of d logits exactly as one
// rank would (p_j = e^(z_j - lse) with the whole vocabulary's lse):
//   dz_j = (1[j = t] dlp - p_j sum(dlp) - dH p_j (z_j - (lse - H))) / temperature,
// giving this rank's d lm_head rows and a partial d xn, summed over the group. Gemma-2's final
// soft-capping z = c tanh(x / c) / temperature is elementwise, so each rank caps its own tile.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "model.hpp"

namespace rlh::engine {

void Engine::Impl::tp_embedding_fwd(float* x, const int32_t* ids, int64_t N) {
  sdk::tp_embedding_lookup(*opt.tp, x, ids, N, w(prog.embed), C);
  if (sp_on)
    sp_scatter(x, C);  // sequence parallelism: this rank's rows of the sum
  else
    tp_reduce(x, N * C);
}

void Engine::Impl::tp_embedding_bwd(const int32_t* ids, const float* dx, int64_t N) {
  float* dW = g(prog.embed);
  for (int64_t t = 0; t < N; ++t) {
    const int64_t id = int64_t(ids[t]) - vlo;
    if (id < 0 || id >= vcount) continue;
    float* row = dW + id * C;
    const float* d = dx + t * C;
    for (int64_t c = 0; c < C; ++c) row[c] += d[c];
  }
}

namespace {

// Gemma-2's final soft-capping of a tile of products x: z = c tanh(x / c) / temperature.
void soft_cap_tile(float* z, int64_t n, float cap, float inv_t) {
  for (int64_t i = 0; i < n; ++i) z[i] = cap * std::tanh(z[i] / cap) * inv_t;
}

// Rows per tile of the [rows, vcount] logits, within the head's tile budget.
int64_t tile_rows(int64_t bytes, int64_t vcount, int64_t N) {
  const int64_t budget = bytes > 0 ? bytes : (int64_t(32) << 20);
  return std::clamp<int64_t>(budget / (std::max<int64_t>(vcount, 1) * int64_t(sizeof(float))), 1, std::max<int64_t>(N, 1));
}

}  // namespace

void Engine::Impl::tp_head_fwd(float* lp, float* lse, float* ent, const int32_t* tg, int64_t N, int64_t K,
                               double temperature) {
  const float inv_t = float(1.0 / temperature), cap = float(prog.logit_softcap);
  const float* W = w(prog.head);
  const float* xn = head.xn;
  const int64_t R = tile_rows(opt.logprob_chunk_bytes, vcount, N);
  Buffer<float> tile(*alloc, size_t(R * std::max<int64_t>(vcount, 1)));
  // Per token: this rank's max (kept), the group's max (reduced), then (l, s, z_t[K]) summed.
  const int64_t W2 = 2 + K;
  Buffer<float> mr(*alloc, size_t(N)), M(*alloc, size_t(N)), sums(*alloc, size_t(N * W2));
  std::vector<double> l(static_cast<size_t>(N)), s(static_cast<size_t>(N));
  std::memset(sums.data(), 0, sums.size() * sizeof(float));
  for (int64_t n0 = 0; n0 < N; n0 += R) {
    const int64_t rows = std::min(R, N - n0);
    if (vcount > 0) {
      ops->gemm(false, true, rows, vcount, C, cap > 0 ? 1.f : inv_t, xn + n0 * C, C, W, C, 0.f, tile.data(), vcount);
      if (cap > 0) soft_cap_tile(tile.data(), rows * vcount, cap, inv_t);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = n0 + r;
      const float* z = tile.data() + r * vcount;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < vcount; ++j) mx = std::max(mx, z[j]);
      double ls = 0, ss = 0;
      for (int64_t j = 0; j < vcount; ++j) {
        const double d = double(z[j]) - double(mx), e = std::exp(d);
        ls += e;
        ss += e * d;
      }
      mr[size_t(n)] = M[size_t(n)] = mx;
      l[size_t(n)] = ls;
      s[size_t(n)] = ss;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t t = int64_t(tg[n * K + k]) - vlo;
        if (tg[n * K + k] >= 0 && t >= 0 && t < vcount) sums[size_t(n * W2 + 2 + k)] = z[t];
      }
    }
  }
  opt.tp_comm->all_reduce_max(M.data(), N);
  for (int64_t n = 0; n < N; ++n) {
    if (vcount == 0) continue;  // no rows here: nothing to add
    const double d = double(mr[size_t(n)]) - double(M[size_t(n)]), e = std::exp(d);
    sums[size_t(n * W2)] = float(l[size_t(n)] * e);
    sums[size_t(n * W2 + 1)] = float(e * (s[size_t(n)] + d * l[size_t(n)]));
  }
  opt.tp_comm->all_reduce_sum(sums.data(), N * W2);
  for (int64_t n = 0; n < N; ++n) {
    const float* q = sums.data() + n * W2;
    const double logl = std::log(double(q[0]));
    lse[n] = float(double(M[size_t(n)]) + logl);
    if (ent) ent[n] = float(logl - double(q[1]) / double(q[0]));
    for (int64_t k = 0; k < K; ++k) lp[n * K + k] = tg[n * K + k] < 0 ? 0.f : q[2 + k] - lse[n];
  }
}

void Engine::Impl::tp_head_bwd(float* dxn, const float* dlp, const float* dent, const int32_t* tg, const float* lse,
                               const float* ent, int64_t N, int64_t K, double temperature) {
  const float inv_t = float(1.0 / temperature), cap = float(prog.logit_softcap);
  const float* W = w(prog.head);
  float* dW = g(prog.head);
  const float* xn = head.xn;
  if (vcount == 0) {
    std::memset(dxn, 0, size_t(N * C) * sizeof(float));
  } else {
    const int64_t R = tile_rows(opt.logprob_chunk_bytes, vcount, N);
    Buffer<float> tile(*alloc, size_t(R * vcount));
    std::vector<float> ft(static_cast<size_t>(K));  // d z / d (h W^T) at the row's targets
    for (int64_t n0 = 0; n0 < N; n0 += R) {
      const int64_t rows = std::min(R, N - n0);
      ops->gemm(false, true, rows, vcount, C, cap > 0 ? 1.f : inv_t, xn + n0 * C, C, W, C, 0.f, tile.data(), vcount);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = n0 + r;
        float* z = tile.data() + r * vcount;
        float a = 0;  // the row's logprob gradients (a missing target's logprob is the constant 0)
        for (int64_t k = 0; k < K; ++k)
          if (tg[n * K + k] >= 0) a += dlp[n * K + k];
        const float b = dent ? dent[n] : 0.f, zl = lse[n], e = dent ? lse[n] - ent[n] : 0.f;
        // Soft-capped (Gemma-2): z = c tanh(x / c) / temperature of the product x, so the
        // gradient of x is that of z times (1 - tanh(x / c)^2) / temperature.
        for (int64_t k = 0; k < K; ++k) {
          const int64_t t = int64_t(tg[n * K + k]) - vlo;
          if (tg[n * K + k] < 0 || t < 0 || t >= vcount) continue;
          const float u = cap > 0 ? std::tanh(z[t] / cap) : 0.f;
          ft[size_t(k)] = cap > 0 ? (1.f - u * u) * inv_t : inv_t;
        }
        for (int64_t j = 0; j < vcount; ++j) {
          float zc = z[j], f = inv_t;
          if (cap > 0) {
            const float u = std::tanh(z[j] / cap);
            zc = cap * u * inv_t;
            f = (1.f - u * u) * inv_t;
          }
          const float p = std::exp(zc - zl);
          z[j] = (-a * p - b * p * (zc - e)) * f;
        }
        for (int64_t k = 0; k < K; ++k) {
          const int64_t t = int64_t(tg[n * K + k]) - vlo;
          if (tg[n * K + k] >= 0 && t >= 0 && t < vcount) z[t] += dlp[n * K + k] * ft[size_t(k)];
        }
      }
      ops->gemm(false, false, rows, C, vcount, 1.f, tile.data(), vcount, W, C, 0.f, dxn + n0 * C, C);
      ops->gemm(true, false, vcount, C, rows, 1.f, tile.data(), vcount, xn + n0 * C, C, 1.f, dW, C);
    }
  }
  if (sp_on)
    sp_scatter(dxn, C);
  else
    tp_reduce(dxn, N * C);
}

// After a step's micro-batches: the q/k norms' gradients (each rank saw its heads only) are
// summed, and a kv head replicated on several ranks gets the sum of their gradients (placed in
// a zero tensor of all kv heads, so one all-reduce over the group serves every replica set).
void Engine::Impl::tp_sync_grads() {
  const sdk::TpLayout& T = *opt.tp;
  for (size_t i = 0; i < desc.params.size(); ++i) {
    const sdk::TpPiece& pc = T.pieces[i];
    // Sequence parallelism: a norm's (or a row-parallel bias's) gradient comes from this rank's
    // rows only; an MoE router's or MLA projection's from every row, as under plain TP.
    const bool sp_norm = sp_on && pc.split == sdk::TpSplit::replicated && !sp_whole_rows[i];
    if (!pc.sum_grads && !sp_norm) continue;
    const std::vector<int64_t>& shape = desc.params[i].shape;
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    if (pc.split == sdk::TpSplit::replicated_sum || sp_norm) {
      tp_reduce(g(int64_t(i)), n);
      continue;
    }
    const int64_t inner = n / pc.extent;  // kv_rows: axis 0
    Buffer<float> full(*alloc, size_t(pc.full * inner));
    std::memset(full.data(), 0, full.size() * sizeof(float));
    std::memcpy(full.data() + pc.begin * inner, g(int64_t(i)), size_t(n) * sizeof(float));
    tp_reduce(full.data(), pc.full * inner);
    std::memcpy(g(int64_t(i)), full.data() + pc.begin * inner, size_t(n) * sizeof(float));
  }
}

}  // namespace rlh::engine
