// A model of a backend at data-parallel size > 1 (data_parallel.hpp, docs/parallelism.md):
// setting it up around the engine, the sharded train step, forward, weights and the state in
// full for checkpoints. Every function here is collective over the backend's groups: all ranks
// call it in the same order.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "backend_internal.hpp"

namespace rlh::backend {

using sdk::Error;

namespace {

// The group segment j of the shard layout is sharded over: under expert parallelism the
// distributed optimizer's second segment holds the experts, sharded over the expert dp group.
const sdk::Comm* shard_comm(const Model& m);
const sdk::Comm* segment_comm(const Model& m, size_t j) {
  if (m.dp_mode == Model::Dp::distributed_optimizer && m.ep() && j == 1) return &m.dp->edp;
  return shard_comm(m);
}

// The group the state is sharded over (and the norm summed over).
const sdk::Comm* shard_comm(const Model& m) {
  switch (m.dp_mode) {
    case Model::Dp::fsdp: return &m.dp->shard;
    case Model::Dp::distributed_optimizer: return &m.dp->dp;
    default: return nullptr;  // ddp: every rank holds the whole (reduced) gradient
  }
}

// Ring traffic of one collective on `bytes` over S ranks (DpStepResult::comm_bytes).
int64_t ring_bytes(int64_t bytes, int S, bool all_reduce = false) {
  return S <= 1 ? 0 : (all_reduce ? 2 : 1) * bytes * (S - 1) / S;
}

// Tensor parallelism: the engine holds this rank's pieces; full tensors are sliced on the way in
// and gathered from the group's pieces on the way out.
// Expert parallelism likewise keeps this rank's block of the experts (expert_parallel.cpp).
// Under both (expert_tensor_parallel_size 1) the tensor-parallel slice, then the ep block of it.
std::vector<float> tp_local(const Model& m, size_t i, const std::vector<float>& full) {
  if (!m.tp()) return ep_local(m, i, full);
  std::vector<float> t = sdk::tp_slice(*m.tp(), i, full);
  return m.ep() ? ep_local(m, i, t) : t;
}
// This rank's tensors (in engine order) from the whole model's: tensor-parallel slices, and
// under pipeline parallelism only the stage's.
std::vector<std::vector<float>> tp_local_all(const Model& m, const std::vector<std::vector<float>>& full) {
  if (!m.tp() && !m.ep() && !m.pp()) return full;
  if (full.size() != m.desc.params.size())
    throw Error(RLH_E_INTERNAL, "model parallelism: " + std::to_string(full.size()) + " tensors for " +
                                    std::to_string(m.desc.params.size()) + " parameters");
  std::vector<std::vector<float>> out;
  if (!m.pp()) {
    for (size_t i = 0; i < full.size(); ++i) out.push_back(tp_local(m, i, full[i]));
    return out;
  }
  for (int64_t i : m.pp()->full_index)
    out.push_back(m.tp() || m.ep() ? tp_local(m, size_t(i), full[size_t(i)]) : full[size_t(i)]);
  return out;
}
// Parameter i in full from every tensor-parallel rank's piece (collective over the tp group;
// a replicated tensor is this rank's own).
std::vector<float> tp_full(const Model& m, size_t i, std::span<const float> local) {
  std::vector<float> experts;  // under both: the ep blocks gathered first (a tp piece that is whole)
  if (m.ep()) {
    experts = ep_full(m, i, local);
    if (!m.tp()) return experts;
    local = experts;
  }
  const sdk::TpSplit split = m.tp()->pieces[i].split;
  if (split == sdk::TpSplit::replicated || split == sdk::TpSplit::replicated_sum || split == sdk::TpSplit::experts_whole)
    return std::vector<float>(local.begin(), local.end());
  const int T = m.dp->tp_size();
  const int64_t n = int64_t(local.size());
  std::vector<float> all(size_t(n * T)), full(size_t(numel(m.desc.params[i].shape)));
  FloatView in(const_cast<float*>(local.data()), n), out(all.data(), n * T);
  m.dp->tp.all_gather(*in, *out);
  for (int r = 0; r < T; ++r)
    sdk::tp_place(m.tp_layouts[size_t(r)], i, std::span<const float>(all.data() + int64_t(r) * n, size_t(n)), full);
  return full;
}

// Whole-model parameter i in full on every rank, from this rank's view `local(j)` of its engine
// parameter j: the tensor-parallel pieces gathered, and under pipeline parallelism broadcast
// from the stage that owns it (collective over the tp and pp groups).
std::vector<float> full_param(const Model& m, size_t i, const std::function<std::span<const float>(size_t)>& local) {
  auto mine = [&](size_t j) {
    const std::span<const float> l = local(j);
    return m.tp() || m.ep() ? tp_full(m, i, l) : std::vector<float>(l.begin(), l.end());
  };
  if (!m.pp()) return mine(i);
  const int owner = int(m.pp()->owner[i]);
  std::vector<float> full = m.dp->pp_rank() == owner ? mine(size_t(m.pp()->local_index[i]))
                                                     : std::vector<float>(size_t(numel(m.desc.params[i].shape)));
  FloatView v(full.data(), int64_t(full.size()));
  m.dp->pp.broadcast(*v, owner);
  return full;
}

}  // namespace

// A device model under tensor parallelism holds this rank's pieces (DeviceEngineOptions::tp):
// what the backend moves in and out whole is sliced on the way in and gathered over the host tp
// group on the way out, as for the CPU engine above. (Nothing else of model parallelism runs on
// the device: place_on_device keeps pipeline, expert and context parallelism on the CPU engine.)
std::vector<std::vector<float>> device_parameters(Model& m) {
  std::vector<std::vector<float>> local = m.device->parameters();
  if (!m.tp()) return local;
  if (local.size() != m.desc.params.size())
    throw Error(RLH_E_INTERNAL, "tensor parallelism on the device: " + std::to_string(local.size()) +
                                    " tensors for " + std::to_string(m.desc.params.size()) + " parameters");
  std::vector<std::vector<float>> full(local.size());
  for (size_t i = 0; i < local.size(); ++i) {
    full[i] = tp_full(m, i, local[i]);  // collective over the tp group, parameter by parameter
    std::vector<float>().swap(local[i]);
  }
  return full;
}

void device_load_parameters(Model& m, const std::vector<std::vector<float>>& full) {
  m.device->load_parameters(m.tp() ? tp_local_all(m, full) : full);
}

DeviceEngine::AdamState device_adam_state(Model& m) {
  DeviceEngine::AdamState s = m.device->adam_state();  // collective over dp with the distributed optimizer
  if (!m.tp()) return s;
  for (std::vector<std::vector<float>>* part : {&s.exp_avg, &s.exp_avg_sq}) {
    if (part->size() != m.desc.params.size())
      throw Error(RLH_E_INTERNAL, "tensor parallelism on the device: optimizer state of " + std::to_string(part->size()) +
                                      " tensors for " + std::to_string(m.desc.params.size()) + " parameters");
    for (size_t i = 0; i < part->size(); ++i) {
      // A parameter without updates has zero moments on every rank: zeros in full, no gather
      // (every rank skips the same ones, so the gathers still meet).
      (*part)[i] = without_update(m, m.desc.params[i]) ? std::vector<float>(size_t(numel(m.desc.params[i].shape)), 0.0f)
                                                       : tp_full(m, i, (*part)[i]);
    }
  }
  return s;
}

void device_load_adam_state(Model& m, const DeviceEngine::AdamState& full) {
  if (!m.tp()) return m.device->load_adam_state(full);
  m.device->load_adam_state(DeviceEngine::AdamState{full.step, tp_local_all(m, full.exp_avg), tp_local_all(m, full.exp_avg_sq)});
}

int64_t local_param(const Model& m, size_t i) { return m.pp() ? m.pp()->local_index.at(i) : int64_t(i); }
const sdk::ParamDesc& model_param(const Model& m, size_t j) {
  return m.desc.params.at(m.pp() ? size_t(m.pp()->full_index.at(j)) : j);
}

void prepare_data_parallel(Backend& b, Model& m, engine::EngineOptions& eo) {
  if (!b.dp) return;
  m.dp = b.dp.get();
  const BackendConfig::Parallel& p = m.config.parallel;
  if (p.fsdp) {
    m.dp_mode = Model::Dp::fsdp;
    m.fsdp = std::make_unique<FsdpStore>(*m.dp, m.state_alloc, m.alloc);
    eo.units = m.fsdp.get();
  } else if (p.distributed_optimizer) {
    m.dp_mode = Model::Dp::distributed_optimizer;
    eo.pad_storage_to = m.dp->size();  // equal blocks of the gradient buffer
  } else {
    m.dp_mode = Model::Dp::ddp;
  }
}

void finish_data_parallel(Model& m, const std::vector<std::vector<float>>& weights) {
  engine::Engine& e = *m.engine;
  const auto updated = [&m](size_t i) { return !without_update(m, model_param(m, i)); };
  const bool decay_1d = m.config.optimizer ? m.config.optimizer->decay_1d_params : true;
  switch (m.dp_mode) {
    case Model::Dp::none: return;
    case Model::Dp::fsdp: {
      std::vector<std::pair<int64_t, int64_t>> units;
      for (int64_t u = 0; u < e.num_units(); ++u) units.push_back(e.unit_range(u));
      m.shards = std::make_unique<ShardLayout>(e, units, m.dp->shard.rank(), m.dp->shard.size(), updated, decay_1d);
      m.fsdp->bind(*m.shards);
      dp_load_parameters(m, weights);
      break;
    }
    case Model::Dp::distributed_optimizer: {
      e.load_parameters(tp_local_all(m, weights));
      const int64_t padded = int64_t(e.flat_params().size());
      if (m.ep()) {  // the dense part over the data-parallel group, the experts over expert dp
        const int64_t eb = e.expert_range().first;
        m.shards = std::make_unique<ShardLayout>(
            e, std::vector<std::pair<int64_t, int64_t>>{{0, eb}, {eb, padded}},
            std::vector<std::pair<int, int>>{{m.dp->rank(), m.dp->size()}, {m.dp->edp.rank(), m.dp->edp.size()}}, updated,
            decay_1d);
      } else {
        m.shards = std::make_unique<ShardLayout>(e, std::vector<std::pair<int64_t, int64_t>>{{0, padded}}, m.dp->rank(),
                                                 m.dp->size(), updated, decay_1d);
      }
      m.grad_shard = engine::Buffer<float>(m.state_alloc, size_t(m.shards->elements()));
      std::memset(m.grad_shard.data(), 0, m.grad_shard.size() * sizeof(float));
      break;
    }
    case Model::Dp::ddp:
      e.load_parameters(tp_local_all(m, weights));
      m.shards = std::make_unique<ShardLayout>(e, std::vector<std::pair<int64_t, int64_t>>{{0, e.num_elements()}}, 0, 1,
                                               updated, decay_1d);
      break;
  }
  if (m.trainable)
    m.shard_opt = std::make_unique<ShardOptimizer>(*m.config.optimizer, m.config.schedule, *m.shards, *m.ops, m.state_alloc);
}

DpStepResult dp_train_step(Model& m, const std::vector<engine::MicroBatch>& views, engine::StepOptions so,
                           const engine::LossFn& loss, bool eval_only, double lr_override) {
  const DpGroups& g = *m.dp;
  DpStepResult out;
  engine::StepResult& r = out.r;
  // The MoE auxiliary losses are normalised by the global batch's counts; every rank runs as
  // many micro-batches as the rank with most (FSDP: its gathers and reductions are per
  // micro-batch).
  const int S = g.size();
  const int64_t cp_bytes0 = m.cp_comm ? m.cp_comm->bytes() : 0;
  const double cp_seconds0 = m.cp_comm ? m.cp_comm->seconds() : 0;
  const int64_t tp_bytes0 = m.tp_comm ? m.tp_comm->bytes() : 0;
  const int64_t pp_bytes0 = m.pp_bytes;
  const double tp_seconds0 = m.tp_comm ? m.tp_comm->seconds() : 0;
  // (Under expert tensor parallelism the etp group's row exchanges count as the ep group's.)
  const auto ep_bytes = [&m] { return (m.ep_comm ? m.ep_comm->bytes() : 0) + (m.etp_comm ? m.etp_comm->bytes() : 0); };
  const auto ep_seconds = [&m] {
    return (m.ep_comm ? m.ep_comm->seconds() : 0) + (m.etp_comm ? m.etp_comm->seconds() : 0);
  };
  const int64_t ep_bytes0 = ep_bytes();
  const double ep_seconds0 = ep_seconds();
  const int64_t fsdp_bytes0 = m.fsdp ? m.fsdp->bytes_gathered() + m.fsdp->bytes_reduced() : 0;
  const double fsdp_seconds0 = m.fsdp ? m.fsdp->comm_seconds() : 0;
  // Times a collective of this function into out.comm_seconds.
  const auto timed = [&out](auto&& call) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    out.comm_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  // The counts over the data-parallel ranks only: a cp group's ranks hold the same batch.
  const engine::MoeNormCounts local = engine::moe_norm_counts(views, so);
  double counts[2] = {local.tokens, local.sequences};
  timed([&] { g.sums().all_reduce(std::span<double>(counts, 2), RLH_REDUCE_SUM); });
  so.moe_global_tokens = int64_t(counts[0]);
  so.moe_global_sequences = int64_t(counts[1]);
  int64_t most[1] = {int64_t(views.size())};
  timed([&] { g.dp.all_reduce(std::span<int64_t>(most, 1), RLH_REDUCE_MAX); });
  out.comm_bytes += ring_bytes(2 * 8, g.sums().size(), true) + ring_bytes(8, S, true);

  float* grads = nullptr;
  if (m.device) {
    // The device engine sums the gradients over its device group and applies the same update
    // on every rank (DDP), or its block of it (distributed optimizer; device_engine.hpp).
    const int64_t bytes0 = m.device->dp_bytes(), tp_bytes_before = m.device->tp_bytes();
    const double seconds0 = m.device->dp_seconds(), tp_seconds_before = m.device->tp_seconds();
    out.info = m.next_update(lr_override);
    so.apply_optimizer = !eval_only;
    so.lr = out.info.lr;
    so.group_microbatches = most[0];  // FSDP's per-unit collectives: the idle passes' count
    r = m.device->train_step(views, so, out.info.weight_decay, loss);
    out.updated = so.apply_optimizer && !r.skipped;
    out.comm_bytes += m.device->dp_bytes() - bytes0;
    out.comm_seconds += m.device->dp_seconds() - seconds0;
    // Tensor parallelism on the device: its group's sums and the head's gathers.
    out.tp_comm_bytes += m.device->tp_bytes() - tp_bytes_before;
    out.tp_comm_seconds += m.device->tp_seconds() - tp_seconds_before;
  } else if (m.dp_mode == Model::Dp::fsdp) {
    m.fsdp->begin_step();
    try {
      if (!views.empty()) r = m.engine->train_step(views, so, loss);
      for (int64_t k = int64_t(views.size()); k < most[0]; ++k) m.fsdp->idle_microbatch();
    } catch (...) {
      m.fsdp->reset();
      throw;
    }
    m.fsdp->end_step();
    grads = m.fsdp->grad_shard();
  } else {
    if (m.pp())
      r = pp_train_step(m, views, so, loss);  // the 1F1B schedule over the stages (pp_model.cpp)
    else if (!views.empty())
      r = m.engine->train_step(views, so, loss);
    else
      m.engine->zero_grad();
    // Expert parallelism: a rank out of micro-batches still runs its experts for its peers' rows
    // (under pipeline parallelism inside the schedule).
    if (m.ep() && !m.pp())
      for (int64_t k = int64_t(views.size()); k < most[0]; ++k) m.engine->ep_idle_microbatch(true);
    std::span<float> flat = m.engine->flat_grads();
    if (m.dp_mode == Model::Dp::distributed_optimizer) {
      // Each segment (the experts apart under expert parallelism) over its group.
      for (size_t j = 0; j < m.shards->segments().size(); ++j) {
        const ShardSegment& sg = m.shards->segments()[j];
        const sdk::Comm& c = *segment_comm(m, j);
        FloatView in(flat.data() + sg.begin, sg.block * sg.size), shard(m.grad_shard.data() + sg.at, sg.block);
        timed([&] { c.reduce_scatter(*in, *shard, RLH_REDUCE_SUM); });
        out.comm_bytes += ring_bytes(sg.block * sg.size * int64_t(sizeof(float)), sg.size);
      }
      grads = m.grad_shard.data();
    } else {
      // Dense gradients over the data-parallel group; under expert parallelism the experts'
      // over the expert data-parallel group (the ranks holding the same experts).
      const int64_t eb = m.ep() ? m.engine->expert_range().first : int64_t(flat.size());
      FloatView dense(flat.data(), eb);
      timed([&] { g.dp.all_reduce(*dense, RLH_REDUCE_SUM); });
      out.comm_bytes += ring_bytes(eb * int64_t(sizeof(float)), S, true);
      if (m.ep() && g.edp.size() > 1) {
        FloatView experts(flat.data() + eb, int64_t(flat.size()) - eb);
        timed([&] { g.edp.all_reduce(*experts, RLH_REDUCE_SUM); });
        out.comm_bytes += ring_bytes((int64_t(flat.size()) - eb) * int64_t(sizeof(float)), g.edp.size(), true);
      }
      grads = flat.data();
    }
  }
  // The global gradient norm over the updated parameters: shards' sums of squares summed.
  // Under tensor parallelism each parameter's squares are weighted (replicated tensors count
  // once over the group) and summed over the tp group too. (A device engine did all of this.)
  if (!m.device) {
    double ss[1] = {0}, ss_experts[1] = {0};
    const int64_t experts_at = m.ep() ? m.engine->expert_range().first : std::numeric_limits<int64_t>::max();
    // (A run may reach from the dense part into the experts: a stage's embedding is next to them.)
    for (const ShardRun& run : m.shards->runs()) {
      const int64_t dense = std::clamp<int64_t>(experts_at - run.flat, 0, run.n);
      if (dense > 0) ss[0] += m.engine->grad_sumsq(std::span<const float>(grads + run.at, size_t(dense)), run.flat);
      if (dense < run.n)
        ss_experts[0] += m.engine->grad_sumsq(std::span<const float>(grads + run.at + dense, size_t(run.n - dense)),
                                              run.flat + dense);
    }
    // DDP under expert parallelism: every rank holds the dense gradients whole and its ep rank's
    // experts whole: those are summed over the ep group. (The distributed optimizer's shards of
    // both are summed over the data-parallel group, which holds every ep rank.)
    // Under tensor parallelism with the experts whole on their ep rank (expert_tensor_parallel_size
    // 1) or cut over an etp group smaller than the tp group, the ep group holds tp ranks, which
    // the data-parallel group does not: the experts (norm weight 1) are summed over expert dp
    // (the distributed optimizer's shards), ep and etp (each rank's blocks) apart, the dense part
    // as under TP. (With etp = tp the ep group is within the data-parallel ranks of one tp rank
    // and the experts' tp pieces are summed over tp with the rest.)
    const bool experts_apart = m.ep() && m.tp() && m.tp()->expert_size < m.tp()->size;
    if (experts_apart && m.dp_mode == Model::Dp::distributed_optimizer) {
      timed([&] { g.edp.all_reduce(std::span<double>(ss_experts, 1), RLH_REDUCE_SUM); });
      out.comm_bytes += ring_bytes(8, g.edp.size(), true);
    }
    if (m.ep() && (m.dp_mode == Model::Dp::ddp || experts_apart)) {
      timed([&] { g.ep.all_reduce(std::span<double>(ss_experts, 1), RLH_REDUCE_SUM); });
      out.comm_bytes += ring_bytes(8, g.ep.size(), true);
    }
    if (experts_apart && g.etp.size() > 1) {
      timed([&] { g.etp.all_reduce(std::span<double>(ss_experts, 1), RLH_REDUCE_SUM); });
      out.comm_bytes += ring_bytes(8, g.etp.size(), true);
    }
    if (!experts_apart) ss[0] += ss_experts[0];
    if (const sdk::Comm* c = shard_comm(m)) {
      timed([&] { c->all_reduce(std::span<double>(ss, 1), RLH_REDUCE_SUM); });
      out.comm_bytes += ring_bytes(8, c->size(), true);
    }
    if (m.tp()) timed([&] { m.tp_comm->all_reduce_sum(ss, 1); });
    if (experts_apart) ss[0] += ss_experts[0];
    if (m.pp()) {  // each stage's parameters (a tied embedding counted on the first stage only)
      timed([&] { m.dp->pp.all_reduce(std::span<double>(ss, 1), RLH_REDUCE_SUM); });
      m.pp_bytes += ring_bytes(8, m.dp->pp_size(), true);
    }
    r.grad_norm = std::sqrt(ss[0]);
    const double max_norm = m.config.optimizer ? m.config.optimizer->max_grad_norm : 0.0;
    r.clip_coef = max_norm > 0 ? std::min(1.0, max_norm / (r.grad_norm + 1e-6)) : 1.0;
    r.skipped = !std::isfinite(r.grad_norm);
    if (m.shard_opt) {
      if (!eval_only && !r.skipped) {
        float* params = m.dp_mode == Model::Dp::fsdp ? m.fsdp->param_shard() : m.engine->flat_params().data();
        out.info = m.shard_opt->step(lr_override, r.clip_coef, params, m.dp_mode != Model::Dp::fsdp, grads);
        out.updated = true;
        if (m.dp_mode == Model::Dp::distributed_optimizer) {
          // The updated blocks back to every rank of each segment's group, in place.
          std::span<float> flat = m.engine->flat_params();
          for (size_t j = 0; j < m.shards->segments().size(); ++j) {
            const ShardSegment& sg = m.shards->segments()[j];
            const sdk::Comm& c = *segment_comm(m, j);
            FloatView mine(flat.data() + sg.begin + int64_t(sg.rank) * sg.block, sg.block),
                all(flat.data() + sg.begin, sg.block * sg.size);
            timed([&] { c.all_gather(*mine, *all); });
            out.comm_bytes += ring_bytes(sg.block * sg.size * int64_t(sizeof(float)), sg.size);
          }
        }
      } else {
        out.info = m.shard_opt->next(lr_override);
      }
    }
  }
  // Loss, tokens and the engine's metrics of the whole global batch (over the data-parallel
  // ranks without context parallelism's: a cp group's ranks computed the same loss).
  double sums[2] = {r.loss, double(r.tokens)};
  g.sums().all_reduce(std::span<double>(sums, 2), RLH_REDUCE_SUM);
  r.loss = sums[0];
  r.tokens = int64_t(sums[1]);
  r.metrics = all_reduce_named(g.sums(), r.metrics);
  r.step = m.version();
  out.comm_bytes += ring_bytes(2 * 8, g.sums().size(), true);
  if (m.cp_comm) {
    out.cp_comm_bytes = m.cp_comm->bytes() - cp_bytes0;
    out.cp_comm_seconds = m.cp_comm->seconds() - cp_seconds0;
  }
  if (m.tp_comm) {  // the layers' and head's all-reduces, the shared gradients, the norm
    out.tp_comm_bytes += m.tp_comm->bytes() - tp_bytes0;
    out.tp_comm_seconds += m.tp_comm->seconds() - tp_seconds0;
  }
  if (m.ep_comm) {  // the dispatch and combine exchanges of every MoE layer
    out.ep_comm_bytes = ep_bytes() - ep_bytes0;
    out.ep_comm_seconds = ep_seconds() - ep_seconds0;
  }
  out.pp_comm_bytes = m.pp_bytes - pp_bytes0;
  if (m.fsdp) {
    out.comm_bytes += m.fsdp->bytes_gathered() + m.fsdp->bytes_reduced() - fsdp_bytes0;
    out.comm_seconds += m.fsdp->comm_seconds() - fsdp_seconds0;
  }
  return out;
}

void dp_forward(Model& m, size_t local_microbatches, const std::function<void(size_t)>& run,
                const engine::OutputRequest& req) {
  if (m.ep()) {  // the ep group's exchanges meet: a rank out of micro-batches runs its experts
    int64_t most[1] = {int64_t(local_microbatches)};
    m.dp->ep.all_reduce(std::span<int64_t>(most, 1), RLH_REDUCE_MAX);
    for (size_t i = 0; i < local_microbatches; ++i) run(i);
    for (int64_t k = int64_t(local_microbatches); k < most[0]; ++k) m.engine->ep_idle_microbatch(false);
    return;
  }
  if (m.dp_mode != Model::Dp::fsdp) {
    for (size_t i = 0; i < local_microbatches; ++i) run(i);
    return;
  }
  int64_t most[1] = {int64_t(local_microbatches)};
  m.dp->dp.all_reduce(std::span<int64_t>(most, 1), RLH_REDUCE_MAX);
  if (m.device) {  // the device engine gathers its units itself (engine_cuda's FSDP)
    for (size_t i = 0; i < local_microbatches; ++i) run(i);
    for (int64_t k = int64_t(local_microbatches); k < most[0]; ++k) m.device->idle_forward(req);
    return;
  }
  try {
    for (size_t i = 0; i < local_microbatches; ++i) run(i);
    for (int64_t k = int64_t(local_microbatches); k < most[0]; ++k) m.fsdp->idle_forward();
  } catch (...) {
    m.fsdp->reset();
    throw;
  }
}

void dp_visit_parameters(Model& m, const std::function<void(size_t, std::span<float>)>& fn) {
  const auto& params = m.desc.params;
  if (m.dp_mode != Model::Dp::fsdp) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (!m.tp() && !m.ep() && !m.pp()) {
        fn(i, m.engine->param(i));
        continue;
      }
      std::vector<float> full = full_param(m, i, [&](size_t j) { return std::span<const float>(m.engine->param(j)); });
      fn(i, full);
    }
    return;
  }
  // Unit by unit: one unit in full at a time.
  engine::Engine& e = *m.engine;
  for (int64_t u = 0; u < e.num_units(); ++u) {
    std::vector<float> full = m.fsdp->gather_unit(u);
    const int64_t begin = e.unit_range(u).first, end = e.unit_range(u).second;
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t o = e.param_offset(i);
      if (o < begin || o >= end) continue;
      fn(i, std::span<float>(full.data() + (o - begin), size_t(numel(params[i].shape))));
    }
  }
}

