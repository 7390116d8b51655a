// Pipeline parallelism on one stage (engine.hpp's *_stage calls, sdk/pipeline_parallel.hpp):
// the stage's program starts from the previous stage's activations instead of the embedding
// and ends at its last layer instead of the head; these calls carry those activations and their
// gradients in and out. The schedule (which micro-batch runs when, and the sends and receives
// between stages) is the owner's.
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "model.hpp"

namespace rlh::engine {

namespace {

// Null the stage's boundary pointers and run every layer again when a call leaves, whatever
// leaves its scope.
template <class Impl>
struct StageReset {
  Impl& m;
  ~StageReset() {
    m.pp_x_in = m.pp_dy = nullptr, m.pp_dx = nullptr;
    m.run_whole();
  }
};

// A model chunk's own columns of this stage's routing record (rows x the stage's R): each chunk
// is one run of the whole record (PpLayout::Chunk::route_begin), a rank's chunks together are not.
std::vector<int32_t> chunk_columns(std::vector<int32_t> rec, const sdk::PpLayout& L, int64_t chunk, int64_t width) {
  if (L.chunks.size() == 1) return rec;
  int64_t lo = 0;  // the chunk's first column in the stage's record
  for (int64_t c = 0; c < chunk; ++c) lo += L.chunks[size_t(c)].route_count;
  const int64_t w = L.chunks[size_t(chunk)].route_count, rows = width > 0 ? int64_t(rec.size()) / width : 0;
  std::vector<int32_t> out(size_t(rows * w));
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t k = 0; k < w; ++k) out[size_t(n * w + k)] = rec[size_t(n * width + lo + k)];
  return out;
}

}  // namespace

int64_t Engine::stage_rows(const MicroBatch& mb) const {
  const Impl& m = *impl_;
  if (!m.cp_on && !m.sp_on) return mb.num_tokens();
  // cp_prepare's count: per sequence 2 chunks of ceil(n / 2cp) rows (one chunk of n without CP),
  // each padded to a multiple of T under sequence parallelism, whose rank keeps 1/T of them.
  const int64_t pieces = m.cp_on ? 2 * m.cp : 1, q = m.sp_on ? m.opt.tp->size : 1;
  int64_t rows = 0;
  for (int64_t s = 0; s < mb.num_sequences(); ++s) {
    const int64_t n = mb.cu_seqlens[size_t(s) + 1] - mb.cu_seqlens[size_t(s)];
    rows += (m.cp_on ? 2 : 1) * ((n + pieces * q - 1) / (pieces * q) * q);
  }
  return rows / q;
}

Outputs Engine::forward_stage(const MicroBatch& whole, const OutputRequest& req, std::span<const float> x_in,
                              std::span<float> x_out, int64_t chunk) {
  Impl& m = *impl_;
  StageReset<Impl> reset{m};
  // Under context parallelism the boundary holds this rank's rows of the split (forward() on the
  // last stage prepares the same split again and gathers the outputs); under sequence
  // parallelism this rank's block of them.
  const MicroBatch& mb = m.cp_on || m.sp_on ? m.cp_prepare(whole) : whole;
  m.bind_stage(mb, x_in, {}, {}, false, chunk);
  const sdk::PpLayout& L = *m.opt.pp;
  if (m.run_head) {
    Outputs out = forward(whole, req);
    if (req.routed_experts) {  // this chunk's columns (engine.hpp)
      out.routed_experts = chunk_columns(std::move(out.routed_experts), L, chunk, m.route_width);
      out.routing_width = L.chunks[size_t(chunk)].route_count;
    }
    return out;
  }
  const int64_t rows = m.sp_on ? mb.num_tokens() / m.opt.tp->size : mb.num_tokens();
  const size_t n = size_t(rows * m.C);
  if (x_out.size() != n)
    throw std::invalid_argument("engine: pipeline stage " + std::to_string(m.opt.pp->rank) + ": the output has " +
                                std::to_string(x_out.size()) + " values, expected " + std::to_string(n));
  m.forward(mb, req, false);
  std::memcpy(x_out.data(), m.sp_own(m.xs[size_t(m.run_hi)], m.C), n * sizeof(float));
  Outputs out;
  if (req.routed_experts) {  // this chunk's columns (engine.hpp)
    out.routing_width = L.chunks[size_t(chunk)].route_count;
    out.routed_experts = chunk_columns(std::move(m.route_record), L, chunk, m.route_width);
  }
  return out;
}

