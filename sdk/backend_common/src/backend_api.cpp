// The rlh_backend_api slots: create/destroy, models, forward, train_step (with the loss-callback
// trampoline), visit_weights, save/load of the training state.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "backend_internal.hpp"
#include "rlhost/backend_common/batch_plan.hpp"
#include "rlhost/sdk/weight_pieces.hpp"

namespace rlh::backend {

using sdk::Error;
using json = nlohmann::json;

namespace {

// ---------------------------------------------------------------------------------------------
// Output requests: ABI output specs -> one engine request, and where each spec reads from.

enum class Slot { logprob, processed, entropy, at_ids, value };

struct OutputPlan {
  engine::OutputRequest req;
  std::vector<Slot> slots;  // per spec
  std::vector<std::string> names;
  int64_t ids_per_token = 0;  // K of the at_ids output
};

OutputPlan plan_outputs(const rlh_output_spec* specs, size_t n, const rlh_batch& batch, const Model& m) {
  if (n == 0 || specs == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "no outputs requested");
  OutputPlan p;
  p.req.logprob = false;
  bool have_temperature = false, have_filter = false;
  for (size_t k = 0; k < n; ++k) {
    const rlh_output_spec& s = specs[k];
    const std::string at = "output " + std::to_string(k);
    if (s.struct_size < RLH_STRUCT_SIZE(rlh_output_spec, ids_field))
      throw Error(RLH_E_INVALID_ARGUMENT, at + ": struct_size is smaller than the interface's first version");
    if (s.name == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, at + ": no name");
    const std::string name = s.name;
    for (const std::string& other : p.names)
      if (other == name) throw Error(RLH_E_INVALID_ARGUMENT, "output '" + name + "' is requested twice");
    if (!(s.temperature > 0) || !std::isfinite(s.temperature))
      throw Error(RLH_E_INVALID_ARGUMENT, "output '" + name + "': temperature must be positive");
    // One head pass computes every output, at one temperature and one top-k/top-p setting.
    if (have_temperature && s.temperature != p.req.temperature)
      throw Error(RLH_E_UNIMPLEMENTED, "output '" + name + "': outputs of one request must share a temperature");
    have_temperature = true;
    p.req.temperature = s.temperature;
    Slot slot;
    switch (s.kind) {
      case RLH_OUTPUT_LOGPROB: {
        if (s.top_k < 0 || !(s.top_p > 0 && s.top_p <= 1))
          throw Error(RLH_E_INVALID_ARGUMENT, "output '" + name + "': top_k must be >= 0 and top_p in (0, 1]");
        if (s.top_k == 0 && s.top_p == 1.0) {
          slot = Slot::logprob;  // no filter: the processed logprob is the raw one
          p.req.logprob = true;
          break;
        }
        if (have_filter && (s.top_k != p.req.top_k || s.top_p != p.req.top_p))
          throw Error(RLH_E_UNIMPLEMENTED, "output '" + name + "': filtered outputs of one request must share top_k/top_p");
        have_filter = true;
        p.req.top_k = s.top_k;
        p.req.top_p = s.top_p;
        p.req.processed_logprob = true;
        slot = Slot::processed;
        break;
      }
      case RLH_OUTPUT_LOGPROB_RAW:
        p.req.logprob = true;
        slot = Slot::logprob;
        break;
      case RLH_OUTPUT_ENTROPY:
        p.req.entropy = true;
        slot = Slot::entropy;
        break;
      case RLH_OUTPUT_LOGPROB_AT_IDS: {
        if (s.ids_field == nullptr)
          throw Error(RLH_E_INVALID_ARGUMENT, "output '" + name + "': RLH_OUTPUT_LOGPROB_AT_IDS needs ids_field");
        if (p.req.logprob_at_ids && p.req.ids_field != s.ids_field)
          throw Error(RLH_E_UNIMPLEMENTED, "output '" + name + "': one ids field per request");
        const rlh_named_tensor* f = nullptr;
        for (size_t i = 0; i < batch.num_fields; ++i)
          if (std::strcmp(batch.fields[i].name, s.ids_field) == 0) f = &batch.fields[i];
        if (f == nullptr)
          throw Error(RLH_E_INVALID_ARGUMENT, "output '" + name + "': the batch has no field '" + s.ids_field + "'");
        const rlh_tensor& t = f->tensor;
        if (t.dtype.code != RLH_DTYPE_INT || (t.dtype.bits != 32 && t.dtype.bits != 64) || t.ndim > 2 ||
            t.shape[0] != batch.num_tokens)
          throw Error(RLH_E_INVALID_ARGUMENT, "output '" + name + "': field '" + s.ids_field +
                                                  "' must be int32/int64 [num_tokens, k]");
        p.req.logprob_at_ids = true;
        p.req.ids_field = s.ids_field;
        p.ids_per_token = t.ndim == 2 ? t.shape[1] : 1;
        slot = Slot::at_ids;
        break;
      }
      case RLH_OUTPUT_VALUE:
        // The scalar head exists on models loaded as value models (model_loading.cpp adds
        // score.weight); a policy loaded as a causal LM has none.
        if (!has_value_head(m))
          throw Error(RLH_E_FAILED_PRECONDITION,
                      "output '" + name + "': RLH_OUTPUT_VALUE needs a value head, and model '" + m.role +
                          "' has none (its checkpoint has no score.weight; load it with role 'reward_model' or "
                          "'critic', or set policy.reward_model_cfg.enabled)");
        p.req.value = true;
        slot = Slot::value;
        break;
      default:
        throw Error(RLH_E_INVALID_ARGUMENT, "output '" + name + "': unknown kind " + std::to_string(s.kind));
    }
    if (slot != Slot::value && m.value_only)
      throw Error(RLH_E_FAILED_PRECONDITION, "output '" + name + "': model '" + m.role +
                                                 "' is a value model without a language-model head (its checkpoint "
                                                 "has score.weight and no lm_head.weight): only RLH_OUTPUT_VALUE");
    p.slots.push_back(slot);
    p.names.push_back(name);
  }
  return p;
}

int64_t width(const OutputPlan& p, size_t k) { return p.slots[k] == Slot::at_ids ? p.ids_per_token : 1; }

std::span<const float> engine_output(const engine::Outputs& o, Slot s) {
  switch (s) {
    case Slot::logprob: return o.logprob;
    case Slot::processed: return o.processed_logprob;
    case Slot::entropy: return o.entropy;
    case Slot::at_ids: return o.logprob_at_ids;
    case Slot::value: return o.value;
  }
  return {};
}

// ---------------------------------------------------------------------------------------------
// Micro-batches

std::vector<MicroBatchData> make_microbatches(const rlh_batch& b, const PlanOptions& o) {
  std::vector<MicroBatchPlan> plans = plan_microbatches(b, o);
  std::vector<MicroBatchData> out;
  out.reserve(plans.size());  // no moves after construction: views point into the elements
  for (auto& p : plans) out.emplace_back(b, std::move(p));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Slots

void backend_destroy(rlh_backend* self) { delete as_backend(self); }

rlh_status* backend_load_model(rlh_backend* self, const rlh_model_args* args, rlh_model** out) {
  Backend* b = as_backend(self);
  return sdk::guard(b ? b->host.make_status() : nullptr, [&] {
    if (b == nullptr || args == nullptr || out == nullptr)
      throw Error(RLH_E_INVALID_ARGUMENT, "load_model: NULL backend, args or out");
    *out = nullptr;
    if (args->struct_size < RLH_STRUCT_SIZE(rlh_model_args, config_len))
      throw Error(RLH_E_INVALID_ARGUMENT, "rlh_model_args: struct_size is smaller than the interface's first version");
    if (args->path == nullptr || *args->path == '\0') throw Error(RLH_E_INVALID_ARGUMENT, "load_model: no path");
    std::unique_ptr<Model> m = load_model(*b, *args);
    *out = reinterpret_cast<rlh_model*>(m.get());
    b->models.push_back(std::move(m));
  });
}

void backend_unload_model(rlh_backend* self, rlh_model* model) {
  Backend* b = as_backend(self);
  if (b == nullptr || model == nullptr) return;
  std::erase_if(b->models, [&](const std::unique_ptr<Model>& m) { return m.get() == as_model(model); });
}

Model& check_model(Backend* b, rlh_model* model) {
  if (b == nullptr || model == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "NULL backend or model");
  for (const auto& m : b->models)
    if (m.get() == as_model(model)) return *m;
  throw Error(RLH_E_INVALID_ARGUMENT, "model handle does not belong to this backend instance");
}

void write_output(const rlh_tensor& dst, const MicroBatchData& d, std::span<const float> src, int64_t K) {
  const int64_t s0 = dst.strides != nullptr ? dst.strides[0] : K;
  const int64_t s1 = dst.ndim == 2 && dst.strides != nullptr ? dst.strides[1] : 1;
  float* base = reinterpret_cast<float*>(static_cast<char*>(dst.data) + dst.byte_offset);
  for (size_t j = 0; j < d.plan().seqs.size(); ++j)
    for (int64_t t = 0; t < d.length(j); ++t)
      for (int64_t k = 0; k < K; ++k)
        base[(d.batch_begin(j) + t) * s0 + k * s1] = src[size_t((d.local_begin(j) + t) * K + k)];
}

rlh_status* backend_forward(rlh_backend* self, rlh_model* model, const rlh_forward_args* args) {
  Backend* b = as_backend(self);
  return sdk::guard(b ? b->host.make_status() : nullptr, [&] {
    Model& m = check_model(b, model);
    if (args == nullptr || args->struct_size < RLH_STRUCT_SIZE(rlh_forward_args, micro_batch_tokens))
      throw Error(RLH_E_INVALID_ARGUMENT, "forward: args missing or older than the interface's first version");
    validate_batch(args->batch, m.desc.vocab_size, m.desc.max_position_embeddings, m.dp != nullptr);
    const rlh_batch& batch = *args->batch;
    tp_check_batch(m, batch, "forward");
    const OutputPlan plan = plan_outputs(args->specs, args->num_outputs, batch, m);
    if (args->outputs == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "forward: outputs is NULL");
    for (size_t k = 0; k < plan.slots.size(); ++k) {
      const rlh_tensor& t = args->outputs[k];
      const int64_t K = width(plan, k);
      const bool shape_ok = t.ndim >= 1 && t.shape != nullptr && t.shape[0] == batch.num_tokens &&
                            ((t.ndim == 1 && K == 1) || (t.ndim == 2 && t.shape[1] == K));
      if (t.device.device_type != RLH_DEVICE_CPU || t.dtype.code != RLH_DTYPE_FLOAT || t.dtype.bits != 32 ||
          !shape_ok || (t.data == nullptr && batch.num_tokens > 0))
        throw Error(RLH_E_INVALID_ARGUMENT, "forward: output '" + plan.names[k] + "' must be a float32 host tensor [" +
                                                std::to_string(batch.num_tokens) +
                                                (K == 1 && plan.slots[k] != Slot::at_ids ? "" : ", " + std::to_string(K)) + "]");
    }
    const BatchingConfig& bc = m.config.batching;
    PlanOptions po;
    if (args->micro_batch_tokens > 0) {
      po.max_tokens = args->micro_batch_tokens;
      po.first_fit_decreasing = true;
    } else if (bc.by_tokens) {
      po.max_tokens = bc.logprob_mb_tokens;
      po.first_fit_decreasing = bc.first_fit_decreasing;
    } else {
      po.max_seqs = bc.logprob_batch_size;
    }
    std::vector<MicroBatchData> mbs = batch.num_seqs > 0 ? make_microbatches(batch, po) : std::vector<MicroBatchData>{};
    const auto run = [&](size_t i) {
      MicroBatchData& d = mbs[i];
      if (b->host.cancelled()) throw Error(RLH_E_CANCELLED, "forward cancelled");
      const engine::Outputs o = m.device ? m.device->forward(d.engine_view(), plan.req)
                                : m.pp()   ? pp_forward(m, d.engine_view(), plan.req)  // every stage gets the outputs
                                           : m.engine->forward(d.engine_view(), plan.req);
      for (size_t k = 0; k < plan.slots.size(); ++k)
        write_output(args->outputs[k], d, engine_output(o, plan.slots[k]), width(plan, k));
    };
    if (m.dp != nullptr) {
      dp_forward(m, mbs.size(), run, plan.req);  // this rank's shard; FSDP peers gather together
    } else {
      for (size_t i = 0; i < mbs.size(); ++i) run(i);
    }
  });
}

// The engine's loss callback around the algorithm's rlh_loss_fn: hands it this micro-batch's
// sliced batch and views of the engine's outputs and (zeroed) gradient buffers, host memory.
struct LossTrampoline {
  const rlh_train_args& args;
  const OutputPlan& plan;
  std::vector<MicroBatchData>& mbs;
  std::vector<std::pair<std::string, double>> metrics;  // summed over micro-batches

  static void metric(void* ctx, const char* name, double value) {
    if (name == nullptr) return;
    auto& v = *static_cast<std::vector<std::pair<std::string, double>>*>(ctx);
    for (auto& [k, x] : v)
      if (k == name) {
        x += value;
        return;
      }
    v.emplace_back(name, value);
  }

  engine::LossResult operator()(const engine::LossContext& ctx, const engine::OutputViews& ov,
                                engine::OutputGrads& og) {
    MicroBatchData& d = mbs[size_t(ctx.index)];
    const rlh_batch& mb_batch = d.abi_batch();
    const int64_t N = mb_batch.num_tokens;
    const size_t n = plan.slots.size();
    std::vector<std::array<int64_t, 2>> shape(n), stride(n);
    std::vector<rlh_named_tensor> outs(n);
    std::vector<rlh_tensor> grads(n);
    // Two specs may read the same engine output (LOGPROB without filtering and LOGPROB_RAW):
    // the second gets its own gradient buffer, added into the engine's after the call.
    std::vector<std::vector<float>> extra;
    std::vector<std::pair<std::span<float>, size_t>> add_back;  // engine buffer, extra index
    std::array<bool, 5> taken{};
    for (size_t k = 0; k < n; ++k) {
      const int64_t K = width(plan, k);
      std::span<const float> src;
      std::span<float> dst;
      switch (plan.slots[k]) {
        case Slot::logprob: src = ov.logprob; dst = og.logprob; break;
        case Slot::processed: src = ov.processed_logprob; dst = og.processed_logprob; break;
        case Slot::entropy: src = ov.entropy; dst = og.entropy; break;
        case Slot::at_ids: src = ov.logprob_at_ids; dst = og.logprob_at_ids; break;
        case Slot::value: src = ov.value; dst = og.value; break;
      }
      float* g = dst.data();
      if (taken[size_t(plan.slots[k])]) {
        extra.emplace_back(dst.size(), 0.0f);
        g = extra.back().data();
        add_back.emplace_back(dst, extra.size() - 1);
      }
      taken[size_t(plan.slots[k])] = true;
      const bool two_d = plan.slots[k] == Slot::at_ids;
      shape[k] = {N, K};
      stride[k] = {K, 1};
      auto view = [&](const float* p) {
        rlh_tensor t{};
        t.data = const_cast<float*>(p);
        t.device = rlh_device{RLH_DEVICE_CPU, 0};
        t.ndim = two_d ? 2 : 1;
        t.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
        t.shape = shape[k].data();
        t.strides = two_d ? stride[k].data() : stride[k].data() + 1;
        return t;
      };
      outs[k] = rlh_named_tensor{plan.names[k].c_str(), view(src.data())};
      grads[k] = view(g);
    }
    float loss = 0;
    rlh_tensor loss_t{};
    loss_t.data = &loss;
    loss_t.device = rlh_device{RLH_DEVICE_CPU, 0};
    loss_t.ndim = 0;
    loss_t.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};

    rlh_microbatch mb{};
    mb.struct_size = RLH_STRUCT_SIZE(rlh_microbatch, metric_ctx);
    mb.batch = &mb_batch;
    mb.outputs = outs.data();
    mb.num_outputs = n;
    mb.grads = grads.data();
    mb.loss = &loss_t;
    mb.global_num_tokens = args.global_num_tokens;
    mb.global_num_seqs = args.global_num_seqs;
    mb.index = ctx.index;
    mb.stream = nullptr;
    mb.metric = &LossTrampoline::metric;
    mb.metric_ctx = &metrics;
    rlh_status* s = args.loss_fn(args.loss_user, &mb);
    if (s != nullptr) {
      sdk::StatusPtr owned(s);
      throw Error(s->code, "loss callback (micro-batch " + std::to_string(ctx.index) + "): " + sdk::status_message(s));
    }
    for (auto& [dst, e] : add_back)
      for (size_t i = 0; i < dst.size(); ++i) dst[i] += extra[e][i];
    return engine::LossResult{double(loss), {}};
  }
};

// The loss on the device (rlh_train_args.loss_on_device, BACKEND 0.4) around the algorithm's
// rlh_loss_fn: the callback gets device views of the logprob output, its gradient and the loss,
// the micro-batch's numeric [n] and [n, 1] fields as float32 device tensors (converted and
// uploaded once per step) beside the int32 device field "cu_seqlens", and reports metrics
// through metric_tensor into the step's slots. Loss and metrics come down once, with the
// gradient norm, and are combined here in micro-batch order (sum, min or max per metric).
struct DeviceLossTrampoline {
  static constexpr int64_t kMetricsPerMicroBatch = 64;
  const rlh_train_args& args;
  const OutputPlan& plan;
  std::vector<MicroBatchData>& mbs;
  rlh_device device;
  std::vector<float> inputs;  // every micro-batch's fields, float32, back to back
  struct FieldAt {
    std::string name;
    int64_t offset = 0, n = 0;
  };
  std::vector<std::vector<FieldAt>> fields;           // per micro-batch
  std::vector<std::pair<std::string, int32_t>> names;  // metric id -> name, reduce
  std::vector<std::vector<char>> reported;            // [micro-batch][metric id]
  std::vector<std::pair<std::string, double>> host_metrics;  // plain metric() calls, summed
  std::vector<float> kept;
  std::string error;  // the first bad metric_tensor call (the slot returns nothing)

