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
//
// Experts cut over an expert tensor-parallel group of Te ranks (Megatron-Core's
// expert_tensor_parallel_size between 1 and tp, with moe_own_rows; its all-to-all dispatcher
// does the same): the Te ranks hold the same experts' blocks (gate/up rows, down columns), and
// each received other rows from its ep peers. After the dispatch the group all-gathers those
// rows (and their counts), every rank runs its blocks over all of them (partial outputs, as a
// row-parallel down gives), and the outputs are reduce-scattered back, each rank keeping the sum
// for its own received rows; the backward all-gathers the d outputs and reduce-scatters the
// d inputs. The weight gradients of a block are whole on its rank (every row of the group).
//
//   forward   counts [E] all-gathered over etp                         E int64 to each peer
//             received rows all-gathered                               [R, C] to each peer
//             partial outputs reduce-scattered                         [R_t, C] to peer t
//   backward  d outputs all-gathered, d inputs reduce-scattered        the same rows
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

// Scratch for a layer's exchanges (R rows of C received, Rg run by the experts) and the floats
// each rank sends and receives: the dispatch's pattern (the combine's is the reverse).
void prepare_exchange(EpScratch& sc, const EpActs& e, int64_t C) {
  grow(sc.rows, size_t(e.R * C));
  grow(sc.out, size_t(e.Rg * C));
  if (e.etp_rows.size() > 1) grow(sc.gathered, size_t(e.Rg * C));
  const size_t P = e.send_rows.size();
  sc.counts_out.assign(P, 0);
  sc.counts_in.assign(P, 0);
  for (size_t j = 0; j < P; ++j) {
    sc.counts_out[j] = e.send_rows[j] * C;
    sc.counts_in[j] = e.recv_rows[j] * C;
  }
}

}  // namespace

void Engine::Impl::etp_all_gather(const EpActs& e, const float* mine, float* all) {
  // sdk::Comm's all_gather moves equal blocks; the ranks received different numbers of rows, so
  // this is all_to_all_v with this rank's block repeated for every peer.
  EpScratch& sc = ep_scratch;
  const int64_t T = etp_size, n = e.R * C;
  grow(sc.rep, size_t(T * n));
  for (int64_t t = 0; t < T && n > 0; ++t) std::memcpy(sc.rep.data() + t * n, mine, size_t(n) * sizeof(float));
  sc.etp_out.assign(size_t(T), n);
  sc.etp_in.resize(size_t(T));
  for (int64_t t = 0; t < T; ++t) sc.etp_in[size_t(t)] = e.etp_rows[size_t(t)] * C;
  opt.etp_comm->all_to_all_v(sc.rep.data(), sc.etp_out, all, sc.etp_in);
}

void Engine::Impl::etp_reduce_scatter(const EpActs& e, const float* all, float* mine) {
  // Block t of `all` (rank t's rows) to rank t; this rank's rows from every rank, summed in
  // group order.
  EpScratch& sc = ep_scratch;
  const int64_t T = etp_size, n = e.R * C;
  grow(sc.rep, size_t(T * n));
  sc.etp_out.resize(size_t(T));
  for (int64_t t = 0; t < T; ++t) sc.etp_out[size_t(t)] = e.etp_rows[size_t(t)] * C;
  sc.etp_in.assign(size_t(T), n);
  opt.etp_comm->all_to_all_v(all, sc.etp_out, sc.rep.data(), sc.etp_in);
  if (n == 0) return;
  std::memcpy(mine, sc.rep.data(), size_t(n) * sizeof(float));
  for (int64_t t = 1; t < T; ++t) ops->add_fwd(mine, mine, sc.rep.data() + t * n, n);
}

