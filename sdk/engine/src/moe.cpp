// Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE): the MLP block of a layer whose
// description says `moe`, forward and backward, one op per line, plus the routing record and
// replay and the auxiliary losses. Per token (HF's *SparseMoeBlock, dropless):
//
//   xn  = mlp_norm(h)
//   z   = xn Wr^T (+ b_r)                       router logits [N, E]   (float64: router_fp64)
//   w, e = top-k of scores(z)                   softmax or sigmoid, renormalised or not
//   out = h + sum_k w_k expert_{e_k}(xn)        expert(x) = down(silu(gate x) * up x)
//           + sigmoid(xn ws^T) shared(xn)       Qwen2-MoE shared expert and its gate
//
// The routed part runs on expert-sorted rows: permute (every (token, choice) pair gets a row,
// expert by expert), grouped GEMMs with each expert's weights, the weighted combine. The shared
// expert's gate reuses the same ops as a route with one expert and one choice: sigmoid scores,
// weight sigmoid(logit), rows = tokens.
//
// Auxiliary losses (MoeOptions), added to the objective for every MoE layer, normalised by the
// global counts T (tokens) and S (sequences) so a step does not depend on how it is cut into
// micro-batches, with p the router's softmax scores [N, E] and c_e the tokens sent to expert e:
//   aux_loss      Megatron switch_load_balancing_loss_func on each micro-batch of N tokens,
//                 weighted by its share N / T of the tokens:  coef E / (K N T) sum_e c_e sum_n p_ne
//                 (Megatron: coef E / (K N^2) sum_e c_e sum_n p_ne; one micro-batch: the same)
//   seq_aux_loss  Megatron sequence_load_balancing_loss_func per sequence s of T_s tokens,
//                 averaged over the S sequences: coef E / (K T_s^2 S) sum_e c_se sum_{n in s} p_ne
//   z-loss        Megatron z_loss_func (ST-MoE):  coef / T sum_n logsumexp(z_n)^2
// The counts are constants (the top-k has no gradient), so d/dp_ne = the factor times c_e.
// Under context parallelism each rank routes its zigzag share of every sequence: the counts are
// summed over the group (padding rows left out), N and T_s are the whole micro-batch's and
// sequence's, so each rank's gradients and loss values are its tokens' part of one rank's.
// Under sequence parallelism the block reads every row (gathered before it) and leaves this
// rank's rows of its output (reduce-scattered after the combine); its d input likewise.
// Under expert parallelism with tensor parallelism (moe_own_rows, model.hpp) the router, the
// dispatch and the combine run on this rank's rows [moe_r0, moe_r0 + moe_n) only, the counts
// and loss values summed over the tp group as over a cp group; a shared expert alone reads every
// row (cut over the group like a dense MLP: its partial output reduce-scattered, then the routed
// rows added).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "model.hpp"

