// decode_layer_fwd, the reference: one dense decoder layer for R tokens of a paged KV cache, by
// definition the ops it fuses in turn (docs/ops.md decode_layer_fwd): rmsnorm_fwd, gemm with
// W_qkv, rope_fwd of q and k, kv_cache_write, paged_attention, gemm with W_o, add_fwd,
// rmsnorm_fwd, gemm_glu_fwd (silu), gemm with W_down, add_fwd. Written as plain loops with
// float64 sums: it is what a device provider's fused kernel is checked against, not a fast path
// (kernels_cpu's generator runs the ops one by one).
#include "decode_ops.hpp"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

namespace rlh::kcpu {

namespace {

// y [N] = x [K] W^T for W [N, K] rows
void matvec(float* y, const float* x, const float* W, int64_t N, int64_t K) {
  for (int64_t n = 0; n < N; ++n) {
    double s = 0;
    for (int64_t k = 0; k < K; ++k) s += double(x[k]) * double(W[n * K + k]);
    y[n] = float(s);
  }
}

void rmsnorm(float* y, const float* x, const float* w, int64_t C, double eps, double woff) {
  double ss = 0;
  for (int64_t c = 0; c < C; ++c) ss += double(x[c]) * double(x[c]);
  const float rstd = float(1.0 / std::sqrt(ss / double(C) + eps));
  for (int64_t c = 0; c < C; ++c) y[c] = x[c] * rstd * float(double(w[c]) + woff);
}

// rope_fwd's rotation of H heads of D at position p (pairs (i, i + D/2), angle in float32)
void rope(float* x, int64_t H, int64_t D, int32_t p, const float* inv_freq, double scale) {
  for (int64_t i = 0; i < D / 2; ++i) {
    const float angle = inv_freq[i] * float(p);
    const double c = std::cos(double(angle)) * scale, s = std::sin(double(angle)) * scale;
    for (int64_t h = 0; h < H; ++h) {
      const double a = x[h * D + i], b = x[h * D + i + D / 2];
      x[h * D + i] = float(a * c - b * s);
      x[h * D + i + D / 2] = float(b * c + a * s);
    }
  }
}

}  // namespace

void decode_layer_ref(const DecodeLayerRefArgs& a) {
  const int64_t R = a.R, C = a.C, F = a.F, D = a.D, Hq = a.Hq, Hkv = a.Hkv, G = Hq / Hkv;
  const int64_t Nqkv = (Hq + 2 * Hkv) * D, cap = a.num_blocks * a.bs;
  auto n = [](int64_t k) { return static_cast<size_t>(k); };
  std::vector<float> xn(n(C)), qkv(n(R * Nqkv)), att(n(Hq * D)), h(n(R * C)), gu(n(2 * F)), act(n(F)), tmp(n(C));
  auto kaddr = [&](int64_t slot, int64_t g, int64_t d) {
    return (slot / a.bs) * a.kc[0] + g * a.kc[1] + (slot % a.bs) * a.kc[2] + d * a.kc[3];
  };
  auto vaddr = [&](int64_t slot, int64_t g, int64_t d) {
    return (slot / a.bs) * a.vc[0] + g * a.vc[1] + (slot % a.bs) * a.vc[2] + d * a.vc[3];
  };
  // q|k|v of every row, rotated, and every row's key and value into the cache first (rows of one
  // sequence see each other, as kv_cache_write then paged_attention)
  for (int64_t r = 0; r < R; ++r) {
    float* q = qkv.data() + r * Nqkv;
    rmsnorm(xn.data(), a.x + r * a.ldx, a.norm1, C, a.eps1, a.woff);
    matvec(q, xn.data(), a.wqkv, Nqkv, C);
    rope(q, Hq + Hkv, D, a.pos[r], a.inv_freq, a.rope_scale);
    const int64_t slot = a.slots[r];
    if (slot < 0) continue;
    if (slot >= cap) throw std::invalid_argument("decode_layer_fwd: slot " + std::to_string(slot) + " outside the cache");
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t d = 0; d < D; ++d) {
        a.k_cache[kaddr(slot, g, d)] = q[(Hq + g) * D + d];
        a.v_cache[vaddr(slot, g, d)] = q[(Hq + Hkv + g) * D + d];
      }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float* q = qkv.data() + r * Nqkv;
    const int32_t p = a.pos[r];
    const int32_t* table = a.table + r * a.ld_table;
    if (p < 0 || p / a.bs >= a.table_width)
      throw std::invalid_argument("decode_layer_fwd: position " + std::to_string(p) + " outside the block table");
    std::vector<double> sc(n(p) + 1);
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const int64_t g = hq / G;
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t t = 0; t <= p; ++t) {
        const int64_t blk = table[t / a.bs];
        if (blk < 0 || blk >= a.num_blocks)
          throw std::invalid_argument("decode_layer_fwd: block id " + std::to_string(blk) + " outside the cache");
        const int64_t slot = blk * a.bs + t % a.bs;
        double s = 0;
        for (int64_t d = 0; d < D; ++d) s += double(q[hq * D + d]) * double(a.k_cache[kaddr(slot, g, d)]);
        sc[size_t(t)] = s * a.scale;
        m = std::max(m, sc[size_t(t)]);
      }
      double l = 0;
      for (int64_t t = 0; t <= p; ++t) l += (sc[size_t(t)] = std::exp(sc[size_t(t)] - m));
      for (int64_t d = 0; d < D; ++d) {
        double o = 0;
        for (int64_t t = 0; t <= p; ++t) {
          const int64_t slot = int64_t(table[t / a.bs]) * a.bs + t % a.bs;
          o += sc[size_t(t)] * double(a.v_cache[vaddr(slot, g, d)]);
        }
        att[size_t(hq * D + d)] = float(o / l);
      }
    }
    float* hr = h.data() + r * C;
    matvec(tmp.data(), att.data(), a.wo, C, Hq * D);
    for (int64_t c = 0; c < C; ++c) hr[c] = a.x[r * a.ldx + c] + tmp[size_t(c)];
    rmsnorm(xn.data(), hr, a.norm2, C, a.eps2, a.woff);
    matvec(gu.data(), xn.data(), a.wgu, 2 * F, C);
    for (int64_t i = 0; i < F; ++i) {
      const double g = gu[size_t(i)];
      act[size_t(i)] = float(g / (1 + std::exp(-g)) * double(gu[size_t(F + i)]));
    }
    matvec(tmp.data(), act.data(), a.wdown, C, F);
    for (int64_t c = 0; c < C; ++c) a.y[r * a.ldy + c] = hr[c] + tmp[size_t(c)];
  }
}

}  // namespace rlh::kcpu