  DeviceLossTrampoline(const rlh_train_args& a, const OutputPlan& p, std::vector<MicroBatchData>& m, rlh_device d)
      : args(a), plan(p), mbs(m), device(d) {
    fields.resize(mbs.size());
    reported.resize(mbs.size());
    for (size_t i = 0; i < mbs.size(); ++i) {
      const rlh_batch& b = mbs[i].abi_batch();
      for (size_t f = 0; f < b.num_fields; ++f) {
        const rlh_tensor& t = b.fields[f].tensor;
        if (b.fields[f].name == nullptr || t.dtype.lanes != 1) continue;
        const bool vec = t.ndim == 1 || (t.ndim == 2 && t.shape[1] == 1);
        if (!vec || (t.shape[0] != b.num_tokens && t.shape[0] != b.num_seqs)) continue;
        const int64_t n = t.shape[0];
        FieldAt at{b.fields[f].name, int64_t(inputs.size()), n};
        if (!append_f32(t, n)) continue;
        fields[i].push_back(std::move(at));
      }
    }
  }
  int64_t slots() const { return int64_t(mbs.size()) * (1 + kMetricsPerMicroBatch); }

  // Appends field `t` (contiguous, as MicroBatchData copies it) as float32; false for a dtype
  // no loss reads as a number.
  bool append_f32(const rlh_tensor& t, int64_t n) {
    const char* p = static_cast<const char*>(t.data) + t.byte_offset;
    const int code = t.dtype.code, bits = t.dtype.bits;
    auto each = [&](auto read) {
      for (int64_t i = 0; i < n; ++i) inputs.push_back(read(i));
      return true;
    };
    auto load = [&](auto v, int64_t i) {
      std::memcpy(&v, p + i * int64_t(sizeof(v)), sizeof(v));
      return v;
    };
    if (code == RLH_DTYPE_FLOAT && bits == 32) return each([&](int64_t i) { return load(float(0), i); });
    if (code == RLH_DTYPE_FLOAT && bits == 64) return each([&](int64_t i) { return float(load(double(0), i)); });
    if (code == RLH_DTYPE_BFLOAT && bits == 16)
      return each([&](int64_t i) {
        const uint32_t u = uint32_t(load(uint16_t(0), i)) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
      });
    if (code == RLH_DTYPE_INT && bits == 32) return each([&](int64_t i) { return float(load(int32_t(0), i)); });
    if (code == RLH_DTYPE_INT && bits == 64) return each([&](int64_t i) { return float(load(int64_t(0), i)); });
    if ((code == RLH_DTYPE_UINT || code == RLH_DTYPE_BOOL) && bits == 8)
      return each([&](int64_t i) {
        const uint8_t v = load(uint8_t(0), i);
        return code == RLH_DTYPE_BOOL ? float(v != 0) : float(v);
      });
    return false;
  }