namespace rlh::engine {

namespace {

template <class T>
void to_double(double* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = double(src[i]);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Description

void Engine::Impl::describe_moe_layer(const sdk::LayerDesc& ld, const sdk::LayerStep& step, LayerShape& s) {
  static_cast<MoeBasics&>(s) = moe_basics(ld, opt.moe, "engine: layer " + std::to_string(ld.index) + ": ");
  s.moe = true;
  s.act = step.act;
  s.router.scoring = s.scoring;
  s.router.norm_topk_prob = s.norm_topk_prob;
  s.router.scaling_factor = s.scaling_factor;
  s.router.n_group = s.n_group;
  s.router.topk_group = s.topk_group;
  s.route_col = s.replay_col = route_width;
  route_width += s.Kx;
  // Under PP a stage's local layers are its model chunks' in order, and each chunk's columns are
  // one run of the whole record (PpLayout::Chunk): the layer's place in its chunk's run.
  if (opt.pp != nullptr && opt.pp->size > 1) {
    int64_t chunk_col = 0;  // the chunk's first column in this stage's record
    for (const sdk::PpLayout::Chunk& c : opt.pp->chunks) {
      if (ld.index < c.local_begin + c.count) {
        s.replay_col = c.route_begin + s.route_col - chunk_col;
        break;
      }
      chunk_col += c.route_count;
    }
  }
  router64 = opt.moe.router_fp64;
}

// ---------------------------------------------------------------------------------------------
// Storage: per MoE layer (or one set with recompute) and one scratch set, in three allocations
// (float, double for the float64 router, int32).

void Engine::Impl::plan_moe(int64_t N, bool save_all) {
  moe_acts.clear();
  moe_f.reset();
  moe_d.reset();
  moe_i.reset();
  moe_scratch = MoeScratch{};
  if (route_width == 0) return;
  const bool r64 = router64;
  // Sizes of one layer's saved set: floats, doubles, ints.
  struct Sizes {
    int64_t f = 0, d = 0, i = 0;
  };
  auto layer_sizes = [&](const LayerShape& s) {
    Sizes z;
    const int64_t NK = N * s.Kx;
    z.f = NK + NK * C + NK * 2 * s.Fe + NK * s.Fe + NK * C;  // w, xp, gu, a, yp
    if (!r64) z.f += N * s.E + N;                            // probs, lse
    else z.d += N * s.E + N;
    if (s.Fs > 0) z.f += N * 2 * s.Fs + N * s.Fs + N * C + 2 * N;  // sgu, sa, sy, sgl, sgw
    z.i = 2 * NK + s.E + 1;                                   // experts, row, offsets
    return z;
  };
  int64_t maxE = 0, maxK = 0, maxFe = 0, maxFs = 0;
  Sizes worst;
  LayerShape worst_shape{};
  for (const LayerShape& s : shapes) {
    if (!s.moe) continue;
    maxE = std::max(maxE, s.E);
    maxK = std::max(maxK, s.Kx);
    maxFe = std::max(maxFe, s.Fe);
    maxFs = std::max(maxFs, s.Fs);
  }
  // With recompute one set serves every layer: the largest of each dimension.
  worst_shape.moe = true;
  worst_shape.E = maxE;
  worst_shape.Kx = maxK;
  worst_shape.Fe = maxFe;
  worst_shape.Fs = maxFs;
  worst = layer_sizes(worst_shape);
  Sizes total;
  if (save_all) {
    for (const LayerShape& s : shapes)
      if (s.moe) {
        const Sizes z = layer_sizes(s);
        total.f += z.f;
        total.d += z.d;
        total.i += z.i;
      }
  } else {
    total = worst;
  }
  // Scratch.
  const int64_t NK = N * maxK;
  total.f += N * maxE + NK + NK * C + NK * maxFe + NK * 2 * maxFe + 2 * N * maxE + N;
  total.f += N * C + N * maxFs + N * 2 * maxFs + 2 * N;
  total.i += 2 * N;
  if (r64) total.d += N * maxE + NK + N * C + maxE * C + maxE + NK + 2 * N * maxE + N;

  moe_f = Buffer<float>(*alloc, size_t(total.f));
  if (total.d > 0) moe_d = Buffer<double>(*alloc, size_t(total.d));
  moe_i = Buffer<int32_t>(*alloc, size_t(total.i));
  float* fp = moe_f.data();
  double* dp = moe_d.data();
  int32_t* ip = moe_i.data();
  auto tf = [&](int64_t n) { float* p = fp; fp += n; return p; };
  auto td = [&](int64_t n) { double* p = dp; dp += n; return p; };
  auto ti = [&](int64_t n) { int32_t* p = ip; ip += n; return p; };
  auto carve = [&](const LayerShape& s) {
    MoeActs m;
    const int64_t nk = N * s.Kx;
    if (r64) {
      m.probs64 = td(N * s.E);
      m.lse64 = td(N);
    } else {
      m.probs = tf(N * s.E);
      m.lse = tf(N);
    }
    m.w = tf(nk);
    m.xp = tf(nk * C);
    m.gu = tf(nk * 2 * s.Fe);
    m.a = tf(nk * s.Fe);
    m.yp = tf(nk * C);
    if (s.Fs > 0) {
      m.sgu = tf(N * 2 * s.Fs);
      m.sa = tf(N * s.Fs);
      m.sy = tf(N * C);
      m.sgl = tf(N);
      m.sgw = tf(N);
    }
    m.experts = ti(nk);
    m.row = ti(nk);
    m.offsets = ti(s.E + 1);
    return m;
  };
  if (save_all) {
    moe_acts.assign(size_t(L), MoeActs{});
    for (int64_t l = 0; l < L; ++l)
      if (shapes[size_t(l)].moe) moe_acts[size_t(l)] = carve(shapes[size_t(l)]);
  } else {
    moe_acts.push_back(carve(worst_shape));
  }
  MoeScratch& x = moe_scratch;
  x.logits = tf(N * maxE);
  x.dw = tf(NK);
  x.dyp = tf(NK * C);
  x.da = tf(NK * maxFe);
  x.dgu = tf(NK * 2 * maxFe);
  x.dlogits = tf(N * maxE);
  x.dprobs = tf(N * maxE);
  x.dlse = tf(N);
  x.dsy = tf(N * C);
  x.dsa = tf(N * maxFs);
  x.dsgu = tf(N * 2 * maxFs);
  x.dsgw = tf(N);
  x.dsgl = tf(N);
  x.srow = ti(N);
  x.szero = ti(N);
  for (int64_t n = 0; n < N; ++n) {
    x.srow[n] = int32_t(n);
    x.szero[n] = 0;
  }
  if (r64) {
    x.logits64 = td(N * maxE);
    x.w64 = td(NK);
    x.x64 = td(N * C);
    x.wr64 = td(maxE * C);
    x.b64 = td(maxE);
    x.dw64 = td(NK);
    x.dlogits64 = td(N * maxE);
    x.dprobs64 = td(N * maxE);
    x.dlse64 = td(N);
  }
  if (fp != moe_f.data() + total.f || dp != moe_d.data() + total.d || ip != moe_i.data() + total.i)
    throw std::logic_error("engine: MoE activation plan mismatch");
  moe_saved_all = save_all;
}

// ---------------------------------------------------------------------------------------------
// Routing record and replay

void Engine::Impl::prepare_routing(const MicroBatch& mb, const OutputRequest& req) {
  const int64_t N = mb.num_tokens();
  route_record.clear();
  // Under expert parallelism with tensor parallelism each rank records its block of rows and
  // whole_route_record gathers them; a pipeline stage's record is its own rows' (forward_stage).
  if (moe_own_rows && pp_on && req.routed_experts)
    throw std::invalid_argument("engine: the routing record of a pipeline stage under expert parallelism with tensor "
                                "parallelism is not implemented");
  if (req.routed_experts) route_record.assign(size_t(N * route_width), -1);
  // Under PP the field is the whole model's record; each layer reads its columns (replay_col).
  replay_width = pp_on ? opt.pp->route_total : route_width;
  // Under context (or sequence) parallelism the field is the whole micro-batch's, read through
  // cpp.token.
  replay = replay_routing_tensor(cp_on || sp_on ? *cpp.whole : mb, req.replay_routing_field, replay_width, "engine");
}

const rlh_tensor* replay_routing_tensor(const MicroBatch& mb, const std::string& field, int64_t route_width,
                                        const std::string& who) {
  if (field.empty()) return nullptr;
  const int64_t N = mb.num_tokens();
  const rlh_tensor* f = mb.field(field);
  const std::string name = who + ": routing replay field '" + field + "'";
  if (!f) throw std::invalid_argument(name + " is not in the micro-batch");
  if (route_width == 0) throw std::invalid_argument(name + ": the model has no MoE layer");
  int64_t width = 1;
  for (int i = 1; i < f->ndim; ++i) width *= f->shape[i];
  if (f->ndim < 2 || f->ndim > 3 || f->shape[0] != N || width != route_width ||
      f->dtype.code != RLH_DTYPE_INT || (f->dtype.bits != 32 && f->dtype.bits != 64))
    throw std::invalid_argument(name + " must be int32/int64 [num_tokens, " +
                                std::to_string(route_width) + "] (or [num_tokens, moe layers, top_k])");
  int64_t inner = 1;  // contiguous rows
  for (int i = f->ndim - 1; i >= 1; --i) {
    if (f->shape[i] > 1 && f->strides[i] != inner) throw std::invalid_argument(name + " must be contiguous");
    inner *= f->shape[i];
  }
  if (N > 1 && f->strides[0] != route_width) throw std::invalid_argument(name + " must be contiguous");
  return f;
}

int32_t replayed_expert(const rlh_tensor& f, int64_t at, int64_t E, const std::string& who) {
  const char* base = static_cast<const char*>(f.data) + f.byte_offset;
  const int64_t e = f.dtype.bits == 32 ? reinterpret_cast<const int32_t*>(base)[at]
                                       : reinterpret_cast<const int64_t*>(base)[at];
  if (e < 0 || e >= E)
    throw std::invalid_argument(who + ": replayed expert " + std::to_string(e) + " outside the " +
                                std::to_string(E) + " experts of a layer");
  return int32_t(e);
}

// ---------------------------------------------------------------------------------------------
// Auxiliary losses: values (forward of a train step) and d/dprobs, d/dlse (backward).

template <class T>
void Engine::Impl::moe_losses(int64_t l, const MicroBatch& mb, const MoeActs& m, const T* probs,
                              const T* lse, T* dprobs, T* dlse, bool grads) {
  const LayerShape& s = shapes[size_t(l)];
  // This block's rows [r0, r0 + N) of the micro-batch (all of them but under moe_own_rows).
  const int64_t r0 = moe_r0, N = moe_n, E = s.E, K = s.Kx, S = mb.num_sequences();
  const MoeOptions& o = opt.moe;
  const double Tg = moe_tokens, Sg = moe_seqs;
  const bool per_seq = o.load_balancing == MoeOptions::LoadBalancing::seq_aux_loss;
  // Context parallelism: mb is this rank's zigzag share of the micro-batch. Its padding rows are
  // routed but neither counted nor given a gradient; the counts are the whole micro-batch's
  // (summed over the group in the forward, kept for the backward), and N, T_s the whole
  // micro-batch's and sequence's tokens. So every rank's gradients are its tokens' share of one
  // rank's, and the values (partial sums over its tokens) add up to one rank's.
  // Sequence parallelism pads each sequence likewise (cp_prepare at cp 1), every rank routing
  // every row alike: the same masks, no sum.
  const bool split = cp_on || sp_on;
  const int32_t* token = split ? cpp.token.data() : nullptr;
  auto real = [&](int64_t n) { return token == nullptr || token[r0 + n] >= 0; };  // n: a row of the block
  // A sequence's rows of the block.
  auto first_row = [&](int64_t q) { return std::max<int64_t>(mb.cu_seqlens[size_t(q)], r0) - r0; };
  auto end_row = [&](int64_t q) { return std::min<int64_t>(mb.cu_seqlens[size_t(q) + 1], r0 + N) - r0; };
  const double Nmb = split ? double(cpp.whole_n()) : double(N);
  auto seq_tokens = [&](int64_t q) {
    return split ? cpp.seq_len[size_t(q)] : int64_t(mb.cu_seqlens[size_t(q) + 1] - mb.cu_seqlens[size_t(q)]);
  };
  // c [E], or [S, E] per sequence: the (token, choice) pairs sent to each expert.
  std::vector<double>& c = moe_counts[size_t(l)];
  if (!(cp_on || moe_own_rows) || !grads) {
    c.assign(size_t(per_seq ? S * E : E), 0.0);
    for (int64_t q = 0; q < S; ++q)
      for (int64_t n = first_row(q); n < end_row(q); ++n)
        if (real(n))
          for (int64_t k = 0; k < K; ++k) c[size_t((per_seq ? q * E : 0) + m.experts[n * K + k])] += 1;
    if (cp_on) opt.cp_comm->all_reduce_sum(c.data(), int64_t(c.size()));
    if (moe_own_rows) opt.tp_comm->all_reduce_sum(c.data(), int64_t(c.size()));
  }
  if (dprobs) std::fill(dprobs, dprobs + N * E, T(0));
  if (o.aux_loss_coef != 0 && o.load_balancing == MoeOptions::LoadBalancing::aux_loss &&
      (!grads || dprobs)) {
    const double f = o.aux_loss_coef * double(E) / (double(K) * Nmb * Tg);
    double loss = 0;
    for (int64_t e = 0; e < E; ++e) {
      const double ce = c[size_t(e)];
      if (grads) {
        for (int64_t n = 0; n < N; ++n)
          if (real(n)) dprobs[n * E + e] = T(f * ce);
      } else {
        double P = 0;
        for (int64_t n = 0; n < N; ++n)
          if (real(n)) P += double(probs[n * E + e]);
        loss += f * ce * P;
      }
    }
    if (!grads) moe_aux += loss;
  }
  if (o.aux_loss_coef != 0 && per_seq && (!grads || dprobs)) {
    std::vector<double> P(static_cast<size_t>(E));
    double loss = 0;
    for (int64_t q = 0; q < S; ++q) {
      const int64_t b = first_row(q), e_ = end_row(q);
      if (seq_tokens(q) == 0) continue;
      const double Ts = double(seq_tokens(q));
      const double f = o.aux_loss_coef * double(E) / (double(K) * Ts * Ts * Sg);
      const double* cq = c.data() + q * E;
      std::fill(P.begin(), P.end(), 0.0);
      if (grads) {
        for (int64_t n = b; n < e_; ++n)
          if (real(n))
            for (int64_t e = 0; e < E; ++e) dprobs[n * E + e] = T(f * cq[e]);
      } else {
        for (int64_t n = b; n < e_; ++n)
          if (real(n))
            for (int64_t e = 0; e < E; ++e) P[size_t(e)] += double(probs[n * E + e]);
        for (int64_t e = 0; e < E; ++e) loss += f * cq[e] * P[size_t(e)];
      }
    }
    if (!grads) moe_aux += loss;
  }
  if (o.z_loss_coef != 0 && (!grads || dlse)) {
    if (grads) {
      for (int64_t n = 0; n < N; ++n) dlse[n] = real(n) ? T(2 * o.z_loss_coef / Tg * double(lse[n])) : T(0);
    } else {
      double z = 0;
      for (int64_t n = 0; n < N; ++n)
        if (real(n)) z += double(lse[n]) * double(lse[n]);
      moe_z += o.z_loss_coef / Tg * z;
    }
  }
  if (!grads) {  // the busiest expert's share of this layer's routed tokens
    double mx = 0;
    for (int64_t e = 0; e < E; ++e) {
      double ce = 0;
      for (int64_t q = 0; q < (per_seq ? S : 1); ++q) ce += c[size_t(q * E + e)];
      mx = std::max(mx, ce);
    }
    moe_max_load = std::max(moe_max_load, mx / (Nmb * double(K)));
  }
}

// ---------------------------------------------------------------------------------------------
// Forward: out = the block of xn (the program's add puts it on the residual stream). recompute:
// inside the backward; everything the backward reads is rebuilt, the combine is skipped (and no
// routing is recorded or loss counted twice).

void Engine::Impl::forward_moe(int64_t l, const MicroBatch& mb, const float* xn, float* out, bool recompute) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerParams& p = P[size_t(l)];
  MoeActs& m = moe_of(l);
  MoeScratch& x = moe_scratch;
  // N: the rows routed here (this rank's block under moe_own_rows), Nall: the micro-batch's rows
  // (a shared expert's), xr: the routed rows of xn.
  const int64_t Nall = mb.num_tokens(), r0 = moe_own_rows ? sp_begin : 0, N = moe_own_rows ? sp_rows : Nall;
  const int64_t E = s.E, K = s.Kx, Fe = s.Fe, Fs = s.Fs, NK = N * K;
  const float* xr = xn + r0 * C;
  moe_r0 = r0;
  moe_n = N;
  Ops::RouterAttrs ra = s.router;

  if (replay) {  // this layer's columns of the [N, R] field
    ra.replay = true;
    const std::string who = "engine: layer " + std::to_string(l);  // messages name the layer
    for (int64_t n = 0; n < N; ++n) {
      const int64_t t = cp_on || sp_on ? cpp.token[size_t(r0 + n)] : n;  // the row's token in the field
      for (int64_t k = 0; k < K; ++k)  // a padding row (t < 0) takes experts 0..K-1: its output is never read
        m.experts[n * K + k] =
            t < 0 ? int32_t(k % E) : replayed_expert(*replay, t * replay_width + s.replay_col + k, E, who);
    }
  }

  // Router: logits, scores, choice, weights.
  if (!router64) {
    ops->gemm(false, true, N, E, C, 1.f, xr, C, p.router, C, 0.f, x.logits, E);        // z [N,E]
    if (p.router_b) ops->bias_add_fwd(x.logits, E, p.router_b, N, E);
    ops->moe_router_fwd(m.w, m.experts, m.probs, m.lse, x.logits, E, p.score_bias, N, E, K, ra);
  } else {
    to_double(x.x64, xr, N * C);
    to_double(x.wr64, p.router, E * C);
    ops->gemm_f64(false, true, N, E, C, 1.0, x.x64, C, x.wr64, C, 0.0, x.logits64, E);  // z [N,E]
    if (p.router_b)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t e = 0; e < E; ++e) x.logits64[n * E + e] += double(p.router_b[e]);
    if (p.score_bias) to_double(x.b64, p.score_bias, E);
    ops->moe_router_fwd_f64(x.w64, m.experts, m.probs64, m.lse64, x.logits64, E,
                            p.score_bias ? x.b64 : nullptr, N, E, K, ra);
    for (int64_t i = 0; i < NK; ++i) m.w[i] = float(x.w64[i]);
  }
  if (!recompute && !route_record.empty())
    for (int64_t n = 0; n < N; ++n)
      std::memcpy(route_record.data() + (r0 + n) * route_width + s.route_col, m.experts + n * K,
                  size_t(K) * sizeof(int32_t));

