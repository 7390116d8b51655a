// Reading a backend's config section: typed keys with errors naming them, the policy keys both
// backends share, NeMo-RL's torch-style scheduler list, and merge patches.
#include "rlhost/backend_common/backend_config.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "rlhost/sdk/status.hpp"

namespace rlh::backend {

using sdk::Error;
using json = nlohmann::json;

namespace {

std::vector<std::string> split(std::string_view path) {
  std::vector<std::string> parts;
  std::string cur;
  for (char c : path) {
    if (c == '.') {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  parts.push_back(cur);
  return parts;
}

std::string describe(const json& v) {
  std::string text = v.dump();
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return std::string(v.type_name()) + " " + text;
}

bool under(std::string_view key, std::string_view subtree) {
  return key == subtree || (key.size() > subtree.size() && key.substr(0, subtree.size()) == subtree &&
                            key[subtree.size()] == '.');
}

void collect_leaves(const json& node, const std::string& path, std::vector<std::string>& out) {
  if (node.is_object() && !node.empty()) {
    for (auto it = node.begin(); it != node.end(); ++it)
      collect_leaves(*it, path.empty() ? it.key() : path + "." + it.key(), out);
  } else {
    out.push_back(path);
  }
}

}  // namespace

ConfigReader::ConfigReader(const json& root, std::string prefix)
    : root_(root), prefix_(std::move(prefix)) {}

std::string ConfigReader::full(std::string_view path) const {
  return prefix_.empty() ? std::string(path) : prefix_ + "." + std::string(path);
}

void ConfigReader::fail(std::string_view path, const std::string& what) const {
  throw Error(RLH_E_INVALID_ARGUMENT, full(path) + ": " + what);
}

// The node at a dotted path; list items are addressed by index ("scheduler.0.name").
const json* ConfigReader::lookup(std::string_view path) const {
  const json* node = &root_;
  for (const std::string& part : split(path)) {
    if (node->is_object()) {
      auto it = node->find(part);
      if (it == node->end()) return nullptr;
      node = &*it;
    } else if (node->is_array() && !part.empty() && part.find_first_not_of("0123456789") == std::string::npos &&
               std::stoull(part) < node->size()) {
      node = &(*node)[std::stoull(part)];
    } else {
      return nullptr;
    }
  }
  return node;
}

const json* ConfigReader::find(std::string_view path) {
  read_.emplace_back(path);
  const json* node = lookup(path);
  return node == nullptr || node->is_null() ? nullptr : node;
}

bool ConfigReader::is_null(std::string_view path) {
  read_.emplace_back(path);
  const json* node = lookup(path);
  return node != nullptr && node->is_null();
}

double ConfigReader::number(std::string_view path, double fallback) {
  const json* v = find(path);
  if (v == nullptr) return fallback;
  if (!v->is_number()) {
    // YAML 1.2 reads "1e-6" as a string; accept strings that are numbers in full.
    if (v->is_string()) {
      const std::string s = v->get<std::string>();
      char* end = nullptr;
      const double d = std::strtod(s.c_str(), &end);
      if (!s.empty() && end == s.c_str() + s.size()) {
        // "nan", "inf" and "1e999" parse; none is a setting a run can honour.
        if (!std::isfinite(d)) fail(path, "expected a finite number, got " + describe(*v));
        return d;
      }
    }
    fail(path, "expected a number, got " + describe(*v));
  }
  return v->get<double>();
}

int64_t ConfigReader::integer(std::string_view path, int64_t fallback) {
  const json* v = find(path);
  if (v == nullptr) return fallback;
  if (v->is_number_integer()) return v->get<int64_t>();
  // A float with an integral value in the 64-bit range (checked before the cast, which would be
  // undefined past it).
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (std::isfinite(d) && d >= -9223372036854775808.0 && d < 9223372036854775808.0 &&
        d == static_cast<double>(static_cast<int64_t>(d)))
      return static_cast<int64_t>(d);
  }
  fail(path, "expected an integer, got " + describe(*v));
}

bool ConfigReader::boolean(std::string_view path, bool fallback) {
  const json* v = find(path);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) fail(path, "expected true or false, got " + describe(*v));
  return v->get<bool>();
}

std::string ConfigReader::string(std::string_view path, const std::string& fallback) {
  const json* v = find(path);
  if (v == nullptr) return fallback;
  if (!v->is_string()) fail(path, "expected a string, got " + describe(*v));
  return v->get<std::string>();
}

void ConfigReader::mark_subtree(std::string_view path) { read_.emplace_back(path); }

std::vector<std::string> ConfigReader::unread(std::string_view subtree) const {
  std::vector<std::string> leaves, out;
  const json* node = &root_;
  for (const std::string& part : split(subtree)) {
    if (!node->is_object() || !node->contains(part)) return out;
    node = &(*node)[part];
  }
  collect_leaves(*node, std::string(subtree), leaves);
  for (const std::string& leaf : leaves) {
    // Read when the leaf or a subtree holding it was read, or an item of a list leaf.
    const bool seen = std::any_of(read_.begin(), read_.end(),
                                  [&](const std::string& r) { return under(leaf, r) || under(r, leaf); });
    if (!seen) out.push_back(full(leaf));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------

const char* to_string(OptimizerKind k) { return k == OptimizerKind::adamw ? "adamw" : "sgd"; }

void require_single_rank(ConfigReader& r, std::string_view path) {
  const int64_t n = r.integer(path, 1);
  if (n < 1) r.fail(path, "must be at least 1, got " + std::to_string(n));
  if (n != 1)
    throw Error(RLH_E_UNIMPLEMENTED,
                r.full(path) + " = " + std::to_string(n) +
                    ": only data parallelism (every launched rank a data-parallel rank) and megatron's tensor, "
                    "context, pipeline and expert parallelism are implemented; dtensor's tensor, context and "
                    "expert parallelism are not");
}

void read_shared_policy_keys(ConfigReader& r, BackendConfig& cfg) {
  cfg.precision = r.string("precision", "float32");
  if (cfg.precision != "float32" && cfg.precision != "fp32" && cfg.precision != "bfloat16" &&
      cfg.precision != "bf16" && cfg.precision != "float16" && cfg.precision != "fp16")
    r.fail("precision", "expected float32, bfloat16 or float16, got \"" + cfg.precision + "\"");
  // Where models run; whether the flavor has that device is checked when a model loads.
  cfg.device = r.string("device", "auto");
  {
    const std::string& d = cfg.device;
    const bool indexed = d.rfind("cuda:", 0) == 0 && d.size() > 5 && d.size() < 9 &&
                         d.find_first_not_of("0123456789", 5) == std::string::npos;
    if (d != "auto" && d != "cpu" && d != "cuda" && !indexed)
      r.fail("device", "expected auto, cpu, cuda or cuda:N, got \"" + d + "\"");
  }
  cfg.batch_invariant = r.boolean("generation.native_cfg.batch_invariant", false);
  if (const nlohmann::json* k = r.find("kernels")) {
    cfg.kernel_pins = sdk::kernel_pins_from_json(k->dump());
    cfg.kernel_verify = sdk::kernel_verify_from_json(k->dump());
    r.mark_subtree("kernels");
  }
  cfg.save_dtype = r.string("save_dtype", "float32");
  if (cfg.save_dtype == "fp32") cfg.save_dtype = "float32";
  if (cfg.save_dtype == "bf16") cfg.save_dtype = "bfloat16";
  if (cfg.save_dtype != "float32" && cfg.save_dtype != "bfloat16")
    r.fail("save_dtype", "expected float32 or bfloat16, got \"" + cfg.save_dtype + "\"");
  // null = no clipping (NeMo-RL); read even without an optimizer, so a bad value shows.
  const double clip = r.is_null("max_grad_norm") ? 0.0 : r.number("max_grad_norm", 1.0);
  if (!(clip >= 0)) r.fail("max_grad_norm", "must be >= 0 (or null for none)");
  if (cfg.optimizer) cfg.optimizer->max_grad_norm = clip;

  BatchingConfig& b = cfg.batching;
  b.train_micro_batch_size = r.integer("train_micro_batch_size", b.train_micro_batch_size);
  b.logprob_batch_size = r.integer("logprob_batch_size", b.logprob_batch_size);
  if (b.train_micro_batch_size < 1) r.fail("train_micro_batch_size", "must be at least 1");
  if (b.logprob_batch_size < 1) r.fail("logprob_batch_size", "must be at least 1");

  const bool packing = r.boolean("sequence_packing.enabled", false);
  const bool dynamic = r.boolean("dynamic_batching.enabled", false);
  if (packing && dynamic)
    throw Error(RLH_E_INVALID_ARGUMENT,
                r.full("sequence_packing.enabled") + " and " + r.full("dynamic_batching.enabled") +
                    " are both true; NeMo-RL allows one of them");
  // The rest of both sections is read (and checked) even when disabled, so a typo shows.
  const int64_t sp_train = r.integer("sequence_packing.train_mb_tokens", 0);
  const int64_t sp_lp = r.integer("sequence_packing.logprob_mb_tokens", 0);
  const std::string algo = r.string("sequence_packing.algorithm", "modified_first_fit_decreasing");
  r.integer("sequence_packing.sequence_length_round", 0);  // padding: the engine never pads
  const int64_t db_train = r.integer("dynamic_batching.train_mb_tokens", 0);
  const int64_t db_lp = r.integer("dynamic_batching.logprob_mb_tokens", 0);
  r.integer("dynamic_batching.sequence_length_round", 0);
  if (algo != "modified_first_fit_decreasing" && algo != "first_fit_decreasing" &&
      algo != "first_fit_shuffle" && algo != "concatenative")
    r.fail("sequence_packing.algorithm",
           "expected modified_first_fit_decreasing, first_fit_decreasing, first_fit_shuffle or "
           "concatenative, got \"" + algo + "\"");
  if (packing || dynamic) {
    const std::string sec = packing ? "sequence_packing" : "dynamic_batching";
    b.by_tokens = true;
    b.train_mb_tokens = packing ? sp_train : db_train;
    b.logprob_mb_tokens = packing ? sp_lp : db_lp;
    if (b.train_mb_tokens < 1) r.fail(sec + ".train_mb_tokens", "must be at least 1 when " + sec + " is enabled");
    if (b.logprob_mb_tokens < 1) r.fail(sec + ".logprob_mb_tokens", "must be at least 1 when " + sec + " is enabled");
    // Dynamic batching keeps NeMo-RL's order (it only groups by length); packing bins sequences.
    b.first_fit_decreasing = packing && algo != "concatenative";
  }
}

// ---------------------------------------------------------------------------------------------
// Schedules

double TorchScheduler::lr(double base, int64_t t) const {
  switch (kind) {
    case Kind::constant:
      return base * (t < total_iters ? factor : 1.0);
    case Kind::linear: {
      const double frac = total_iters > 0 ? double(std::min(t, total_iters)) / double(total_iters) : 1.0;
      return base * (start_factor + (end_factor - start_factor) * frac);
    }
    case Kind::cosine:
      // The closed form torch documents; SequentialLR restarts it from the base lr.
      return eta_min + (base - eta_min) * (1 + std::cos(M_PI * double(t) / double(t_max))) / 2;
    case Kind::exponential:
      return base * std::pow(gamma, double(t));
    case Kind::step:
      return base * std::pow(gamma, double(t / step_size));
    case Kind::multi_step: {
      int64_t passed = 0;
      for (int64_t m : milestones) passed += t >= m ? 1 : 0;
      return base * std::pow(gamma, double(passed));
    }
    case Kind::polynomial: {
      const double frac = 1.0 - double(std::min(t, total_iters)) / double(total_iters);
      return base * std::pow(frac, power);
    }
  }
  return base;
}

Schedule::Point Schedule::at(int64_t s, const OptimizerConfig& opt) const {
  Point p{opt.lr, opt.weight_decay};
  if (const auto* ts = std::get_if<TorchSchedule>(&rule)) {
    if (ts->schedulers.empty()) return p;
    // SequentialLR: the scheduler whose milestone interval holds s, restarted at its milestone.
    size_t i = 0;
    while (i < ts->milestones.size() && s >= ts->milestones[i]) ++i;
    const int64_t local = i == 0 ? s : s - ts->milestones[i - 1];
    p.lr = ts->schedulers[i].lr(opt.lr, local);
    return p;
  }
  const MegatronSchedule& m = std::get<MegatronSchedule>(rule);
  const double max_lr = opt.lr;
  if (m.warmup_iters > 0 && s <= m.warmup_iters) {
    p.lr = m.warmup_init_lr + (max_lr - m.warmup_init_lr) * double(s) / double(m.warmup_iters);
  } else if (m.decay == MegatronSchedule::Decay::constant) {
    p.lr = max_lr;
  } else if (m.decay == MegatronSchedule::Decay::inverse_square_root) {
    const double warm = double(std::max<int64_t>(m.warmup_iters, 1));
    p.lr = std::max(m.min_lr, max_lr * std::sqrt(warm) / std::sqrt(double(std::max<int64_t>(s, 1))));
  } else if (s > m.decay_iters) {
    p.lr = m.min_lr;
  } else {
    const double ratio = double(s - m.warmup_iters) / double(m.decay_iters - m.warmup_iters);
    const double coeff = m.decay == MegatronSchedule::Decay::linear ? 1.0 - ratio
                                                                    : 0.5 * (std::cos(M_PI * ratio) + 1.0);
    p.lr = m.min_lr + coeff * (max_lr - m.min_lr);
  }
  if (m.wd_increment == MegatronSchedule::WdIncrement::constant || m.wd_incr_iters <= 0 ||
      s > m.wd_incr_iters) {
    p.weight_decay = m.end_weight_decay;
  } else {
    const double ratio = double(s) / double(m.wd_incr_iters);
    const double coeff = m.wd_increment == MegatronSchedule::WdIncrement::linear
                             ? ratio
                             : 0.5 * (std::cos(M_PI * (1 - ratio)) + 1.0);
    p.weight_decay = m.start_weight_decay + coeff * (m.end_weight_decay - m.start_weight_decay);
  }
  return p;
}

namespace {

TorchScheduler read_torch_scheduler(ConfigReader& r, const std::string& at) {
  TorchScheduler s;
  std::string name = r.string(at + ".name", "");
  if (name.empty()) r.fail(at + ".name", "a scheduler needs a name (e.g. torch.optim.lr_scheduler.LinearLR)");
  const std::string short_name = name.substr(name.rfind('.') == std::string::npos ? 0 : name.rfind('.') + 1);
  const std::string kw = at + ".kwargs.";
  using K = TorchScheduler::Kind;
  if (short_name == "ConstantLR") {
    s.kind = K::constant;
    s.factor = r.number(kw + "factor", 1.0 / 3);
    s.total_iters = r.integer(kw + "total_iters", 5);
  } else if (short_name == "LinearLR") {
    s.kind = K::linear;
    s.start_factor = r.number(kw + "start_factor", 1.0 / 3);
    s.end_factor = r.number(kw + "end_factor", 1.0);
    s.total_iters = r.integer(kw + "total_iters", 5);
  } else if (short_name == "CosineAnnealingLR") {
    s.kind = K::cosine;
    s.t_max = r.integer(kw + "T_max", 0);
    s.eta_min = r.number(kw + "eta_min", 0.0);
    if (s.t_max < 1) r.fail(kw + "T_max", "CosineAnnealingLR needs T_max >= 1");
  } else if (short_name == "ExponentialLR") {
    s.kind = K::exponential;
    s.gamma = r.number(kw + "gamma", 0.0);
    if (!r.has(kw + "gamma")) r.fail(kw + "gamma", "ExponentialLR needs gamma");
  } else if (short_name == "StepLR") {
    s.kind = K::step;
    s.step_size = r.integer(kw + "step_size", 0);
    s.gamma = r.number(kw + "gamma", 0.1);
    if (s.step_size < 1) r.fail(kw + "step_size", "StepLR needs step_size >= 1");
  } else if (short_name == "MultiStepLR") {
    s.kind = K::multi_step;
    const json* ms = r.find(kw + "milestones");
    if (ms == nullptr || !ms->is_array()) r.fail(kw + "milestones", "MultiStepLR needs a list of milestones");
    for (const json& m : *ms) {
      if (!m.is_number_integer()) r.fail(kw + "milestones", "milestones must be integers");
      s.milestones.push_back(m.get<int64_t>());
    }
    s.gamma = r.number(kw + "gamma", 0.1);
  } else if (short_name == "PolynomialLR") {
    s.kind = K::polynomial;
    s.total_iters = r.integer(kw + "total_iters", 5);
    s.power = r.number(kw + "power", 1.0);
  } else {
    r.fail(at + ".name", "scheduler '" + name +
                             "' is not implemented (ConstantLR, LinearLR, CosineAnnealingLR, ExponentialLR, "
                             "StepLR, MultiStepLR, PolynomialLR are)");
  }
  if ((s.kind == K::constant || s.kind == K::linear || s.kind == K::polynomial) && s.total_iters < 1)
    r.fail(kw + "total_iters", "must be at least 1");
  r.find(kw + "last_epoch");  // torch bookkeeping, no effect on a fresh schedule
  return s;
}

}  // namespace

TorchSchedule read_torch_schedule(ConfigReader& r, std::string_view path) {
  TorchSchedule out;
  const json* node = r.find(path);
  if (node == nullptr) return out;
  const std::string base(path);
  if (node->is_object()) {
    out.schedulers.push_back(read_torch_scheduler(r, base));
    return out;
  }
  if (!node->is_array()) r.fail(path, "expected a scheduler or a list of schedulers");
  for (size_t i = 0; i < node->size(); ++i) {
    const json& item = (*node)[i];
    const std::string at = base + "." + std::to_string(i);
    if (!item.is_object()) r.fail(at, "expected {name, kwargs} or {milestones}");
    if (item.contains("milestones")) {
      const json* ms = r.find(at + ".milestones");
      if (ms == nullptr || !ms->is_array()) r.fail(at + ".milestones", "expected a list of step numbers");
      for (const json& m : *ms) {
        if (!m.is_number_integer()) r.fail(at + ".milestones", "milestones must be integers");
        out.milestones.push_back(m.get<int64_t>());
      }
    } else {
      out.schedulers.push_back(read_torch_scheduler(r, at));
    }
  }
  if (out.schedulers.size() > 1 && out.milestones.size() + 1 != out.schedulers.size())
    r.fail(path, std::to_string(out.schedulers.size()) + " schedulers need " +
                     std::to_string(out.schedulers.size() - 1) + " milestones, got " +
                     std::to_string(out.milestones.size()));
  if (out.schedulers.size() <= 1) out.milestones.clear();
  if (!std::is_sorted(out.milestones.begin(), out.milestones.end()))
    r.fail(path, "milestones must increase");
  return out;
}

json merge_patch(json target, const json& patch) {
  if (!patch.is_object()) return patch;
  if (!target.is_object()) target = json::object();
  for (auto it = patch.begin(); it != patch.end(); ++it) {
    if (it->is_null())
      target.erase(it.key());
    else
      target[it.key()] = merge_patch(target.contains(it.key()) ? target[it.key()] : json(), *it);
  }
  return target;
}

}  // namespace rlh::backend
