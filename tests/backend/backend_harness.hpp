// Driving backend plugins through librlhost and their ABI tables, for the backend tests: a host
// with plugins loaded, owned batches with named fields, forward/train_step/visit_weights helpers
// and loss callbacks as C++ lambdas.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <array>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/backend.h"
#include "fixture_util.hpp"  // fixtures_root, rel_error
#include "rlhost/host.h"
#include "rlhost/model.h"
#include "rlhost/sdk/status.hpp"

namespace rlh::test {

// A host with plugins loaded from the build tree ($RLH_TEST_PLUGIN_DIR instead, where the
// binaries were carried to another machine, e.g. the GPU one).
class Host {
 public:
  explicit Host(const std::vector<std::string>& plugins) {
    sdk::check(rlhost_create(&h_));
    rlhost_set_log_level(h_, RLH_LOG_WARN);
    const char* dir = std::getenv("RLH_TEST_PLUGIN_DIR");
    sdk::check(rlhost_add_plugin_dir(h_, dir != nullptr && *dir ? dir : RLH_PLUGIN_DIR));
    for (const auto& p : plugins) sdk::check(rlhost_load_plugin(h_, p.c_str()), "loading " + p);
  }
  ~Host() { rlhost_destroy(h_); }
  Host(const Host&) = delete;
  const rlh_host_api* services() const { return rlhost_services(h_); }
  const rlh_component_desc* find(int32_t kind, const char* name) const {
    const rlh_component_desc* d = nullptr;
    sdk::check(services()->find_component(services()->ctx, kind, name, &d));
    return d;
  }
  const rlh_backend_api* backend(const char* name) const {
    return static_cast<const rlh_backend_api*>(find(RLH_KIND_BACKEND, name)->api);
  }

 private:
  rlhost_t* h_ = nullptr;
};

// A packed batch that owns its ids, offsets and fields.
class Batch {
 public:
  Batch(std::vector<int32_t> ids, std::vector<int64_t> offsets) : ids_(std::move(ids)), offsets_(std::move(offsets)) {}
  Batch(const Batch&) = delete;

  int64_t num_tokens() const { return int64_t(ids_.size()); }
  int64_t num_seqs() const { return int64_t(offsets_.size()) - 1; }
  const std::vector<int32_t>& ids() const { return ids_; }
  const std::vector<int64_t>& offsets() const { return offsets_; }

  // A field of any trivially copyable element type, shape {n} or {n, k}.
  template <class T>
  void add(const std::string& name, const std::vector<T>& values, rlh_dtype dtype, int64_t cols = 0) {
    store_.emplace_back(values.size() * sizeof(T));
    std::memcpy(store_.back().data(), values.data(), store_.back().size());
    const int64_t rows = cols > 0 ? int64_t(values.size()) / cols : int64_t(values.size());
    shapes_.push_back({rows, cols});
    strides_.push_back({cols > 0 ? cols : 1, 1});
    rlh_tensor t{};
    t.data = store_.back().data();
    t.device = rlh_device{RLH_DEVICE_CPU, 0};
    t.ndim = cols > 0 ? 2 : 1;
    t.dtype = dtype;
    t.shape = shapes_.back().data();
    t.strides = strides_.back().data();
    names_.push_back(name);
    fields_.push_back(rlh_named_tensor{nullptr, t});
  }
  void add_f32(const std::string& name, const std::vector<float>& v) { add(name, v, {RLH_DTYPE_FLOAT, 32, 1}); }

  const rlh_batch* raw(uint64_t constraints = 0) {
    for (size_t i = 0; i < fields_.size(); ++i) fields_[i].name = names_[i].c_str();
    b_ = rlh_batch{};
    b_.struct_size = RLH_STRUCT_SIZE(rlh_batch, constraints);
    b_.num_tokens = num_tokens();
    b_.num_seqs = num_seqs();
    b_.token_ids = ids_.data();
    b_.seq_offsets = offsets_.data();
    b_.fields = fields_.data();
    b_.num_fields = fields_.size();
    b_.constraints = constraints;
    return &b_;
  }