void Engine::Impl::ep_forward(int64_t l, const int32_t* offsets, const float* xp, float* yp) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerParams& p = P[size_t(l)];
  EpActs& e = ep_of(l);
  const int64_t E = s.E, Pn = ep_size, El = E / Pn, Fe = s.Fe, Te = etp_size;
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
  // The counts of every rank of the etp group (this rank's alone without one): cnt[t E + j El +
  // x] rows of local expert x that etp rank t received from ep rank j.
  std::vector<int64_t> cnt(size_t(Te * E));
  if (Te > 1) {
    std::vector<int64_t> rep(size_t(Te * E));
    for (int64_t t = 0; t < Te; ++t) std::copy(e.recv_cnt.begin(), e.recv_cnt.end(), rep.begin() + t * E);
    opt.etp_comm->all_to_all(rep.data(), cnt.data(), E);
  } else {
    cnt = e.recv_cnt;
  }
  e.etp_rows.assign(size_t(Te), 0);
  for (int64_t t = 0; t < Te; ++t)
    for (int64_t i = 0; i < E; ++i) e.etp_rows[size_t(t)] += cnt[size_t(t * E + i)];
  int64_t Rg = 0;
  for (int64_t t = 0; t < Te; ++t) Rg += e.etp_rows[size_t(t)];
  e.Rg = Rg;
  // Expert-major order of the rows the experts run on: local expert x's rows from etp rank 0's
  // sources 0, 1, ..., then etp rank 1's, ... (source-major: etp rank, then ep rank, then expert).
  std::vector<int64_t> src_at(size_t(Te * Pn) + 1, 0);  // first source-major row of each (t, j)
  for (int64_t tj = 0; tj < Te * Pn; ++tj) {
    int64_t n = 0;
    for (int64_t x = 0; x < El; ++x) n += cnt[size_t(tj * El + x)];
    src_at[size_t(tj) + 1] = src_at[size_t(tj)] + n;
  }
  e.perm.resize(size_t(Rg));
  e.loff.assign(size_t(El) + 1, 0);
  int64_t at = 0;
  for (int64_t x = 0; x < El; ++x) {
    for (int64_t tj = 0; tj < Te * Pn; ++tj) {
      int64_t first = src_at[size_t(tj)];
      for (int64_t y = 0; y < x; ++y) first += cnt[size_t(tj * El + y)];
      for (int64_t k = 0; k < cnt[size_t(tj * El + x)]; ++k) e.perm[size_t(at++)] = int32_t(first + k);
    }
    e.loff[size_t(x) + 1] = int32_t(at);
  }
  // Dispatch (and the etp group's rows gathered).
  EpScratch& sc = ep_scratch;
  prepare_exchange(sc, e, C);
  opt.ep_comm->all_to_all_v(xp, sc.counts_out, sc.rows.data(), sc.counts_in);
  float* src = Te > 1 ? sc.gathered.data() : sc.rows.data();  // [Rg, C] source-major
  if (Te > 1) etp_all_gather(e, sc.rows.data(), src);
  // This rank's experts (or their blocks), as one rank runs them (moe.cpp), over El groups of
  // expert-major rows.
  e.xe.resize(size_t(Rg * C));
  e.gu.resize(size_t(Rg * 2 * Fe));
  e.a.resize(size_t(Rg * Fe));
  gather_rows(e.xe.data(), src, e.perm, C);
  float* ye = sc.out.data();
  if (Rg > 0) {
    const int32_t* off = e.loff.data();
    ops->grouped_gemm(false, true, El, off, 0, Fe, C, 1.f, e.xe.data(), C, p.we_gate, C, Fe * C, 0.f, e.gu.data(),
                      2 * Fe, 0);                                                     // gate [Rg,Fe]
    ops->grouped_gemm(false, true, El, off, 0, Fe, C, 1.f, e.xe.data(), C, p.we_up, C, Fe * C, 0.f,
                      e.gu.data() + Fe, 2 * Fe, 0);                                   // up [Rg,Fe]
    glu_fwd(s.act, e.a.data(), Fe, e.gu.data(), 2 * Fe, Rg, Fe);                      // a [Rg,Fe]
    ops->grouped_gemm(false, true, El, off, 0, C, Fe, 1.f, e.a.data(), Fe, p.we_down, Fe, C * Fe, 0.f, ye, C,
                      0);                                                             // ye [Rg,C]
  }
  // Combine: under etp the partial outputs summed into this rank's rows first; then the outputs
  // back to the rows' ranks, into this rank's expert-sorted order.
  scatter_rows(src, ye, e.perm, C);
  if (Te > 1) etp_reduce_scatter(e, src, sc.rows.data());
  opt.ep_comm->all_to_all_v(sc.rows.data(), sc.counts_in, yp, sc.counts_out);
}

void Engine::Impl::ep_backward(int64_t l, const float* dyp, float* dxp) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerParams& p = P[size_t(l)];
  const LayerParams& gp = G[size_t(l)];
  EpActs& e = ep_of(l);
  const int64_t El = s.E / ep_size, Fe = s.Fe, Rg = e.Rg, Te = etp_size;
  EpScratch& sc = ep_scratch;
  prepare_exchange(sc, e, C);
  // d outputs to the experts' ranks (the dispatch's pattern), under etp to the whole group.
  opt.ep_comm->all_to_all_v(dyp, sc.counts_out, sc.rows.data(), sc.counts_in);
  float* src = Te > 1 ? sc.gathered.data() : sc.rows.data();  // [Rg, C] source-major
  if (Te > 1) etp_all_gather(e, sc.rows.data(), src);
  float* dye = sc.out.data();
  gather_rows(dye, src, e.perm, C);
  if (Rg > 0) {
    const int32_t* off = e.loff.data();
    std::vector<float> da(size_t(Rg * Fe)), dgu(size_t(Rg * 2 * Fe));
    ops->grouped_gemm(false, false, El, off, 0, Fe, C, 1.f, dye, C, p.we_down, Fe, C * Fe, 0.f, da.data(), Fe,
                      0);                                                             // da [Rg,Fe]
    ops->grouped_gemm(true, false, El, off, C, Fe, 0, 1.f, dye, C, e.a.data(), Fe, 0, 1.f, gp.we_down, Fe,
                      C * Fe);                                                        // dW_down
    glu_bwd(s.act, dgu.data(), 2 * Fe, da.data(), Fe, e.gu.data(), 2 * Fe, Rg, Fe);   // dgu [Rg,2Fe]
    ops->grouped_gemm(true, false, El, off, Fe, C, 0, 1.f, dgu.data(), 2 * Fe, e.xe.data(), C, 0, 1.f, gp.we_gate,
                      C, Fe * C);                                                     // dW_gate
    ops->grouped_gemm(true, false, El, off, Fe, C, 0, 1.f, dgu.data() + Fe, 2 * Fe, e.xe.data(), C, 0, 1.f,
                      gp.we_up, C, Fe * C);                                           // dW_up
    ops->grouped_gemm(false, false, El, off, 0, C, Fe, 1.f, dgu.data(), 2 * Fe, p.we_gate, C, Fe * C, 0.f, dye, C,
                      0);                                                             // dxe [Rg,C]
    ops->grouped_gemm(false, false, El, off, 0, C, Fe, 1.f, dgu.data() + Fe, 2 * Fe, p.we_up, C, Fe * C, 1.f, dye,
                      C, 0);
  }
  // d inputs (under etp partial sums over the group, reduce-scattered first) back to the rows'
  // ranks (the combine's pattern).
  scatter_rows(src, dye, e.perm, C);
  if (Te > 1) etp_reduce_scatter(e, src, sc.rows.data());
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
