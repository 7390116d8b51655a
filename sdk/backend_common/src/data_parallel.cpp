// Data-parallel groups, shard layouts, the shard optimizer and the FSDP unit store
// (data_parallel.hpp).
#include "rlhost/backend_common/data_parallel.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <set>

#include "rlhost/sdk/launch_env.hpp"
#include "rlhost/sdk/parallel_groups.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::backend {

using sdk::Error;

namespace {
int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}
}  // namespace

FloatView::FloatView(float* p, int64_t count) : n(count) {
  static const int64_t kOne = 1;
  t.data = p;
  t.device = {RLH_DEVICE_CPU, 0};
  t.ndim = 1;
  t.dtype = {RLH_DTYPE_FLOAT, 32, 1};
  t.shape = &n;
  t.strides = const_cast<int64_t*>(&kOne);
}

int launched_world_size() { return sdk::detect_launch().size; }

std::unique_ptr<DpGroups> make_dp_groups(const sdk::Host& host, int64_t dp_replicate, const std::string& who,
                                         int64_t tp, int64_t cp, int64_t pp, int64_t ep, int64_t etp) {
  sdk::Comm world = sdk::Comm::world(host);
  sdk::ParallelSizes sizes;
  sizes.dp_replicate = dp_replicate;
  sizes.tp = tp;
  sizes.cp = cp;
  sizes.pp = pp;
  sizes.ep = ep;
  sizes.etp = etp;
  sdk::ParallelComms pc;
  std::vector<sdk::GroupKind> kinds = {sdk::GroupKind::dp_cp, sdk::GroupKind::dp_cp_shard, sdk::GroupKind::dp_cp_replicate,
                                       sdk::GroupKind::tp, sdk::GroupKind::pp, sdk::GroupKind::embedding};
  if (cp > 1) kinds.insert(kinds.end(), {sdk::GroupKind::cp, sdk::GroupKind::dp});
  if (ep > 1) kinds.insert(kinds.end(), {sdk::GroupKind::ep, sdk::GroupKind::expert_dp, sdk::GroupKind::expert_tp});
  try {
    pc = sdk::make_parallel_comms(world, sizes, kinds);
  } catch (const Error& e) {
    throw Error(e.code(), who + ": " + e.what());
  }
  auto g = std::make_unique<DpGroups>();
  auto take = [&](sdk::GroupKind k) { return std::move(pc.comms[static_cast<int>(k)]); };
  g->dp = take(sdk::GroupKind::dp_cp);
  g->tp = take(sdk::GroupKind::tp);
  g->pp = take(sdk::GroupKind::pp);
  g->embedding = take(sdk::GroupKind::embedding);
  g->all = world.split(0, world.rank(), "world");
  if (ep > 1) {
    g->ep = take(sdk::GroupKind::ep);
    g->edp = take(sdk::GroupKind::expert_dp);
    g->etp = take(sdk::GroupKind::expert_tp);
  }
  if (cp > 1) {
    g->cp = take(sdk::GroupKind::cp);
    g->dp_only = take(sdk::GroupKind::dp);
  }
  if (dp_replicate > 1) {
    g->shard = take(sdk::GroupKind::dp_cp_shard);
    g->replicate = take(sdk::GroupKind::dp_cp_replicate);
  } else {
    g->shard = g->dp.split(0, g->dp.rank(), "dp shard");
  }
  return g;
}

// ---------------------------------------------------------------------------------------------
// CommDeviceDp

namespace {
// A contiguous 1-d tensor of n elements on `device` (float32, or bf16 moved as its bits).
struct DeviceView {
  int64_t n;
  int64_t one = 1;
  rlh_tensor t{};
  DeviceView(const void* p, int64_t count, rlh_device device, int element_bytes) : n(count) {
    t.data = const_cast<void*>(p);
    t.device = device;
    t.ndim = 1;
    t.dtype = element_bytes == 2 ? rlh_dtype{RLH_DTYPE_BFLOAT, 16, 1} : rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
    t.shape = &n;
    t.strides = &one;
  }
  DeviceView(const DeviceView&) = delete;
};
}  // namespace