void Engine::begin_stage_step(std::span<const MicroBatch> mbs, const StepOptions& so) {
  Impl& m = *impl_;
  if (!m.pp_on) throw std::logic_error("engine: begin_stage_step without pipeline parallelism");
  if (!m.grads_clear) zero_grad();
  m.grads_clear = false;
  // The auxiliary losses' normalisers are the whole step's, as train_step sets them.
  const MoeNormCounts counts = moe_norm_counts(mbs, so);
  m.moe_tokens = counts.tokens;
  m.moe_seqs = counts.sequences;
  m.moe_aux = m.moe_z = m.moe_max_load = 0;
}

Engine::MoeValues Engine::stage_moe_values() const {
  const Impl& m = *impl_;
  return {m.moe_aux, m.moe_z, m.moe_max_load};
}

LossResult Engine::backward_stage(const MicroBatch& whole, int64_t index, int64_t count, const StepOptions& so,
                                  const LossFn& loss_fn, std::span<const float> x_in, std::span<const float> dy,
                                  std::span<float> dx, int64_t chunk) {
  Impl& m = *impl_;
  const OutputRequest& req = so.outputs;
  if (req.logits) throw std::invalid_argument("engine: logits are a forward-only output");
  if (req.routed_experts)
    throw std::invalid_argument("engine: under pipeline parallelism the routing record is a forward_stage output");
  StageReset<Impl> reset{m};
  const MicroBatch& mb = m.cp_on || m.sp_on ? m.cp_prepare(whole) : whole;  // this rank's rows (stage_rows)
  m.bind_stage(mb, x_in, dy, dx, true, chunk);
  // The auxiliary losses belong to this forward (each micro-batch's one on every stage: a
  // forward_stage of the same micro-batch before it counts none).
  struct TrainFlag {
    bool& f;
    explicit TrainFlag(bool& b) : f(b) { f = true; }
    ~TrainFlag() { f = false; }
  } train_flag(m.moe_train);
  m.forward(mb, req, !m.opt.recompute);
  LossResult lr;
  if (m.run_head) lr = m.call_loss(whole, index, count, so, loss_fn);  // the whole micro-batch's outputs
  m.backward(mb, req);
  return lr;
}

void Engine::end_stage_step() {
  Impl& m = *impl_;
  if (m.tp_on) m.tp_sync_grads();  // the gradients the tensor-parallel group shares
  // Context parallelism: the stage's auxiliary losses are its rows' part; summed over the group
  // as train_step sums them.
  if ((m.cp_on || m.moe_own_rows) && m.route_width > 0) {
    double v[2] = {m.moe_aux, m.moe_z};
    if (m.cp_on) m.opt.cp_comm->all_reduce_sum(v, 2);
    if (m.moe_own_rows) m.opt.tp_comm->all_reduce_sum(v, 2);
    m.moe_aux = v[0];
    m.moe_z = v[1];
  }
}

}  // namespace rlh::engine

namespace rlh::engine {

void Engine::Impl::bind_stage(const MicroBatch& mb, std::span<const float> x_in, std::span<const float> dy,
                              std::span<float> dx, bool backward, int64_t chunk) {
  if (!pp_on) throw std::logic_error("engine: a *_stage call without pipeline parallelism (EngineOptions::pp)");
  if (chunk < 0 || chunk >= int64_t(opt.pp->chunks.size()))
    throw std::invalid_argument("engine: pipeline stage " + std::to_string(opt.pp->rank) + ": model chunk " +
                                std::to_string(chunk) + " of " + std::to_string(opt.pp->chunks.size()));
  const sdk::PpLayout::Chunk& c = opt.pp->chunks[size_t(chunk)];
  run_lo = c.local_begin;
  run_hi = c.local_begin + c.count;
  run_embed = c.embed;
  run_head = c.head;

  const size_t n = size_t((sp_on ? mb.num_tokens() / opt.tp->size : mb.num_tokens()) * C);  // stage_rows x C
  auto need = [&](bool want, size_t got, const char* what) {
    if (want && got != n)
      throw std::invalid_argument(std::string("engine: pipeline stage ") + std::to_string(opt.pp->rank) + ": " + what +
                                  " has " + std::to_string(got) + " values, expected " + std::to_string(n) +
                                  " (stage rows x hidden)");
  };
  need(!run_embed, x_in.size(), "the input activations");
  need(backward && !run_head, dy.size(), "the output gradient");
  need(backward && !run_embed, dx.size(), "the input gradient");
  pp_x_in = x_in.data();
  pp_dy = dy.data();
  pp_dx = dx.data();
}

}  // namespace rlh::engine
