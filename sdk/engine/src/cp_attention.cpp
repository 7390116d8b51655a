// Context parallelism (EngineOptions::cp_comm): Megatron's zigzag split of every sequence over
// the group, and attention of this rank's queries over the group's all-gathered keys and values.
//
// Each sequence of n tokens is padded to n' = 2 cp c (c = ceil(n / 2cp)) and cut into 2 cp
// chunks of c; rank r runs chunks r and 2cp-1-r, so every rank has the same rows and, under the
// causal mask, about the same attention work. Padding comes after the sequence's last token,
// so no real token ever attends to it; its rows get no output gradient. RoPE and the mask use
// the global position in the sequence.
//
// Attention all-gathers k and v (not a ring: simpler, and on CPU ranks the same bytes move),
// with Gemma-2's soft-capping of the scores as the attention op has it (scale, then the cap);
// the backward gathers them again, computes d q of its own rows and partial d k / d v of every
// row, and reduce-scatters those to their owners. The products are plain loops here, not a
// kernel-registry op: the attention op's contract (docs/ops.md) has one sequence layout for
// queries and keys, and a query-offset variant is not part of it yet.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "model.hpp"

namespace rlh::engine {

const MicroBatch& Engine::Impl::cp_prepare(const MicroBatch& mb) {
  const int64_t S = mb.num_sequences(), N = mb.num_tokens();
  if (S < 1 || mb.cu_seqlens[0] != 0 || mb.cu_seqlens[size_t(S)] != N || N == 0)
    throw std::invalid_argument("engine: a micro-batch needs tokens and cu_seqlens running from 0 to their number");
  CpPlan& p = cpp;
  // Each sequence in `two` chunks of c: 2 cp zigzag chunks, or (sequence parallelism without
  // context parallelism: the same plan at cp 1, no communication) one chunk. c is a multiple of
  // T under sequence parallelism, so every rank's rows cut in T blocks: NeMo-RL's padding of
  // each sequence to a multiple of 2 cp tp (of tp without cp).
  const int64_t two = cp > 1 ? 2 * cp : 1;
  const int64_t q = sp_on ? opt.tp->size : 1;
  std::vector<int64_t> chunk(static_cast<size_t>(S)), off(static_cast<size_t>(S) + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = mb.cu_seqlens[size_t(s) + 1] - mb.cu_seqlens[size_t(s)];
    if (n < 0) throw std::invalid_argument("engine: cu_seqlens must not decrease");
    chunk[size_t(s)] = (n + two * q - 1) / (two * q) * q;
    off[size_t(s) + 1] = off[size_t(s)] + two / cp * chunk[size_t(s)];
  }
  p.nloc = off[size_t(S)];
  p.ids.assign(size_t(p.nloc), 0);
  p.pos.assign(size_t(p.nloc), 0);
  p.target.assign(size_t(p.nloc), -1);
  p.seq.assign(size_t(p.nloc), 0);
  p.src.assign(size_t(cp * p.nloc), -1);
  p.cu.assign(size_t(S) + 1, 0);
  p.key_begin.assign(size_t(S) + 1, 0);
  for (int64_t s = 0; s < S; ++s) p.key_begin[size_t(s) + 1] = p.key_begin[size_t(s)] + two * chunk[size_t(s)];
  p.key_row.assign(size_t(p.key_begin[size_t(S)]), 0);
  p.token.assign(size_t(p.nloc), -1);
  p.seq_len.assign(size_t(S), 0);
  p.whole = &mb;
  for (int64_t s = 0; s < S; ++s) {
    p.seq_len[size_t(s)] = mb.cu_seqlens[size_t(s) + 1] - mb.cu_seqlens[size_t(s)];
    p.cu[size_t(s) + 1] = int32_t(off[size_t(s) + 1]);
    const int64_t b = mb.cu_seqlens[size_t(s)], n = mb.cu_seqlens[size_t(s) + 1] - b, c = chunk[size_t(s)];
    // Global position g of the padded sequence: chunk j = g / c lives on rank j (j < cp) or
    // 2cp-1-j, at row off + (0 or c) + g % c of that rank.
    for (int64_t g = 0; g < two * c; ++g) {
      const int64_t j = g / c, r = cp == 1 ? 0 : j < cp ? j : two - 1 - j;
      const int64_t row = off[size_t(s)] + (j < cp ? 0 : c) + g % c;
      p.key_row[size_t(p.key_begin[size_t(s)] + g)] = int32_t(r * p.nloc + row);
      if (g < n) p.src[size_t(r * p.nloc + row)] = int32_t(b + g);
      if (r != cp_rank) continue;
      p.pos[size_t(row)] = int32_t(g);
      p.seq[size_t(row)] = int32_t(s);
      if (g < n) p.token[size_t(row)] = int32_t(b + g);
      if (g < n) p.ids[size_t(row)] = mb.input_ids[size_t(b + g)];
      if (g + 1 < n) p.target[size_t(row)] = mb.input_ids[size_t(b + g + 1)];
    }
  }
  p.mb = MicroBatch{};
  p.mb.input_ids = p.ids;
  p.mb.cu_seqlens = p.cu;
  p.mb.fields = mb.fields;
  return p.mb;
}

void Engine::Impl::cp_positions() {
  std::copy(cpp.pos.begin(), cpp.pos.end(), pos);
  std::copy(cpp.target.begin(), cpp.target.end(), target);
}

void Engine::Impl::cp_gather_rows(const float* local, int64_t ld, int64_t width, float* full, int64_t N) {
  const int64_t n = cpp.nloc;
  Buffer<float> mine(*alloc, size_t(n * width)), all(*alloc, size_t(cp * n * width));
  for (int64_t i = 0; i < n; ++i) std::memcpy(mine.data() + i * width, local + i * ld, size_t(width) * sizeof(float));
  if (cp_on)
    opt.cp_comm->all_gather(mine.data(), n * width, all.data());
  else
    std::memcpy(all.data(), mine.data(), size_t(n * width) * sizeof(float));
  std::fill(full, full + N * width, 0.f);
  for (int64_t r = 0; r < cp * n; ++r)
    if (const int32_t t = cpp.src[size_t(r)]; t >= 0)
      std::memcpy(full + int64_t(t) * width, all.data() + r * width, size_t(width) * sizeof(float));
}

void Engine::Impl::cp_take_rows(const float* full, int64_t width, float* local, int64_t ld) {
  for (int64_t i = 0; i < cpp.nloc; ++i) {
    const int32_t t = cpp.src[size_t(cp_rank * cpp.nloc + i)];
    if (t >= 0)
      std::memcpy(local + i * ld, full + int64_t(t) * width, size_t(width) * sizeof(float));
    else
      std::fill(local + i * ld, local + i * ld + width, 0.f);
  }
}

const float* Engine::Impl::cp_whole_rows(const float* rows, int64_t N, std::vector<float>& store) {
  if (!cp_on && !sp_on) return rows;
  store.resize(size_t(N));
  cp_gather_rows(rows, 1, 1, store.data(), N);
  return store.data();
}

std::vector<int32_t> Engine::Impl::whole_route_record(int64_t N) {
  if (!cp_on && !sp_on) return std::move(route_record);
  // Expert indices are small integers, exact in float: gathered through the rows' path.
  const int64_t W = route_width;
  if (moe_own_rows) {  // each tp rank routed its block of rows: every block to every rank first
    std::vector<float> block(size_t(sp_rows * W)), rows(route_record.size());
    for (size_t i = 0; i < block.size(); ++i) block[i] = float(route_record[size_t(sp_begin * W) + i]);
    opt.tp_comm->all_gather(block.data(), sp_rows * W, rows.data());
    for (size_t i = 0; i < rows.size(); ++i) route_record[i] = int32_t(rows[i]);
  }
  std::vector<float> mine(route_record.begin(), route_record.end()), full(size_t(N * W));
  cp_gather_rows(mine.data(), W, W, full.data(), N);
  return std::vector<int32_t>(full.begin(), full.end());
}

void Engine::Impl::cp_gather_kv(const float* k, int64_t ldk, int64_t wk, const float* v, int64_t ldv, int64_t wv,
                                Buffer<float>& kall, Buffer<float>& vall) {
  const int64_t n = cpp.nloc;
  Buffer<float> mine(*alloc, size_t(n * std::max(wk, wv)));
  kall = Buffer<float>(*alloc, size_t(cp * n * wk));
  vall = Buffer<float>(*alloc, size_t(cp * n * wv));
  for (int64_t i = 0; i < n; ++i) std::memcpy(mine.data() + i * wk, k + i * ldk, size_t(wk) * sizeof(float));
  opt.cp_comm->all_gather(mine.data(), n * wk, kall.data());
  for (int64_t i = 0; i < n; ++i) std::memcpy(mine.data() + i * wv, v + i * ldv, size_t(wv) * sizeof(float));
  opt.cp_comm->all_gather(mine.data(), n * wv, vall.data());
}

namespace {
// The keys query row i sees: positions [first, pos] of its sequence (HF's sliding window: W
// keys including itself).
int64_t first_key(int64_t pos, int64_t window) { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }
}  // namespace

void Engine::Impl::cp_attention_fwd(const sdk::LayerStep& st, float* o, int64_t ldo, float* lse, const float* q,
                                    int64_t ldq, const float* k, int64_t ldk, const float* v, int64_t ldv) {
  const int64_t n = cpp.nloc, Hq = st.hq, Hkv = st.hkv, Dk = st.dk, Dv = st.dv, group = Hq / Hkv;
  const int64_t wk = Hkv * Dk, wv = Hkv * Dv;
  Buffer<float> kall, vall;
  cp_gather_kv(k, ldk, wk, v, ldv, wv, kall, vall);
  const float scale = float(st.scale), cap = float(st.softcap);
  std::vector<float> s;
  std::vector<double> acc(static_cast<size_t>(Dv));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = cpp.pos[size_t(i)], j0 = first_key(p, st.window);
    const int32_t* rows = cpp.key_row.data() + cpp.key_begin[size_t(cpp.seq[size_t(i)])];
    s.resize(size_t(p + 1));
    for (int64_t h = 0; h < Hq; ++h) {
      const float* qi = q + i * ldq + h * Dk;
      const int64_t kvh = h / group;
      float mx = -INFINITY;
      for (int64_t j = j0; j <= p; ++j) {
        const float* kj = kall.data() + int64_t(rows[j]) * wk + kvh * Dk;
        float dot = 0;
        for (int64_t d = 0; d < Dk; ++d) dot += qi[d] * kj[d];
        s[size_t(j)] = cap > 0 ? cap * std::tanh(dot * scale / cap) : dot * scale;  // the op's order: scale, cap
        mx = std::max(mx, s[size_t(j)]);
      }
      double sum = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = j0; j <= p; ++j) {
        const double e = std::exp(double(s[size_t(j)] - mx));
        sum += e;
        const float* vj = vall.data() + int64_t(rows[j]) * wv + kvh * Dv;
        for (int64_t d = 0; d < Dv; ++d) acc[size_t(d)] += e * vj[d];
      }
      float* oi = o + i * ldo + h * Dv;
      for (int64_t d = 0; d < Dv; ++d) oi[d] = float(acc[size_t(d)] / sum);
      lse[h * n + i] = float(double(mx) + std::log(sum));
    }
  }
}