void CommDeviceDp::all_reduce_sum(float* data, int64_t n, void* stream) {
  DeviceView v(data, n, device_, 4);
  c_.all_reduce(v.t, RLH_REDUCE_SUM, stream);
}

void CommDeviceDp::reduce_scatter_sum(const float* in, float* out, int64_t block, void* stream) {
  DeviceView a(in, block * c_.size(), device_, 4), b(out, block, device_, 4);
  c_.reduce_scatter(a.t, b.t, RLH_REDUCE_SUM, stream);
}

void CommDeviceDp::all_gather(const void* mine, void* all, int64_t block, int element_bytes, void* stream) {
  if (element_bytes != 2 && element_bytes != 4)
    throw Error(RLH_E_INTERNAL, "data-parallel all_gather of " + std::to_string(element_bytes) + "-byte elements");
  DeviceView a(mine, block, device_, element_bytes), b(all, block * c_.size(), device_, element_bytes);
  c_.all_gather(a.t, b.t, stream);
}

// ---------------------------------------------------------------------------------------------
// ShardLayout

ShardLayout::ShardLayout(const engine::Engine& e, const std::vector<std::pair<int64_t, int64_t>>& ranges, int rank,
                         int size, const std::function<bool(size_t)>& updated, bool decay_1d_params)
    : ShardLayout(e, ranges, std::vector<std::pair<int, int>>(ranges.size(), {rank, size}), updated, decay_1d_params) {}

ShardLayout::ShardLayout(const engine::Engine& e, const std::vector<std::pair<int64_t, int64_t>>& ranges,
                         const std::vector<std::pair<int, int>>& groups, const std::function<bool(size_t)>& updated,
                         bool decay_1d_params) {
  if (groups.size() != ranges.size() || ranges.empty())
    throw std::logic_error("shard layout: one group per range");
  rank_ = groups[0].first;
  size_ = groups[0].second;
  for (size_t j = 0; j < ranges.size(); ++j) {
    const auto& [b, end] = ranges[j];
    ShardSegment s;
    s.begin = b;
    s.end = end;
    s.rank = groups[j].first;
    s.size = groups[j].second;
    s.block = (end - b + s.size - 1) / s.size;
    s.at = elements_;
    elements_ += s.block;
    segments_.push_back(s);
  }
  // Parameters in storage order; each one's overlap with this rank's block of its segment.
  const auto& params = e.desc().params;
  std::vector<size_t> order(params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return e.param_offset(a) < e.param_offset(b); });
  for (size_t i : order) {
    if (!updated(i)) continue;
    const int64_t o = e.param_offset(i), n = numel(params[i].shape);
    const bool decay = decay_1d_params || params[i].shape.size() > 1;
    // A parameter lies in one segment (units never split a tensor; Megatron's is one segment).
    const ShardSegment& s = segments_[segment_of(o)];
    const int64_t mine = s.begin + int64_t(s.rank) * s.block;
    const int64_t lo = std::max(o, mine), hi = std::min({o + n, mine + s.block, s.end});
    if (lo >= hi) continue;
    const ShardRun r{s.at + (lo - mine), lo, hi - lo, decay};
    if (!runs_.empty() && runs_.back().decay == decay && runs_.back().at + runs_.back().n == r.at &&
        runs_.back().flat + runs_.back().n == r.flat)
      runs_.back().n += r.n;
    else
      runs_.push_back(r);
  }
}

size_t ShardLayout::segment_of(int64_t flat) const {
  for (size_t j = 0; j < segments_.size(); ++j)
    if (flat >= segments_[j].begin && flat < segments_[j].end) return j;
  throw std::logic_error("shard layout: flat index " + std::to_string(flat) + " is in no segment");
}

void ShardLayout::scatter_param(int64_t flat, const float* data, int64_t n, float* shard) const {
  const ShardSegment& s = segments_[segment_of(flat)];
  const int64_t mine = s.begin + int64_t(s.rank) * s.block;
  const int64_t lo = std::max(flat, mine), hi = std::min(flat + n, mine + s.block);
  if (lo < hi) std::memcpy(shard + s.at + (lo - mine), data + (lo - flat), size_t(hi - lo) * sizeof(float));
}