std::vector<std::vector<float>> dp_full_parameters(Model& m, bool keep) {
  std::vector<std::vector<float>> out(keep ? m.desc.params.size() : 0);
  dp_visit_parameters(m, [&](size_t i, std::span<float> w) {
    if (keep) out[i].assign(w.begin(), w.end());
  });
  return out;
}

namespace {

// A moment in full flat layout from its shards (collective; empty unless `keep`).
std::vector<float> gather_flat(const Model& m, const float* shard, bool keep) {
  const int64_t total = m.engine->num_elements();
  std::vector<float> flat(keep ? size_t(total) : 0);
  for (size_t j = 0; j < m.shards->segments().size(); ++j) {
    const ShardSegment& s = m.shards->segments()[j];
    const sdk::Comm* c = segment_comm(m, j);
    const int n = c != nullptr ? c->size() : 1;
    std::vector<float> full(size_t(s.block * n));
    if (c != nullptr) {
      FloatView in(const_cast<float*>(shard) + s.at, s.block), all(full.data(), int64_t(full.size()));
      c->all_gather(*in, *all);
    } else {
      std::memcpy(full.data(), shard + s.at, size_t(s.block) * sizeof(float));
    }
    if (keep) {
      const int64_t len = std::min(s.end, total) - s.begin;
      if (len > 0) std::memcpy(flat.data() + s.begin, full.data(), size_t(len) * sizeof(float));
    }
  }
  return flat;
}

}  // namespace

