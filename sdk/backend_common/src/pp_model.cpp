// Pipeline parallelism in the backend (docs/model_parallelism.md, "Pipeline parallelism"): the 1F1B
// schedule over the stages of one model replica (interleaved over model chunks with virtual
// stages), forward-only passes, and the results of the last stage (loss, metrics, outputs) on
// every stage. The engine runs one stage, or one model chunk of it (engine.hpp's *_stage
// calls); activations and their gradients move here, by send/recv on the pp group.
//
// The schedule as data. Every stage runs Megatron's non-interleaved 1F1B order: w = min(P-1-s,
// M) forwards (warm-up), then one forward and one backward alternately, then the remaining
// backwards (cool-down); with V virtual stages Megatron's interleaved order (pp_schedule). On
// the last (virtual) stage a micro-batch's forward, loss callback and backward are one call. A
// stage that is not the last keeps only its input activations of the micro-batches in flight
// and runs the forward again inside the backward (backward_stage): Megatron's full recompute at
// stage granularity, which keeps the engine's one activation plan per call.
//
// Sends and receives are blocking (sdk::Comm), so the order of every p2p call must be one that
// cannot deadlock. Every rank therefore derives the same timeline: ticks in which each stage
// runs its next operation once the operation it depends on ran at an earlier tick (the previous
// virtual stage's forward of that micro-batch, the next one's backward). After each tick every
// rank walks the messages that tick produced in one order — forward messages from even ranks,
// from odd ranks, then backward messages from even ranks, from odd ones — and sends or receives
// those it takes part in. The first message not yet done always has both its ranks at it, so
// every send meets its receive.
// MoE: each stage adds its layers' auxiliary losses to its gradients; the values behind the
// moe/* metrics are summed (the busiest expert's share: maximised) over the stages.
#include <algorithm>
#include <cstring>
#include <map>

#include "backend_internal.hpp"

