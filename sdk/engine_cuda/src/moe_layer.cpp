// Mixture-of-experts layers on the GPU (Mixtral, Qwen2-MoE, Qwen3-MoE): the MLP block of a layer
// the description marks `moe`, forward and backward, one launcher call per line, op for op the
// CPU engine's sdk/engine/src/moe.cpp (whose header comment gives the math and the auxiliary
// losses). Per token, dropless:
//
//   z    = xn Wr^T (+ b_r)                 router logits, fp32 (bf16 GEMM operands, fp32 C) or
//                                          fp64 (router_fp64: bf16 xn, fp32 master Wr)
//   w, e = top-k of softmax/sigmoid(z)     (+ selection bias), renormalised, scaled
//   out  = h + sum_k w_k down_e(silu(gate_e xn) * up_e xn) + [sigmoid(xn ws^T)] shared(xn)
//
// What differs from the CPU engine is where the work lives, not what it computes:
//   - each expert's gate and up are one [2 Fe, C] matrix (carve_params interleaves them), so
//     gate|up is one grouped GEMM forward, one for its weight gradient, one for dxp;
//   - the expert offsets never leave the device (grouped_gemm reads them there), and the
//     auxiliary losses are summed on the device (read with the gradient norm): no host wait;
//   - weight gradients accumulate in fp32 inside the GEMMs (bf16 operands, fp32 C, beta 1).
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cuda_engine_impl.hpp"

namespace rlh::engine {

using cuda::bf16;
using cuda::check;

// ---------------------------------------------------------------------------------------------
// Description

void CudaEngine::Impl::describe_moe_layer(const sdk::LayerDesc& ld, LayerShape& s) {
  static_cast<MoeBasics&>(s) =
      moe_basics(ld, opt.moe, "cuda engine: layer " + std::to_string(ld.index) + ": ");
  s.moe = true;
  s.F = 0;
  s.route_col = route_width;
  route_width += s.Kx;
  maxE = std::max(maxE, s.E);
  maxK = std::max(maxK, s.Kx);
  maxFe = std::max(maxFe, s.Fe);
  maxFs = std::max(maxFs, s.Fs);
  ++moe_layers;
}

// ---------------------------------------------------------------------------------------------
// Memory: per MoE layer when training keeps every layer (none / selective recompute: the
// routed activations are GEMM outputs and permutations, which selective recompute keeps), one
// set sized for the largest layer otherwise (forward only, full recompute). One scratch set.

void CudaEngine::Impl::carve_moe(cuda::Carver& c, int64_t N, bool per_layer, bool train) {
  moe_acts.clear();
  moe_x = cuda::MoeScratch{};
  if (moe_layers == 0) return;
  const bool r64 = opt.moe.router_fp64;
  auto carve = [&](int64_t E, int64_t K, int64_t Fe, int64_t Fs) {
    cuda::MoeActs m;
    const int64_t NK = N * K;
    if (r64) {
      m.probs64 = c.take<double>(N * E);
      m.lse64 = c.take<double>(N);
    } else {
      m.probs = c.take<float>(N * E);
      m.lse = c.take<float>(N);
    }
    m.w = c.take<float>(NK);
    m.experts = c.take<int32_t>(NK);
    m.row = c.take<int32_t>(NK);
    m.offsets = c.take<int32_t>(E + 1);
    m.xp = c.take<bf16>(NK * C);
    m.gu = c.take<bf16>(NK * 2 * Fe);
    m.a = c.take<bf16>(NK * Fe);
    m.yp = c.take<bf16>(NK * C);
    if (Fs > 0) {
      m.sgu = c.take<bf16>(N * 2 * Fs);
      m.sa = c.take<bf16>(N * Fs);
      m.sy = c.take<bf16>(N * C);
      m.sgl = c.take<float>(N);
      m.sgw = c.take<float>(N);
    }
    return m;
  };
  if (per_layer) {
    moe_acts.assign(size_t(L), cuda::MoeActs{});
    for (int64_t l = 0; l < L; ++l) {
      const LayerShape& s = shapes[size_t(l)];
      if (s.moe) moe_acts[size_t(l)] = carve(s.E, s.Kx, s.Fe, s.Fs);
    }
  } else {
    moe_acts.push_back(carve(maxE, maxK, maxFe, maxFs));
  }
  cuda::MoeScratch& x = moe_x;
  const int64_t NK = N * maxK;
  if (r64) {
    x.logits64 = c.take<double>(N * maxE);
    x.w64 = c.take<double>(NK);
    x.bias64 = c.take<double>(maxE);
  } else {
    x.logits = c.take<float>(N * maxE);
  }
  x.sprob = c.take<float>(N);
  x.srow = c.take<int32_t>(N);
  x.szero = c.take<int32_t>(N);
  if (!train) return;
  x.dw = c.take<float>(NK);
  x.dyp = c.take<bf16>(NK * C);
  x.da = c.take<bf16>(NK * maxFe);
  x.dgu = c.take<bf16>(NK * 2 * maxFe);
  if (r64) {
    x.dw64 = c.take<double>(NK);
    x.dlogits64 = c.take<double>(N * maxE);
    x.dprobs64 = c.take<double>(N * maxE);
    x.dlse64 = c.take<double>(N);
  } else {
    x.dlogits = c.take<float>(N * maxE);
    x.dlogits16 = c.take<bf16>(N * maxE);
    x.dprobs = c.take<float>(N * maxE);
    x.dlse = c.take<float>(N);
  }
  if (maxFs > 0) {
    x.dsy = c.take<bf16>(N * C);
    x.dsa = c.take<bf16>(N * maxFs);
    x.dsgu = c.take<bf16>(N * 2 * maxFs);
    x.dsgw = c.take<float>(N);
    x.dsgl = c.take<float>(N);
    x.dsgl16 = c.take<bf16>(N);
  }
}

// ---------------------------------------------------------------------------------------------
// Routing record and replay: the CPU engine's layout and checks (moe.cpp prepare_routing). The
// replay field is checked and narrowed to int32 on the host into pinned staging, then uploaded
// with the batch; each MoE layer copies its columns into its choices on the device.

void CudaEngine::Impl::prepare_routing(const MicroBatch& mb, const OutputRequest& req) {
  const int64_t N = mb.num_tokens();
  replay_active = false;
  record_active = req.routed_experts && route_width > 0;
  const rlh_tensor* f = replay_routing_tensor(mb, req.replay_routing_field, route_width, "cuda engine");
  if (!f) return;
  for (const LayerShape& s : shapes) {
    if (!s.moe) continue;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < s.Kx; ++k) {
        const int64_t at = n * route_width + s.route_col + k;
        h_route[at] = replayed_expert(*f, at, s.E, "cuda engine");
      }
  }
  // from pinned staging, ordered before the layers; the previous user of h_route (a record's
  // download) finished at the last wait
  check(cudaMemcpyAsync(route, h_route, size_t(N * route_width) * 4, cudaMemcpyHostToDevice,
                        stream), "upload");
  replay_active = true;
}

