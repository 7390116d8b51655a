// rlh_loss_fn over CPU tensors for the GRPO family, SFT and DPO (see loss_adapter.hpp).
#include "rlhost/grpo/loss_adapter.hpp"

#include <cmath>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "rlhost/grpo/device_loss.hpp"
#include "rlhost/grpo/nll_loss.hpp"
#include "rlhost/grpo/packing.hpp"
#include "rlhost/losses/loss_ops.hpp"

namespace rlh::grpo {

namespace {

using sdk::Error;

bool host_accessible(const rlh_device& d) {
  return d.device_type == RLH_DEVICE_CPU || d.device_type == RLH_DEVICE_CUDA_HOST ||
         d.device_type == RLH_DEVICE_CUDA_MANAGED;
}

double bf16_to_double(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t double_to_bf16(double v) {
  const float f = static_cast<float>(v);
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

double f16_to_double(uint16_t h) {
  const int sign = (h >> 15) & 1, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  double v;
  if (exp == 0) {
    v = std::ldexp(static_cast<double>(man), -24);
  } else if (exp == 31) {
    v = man ? std::nan("") : INFINITY;
  } else {
    v = std::ldexp(static_cast<double>(man | 0x400), exp - 25);
  }
  return sign ? -v : v;
}

// Checks that `t` is a host tensor of `n` elements laid out [n] or [n, 1]; returns the element
// stride.
int64_t check_vector(const rlh_tensor& t, int64_t n, std::string_view what) {
  const std::string name(what);
  if (!host_accessible(t.device))
    throw Error(RLH_E_UNIMPLEMENTED, name + ": the GRPO loss callback reads host (CPU) tensors; got "
                                         "device type " + std::to_string(t.device.device_type));
  if (t.data == nullptr && n > 0) throw Error(RLH_E_INVALID_ARGUMENT, name + ": null data");
  const bool ok = (t.ndim == 1 && t.shape[0] == n) ||
                  (t.ndim == 2 && t.shape[0] == n && t.shape[1] == 1);
  if (!ok) {
    std::string shape = "[";
    for (int i = 0; i < t.ndim; ++i) shape += (i ? "," : "") + std::to_string(t.shape[i]);
    throw Error(RLH_E_INVALID_ARGUMENT,
                name + ": expected shape [" + std::to_string(n) + "], got " + shape + "]");
  }
  if (t.dtype.lanes != 1) throw Error(RLH_E_INVALID_ARGUMENT, name + ": vector dtypes unsupported");
  return t.strides != nullptr ? t.strides[0] : 1;
}

std::vector<double> read_vector(const rlh_tensor& t, int64_t n, std::string_view what) {
  const int64_t stride = check_vector(t, n, what);
  const char* base = static_cast<const char*>(t.data) + t.byte_offset;
  std::vector<double> out(n);
  const int code = t.dtype.code, bits = t.dtype.bits;
  auto at = [&](int64_t i, size_t size) { return base + i * stride * static_cast<int64_t>(size); };
  for (int64_t i = 0; i < n; ++i) {
    if (code == RLH_DTYPE_FLOAT && bits == 32) {
      float v; std::memcpy(&v, at(i, 4), 4); out[i] = v;
    } else if (code == RLH_DTYPE_FLOAT && bits == 64) {
      double v; std::memcpy(&v, at(i, 8), 8); out[i] = v;
    } else if (code == RLH_DTYPE_BFLOAT && bits == 16) {
      uint16_t v; std::memcpy(&v, at(i, 2), 2); out[i] = bf16_to_double(v);
    } else if (code == RLH_DTYPE_FLOAT && bits == 16) {
      uint16_t v; std::memcpy(&v, at(i, 2), 2); out[i] = f16_to_double(v);
    } else if (code == RLH_DTYPE_INT && bits == 32) {
      int32_t v; std::memcpy(&v, at(i, 4), 4); out[i] = v;
    } else if (code == RLH_DTYPE_INT && bits == 64) {
      int64_t v; std::memcpy(&v, at(i, 8), 8); out[i] = static_cast<double>(v);
    } else if (code == RLH_DTYPE_INT && bits == 8) {
      int8_t v; std::memcpy(&v, at(i, 1), 1); out[i] = v;
    } else if ((code == RLH_DTYPE_UINT || code == RLH_DTYPE_BOOL) && bits == 8) {
      uint8_t v; std::memcpy(&v, at(i, 1), 1); out[i] = code == RLH_DTYPE_BOOL ? (v != 0) : v;
    } else {
      throw Error(RLH_E_INVALID_ARGUMENT, std::string(what) + ": unsupported dtype (code " +
                                              std::to_string(code) + ", " + std::to_string(bits) +
                                              " bits)");
    }
  }
  return out;
}

void write_vector(const rlh_tensor& t, const std::vector<double>& v, std::string_view what) {
  const int64_t n = static_cast<int64_t>(v.size());
  const int64_t stride = check_vector(t, n, what);
  char* base = static_cast<char*>(t.data) + t.byte_offset;
  const int code = t.dtype.code, bits = t.dtype.bits;
  for (int64_t i = 0; i < n; ++i) {
    if (code == RLH_DTYPE_FLOAT && bits == 32) {
      const float f = static_cast<float>(v[i]);
      std::memcpy(base + i * stride * 4, &f, 4);
    } else if (code == RLH_DTYPE_FLOAT && bits == 64) {
      std::memcpy(base + i * stride * 8, &v[i], 8);
    } else if (code == RLH_DTYPE_BFLOAT && bits == 16) {
      const uint16_t h = double_to_bf16(v[i]);
      std::memcpy(base + i * stride * 2, &h, 2);
    } else {
      throw Error(RLH_E_INVALID_ARGUMENT,
                  std::string(what) + ": gradients are written as float32, float64 or bfloat16");
    }
  }
}

void write_scalar(const rlh_tensor* t, double value) {
  if (t == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "loss tensor is null");
  if (!host_accessible(t->device))
    throw Error(RLH_E_UNIMPLEMENTED, "loss: the GRPO loss callback writes a host (CPU) tensor");
  int64_t numel = 1;
  for (int i = 0; i < t->ndim; ++i) numel *= t->shape[i];
  if (numel != 1) throw Error(RLH_E_INVALID_ARGUMENT, "loss: expected a 0-d tensor");
  char* p = static_cast<char*>(t->data) + t->byte_offset;
  if (t->dtype.code == RLH_DTYPE_FLOAT && t->dtype.bits == 32) {
    const float f = static_cast<float>(value);
    std::memcpy(p, &f, 4);
  } else if (t->dtype.code == RLH_DTYPE_FLOAT && t->dtype.bits == 64) {
    std::memcpy(p, &value, 8);
  } else {
    throw Error(RLH_E_INVALID_ARGUMENT, "loss: expected a float32 (or float64) tensor");
  }
}

// The fields and outputs of one micro-batch, by name.
class MicroBatchView {
 public:
  explicit MicroBatchView(const rlh_microbatch& mb) : mb_(mb) {
    if (mb.struct_size < RLH_STRUCT_SIZE(rlh_microbatch, global_num_seqs))
      throw Error(RLH_E_INVALID_ARGUMENT, "rlh_microbatch: struct_size too small");
    if (mb.batch == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "rlh_microbatch: null batch");
    const rlh_batch& b = *mb.batch;
    if (b.seq_offsets == nullptr)
      throw Error(RLH_E_INVALID_ARGUMENT, "rlh_microbatch: batch without seq_offsets");
    packing_.num_tokens = b.num_tokens;
    packing_.num_seqs = b.num_seqs;
    packing_.seq_offsets = b.seq_offsets;
    validate(packing_);
  }

  const Packing& packing() const { return packing_; }

  const rlh_tensor* find_field(std::string_view name) const {
    const rlh_batch& b = *mb_.batch;
    for (size_t i = 0; i < b.num_fields; ++i)
      if (b.fields[i].name != nullptr && name == b.fields[i].name) return &b.fields[i].tensor;
    return nullptr;
  }
  // A token-frame field ([num_tokens]); nullopt-like empty vector when absent and not required.
  std::vector<double> token_field(std::string_view name, bool required) const {
    return field(name, packing_.num_tokens, required, "token");
  }
  std::vector<double> seq_field(std::string_view name, bool required) const {
    return field(name, packing_.num_seqs, required, "per-sequence");
  }
  bool has_field(std::string_view name) const { return find_field(name) != nullptr; }

  int find_output(std::string_view name) const {
    for (size_t i = 0; i < mb_.num_outputs; ++i)
      if (mb_.outputs[i].name != nullptr && name == mb_.outputs[i].name) return static_cast<int>(i);
    return -1;
  }
  // Output k in the loss math's output frame (the backend hands it over token-aligned).
  std::vector<double> output(int k) const {
    return to_output_frame(packing_, read_vector(mb_.outputs[k].tensor, packing_.num_tokens,
                                                 std::string("output '") + mb_.outputs[k].name + "'"));
  }
  // d loss / d output k, given in the output frame, written token-aligned like the output.
  void write_grad(int k, const std::vector<double>& g) const {
    if (mb_.grads == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "rlh_microbatch: null grads");
    write_vector(mb_.grads[k], to_token_frame(packing_, g), std::string("gradient of '") + mb_.outputs[k].name + "'");
  }

 private:
  std::vector<double> field(std::string_view name, int64_t n, bool required,
                            const char* kind) const {
    const rlh_tensor* t = find_field(name);
    if (t == nullptr) {
      if (required)
        throw Error(RLH_E_INVALID_ARGUMENT,
                    "batch field '" + std::string(name) + "' (" + kind + ") is missing");
      return {};
    }
    return read_vector(*t, n, "batch field '" + std::string(name) + "'");
  }

  const rlh_microbatch& mb_;
  Packing packing_;
};

const double* ptr(const std::vector<double>& v) { return v.empty() ? nullptr : v.data(); }

}  // namespace

LossAdapter::LossAdapter(Config cfg, LossAdapterOptions opts)
    : cfg_(std::move(cfg)), opts_(std::move(opts)) {
  if (const auto* pg = std::get_if<ClippedPGConfig>(&cfg_)) pg->validate();
}

LossAdapter::~LossAdapter() = default;

void LossAdapter::enable_device_loss(sdk::Host host, std::string kernels_json, bool on_host_too) {
  std::lock_guard<std::mutex> lock(mu_);
  device_host_ = host;
  kernels_json_ = std::move(kernels_json);
  device_enabled_ = true;
  op_on_host_ = on_host_too;
  device_ok_ = false;
  device_ops_.clear();
}

DeviceLoss* LossAdapter::device_loss_for(const rlh_device& device, std::string* why) {
  // Callers hold mu_.
  for (const auto& d : device_ops_)
    if (d->device().device_type == device.device_type && d->device().device_id == device.device_id) return d.get();
  const ClippedPGConfig* pg = std::get_if<ClippedPGConfig>(&cfg_);
  if (pg == nullptr && !std::holds_alternative<NllConfig>(cfg_)) {
    if (why) *why = "only the ClippedPG and NLL losses run as kernel ops";
    return nullptr;
  }
  std::unique_ptr<DeviceLoss> d = DeviceLoss::resolve(device_host_, kernels_json_, pg, device, why);
  if (!d) return nullptr;
  device_ops_.push_back(std::move(d));
  return device_ops_.back().get();
}

bool LossAdapter::device_loss_supported(rlh_device device, const std::vector<rlh_output_spec>& specs, std::string* why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!device_enabled_) {
    if (why) *why = "the device loss is not enabled";
    return false;
  }
  if (specs.size() != 1 || specs[0].kind != RLH_OUTPUT_LOGPROB) {
    if (why) *why = "the loss reads more than the logprob output (top-k/top-p filtering with the KL term)";
    return false;
  }
  device_ok_ = device_loss_for(device, why) != nullptr;
  return device_ok_;
}

Reduce LossAdapter::reduce_of(std::string_view name) {
  for (const losses::OpMetric& m : losses::kClippedPgMetrics)
    if (name == m.name) return m.reduce;
  return Reduce::kSum;
}

rlh_status* LossAdapter::callback(void* user, const rlh_microbatch* mb) {
  auto* self = static_cast<LossAdapter*>(user);
  const sdk::MakeStatusFn make = self != nullptr ? self->make_status_ : nullptr;
  return sdk::guard(make, [&] {
    if (self == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "GRPO loss callback: null user");
    if (mb == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "GRPO loss callback: null micro-batch");
    self->run(*mb);
  });
}

std::vector<rlh_output_spec> LossAdapter::output_specs(double temperature, int32_t top_k,
                                                      double top_p) const {
  auto spec = [&](int32_t kind, const std::string& name) {
    rlh_output_spec s{};
    s.struct_size = RLH_STRUCT_SIZE(rlh_output_spec, ids_field);
    s.kind = kind;
    s.name = name.c_str();
    s.temperature = temperature;
    s.top_k = kind == RLH_OUTPUT_LOGPROB ? top_k : 0;
    s.top_p = kind == RLH_OUTPUT_LOGPROB ? top_p : 1.0;
    return s;
  };
  if (std::holds_alternative<PreferenceConfig>(cfg_) || std::holds_alternative<ValueLossConfig>(cfg_))
    return {spec(RLH_OUTPUT_VALUE, opts_.values_output)};
  std::vector<rlh_output_spec> out = {spec(RLH_OUTPUT_LOGPROB, opts_.logprobs_output)};
  const bool filtered = top_k > 0 || top_p < 1.0;
  if (const auto* pg = std::get_if<ClippedPGConfig>(&cfg_);
      pg != nullptr && filtered && pg->needs_reference_logprobs())
    out.push_back(spec(RLH_OUTPUT_LOGPROB_RAW, opts_.logprobs_unfiltered_output));
  return out;
}

Metrics LossAdapter::step_extrema() const {
  std::lock_guard<std::mutex> lock(mu_);
  return extrema_;
}

void LossAdapter::reset_step() {
  std::lock_guard<std::mutex> lock(mu_);
  extrema_.clear();
}

void LossAdapter::run(const rlh_microbatch& mb) {
  const MicroBatchView view(mb);
  const Packing& p = view.packing();
  if (p.num_seqs == 0) {  // nothing to learn from: zero loss, the grads stay zero
    write_scalar(mb.loss, 0.0);
    return;
  }
  if (std::holds_alternative<PreferenceConfig>(cfg_)) {
    const int k_v = view.find_output(opts_.values_output);
    if (k_v < 0)
      throw Error(RLH_E_INVALID_ARGUMENT, "the loss needs the output '" + opts_.values_output + "' (RLH_OUTPUT_VALUE)");
    // Values are not shifted (no output frame): read and written token-aligned as they come.
    const std::vector<double> v = read_vector(mb.outputs[k_v].tensor, p.num_tokens,
                                              "output '" + opts_.values_output + "'");
    const std::vector<double> sm = view.seq_field("sample_mask", true);
    PreferenceInputs in;
    in.packing = p;
    in.values = v.data();
    in.sample_mask = sm.data();
    in.global_valid_seqs = static_cast<double>(mb.global_num_seqs);
    std::vector<double> grad(p.num_tokens, 0.0);
    const LossResult res = preference_loss(in, grad.data());
    if (mb.grads == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "rlh_microbatch: null grads");
    write_vector(mb.grads[k_v], grad, "gradient of '" + opts_.values_output + "'");
    write_scalar(mb.loss, res.loss);
    report(mb, res);
    return;
  }
  if (const auto* vl = std::get_if<ValueLossConfig>(&cfg_)) {
    const int k_v = view.find_output(opts_.values_output);
    if (k_v < 0)
      throw Error(RLH_E_INVALID_ARGUMENT, "the loss needs the output '" + opts_.values_output + "' (RLH_OUTPUT_VALUE)");
    // The head's entry t values the state after token t; the critic's V_t is the state before
    // token t: to_token_frame shifts right (entry 0 = 0) and to_output_frame shifts the gradient back.
    const std::vector<double> v = to_token_frame(
        p, read_vector(mb.outputs[k_v].tensor, p.num_tokens, "output '" + opts_.values_output + "'"));
    const std::vector<double> old = view.token_field("values", vl->clipped());
    const std::vector<double> ret = view.token_field("returns", true);
    const std::vector<double> tm = view.token_field("token_mask", true);
    const std::vector<double> sm = view.seq_field("sample_mask", true);
    ValueLossInputs in;
    in.packing = p;
    in.values = v.data();
    in.old_values = ptr(old);
    in.returns = ret.data();
    in.token_mask = tm.data();
    in.sample_mask = sm.data();
    in.global_valid_toks = static_cast<double>(mb.global_num_tokens);
    std::vector<double> grad(p.num_tokens, 0.0);
    const LossResult res = value_loss(*vl, in, grad.data());
    if (mb.grads == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "rlh_microbatch: null grads");
    write_vector(mb.grads[k_v], to_output_frame(p, grad), "gradient of '" + opts_.values_output + "'");
    write_scalar(mb.loss, res.loss);
    report(mb, res);
    return;
  }
  const int k_lp = view.find_output(opts_.logprobs_output);
  if (k_lp < 0)
    throw Error(RLH_E_INVALID_ARGUMENT,
                "the loss needs the output '" + opts_.logprobs_output + "' (RLH_OUTPUT_LOGPROB)");
  const rlh_device where = mb.outputs[k_lp].tensor.device;
  if (device_enabled_ && (!host_accessible(where) || op_on_host_)) {
    // The loss as a kernel op where the tensors are (device_loss.hpp).
    if (view.find_output(opts_.logprobs_unfiltered_output) >= 0)
      throw Error(RLH_E_UNIMPLEMENTED, "the device loss reads the logprob output alone (no '" +
                                           opts_.logprobs_unfiltered_output + "')");
    std::string why;
    DeviceLoss* op = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      op = device_loss_for(where, &why);
    }
    if (op == nullptr) throw Error(RLH_E_UNIMPLEMENTED, "the loss on device type " + std::to_string(where.device_type) + ": " + why);
    LossResult res;
    res.metrics = op->run(std::get_if<ClippedPGConfig>(&cfg_), mb, k_lp, global_positive_toks_);
    report(mb, res);
    return;
  }
  const std::vector<double> lp = view.output(k_lp);
  const double g_tok = static_cast<double>(mb.global_num_tokens);
  const double g_seq = static_cast<double>(mb.global_num_seqs);

