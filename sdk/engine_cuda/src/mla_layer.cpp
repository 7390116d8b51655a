// Multi-head latent attention (DeepSeek-V2/V3) on the GPU: the attention block of a layer the
// description marks `mla`: the layer program's mla step (sdk/layer_program.hpp), forward and
// backward, op for op the CPU engine's sdk/engine/src/mla.cpp (whose header gives the math, as
// HF's DeepseekV3Attention). The attention norm, o_proj and the residual add are the program's
// own steps; this step takes xn and writes att:
//
//   q      = q_b(q_a_norm(q_a(xn)))  [N, H (dn+dr)]     (or q_proj(xn) without q_lora_rank)
//   kva    = kv_a(xn)                [N, rkv + dr]       latent | k_rot
//   kv     = kv_b(kv_a_norm(latent)) [N, H (dn+dv)]     per head: k_nope | v
//   q_rot  = rope(q[.., dn:]),  k_rot = rope(kva[.., rkv:]), shared by every head
//   att    = attention([q_nope | q_rot], [k_nope | k_rot], v)
//
// q, k and v live in the step's qkv value (rows Wqkv = H (2 (dn+dr) + dv) apart, heads
// contiguous), so the attention kernels read them as a GQA layer's with Hkv = H, Dk = dn + dr
// and Dv = dv (whichever provider answers attention for those head dims).
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
// Description: the CPU engine's readings (mla.cpp describe_mla_layer) and the parameter shapes
// this step reads.