 private:
  std::vector<int32_t> ids_;
  std::vector<int64_t> offsets_;
  std::deque<std::vector<unsigned char>> store_;
  std::deque<std::array<int64_t, 2>> shapes_, strides_;
  std::vector<std::string> names_;
  std::vector<rlh_named_tensor> fields_;
  rlh_batch b_{};
};

// Random sequences of the given lengths over ids [0, vocab).
inline std::unique_ptr<Batch> random_batch(const std::vector<int64_t>& lengths, int32_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids;
  std::vector<int64_t> off = {0};
  for (int64_t L : lengths) {
    for (int64_t t = 0; t < L; ++t) ids.push_back(int32_t(rng() % uint32_t(vocab)));
    off.push_back(off.back() + L);
  }
  return std::make_unique<Batch>(std::move(ids), std::move(off));
}

inline rlh_output_spec spec(int32_t kind, const char* name, double temperature = 1.0, int32_t top_k = 0,
                            double top_p = 1.0, const char* ids_field = nullptr) {
  rlh_output_spec s{};
  s.struct_size = RLH_STRUCT_SIZE(rlh_output_spec, ids_field);
  s.kind = kind;
  s.name = name;
  s.temperature = temperature;
  s.top_k = top_k;
  s.top_p = top_p;
  s.ids_field = ids_field;
  return s;
}

// A backend instance and its models; destroys them in order.
class Backend {
 public:
  Backend(const Host& host, const char* name, const nlohmann::json& config = nlohmann::json::object())
      : api_(host.backend(name)) {
    const std::string text = config.dump();
    sdk::check(api_->create(host.services(), text.data(), text.size(), &b_), std::string("create ") + name);
  }
  ~Backend() { api_->destroy(b_); }
  Backend(const Backend&) = delete;
  const rlh_backend_api* api() const { return api_; }
  rlh_backend* raw() const { return b_; }

  rlh_status* try_load(const std::string& path, bool trainable, rlh_model** out, const char* role = "policy",
                       const std::string& overrides = {}) {
    rlh_model_args a{};
    a.struct_size = RLH_STRUCT_SIZE(rlh_model_args, config_len);
    a.role = role;
    a.path = path.c_str();
    a.flags = trainable ? RLH_MODEL_TRAINABLE : 0;
    a.config_json = overrides.empty() ? nullptr : overrides.c_str();
    a.config_len = overrides.size();
    return api_->load_model(b_, &a, out);
  }
  rlh_model* load(const std::string& path, bool trainable, const char* role = "policy", const std::string& overrides = {}) {
    rlh_model* m = nullptr;
    sdk::check(try_load(path, trainable, &m, role, overrides), "load_model " + path);
    return m;
  }

  // Forward outputs [num_tokens * width] per spec.
  rlh_status* try_forward(rlh_model* m, Batch& batch, const std::vector<rlh_output_spec>& specs,
                          std::vector<std::vector<float>>& out, int64_t micro_batch_tokens = 0,
                          std::vector<int64_t> widths = {}) {
    widths.resize(specs.size(), 1);
    out.assign(specs.size(), {});
    std::vector<rlh_tensor> tensors(specs.size());
    std::vector<std::array<int64_t, 2>> shape(specs.size()), stride(specs.size());
    for (size_t k = 0; k < specs.size(); ++k) {
      out[k].assign(size_t(batch.num_tokens() * widths[k]), -999.0f);
      shape[k] = {batch.num_tokens(), widths[k]};
      stride[k] = {widths[k], 1};
      rlh_tensor& t = tensors[k];
      t.data = out[k].data();
      t.device = rlh_device{RLH_DEVICE_CPU, 0};
      t.ndim = specs[k].kind == RLH_OUTPUT_LOGPROB_AT_IDS ? 2 : 1;
      t.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
      t.shape = shape[k].data();
      t.strides = t.ndim == 2 ? stride[k].data() : stride[k].data() + 1;
    }
    rlh_forward_args a{};
    a.struct_size = RLH_STRUCT_SIZE(rlh_forward_args, micro_batch_tokens);
    a.batch = batch.raw();
    a.specs = specs.data();
    a.num_outputs = specs.size();
    a.outputs = tensors.data();
    a.micro_batch_tokens = micro_batch_tokens;
    return api_->forward(b_, m, &a);
  }
  std::vector<float> logprobs(rlh_model* m, Batch& batch, double temperature = 1.0, int64_t mb_tokens = 0) {
    std::vector<std::vector<float>> out;
    sdk::check(try_forward(m, batch, {spec(RLH_OUTPUT_LOGPROB_RAW, "lp", temperature)}, out, mb_tokens), "forward");
    return out[0];
  }

