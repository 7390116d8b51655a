// The engine's public face: construction, parameters, forward, and the train step
// (micro-batch loop, loss callback, global grad-norm clip, AdamW).
#include "rlhost/engine/engine.hpp"


#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "model.hpp"

namespace rlh::engine {

// ---------------------------------------------------------------------------------------------
// Allocator

void* CountingAllocator::allocate(size_t bytes) {
  void* p = std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64));
  if (!p) throw std::bad_alloc();
  const size_t now = live_.fetch_add(bytes) + bytes;
  size_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
  return p;
}

void CountingAllocator::deallocate(void* p, size_t bytes) {
  if (!p) return;
  std::free(p);
  live_.fetch_sub(bytes);
}

// ---------------------------------------------------------------------------------------------
// Batches

const rlh_tensor* MicroBatch::field(const std::string& name) const {
  for (const rlh_named_tensor& f : fields)
    if (f.name && name == f.name) return &f.tensor;
  return nullptr;
}

std::vector<MicroBatch> split_microbatches(std::span<const int32_t> ids,
                                           std::span<const int32_t> cu, int64_t max_tokens,
                                           std::vector<std::vector<int32_t>>* cu_storage) {
  std::vector<MicroBatch> out;
  cu_storage->clear();
  const size_t S = cu.size() - 1;
  size_t s = 0;
  // Reserve so the spans into cu_storage stay valid.
  cu_storage->reserve(S + 1);
  while (s < S) {
    size_t e = s + 1;
    while (e < S && cu[e + 1] - cu[s] <= max_tokens) ++e;
    std::vector<int32_t> local;
    for (size_t i = s; i <= e; ++i) local.push_back(cu[i] - cu[s]);
    cu_storage->push_back(std::move(local));
    MicroBatch mb;
    mb.input_ids = ids.subspan(size_t(cu[s]), size_t(cu[e] - cu[s]));
    mb.cu_seqlens = cu_storage->back();
    out.push_back(mb);
    s = e;
  }
  return out;
}

void accumulate_metrics(std::vector<std::pair<std::string, double>>& into,
                        const std::vector<std::pair<std::string, double>>& add) {
  for (const auto& metric : add) {
    // (no structured binding: clang 14 cannot capture one in the lambda)
    const std::string& name = metric.first;
    auto it = std::find_if(into.begin(), into.end(), [&](const auto& kv) { return kv.first == name; });
    if (it == into.end())
      into.emplace_back(name, metric.second);
    else
      it->second += metric.second;
  }
}

// ---------------------------------------------------------------------------------------------
// Engine

Engine::Engine(sdk::TransformerDesc desc, EngineOptions options)
    : impl_(std::make_unique<Impl>(std::move(desc), options)) {}
Engine::~Engine() = default;

const sdk::TransformerDesc& Engine::desc() const { return impl_->desc; }
Allocator& Engine::allocator() { return *impl_->alloc; }
CountingAllocator* Engine::counting_allocator() {
  return impl_->opt.allocator ? nullptr : &impl_->own_alloc;
}
size_t Engine::num_params() const { return impl_->desc.params.size(); }
int64_t Engine::num_elements() const { return impl_->total; }
int64_t Engine::step() const { return impl_->steps; }
int64_t Engine::routing_width() const { return impl_->route_width; }

namespace {
int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}
}  // namespace

namespace {
void own_storage(const UnitStore* store, const char* what) {
  if (store != nullptr)
    throw std::logic_error(std::string("engine: ") + what + ": the parameters are held by a UnitStore");
}
}  // namespace

std::span<float> Engine::param(size_t i) {
  own_storage(impl_->store, "param");
  return {impl_->params.data() + impl_->offset.at(i), size_t(numel(impl_->desc.params[i].shape))};
}
std::span<float> Engine::grad(size_t i) {
  own_storage(impl_->store, "grad");
  return {impl_->grads.data() + impl_->offset.at(i), size_t(numel(impl_->desc.params[i].shape))};
}
int64_t Engine::param_offset(size_t i) const { return impl_->offset.at(i); }
int64_t Engine::num_units() const { return impl_->L + 1; }
std::pair<int64_t, int64_t> Engine::unit_range(int64_t u) const {
  if (u < 0 || u > impl_->L) throw std::out_of_range("engine: unit " + std::to_string(u));
  return {impl_->unit_begin[size_t(u)], impl_->unit_begin[size_t(u) + 1]};
}
std::span<float> Engine::flat_params() {
  own_storage(impl_->store, "flat_params");
  return impl_->params.span();
}
std::span<float> Engine::flat_grads() {
  own_storage(impl_->store, "flat_grads");
  return impl_->grads.span();
}