void Engine::Impl::cp_attention_bwd(const sdk::LayerStep& st, float* dq, int64_t lddq, float* dk, int64_t lddk,
                                    float* dv, int64_t lddv, const float* dout, int64_t lddo, const float* q,
                                    int64_t ldq, const float* k, int64_t ldk, const float* v, int64_t ldv,
                                    const float* o, int64_t ldo, const float* lse) {
  const int64_t n = cpp.nloc, Hq = st.hq, Hkv = st.hkv, Dk = st.dk, Dv = st.dv, group = Hq / Hkv;
  const int64_t wk = Hkv * Dk, wv = Hkv * Dv;
  Buffer<float> kall, vall;
  cp_gather_kv(k, ldk, wk, v, ldv, wv, kall, vall);
  // Partial d k / d v of every gathered row (this rank's queries' share), then summed over the
  // group onto their owners.
  Buffer<float> dkall(*alloc, size_t(cp * n * wk)), dvall(*alloc, size_t(cp * n * wv));
  std::memset(dkall.data(), 0, dkall.size() * sizeof(float));
  std::memset(dvall.data(), 0, dvall.size() * sizeof(float));
  const float scale = float(st.scale), cap = float(st.softcap);
  std::vector<double> dqi(static_cast<size_t>(Dk));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = cpp.pos[size_t(i)], j0 = first_key(p, st.window);
    const int32_t* rows = cpp.key_row.data() + cpp.key_begin[size_t(cpp.seq[size_t(i)])];
    for (int64_t h = 0; h < Hq; ++h) {
      const float* qi = q + i * ldq + h * Dk;
      const float* doi = dout + i * lddo + h * Dv;
      const float* oi = o + i * ldo + h * Dv;
      const int64_t kvh = h / group;
      double delta = 0;
      for (int64_t d = 0; d < Dv; ++d) delta += double(doi[d]) * oi[d];
      const double l = lse[h * n + i];
      std::fill(dqi.begin(), dqi.end(), 0.0);
      for (int64_t j = j0; j <= p; ++j) {
        const int64_t row = rows[j];
        const float* kj = kall.data() + row * wk + kvh * Dk;
        const float* vj = vall.data() + row * wv + kvh * Dv;
        float dot = 0;
        for (int64_t d = 0; d < Dk; ++d) dot += qi[d] * kj[d];
        // Soft-capped: s = c tanh(u), u = scale dot / c, so d s / d dot = scale (1 - tanh(u)^2).
        const float u = cap > 0 ? std::tanh(dot * scale / cap) : 0.f;
        const double P = std::exp(double(cap > 0 ? cap * u : dot * scale) - l);
        double dP = 0;
        for (int64_t d = 0; d < Dv; ++d) dP += double(doi[d]) * vj[d];
        const double dS = P * (dP - delta) * scale * (cap > 0 ? 1.0 - double(u) * u : 1.0);
        float* dvj = dvall.data() + row * wv + kvh * Dv;
        for (int64_t d = 0; d < Dv; ++d) dvj[d] += float(P * doi[d]);
        float* dkj = dkall.data() + row * wk + kvh * Dk;
        for (int64_t d = 0; d < Dk; ++d) {
          dkj[d] += float(dS * qi[d]);
          dqi[size_t(d)] += dS * kj[d];
        }
      }
      float* dqo = dq + i * lddq + h * Dk;
      for (int64_t d = 0; d < Dk; ++d) dqo[d] = float(dqi[size_t(d)]);
    }
  }
  Buffer<float> mine(*alloc, size_t(n * std::max(wk, wv)));
  opt.cp_comm->reduce_scatter_sum(dkall.data(), n * wk, mine.data());
  for (int64_t i = 0; i < n; ++i) std::memcpy(dk + i * lddk, mine.data() + i * wk, size_t(wk) * sizeof(float));
  opt.cp_comm->reduce_scatter_sum(dvall.data(), n * wv, mine.data());
  for (int64_t i = 0; i < n; ++i) std::memcpy(dv + i * lddv, mine.data() + i * wv, size_t(wv) * sizeof(float));
}

}  // namespace rlh::engine