  using LossBody = std::function<double(const rlh_microbatch&)>;  // writes grads, returns loss
  struct TrainOptions {
    int64_t micro_batch_seqs = 0, micro_batch_tokens = 0;
    double learning_rate = -1;
    bool eval_only = false;
    std::vector<rlh_output_spec> specs = {spec(RLH_OUTPUT_LOGPROB_RAW, "lp")};
    uint64_t constraints = 0;
    // An rlh_loss_fn of the caller's in place of the LossBody (e.g. the grpo LossAdapter), and
    // rlh_train_args.loss_on_device for it.
    rlh_loss_fn raw_fn = nullptr;
    void* raw_user = nullptr;
    bool loss_on_device = false;
  };
  struct TrainResult {
    rlh_train_result r{};
    nlohmann::json metrics;
  };
  rlh_status* try_train(rlh_model* m, Batch& batch, int64_t g_tok, int64_t g_seq, const LossBody& body,
                        const TrainOptions& o, TrainResult& res) {
    rlh_train_args a{};
    a.struct_size = RLH_STRUCT_SIZE(rlh_train_args, loss_on_device);
    a.loss_on_device = o.loss_on_device ? 1 : 0;
    a.batch = batch.raw(o.constraints);
    a.specs = o.specs.data();
    a.num_outputs = o.specs.size();
    a.loss_fn = [](void* user, const rlh_microbatch* mb) -> rlh_status* {
      try {
        const double loss = (*static_cast<const LossBody*>(user))(*mb);
        *static_cast<float*>(mb->loss->data) = float(loss);
        return nullptr;
      } catch (const std::exception& e) {
        return sdk::make_local_status(RLH_E_INVALID_ARGUMENT, e.what());
      }
    };
    a.loss_user = const_cast<LossBody*>(&body);
    if (o.raw_fn != nullptr) {
      a.loss_fn = o.raw_fn;
      a.loss_user = o.raw_user;
    }
    a.global_num_tokens = g_tok;
    a.global_num_seqs = g_seq;
    a.micro_batch_seqs = o.micro_batch_seqs;
    a.micro_batch_tokens = o.micro_batch_tokens;
    a.learning_rate = o.learning_rate;
    a.eval_only = o.eval_only ? 1 : 0;
    std::string text;
    res.r = rlh_train_result{};
    res.r.struct_size = RLH_STRUCT_SIZE(rlh_train_result, user);
    res.r.write = sdk::write_to_string;
    res.r.user = &text;
    rlh_status* s = api_->train_step(b_, m, &a, &res.r);
    if (s == nullptr) res.metrics = nlohmann::json::parse(text);
    return s;
  }
  TrainResult train(rlh_model* m, Batch& batch, int64_t g_tok, int64_t g_seq, const LossBody& body,
                    const TrainOptions& o) {
    TrainResult res;
    sdk::check(try_train(m, batch, g_tok, g_seq, body, o, res), "train_step");
    return res;
  }

