// The loss as a kernel op on the backend's device (see device_loss.hpp).
#include "rlhost/grpo/device_loss.hpp"

#include <span>

#include "rlhost/losses/loss_ops.hpp"
#include "rlhost/sdk/kernel_registry.hpp"

namespace rlh::grpo {

namespace {

using sdk::Error;

bool host_memory(const rlh_device& d) {
  return d.device_type == RLH_DEVICE_CPU || d.device_type == RLH_DEVICE_CUDA_HOST ||
         d.device_type == RLH_DEVICE_CUDA_MANAGED;
}

bool same_device(const rlh_device& a, const rlh_device& b) {
  return a.device_type == b.device_type && a.device_id == b.device_id;
}

rlh_tensor absent(rlh_device device, rlh_dtype dtype) {
  rlh_tensor t{};
  t.device = device;
  t.dtype = dtype;
  return t;
}

constexpr rlh_dtype kF32{RLH_DTYPE_FLOAT, 32, 1};
// Unit strides for views whose strides are NULL (DLPack: compact), as providers index them.
int64_t kUnit[2] = {1, 1};
rlh_tensor strided(rlh_tensor t) {
  if (t.strides == nullptr && t.ndim > 0) t.strides = kUnit;
  return t;
}
constexpr rlh_dtype kI32{RLH_DTYPE_INT, 32, 1};

// The micro-batch's field `name`: a contiguous [n] (or [n, 1]) tensor of `dtype` on `device`.
const rlh_tensor* find_field(const rlh_batch& b, const char* name) {
  for (size_t i = 0; i < b.num_fields; ++i)
    if (b.fields[i].name != nullptr && std::string_view(b.fields[i].name) == name) return &b.fields[i].tensor;
  return nullptr;
}

void check_vector(const rlh_tensor& t, int64_t n, rlh_dtype dtype, const rlh_device& device, const std::string& what) {
  if (!same_device(t.device, device))
    throw Error(RLH_E_INVALID_ARGUMENT, what + ": on device type " + std::to_string(t.device.device_type) + ":" +
                                            std::to_string(t.device.device_id) + ", not the loss op's " +
                                            std::to_string(device.device_type) + ":" + std::to_string(device.device_id));
  if (t.dtype.code != dtype.code || t.dtype.bits != dtype.bits || t.dtype.lanes != 1)
    throw Error(RLH_E_INVALID_ARGUMENT, what + ": the device loss reads " +
                                            std::string(dtype.code == RLH_DTYPE_INT ? "int32" : "float32") + " tensors");
  const bool shape_ok = (t.ndim == 1 && t.shape[0] == n) || (t.ndim == 2 && t.shape[0] == n && t.shape[1] == 1);
  if (!shape_ok) throw Error(RLH_E_INVALID_ARGUMENT, what + ": expected " + std::to_string(n) + " elements in a vector");
  if (t.strides != nullptr && n > 1 && t.strides[0] != 1)
    throw Error(RLH_E_INVALID_ARGUMENT, what + ": must be contiguous");
}

}  // namespace

std::unique_ptr<DeviceLoss> DeviceLoss::resolve(const sdk::Host& host, const std::string& kernels_json,
                                                const ClippedPGConfig* pg, rlh_device device, std::string* why) {
  std::unique_ptr<DeviceLoss> d(new DeviceLoss);
  d->device_ = device;
  d->registry_ = sdk::make_kernel_registry(host, device, sdk::kernel_pins_from_json(kernels_json), "grpo", "{}",
                                           sdk::kernel_verify_from_json(kernels_json));
  if (d->registry_->providers().empty()) {
    if (why) *why = "no kernel provider runs on device type " + std::to_string(device.device_type);
    return nullptr;
  }
  const char* name = pg ? "clipped_pg_loss" : "nll_loss";
  const size_t metrics = pg ? losses::kClippedPgMetricCount : losses::kNllMetricCount;
  std::vector<rlh_tensor> ins(pg ? 9 : 4, absent(device, kF32));
  ins[pg ? 5 : 3] = absent(device, kI32);
  const std::vector<rlh_tensor> outs(3, absent(device, kF32));
  const std::vector<rlh_named_value> attrs = pg ? losses::clipped_pg_attrs(*pg, {}) : losses::nll_attrs({});
  try {
    d->op_ = d->registry_->resolve(name, device, ins, outs, attrs);
  } catch (const Error& e) {
    if (e.code() != RLH_E_UNIMPLEMENTED) throw;
    if (why) *why = e.what();
    return nullptr;
  }
  if (host_memory(device)) {
    d->host_metrics_.assign(metrics, 0.f);
    d->metrics_ = d->host_metrics_.data();
    return d;
  }
  const sdk::KernelRegistry::Provider* p = d->registry_->find(d->op_.provider());
  if (p == nullptr || !RLH_HAS_FIELD(p->api, rlh_kernels_api, memory_alloc) || p->api->memory_alloc == nullptr ||
      p->api->memory_free == nullptr) {
    if (why) *why = "kernel provider '" + d->op_.provider() + "' offers " + name + " but no device memory for its metrics";
    return nullptr;
  }
  void* mem = nullptr;
  sdk::check(p->api->memory_alloc(p->instance, metrics * sizeof(float), &mem),
             "kernel provider '" + d->op_.provider() + "': the loss metrics buffer");
  d->api_ = p->api;
  d->instance_ = p->instance;
  d->metrics_ = static_cast<float*>(mem);
  return d;
}

DeviceLoss::~DeviceLoss() {
  if (api_ != nullptr && metrics_ != nullptr) api_->memory_free(instance_, metrics_);
  op_ = sdk::Op();  // before the registry that owns its provider
}

Metrics DeviceLoss::run(const ClippedPGConfig* pg, const rlh_microbatch& mb, int k_lp, double global_positive_toks) {
  const rlh_batch& b = *mb.batch;
  const int64_t N = b.num_tokens, S = b.num_seqs;
  auto field = [&](const char* name, int64_t n, bool required) {
    const rlh_tensor* t = find_field(b, name);
    if (t == nullptr) {
      if (required)
        throw Error(RLH_E_INVALID_ARGUMENT, std::string("device loss: batch field '") + name + "' is missing");
      return absent(device_, kF32);
    }
    check_vector(*t, n, kF32, device_, std::string("batch field '") + name + "'");
    return strided(*t);
  };
  // Sequence offsets: the backend's int32 device field, or built here from the host's.
  rlh_tensor cu;
  int64_t cu_shape = S + 1;
  if (const rlh_tensor* t = find_field(b, "cu_seqlens")) {
    check_vector(*t, S + 1, kI32, device_, "batch field 'cu_seqlens'");
    cu = strided(*t);
  } else if (host_memory(device_)) {
    host_cu_.assign(b.seq_offsets, b.seq_offsets + S + 1);
    cu = absent(device_, kI32);
    cu.data = host_cu_.data();
    cu.ndim = 1;
    cu.shape = &cu_shape;
    cu.strides = kUnit;
  } else {
    throw Error(RLH_E_INVALID_ARGUMENT, "device loss: batch field 'cu_seqlens' (int32 on the device) is missing");
  }
  const rlh_tensor lp = strided(mb.outputs[k_lp].tensor);
  check_vector(lp, N, kF32, device_, std::string("output '") + mb.outputs[k_lp].name + "'");
  check_vector(mb.grads[k_lp], N, kF32, device_, "the logprob gradient");
  if (mb.loss == nullptr || !same_device(mb.loss->device, device_)) throw Error(RLH_E_INVALID_ARGUMENT, "device loss: the loss tensor is not on the op's device");

  std::vector<rlh_tensor> ins;
  if (pg != nullptr) {
    ins = {lp,
           field("advantages", N, true),
           field("generation_logprobs", N, true),
           field("token_mask", N, true),
           field("sample_mask", S, true),
           cu,
           field("prev_logprobs", N, pg->needs_prev_logprobs()),
           field("reference_policy_logprobs", N, pg->needs_reference_logprobs()),
           field("rewards", S, pg->positive_example_nll_weight > 0)};
  } else {
    ins = {lp, field("token_mask", N, true), field("sample_mask", S, true), cu};
  }
  const std::span<const losses::OpMetric> table =
      pg ? std::span<const losses::OpMetric>(losses::kClippedPgMetrics) : std::span<const losses::OpMetric>(losses::kNllMetrics);
  int64_t m_shape = int64_t(table.size());
  rlh_tensor metrics = absent(device_, kF32);
  metrics.data = metrics_;
  metrics.ndim = 1;
  metrics.shape = &m_shape;
  metrics.strides = kUnit;
  const std::vector<rlh_tensor> outs = {strided(*mb.loss), strided(mb.grads[k_lp]), metrics};
  const losses::LossCounts counts{double(mb.global_num_tokens), double(mb.global_num_seqs), global_positive_toks};
  const std::vector<rlh_named_value> attrs = pg ? losses::clipped_pg_attrs(*pg, counts) : losses::nll_attrs(counts);
  op_.run(ins, outs, attrs, mb.stream);

  Metrics out;
  const bool has_tensor = RLH_HAS_FIELD(&mb, rlh_microbatch, metric_tensor) && mb.metric_tensor != nullptr;
  if (!has_tensor && !host_memory(device_))
    throw Error(RLH_E_FAILED_PRECONDITION, "device loss: the backend hands over device tensors without metric_tensor");
  for (size_t i = 0; i < table.size(); ++i) {
    if (pg != nullptr && !losses::clipped_pg_metric_reported(*pg, i)) continue;
    const int32_t reduce = table[i].reduce == Reduce::kMin   ? RLH_METRIC_MIN
                           : table[i].reduce == Reduce::kMax ? RLH_METRIC_MAX
                                                             : RLH_METRIC_SUM;
    if (has_tensor) {
      rlh_tensor v = absent(device_, kF32);
      v.data = metrics_;
      v.byte_offset = i * sizeof(float);
      mb.metric_tensor(mb.metric_ctx, table[i].name, &v, reduce);
    } else {
      out.add(table[i].name, metrics_[i], table[i].reduce);
    }
  }
  return out;
}

}  // namespace rlh::grpo
