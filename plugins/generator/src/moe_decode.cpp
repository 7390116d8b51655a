// The MoE step of the layer program for a decoding step (Mixtral, Qwen2-MoE, Qwen3-MoE,
// DeepSeek-V3): the engine's forward (sdk/engine/src/moe.cpp), op for op, with its products made
// batch-invariant.
//
//   z    = xn Wr^T (+ b_r)                       router logits [R, E]   (float64: router_fp64)
//   w, e = top-k of softmax(z) / sigmoid(z)      moe_router_fwd (per row)
//   y    = sum_k w_k down_e(act(gate_e xn) * up_e xn)      over expert-sorted rows
//        + sigmoid(xn ws^T) shared(xn)            Qwen2-MoE's gated shared expert
//
// The engine runs the experts with grouped GEMMs, whose result for a row depends on how many
// rows its expert got; here each expert's rows go through the batch-invariant gemm, so a token's
// output depends only on itself, whichever other tokens share the step and its experts. The
// router's scores, choice and weights, the permutation and the weighted combine are the engine's
// ops, per row by construction.
//
// Router precision follows the trainer's (MoeOptions::router_fp64, NeMo-RL's moe_router_dtype):
// the generator computes what the trainer computes — float32 logits and scores, or float64 ones
// from the widened (exact) inputs and weights, the weights rounded to float at the end as the
// engine rounds them. In float32 the router's own product adds rounding in an order the trainer
// does not share; in float64 it adds none worth the name, and the logits of the two differ only
// by what their inputs xn differ by (the rounding of the layers below). Either way a token whose
// two best experts tie to within that difference may be routed differently by the two.
#include <algorithm>
#include <string>

#include "host_executor.hpp"

namespace rlh::gen {

void HostBackend::moe(int64_t l, int64_t R, const float* xn, float* y) {
  const LayerShape& s = m_.shapes()[size_t(l)];
  const MoeWeights& w = lw_[size_t(l)];
  const int64_t C = C_, E = s.E, K = s.Kx, Fe = s.Fe, Fs = s.Fs, RK = R * K;
  auto glu = [&](const std::string& act, float* h, int64_t ldh, const float* gu_, int64_t ldgu, int64_t n,
                 int64_t F) {
    if (act == "silu") ops_->swiglu_fwd(h, ldh, gu_, ldgu, gu_ + F, ldgu, n, F);
    else ops_->geglu_fwd(h, ldh, gu_, ldgu, gu_ + F, ldgu, n, F, act == "gelu_tanh");
  };

  // Scratch for R rows, carved in order (grown on demand; no state survives the call).
  // Each piece starts 64-byte aligned (the vector loads of the gemm), hence 16 floats of slack per piece.
  const size_t nf = size_t(R * E * 2 + RK + RK * C + RK * 2 * Fe + RK * Fe + RK * C +
                           (Fs > 0 ? R * 2 * Fs + R * Fs + R * C + 3 * R : 0)) + 13 * 16;
  const size_t ni = size_t(RK * 2 + E + 1 + 2 * R);
  if (moe_f_.size() < nf) moe_f_.resize(nf);
  if (moe_i_.size() < ni) moe_i_.resize(ni);
  float* fp = moe_f_.data();
  int32_t* ip = moe_i_.data();
  auto tf = [&](int64_t n) { float* p = fp; fp += (n + 15) / 16 * 16; return p; };
  auto ti = [&](int64_t n) { int32_t* p = ip; ip += n; return p; };
  float* z = tf(R * E);
  float* probs = tf(R * E);
  float* wts = tf(RK);
  float* xp = tf(RK * C);
  float* gu = tf(RK * 2 * Fe);
  float* a = tf(RK * Fe);
  float* yp = tf(RK * C);
  int32_t* experts = ti(RK);
  int32_t* row = ti(RK);
  int32_t* offsets = ti(E + 1);

  // Router: logits, scores, choice, weights.
  if (!m_.router_fp64()) {
    ops_->gemm_rows(z, E, xn, C, w.router, C, R, E, C);                                            // z [R,E]
    if (w.router_b) ops_->bias_add_fwd(z, E, w.router_b, R, E);
    ops_->moe_router_fwd(wts, experts, probs, nullptr, z, E, w.score_bias, R, E, K, s.router);
  } else {
    double *z64, *p64, *w64, *b64;
    // Each z[r, e] a k-ordered sum of exact products of widened floats (the batch-invariant
    // gemm in float64): a function of row r alone.
    if (moe_d_.size() < size_t(2 * R * E + RK + E + R * C)) moe_d_.resize(size_t(2 * R * E + RK + E + R * C));
    z64 = moe_d_.data();
    p64 = z64 + R * E;
    w64 = p64 + R * E;
    b64 = w64 + RK;
    double* x64 = b64 + E;
    std::copy(xn, xn + R * C, x64);
    ops_->gemm_rows_f64(z64, E, x64, C, w.router64.data(), C, R, E, C);                    // z [R,E]
    if (w.router_b)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t e = 0; e < E; ++e) z64[r * E + e] += double(w.router_b[e]);
    if (w.score_bias)
      for (int64_t e = 0; e < E; ++e) b64[e] = double(w.score_bias[e]);
    ops_->moe_router_fwd_f64(w64, experts, p64, nullptr, z64, E, w.score_bias ? b64 : nullptr, R, E, K, s.router);
    for (int64_t i = 0; i < RK; ++i) wts[i] = float(w64[i]);
  }