void Engine::load_parameters(const std::vector<std::vector<float>>& tensors) {
  own_storage(impl_->store, "load_parameters");
  if (tensors.size() != num_params())
    throw std::invalid_argument("engine: load_parameters got " + std::to_string(tensors.size()) +
                                " tensors for " + std::to_string(num_params()) + " parameters");
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::span<float> dst = param(i);
    if (tensors[i].size() != dst.size())
      throw std::invalid_argument("engine: parameter " + impl_->desc.params[i].name +
                                  " has the wrong number of elements");
    std::memcpy(dst.data(), tensors[i].data(), dst.size() * sizeof(float));
  }
}

std::vector<std::vector<float>> Engine::save_parameters() const {
  own_storage(impl_->store, "save_parameters");
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < impl_->desc.params.size(); ++i) {
    const float* p = impl_->params.data() + impl_->offset[i];
    out.emplace_back(p, p + numel(impl_->desc.params[i].shape));
  }
  return out;
}

double Engine::grad_sumsq(std::span<const float> g, int64_t flat_begin) const {
  const Impl& m = *impl_;
  if (m.norm_w.empty()) return g.empty() ? 0.0 : m.ops->sumsq(g.data(), int64_t(g.size()));
  // Per parameter overlapping [flat_begin, flat_begin + n), with its weight (padding: none;
  // tensor parallelism's replicated tensors, a pipeline's second copy of a tied embedding).
  const int64_t end = flat_begin + int64_t(g.size());
  double ss = 0;
  for (size_t i = 0; i < m.desc.params.size(); ++i) {
    const int64_t b = std::max(flat_begin, m.offset[i]), e = std::min(end, m.offset[i] + numel(m.desc.params[i].shape));
    if (b < e && m.norm_w[i] != 0) ss += m.norm_w[i] * m.ops->sumsq(g.data() + (b - flat_begin), e - b);
  }
  return ss;
}

void Engine::zero_grad() {
  own_storage(impl_->store, "zero_grad");
  std::memset(impl_->grads.data(), 0, impl_->grads.size() * sizeof(float));
  impl_->grads_clear = true;
}

Outputs Engine::forward(const MicroBatch& whole, const OutputRequest& req) {
  Impl& m = *impl_;
  if (!m.run_head || (!m.run_embed && m.pp_x_in == nullptr))
    throw std::logic_error("engine: a pipeline stage runs through forward_stage");
  m.forget_units();  // an earlier call that threw may have left units marked held
  // This rank's share under CP; every sequence padded to a multiple of T under sequence
  // parallelism (cp_prepare at cp 1).
  const MicroBatch& mb = m.cp_on || m.sp_on ? m.cp_prepare(whole) : whole;
  m.forward(mb, req, false);
  const int64_t N = whole.num_tokens(), kraw = m.head.kraw, K = kraw - 1;
  const auto cu = whole.cu_seqlens;
  Outputs out;
  std::vector<float> rows;
  if (req.logprob) {
    out.logprob.resize(size_t(N));
    shift_to_outputs(m.cp_whole_rows(m.head.lp, N, rows), kraw, out.logprob.data(), 1, 1, cu);
  }
  if (req.entropy) {
    out.entropy.resize(size_t(N));
    shift_to_outputs(m.cp_whole_rows(m.head.ent, N, rows), 1, out.entropy.data(), 1, 1, cu);
  }
  if (req.processed_logprob) {
    out.processed_logprob.resize(size_t(N));
    shift_to_outputs(m.cp_whole_rows(m.head.lp_proc, N, rows), 1, out.processed_logprob.data(), 1, 1, cu);
  }
  if (req.logprob_at_ids) {
    out.ids_per_token = K;
    out.logprob_at_ids.resize(size_t(N * K));
    shift_to_outputs(m.head.lp + 1, kraw, out.logprob_at_ids.data(), K, K, cu);
  }
  if (req.value) {
    const float* val = m.cp_whole_rows(m.head.val, N, rows);
    out.value.assign(val, val + N);
  }
  if (req.routed_experts) {
    out.routing_width = m.route_width;
    out.routed_experts = m.whole_route_record(N);
  }
  if (req.logits) {  // [N, V]: for tests on small vocabularies
    out.logits.resize(size_t(N * m.V));
    m.ops->gemm(false, true, N, m.V, m.C, 1.f, m.head.xn, m.C, m.w(m.prog.head), m.C, 0.f,
                out.logits.data(), m.V);
    if (const double c = m.prog.logit_softcap; c > 0)  // Gemma-2: the logits HF returns are capped
      for (float& z : out.logits) z = float(c * std::tanh(double(z) / c));
  }
  m.drop_params(m.L);
  return out;
}