  struct Call {
    DeviceLossTrampoline* self;
    int64_t mb;
    const DeviceEngine::DeviceLossViews* views;
  };
  static void metric(void* ctx, const char* name, double value) {
    if (name != nullptr) LossTrampoline::metric(&static_cast<Call*>(ctx)->self->host_metrics, name, value);
  }
  static void metric_tensor(void* ctx, const char* name, const rlh_tensor* value, int32_t reduce) {
    Call& c = *static_cast<Call*>(ctx);
    DeviceLossTrampoline& t = *c.self;
    auto fail = [&](const std::string& why) {
      if (t.error.empty()) t.error = "metric_tensor('" + std::string(name ? name : "(null)") + "'): " + why;
    };
    if (name == nullptr || value == nullptr) return fail("null name or value");
    if (reduce != RLH_METRIC_SUM && reduce != RLH_METRIC_MIN && reduce != RLH_METRIC_MAX)
      return fail("reduce " + std::to_string(reduce) + " is not RLH_METRIC_SUM, _MIN or _MAX");
    int64_t numel = 1;
    for (int d = 0; d < value->ndim; ++d) numel *= value->shape[d];
    if (numel != 1 || value->dtype.code != RLH_DTYPE_FLOAT || value->dtype.bits != 32 || value->dtype.lanes != 1)
      return fail("expected a 0-d float32 tensor");
    if (value->device.device_type != t.device.device_type || value->device.device_id != t.device.device_id)
      return fail("the tensor is not on the backend's device");
    size_t id = 0;
    while (id < t.names.size() && t.names[id].first != name) ++id;
    if (id == t.names.size()) {
      if (int64_t(id) >= kMetricsPerMicroBatch)
        return fail("more than " + std::to_string(kMetricsPerMicroBatch) + " metrics in a step");
      t.names.emplace_back(name, reduce);
    } else if (t.names[id].second != reduce) {
      return fail("reported with another reduce than before");
    }
    std::vector<char>& seen = t.reported[size_t(c.mb)];
    if (seen.size() <= id) seen.resize(id + 1, 0);
    if (seen[id]) return fail("reported twice for one micro-batch");
    seen[id] = 1;
    c.views->keep(reinterpret_cast<const float*>(static_cast<const char*>(value->data) + value->byte_offset),
                  c.mb * (1 + kMetricsPerMicroBatch) + 1 + int64_t(id));
  }

