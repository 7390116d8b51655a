// Multi-head latent attention (DeepSeek-V2/V3) on the GPU: the attention block of a layer the
// description marks `mla`, forward and backward, op for op the CPU engine's
// sdk/engine/src/mla.cpp (whose header gives the math, as HF's DeepseekV3Attention):
//
//   q      = q_b(q_a_norm(q_a(xn)))  [N, H (dn+dr)]     (or q_proj(xn) without q_lora_rank)
//   kva    = kv_a(xn)                [N, rkv + dr]       latent | k_rot
//   kv     = kv_b(kv_a_norm(latent)) [N, H (dn+dv)]     per head: k_nope | v
//   q_rot  = rope(q[.., dn:]),  k_rot = rope(kva[.., rkv:]), shared by every head
//   h      = x + o(attention([q_nope | q_rot], [k_nope | k_rot], v))
//
// q, k and v live in the layer's qkv buffer (rows Wqkv = H (2 (dn+dr) + dv) apart, heads
// contiguous), so the attention kernels read them as a GQA layer's with Hkv = H, Dk = dn + dr
// and Dv = dv (the SIMT path: the tensor-core kernels need Dk = Dv in {64, 128}).
//
// Where this differs from the CPU engine, and why:
//   - kv_b is one GEMM into a scratch [N, H (dn+dv)] followed by an engine kernel that copies
//     k_nope and v into their heads and the rotated key into every head (mla_kernels.cu),
//     instead of 2H per-head GEMMs writing in place: one launch of the full width instead of
//     2H narrow ones. Backward is the transpose: one kernel gathers d(k_nope | v) into the
//     scratch and sums d k_rot over the heads (fp32, head order), then one GEMM each for
//     d latent and dW_kv_b.
//   - k_rot's gradient is summed over the heads before the inverse rotation (the CPU engine
//     rotates each head's and sums): the rotation is linear and the same for every head, so
//     this is the same value with H - 1 fewer rotations.
//   - kv_a's two row blocks (latent, k_rot) take one GEMM each way: their gradients sit side by
//     side in one [N, rkv + dr] buffer (the norm's backward writes the latent part, the k_rot
//     sum the rest).
// RoPE rotates the dr dims only: q's in place at column dn of each head (head stride dn + dr,
// R = dr), k_rot from kva into a [N, dr] scratch; DeepSeek's interleaved layout rotates pairs
// (2i, 2i+1) as the CPU engine does (mla.cpp explains why that equals HF's de-interleave). The
// latent norms use eps 1e-6 (HF's DeepseekV3RMSNorm default; the description carries none).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda_engine_impl.hpp"

