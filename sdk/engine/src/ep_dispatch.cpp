// Expert parallelism in the CPU engine (EngineOptions::ep, sdk/expert_parallel.hpp): the
// all-to-all dispatch and combine of an MoE layer's routed rows, and the experts this rank owns.
//
// moe.cpp routes every token locally (the router is replicated) and permutes the (token,
// choice) rows by global expert, so the rows for rank j's experts [j El, (j+1) El) are one
// contiguous block. Per layer and micro-batch:
//
//   forward   counts: all_to_all of rows per (rank, local expert)     E int64 per rank
//             dispatch: all_to_all_v of the rows                      [rows, C] out, [R, C] in
//             this rank's El experts over the R rows it received (expert-major, like one rank)
//             combine: all_to_all_v of the outputs back               [R, C] out, [rows, C] in
//   backward  the same two exchanges for d outputs and d inputs; the expert weight gradients
//             stay here (the owner reduces them over the expert data-parallel group).
//
// Dropless: no capacity, every row is sent. The arithmetic on each row is the one-rank engine's
// (the same grouped GEMMs on the same rows of each expert, only in another order of rows), so
// results agree with one rank to fp32 rounding of the weight-gradient sums.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "model.hpp"

namespace rlh::engine {

namespace {

// Rows of source-major storage -> expert-major (out[i] = in[perm[i]]) and back.
void gather_rows(float* out, const float* in, const std::vector<int32_t>& perm, int64_t C) {
  for (size_t i = 0; i < perm.size(); ++i)
    std::memcpy(out + int64_t(i) * C, in + int64_t(perm[i]) * C, size_t(C) * sizeof(float));
}
void scatter_rows(float* out, const float* in, const std::vector<int32_t>& perm, int64_t C) {
  for (size_t i = 0; i < perm.size(); ++i)
    std::memcpy(out + int64_t(perm[i]) * C, in + int64_t(i) * C, size_t(C) * sizeof(float));
}

template <class T>
void grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// Scratch for a layer's exchanges (R rows of C received) and the floats each rank sends and
// receives: the dispatch's pattern (the combine's is the reverse).
void prepare_exchange(EpScratch& sc, const EpActs& e, int64_t C) {
  grow(sc.rows, size_t(e.R * C));
  grow(sc.out, size_t(e.R * C));
  const size_t P = e.send_rows.size();
  sc.counts_out.assign(P, 0);
  sc.counts_in.assign(P, 0);
  for (size_t j = 0; j < P; ++j) {
    sc.counts_out[j] = e.send_rows[j] * C;
    sc.counts_in[j] = e.recv_rows[j] * C;
  }
}

}  // namespace

void Engine::Impl::ep_forward(int64_t l, const int32_t* offsets, const float* xp, float* yp) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerParams& p = P[size_t(l)];
  EpActs& e = ep_of(l);
  const int64_t E = s.E, Pn = ep_size, El = E / Pn, Fe = s.Fe;
  // Counts: rows this rank sends to each (rank, local expert), and receives.
  e.send_cnt.assign(size_t(E), 0);
  e.recv_cnt.assign(size_t(E), 0);
  for (int64_t x = 0; x < E; ++x) e.send_cnt[size_t(x)] = offsets[x + 1] - offsets[x];
  opt.ep_comm->all_to_all(e.send_cnt.data(), e.recv_cnt.data(), El);
  e.send_rows.assign(size_t(Pn), 0);
  e.recv_rows.assign(size_t(Pn), 0);
  for (int64_t j = 0; j < Pn; ++j)
    for (int64_t x = 0; x < El; ++x) {
      e.send_rows[size_t(j)] += e.send_cnt[size_t(j * El + x)];
      e.recv_rows[size_t(j)] += e.recv_cnt[size_t(j * El + x)];
    }
  int64_t R = 0;
  for (int64_t j = 0; j < Pn; ++j) R += e.recv_rows[size_t(j)];
  e.R = R;
  // Expert-major order of the received rows: local expert x's rows from rank 0, 1, ...
  std::vector<int64_t> src_at(size_t(Pn) + 1, 0);  // first source-major row of each rank
  for (int64_t j = 0; j < Pn; ++j) src_at[size_t(j) + 1] = src_at[size_t(j)] + e.recv_rows[size_t(j)];
  e.perm.resize(size_t(R));
  e.loff.assign(size_t(El) + 1, 0);
  int64_t at = 0;
  for (int64_t x = 0; x < El; ++x) {
    for (int64_t j = 0; j < Pn; ++j) {
      int64_t first = src_at[size_t(j)];
      for (int64_t y = 0; y < x; ++y) first += e.recv_cnt[size_t(j * El + y)];
      for (int64_t k = 0; k < e.recv_cnt[size_t(j * El + x)]; ++k) e.perm[size_t(at++)] = int32_t(first + k);
    }
    e.loff[size_t(x) + 1] = int32_t(at);
  }
  // Dispatch.
  EpScratch& sc = ep_scratch;
  prepare_exchange(sc, e, C);
  opt.ep_comm->all_to_all_v(xp, sc.counts_out, sc.rows.data(), sc.counts_in);
  // This rank's experts, as one rank runs them (moe.cpp), over El groups of expert-major rows.
  e.xe.resize(size_t(R * C));
  e.gu.resize(size_t(R * 2 * Fe));
  e.a.resize(size_t(R * Fe));
  gather_rows(e.xe.data(), sc.rows.data(), e.perm, C);
  float* ye = sc.out.data();
  if (R > 0) {
    const int32_t* off = e.loff.data();
    ops->grouped_gemm(false, true, El, off, 0, Fe, C, 1.f, e.xe.data(), C, p.we_gate, C, Fe * C, 0.f, e.gu.data(),
                      2 * Fe, 0);                                                     // gate [R,Fe]
    ops->grouped_gemm(false, true, El, off, 0, Fe, C, 1.f, e.xe.data(), C, p.we_up, C, Fe * C, 0.f,
                      e.gu.data() + Fe, 2 * Fe, 0);                                   // up [R,Fe]
    glu_fwd(s.act, e.a.data(), Fe, e.gu.data(), 2 * Fe, R, Fe);                       // a [R,Fe]
    ops->grouped_gemm(false, true, El, off, 0, C, Fe, 1.f, e.a.data(), Fe, p.we_down, Fe, C * Fe, 0.f, ye, C,
                      0);                                                             // ye [R,C]
  }
  // Combine: the outputs back to the rows' ranks, into this rank's expert-sorted order.
  scatter_rows(sc.rows.data(), ye, e.perm, C);
  opt.ep_comm->all_to_all_v(sc.rows.data(), sc.counts_in, yp, sc.counts_out);
}