  void run(const engine::LossContext& ctx, const DeviceEngine::DeviceLossViews& v) {
    MicroBatchData& d = mbs[size_t(ctx.index)];
    const rlh_batch& host = d.abi_batch();
    const int64_t N = host.num_tokens, S = host.num_seqs;
    auto view = [&](const void* p, const int64_t* shape, int ndim, rlh_dtype dt) {
      rlh_tensor t{};
      t.data = const_cast<void*>(p);
      t.device = device;
      t.ndim = ndim;
      t.dtype = dt;
      t.shape = const_cast<int64_t*>(shape);
      return t;
    };
    const std::vector<FieldAt>& fa = fields[size_t(ctx.index)];
    std::vector<int64_t> shapes(fa.size() + 2);
    std::vector<rlh_named_tensor> named;
    for (size_t k = 0; k < fa.size(); ++k) {
      shapes[k] = fa[k].n;
      named.push_back({fa[k].name.c_str(), view(v.inputs + fa[k].offset, &shapes[k], 1, rlh_dtype{RLH_DTYPE_FLOAT, 32, 1})});
    }
    shapes[fa.size()] = S + 1;
    named.push_back({"cu_seqlens", view(v.cu_seqlens, &shapes[fa.size()], 1, rlh_dtype{RLH_DTYPE_INT, 32, 1})});
    shapes[fa.size() + 1] = N;
    rlh_batch b = host;
    b.fields = named.data();
    b.num_fields = named.size();
    const rlh_dtype f32{RLH_DTYPE_FLOAT, 32, 1};
    rlh_named_tensor out{plan.names[0].c_str(), view(v.logprob, &shapes[fa.size() + 1], 1, f32)};
    rlh_tensor grad = view(v.dlogprob, &shapes[fa.size() + 1], 1, f32);
    rlh_tensor loss = view(v.loss, nullptr, 0, f32);
    Call call{this, ctx.index, &v};
    rlh_microbatch mb{};
    mb.struct_size = RLH_STRUCT_SIZE(rlh_microbatch, metric_tensor);
    mb.batch = &b;
    mb.outputs = &out;
    mb.num_outputs = 1;
    mb.grads = &grad;
    mb.loss = &loss;
    mb.global_num_tokens = args.global_num_tokens;
    mb.global_num_seqs = args.global_num_seqs;
    mb.index = ctx.index;
    mb.stream = v.stream;
    mb.metric = &DeviceLossTrampoline::metric;
    mb.metric_ctx = &call;
    mb.metric_tensor = &DeviceLossTrampoline::metric_tensor;
    rlh_status* s = args.loss_fn(args.loss_user, &mb);
    if (s != nullptr) {
      sdk::StatusPtr owned(s);
      throw Error(s->code, "loss callback (micro-batch " + std::to_string(ctx.index) + "): " + sdk::status_message(s));
    }
    if (!error.empty()) throw Error(RLH_E_INVALID_ARGUMENT, "loss callback (micro-batch " + std::to_string(ctx.index) + "): " + error);
    v.keep(v.loss, ctx.index * (1 + kMetricsPerMicroBatch));
  }

