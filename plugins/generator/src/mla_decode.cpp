// The q, k and v of a multi-head latent attention layer (DeepSeek-V2/V3) for one step: the
// program's mla step for the generator: the engine's forward (sdk/engine/src/mla.cpp), op for
// op, with the products batch-invariant:
//
//   q      = q_b(q_a_norm(q_a(xn)))  [R, H (dn+dr)]     (or q_proj(xn) without q_lora_rank)
//   kva    = kv_a(xn)                [R, rkv + dr]       latent | k_rot
//   kv     = kv_b(kv_a_norm(latent)) [R, H (dn+dv)]     per head: k_nope | v
//   q_rot  = rope(q[.., dn:]),  k_rot = rope(kva[.., rkv:]), shared by every head
//
// The results land where a GQA layer's do, in the q|k|v buffer (rows Wqkv = H (2 (dn+dr) + dv)
// apart, heads contiguous), so the layer continues as any other: keys and values go into the
// paged cache and attention reads them with Dk = dn + dr, Dv = dv. The cache thus holds the
// expanded per-head keys and values, H (dn + dr + dv) floats per token and layer, where the
// latent (rkv + dr) would do: caching the latent and absorbing kv_b into q and o (q.k as
// (q W_uk).latent) is the memory optimisation left for later; it is the same math in another
// rounding order, and costs a product per cached token per step where this reads a cache.
//
// Differences from the engine that change no value: kv_b is one product over all heads into
// scratch, then copied into k_nope and v (the engine takes 2H products straight into them; each
// output element of the batch-invariant gemm is the same k-ordered sum whatever the column split), and the
// rotated key is formed once per head from the shared unrotated one, as the engine's rope does.
//
// The latent norms use eps 1e-6, HF's DeepseekV3RMSNorm default (the engine's kLatentEps; the
// config's rms_norm_eps is not theirs). DeepSeek's interleaved RoPE (rope_interleave) rotates
// pairs (2i, 2i+1) in place through the rope op, as the engine does; HF de-interleaves
// first, which permutes q's and k's rotated dims alike and leaves q.k unchanged.
#include <cstring>

#include "rlhost/generator/model.hpp"

namespace rlh::gen {

namespace {
constexpr float kLatentEps = 1e-6f;  // sdk/engine/src/mla.cpp
}

void DecodeModel::mla_qkv(int64_t l, const float* xn, float* qkv, int64_t R) {
  const LayerShape& s = shapes_[size_t(l)];
  const LayerWeights& w = lw_[size_t(l)];
  const int64_t C = C_, H = s.Hq, D = s.Dk, W = s.Wqkv;
  const int64_t dn = s.dn, dr = s.dr, dv = s.Dv, rq = s.rq, rkv = s.rkv, wkv = H * (dn + dv);
  float* q = qkv;        // [R, H*D]
  float* k = q + H * D;  // [R, H*D]
  float* v = k + H * D;  // [R, H*dv]
  // Scratch carved as reserve() sized it (64-byte aligned pieces).
  auto r16 = [](int64_t n) { return (n + 15) / 16 * 16; };
  float* qa = mla_f_.data();              // [R, rq]     q latent, normed in place
  float* kva = qa + r16(R * rq);          // [R, rkv+dr] kv latent | k_rot (unrotated)
  float* ckv = kva + r16(R * (rkv + dr)); // [R, rkv]    kv_a_norm(latent)
  float* kvb = ckv + r16(R * rkv);        // [R, H*(dn+dv)] per head k_nope | v

  if (rq > 0) {
    ops_->gemm_rows(qa, rq, xn, C, w.q_a, C, R, rq, C);                                   // qa [R,rq]
    ops_->rmsnorm_fwd(qa, rq, nullptr, qa, rq, w.q_a_norm, R, rq, kLatentEps, 0.f);
    ops_->gemm_rows(q, W, qa, rq, w.q_b, rq, R, H * D, rq);                               // q [R,H*D]
  } else {
    ops_->gemm_rows(q, W, xn, C, w.q, C, R, H * D, C);
  }
  ops_->gemm_rows(kva, rkv + dr, xn, C, w.kv_a, C, R, rkv + dr, C);                       // kva
  ops_->rmsnorm_fwd(ckv, rkv, nullptr, kva, rkv + dr, w.kv_a_norm, R, rkv, kLatentEps, 0.f);  // ckv
  ops_->gemm_rows(kvb, wkv, ckv, rkv, w.kv_b, rkv, R, wkv, rkv);                          // kvb
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) {
      const float* src = kvb + r * wkv + h * (dn + dv);
      std::memcpy(k + r * W + h * D, src, size_t(dn) * sizeof(float));                 // k_nope
      std::memcpy(v + r * W + h * dv, src + dn, size_t(dv) * sizeof(float));           // v
    }
  if (s.rope >= 0) {
    for (int64_t h = 0; h < H; ++h) {
      rope(s.rope, q + h * D + dn, W, q + h * D + dn, W, 1, dr, R);                       // q_rot
      rope(s.rope, k + h * D + dn, W, kva + rkv, rkv + dr, 1, dr, R);                     // k_rot
    }
  } else {
    for (int64_t r = 0; r < R; ++r)  // the shared key part into every head, unrotated
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(k + r * W + h * D + dn, kva + r * (rkv + dr) + rkv, size_t(dr) * sizeof(float));
  }
}

}  // namespace rlh::gen