void CudaEngine::Impl::describe_mla_layer(const sdk::LayerDesc& ld, const sdk::LayerStep& st, LayerShape& s) {
  const std::string at = "cuda engine: layer " + std::to_string(ld.index) + ": ";
  static_cast<MlaBasics&>(s) = mla_basics(ld, at);
  s.mla = true;
  s.H = st.hq;
  s.D = st.dk;
  s.Wqkv = st.out2.width;
  s.window = st.window;
  s.scale = st.scale;  // the description's (DeepSeek's yarn mscale^2 folded in)
  s.softcap = st.softcap;
  s.rope = st.table;
  const int64_t l = ld.index, H = s.H;
  auto shape_is = [&](sdk::ParamRole r, std::vector<int64_t> want) {
    const sdk::ParamDesc* p = desc.find_param(l, r);
    if (!p || p->shape != want)
      throw std::invalid_argument(at + "MLA parameter " + std::string(sdk::to_string(r)) +
                                  (p ? " has an unexpected shape" : " is missing"));
  };
  if (s.rq > 0) {
    shape_is(sdk::ParamRole::q_a, {s.rq, prog.hidden});
    shape_is(sdk::ParamRole::q_a_norm, {s.rq});
    shape_is(sdk::ParamRole::q_b, {H * s.D, s.rq});
  } else {
    shape_is(sdk::ParamRole::q, {H * s.D, prog.hidden});
  }
  shape_is(sdk::ParamRole::kv_a, {s.rkv + s.dr, prog.hidden});
  shape_is(sdk::ParamRole::kv_a_norm, {s.rkv});
  shape_is(sdk::ParamRole::kv_b, {H * (s.dn + s.dv), s.rkv});
  ++mla_layers;
  maxRq = std::max(maxRq, s.rq);
  maxRkv = std::max(maxRkv, s.rkv);
  maxDr = std::max(maxDr, s.dr);
  maxKvb = std::max(maxKvb, H * (s.dn + s.dv));
  maxMlaW = std::max(maxMlaW, s.Wqkv);
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
  x.dqkv = c.take<bf16>(N * maxMlaW);
  x.dkva = c.take<bf16>(N * (maxRkv + maxDr));
  x.dckv = c.take<bf16>(N * maxRkv);
  if (maxRq > 0) {
    x.dqan = c.take<bf16>(N * maxRq);
    x.dqa = c.take<bf16>(N * maxRq);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward: att [N, H dv], q|k|v into qkv [N, W] and lse [H, N] from xn.

void CudaEngine::Impl::forward_mla(int64_t l, const MicroBatch& mb, const bf16* xn, bf16* qkv, bf16* att,
                                   float* lse) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerOffsets& p = lo[size_t(l)];
  cuda::MlaActs& m = mla_of(l);
  cuda::MlaScratch& x = mla_x;
  const int64_t N = mb.num_tokens(), H = s.H, D = s.D, W = s.Wqkv;
  const int64_t dn = s.dn, dr = s.dr, dv = s.dv, rq = s.rq, rkv = s.rkv, Wkv = H * (dn + dv);
  bf16* q = qkv;              // [N, H D]   row stride W
  bf16* k = qkv + H * D;      // [N, H D]
  bf16* v = qkv + 2 * H * D;  // [N, H dv]

  if (rq > 0) {
    ops->gemm(false, true, N, rq, C, xn, C, w(p.q_a), C, 0, m.qa, rq, false);                  // qa
    ops->rmsnorm_fwd(m.qan, rq, m.rstd_qa, m.qa, rq, w(p.q_a_norm), N, rq, kLatentEps, 0);    // qan
    ops->gemm(false, true, N, H * D, rq, m.qan, rq, w(p.q_b), rq, 0, q, W, false);             // q
  } else {
    ops->gemm(false, true, N, H * D, C, xn, C, w(p.wq), C, 0, q, W, false);                    // q
  }
  ops->gemm(false, true, N, rkv + dr, C, xn, C, w(p.kv_a), C, 0, m.kva, rkv + dr, false);      // kva
  ops->rmsnorm_fwd(m.ckv, rkv, m.rstd_kva, m.kva, rkv + dr, w(p.kv_a_norm), N, rkv, kLatentEps, 0);  // ckv
  ops->gemm(false, true, N, Wkv, rkv, m.ckv, rkv, w(p.kv_b), rkv, 0, x.kv, Wkv, false);        // kv
  const bf16* krot = m.kva + rkv;  // unrotated without RoPE
  int64_t ldkrot = rkv + dr;
  if (s.rope >= 0) {
    // q's rope dims in place (head stride D, the dr dims from column dn); the shared key once,
    // into the scratch
    rope(s.rope, q + dn, W, q + dn, W, H, D, N, false);
    rope(s.rope, x.krot, dr, m.kva + rkv, rkv + dr, 1, dr, N, false);
    krot = x.krot;
    ldkrot = dr;
  }
  cuda::mla_assemble_kv(x.kv, krot, ldkrot, k, v, W, N, H, dn, dr, dv, stream);        // k, v
  attention_forward(mla_attention(s, N, mb.num_sequences(), qkv, att, lse));          // att
}

cuda::DeviceOps::Attention CudaEngine::Impl::mla_attention(const LayerShape& s, int64_t N, int64_t S,
                                                           const bf16* qkv, const bf16* att,
                                                           const float* lse) const {
  cuda::DeviceOps::Attention at;
  at.N = N;
  at.S = S;
  at.Hq = at.Hkv = s.H;
  at.Dk = s.D;
  at.Dv = s.dv;
  at.window = s.window;
  at.scale = s.scale;
  at.softcap = s.softcap;
  at.cu = cu;
  at.q = qkv;
  at.k = qkv + s.H * s.D;
  at.v = qkv + 2 * s.H * s.D;
  at.ldq = at.ldk = at.ldv = s.Wqkv;
  at.o = const_cast<bf16*>(att);
  at.ldo = s.H * s.dv;
  at.lse = const_cast<float*>(lse);
  return at;
}

// ---------------------------------------------------------------------------------------------
// Backward: datt = d loss / d att in; dxn = d loss / d xn out (added to it with accumulate).

void CudaEngine::Impl::backward_mla(int64_t l, const MicroBatch& mb, const bf16* xn, const bf16* qkv,
                                    const bf16* att, const float* lse, const bf16* datt, bf16* dxn,
                                    bool accumulate) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerOffsets& p = lo[size_t(l)];
  cuda::MlaActs& m = mla_of(l);
  cuda::MlaScratch& x = mla_x;
  const int64_t N = mb.num_tokens(), H = s.H, D = s.D, W = s.Wqkv;
  const int64_t dn = s.dn, dr = s.dr, dv = s.dv, rq = s.rq, rkv = s.rkv, Wkv = H * (dn + dv);
  bf16* dq = x.dqkv;
  bf16* dk = x.dqkv + H * D;
  bf16* dvv = x.dqkv + 2 * H * D;

  ops->attention_bwd(mla_attention(s, N, mb.num_sequences(), qkv, att, lse), datt, H * dv, dq, W, dk, W,
                     dvv, W);                                                           // dq dk dv

  // d(k_nope | v) per head into kv_b's layout; d k_rot summed over the heads into dkva's
  // rope columns, then the transposed rotations (q's in place).
  bf16* dkrot = x.dkva + rkv;
  cuda::mla_split_dkv(dk, dvv, W, x.kv, dkrot, rkv + dr, N, H, dn, dr, dv, stream);
  if (s.rope >= 0) {
    rope(s.rope, dq + dn, W, dq + dn, W, H, D, N, true);
    rope(s.rope, dkrot, rkv + dr, dkrot, rkv + dr, 1, dr, N, true);
  }
  // kv_b, the latent norm (into dkva's latent columns), kv_a (both row blocks at once)
  ops->gemm(false, false, N, rkv, Wkv, x.kv, Wkv, w(p.kv_b), rkv, 0, x.dckv, rkv, false);    // dckv
  ops->gemm(true, false, Wkv, rkv, N, x.kv, Wkv, m.ckv, rkv, 1, g(p.kv_b), rkv, true);       // dW_kv_b
  ops->rmsnorm_bwd(x.dkva, rkv + dr, g(p.kv_a_norm), x.dckv, rkv, m.kva, rkv + dr, w(p.kv_a_norm), m.rstd_kva,
                   N, rkv, 0, false);                                                   // d latent
  ops->gemm(false, false, N, C, rkv + dr, x.dkva, rkv + dr, w(p.kv_a), C, accumulate ? 1 : 0, dxn, C,
            false);                                                                     // dxn
  ops->gemm(true, false, rkv + dr, C, N, x.dkva, rkv + dr, xn, C, 1, g(p.kv_a), C, true);    // dW_kv_a
  // q path
  if (rq > 0) {
    ops->gemm(false, false, N, rq, H * D, dq, W, w(p.q_b), rq, 0, x.dqan, rq, false);        // dqan
    ops->gemm(true, false, H * D, rq, N, dq, W, m.qan, rq, 1, g(p.q_b), rq, true);           // dW_q_b
    ops->rmsnorm_bwd(x.dqa, rq, g(p.q_a_norm), x.dqan, rq, m.qa, rq, w(p.q_a_norm), m.rstd_qa, N, rq, 0,
                     false);                                                            // dqa
    ops->gemm(false, false, N, C, rq, x.dqa, rq, w(p.q_a), C, 1, dxn, C, false);             // dxn +=
    ops->gemm(true, false, rq, C, N, x.dqa, rq, xn, C, 1, g(p.q_a), C, true);                // dW_q_a
  } else {
    ops->gemm(false, false, N, C, H * D, dq, W, w(p.wq), C, 1, dxn, C, false);               // dxn +=
    ops->gemm(true, false, H * D, C, N, dq, W, xn, C, 1, g(p.wq), C, true);                  // dW_q
  }
}

}  // namespace rlh::engine