  // After the step: the loss summed over micro-batches, and the metrics combined.
  double loss() const {
    double l = 0;
    for (size_t i = 0; i < mbs.size(); ++i) l += kept.at(i * size_t(1 + kMetricsPerMicroBatch));
    return l;
  }
  std::vector<std::pair<std::string, double>> metrics() const {
    std::vector<std::pair<std::string, double>> out = host_metrics;
    for (size_t id = 0; id < names.size(); ++id) {
      const int32_t red = names[id].second;
      bool any = false;
      double acc = 0;
      for (size_t i = 0; i < mbs.size(); ++i) {
        if (reported[i].size() <= id || !reported[i][id]) continue;
        const double x = kept.at(i * size_t(1 + kMetricsPerMicroBatch) + 1 + id);
        acc = !any ? x : red == RLH_METRIC_SUM ? acc + x : red == RLH_METRIC_MIN ? std::min(acc, x) : std::max(acc, x);
        any = true;
      }
      if (any) out.emplace_back(names[id].first, acc);
    }
    return out;
  }
};

rlh_status* backend_train_step(rlh_backend* self, rlh_model* model, const rlh_train_args* args,
                               rlh_train_result* result) {
  Backend* b = as_backend(self);
  return sdk::guard(b ? b->host.make_status() : nullptr, [&] {
    Model& m = check_model(b, model);
    if (args == nullptr || args->struct_size < RLH_STRUCT_SIZE(rlh_train_args, eval_only))
      throw Error(RLH_E_INVALID_ARGUMENT, "train_step: args missing or older than the interface's first version");
    if (result == nullptr || result->struct_size < RLH_STRUCT_SIZE(rlh_train_result, num_micro_batches))
      throw Error(RLH_E_INVALID_ARGUMENT, "train_step: result missing or older than the interface's first version");
    if (args->loss_fn == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "train_step: loss_fn is NULL");
    const bool eval_only = args->eval_only != 0;
    if (!eval_only && !m.trainable)
      throw Error(RLH_E_FAILED_PRECONDITION, "train_step: model '" + m.role +
                                                 "' was loaded without RLH_MODEL_TRAINABLE (use eval_only for a loss)");
    if (m.device && !m.trainable)
      throw Error(RLH_E_FAILED_PRECONDITION, "train_step: model '" + m.role + "' is frozen on " + m.kernels +
                                                 ", which keeps no gradients for it (an eval_only loss on the "
                                                 "device needs RLH_MODEL_TRAINABLE)");
    validate_batch(args->batch, m.desc.vocab_size, m.desc.max_position_embeddings, m.dp != nullptr);
    const rlh_batch& batch = *args->batch;
    tp_check_batch(m, batch, "train_step");
    const OutputPlan plan = plan_outputs(args->specs, args->num_outputs, batch, m);

    const BatchingConfig& bc = m.config.batching;
    PlanOptions po;
    if (args->micro_batch_seqs > 0) {
      po.max_seqs = args->micro_batch_seqs;
    } else if (args->micro_batch_tokens > 0) {
      po.max_tokens = args->micro_batch_tokens;
      po.first_fit_decreasing = true;
    } else if (bc.by_tokens) {
      po.max_tokens = bc.train_mb_tokens;
      po.first_fit_decreasing = bc.first_fit_decreasing;
    } else {
      po.max_seqs = bc.train_micro_batch_size;
    }
    // At DP > 1 the batch is this rank's shard of the global batch (maybe empty).
    std::vector<MicroBatchData> mbs = batch.num_seqs > 0 ? make_microbatches(batch, po) : std::vector<MicroBatchData>{};
    std::vector<engine::MicroBatch> views;
    for (const MicroBatchData& d : mbs) views.push_back(d.engine_view());
    if (b->host.cancelled()) throw Error(RLH_E_CANCELLED, "train_step cancelled");

    engine::StepOptions so;
    so.global_tokens = args->global_num_tokens;
    so.global_sequences = args->global_num_seqs;
    so.outputs = plan.req;
    so.apply_optimizer = false;  // the backend's optimizer applies the update (optimizer.hpp)
    LossTrampoline tramp{*args, plan, mbs, {}};
    // The loss on the device when the caller asks and this model can: one device, no data
    // parallelism (its reductions of loss and metrics are the host's), the logprob output alone.
    const bool device_loss = RLH_HAS_FIELD(args, rlh_train_args, loss_on_device) && args->loss_on_device != 0 &&
                             m.device && m.dp == nullptr && m.device->device_loss() && plan.slots.size() == 1 &&
                             plan.slots[0] == Slot::logprob && !plan.req.routed_experts &&
                             plan.req.replay_routing_field.empty();
    const engine::LossFn loss = [&](const engine::LossContext& c, const engine::OutputViews& ov,
                                    engine::OutputGrads& og) { return tramp(c, ov, og); };

    engine::StepResult r;
    Optimizer::StepInfo info;
    bool updated = false;
    int64_t comm_bytes = 0, tp_bytes = 0, cp_bytes = 0, pp_bytes = 0, ep_bytes = 0;
    double comm_seconds = 0, tp_seconds = 0, cp_seconds = 0, ep_seconds = 0;
    if (m.dp != nullptr) {  // data parallel: reduced gradients, the sharded update (dp_model.cpp)
      DpStepResult d = dp_train_step(m, views, so, loss, eval_only, args->learning_rate);
      r = std::move(d.r);
      info = d.info;
      updated = d.updated;
      comm_bytes = d.comm_bytes;
      comm_seconds = d.comm_seconds;
      tp_bytes = d.tp_comm_bytes;
      tp_seconds = d.tp_comm_seconds;
      ep_bytes = d.ep_comm_bytes;
      ep_seconds = d.ep_comm_seconds;
      cp_bytes = d.cp_comm_bytes;
      cp_seconds = d.cp_comm_seconds;
      pp_bytes = d.pp_comm_bytes;
      // The last stage's callback metrics (pipeline), summed over the data-parallel ranks
      // without cp (every rank of a cp group computes the same ones).
      tramp.metrics = all_reduce_named(m.dp->sums(), pp_share_named(m, tramp.metrics));
    } else if (m.device) {  // the device applies its own update (device_engine.hpp)
      info = m.next_update(args->learning_rate);
      so.apply_optimizer = !eval_only;
      so.lr = info.lr;
      if (device_loss) {
        DeviceLossTrampoline dt(*args, plan, mbs, m.device->device());
        DeviceEngine::DeviceLoss dl;
        dl.inputs = dt.inputs;
        dl.slots = dt.slots();
        dl.kept = &dt.kept;
        dl.run = [&dt](const engine::LossContext& c, const DeviceEngine::DeviceLossViews& v) { dt.run(c, v); };
        r = m.device->train_step_device_loss(views, so, info.weight_decay, dl);
        r.loss = dt.loss();
        tramp.metrics = dt.metrics();
      } else {
        r = m.device->train_step(views, so, info.weight_decay, loss);
      }
      updated = so.apply_optimizer && !r.skipped;
    } else {
      r = m.engine->train_step(views, so, loss);
      if (m.optimizer) {
        if (!eval_only && !r.skipped) {
          info = m.optimizer->step(args->learning_rate, r.clip_coef);
          updated = true;
        } else {
          info = m.optimizer->next(args->learning_rate);
        }
      }
    }
    result->loss = r.loss;
    result->grad_norm = r.grad_norm;
    int64_t num_mbs = int64_t(mbs.size());
    if (m.dp != nullptr) m.dp->sums().all_reduce(std::span<int64_t>(&num_mbs, 1), RLH_REDUCE_SUM);
    result->num_micro_batches = num_mbs;
    json metrics = {{"loss", r.loss},
                    {"grad_norm", r.grad_norm},
                    {"clip_coef", r.clip_coef},
                    {"lr", info.lr},
                    {"weight_decay", info.weight_decay},
                    {"step", m.version()},
                    {"num_micro_batches", num_mbs},
                    {"num_tokens", r.tokens},
                    {"eval_only", eval_only},
                    {"updated", updated},
                    {"skipped_nonfinite", r.skipped},
                    // This rank's training state (parameters, gradients, moments, or its shards
                    // of them) and the data-parallel size.
                    {"memory/state_bytes", m.device ? m.device->state_bytes() : m.state_alloc.live_bytes()},
                    {"memory/host_state_bytes", m.device ? m.device->host_state_bytes() : 0},
                    // A device model's bf16 weights and fp32 gradient buffer (FSDP: this rank's
                    // blocks) and the gathered units' staging; the CPU engine counts all in
                    // state_bytes.
                    {"memory/weight_bytes", m.device ? m.device->weight_bytes() : 0},
                    {"memory/grad_bytes", m.device ? m.device->grad_bytes() : 0},
                    {"memory/stage_bytes", m.device ? m.device->stage_bytes() : 0},
                    {"dp_size", m.dp != nullptr ? m.dp->size() : 1},
                    {"dp/comm_bytes", comm_bytes},
                    {"dp/comm_seconds", comm_seconds},
                    {"tp/comm_bytes", tp_bytes},
                    {"tp/comm_seconds", tp_seconds},
                    {"ep/comm_bytes", ep_bytes},
                    {"ep/comm_seconds", ep_seconds},
                    {"pp/comm_bytes", pp_bytes}};
    if (m.cp_comm) {  // context parallelism: its group's size and traffic
      metrics["cp_size"] = m.dp->cp_size();
      metrics["cp/comm_bytes"] = cp_bytes;
      metrics["cp/comm_seconds"] = cp_seconds;
    }
    // The engine's own metrics (MoE auxiliary losses and expert load), beside the backend's.
    for (const auto& [name, value] : r.metrics) metrics[name] = value;
    json loss_metrics = json::object();
    for (const auto& [name, value] : tramp.metrics) loss_metrics[name] = value;
    metrics["metrics"] = loss_metrics;
    if (RLH_HAS_FIELD(result, rlh_train_result, user) && result->write != nullptr) {
      const std::string text = metrics.dump();
      result->write(result->user, text.data(), text.size());
    }
  });
}

namespace {

// Row-major strides of a shape.
std::vector<int64_t> row_major(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int d = int(shape.size()) - 2; d >= 0; --d) strides[size_t(d)] = strides[size_t(d) + 1] * shape[size_t(d) + 1];
  return strides;
}

void call_weight_fn(rlh_weight_fn fn, void* user, const std::string& name, rlh_tensor& t) {
  rlh_status* s = fn(user, name.c_str(), &t);
  if (s != nullptr) {
    sdk::StatusPtr owned(s);
    throw Error(s->code, "visit_weights callback at '" + name + "': " + sdk::status_message(s));
  }
}

// A device model visited where it lives: views of its fp32 master weights, HF piece by piece
// (a stacked piece is a slab, or one run of an interleaved tensor; a concatenated one a strided
// block of the engine tensor), so nothing is copied.
void visit_device_views(Model& m, rlh_weight_fn fn, void* user) {
  const rlh_device dev = m.device->device();
  size_t seen = 0;
  m.device->visit_master_views([&](size_t i, const DeviceEngine::ParamView& v) {
    if (i >= m.desc.params.size())
      throw Error(RLH_E_INTERNAL, "visit_weights: the device engine gave a view of parameter " + std::to_string(i) +
                                      " of " + std::to_string(m.desc.params.size()));
    ++seen;
    const sdk::ParamDesc& p = m.desc.params[i];
    const std::vector<int64_t> engine_strides = row_major(p.shape);
    for (size_t k = 0; k < p.hf_names.size(); ++k) {
      std::vector<int64_t> shape = p.hf_shapes[k], strides = row_major(shape);
      const int64_t n = numel(shape);
      const float* data = v.data;
      const bool runs_are_pieces = v.pieces == int64_t(p.hf_names.size()) && v.piece == n;
      if (p.transform == sdk::ParamTransform::stack && (v.pieces == 1 || runs_are_pieces)) {
        data = v.data + int64_t(k) * (v.pieces > 1 ? v.stride : n);
      } else if (p.transform == sdk::ParamTransform::concat && v.pieces == 1) {
        int64_t before = 0;
        for (size_t j = 0; j < k; ++j) before += p.hf_shapes[j][size_t(p.axis)];
        data = v.data + before * engine_strides[size_t(p.axis)];
        strides = engine_strides;  // a block of the engine tensor along `axis`
      } else if (p.transform != sdk::ParamTransform::none || v.pieces != 1) {
        throw Error(RLH_E_INTERNAL, "visit_weights: parameter " + p.name + " has a device layout (" +
                                        std::to_string(v.pieces) + " runs) its HF pieces cannot be viewed in");
      }
      rlh_tensor t{};
      t.data = const_cast<float*>(data);
      t.device = dev;
      t.ndim = int32_t(shape.size());
      t.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
      t.shape = shape.data();
      t.strides = strides.data();
      call_weight_fn(fn, user, p.hf_names[k], t);
    }
  });
  if (seen != m.desc.params.size())
    throw Error(RLH_E_INTERNAL, "visit_weights: the device engine gave " + std::to_string(seen) + " views for " +
                                    std::to_string(m.desc.params.size()) + " parameters");
}

rlh_status* visit_weights_where(rlh_backend* self, rlh_model* model, const rlh_device& readable,
                                rlh_weight_fn fn, void* user, int64_t* version) {
  Backend* b = as_backend(self);
  return sdk::guard(b ? b->host.make_status() : nullptr, [&] {
    Model& m = check_model(b, model);
    if (fn == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "visit_weights: fn is NULL");
    if (version != nullptr) *version = m.version();
    // (A device model holds its whole masters on every data-parallel rank, or under FSDP
    // gathers them: then collective, as the CPU engine's FSDP visit is. Under tensor
    // parallelism its device memory holds only this rank's pieces of the cut tensors, which a
    // reader of whole HF tensors cannot take: the masters are gathered over the tp group into
    // host copies instead (collective), visited as a host reader's below.)
    if (m.device && !m.tp() && readable.device_type != RLH_DEVICE_CPU) {
      const rlh_device d = m.device->device();
      if (d.device_type == readable.device_type && d.device_id == readable.device_id) {
        visit_device_views(m, fn, user);
        return;
      }
    }
    std::vector<float> split;  // a fused engine tensor's HF piece
    const auto visit = [&](size_t i, std::span<float> w) {
      const sdk::ParamDesc& p = m.desc.params[i];
      for (size_t k = 0; k < p.hf_names.size(); ++k) {
        std::vector<int64_t> shape = p.hf_shapes[k], strides = row_major(shape);
        const int64_t n = numel(shape);
        float* data = w.data();
        if (p.transform == sdk::ParamTransform::stack) {
          data = w.data() + int64_t(k) * n;  // stacked pieces are contiguous slabs: a view
        } else if (p.transform == sdk::ParamTransform::concat) {
          // Piece k spans [before, before + len) along `axis` of the engine tensor: copy it out.
          int64_t before = 0, outer = 1, rest = 1;
          for (size_t j = 0; j < k; ++j) before += p.hf_shapes[j][size_t(p.axis)];
          for (int64_t a = 0; a < p.axis; ++a) outer *= p.shape[size_t(a)];
          for (size_t a = size_t(p.axis) + 1; a < p.shape.size(); ++a) rest *= p.shape[a];
          const int64_t len = shape[size_t(p.axis)] * rest, full = p.shape[size_t(p.axis)] * rest;
          split.resize(size_t(n));
          for (int64_t o = 0; o < outer; ++o)
            std::memcpy(split.data() + o * len, w.data() + o * full + before * rest, size_t(len) * sizeof(float));
          data = split.data();
        }
        rlh_tensor t{};
        t.data = data;
        t.device = rlh_device{RLH_DEVICE_CPU, 0};
        t.ndim = int32_t(shape.size());
        t.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
        t.shape = shape.data();
        t.strides = strides.data();
        call_weight_fn(fn, user, p.hf_names[k], t);
      }
    };
    if (m.dp != nullptr && !m.device) {  // FSDP gathers unit by unit (collective)
      dp_visit_parameters(m, visit);
      return;
    }
    // A device model's weights are copied to the host once (under tensor parallelism gathered
    // over the tp group: collective), then visited like the CPU engine's.
    std::vector<std::vector<float>> host;
    if (m.device) host = device_parameters(m);
    for (size_t i = 0; i < m.desc.params.size(); ++i)
      visit(i, m.device ? std::span<float>(host[i]) : m.engine->param(i));
  });
}

}  // namespace

rlh_status* backend_visit_weights(rlh_backend* self, rlh_model* model, rlh_weight_fn fn, void* user,
                                  int64_t* version) {
  return visit_weights_where(self, model, rlh_device{RLH_DEVICE_CPU, 0}, fn, user, version);
}

rlh_status* backend_visit_weights_on(rlh_backend* self, rlh_model* model, const rlh_visit_args* args,
                                     rlh_weight_fn fn, void* user, int64_t* version) {
  if (args == nullptr || args->struct_size < RLH_STRUCT_SIZE(rlh_visit_args, device)) {
    Backend* b = as_backend(self);
    return sdk::guard(b ? b->host.make_status() : nullptr, [] {
      throw Error(RLH_E_INVALID_ARGUMENT, "visit_weights_on: missing or too small rlh_visit_args");
    });
  }
  return visit_weights_where(self, model, args->device, fn, user, version);
}

// BACKEND 0.5: this rank's pieces with their placement, ungathered (docs/backends.md, "Weight
// pieces"). Under tensor parallelism a piece is the rank's slice of each HF tensor (a padded
// vocabulary block without its padding), under expert parallelism its block of experts (one HF
// tensor each), under pipeline parallelism its stage's tensors; data- and context-parallel
// replicas hold the same pieces. The sender of a replicated piece rotates with the parameter
// (parameter i: replica i mod the replicas), so the replicas share the sending. FSDP shards
// flat, across tensor boundaries: a rank's part of a tensor is a flat range of it, visited as the
// few boxes that range covers (a partial first row, whole rows, a partial last row), straight from
// the shard, so each shard rank sends exactly its shard and nothing is gathered. A device model
// visits whole tensors (its masters copied to the host, gathered under FSDP), the data-parallel
// ranks taking turns as senders; under tensor parallelism its pieces (copied to the host), as
// the CPU engine's.
rlh_status* backend_visit_weight_pieces(rlh_backend* self, rlh_model* model, rlh_weight_piece_fn fn, void* user,
                                        int64_t* version) {
  Backend* b = as_backend(self);
  return sdk::guard(b ? b->host.make_status() : nullptr, [&] {
    Model& m = check_model(b, model);
    if (fn == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "visit_weight_pieces: fn is NULL");
    if (version != nullptr) *version = m.version();
    const int D = m.dp != nullptr ? m.dp->size() : 1, dp_rank = m.dp != nullptr ? m.dp->rank() : 0;
    const auto emit = [&](const sdk::ParamDesc& p, const sdk::EngineBox& box, const float* base, bool sender) {
      for (size_t k = 0; k < p.hf_names.size(); ++k) {
        const sdk::HfBox h = sdk::hf_box(p, k, box);
        if (!h.present) continue;
        rlh_tensor t{};
        t.data = const_cast<float*>(base + h.at);
        t.device = rlh_device{RLH_DEVICE_CPU, 0};
        t.ndim = int32_t(h.extent.size());
        t.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
        t.shape = const_cast<int64_t*>(h.extent.data());
        t.strides = const_cast<int64_t*>(h.strides.data());
        rlh_weight_piece piece{};
        piece.struct_size = sizeof(rlh_weight_piece);
        piece.hf_name = p.hf_names[k].c_str();
        piece.data = &t;
        piece.global_shape = p.hf_shapes[k].data();
        piece.offset = h.offset.data();
        piece.flags = sender ? RLH_PIECE_SENDER : 0u;
        rlh_status* s = fn(user, &piece);
        if (s != nullptr) {
          sdk::StatusPtr owned(s);
          throw Error(s->code, "visit_weight_pieces callback at '" + p.hf_names[k] + "': " + sdk::status_message(s));
        }
      }
    };
    const auto rotates_to_me = [](size_t i, int rank, int size) { return size <= 1 || int(i % size_t(size)) == rank; };
    if (m.dp_mode == Model::Dp::fsdp && !m.device) {
      // This rank's flat shard of every unit as it lies, no gather: each parameter's part of it
      // is the few boxes its flat range covers (flat_range_boxes), viewed in the shard storage.
      // The shard ranks' parts tile each tensor; HSDP's replicas of a shard take turns sending.
      const engine::Engine& e = *m.engine;
      const ShardLayout& L = *m.shards;
      const float* shard = m.fsdp->param_shard();
      const int reps = m.dp->replicate ? m.dp->replicate.size() : 1, rep = m.dp->replicate ? m.dp->replicate.rank() : 0;
      for (size_t i = 0; i < m.desc.params.size(); ++i) {
        const sdk::ParamDesc& p = m.desc.params[i];
        const int64_t o = e.param_offset(i), n = numel(p.shape);
        if (n == 0) continue;
        const ShardSegment& s = L.segments()[L.segment_of(o)];
        const int64_t mine = s.begin + int64_t(s.rank) * s.block;  // this rank's block of the unit
        const int64_t lo = std::max(o, mine), hi = std::min({o + n, mine + s.block, s.end});
        if (lo >= hi) continue;
        const std::vector<int64_t> strides = row_major(p.shape);
        for (const sdk::EngineBox& box : sdk::flat_range_boxes(p.shape, lo - o, hi - o)) {
          int64_t first = o;  // the box's first element in the flat storage
          for (size_t d = 0; d < strides.size(); ++d) first += box.lo[d] * strides[d];
          emit(p, box, shard + s.at + (first - mine), rotates_to_me(i, rep, reps));
        }
      }
      return;
    }
    if (m.device && !m.tp()) {  // a device model's whole masters, copied to the host (gathered under FSDP)
      const auto whole = [&](size_t i, std::span<float> w) {
        const sdk::ParamDesc& p = m.desc.params[i];
        emit(p, sdk::whole_box(p), w.data(), rotates_to_me(i, dp_rank, D));
      };
      std::vector<std::vector<float>> host = m.device->parameters();
      for (size_t i = 0; i < m.desc.params.size(); ++i) whole(i, host[i]);
      return;
    }
    // Under tensor parallelism a device model's pieces are copied to the host (in its local
    // shapes, as the CPU engine holds them) and visited as the CPU engine's are.
    std::vector<std::vector<float>> device_local;
    if (m.device) device_local = m.device->parameters();
    for (size_t i = 0; i < m.desc.params.size(); ++i) {
      const int64_t j = local_param(m, i);
      if (j < 0) continue;  // another pipeline stage's
      const sdk::ParamDesc& p = m.desc.params[i];
      sdk::EngineBox box = m.tp() ? sdk::tp_box(*m.tp(), i) : sdk::whole_box(p);
      // A tied embedding's copy on the last stage is not its owner's: it is never the sender.
      bool sender = !m.pp() || m.pp()->owner[i] == m.dp->pp_rank();
      if (m.ep() && m.ep()->is_expert(i)) {
        // This rank's block of experts (whole over the tensor-parallel ranks, which hold other
        // blocks); the expert data-parallel ranks hold the same block.
        const sdk::EpPiece& e = m.ep()->pieces[i];
        box.lo[0] = e.begin;
        box.count[0] = box.stored[0] = e.count;
        sender = sender && rotates_to_me(i, m.dp->edp.rank(), m.dp->edp.size());
      } else {
        sender = sender && rotates_to_me(i, dp_rank, D);
        if (m.tp()) {  // a piece several tensor-parallel ranks hold alike is sent by the first
          const sdk::TpPiece& mine = m.tp()->pieces[i];
          for (int r = 0; r < m.dp->tp_rank(); ++r) {
            const sdk::TpPiece& o = m.tp_layouts[size_t(r)].pieces[i];
            if (o.axis == mine.axis && o.begin == mine.begin && o.count == mine.count) sender = false;
          }
        }
      }
      emit(p, box, m.device ? device_local[size_t(j)].data() : m.engine->param(size_t(j)).data(), sender);
    }
  });
}

// The loops' data-parallel layout (BACKEND 0.3): the group losses and metrics are summed over
// (Megatron's dp, without the cp ranks), so a tp/cp/pp group's ranks share one rank.
rlh_status* backend_data_parallel(rlh_backend* self, rlh_model* model, int32_t* rank, int32_t* size) {
  Backend* b = as_backend(self);
  return sdk::guard(b ? b->host.make_status() : nullptr, [&] {
    check_model(b, model);
    if (rank == nullptr || size == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "data_parallel: rank or size is NULL");
    *rank = 0;
    *size = 1;
    if (!b->dp) return;  // one launched rank
    const sdk::Comm& c = b->dp->sums();
    *rank = c.rank();
    *size = c.size();
  });
}

rlh_status* backend_save_state(rlh_backend* self, rlh_model* model, const char* dir) {
  Backend* b = as_backend(self);
  return sdk::guard(b ? b->host.make_status() : nullptr, [&] {
    Model& m = check_model(b, model);
    if (dir == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "save_state: dir is NULL");
    save_state(m, dir);
  });
}

rlh_status* backend_load_state(rlh_backend* self, rlh_model* model, const char* dir) {
  Backend* b = as_backend(self);
  return sdk::guard(b ? b->host.make_status() : nullptr, [&] {
    Model& m = check_model(b, model);
    if (dir == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "load_state: dir is NULL");
    load_state(m, dir);
  });
}

}  // namespace