std::vector<Optimizer::StateTensor> dp_full_optimizer_state(Model& m, bool keep, std::vector<std::vector<float>>& storage) {
  std::vector<Optimizer::StateTensor> out;
  storage.clear();
  if (!m.shard_opt || !m.shard_opt->has_state()) return out;
  const bool adam = m.shard_opt->config().kind == OptimizerKind::adamw;
  std::vector<std::pair<const char*, const float*>> parts = {{adam ? "exp_avg" : "momentum_buffer", m.shard_opt->first()}};
  if (adam) parts.emplace_back("exp_avg_sq", m.shard_opt->second());
  storage.reserve(parts.size());
  if (m.tp() || m.ep() || m.pp()) {
    // This rank's moments in its local flat layout (every rank), then each parameter's pieces
    // gathered over the tp (or ep) group (and from its pipeline stage); only `keep` ranks hold the
    // full tensors.
    for (const auto& [prefix, shard] : parts) {
      const std::vector<float> flat = gather_flat(m, shard, true);
      for (size_t i = 0; i < m.desc.params.size(); ++i) {
        const sdk::ParamDesc& p = m.desc.params[i];
        if (without_update(m, p)) continue;
        std::vector<float> full = full_param(m, i, [&](size_t j) {
          const int64_t n = numel(m.engine->desc().params[j].shape);
          return std::span<const float>(flat.data() + m.engine->param_offset(j), size_t(n));
        });
        if (!keep) continue;
        storage.push_back(std::move(full));
        out.push_back(Optimizer::StateTensor{std::string(prefix) + "." + p.name, p.shape,
                                             {storage.back().data(), storage.back().size()}});
      }
    }
    return out;
  }
  for (const auto& [prefix, shard] : parts) {
    storage.push_back(gather_flat(m, shard, keep));
    if (!keep) continue;
    // The names and order of Optimizer::state(): updated parameters in description order.
    for (size_t i = 0; i < m.desc.params.size(); ++i) {
      const sdk::ParamDesc& p = m.desc.params[i];
      if (without_update(m, p)) continue;
      out.push_back(Optimizer::StateTensor{std::string(prefix) + "." + p.name, p.shape,
                                           {storage.back().data() + m.engine->param_offset(i), size_t(numel(p.shape))}});
    }
  }
  return out;
}