std::vector<std::pair<std::string, double>> moe_step_metrics(const MoeOptions& mo, double aux, double z,
                                                             double max_load) {
  std::vector<std::pair<std::string, double>> out;
  if (mo.aux_loss_coef != 0 && mo.load_balancing != MoeOptions::LoadBalancing::none)
    out.emplace_back("moe/aux_loss", aux);
  if (mo.z_loss_coef != 0) out.emplace_back("moe/z_loss", z);
  out.emplace_back("moe/max_expert_load", max_load);
  return out;
}

MoeNormCounts moe_norm_counts(std::span<const MicroBatch> mbs, const StepOptions& so) {
  int64_t tokens = 0, seqs = 0;
  for (const MicroBatch& mb : mbs) {
    tokens += mb.num_tokens();
    for (int64_t q = 0; q < mb.num_sequences(); ++q) seqs += mb.cu_seqlens[size_t(q) + 1] > mb.cu_seqlens[size_t(q)];
  }
  return {double(so.moe_global_tokens > 0 ? so.moe_global_tokens : tokens),
          double(so.moe_global_sequences > 0 ? so.moe_global_sequences : seqs)};
}

StepResult Engine::train_step(std::span<const MicroBatch> mbs, const StepOptions& so,
                              const LossFn& loss_fn) {
  Impl& m = *impl_;
  const OutputRequest& req = so.outputs;
  if (!req.logprob && !req.processed_logprob && !req.entropy && !req.logprob_at_ids && !req.value)
    throw std::invalid_argument("engine: a train step needs at least one differentiable output");
  if (req.logits) throw std::invalid_argument("engine: logits are a forward-only output");
  if (mbs.empty()) throw std::invalid_argument("engine: a train step needs micro-batches");
  if (m.pp_on) throw std::logic_error("engine: a pipeline stage trains through backward_stage");
  if (m.store != nullptr && so.apply_optimizer)
    throw std::invalid_argument("engine: with a UnitStore the update is the store owner's (apply_optimizer = false)");
  m.forget_units();
  if (m.store == nullptr && !m.grads_clear) zero_grad();  // after an optimizer step AdamW has cleared them already
  m.grads_clear = false;
  StepResult r;
  // MoE auxiliary losses: normalised by the global counts (this step's when not given).
  const MoeNormCounts moe_counts = moe_norm_counts(mbs, so);
  m.moe_tokens = moe_counts.tokens;
  m.moe_seqs = moe_counts.sequences;
  m.moe_aux = m.moe_z = m.moe_max_load = 0;
  struct TrainFlag {  // the losses belong to train steps only, whatever leaves this scope
    bool& f;
    explicit TrainFlag(bool& b) : f(b) { f = true; }
    ~TrainFlag() { f = false; }
  } train_flag(m.moe_train);
  if (m.cp_on && so.apply_optimizer)
    throw std::invalid_argument("engine: under context parallelism the gradients are partial sums; the owner reduces "
                                "them over the group and applies the update (apply_optimizer = false)");
  for (size_t i = 0; i < mbs.size(); ++i) {
    const MicroBatch& whole = mbs[i];
    const MicroBatch& mb = m.cp_on || m.sp_on ? m.cp_prepare(whole) : whole;
    m.forward(mb, req, !m.opt.recompute);
    if (req.routed_experts) r.routed_experts.push_back(m.whole_route_record(whole.num_tokens()));
    const LossResult lr = m.call_loss(whole, int64_t(i), int64_t(mbs.size()), so, loss_fn);
    r.loss += lr.loss;
    accumulate_metrics(r.metrics, lr.metrics);
    m.backward(mb, req);
    r.tokens += whole.num_tokens();  // the micro-batch's tokens, not this rank's cp/sp rows
  }

  // Context parallelism: each rank's auxiliary losses are its tokens' part; every rank of the
  // group reports the sum, as it reports the group's loss (the backend sums over dp only).
  // Likewise each tensor-parallel rank's rows under expert parallelism with tensor parallelism.
  if ((m.cp_on || m.moe_own_rows) && m.route_width > 0) {
    double v[2] = {m.moe_aux, m.moe_z};
    if (m.cp_on) m.opt.cp_comm->all_reduce_sum(v, 2);
    if (m.moe_own_rows) m.opt.tp_comm->all_reduce_sum(v, 2);
    m.moe_aux = v[0];
    m.moe_z = v[1];
  }
  if (m.route_width > 0)
    for (auto& kv : moe_step_metrics(m.opt.moe, m.moe_aux, m.moe_z, m.moe_max_load)) r.metrics.push_back(std::move(kv));

  // With a UnitStore the gradients were handed over unit by unit: their norm is the owner's.
  if (m.store != nullptr) {
    r.step = m.steps;
    return r;
  }
  // Tensor parallelism: the gradients the group shares are summed first.
  if (m.tp_on) m.tp_sync_grads();
  // Global gradient norm over trainable parameters, then clip + AdamW in one pass.
  double ss = 0;
  for (const Impl::Run& run : m.runs)
    if (run.trainable) ss += grad_sumsq({m.grads.data() + run.begin, size_t(run.end - run.begin)}, run.begin);
  if (m.tp_on) m.opt.tp_comm->all_reduce_sum(&ss, 1);
  r.grad_norm = std::sqrt(ss);
  const double max_norm = m.opt.optimizer.max_grad_norm;
  r.clip_coef = max_norm > 0 ? std::min(1.0, max_norm / (r.grad_norm + 1e-6)) : 1.0;
  if (!std::isfinite(r.grad_norm)) {
    r.skipped = true;  // never apply a non-finite update
  } else if (so.apply_optimizer) {
    m.optimizer_step(so, r.clip_coef);
  }
  r.step = m.steps;
  return r;
}