rlh_status* create_backend(const rlh_host_api* host, const char* config_json, size_t config_len,
                           const BackendFlavor& flavor, rlh_backend** out) {
  return sdk::guard(host != nullptr ? host->make_status : nullptr, [&] {
    if (out == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, std::string(flavor.name) + " create: out is NULL");
    *out = nullptr;
    auto b = std::make_unique<Backend>();
    b->flavor = &flavor;
    b->host = sdk::Host(host);
    const std::string text = config_json != nullptr && config_len > 0 ? std::string(config_json, config_len) : "{}";
    try {
      b->policy = json::parse(text);
    } catch (const json::exception& e) {
      throw Error(RLH_E_INVALID_ARGUMENT, std::string(flavor.name) + ": the config section is not valid JSON: " + e.what());
    }
    if (b->policy.is_null()) b->policy = json::object();
    if (!b->policy.is_object())
      throw Error(RLH_E_INVALID_ARGUMENT, std::string(flavor.name) + ": the config section (policy) must be an object");
    b->config = flavor.read_config(b->policy);
    for (const std::string& note : b->config.notes) b->host.info(std::string(flavor.name) + ": " + note);
    *out = reinterpret_cast<rlh_backend*>(b.release());
  });
}

rlh_backend_api backend_api(rlh_status* (*create)(const rlh_host_api*, const char*, size_t, rlh_backend**)) {
  rlh_backend_api api{};
  api.struct_size = RLH_STRUCT_SIZE(rlh_backend_api, visit_weight_pieces);
  api.create = create;
  api.destroy = backend_destroy;
  api.load_model = backend_load_model;
  api.unload_model = backend_unload_model;
  api.forward = backend_forward;
  api.train_step = backend_train_step;
  api.visit_weights = backend_visit_weights;
  api.visit_weights_on = backend_visit_weights_on;
  api.save_state = backend_save_state;
  api.load_state = backend_load_state;
  api.data_parallel = backend_data_parallel;
  api.visit_weight_pieces = backend_visit_weight_pieces;
  return api;
}

}  // namespace rlh::backend