void dp_load_parameters(Model& m, const std::vector<std::vector<float>>& weights) {
  if (m.dp_mode != Model::Dp::fsdp) {
    m.engine->load_parameters(tp_local_all(m, weights));
    return;
  }
  if (weights.size() != m.desc.params.size())
    throw Error(RLH_E_INTERNAL, "dp_load_parameters: " + std::to_string(weights.size()) + " tensors for " +
                                    std::to_string(m.desc.params.size()) + " parameters");
  for (size_t i = 0; i < weights.size(); ++i)
    m.shards->scatter_param(m.engine->param_offset(i), weights[i].data(), int64_t(weights[i].size()), m.fsdp->param_shard());
}

void dp_load_optimizer(Model& m, const std::vector<std::vector<float>>& first, const std::vector<std::vector<float>>& second,
                       int64_t steps) {
  m.shard_opt = std::make_unique<ShardOptimizer>(*m.config.optimizer, m.config.schedule, *m.shards, *m.ops, m.state_alloc);
  m.shard_opt->set_steps(steps);
  if (first.empty()) return;  // saved before the first update: moments start from zero
  m.shard_opt->allocate_state();
  for (size_t i = 0; i < first.size(); ++i) {
    if (first[i].empty() || local_param(m, i) < 0) continue;  // another pipeline stage's
    const int64_t o = m.engine->param_offset(size_t(local_param(m, i)));
    const bool cut = m.tp() || m.ep();
    const std::vector<float> f = cut ? tp_local(m, i, first[i]) : first[i];
    m.shards->scatter_param(o, f.data(), int64_t(f.size()), m.shard_opt->first());
    if (!second.empty() && !second[i].empty() && m.shard_opt->second() != nullptr) {
      const std::vector<float> v = cut ? tp_local(m, i, second[i]) : second[i];
      m.shards->scatter_param(o, v.data(), int64_t(v.size()), m.shard_opt->second());
    }
  }
}

}  // namespace rlh::backend