// `whole` is the micro-batch as the caller gave it. Under context or sequence parallelism the
// head's buffers hold this rank's rows of its prepared (padded, split) copy: the outputs are
// gathered into the whole micro-batch's token order for the callback, and this rank takes back
// the gradients of its own rows.
LossResult Engine::Impl::call_loss(const MicroBatch& whole, int64_t index, int64_t count, const StepOptions& so,
                                   const LossFn& loss_fn) {
  const OutputRequest& req = so.outputs;
  const int64_t N = whole.num_tokens(), kraw = head.kraw, K = kraw - 1;
  const auto cu = whole.cu_seqlens;
  const bool split = cp_on || sp_on;
  std::vector<float> rows[4], val, dval;  // split: the whole micro-batch's head rows

  // Outputs and their gradients in output alignment, for the callback: logprob, entropy,
  // processed logprob [N] each, logprob_at_ids [N, K]; then the same again for gradients.
  const int64_t per = 3 * N + N * K;
  Buffer<float> views(*alloc, size_t(2 * per));
  std::memset(views.data(), 0, size_t(2 * per) * sizeof(float));
  float* lp = views.data();
  float* ent = lp + N;
  float* proc = ent + N;
  float* ids = proc + N;
  float* dlp = views.data() + per;
  float* dent = dlp + N;
  float* dproc = dent + N;
  float* dids = dproc + N;
  OutputViews ov;
  OutputGrads og;
  if (req.logprob) {
    shift_to_outputs(cp_whole_rows(head.lp, N, rows[0]), kraw, lp, 1, 1, cu);
    ov.logprob = {lp, size_t(N)};
    og.logprob = {dlp, size_t(N)};
  }
  if (req.entropy) {
    shift_to_outputs(cp_whole_rows(head.ent, N, rows[1]), 1, ent, 1, 1, cu);
    ov.entropy = {ent, size_t(N)};
    og.entropy = {dent, size_t(N)};
  }
  if (req.processed_logprob) {
    shift_to_outputs(cp_whole_rows(head.lp_proc, N, rows[2]), 1, proc, 1, 1, cu);
    ov.processed_logprob = {proc, size_t(N)};
    og.processed_logprob = {dproc, size_t(N)};
  }
  if (req.logprob_at_ids) {
    shift_to_outputs(head.lp + 1, kraw, ids, K, K, cu);
    ov.logprob_at_ids = {ids, size_t(N * K)};
    ov.ids_per_token = K;
    og.logprob_at_ids = {dids, size_t(N * K)};
  }
  if (req.value && split) {  // output alignment; the whole micro-batch's rows
    dval.assign(size_t(N), 0.f);
    ov.value = {cp_whole_rows(head.val, N, val), size_t(N)};
    og.value = {dval.data(), size_t(N)};
  } else if (req.value) {  // already in output alignment: the callback reads and writes the head's buffers
    std::memset(head.dval, 0, size_t(N) * sizeof(float));
    ov.value = {head.val, size_t(N)};
    og.value = {head.dval, size_t(N)};
  }
  LossContext ctx{&whole, index, count, so.global_tokens, so.global_sequences};
  LossResult lr = loss_fn(ctx, ov, og);
  if (split) {
    // The whole micro-batch's output gradients; this rank backpropagates its own rows.
    std::vector<float>& k = rows[3];
    k.resize(size_t(N));
    const std::pair<const float*, float*> grads[] = {{dlp, head.dlp}, {dent, head.dent}, {dproc, head.dlp_proc}};
    for (const auto& [d, head_rows] : grads) {
      shift_to_kernel(d, 1, k.data(), 1, 1, cu);
      cp_take_rows(k.data(), 1, head_rows, 1);
    }
    if (req.value) cp_take_rows(dval.data(), 1, head.dval, 1);
  } else {
    shift_to_kernel(dlp, 1, head.dlp, kraw, 1, cu);
    if (K > 0) shift_to_kernel(dids, K, head.dlp + 1, kraw, K, cu);
    shift_to_kernel(dent, 1, head.dent, 1, 1, cu);
    shift_to_kernel(dproc, 1, head.dlp_proc, 1, 1, cu);
  }
  return lr;
}