  // Routed experts on expert-sorted rows.
  ops->moe_permute_fwd(m.xp, m.row, m.offsets, xr, C, m.experts, N, K, C, E);        // xp [NK,C]
  if (ep_on) {
    ep_forward(l, m.offsets, m.xp, m.yp);  // to the experts' ranks and back (ep_dispatch.cpp)
  } else {
    ops->grouped_gemm(false, true, E, m.offsets, 0, Fe, C, 1.f, m.xp, C, p.we_gate, C, Fe * C, 0.f,
                      m.gu, 2 * Fe, 0);                                                 // gate [NK,Fe]
    ops->grouped_gemm(false, true, E, m.offsets, 0, Fe, C, 1.f, m.xp, C, p.we_up, C, Fe * C, 0.f,
                      m.gu + Fe, 2 * Fe, 0);                                            // up [NK,Fe]
    glu_fwd(s.act, m.a, Fe, m.gu, 2 * Fe, NK, Fe);                                     // a [NK,Fe]
    ops->grouped_gemm(false, true, E, m.offsets, 0, C, Fe, 1.f, m.a, Fe, p.we_down, Fe, C * Fe, 0.f,
                      m.yp, C, 0);                                                      // yp [NK,C]
  }

  // Shared expert (a dense SwiGLU MLP on every token), with its sigmoid gate.
  if (Fs > 0) {  // (every row: Nall)
    ops->gemm(false, true, Nall, 2 * Fs, C, 1.f, xn, C, p.ws_gu, C, 0.f, m.sgu, 2 * Fs);  // [N,2Fs]
    glu_fwd(s.act, m.sa, Fs, m.sgu, 2 * Fs, Nall, Fs);                                   // [N,Fs]
    ops->gemm(false, true, Nall, C, Fs, 1.f, m.sa, Fs, p.ws_down, Fs, 0.f, m.sy, C);       // sy [N,C]
    if (p.ws_gate) {
      ops->gemm(false, true, Nall, 1, C, 1.f, xn, C, p.ws_gate, C, 0.f, m.sgl, 1);        // [N,1]
      Ops::RouterAttrs g;
      g.scoring = 1;  // sigmoid, one expert, one choice: weight = sigmoid(logit)
      // (its probs, equal to the weights here, land in the dsgw scratch: unused)
      ops->moe_router_fwd(m.sgw, x.szero, x.dsgw, nullptr, m.sgl, 1, nullptr, Nall, 1, 1, g);
    }
  }