namespace rlh::backend {

using sdk::Error;

namespace {

struct PpOp {
  bool forward = true;  // forward only (not the last virtual stage), else the micro-batch's backward
  int64_t mb = 0;
  int64_t chunk = 0;  // the rank's model chunk (interleaved virtual stages; 0 without them)
};

// Each rank's operations. V = 1: Megatron's 1F1B order. V > 1: Megatron's interleaved order
// (schedules.py, forward_backward_pipelining_with_interleaving): the M x V forwards run in
// groups of P micro-batches chunk after chunk (forward k: chunk (k / P) mod V, micro-batch
// (k / (P V)) P + k mod P; backward k the same with the chunks from the last), after
// 2 (P - 1 - s) + (V - 1) P warm-up forwards. The last virtual stage's forward is part of its
// backward call (forward, loss, backward), so its forward operations are left out.
std::vector<std::vector<PpOp>> pp_schedule(int64_t P, int64_t V, int64_t M) {
  std::vector<std::vector<PpOp>> ops(static_cast<size_t>(P));
  for (int64_t s = 0; s < P; ++s) {
    std::vector<PpOp>& o = ops[size_t(s)];
    if (V == 1) {
      if (s == P - 1) {
        for (int64_t i = 0; i < M; ++i) o.push_back({false, i, 0});
        continue;
      }
      const int64_t w = std::min(P - 1 - s, M);
      int64_t f = 0, b = 0;
      for (; f < w; ++f) o.push_back({true, f, 0});
      while (f < M) {
        o.push_back({true, f++, 0});
        o.push_back({false, b++, 0});
      }
      while (b < M) o.push_back({false, b++, 0});
      continue;
    }
    const int64_t total = M * V;
    const auto at = [&](int64_t k, bool forward) {
      const int64_t c = (k / P) % V;
      return PpOp{forward, (k / (P * V)) * P + k % P, forward ? c : V - 1 - c};
    };
    const auto add = [&](const PpOp& op) {
      if (!(op.forward && s == P - 1 && op.chunk == V - 1)) o.push_back(op);
    };
    const int64_t w = std::min(2 * (P - 1 - s) + (V - 1) * P, total);
    int64_t f = 0, b = 0;
    for (; f < w; ++f) add(at(f, true));
    while (f < total) {
      add(at(f++, true));
      add(at(b++, false));
    }
    while (b < total) add(at(b++, false));
  }
  return ops;
}

// The tick at which each rank runs each of its operations: tick[s][k] for ops[s][k]. An
// operation runs once the one it depends on ran at an earlier tick: a forward (or the last
// virtual stage's whole micro-batch) needs the previous virtual stage's forward of that
// micro-batch, a backward elsewhere the next virtual stage's backward. Virtual stage of chunk c
// on rank s: c P + s.
std::vector<std::vector<int64_t>> timeline(const std::vector<std::vector<PpOp>>& ops, int64_t V, int64_t M) {
  const int64_t P = int64_t(ops.size()), S = P * V;
  std::vector<std::vector<int64_t>> tick(static_cast<size_t>(P));
  // When each virtual stage's forward / backward of each micro-batch ran (-1: not yet).
  std::vector<std::vector<int64_t>> fwd(static_cast<size_t>(S), std::vector<int64_t>(static_cast<size_t>(M), -1)), bwd = fwd;
  std::vector<size_t> next(static_cast<size_t>(P), 0);
  const auto before = [](int64_t when, int64_t t) { return when >= 0 && when < t; };
  for (int64_t t = 0;; ++t) {
    bool left = false, ran = false;
    for (int64_t s = 0; s < P; ++s) {
      if (next[size_t(s)] >= ops[size_t(s)].size()) continue;
      left = true;
      const PpOp& op = ops[size_t(s)][next[size_t(s)]];
      const int64_t v = op.chunk * P + s;
      const size_t mb = size_t(op.mb);
      bool ready = true;
      if (op.forward || v == S - 1) ready = v == 0 || before(fwd[size_t(v - 1)][mb], t);
      if (!op.forward && v < S - 1) ready = before(bwd[size_t(v + 1)][mb], t);
      if (!ready) continue;
      (op.forward ? fwd : bwd)[size_t(v)][mb] = t;
      if (v == S - 1) fwd[size_t(v)][mb] = t;
      tick[size_t(s)].push_back(t);
      ++next[size_t(s)];
      ran = true;
    }
    if (!left) break;
    if (!ran) throw Error(RLH_E_INTERNAL, "pipeline schedule: no stage can run at tick " + std::to_string(t));
  }
  return tick;
}

int64_t ring_bytes(int64_t bytes, int S) { return S <= 1 ? 0 : 2 * bytes * (S - 1) / S; }

}  // namespace

void make_pipeline_stage(const Backend& b, Model& m) {
  const std::string key = "policy.megatron_cfg.pipeline_model_parallel_size";
  const int64_t pp = m.config.parallel.pp;
  if (!b.dp || b.dp->pp_size() != pp)
    throw Error(RLH_E_INVALID_ARGUMENT,
                std::string(b.flavor->name) + ": " + key + " = " + std::to_string(pp) + " needs a multiple of " +
                    std::to_string(pp) + " launched ranks split that way, but " +
                    (b.dp ? "this backend's groups have pipeline size " + std::to_string(b.dp->pp_size())
                          : std::string("one rank was started")));
  if (m.config.parallel.fsdp)
    throw Error(RLH_E_UNIMPLEMENTED, key + " = " + std::to_string(pp) + ": pipeline parallelism with FSDP is not implemented");
  const sdk::PpSplit split{m.config.parallel.pp_first_layers, m.config.parallel.pp_last_layers, m.config.parallel.vpp};
  // The stage is cut from this rank's description: its tensor-parallel pieces, and under expert
  // parallelism its block of the experts (an ep group holds ranks of one stage).
  const sdk::TransformerDesc& desc =
      m.ep() ? m.ep()->local : m.tp_layouts.empty() ? m.desc : m.tp_layouts[size_t(b.dp->tp_rank())].local;
  try {
    m.pp_layout = std::make_unique<sdk::PpLayout>(sdk::make_pp_layout(desc, pp, b.dp->pp_rank(), split, key));
  } catch (const std::invalid_argument& e) {
    throw Error(RLH_E_UNIMPLEMENTED, m.desc.architecture + " (" + m.dir + "): " + e.what());
  }
}

std::string pp_layers_note(const sdk::PpLayout& L) {
  std::string out = "layers ";
  for (size_t c = 0; c < L.chunks.size(); ++c)
    out += (c ? ", " : "") + std::to_string(L.chunks[c].global_begin) + ".." +
           std::to_string(L.chunks[c].global_begin + L.chunks[c].count - 1);
  return out;
}

engine::Outputs pp_forward(Model& m, const engine::MicroBatch& mb, const engine::OutputRequest& req) {
  const sdk::PpLayout& L = *m.pp();
  const sdk::Comm& pp = m.dp->pp;
  const int64_t P = L.size, S = P * L.virtual_size, s = m.dp->pp_rank();
  const int64_t n = m.engine->stage_rows(mb) * m.engine->desc().hidden_size;  // this rank's rows under CP
  // The micro-batch through the virtual stages in turn (one per rank without virtual stages):
  // virtual stage v is chunk v / P of rank v mod P; each hands its output to the next.
  engine::Outputs o;
  std::vector<float> x_in, x_out;
  for (int64_t v = 0; v < S; ++v) {
    if (v % P != s) continue;
    if (v > 0) {
      x_in.resize(size_t(n));
      FloatView in(x_in.data(), n);
      pp.recv(*in, int((v - 1) % P));
    }
    x_out.assign(v < S - 1 ? size_t(n) : 0, 0.f);
    engine::Outputs got = m.engine->forward_stage(mb, req, v > 0 ? std::span<const float>(x_in) : std::span<const float>(),
                                                  x_out, v / P);
    if (v == S - 1) o = std::move(got);
    if (v < S - 1) {
      FloatView out(x_out.data(), n);
      pp.send(*out, int((v + 1) % P));
      m.pp_bytes += n * int64_t(sizeof(float));
    }
  }
  // The last stage's outputs on every stage: their sizes, then each one requested.
  std::vector<float>* outs[] = {&o.logprob, &o.processed_logprob, &o.entropy, &o.logprob_at_ids, &o.logits, &o.value};
  int64_t sizes[7] = {0, 0, 0, 0, 0, 0, o.ids_per_token};
  for (size_t k = 0; k < 6; ++k) sizes[k] = int64_t(outs[k]->size());
  const int root = int(L.size - 1);
  pp.broadcast(std::span<int64_t>(sizes, 7), root);
  o.ids_per_token = sizes[6];
  for (size_t k = 0; k < 6; ++k) {
    if (sizes[k] == 0) continue;
    outs[k]->resize(size_t(sizes[k]));
    FloatView v(outs[k]->data(), sizes[k]);
    pp.broadcast(*v, root);
  }
  return o;
}

engine::StepResult pp_train_step(Model& m, const std::vector<engine::MicroBatch>& views, const engine::StepOptions& so,
                                 const engine::LossFn& loss) {
  const sdk::PpLayout& L = *m.pp();
  const sdk::Comm& pp = m.dp->pp;
  const int64_t P = L.size, V = L.virtual_size, s = m.dp->pp_rank(), M = int64_t(views.size());
  const int64_t C = m.engine->desc().hidden_size;
  // Expert parallelism: the stage's ep group (ranks of other replicas) exchanges rows in every
  // MoE layer, so every replica of the group runs the schedule of its busiest one, Mx
  // micro-batches: a micro-batch past its own M is an idle one (its experts run for the others'
  // rows, the exchanges of a forward_stage or backward_stage call, no message between stages:
  // the replica's stages skip it alike). The ranks of an ep group share their stage s and Mx,
  // so they derive the same operations (with virtual stages each one a single model chunk's
  // layers, an idle one too) and meet in every chunk's exchanges in the same order.
  int64_t most[1] = {M};
  if (m.ep()) m.dp->ep.all_reduce(std::span<int64_t>(most, 1), RLH_REDUCE_MAX);
  const int64_t Mx = most[0];
  // Megatron's interleaving rule. Every rank learns whether any replica breaks it (its stage's
  // data-parallel group holds one rank of every replica), so all of them stop together.
  int64_t bad[1] = {V > 1 && M % P != 0 ? M : 0};
  if (V > 1) m.dp->dp.all_reduce(std::span<int64_t>(bad, 1), RLH_REDUCE_MAX);
  if (bad[0] != 0)
    throw Error(RLH_E_INVALID_ARGUMENT,
                "policy.megatron_cfg.virtual_pipeline_model_parallel_size = " + std::to_string(V) +
                    ": the interleaved schedule needs a number of micro-batches divisible by "
                    "policy.megatron_cfg.pipeline_model_parallel_size = " +
                    std::to_string(P) + ", got " + std::to_string(bad[0]) + " micro-batches");
  const std::vector<std::vector<PpOp>> ops = pp_schedule(P, V, Mx);
  const std::vector<std::vector<int64_t>> ticks = timeline(ops, V, Mx);
  // Per tick, the messages: (from virtual stage, forward?, micro-batch). Every rank walks each
  // tick's messages in the same order (forward ones first, then by the sender's parity) and
  // takes part in those it sends or receives: the first message not yet done always has both
  // its ranks at it, so blocking send/recv cannot deadlock.
  struct Msg {
    int64_t from;
    bool forward;
    int64_t mb;
  };
  std::map<int64_t, std::vector<Msg>> sent;
  for (int64_t q = 0; q < P; ++q)
    for (size_t k = 0; k < ops[size_t(q)].size(); ++k) {
      const PpOp& op = ops[size_t(q)][k];
      const int64_t v = op.chunk * P + q;
      if (op.mb >= M) continue;  // an idle micro-batch moves nothing
      if (op.forward) sent[ticks[size_t(q)][k]].push_back({v, true, op.mb});
      if (!op.forward && v > 0) sent[ticks[size_t(q)][k]].push_back({v, false, op.mb});
    }

  engine::StepResult r;
  m.engine->begin_stage_step(views, so);
  // Received inputs and output gradients, and this rank's outputs and input gradients waiting
  // to be sent, by (micro-batch, chunk) (dropped once used).
  std::map<int64_t, std::vector<float>> x_in, dy, x_out, dx;
  const auto key = [&](int64_t mb, int64_t chunk) { return mb * V + chunk; };
  // A boundary's values: this rank's rows (its share of the cp split) x C.
  const auto tokens = [&](int64_t i) { return m.engine->stage_rows(views[size_t(i)]) * C; };
  size_t k = 0;
  int64_t last_tick = -1;
  for (const auto& [t, msgs] : sent) last_tick = std::max(last_tick, t);
  if (!ticks[size_t(s)].empty()) last_tick = std::max(last_tick, ticks[size_t(s)].back());
  for (int64_t t = 0; t <= last_tick; ++t) {
    const PpOp* run = k < ops[size_t(s)].size() && ticks[size_t(s)][k] == t ? &ops[size_t(s)][k++] : nullptr;
    if (run != nullptr && run->mb >= M) {  // an idle micro-batch (expert parallelism, above): its chunk's layers
      m.engine->ep_idle_microbatch(!run->forward, run->chunk);
      run = nullptr;
    }
    if (run != nullptr) {
      const PpOp& op = *run;
      const engine::MicroBatch& mb = views[size_t(op.mb)];
      const sdk::PpLayout::Chunk& chunk = L.chunks[size_t(op.chunk)];
      const int64_t at = key(op.mb, op.chunk);
      const std::span<const float> in = chunk.embed ? std::span<const float>() : std::span<const float>(x_in.at(at));
      if (op.forward) {
        std::vector<float>& out = x_out[at];
        out.resize(size_t(tokens(op.mb)));
        m.engine->forward_stage(mb, so.outputs, in, out, op.chunk);
      } else {
        std::vector<float> din(chunk.embed ? 0 : size_t(tokens(op.mb)));
        const std::span<const float> g = chunk.head ? std::span<const float>() : std::span<const float>(dy.at(at));
        const engine::LossResult lr = m.engine->backward_stage(mb, op.mb, M, so, loss, in, g, din, op.chunk);
        r.loss += lr.loss;
        engine::accumulate_metrics(r.metrics, lr.metrics);
        if (op.chunk == 0) r.tokens += mb.num_tokens();
        x_in.erase(at);
        dy.erase(at);
        if (!chunk.embed) dx[at] = std::move(din);
      }
    }
    auto it = sent.find(t);
    if (it == sent.end()) continue;
    for (const bool forward : {true, false})
      for (const int parity : {0, 1})
        for (const Msg& msg : it->second) {
          const int64_t from = msg.from % P;
          if (msg.forward != forward || from % 2 != parity) continue;
          const int64_t v_to = forward ? msg.from + 1 : msg.from - 1, to = v_to % P;
          const int64_t n = tokens(msg.mb);
          if (from == s) {
            std::map<int64_t, std::vector<float>>& box = forward ? x_out : dx;
            const int64_t at = key(msg.mb, msg.from / P);
            FloatView v(box.at(at).data(), n);
            pp.send(*v, int(to));
            m.pp_bytes += n * int64_t(sizeof(float));
            box.erase(at);
          } else if (to == s) {
            std::vector<float>& into = (forward ? x_in : dy)[key(msg.mb, v_to / P)];
            into.resize(size_t(n));
            FloatView v(into.data(), n);
            pp.recv(*v, int(from));
          }
        }
  }
  m.engine->end_stage_step();
  // A tied embedding: the first stage's embedding and the last stage's head are one weight;
  // each copy gets the sum of both gradients (Megatron's embedding group).
  if (L.shares_embedding) {
    std::span<float> g = m.engine->grad(size_t(L.embed_local));
    FloatView v(g.data(), int64_t(g.size()));
    m.dp->embedding.all_reduce(*v, RLH_REDUCE_SUM);
    m.pp_bytes += ring_bytes(int64_t(g.size() * sizeof(float)), m.dp->embedding.size());
  }
  // The loss and the loss callback's metrics are the last stage's.
  double total[1] = {r.loss};
  pp.broadcast(std::span<double>(total, 1), int(P - 1));
  r.loss = total[0];
  r.metrics = pp_share_named(m, r.metrics);
  // MoE: each stage added its layers' auxiliary losses to its gradients; their values (summed
  // over layers on one rank) are summed over the stages, the busiest expert's share is the
  // largest of any stage's. Every stage takes part, a stage without MoE layers with zeros.
  if (std::any_of(m.desc.layers.begin(), m.desc.layers.end(),
                  [](const sdk::LayerDesc& l) { return l.mlp.kind == sdk::MlpKind::moe; })) {
    const engine::Engine::MoeValues v = m.engine->stage_moe_values();
    double sums[2] = {v.aux, v.z}, most[1] = {v.max_load};
    pp.all_reduce(std::span<double>(sums, 2), RLH_REDUCE_SUM);
    pp.all_reduce(std::span<double>(most, 1), RLH_REDUCE_MAX);
    for (auto& kv : engine::moe_step_metrics(m.config.moe, sums[0], sums[1], most[0])) r.metrics.push_back(std::move(kv));
  }
  return r;
}

std::vector<std::pair<std::string, double>> pp_share_named(const Model& m,
                                                           const std::vector<std::pair<std::string, double>>& mine) {
  if (!m.pp()) return mine;
  const sdk::Comm& pp = m.dp->pp;
  const int root = pp.size() - 1;
  std::string text;
  for (const auto& [name, v] : mine) text += name + "\n";
  int64_t len[2] = {int64_t(text.size()), int64_t(mine.size())};
  pp.broadcast(std::span<int64_t>(len, 2), root);
  std::vector<uint8_t> bytes(static_cast<size_t>(len[0]));
  if (!bytes.empty()) std::memcpy(bytes.data(), text.data(), std::min(text.size(), bytes.size()));  // no names: null data
  if (len[0] > 0) pp.broadcast(std::span<uint8_t>(bytes), root);
  std::vector<double> values(static_cast<size_t>(len[1]));
  for (size_t i = 0; i < mine.size() && i < values.size(); ++i) values[i] = mine[i].second;
  if (len[1] > 0) pp.broadcast(std::span<double>(values), root);
  std::vector<std::pair<std::string, double>> out;
  size_t at = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const size_t end = size_t(std::find(bytes.begin() + long(at), bytes.end(), uint8_t('\n')) - bytes.begin());
    out.emplace_back(std::string(bytes.begin() + long(at), bytes.begin() + long(end)), values[i]);
    at = end + 1;
  }
  return out;
}

}  // namespace rlh::backend