// ---------------------------------------------------------------------------------------------
// ShardOptimizer

ShardOptimizer::ShardOptimizer(OptimizerConfig config, Schedule schedule, const ShardLayout& layout, engine::Ops& ops,
                               engine::Allocator& state)
    : config_(config), schedule_(std::move(schedule)), layout_(layout), ops_(ops), alloc_(state) {}

Optimizer::StepInfo ShardOptimizer::next(double lr_override) const {
  const Schedule::Point p = schedule_.at(steps_, config_);
  return Optimizer::StepInfo{lr_override >= 0 ? lr_override : p.lr, p.weight_decay};
}

void ShardOptimizer::allocate_state() {
  const bool needs_v = config_.kind == OptimizerKind::adamw;
  const bool needs_m = needs_v || config_.momentum != 0;
  const size_t n = size_t(layout_.elements());
  if (needs_m && m_.size() == 0) {
    m_ = engine::Buffer<float>(alloc_, n);
    std::memset(m_.data(), 0, n * sizeof(float));
  }
  if (needs_v && v_.size() == 0) {
    v_ = engine::Buffer<float>(alloc_, n);
    std::memset(v_.data(), 0, n * sizeof(float));
  }
}

Optimizer::StepInfo ShardOptimizer::step(double lr_override, double grad_scale, float* params, bool by_flat,
                                         float* grad_shard) {
  const Optimizer::StepInfo info = next(lr_override);
  const bool first = !has_state();
  allocate_state();
  ++steps_;
  for (const ShardRun& r : layout_.runs()) {
    float* p = params + (by_flat ? r.flat : r.at);
    float* g = grad_shard + r.at;
    if (config_.kind == OptimizerKind::adamw) {
      engine::Ops::AdamW a{info.lr, config_.beta1, config_.beta2, config_.eps, r.decay ? info.weight_decay : 0.0,
                           steps_, grad_scale, false};
      ops_.adamw(p, g, m_.data() + r.at, v_.data() + r.at, r.n, a);
      continue;
    }
    // torch.optim.SGD, as Optimizer::step.
    const float lr = float(info.lr), mu = float(config_.momentum), scale = float(grad_scale);
    const float wd = r.decay ? float(info.weight_decay) : 0.0f;
    float* buf = config_.momentum != 0 ? m_.data() + r.at : nullptr;
    for (int64_t k = 0; k < r.n; ++k) {
      float d = g[k] * scale + wd * p[k];
      if (buf != nullptr) {
        buf[k] = first ? d : mu * buf[k] + d;
        d = buf[k];
      }
      p[k] -= lr * d;
    }
  }
  return info;
}

// ---------------------------------------------------------------------------------------------
// FsdpStore

FsdpStore::FsdpStore(const DpGroups& groups, engine::Allocator& state, engine::Allocator& work)
    : g_(groups), state_(state), work_(work) {}

void FsdpStore::bind(const ShardLayout& layout) {
  layout_ = &layout;
  const size_t n = size_t(layout.elements());
  params_ = engine::Buffer<float>(state_, n);
  grads_ = engine::Buffer<float>(state_, n);
  std::memset(params_.data(), 0, n * sizeof(float));
  std::memset(grads_.data(), 0, n * sizeof(float));
}

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

engine::Buffer<float> FsdpStore::take(size_t n) {
  for (size_t i = 0; i < pool_.size(); ++i)
    if (pool_[i].size() == n) {
      engine::Buffer<float> b = std::move(pool_[i]);
      pool_.erase(pool_.begin() + std::ptrdiff_t(i));
      return b;
    }
  return engine::Buffer<float>(work_, n);
}

void FsdpStore::give_back(engine::Buffer<float> b) {
  // At most as many as a step holds at once (the global unit, a layer's parameters and its
  // gradients, and the global unit's gradients).
  if (pool_.size() < 4) pool_.push_back(std::move(b));
}