cuda::MoeLossArgs CudaEngine::Impl::moe_loss_args(int64_t l, const MicroBatch& mb,
                                                   const cuda::MoeActs& m) const {
  const LayerShape& s = shapes[size_t(l)];
  const MoeOptions& o = opt.moe;
  cuda::MoeLossArgs a;
  a.N = mb.num_tokens();
  a.S = mb.num_sequences();
  a.E = s.E;
  a.K = s.Kx;
  a.mode = o.aux_loss_coef == 0 ? 0
           : o.load_balancing == MoeOptions::LoadBalancing::aux_loss     ? 1
           : o.load_balancing == MoeOptions::LoadBalancing::seq_aux_loss ? 2
                                                                         : 0;
  a.aux_coef = o.aux_loss_coef;
  a.z_coef = o.z_loss_coef;
  a.tokens = moe_tokens;
  a.seqs = moe_seqs;
  a.experts = m.experts;
  a.offsets = m.offsets;
  a.cu = cu;
  return a;
}

namespace {

// A layer's routing as the router kernel takes it, forward and backward alike.
kc::RouterArgs router_args(const cuda::LayerShape& s, int64_t N, int32_t* experts, int* err) {
  kc::RouterArgs r;
  r.N = N;
  r.E = s.E;
  r.K = s.Kx;
  r.scoring = s.scoring;
  r.norm_topk_prob = s.norm_topk_prob;
  r.scaling_factor = s.scaling_factor;
  r.n_group = s.n_group;
  r.topk_group = s.topk_group;
  r.experts = experts;
  r.err = err;
  return r;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Forward: a.xn2 = mlp_norm(h) is computed (forward_layer); x_out = h + the block.

void CudaEngine::Impl::forward_moe(int64_t l, const MicroBatch& mb, LayerActs& a, bf16* x_out,
                                   bool recompute) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerOffsets& p = lo[size_t(l)];
  cuda::MoeActs& m = moe_of(l);
  cuda::MoeScratch& x = moe_x;
  const int64_t N = mb.num_tokens(), E = s.E, K = s.Kx, Fe = s.Fe, Fs = s.Fs, NK = N * K;
  const bf16* xn = a.xn2;
  const auto bf = kc::DType::bf16;
  const bool r64 = opt.moe.router_fp64;

  // Router: logits, scores, choice, weights.
  kc::RouterArgs ra = router_args(s, N, m.experts, err);
  ra.ldl = E;
  const size_t kb = size_t(K) * 4, rb = size_t(route_width) * 4;
  if (replay_active) {  // this layer's columns of the [N, R] record become its choices
    check(cudaMemcpy2DAsync(m.experts, kb, route + s.route_col, rb, kb, size_t(N),
                            cudaMemcpyDeviceToDevice, stream), "replay");
    ra.replay = true;
  }
  if (!r64) {
    // bf16 operands, fp32 logits (HF's bf16 model runs the router Linear in bf16 and its
    // softmax in fp32); the scores are never rounded before the choice.
    gemm(false, true, N, E, C, xn, C, w(p.router), C, 0, x.logits, E, true);         // z [N,E]
    if (p.router_b >= 0) kc::bias_add_fwd(kc::DType::f32, x.logits, E, mf(p.router_b), N, E, stream);
    ra.t = kc::DType::f32;
    ra.logits = x.logits;
    ra.bias = {mf(p.score_bias), false};
    ra.weights = {m.w, false};
    ra.probs = {m.probs, false};
    ra.lse = {m.lse, false};
    kc::moe_router_fwd(ra, stream);
  } else {
    // fp64 from the fp32 master router weight (NeMo-RL's moe_router_dtype fp64)
    cuda::f64_gemm_logits(xn, C, mf(p.router), mf(p.router_b), x.logits64, N, E, C, stream);
    if (p.score_bias >= 0) cuda::f32_to_f64(mf(p.score_bias), x.bias64, E, stream);
    ra.t = kc::DType::f64;
    ra.logits = x.logits64;
    ra.bias = {p.score_bias >= 0 ? x.bias64 : nullptr, false};
    ra.weights = {x.w64, false};
    ra.probs = {m.probs64, false};
    ra.lse = {m.lse64, false};
    kc::moe_router_fwd(ra, stream);
    cuda::f64_to_f32(x.w64, m.w, NK, stream);  // the combine takes fp32 weights (as the CPU's)
  }

  if (record_active && !replay_active && !recompute)  // (a replay's record is the field)
    check(cudaMemcpy2DAsync(route + s.route_col, rb, m.experts, kb, kb, size_t(N),
                            cudaMemcpyDeviceToDevice, stream), "routing record");

  // Routed experts on expert-sorted rows; offsets stay on the device.
  kc::moe_permute_fwd(bf, m.xp, C, m.row, m.offsets, xn, C, m.experts, N, K, C, E, err, ws(),
                      stream);                                                         // xp [NK,C]
  grouped_gemm(false, true, E, NK, m.offsets, 0, 2 * Fe, C, m.xp, C, w(p.we_gu), C, 2 * Fe * C, 0,
               m.gu, 2 * Fe, 0, false);                                                // gu [NK,2Fe]
  kc::swiglu_fwd(bf, m.a, Fe, m.gu, 2 * Fe, m.gu + Fe, 2 * Fe, NK, Fe, stream);        // a [NK,Fe]
  grouped_gemm(false, true, E, NK, m.offsets, 0, C, Fe, m.a, Fe, w(p.we_down), Fe, C * Fe, 0, m.yp,
               C, 0, false);                                                           // yp [NK,C]

  // Shared expert (a dense SwiGLU on every token) and its sigmoid gate, a route with one
  // expert and one choice: weight = sigmoid(logit), fp32 logit from the bf16 GEMM.
  if (Fs > 0) {
    gemm(false, true, N, 2 * Fs, C, xn, C, w(p.ws_gu), C, 0, m.sgu, 2 * Fs, false);   // [N,2Fs]
    kc::swiglu_fwd(bf, m.sa, Fs, m.sgu, 2 * Fs, m.sgu + Fs, 2 * Fs, N, Fs, stream);    // [N,Fs]
    gemm(false, true, N, C, Fs, m.sa, Fs, w(p.ws_down), Fs, 0, m.sy, C, false);        // sy [N,C]
    if (p.ws_gate >= 0) {
      gemm(false, true, N, 1, C, xn, C, w(p.ws_gate), C, 0, m.sgl, 1, true);           // [N,1]
      kc::RouterArgs ga;
      ga.t = kc::DType::f32;
      ga.N = N;
      ga.E = 1;
      ga.K = 1;
      ga.scoring = 1;
      ga.logits = m.sgl;
      ga.ldl = 1;
      ga.weights = {m.sgw, false};
      ga.experts = x.szero;  // writes expert 0 again
      ga.probs = {x.sprob, false};
      ga.err = err;
      kc::moe_router_fwd(ga, stream);
    }
  }

  if (moe_train && !recompute) {  // values of the auxiliary losses, once per forward
    const cuda::MoeLossArgs la = moe_loss_args(l, mb, m);
    if (!r64) cuda::moe_loss_values<float>(la, m.probs, m.lse, moe_stats(), stream);
    else cuda::moe_loss_values<double>(la, m.probs64, m.lse64, moe_stats(), stream);
  }
  kc::moe_unpermute_fwd(bf, x_out, C, m.yp, C, m.row, {m.w, false}, N, K, C, false, err, ws(),
                        stream);                                                       // out [N,C]
  if (Fs > 0) {
    if (p.ws_gate >= 0)
      kc::moe_unpermute_fwd(bf, x_out, C, m.sy, C, x.srow, {m.sgw, false}, N, 1, C, true, err,
                            ws(), stream);
    else
      kc::add_fwd(bf, x_out, x_out, m.sy, N * C, stream);
  }
  kc::add_fwd(bf, x_out, a.h, x_out, N * C, stream);                                  // h + moe
}

// ---------------------------------------------------------------------------------------------
// Backward: dres holds d loss / d (layer output) on entry; on exit the block's contribution is
// added (d loss / d h), as the dense block does. dxn collects d loss / d xn2.

void CudaEngine::Impl::backward_moe(int64_t l, const MicroBatch& mb, LayerActs& a) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerOffsets& p = lo[size_t(l)];
  cuda::MoeActs& m = moe_of(l);
  cuda::MoeScratch& x = moe_x;
  const int64_t N = mb.num_tokens(), E = s.E, K = s.Kx, Fe = s.Fe, Fs = s.Fs, NK = N * K;
  const bf16* xn = a.xn2;
  const auto bf = kc::DType::bf16;
  const bool r64 = opt.moe.router_fp64;
  const bool frozen = opt.moe.freeze_router;
  const int32_t* off = m.offsets;