  std::vector<double> grad(p.num_tokens, 0.0);
  LossResult res;
  if (const auto* pg = std::get_if<ClippedPGConfig>(&cfg_)) {
    const std::vector<double> adv = view.token_field("advantages", true);
    const std::vector<double> gen = view.token_field("generation_logprobs", true);
    const std::vector<double> tm = view.token_field("token_mask", true);
    const std::vector<double> sm = view.seq_field("sample_mask", true);
    const std::vector<double> prev = view.token_field("prev_logprobs", pg->needs_prev_logprobs());
    const std::vector<double> ref =
        view.token_field("reference_policy_logprobs", pg->needs_reference_logprobs());
    const bool want_rewards = pg->positive_example_nll_weight > 0;
    const std::vector<double> rewards = view.seq_field("rewards", want_rewards);
    const int k_lpu = view.find_output(opts_.logprobs_unfiltered_output);
    const std::vector<double> lpu = k_lpu >= 0 ? view.output(k_lpu) : std::vector<double>();
    std::vector<double> grad_u(k_lpu >= 0 ? p.num_tokens : 0, 0.0);

    ClippedPGInputs in;
    in.packing = p;
    in.logprobs = lp.data();
    in.logprobs_unfiltered = ptr(lpu);
    in.advantages = adv.data();
    in.prev_logprobs = ptr(prev);
    in.generation_logprobs = gen.data();
    in.reference_policy_logprobs = ptr(ref);
    in.token_mask = tm.data();
    in.sample_mask = ptr(sm);
    in.rewards = want_rewards ? ptr(rewards) : nullptr;
    in.global_valid_toks = g_tok;
    in.global_valid_seqs = g_seq;
    in.global_positive_toks = global_positive_toks_;
    res = clipped_pg_loss(*pg, in, grad.data(), k_lpu >= 0 ? grad_u.data() : nullptr);
    if (k_lpu >= 0) view.write_grad(k_lpu, grad_u);
  } else if (std::holds_alternative<NllConfig>(cfg_)) {
    const std::vector<double> tm = view.token_field("token_mask", true);
    const std::vector<double> sm = view.seq_field("sample_mask", true);
    NllInputs in;
    in.packing = p;
    in.logprobs = lp.data();
    in.token_mask = tm.data();
    in.sample_mask = ptr(sm);
    in.global_valid_toks = g_tok;
    res = nll_loss(in, grad.data());
  } else {
    const DpoConfig& dpo = std::get<DpoConfig>(cfg_);
    const std::vector<double> ref = view.token_field("reference_policy_logprobs", true);
    const std::vector<double> tm = view.token_field("token_mask", true);
    const std::vector<double> sm = view.seq_field("sample_mask", true);
    DpoInputs in;
    in.packing = p;
    in.logprobs = lp.data();
    in.reference_policy_logprobs = ref.data();
    in.token_mask = tm.data();
    in.sample_mask = ptr(sm);
    in.global_valid_seqs = g_seq;
    res = dpo_loss(dpo, in, grad.data());
  }
  view.write_grad(k_lp, grad);
  write_scalar(mb.loss, res.loss);
  report(mb, res);
}

void LossAdapter::report(const rlh_microbatch& mb, const LossResult& res) {
  const bool has_metric =
      mb.struct_size >= RLH_STRUCT_SIZE(rlh_microbatch, metric_ctx) && mb.metric != nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  for (const Metric& m : res.metrics.items()) {
    if (m.reduce == Reduce::kSum) {
      if (has_metric) mb.metric(mb.metric_ctx, m.name.c_str(), m.value);
    } else {
      extrema_.add(m.name, m.value, m.reduce);
    }
  }
}

}  // namespace rlh::grpo