void FsdpStore::gather_into(int64_t unit, float* full) const {
  const ShardSegment& s = layout_->segments()[size_t(unit)];
  FloatView in(params_.data() + s.at, s.block), out(full, s.block * g_.shard.size());
  const auto t0 = std::chrono::steady_clock::now();
  g_.shard.all_gather(*in, *out);
  comm_seconds_ += seconds_since(t0);
  bytes_gathered_ += s.block * (g_.shard.size() - 1) * int64_t(sizeof(float));
}

float* FsdpStore::acquire_params(int64_t unit) {
  const ShardSegment& s = layout_->segments()[size_t(unit)];
  engine::Buffer<float> full = take(size_t(s.block * g_.shard.size()));
  gather_into(unit, full.data());
  float* p = full.data();
  held_params_[unit] = std::move(full);
  return p;
}

void FsdpStore::release_params(int64_t unit) {
  auto it = held_params_.find(unit);
  if (it == held_params_.end()) return;
  give_back(std::move(it->second));
  held_params_.erase(it);
}

float* FsdpStore::acquire_grads(int64_t unit) {
  const ShardSegment& s = layout_->segments()[size_t(unit)];
  const size_t n = size_t(s.block * g_.shard.size());
  engine::Buffer<float> full = take(n);
  std::memset(full.data(), 0, n * sizeof(float));
  float* p = full.data();
  held_grads_[unit] = std::move(full);
  return p;
}

void FsdpStore::release_grads(int64_t unit) {
  auto it = held_grads_.find(unit);
  if (it == held_grads_.end()) throw std::logic_error("fsdp store: gradients of unit " + std::to_string(unit) + " not held");
  const ShardSegment& s = layout_->segments()[size_t(unit)];
  if (reduced_.size() < size_t(s.block)) reduced_ = engine::Buffer<float>(work_, size_t(s.block));
  FloatView in(it->second.data(), s.block * g_.shard.size()), out(reduced_.data(), s.block);
  const auto t0 = std::chrono::steady_clock::now();
  g_.shard.reduce_scatter(*in, *out, RLH_REDUCE_SUM);
  comm_seconds_ += seconds_since(t0);
  bytes_reduced_ += s.block * (g_.shard.size() - 1) * int64_t(sizeof(float));
  float* acc = grads_.data() + s.at;
  for (int64_t k = 0; k < s.block; ++k) acc[k] += reduced_[size_t(k)];
  give_back(std::move(it->second));
  held_grads_.erase(it);
}

void FsdpStore::begin_step() {
  reset();
  std::memset(grads_.data(), 0, grads_.size() * sizeof(float));
}

void FsdpStore::end_step() {
  if (!g_.replicate || g_.replicate.size() == 1) return;
  FloatView t(grads_.data(), int64_t(grads_.size()));
  const auto t0 = std::chrono::steady_clock::now();
  g_.replicate.all_reduce(*t, RLH_REDUCE_SUM);
  comm_seconds_ += seconds_since(t0);
  bytes_reduced_ += 2 * int64_t(grads_.size()) * (g_.replicate.size() - 1) / g_.replicate.size() * int64_t(sizeof(float));
}

void FsdpStore::idle_forward() {
  const int64_t L = int64_t(layout_->segments().size()) - 1;
  const bool had_global = held_params_.count(L) != 0;
  if (!had_global) acquire_params(L);
  for (int64_t l = 0; l < L; ++l) {
    acquire_params(l);
    release_params(l);
  }
  if (!had_global) release_params(L);
}

void FsdpStore::idle_microbatch() {
  const int64_t L = int64_t(layout_->segments().size()) - 1;
  acquire_params(L);
  for (int64_t l = 0; l < L; ++l) {
    acquire_params(l);
    release_params(l);
  }
  acquire_grads(L);
  for (int64_t l = L - 1; l >= 0; --l) {
    acquire_params(l);
    acquire_grads(l);
    release_grads(l);
    release_params(l);
  }
  release_grads(L);
  release_params(L);
}

void FsdpStore::reset() {
  held_params_.clear();
  held_grads_.clear();
}

std::vector<float> FsdpStore::gather_unit(int64_t unit) const {
  const ShardSegment& s = layout_->segments()[size_t(unit)];
  std::vector<float> full(size_t(s.block * g_.shard.size()));
  gather_into(unit, full.data());
  full.resize(size_t(s.end - s.begin));
  return full;
}