  if (moe_train && !recompute) {
    if (!router64) moe_losses<float>(l, mb, m, m.probs, m.lse, nullptr, nullptr, false);
    else moe_losses<double>(l, mb, m, m.probs64, m.lse64, nullptr, nullptr, false);
  }
  if (recompute) return;
  if (moe_own_rows) {
    // This rank's rows: the shared expert's partial sums over the group reduce-scattered into
    // them, then the routed experts' combine (whole: the experts are whole on their ep rank, or
    // their etp group's partial outputs were summed in ep_forward).
    if (Fs > 0) {
      if (p.ws_gate) ops->moe_unpermute_fwd(out, C, m.sy, x.srow, m.sgw, Nall, 1, C, false);
      else std::memcpy(out, m.sy, size_t(Nall * C) * sizeof(float));
      sp_scatter(out, C);
    }
    ops->moe_unpermute_fwd(out + r0 * C, C, m.yp, m.row, m.w, N, K, C, Fs > 0);
    return;
  }
  ops->moe_unpermute_fwd(out, C, m.yp, m.row, m.w, N, K, C, false);                   // out [N,C]
  if (Fs > 0) {
    if (p.ws_gate) ops->moe_unpermute_fwd(out, C, m.sy, x.srow, m.sgw, N, 1, C, true);
    else ops->add_fwd(out, out, m.sy, N * C);
  }
  // Tensor parallelism: each rank's experts (and shared expert) hold 1/T of their width, so out
  // is a partial sum, reduced once after the combine (the routing weights are the same on every
  // rank: the router and its input are whole).
  // Sequence parallelism: this rank's rows of the sum (the residual stream's block).
  if (tp_on) {
    if (sp_on)
      sp_scatter(out, C);
    else
      tp_reduce(out, N * C);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: dout = d loss / d out in, dxn = d loss / d xn out (added to it with accumulate).

void Engine::Impl::backward_moe(int64_t l, const MicroBatch& mb, const float* xn, const float* dout, float* dxn,
                                bool accumulate) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerParams& p = P[size_t(l)];
  const LayerParams& gp = G[size_t(l)];
  MoeActs& m = moe_of(l);
  MoeScratch& x = moe_scratch;
  // As in forward_moe: N routed rows from r0 (dr, dxr, xr their rows of dout, dxn, xn), Nall
  // every row.
  const int64_t Nall = mb.num_tokens(), r0 = moe_own_rows ? sp_begin : 0, N = moe_own_rows ? sp_rows : Nall;
  const int64_t E = s.E, K = s.Kx, Fe = s.Fe, Fs = s.Fs, NK = N * K;
  const bool frozen = opt.moe.freeze_router;
  const int32_t* off = m.offsets;
  const float* xr = xn + r0 * C;
  float* dxr = dxn + r0 * C;
  moe_r0 = r0;
  moe_n = N;

  // The shared expert's MLP: d input into dxn, its weight gradients (every row).
  auto shared_mlp_bwd = [&](const float* dsy) {
    ops->gemm(false, false, Nall, Fs, C, 1.f, dsy, C, p.ws_down, Fs, 0.f, x.dsa, Fs);      // dsa
    ops->gemm(true, false, C, Fs, Nall, 1.f, dsy, C, m.sa, Fs, 1.f, gp.ws_down, Fs);       // dW_down
    glu_bwd(s.act, x.dsgu, 2 * Fs, x.dsa, Fs, m.sgu, 2 * Fs, Nall, Fs);                  // dsgu
    ops->gemm(false, false, Nall, C, 2 * Fs, 1.f, x.dsgu, 2 * Fs, p.ws_gu, C, 1.f, dxn, C);  // dxn +=
    ops->gemm(true, false, 2 * Fs, C, Nall, 1.f, x.dsgu, 2 * Fs, xn, C, 1.f, gp.ws_gu, C);     // dW_gu
  };
  if (moe_own_rows && Fs > 0) {
    // The shared expert first, on every row (d out gathered): its part of d xn is a partial sum
    // over the group, reduce-scattered into this rank's rows, to which the routed part adds.
    if (accumulate) throw std::logic_error("engine: an MoE block's input gradient is shared");
    std::memset(dxn, 0, size_t(Nall * C) * sizeof(float));
    if (p.ws_gate) ops->moe_unpermute_bwd(x.dsy, x.dsgw, dout, C, m.sy, x.srow, m.sgw, Nall, 1, C);
    shared_mlp_bwd(p.ws_gate ? x.dsy : dout);
    sp_scatter(dxn, C);
    if (p.ws_gate) tp_reduce(x.dsgw, Nall);
  }

  // Combine: dyp = w dres (scattered to the rows), dw = <dres, yp>.
  ops->moe_unpermute_bwd(x.dyp, x.dw, dout + r0 * C, C, m.yp, m.row, m.w, N, K, C);
  float* dxp = x.dyp;
  if (ep_on) {
    ep_backward(l, x.dyp, dxp);  // the experts' ranks compute d xp (ep_dispatch.cpp)
  } else {
    // Experts: down, activation, gate|up, each with its weight gradient.
    ops->grouped_gemm(false, false, E, off, 0, Fe, C, 1.f, x.dyp, C, p.we_down, Fe, C * Fe, 0.f,
                      x.da, Fe, 0);                                                     // da [NK,Fe]
    ops->grouped_gemm(true, false, E, off, C, Fe, 0, 1.f, x.dyp, C, m.a, Fe, 0, 1.f, gp.we_down, Fe,
                      C * Fe);                                                          // dW_down
    glu_bwd(s.act, x.dgu, 2 * Fe, x.da, Fe, m.gu, 2 * Fe, NK, Fe);                      // dgu [NK,2Fe]
    ops->grouped_gemm(true, false, E, off, Fe, C, 0, 1.f, x.dgu, 2 * Fe, m.xp, C, 0, 1.f, gp.we_gate,
                      C, Fe * C);                                                       // dW_gate
    ops->grouped_gemm(true, false, E, off, Fe, C, 0, 1.f, x.dgu + Fe, 2 * Fe, m.xp, C, 0, 1.f,
                      gp.we_up, C, Fe * C);                                             // dW_up
    // dyp is spent: dxp takes its storage
    ops->grouped_gemm(false, false, E, off, 0, C, Fe, 1.f, x.dgu, 2 * Fe, p.we_gate, C, Fe * C, 0.f,
                      dxp, C, 0);                                                       // dxp [NK,C]
    ops->grouped_gemm(false, false, E, off, 0, C, Fe, 1.f, x.dgu + Fe, 2 * Fe, p.we_up, C, Fe * C,
                      1.f, dxp, C, 0);
  }
  ops->moe_permute_bwd(dxr, C, dxp, m.row, N, K, C, accumulate || (moe_own_rows && Fs > 0));  // dxn [N,C]

  // Tensor parallelism: the experts' and the shared expert's parts of dxn are partial sums (their
  // gate|up are column-parallel), and so are the routing weights' gradients dw = <dout, yp> and
  // the shared gate's (yp and sy are partial): all three are summed over the group here, before
  // the router and the shared gate, which every rank holds whole, add their parts once.
  if (tp_on && !moe_own_rows) {
    if (Fs > 0) {
      if (p.ws_gate) ops->moe_unpermute_bwd(x.dsy, x.dsgw, dout, C, m.sy, x.srow, m.sgw, N, 1, C);
      shared_mlp_bwd(p.ws_gate ? x.dsy : dout);
    }
    // Sequence parallelism: this rank's rows of d xn (the router's part, whole on every rank, is
    // added to every row below; the next step reads this rank's rows only).
    if (sp_on)
      sp_scatter(dxn, C);
    else
      tp_reduce(dxn, N * C);
    tp_reduce(x.dw, NK);
    if (Fs > 0 && p.ws_gate) tp_reduce(x.dsgw, N);
  }

  // Router: d logits from the weights (and the auxiliary losses), then into xn (always) and
  // into the router weight (unless frozen).
  if (!router64) {
    const bool aux = moe_train && (opt.moe.aux_loss_coef != 0 &&
                                   opt.moe.load_balancing != MoeOptions::LoadBalancing::none);
    const bool zl = moe_train && opt.moe.z_loss_coef != 0;
    moe_losses<float>(l, mb, m, m.probs, m.lse, aux ? x.dprobs : nullptr, zl ? x.dlse : nullptr, true);
    ops->moe_router_bwd(x.dlogits, x.dw, m.probs, m.experts, aux ? x.dprobs : nullptr,
                        zl ? x.dlse : nullptr, N, E, K, s.router);                    // dz [N,E]
    if (!frozen) {
      ops->gemm(true, false, E, C, N, 1.f, x.dlogits, E, xr, C, 1.f, gp.router, C);   // dW_router
      if (gp.router_b) ops->bias_bwd(gp.router_b, x.dlogits, E, N, E);
    }
    ops->gemm(false, false, N, C, E, 1.f, x.dlogits, E, p.router, C, 1.f, dxr, C);  // dxn += dz Wr
  } else {
    const bool aux = moe_train && (opt.moe.aux_loss_coef != 0 &&
                                   opt.moe.load_balancing != MoeOptions::LoadBalancing::none);
    const bool zl = moe_train && opt.moe.z_loss_coef != 0;
    moe_losses<double>(l, mb, m, m.probs64, m.lse64, aux ? x.dprobs64 : nullptr,
                       zl ? x.dlse64 : nullptr, true);
    to_double(x.dw64, x.dw, NK);
    ops->moe_router_bwd_f64(x.dlogits64, x.dw64, m.probs64, m.experts, aux ? x.dprobs64 : nullptr,
                            zl ? x.dlse64 : nullptr, N, E, K, s.router);              // dz [N,E]
    to_double(x.wr64, p.router, E * C);
    ops->gemm_f64(false, false, N, C, E, 1.0, x.dlogits64, E, x.wr64, C, 0.0, x.x64, C);  // dz Wr
    for (int64_t i = 0; i < N * C; ++i) dxr[i] += float(x.x64[i]);
    if (!frozen) {
      to_double(x.x64, xr, N * C);
      ops->gemm_f64(true, false, E, C, N, 1.0, x.dlogits64, E, x.x64, C, 0.0, x.wr64, C);
      for (int64_t i = 0; i < E * C; ++i) gp.router[i] += float(x.wr64[i]);      // dW_router
      if (gp.router_b)
        for (int64_t e = 0; e < E; ++e) {
          double acc = 0;
          for (int64_t n = 0; n < N; ++n) acc += x.dlogits64[n * E + e];
          gp.router_b[e] += float(acc);
        }
    }
  }

  // Shared expert and its gate (every row; under moe_own_rows the gate's part of d xn, whole,
  // goes to this rank's rows only).
  if (Fs > 0) {
    const float* dsy = dout;
    if (p.ws_gate) {
      if (!tp_on) ops->moe_unpermute_bwd(x.dsy, x.dsgw, dout, C, m.sy, x.srow, m.sgw, Nall, 1, C);  // dsy, dgate
      Ops::RouterAttrs ga;
      ga.scoring = 1;
      ops->moe_router_bwd(x.dsgl, x.dsgw, m.sgw, x.szero, nullptr, nullptr, Nall, 1, 1, ga);  // [N,1]
      ops->gemm(true, false, 1, C, Nall, 1.f, x.dsgl, 1, xn, C, 1.f, gp.ws_gate, C);       // dW_gate
      ops->gemm(false, false, N, C, 1, 1.f, x.dsgl + r0, 1, p.ws_gate, C, 1.f, dxr, C);    // dxn +=
      dsy = x.dsy;
    }
    if (!tp_on) shared_mlp_bwd(dsy);
  }
}

template void Engine::Impl::moe_losses<float>(int64_t, const MicroBatch&, const MoeActs&,
                                              const float*, const float*, float*, float*, bool);
template void Engine::Impl::moe_losses<double>(int64_t, const MicroBatch&, const MoeActs&,
                                               const double*, const double*, double*, double*,
                                               bool);

}  // namespace rlh::engine