// AdamW over every trainable tensor (fp32 master weights are the parameters themselves).
// Optimizer state is allocated on the first step, so inference-only use never pays for it.
void Engine::Impl::optimizer_step(const StepOptions& so, double clip_coef) {
  if (adam_m.size() == 0) {
    adam_m = Buffer<float>(*state_alloc, size_t(total));
    adam_v = Buffer<float>(*state_alloc, size_t(total));
    std::memset(adam_m.data(), 0, size_t(total) * sizeof(float));
    std::memset(adam_v.data(), 0, size_t(total) * sizeof(float));
  }
  ++steps;
  const OptimizerOptions& o = opt.optimizer;
  for (const Run& run : runs) {
    const int64_t n = run.end - run.begin;
    if (!run.trainable) {  // buffers: no update, and their gradient is kept at zero
      std::memset(grads.data() + run.begin, 0, size_t(n) * sizeof(float));
      continue;
    }
    // zero_grad: the pass that reads g also clears it for the next step (no separate memset).
    Ops::AdamW a{so.lr, o.beta1, o.beta2, o.eps, run.decay ? o.weight_decay : 0.0,
                 steps, clip_coef, true};
    ops->adamw(params.data() + run.begin, grads.data() + run.begin, adam_m.data() + run.begin,
               adam_v.data() + run.begin, n, a);
  }
  grads_clear = true;
}

}  // namespace rlh::engine