  // Routed experts on expert-sorted rows: rows offsets[e] .. offsets[e+1]-1 are expert e's.
  ops_->moe_permute_fwd(xp, row, offsets, xn, C, experts, R, K, C, E);                    // xp [RK,C]
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], n = offsets[e + 1] - r0;
    if (n == 0) continue;
    ops_->gemm_rows(gu + r0 * 2 * Fe, 2 * Fe, xp + r0 * C, C, w.e_gate[size_t(e)], C, n, Fe, C);       // gate
    ops_->gemm_rows(gu + r0 * 2 * Fe + Fe, 2 * Fe, xp + r0 * C, C, w.e_up[size_t(e)], C, n, Fe, C);    // up
  }
  glu(s.act, a, Fe, gu, 2 * Fe, RK, Fe);                                                  // a [RK,Fe]
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], n = offsets[e + 1] - r0;
    if (n == 0) continue;
    ops_->gemm_rows(yp + r0 * C, C, a + r0 * Fe, Fe, w.e_down[size_t(e)], Fe, n, C, Fe);             // yp [RK,C]
  }
  ops_->moe_unpermute_fwd(y, C, yp, row, wts, R, K, C, false);                            // y [R,C]

  // Shared expert (a dense GLU MLP on every token) and its sigmoid gate, as the engine adds them.
  if (Fs > 0) {
    float* sgu = tf(R * 2 * Fs);
    float* sa = tf(R * Fs);
    float* sy = tf(R * C);
    float* sgl = tf(R);
    float* sgw = tf(R);
    float* sgp = tf(R);
    int32_t* srow = ti(R);
    int32_t* szero = ti(R);
    if (w.ws_up == w.ws_gate_proj + Fs * C) {
      ops_->gemm_rows(sgu, 2 * Fs, xn, C, w.ws_gate_proj, C, R, 2 * Fs, C);                        // [R,2Fs]
    } else {
      ops_->gemm_rows(sgu, 2 * Fs, xn, C, w.ws_gate_proj, C, R, Fs, C);
      ops_->gemm_rows(sgu + Fs, 2 * Fs, xn, C, w.ws_up, C, R, Fs, C);
    }
    glu(s.act, sa, Fs, sgu, 2 * Fs, R, Fs);                                                // [R,Fs]
    ops_->gemm_rows(sy, C, sa, Fs, w.ws_down, Fs, R, C, Fs);                                       // sy [R,C]
    if (w.ws_gate) {
      ops_->gemm_rows(sgl, 1, xn, C, w.ws_gate, C, R, 1, C);                                       // [R,1]
      for (int64_t r = 0; r < R; ++r) {
        srow[r] = int32_t(r);
        szero[r] = 0;
      }
      engine::Ops::RouterAttrs g;
      g.scoring = 1;  // sigmoid, one expert, one choice: weight = sigmoid(logit)
      ops_->moe_router_fwd(sgw, szero, sgp, nullptr, sgl, 1, nullptr, R, 1, 1, g);
      ops_->moe_unpermute_fwd(y, C, sy, srow, sgw, R, 1, C, true);                        // y += g sy
    } else {
      ops_->add_fwd(y, y, sy, R * C);
    }
  }
}

}  // namespace rlh::gen