// ---------------------------------------------------------------------------------------------

std::vector<std::pair<std::string, double>> all_reduce_named(const sdk::Comm& c,
                                                             const std::vector<std::pair<std::string, double>>& mine) {
  // Every rank's names, joined by '\n', all-gathered at the longest length.
  std::string text;
  for (const auto& [name, v] : mine) text += name + "\n";
  int64_t len[1] = {int64_t(text.size())};
  c.all_reduce(std::span<int64_t>(len, 1), RLH_REDUCE_MAX);
  std::vector<uint8_t> padded(size_t(len[0]) + 1, 0), all(padded.size() * size_t(c.size()));
  std::memcpy(padded.data(), text.data(), text.size());
  const int64_t n_in = int64_t(padded.size()), n_out = int64_t(all.size());
  c.all_gather(sdk::host_tensor(padded.data(), sdk::dtype_of<uint8_t>(), std::span<const int64_t>(&n_in, 1)),
               sdk::host_tensor(all.data(), sdk::dtype_of<uint8_t>(), std::span<const int64_t>(&n_out, 1)));
  std::set<std::string> names;
  for (int r = 0; r < c.size(); ++r) {
    const char* p = reinterpret_cast<const char*>(all.data() + size_t(r) * padded.size());
    std::string s(p, strnlen(p, padded.size()));
    size_t at = 0;
    while (at < s.size()) {
      const size_t nl = s.find('\n', at);
      names.insert(s.substr(at, nl - at));
      at = nl + 1;
    }
  }
  std::vector<std::pair<std::string, double>> out;
  std::vector<double> sums, maxes;
  for (const std::string& name : names) {
    double v = 0;
    bool have = false;
    for (const auto& [k, x] : mine)
      if (k == name) {
        v = x;
        have = true;
      }
    const bool is_max = name.rfind("moe/max", 0) == 0;
    (is_max ? maxes : sums).push_back(have ? v : (is_max ? -INFINITY : 0.0));
    out.emplace_back(name, 0.0);
  }
  if (!sums.empty()) c.all_reduce(std::span<double>(sums), RLH_REDUCE_SUM);
  if (!maxes.empty()) c.all_reduce(std::span<double>(maxes), RLH_REDUCE_MAX);
  size_t si = 0, mi = 0;
  for (auto& [name, v] : out) v = name.rfind("moe/max", 0) == 0 ? maxes[mi++] : sums[si++];
  return out;
}

}  // namespace rlh::backend

namespace rlh::backend {

template <typename T>
void CommTpGroup::reduce(T* data, int64_t n, int32_t op) {
  if (n == 0) return;
  const auto t0 = std::chrono::steady_clock::now();
  c_.all_reduce(std::span<T>(data, size_t(n)), op);
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int S = c_.size();
  bytes_ += 2 * n * int64_t(sizeof(T)) * (S - 1) / S;
}
void CommTpGroup::all_reduce_sum(float* data, int64_t n) { reduce(data, n, RLH_REDUCE_SUM); }
void CommTpGroup::all_reduce_sum(double* data, int64_t n) { reduce(data, n, RLH_REDUCE_SUM); }
void CommTpGroup::all_reduce_max(float* data, int64_t n) { reduce(data, n, RLH_REDUCE_MAX); }
void CommTpGroup::all_gather(const float* in, int64_t n, float* out) {
  const auto t0 = std::chrono::steady_clock::now();
  const int S = c_.size();
  FloatView mine(const_cast<float*>(in), n), all(out, n * S);
  c_.all_gather(*mine, *all);
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  bytes_ += n * S * int64_t(sizeof(float)) * (S - 1) / S;
}
void CommTpGroup::reduce_scatter_sum(const float* in, int64_t n, float* out) {
  const auto t0 = std::chrono::steady_clock::now();
  const int S = c_.size();
  FloatView all(const_cast<float*>(in), n * S), mine(out, n);
  c_.reduce_scatter(*all, *mine, RLH_REDUCE_SUM);
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  bytes_ += n * S * int64_t(sizeof(float)) * (S - 1) / S;
}

}  // namespace rlh::backend