namespace rlh::backend {

namespace {
void same_batch_over(const sdk::Comm& group, const char* kind, const rlh_batch& batch, const char* what);
}  // namespace

void tp_check_batch(const Model& m, const rlh_batch& batch, const char* what) {
  // Over the cp group, the tp group, then the pp group (a pipeline's stages run the same
  // micro-batches); every rank takes the same branches, so the collectives meet.
  if (m.dp != nullptr && m.dp->cp_size() > 1) same_batch_over(m.dp->cp, "context", batch, what);
  if (m.tp()) same_batch_over(m.dp->tp, "tensor", batch, what);
  if (m.pp()) same_batch_over(m.dp->pp, "pipeline", batch, what);
}

namespace {
void same_batch_over(const sdk::Comm& group, const char* kind, const rlh_batch& batch, const char* what) {
  // Token and sequence counts and an FNV-1a hash of ids and offsets: min and max over the group.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  };
  if (batch.num_tokens > 0 && batch.token_ids) mix(batch.token_ids, size_t(batch.num_tokens) * sizeof(int32_t));
  if (batch.seq_offsets) mix(batch.seq_offsets, size_t(batch.num_seqs + 1) * sizeof(int64_t));
  int64_t lo[3] = {batch.num_tokens, batch.num_seqs, int64_t(h >> 1)}, hi[3] = {lo[0], lo[1], lo[2]};
  group.all_reduce(std::span<int64_t>(lo, 3), RLH_REDUCE_MIN);
  group.all_reduce(std::span<int64_t>(hi, 3), RLH_REDUCE_MAX);
  const std::string k(kind);
  if (lo[0] != hi[0] || lo[1] != hi[1] || lo[2] != hi[2])
    throw Error(RLH_E_INVALID_ARGUMENT,
                std::string(what) + ": the ranks of a " + k + "-parallel group were given different batches (tokens " +
                    std::to_string(lo[0]) + ".." + std::to_string(hi[0]) + "); under " + k +
                    " parallelism every rank of a group takes its data-parallel rank's batch (the caller shards "
                    "over the data-parallel ranks the backend's data_parallel names)");
}
}  // namespace

}  // namespace rlh::backend
