// Mixture-of-experts layers on the GPU (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3): the layer
// program's moe step (sdk/layer_program.hpp), forward and backward, one op per line, op for op
// the CPU engine's sdk/engine/src/moe.cpp (whose header comment gives the math and the auxiliary
// losses). The MLP norm before it and the residual add after it are the program's own steps.
// Per token, dropless:
//
//   z    = xn Wr^T (+ b_r)                 router logits, fp32 (bf16 GEMM operands, fp32 C) or
//                                          fp64 (router_fp64: bf16 xn, fp32 master Wr)
//   w, e = top-k of softmax/sigmoid(z)     (+ selection bias), renormalised, scaled
//   out  = sum_k w_k down_e(act(gate_e xn) * up_e xn) + [sigmoid(xn ws^T)] shared(xn)
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

void CudaEngine::Impl::describe_moe_layer(const sdk::LayerDesc& ld, const sdk::LayerStep& st, LayerShape& s) {
  static_cast<MoeBasics&>(s) =
      moe_basics(ld, opt.moe, "cuda engine: layer " + std::to_string(ld.index) + ": ");
  s.moe = true;
  s.act = st.act;
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

// A layer's routing as the router op takes it, forward and backward alike.
cuda::DeviceOps::Router router_of(const cuda::LayerShape& s, int64_t N, bool f64, bool replay) {
  cuda::DeviceOps::Router r;
  r.f64 = f64;
  r.N = N;
  r.E = s.E;
  r.K = s.Kx;
  r.scoring = s.scoring;
  r.norm_topk_prob = s.norm_topk_prob;
  r.scaling_factor = s.scaling_factor;
  r.replay = replay;
  r.n_group = s.n_group;
  r.topk_group = s.topk_group;
  return r;
}

// The shared expert's sigmoid gate as a route with one expert and one choice.
cuda::DeviceOps::Router shared_gate(int64_t N) {
  cuda::DeviceOps::Router r;
  r.N = N;
  r.E = 1;
  r.K = 1;
  r.scoring = 1;
  return r;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Forward: out [N, C] = the block of xn [N, C]. Inside the backward's recompute only what the
// backward reads is rebuilt (not out, not the routing record, no auxiliary losses counted).

void CudaEngine::Impl::forward_moe(int64_t l, const MicroBatch& mb, const bf16* xn, bf16* out, bool recompute) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerOffsets& p = lo[size_t(l)];
  cuda::MoeActs& m = moe_of(l);
  cuda::MoeScratch& x = moe_x;
  const int64_t N = mb.num_tokens(), E = s.E, K = s.Kx, Fe = s.Fe, Fs = s.Fs, NK = N * K;
  const bool r64 = opt.moe.router_fp64;

  // Router: logits, scores, choice, weights.
  const size_t kb = size_t(K) * 4, rb = size_t(route_width) * 4;
  if (replay_active)  // this layer's columns of the [N, R] record become its choices
    check(cudaMemcpy2DAsync(m.experts, kb, route + s.route_col, rb, kb, size_t(N), cudaMemcpyDeviceToDevice,
                            stream), "replay");
  const cuda::DeviceOps::Router ra = router_of(s, N, r64, replay_active);
  if (!r64) {
    // bf16 operands, fp32 logits (HF's bf16 model runs the router Linear in bf16 and its
    // softmax in fp32); the scores are never rounded before the choice.
    ops->gemm(false, true, N, E, C, xn, C, w(p.router), C, 0, x.logits, E, true);                 // z [N,E]
    if (p.router_b >= 0) ops->bias_add(true, x.logits, E, mf(p.router_b), N, E);
    ops->router_fwd(ra, x.logits, E, mf(p.score_bias), m.w, m.experts, m.probs, m.lse);
  } else {
    // fp64 from the fp32 master router weight (NeMo-RL's moe_router_dtype fp64)
    cuda::f64_gemm_logits(xn, C, mf(p.router), mf(p.router_b), x.logits64, N, E, C, stream);
    if (p.score_bias >= 0) cuda::f32_to_f64(mf(p.score_bias), x.bias64, E, stream);
    ops->router_fwd(ra, x.logits64, E, p.score_bias >= 0 ? x.bias64 : nullptr, x.w64, m.experts, m.probs64,
                    m.lse64);
    cuda::f64_to_f32(x.w64, m.w, NK, stream);  // the combine takes fp32 weights (as the CPU's)
  }

  if (record_active && !replay_active && !recompute)  // (a replay's record is the field)
    check(cudaMemcpy2DAsync(route + s.route_col, rb, m.experts, kb, kb, size_t(N), cudaMemcpyDeviceToDevice,
                            stream), "routing record");

  // Routed experts on expert-sorted rows; offsets stay on the device.
  ops->permute_fwd(m.xp, m.row, m.offsets, xn, C, m.experts, N, K, C, E);                      // xp [NK,C]
  ops->grouped_gemm(false, true, E, NK, m.offsets, 0, 2 * Fe, C, m.xp, C, w(p.we_gu), C, 2 * Fe * C, 0, m.gu,
                    2 * Fe, 0, false);                                                         // gu [NK,2Fe]
  ops->glu_fwd(s.act, m.a, Fe, m.gu, 2 * Fe, NK, Fe);                                           // a [NK,Fe]
  ops->grouped_gemm(false, true, E, NK, m.offsets, 0, C, Fe, m.a, Fe, w(p.we_down), Fe, C * Fe, 0, m.yp, C, 0,
                    false);                                                                    // yp [NK,C]

  // Shared expert (a dense GLU MLP on every token) and its sigmoid gate, a route with one
  // expert and one choice: weight = sigmoid(logit), fp32 logit from the bf16 GEMM.
  if (Fs > 0) {
    ops->gemm(false, true, N, 2 * Fs, C, xn, C, w(p.ws_gu), C, 0, m.sgu, 2 * Fs, false);        // [N,2Fs]
    ops->glu_fwd(s.act, m.sa, Fs, m.sgu, 2 * Fs, N, Fs);                                         // [N,Fs]
    ops->gemm(false, true, N, C, Fs, m.sa, Fs, w(p.ws_down), Fs, 0, m.sy, C, false);             // sy [N,C]
    if (p.ws_gate >= 0) {
      ops->gemm(false, true, N, 1, C, xn, C, w(p.ws_gate), C, 0, m.sgl, 1, true);                // [N,1]
      ops->router_fwd(shared_gate(N), m.sgl, 1, nullptr, m.sgw, x.szero, x.sprob, nullptr);
    }
  }

  if (moe_train && !recompute) {  // values of the auxiliary losses, once per forward
    const cuda::MoeLossArgs la = moe_loss_args(l, mb, m);
    if (!r64) cuda::moe_loss_values<float>(la, m.probs, m.lse, moe_stats(), stream);
    else cuda::moe_loss_values<double>(la, m.probs64, m.lse64, moe_stats(), stream);
  }
  if (recompute) return;
  ops->unpermute_fwd(out, C, m.yp, m.row, m.w, N, K, C, false);                                  // out [N,C]
  if (Fs > 0) {
    if (p.ws_gate >= 0) ops->unpermute_fwd(out, C, m.sy, x.srow, m.sgw, N, 1, C, true);
    else ops->add(out, out, m.sy, N * C);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: dout = d loss / d out in; dxn = d loss / d xn out (added to it with accumulate).

void CudaEngine::Impl::backward_moe(int64_t l, const MicroBatch& mb, const bf16* xn, const bf16* dout, bf16* dxn,
                                    bool accumulate) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerOffsets& p = lo[size_t(l)];
  cuda::MoeActs& m = moe_of(l);
  cuda::MoeScratch& x = moe_x;
  const int64_t N = mb.num_tokens(), E = s.E, K = s.Kx, Fe = s.Fe, Fs = s.Fs, NK = N * K;
  const bool r64 = opt.moe.router_fp64;
  const bool frozen = opt.moe.freeze_router;
  const int32_t* off = m.offsets;

  // Combine: dyp = w dout (scattered to the rows), dw = <dout, yp> (fp32).
  ops->unpermute_bwd(x.dyp, x.dw, dout, C, m.yp, m.row, m.w, N, K, C);
  // Experts: down, activation, gate|up, each with its weight gradient (fp32, beta 1).
  ops->grouped_gemm(false, false, E, NK, off, 0, Fe, C, x.dyp, C, w(p.we_down), Fe, C * Fe, 0, x.da, Fe, 0,
                    false);                                                                    // da [NK,Fe]
  ops->grouped_gemm(true, false, E, NK, off, C, Fe, 0, x.dyp, C, m.a, Fe, 0, 1, g(p.we_down), Fe, C * Fe,
                    true);                                                                     // dW_down
  ops->glu_bwd(s.act, x.dgu, 2 * Fe, x.da, Fe, m.gu, 2 * Fe, NK, Fe);                          // dgu
  ops->grouped_gemm(true, false, E, NK, off, 2 * Fe, C, 0, x.dgu, 2 * Fe, m.xp, C, 0, 1, g(p.we_gu), C,
                    2 * Fe * C, true);                                                         // dW_gu
  bf16* dxp = x.dyp;  // dyp is spent
  ops->grouped_gemm(false, false, E, NK, off, 0, C, 2 * Fe, x.dgu, 2 * Fe, w(p.we_gu), C, 2 * Fe * C, 0, dxp,
                    C, 0, false);                                                              // dxp [NK,C]
  ops->permute_bwd(dxn, C, dxp, m.row, N, K, C, accumulate);                                   // dxn [N,C]

  // Router: d logits from the weights (and the auxiliary losses), then into xn (always) and
  // into the router weight (unless frozen).
  const bool aux = moe_train && opt.moe.aux_loss_coef != 0 &&
                   opt.moe.load_balancing != MoeOptions::LoadBalancing::none;
  const bool zl = moe_train && opt.moe.z_loss_coef != 0;
  const cuda::MoeLossArgs la = moe_loss_args(l, mb, m);
  const cuda::DeviceOps::Router rb = router_of(s, N, r64, false);
  if (!r64) {
    if (aux || zl)
      cuda::moe_loss_grads<float>(la, m.lse, aux ? x.dprobs : nullptr, zl ? x.dlse : nullptr, stream);
    ops->router_bwd(rb, x.dlogits, x.dw, m.probs, m.experts, aux ? x.dprobs : nullptr,
                    zl ? x.dlse : nullptr);                                                    // dz [N,E]
    cuda::cast_to_bf16(x.dlogits, x.dlogits16, N * E, stream);  // the GEMMs' bf16 operand
    if (!frozen) {
      ops->gemm(true, false, E, C, N, x.dlogits16, E, xn, C, 1, g(p.router), C, true);         // dW_router
      if (p.router_b >= 0) ops->bias_bwd(true, g(p.router_b), x.dlogits, E, N, E);
    }
    ops->gemm(false, false, N, C, E, x.dlogits16, E, w(p.router), C, 1, dxn, C, false);        // dxn += dz Wr
  } else {
    if (aux || zl)
      cuda::moe_loss_grads<double>(la, m.lse64, aux ? x.dprobs64 : nullptr, zl ? x.dlse64 : nullptr, stream);
    cuda::f32_to_f64(x.dw, x.dw64, NK, stream);
    ops->router_bwd(rb, x.dlogits64, x.dw64, m.probs64, m.experts, aux ? x.dprobs64 : nullptr,
                    zl ? x.dlse64 : nullptr);                                                  // dz [N,E]
    cuda::f64_gemm_dx(x.dlogits64, mf(p.router), dxn, N, E, C, stream);                        // dxn += dz Wr
    if (!frozen) {
      cuda::f64_gemm_dw(x.dlogits64, xn, g(p.router), N, E, C, stream);                       // dW_router
      if (p.router_b >= 0) cuda::f64_colsum_acc(x.dlogits64, g(p.router_b), N, E, stream);
    }
  }

  // Shared expert and its gate.
  if (Fs > 0) {
    const bf16* dsy = dout;
    if (p.ws_gate >= 0) {
      ops->unpermute_bwd(x.dsy, x.dsgw, dout, C, m.sy, x.srow, m.sgw, N, 1, C);                 // dsy, dgate
      // sigmoid scores = the weights with one expert
      ops->router_bwd(shared_gate(N), x.dsgl, x.dsgw, m.sgw, x.szero, nullptr, nullptr);        // [N,1]
      cuda::cast_to_bf16(x.dsgl, x.dsgl16, N, stream);
      ops->gemm(true, false, 1, C, N, x.dsgl16, 1, xn, C, 1, g(p.ws_gate), C, true);             // dW_gate
      ops->gemm(false, false, N, C, 1, x.dsgl16, 1, w(p.ws_gate), C, 1, dxn, C, false);          // dxn +=
      dsy = x.dsy;
    }
    ops->gemm(false, false, N, Fs, C, dsy, C, w(p.ws_down), Fs, 0, x.dsa, Fs, false);            // dsa
    ops->gemm(true, false, C, Fs, N, dsy, C, m.sa, Fs, 1, g(p.ws_down), Fs, true);               // dW_down
    ops->glu_bwd(s.act, x.dsgu, 2 * Fs, x.dsa, Fs, m.sgu, 2 * Fs, N, Fs);                        // dsgu
    ops->gemm(false, false, N, C, 2 * Fs, x.dsgu, 2 * Fs, w(p.ws_gu), C, 1, dxn, C, false);      // dxn +=
    ops->gemm(true, false, 2 * Fs, C, N, x.dsgu, 2 * Fs, xn, C, 1, g(p.ws_gu), C, true);         // dW_gu
  }
}

}  // namespace rlh::engine