  // Combine: dyp = w dres (scattered to the rows), dw = <dres, yp> (fp32).
  kc::moe_unpermute_bwd(bf, x.dyp, C, {x.dw, false}, dres, C, m.yp, C, m.row, {m.w, false}, N, K,
                        C, err, ws(), stream);
  // Experts: down, activation, gate|up, each with its weight gradient (fp32, beta 1).
  grouped_gemm(false, false, E, NK, off, 0, Fe, C, x.dyp, C, w(p.we_down), Fe, C * Fe, 0, x.da,
               Fe, 0, false);                                                          // da [NK,Fe]
  grouped_gemm(true, false, E, NK, off, C, Fe, 0, x.dyp, C, m.a, Fe, 0, 1, g(p.we_down), Fe,
               C * Fe, true);                                                          // dW_down
  kc::swiglu_bwd(bf, x.dgu, 2 * Fe, x.dgu + Fe, 2 * Fe, x.da, Fe, m.gu, 2 * Fe, m.gu + Fe, 2 * Fe,
                 NK, Fe, stream);                                                      // dgu
  grouped_gemm(true, false, E, NK, off, 2 * Fe, C, 0, x.dgu, 2 * Fe, m.xp, C, 0, 1, g(p.we_gu), C,
               2 * Fe * C, true);                                                      // dW_gu
  bf16* dxp = x.dyp;  // dyp is spent
  grouped_gemm(false, false, E, NK, off, 0, C, 2 * Fe, x.dgu, 2 * Fe, w(p.we_gu), C, 2 * Fe * C, 0,
               dxp, C, 0, false);                                                      // dxp [NK,C]
  kc::moe_permute_bwd(bf, dxn, C, dxp, C, m.row, N, K, C, false, err, ws(), stream);   // dxn [N,C]