namespace rlh::engine {

using cuda::bf16;
using cuda::check;

namespace {
constexpr float kLatentEps = 1e-6f;  // mla.cpp's
}

// ---------------------------------------------------------------------------------------------
// Description: the CPU engine's checks (mla.cpp describe_mla_layer).

void CudaEngine::Impl::describe_mla_layer(const sdk::LayerDesc& ld, LayerShape& s) {
  const std::string at = "cuda engine: layer " + std::to_string(ld.index) + ": ";
  static_cast<MlaBasics&>(s) = mla_basics(ld, at);  // the CPU engine's checks
  // and this path's: the SIMT attention's head dims, RoPE pairs
  if (s.dn + s.dr > 256 || s.dv > 256)
    throw std::invalid_argument(at + "MLA head dims above 256 are not supported by the attention");
  if (s.dr % 2) throw std::invalid_argument(at + "MLA's qk_rope_head_dim must be even");
  s.mla = true;
  s.Hkv = s.Hq;
  s.D = s.dn + s.dr;
  s.Wqkv = s.Hq * (2 * s.D + s.dv);
  s.qk_norm = false;
  // RoPE's table has R = rotary_dim entries; an MLA layer rotates exactly its dr dims.
  if (s.use_rope && desc.rope.rotary_dim != s.dr)
    throw std::invalid_argument(at + "MLA's rotary dims must be qk_rope_head_dim");
  ++mla_layers;
  maxRq = std::max(maxRq, s.rq);
  maxRkv = std::max(maxRkv, s.rkv);
  maxDr = std::max(maxDr, s.dr);
  maxKvb = std::max(maxKvb, s.Hq * (s.dn + s.dv));
}

void CudaEngine::Impl::check_mla_params(int64_t l) const {
  const LayerShape& s = shapes[size_t(l)];
  const LayerOffsets& o = lo[size_t(l)];
  auto shape_is = [&](sdk::ParamRole r, std::vector<int64_t> want) {
    const sdk::ParamDesc* p = desc.find_param(l, r);
    if (!p || p->shape != want)
      throw std::invalid_argument("cuda engine: layer " + std::to_string(l) + ": MLA parameter " +
                                  std::string(sdk::to_string(r)) +
                                  (p ? " has an unexpected shape" : " is missing"));
  };
  const int64_t H = s.Hq;
  if (s.rq > 0) {
    shape_is(sdk::ParamRole::q_a, {s.rq, C});
    shape_is(sdk::ParamRole::q_a_norm, {s.rq});
    shape_is(sdk::ParamRole::q_b, {H * s.D, s.rq});
  } else {
    shape_is(sdk::ParamRole::q, {H * s.D, C});
  }
  shape_is(sdk::ParamRole::kv_a, {s.rkv + s.dr, C});
  shape_is(sdk::ParamRole::kv_a_norm, {s.rkv});
  shape_is(sdk::ParamRole::kv_b, {H * (s.dn + s.dv), s.rkv});
  shape_is(sdk::ParamRole::o, {C, H * s.dv});
  if (o.kv_a < 0 || o.kv_a_norm < 0 || o.kv_b < 0 || o.wo < 0 ||
      (s.rq > 0 ? (o.q_a < 0 || o.q_a_norm < 0 || o.q_b < 0) : o.wqkv < 0))
    throw std::logic_error("cuda engine: an MLA parameter was not placed");
}

// ---------------------------------------------------------------------------------------------
// Memory: MlaActs per MLA layer when training keeps every layer's set (none / selective
// recompute), one set sized for the largest layer otherwise (forward only, full recompute);
// one scratch set. The kv scratch serves the forward (kv_b's product, copied out at once) and
// the backward (d of it), which never overlap within a layer.

void CudaEngine::Impl::carve_mla(cuda::Carver& c, int64_t N, bool per_layer, bool train) {
  mla_acts.clear();
  mla_x = cuda::MlaScratch{};
  if (mla_layers == 0) return;
  auto carve = [&](int64_t rq, int64_t rkv, int64_t dr) {
    cuda::MlaActs m;
    if (rq > 0) {
      m.qa = c.take<bf16>(N * rq);
      m.qan = c.take<bf16>(N * rq);
      m.rstd_qa = c.take<float>(N);
    }
    m.kva = c.take<bf16>(N * (rkv + dr));
    m.ckv = c.take<bf16>(N * rkv);
    m.rstd_kva = c.take<float>(N);
    return m;
  };
  if (per_layer) {
    mla_acts.assign(size_t(L), cuda::MlaActs{});
    for (int64_t l = 0; l < L; ++l) {
      const LayerShape& s = shapes[size_t(l)];
      if (s.mla) mla_acts[size_t(l)] = carve(s.rq, s.rkv, s.dr);
    }
  } else {
    mla_acts.push_back(carve(maxRq, maxRkv, maxDr));
  }
  cuda::MlaScratch& x = mla_x;
  x.kv = c.take<bf16>(N * maxKvb);
  x.krot = c.take<bf16>(N * maxDr);
  if (!train) return;
  x.dkva = c.take<bf16>(N * (maxRkv + maxDr));
  x.dckv = c.take<bf16>(N * maxRkv);
  if (maxRq > 0) {
    x.dqan = c.take<bf16>(N * maxRq);
    x.dqa = c.take<bf16>(N * maxRq);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward: a.xn1 = attn_norm(x) is computed (forward_layer); a.h = x + o(mla(xn1)).

void CudaEngine::Impl::forward_mla(int64_t l, const MicroBatch& mb, LayerActs& a) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerOffsets& p = lo[size_t(l)];
  cuda::MlaActs& m = mla_of(l);
  cuda::MlaScratch& x = mla_x;
  const int64_t N = mb.num_tokens(), S = mb.num_sequences(), H = s.Hq, D = s.D, W = s.Wqkv;
  const int64_t dn = s.dn, dr = s.dr, dv = s.dv, rq = s.rq, rkv = s.rkv, Wkv = H * (dn + dv);
  const auto bf = kc::DType::bf16;
  bf16* q = a.qkv;              // [N, H D]   row stride W
  bf16* k = a.qkv + H * D;      // [N, H D]
  bf16* v = a.qkv + 2 * H * D;  // [N, H dv]

  if (rq > 0) {
    gemm(false, true, N, rq, C, a.xn1, C, w(p.q_a), C, 0, m.qa, rq, false);             // qa
    kc::rmsnorm_fwd(bf, m.qan, rq, {m.rstd_qa, false}, m.qa, rq, w(p.q_a_norm), N, rq,
                    kLatentEps, 0.f, stream);                                           // qan
    gemm(false, true, N, H * D, rq, m.qan, rq, w(p.q_b), rq, 0, q, W, false);           // q
  } else {
    gemm(false, true, N, H * D, C, a.xn1, C, w(p.wqkv), C, 0, q, W, false);             // q
  }
  gemm(false, true, N, rkv + dr, C, a.xn1, C, w(p.kv_a), C, 0, m.kva, rkv + dr, false); // kva
  kc::rmsnorm_fwd(bf, m.ckv, rkv, {m.rstd_kva, false}, m.kva, rkv + dr, w(p.kv_a_norm), N, rkv,
                  kLatentEps, 0.f, stream);                                             // ckv
  gemm(false, true, N, Wkv, rkv, m.ckv, rkv, w(p.kv_b), rkv, 0, x.kv, Wkv, false);      // kv
  const bf16* krot = m.kva + rkv;  // unrotated without RoPE
  int64_t ldkrot = rkv + dr;
  if (s.use_rope) {
    // q's rope dims in place (head stride D, the first dr dims from column dn); the shared key
    // once, into the scratch
    kc::rope(bf, q + dn, W, q + dn, W, pos, inv_freq.get<float>(), N, H, D, dr, rope_scale,
             rope_interleaved, false, stream);
    kc::rope(bf, x.krot, dr, m.kva + rkv, rkv + dr, pos, inv_freq.get<float>(), N, 1, dr, dr,
             rope_scale, rope_interleaved, false, stream);
    krot = x.krot;
    ldkrot = dr;
  }
  cuda::mla_assemble_kv(x.kv, krot, ldkrot, k, v, W, N, H, dn, dr, dv, stream);        // k, v
  kc::AttnArgs at;
  at.t = bf;
  at.N = N;
  at.S = S;
  at.Hq = at.Hkv = H;
  at.Dk = D;
  at.Dv = dv;
  at.window = s.window;
  at.scale = s.scale;  // the description's (DeepSeek's yarn mscale^2 folded in)
  at.cu = cu;
  at.q = q;
  at.ldq = W;
  at.k = k;
  at.ldk = W;
  at.v = v;
  at.ldv = W;
  at.o = a.att;
  at.ldo = H * dv;
  at.lse = {a.lse, false};
  kc::attention_fwd(at, dev, stream);                                                   // att
  gemm(false, true, N, C, H * dv, a.att, H * dv, w(p.wo), H * dv, 0, a.h, C, false);    // o
  kc::add_fwd(bf, a.h, a.x, a.h, N * C, stream);                                       // h
}

// ---------------------------------------------------------------------------------------------
// Backward: dres holds d loss / d h on entry, d loss / d x on exit (the attention norm's
// backward accumulates into it, as the dense block's).

void CudaEngine::Impl::backward_mla(int64_t l, const MicroBatch& mb, LayerActs& a) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerOffsets& p = lo[size_t(l)];
  cuda::MlaActs& m = mla_of(l);
  cuda::MlaScratch& x = mla_x;
  const int64_t N = mb.num_tokens(), S = mb.num_sequences(), H = s.Hq, D = s.D, W = s.Wqkv;
  const int64_t dn = s.dn, dr = s.dr, dv = s.dv, rq = s.rq, rkv = s.rkv, Wkv = H * (dn + dv);
  const auto bf = kc::DType::bf16;
  bf16* dq = dqkv;
  bf16* dk = dqkv + H * D;
  bf16* dvv = dqkv + 2 * H * D;

  gemm(false, false, N, H * dv, C, dres, C, w(p.wo), H * dv, 0, datt, H * dv, false);   // datt
  gemm(true, false, C, H * dv, N, dres, C, a.att, H * dv, 1, g(p.wo), H * dv, true);    // dW_o
  kc::AttnArgs at;
  at.t = bf;
  at.N = N;
  at.S = S;
  at.Hq = at.Hkv = H;
  at.Dk = D;
  at.Dv = dv;
  at.window = s.window;
  at.scale = s.scale;
  at.cu = cu;
  at.q = a.qkv;
  at.ldq = W;
  at.k = a.qkv + H * D;
  at.ldk = W;
  at.v = a.qkv + 2 * H * D;
  at.ldv = W;
  at.o = a.att;
  at.ldo = H * dv;
  at.lse = {a.lse, false};
  at.dout = datt;
  at.lddo = H * dv;
  at.dq = dq;
  at.lddq = W;
  at.dk = dk;
  at.lddk = W;
  at.dv = dvv;
  at.lddv = W;
  kc::attention_bwd(at, dev, ws(), stream);                                             // dq dk dv

  // d(k_nope | v) per head into kv_b's layout; d k_rot summed over the heads into dkva's
  // rope columns, then the transposed rotations (q's in place).
  bf16* dkrot = x.dkva + rkv;
  cuda::mla_split_dkv(dk, dvv, W, x.kv, dkrot, rkv + dr, N, H, dn, dr, dv, stream);
  if (s.use_rope) {
    kc::rope(bf, dq + dn, W, dq + dn, W, pos, inv_freq.get<float>(), N, H, D, dr, rope_scale,
             rope_interleaved, true, stream);
    kc::rope(bf, dkrot, rkv + dr, dkrot, rkv + dr, pos, inv_freq.get<float>(), N, 1, dr, dr,
             rope_scale, rope_interleaved, true, stream);
  }
  // kv_b, the latent norm (into dkva's latent columns), kv_a (both row blocks at once)
  gemm(false, false, N, rkv, Wkv, x.kv, Wkv, w(p.kv_b), rkv, 0, x.dckv, rkv, false);    // dckv
  gemm(true, false, Wkv, rkv, N, x.kv, Wkv, m.ckv, rkv, 1, g(p.kv_b), rkv, true);       // dW_kv_b
  kc::rmsnorm_bwd(bf, x.dkva, rkv + dr, {g(p.kv_a_norm), false}, x.dckv, rkv, m.kva, rkv + dr,
                  w(p.kv_a_norm), {m.rstd_kva, false}, N, rkv, 0.f, false, ws(), stream); // d latent
  gemm(false, false, N, C, rkv + dr, x.dkva, rkv + dr, w(p.kv_a), C, 0, dxn, C, false); // dxn1
  gemm(true, false, rkv + dr, C, N, x.dkva, rkv + dr, a.xn1, C, 1, g(p.kv_a), C, true); // dW_kv_a
  // q path
  if (rq > 0) {
    gemm(false, false, N, rq, H * D, dq, W, w(p.q_b), rq, 0, x.dqan, rq, false);        // dqan
    gemm(true, false, H * D, rq, N, dq, W, m.qan, rq, 1, g(p.q_b), rq, true);           // dW_q_b
    kc::rmsnorm_bwd(bf, x.dqa, rq, {g(p.q_a_norm), false}, x.dqan, rq, m.qa, rq, w(p.q_a_norm),
                    {m.rstd_qa, false}, N, rq, 0.f, false, ws(), stream);               // dqa
    gemm(false, false, N, C, rq, x.dqa, rq, w(p.q_a), C, 1, dxn, C, false);             // dxn1 +=
    gemm(true, false, rq, C, N, x.dqa, rq, a.xn1, C, 1, g(p.q_a), C, true);             // dW_q_a
  } else {
    gemm(false, false, N, C, H * D, dq, W, w(p.wqkv), C, 1, dxn, C, false);             // dxn1 +=
    gemm(true, false, H * D, C, N, dq, W, a.xn1, C, 1, g(p.wqkv), C, true);             // dW_q
  }
  kc::rmsnorm_bwd(bf, dres, C, {g(p.attn_norm), false}, dxn, C, a.x, C, w(p.attn_norm),
                  {a.rstd1, false}, N, C, s.off_attn, true, ws(), stream);               // dres = dx
}

}  // namespace rlh::engine
