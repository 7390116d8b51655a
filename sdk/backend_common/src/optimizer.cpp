// AdamW (through Ops::adamw, one call per run of adjacent parameters) and SGD over an engine's
// parameters, with checkpointable state (see optimizer.hpp for why the backend owns it).
#include "rlhost/backend_common/optimizer.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>

namespace rlh::backend {

namespace {
int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}
}  // namespace

Optimizer::Optimizer(OptimizerConfig config, Schedule schedule, engine::Engine& engine, engine::Ops& ops,
                     const std::function<bool(const sdk::ParamDesc&)>& frozen, engine::Allocator* state)
    : config_(config), schedule_(std::move(schedule)), engine_(engine), ops_(ops),
      state_(state != nullptr ? state : &engine.allocator()) {
  const auto& params = engine_.desc().params;
  state_offset_.assign(params.size(), -1);
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].trainable && !(frozen && frozen(params[i]))) trainable_.push_back(i);
  // Storage order, so parameters adjacent in memory become one run (a few long kernel calls
  // instead of one per tensor) and their state is adjacent too.
  std::sort(trainable_.begin(), trainable_.end(),
            [&](size_t a, size_t b) { return engine_.param(a).data() < engine_.param(b).data(); });
  for (size_t i : trainable_) {
    const int64_t n = numel(params[i].shape);
    const bool decay = config_.decay_1d_params || params[i].shape.size() > 1;
    float* p = engine_.param(i).data();
    float* g = engine_.grad(i).data();
    state_offset_[i] = state_size_;
    if (!runs_.empty() && runs_.back().decay == decay && runs_.back().param + runs_.back().n == p &&
        runs_.back().grad + runs_.back().n == g) {
      runs_.back().n += n;
    } else {
      runs_.push_back(Run{p, g, state_size_, n, decay});
    }
    state_size_ += n;
  }
}

Optimizer::StepInfo Optimizer::next(double lr_override) const {
  const Schedule::Point p = schedule_.at(steps_, config_);
  return StepInfo{lr_override >= 0 ? lr_override : p.lr, p.weight_decay};
}

void Optimizer::allocate_state() {
  const bool needs_v = config_.kind == OptimizerKind::adamw;
  const bool needs_m = needs_v || config_.momentum != 0;
  if (needs_m && m_.size() == 0) {
    m_ = engine::Buffer<float>(*state_, size_t(state_size_));
    std::memset(m_.data(), 0, size_t(state_size_) * sizeof(float));
  }
  if (needs_v && v_.size() == 0) {
    v_ = engine::Buffer<float>(*state_, size_t(state_size_));
    std::memset(v_.data(), 0, size_t(state_size_) * sizeof(float));
  }
}

Optimizer::StepInfo Optimizer::step(double lr_override, double grad_scale) {
  const StepInfo info = next(lr_override);
  const bool first = m_.size() == 0;
  allocate_state();
  ++steps_;
  if (config_.kind == OptimizerKind::adamw) {
    for (const Run& r : runs_) {
      engine::Ops::AdamW a{info.lr, config_.beta1, config_.beta2, config_.eps,
                           r.decay ? info.weight_decay : 0.0, steps_, grad_scale, false};
      ops_.adamw(r.param, r.grad, m_.data() + r.offset, v_.data() + r.offset, r.n, a);
    }
    return info;
  }
  // torch.optim.SGD: d = g + wd p (coupled decay); with momentum, buf = mu buf + d (buf = d on
  // the first step); p -= lr d. On host memory, where this engine keeps its parameters.
  const float lr = float(info.lr), mu = float(config_.momentum), scale = float(grad_scale);
  for (const Run& r : runs_) {
    const float wd = r.decay ? float(info.weight_decay) : 0.0f;
    float* buf = config_.momentum != 0 ? m_.data() + r.offset : nullptr;
    for (int64_t k = 0; k < r.n; ++k) {
      float d = r.grad[k] * scale + wd * r.param[k];
      if (buf != nullptr) {
        buf[k] = first ? d : mu * buf[k] + d;
        d = buf[k];
      }
      r.param[k] -= lr * d;
    }
  }
  return info;
}

std::vector<Optimizer::StateTensor> Optimizer::state() {
  std::vector<StateTensor> out;
  const auto& params = engine_.desc().params;
  auto add = [&](const char* prefix, engine::Buffer<float>& buf) {
    if (buf.size() == 0) return;
    std::vector<size_t> order = trainable_;
    std::sort(order.begin(), order.end());  // description order: stable names in files
    for (size_t i : order)
      out.push_back(StateTensor{std::string(prefix) + "." + params[i].name, params[i].shape,
                                {buf.data() + state_offset_[i], size_t(numel(params[i].shape))}});
  };
  add(config_.kind == OptimizerKind::adamw ? "exp_avg" : "momentum_buffer", m_);
  add("exp_avg_sq", v_);
  return out;
}

}  // namespace rlh::backend