  // Router: d logits from the weights (and the auxiliary losses), then into xn (always) and
  // into the router weight (unless frozen).
  const bool aux = moe_train && opt.moe.aux_loss_coef != 0 &&
                   opt.moe.load_balancing != MoeOptions::LoadBalancing::none;
  const bool zl = moe_train && opt.moe.z_loss_coef != 0;
  const cuda::MoeLossArgs la = moe_loss_args(l, mb, m);
  kc::RouterArgs rb = router_args(s, N, m.experts, err);
  rb.lddl = E;
  if (!r64) {
    if (aux || zl)
      cuda::moe_loss_grads<float>(la, m.lse, aux ? x.dprobs : nullptr, zl ? x.dlse : nullptr,
                                  stream);
    rb.t = kc::DType::f32;
    rb.dweights = {x.dw, false};
    rb.probs = {m.probs, false};
    rb.dprobs = {aux ? x.dprobs : nullptr, false};
    rb.dlse = {zl ? x.dlse : nullptr, false};
    rb.dlogits = x.dlogits;
    kc::moe_router_bwd(rb, stream);                                                    // dz [N,E]
    cuda::cast_to_bf16(x.dlogits, x.dlogits16, N * E, stream);  // the GEMMs' bf16 operand
    if (!frozen) {
      gemm(true, false, E, C, N, x.dlogits16, E, xn, C, 1, g(p.router), C, true);     // dW_router
      if (p.router_b >= 0)
        kc::bias_bwd(kc::DType::f32, {g(p.router_b), false}, x.dlogits, E, N, E, ws(), stream);
    }
    gemm(false, false, N, C, E, x.dlogits16, E, w(p.router), C, 1, dxn, C, false);    // dxn += dz Wr
  } else {
    if (aux || zl)
      cuda::moe_loss_grads<double>(la, m.lse64, aux ? x.dprobs64 : nullptr,
                                   zl ? x.dlse64 : nullptr, stream);
    cuda::f32_to_f64(x.dw, x.dw64, NK, stream);
    rb.t = kc::DType::f64;
    rb.dweights = {x.dw64, false};
    rb.probs = {m.probs64, false};
    rb.dprobs = {aux ? x.dprobs64 : nullptr, false};
    rb.dlse = {zl ? x.dlse64 : nullptr, false};
    rb.dlogits = x.dlogits64;
    kc::moe_router_bwd(rb, stream);                                                    // dz [N,E]
    cuda::f64_gemm_dx(x.dlogits64, mf(p.router), dxn, N, E, C, stream);                // dxn += dz Wr
    if (!frozen) {
      cuda::f64_gemm_dw(x.dlogits64, xn, g(p.router), N, E, C, stream);               // dW_router
      if (p.router_b >= 0) cuda::f64_colsum_acc(x.dlogits64, g(p.router_b), N, E, stream);
    }
  }