  // Every weight by HF name (copies), and the weights' version.
  std::map<std::string, std::vector<float>> weights(rlh_model* m, int64_t* version = nullptr) {
    std::map<std::string, std::vector<float>> out;
    auto fn = [](void* user, const char* name, const rlh_tensor* t) -> rlh_status* {
      int64_t n = 1;
      for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
      const float* p = static_cast<const float*>(t->data);
      (*static_cast<std::map<std::string, std::vector<float>>*>(user))[name].assign(p, p + n);
      return nullptr;
    };
    int64_t v = -1;
    sdk::check(api_->visit_weights(b_, m, fn, &out, &v), "visit_weights");
    if (version != nullptr) *version = v;
    return out;
  }

  // The same through visit_weights_on (BACKEND 0.2) for a caller that also reads `device`:
  // each tensor goes to `fn` as the backend gives it (host or device memory).
  using TensorFn = std::function<void(const std::string& name, const rlh_tensor& t)>;
  void visit_on(rlh_model* m, const rlh_device& device, const TensorFn& each, int64_t* version = nullptr) {
    auto fn = [](void* user, const char* name, const rlh_tensor* t) -> rlh_status* {
      (*static_cast<const TensorFn*>(user))(name, *t);
      return nullptr;
    };
    rlh_visit_args args{};
    args.struct_size = RLH_STRUCT_SIZE(rlh_visit_args, device);
    args.device = device;
    if (!RLH_HAS_FIELD(api_, rlh_backend_api, visit_weights_on) || api_->visit_weights_on == nullptr)
      throw std::runtime_error("the backend has no visit_weights_on");
    int64_t v = -1;
    sdk::check(api_->visit_weights_on(b_, m, &args, fn, const_cast<TensorFn*>(&each), &v), "visit_weights_on");
    if (version != nullptr) *version = v;
  }

 private:
  const rlh_backend_api* api_;
  rlh_backend* b_ = nullptr;
};

// Token-aligned output `name` of a micro-batch as a float pointer (the backend's are float32 [N]).
inline const float* output(const rlh_microbatch& mb, const char* name, float** grad = nullptr) {
  for (size_t k = 0; k < mb.num_outputs; ++k)
    if (std::strcmp(mb.outputs[k].name, name) == 0) {
      if (grad != nullptr) *grad = static_cast<float*>(mb.grads[k].data);
      return static_cast<const float*>(mb.outputs[k].tensor.data);
    }
  throw std::runtime_error(std::string("no output ") + name);
}

// NeMo-RL's NLL: -sum of log p over predicted tokens (not the first of a sequence) / global count.
inline Backend::LossBody nll_loss(const char* name = "lp") {
  return [name](const rlh_microbatch& mb) {
    float* g = nullptr;
    const float* lp = output(mb, name, &g);
    const rlh_batch& b = *mb.batch;
    double loss = 0;
    for (int64_t s = 0; s < b.num_seqs; ++s)
      for (int64_t t = b.seq_offsets[s] + 1; t < b.seq_offsets[s + 1]; ++t) {
        loss -= lp[t] / double(mb.global_num_tokens);
        g[t] = float(-1.0 / double(mb.global_num_tokens));
      }
    return loss;
  };
}

inline std::string status_text(rlh_status* s) {
  std::string m = sdk::status_message(s);
  rlh_status_destroy(s);
  return m;
}

// Expects `s` to be an error of `code` whose one-line message contains `part`.
inline void expect_error(rlh_status* s, rlh_code code, const std::string& part) {
  ASSERT_NE(s, nullptr) << "expected an error containing '" << part << "'";
  const rlh_code got = s->code;
  const std::string msg = status_text(s);
  EXPECT_EQ(got, code) << rlh_code_name(got) << ": " << msg;
  EXPECT_NE(msg.find(part), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
}

}  // namespace rlh::test