void Engine::Impl::ep_backward(int64_t l, const float* dyp, float* dxp) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerParams& p = P[size_t(l)];
  const LayerParams& gp = G[size_t(l)];
  EpActs& e = ep_of(l);
  const int64_t El = s.E / ep_size, Fe = s.Fe, R = e.R;
  EpScratch& sc = ep_scratch;
  prepare_exchange(sc, e, C);
  // d outputs to the experts' ranks (the dispatch's pattern).
  opt.ep_comm->all_to_all_v(dyp, sc.counts_out, sc.rows.data(), sc.counts_in);
  float* dye = sc.out.data();
  gather_rows(dye, sc.rows.data(), e.perm, C);
  if (R > 0) {
    const int32_t* off = e.loff.data();
    std::vector<float> da(size_t(R * Fe)), dgu(size_t(R * 2 * Fe));
    ops->grouped_gemm(false, false, El, off, 0, Fe, C, 1.f, dye, C, p.we_down, Fe, C * Fe, 0.f, da.data(), Fe,
                      0);                                                             // da [R,Fe]
    ops->grouped_gemm(true, false, El, off, C, Fe, 0, 1.f, dye, C, e.a.data(), Fe, 0, 1.f, gp.we_down, Fe,
                      C * Fe);                                                        // dW_down
    glu_bwd(s.act, dgu.data(), 2 * Fe, da.data(), Fe, e.gu.data(), 2 * Fe, R, Fe);    // dgu [R,2Fe]
    ops->grouped_gemm(true, false, El, off, Fe, C, 0, 1.f, dgu.data(), 2 * Fe, e.xe.data(), C, 0, 1.f, gp.we_gate,
                      C, Fe * C);                                                     // dW_gate
    ops->grouped_gemm(true, false, El, off, Fe, C, 0, 1.f, dgu.data() + Fe, 2 * Fe, e.xe.data(), C, 0, 1.f,
                      gp.we_up, C, Fe * C);                                           // dW_up
    ops->grouped_gemm(false, false, El, off, 0, C, Fe, 1.f, dgu.data(), 2 * Fe, p.we_gate, C, Fe * C, 0.f, dye, C,
                      0);                                                             // dxe [R,C]
    ops->grouped_gemm(false, false, El, off, 0, C, Fe, 1.f, dgu.data() + Fe, 2 * Fe, p.we_up, C, Fe * C, 1.f, dye,
                      C, 0);
  }
  // d inputs back to the rows' ranks (the combine's pattern).
  scatter_rows(sc.rows.data(), dye, e.perm, C);
  opt.ep_comm->all_to_all_v(sc.rows.data(), sc.counts_in, dxp, sc.counts_out);
}

void Engine::ep_idle_microbatch(bool train, int64_t chunk) {
  Impl& m = *impl_;
  if (!m.ep_on) return;
  // The layers a real call would run: a pipeline stage's model chunk (interleaved virtual
  // stages: the schedule runs one chunk a call, and a peer's exchanges are that chunk's), else
  // every layer this engine holds.
  int64_t lo = 0, hi = m.L;
  if (chunk >= 0) {
    if (!m.pp_on || chunk >= int64_t(m.opt.pp->chunks.size()))
      throw std::invalid_argument("engine: ep_idle_microbatch: model chunk " + std::to_string(chunk) + " of " +
                                  std::to_string(m.pp_on ? m.opt.pp->chunks.size() : 0));
    lo = m.opt.pp->chunks[size_t(chunk)].local_begin;
    hi = lo + m.opt.pp->chunks[size_t(chunk)].count;
  }
  // No rows of this rank's own: every expert of every rank gets zero rows from it.
  std::vector<int32_t> zero(size_t(1), 0);
  for (int64_t l = lo; l < hi; ++l) {
    const LayerShape& s = m.shapes[size_t(l)];
    if (!s.moe) continue;
    zero.assign(size_t(s.E) + 1, 0);
    m.ep_forward(l, zero.data(), nullptr, nullptr);
  }
  if (!train) return;
  for (int64_t l = hi - 1; l >= lo; --l) {
    const LayerShape& s = m.shapes[size_t(l)];
    if (!s.moe) continue;
    if (m.opt.recompute) {  // a train step re-runs each layer's forward inside its backward
      zero.assign(size_t(s.E) + 1, 0);
      m.ep_forward(l, zero.data(), nullptr, nullptr);
    }
    m.ep_backward(l, nullptr, nullptr);
  }
  m.grads_clear = false;
}

std::pair<int64_t, int64_t> Engine::expert_range() const { return {impl_->expert_begin, impl_->expert_end}; }

}  // namespace rlh::engine