  // Shared expert and its gate.
  if (Fs > 0) {
    const bf16* dsy = dres;
    if (p.ws_gate >= 0) {
      kc::moe_unpermute_bwd(bf, x.dsy, C, {x.dsgw, false}, dres, C, m.sy, C, x.srow,
                            {m.sgw, false}, N, 1, C, err, ws(), stream);               // dsy, dgate
      kc::RouterArgs ga;
      ga.t = kc::DType::f32;
      ga.N = N;
      ga.E = 1;
      ga.K = 1;
      ga.scoring = 1;
      ga.dweights = {x.dsgw, false};
      ga.probs = {m.sgw, false};  // sigmoid scores = the weights with one expert
      ga.experts = x.szero;
      ga.dlogits = x.dsgl;
      ga.lddl = 1;
      ga.err = err;
      kc::moe_router_bwd(ga, stream);                                                  // [N,1]
      cuda::cast_to_bf16(x.dsgl, x.dsgl16, N, stream);
      gemm(true, false, 1, C, N, x.dsgl16, 1, xn, C, 1, g(p.ws_gate), C, true);        // dW_gate
      gemm(false, false, N, C, 1, x.dsgl16, 1, w(p.ws_gate), C, 1, dxn, C, false);     // dxn +=
      dsy = x.dsy;
    }
    gemm(false, false, N, Fs, C, dsy, C, w(p.ws_down), Fs, 0, x.dsa, Fs, false);       // dsa
    gemm(true, false, C, Fs, N, dsy, C, m.sa, Fs, 1, g(p.ws_down), Fs, true);          // dW_down
    kc::swiglu_bwd(bf, x.dsgu, 2 * Fs, x.dsgu + Fs, 2 * Fs, x.dsa, Fs, m.sgu, 2 * Fs, m.sgu + Fs,
                   2 * Fs, N, Fs, stream);                                             // dsgu
    gemm(false, false, N, C, 2 * Fs, x.dsgu, 2 * Fs, w(p.ws_gu), C, 1, dxn, C, false); // dxn +=
    gemm(true, false, 2 * Fs, C, N, x.dsgu, 2 * Fs, xn, C, 1, g(p.ws_gu), C, true);    // dW_gu
  }
  kc::rmsnorm_bwd(bf, dres, C, {g(p.mlp_norm), false}, dxn, C, a.h, C, w(p.mlp_norm),
                  {a.rstd2, false}, N, C, s.off_mlp, true, ws(), stream);              // dres = dh
}

}  // namespace rlh::engine
