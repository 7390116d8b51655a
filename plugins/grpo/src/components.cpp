// Component handles over the ABI tables (see components.hpp).
#include "components.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "rlhost/sdk/hf_cache.hpp"
#include "rlhost/sdk/launch_env.hpp"

namespace rlh::grpo {

using json = nlohmann::json;
using sdk::Error;

namespace {

std::string component_label(const char* kind, const std::string& name) {
  return std::string(kind) + " '" + name + "'";
}

}  // namespace

// ---- PackedBatch -------------------------------------------------------------------------------

void PackedBatch::add_sequence(std::span<const int32_t> ids) {
  if (!fields_.empty())
    throw std::logic_error("PackedBatch: add every sequence before the fields");
  tokens_.insert(tokens_.end(), ids.begin(), ids.end());
  offsets_.push_back(static_cast<int64_t>(tokens_.size()));
}

std::vector<float>& PackedBatch::field(const std::string& name, Frame frame) {
  const size_t n = static_cast<size_t>(frame == Frame::kToken ? num_tokens() : num_seqs());
  for (Field& f : fields_)
    if (f.name == name) {
      f.frame = frame;
      f.data.assign(n, 0.0f);
      return f.data;
    }
  fields_.push_back(Field{name, frame, std::vector<float>(n, 0.0f)});
  return fields_.back().data;
}

const std::vector<float>* PackedBatch::find(const std::string& name) const {
  for (const Field& f : fields_)
    if (f.name == name) return &f.data;
  return nullptr;
}

BatchMasks::BatchMasks(const PackedBatch& b) {
  const std::vector<float>* tm = b.find("token_mask");
  const std::vector<float>* sm = b.find("sample_mask");
  if (tm == nullptr || sm == nullptr)
    throw std::logic_error("BatchMasks: the batch has no token_mask or sample_mask");
  token_mask.assign(tm->begin(), tm->end());
  sample_mask.assign(sm->begin(), sm->end());
  packing = Packing{b.num_tokens(), b.num_seqs(), b.offsets().data()};
  counts = valid_counts(packing, token_mask.data(), sample_mask.data());
}

void enable_device_loss(LossAdapter& loss, const sdk::Host& host, const std::vector<rlh_output_spec>& specs) {
  // On by default since it ran on a GPU (2026-12-05, H100: the loss within 1.03e-8 of the host's,
  // 1 host wait per step of 2 micro-batches); RLH_DEVICE_LOSS=0 keeps the host loss callback.
  const char* opt_out = std::getenv("RLH_DEVICE_LOSS");
  if (opt_out != nullptr && std::string(opt_out) == "0") return;
  std::string device = "auto";
  try {
    device = nlohmann::json::parse(host.config_json("policy.device")).get<std::string>();
  } catch (const std::exception&) {
    // absent or not a string: backend_config refuses a bad one; "auto" tries the GPU
  }
  if (device == "cpu") return;
  const int index = device.rfind("cuda:", 0) == 0 ? std::stoi(device.substr(5)) : 0;
  std::string kernels = "{}";
  try {
    kernels = host.config_json("policy.kernels");
  } catch (const sdk::Error&) {
    // no pins
  }
  loss.enable_device_loss(host, kernels);
  std::string why;
  if (loss.device_loss_supported(rlh_device{RLH_DEVICE_CUDA, index}, specs, &why))
    host.info("loss on the device: the policy's train steps run the loss as a kernel op on cuda:" +
              std::to_string(index) + " when the backend trains there");
  else
    host.info("loss on the host (the device loss is off: " + why + ")");
}

rlh_train_args train_args(PackedBatch& b, const std::vector<rlh_output_spec>& specs,
                          LossAdapter& loss, const ValidCounts& counts, int64_t mb_tokens,
                          int64_t mb_seqs, bool eval_only, uint64_t constraints) {
  rlh_train_args a{};
  a.struct_size = RLH_STRUCT_SIZE(rlh_train_args, loss_on_device);
  a.loss_on_device = loss.wants_device_tensors() ? 1 : 0;  // a CPU backend gives host tensors anyway
  a.batch = &b.view(constraints);
  a.specs = specs.data();
  a.num_outputs = specs.size();
  a.loss_fn = loss.fn();
  a.loss_user = loss.user();
  a.global_num_tokens = static_cast<int64_t>(std::llround(counts.tokens));
  a.global_num_seqs = static_cast<int64_t>(std::llround(counts.seqs));
  if (mb_tokens > 0) a.micro_batch_tokens = mb_tokens;
  else a.micro_batch_seqs = mb_seqs;
  a.learning_rate = -1;  // the backend's optimizer/scheduler config
  a.eval_only = eval_only ? 1 : 0;
  return a;
}

PackedBatch PackedBatch::slice(int64_t begin, int64_t end) const {
  PackedBatch out;
  const int64_t t0 = offsets_[begin], t1 = offsets_[end];
  out.tokens_.assign(tokens_.begin() + t0, tokens_.begin() + t1);
  out.offsets_.clear();
  for (int64_t i = begin; i <= end; ++i) out.offsets_.push_back(offsets_[i] - t0);
  for (const Field& f : fields_) {
    Field g{f.name, f.frame, {}};
    if (f.frame == Frame::kToken) g.data.assign(f.data.begin() + t0, f.data.begin() + t1);
    else g.data.assign(f.data.begin() + begin, f.data.begin() + end);
    out.fields_.push_back(std::move(g));
  }
  return out;
}

PackedBatch PackedBatch::select(const std::vector<const PackedBatch*>& parts,
                                const std::vector<std::pair<size_t, int64_t>>& picks) {
  PackedBatch out;
  for (const auto& [p, i] : picks) {
    const PackedBatch& b = *parts[p];
    out.tokens_.insert(out.tokens_.end(), b.tokens_.begin() + b.offsets_[i], b.tokens_.begin() + b.offsets_[i + 1]);
    out.offsets_.push_back(static_cast<int64_t>(out.tokens_.size()));
  }
  if (parts.empty()) return out;
  for (const Field& f : parts.front()->fields_) {
    Field g{f.name, f.frame, {}};
    for (const auto& [p, i] : picks) {
      const std::vector<float>* src = parts[p]->find(f.name);
      if (src == nullptr) throw std::logic_error("PackedBatch::select: a part lacks field " + f.name);
      if (f.frame == Frame::kToken)
        g.data.insert(g.data.end(), src->begin() + parts[p]->offsets_[i], src->begin() + parts[p]->offsets_[i + 1]);
      else
        g.data.push_back((*src)[static_cast<size_t>(i)]);
    }
    out.fields_.push_back(std::move(g));
  }
  return out;
}

std::vector<std::pair<std::string, PackedBatch::Frame>> PackedBatch::field_names() const {
  std::vector<std::pair<std::string, Frame>> out;
  for (const Field& f : fields_) out.emplace_back(f.name, f.frame);
  return out;
}

const rlh_batch& PackedBatch::view(uint64_t constraints) {
  views_.clear();
  for (Field& f : fields_) {
    f.shape[0] = static_cast<int64_t>(f.data.size());
    f.strides[0] = 1;
    rlh_named_tensor t{};
    t.name = f.name.c_str();
    t.tensor.data = f.data.data();
    t.tensor.device = rlh_device{RLH_DEVICE_CPU, 0};
    t.tensor.ndim = 1;
    t.tensor.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
    t.tensor.shape = f.shape;
    t.tensor.strides = f.strides;
    views_.push_back(t);
  }
  batch_ = rlh_batch{};
  batch_.struct_size = RLH_STRUCT_SIZE(rlh_batch, constraints);
  batch_.num_tokens = num_tokens();
  batch_.num_seqs = num_seqs();
  batch_.token_ids = tokens_.data();
  batch_.seq_offsets = offsets_.data();
  batch_.fields = views_.data();
  batch_.num_fields = views_.size();
  batch_.constraints = constraints;
  return batch_;
}

HostVector::HostVector(std::vector<float>& v) {
  shape[0] = static_cast<int64_t>(v.size());
  tensor.data = v.data();
  tensor.device = rlh_device{RLH_DEVICE_CPU, 0};
  tensor.ndim = 1;
  tensor.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
  tensor.shape = shape;
  tensor.strides = strides;
}

// ---- Backend -----------------------------------------------------------------------------------

Backend::Backend(const sdk::Host& host, const std::string& name, const json& config)
    : host_(host), name_(name) {
  api_ = host_.find<rlh_backend_api>(RLH_KIND_BACKEND, name.c_str(),
                                     RLH_STRUCT_SIZE(rlh_backend_api, load_state));
  const std::string text = config.dump();
  sdk::check(api_->create(host_.api(), text.data(), text.size(), &self_),
             component_label("backend", name));
}

Backend::~Backend() {
  if (api_ != nullptr && self_ != nullptr) api_->destroy(self_);
}

rlh_model* Backend::load_model(const std::string& role, const std::string& path, bool trainable,
                               const nlohmann::json& overrides) {
  rlh_model_args args{};
  args.struct_size = RLH_STRUCT_SIZE(rlh_model_args, config_len);
  args.role = role.c_str();
  args.path = path.c_str();
  args.flags = trainable ? RLH_MODEL_TRAINABLE : 0;
  const std::string text = overrides.is_null() ? std::string() : overrides.dump();
  if (!text.empty()) {
    args.config_json = text.c_str();
    args.config_len = text.size();
  }
  rlh_model* m = nullptr;
  sdk::check(api_->load_model(self_, &args, &m),
             component_label("backend", name_) + ": loading the " + role + " model from " + path);
  return m;
}

void Backend::forward(rlh_model* model, PackedBatch& batch,
                      const std::vector<rlh_output_spec>& specs,
                      std::vector<std::vector<float>>& outputs, int64_t micro_batch_tokens) {
  outputs.assign(specs.size(), std::vector<float>(static_cast<size_t>(batch.num_tokens()), 0.0f));
  std::vector<HostVector> views;
  views.reserve(specs.size());
  for (auto& o : outputs) views.emplace_back(o);
  std::vector<rlh_tensor> tensors;
  for (const auto& v : views) tensors.push_back(v.tensor);
  rlh_forward_args args{};
  args.struct_size = RLH_STRUCT_SIZE(rlh_forward_args, micro_batch_tokens);
  args.batch = &batch.view();
  args.specs = specs.data();
  args.num_outputs = specs.size();
  args.outputs = tensors.data();
  args.micro_batch_tokens = micro_batch_tokens;
  sdk::check(api_->forward(self_, model, &args), component_label("backend", name_) + ": forward");
}

Backend::TrainResult Backend::train_step(rlh_model* model, const rlh_train_args& args) {
  std::string metrics_text;
  rlh_train_result r{};
  r.struct_size = RLH_STRUCT_SIZE(rlh_train_result, user);
  r.write = sdk::write_to_string;
  r.user = &metrics_text;
  sdk::check(api_->train_step(self_, model, &args, &r),
             component_label("backend", name_) + ": train step");
  TrainResult out;
  out.loss = r.loss;
  out.grad_norm = r.grad_norm;
  out.micro_batches = r.num_micro_batches;
  if (!metrics_text.empty()) {
    try {
      out.metrics = json::parse(metrics_text);
    } catch (const json::exception& e) {
      throw Error(RLH_E_INTERNAL, component_label("backend", name_) +
                                      ": train step metrics are not valid JSON: " + e.what());
    }
    if (!out.metrics.is_object())
      throw Error(RLH_E_INTERNAL,
                  component_label("backend", name_) + ": train step metrics are not a JSON object");
  }
  return out;
}

int64_t Backend::visit_weights(rlh_model* model, rlh_weight_fn fn, void* user) {
  int64_t version = -1;
  sdk::check(api_->visit_weights(self_, model, fn, user, &version),
             component_label("backend", name_) + ": visiting weights");
  return version;
}

bool Backend::has_weight_pieces() const {
  return RLH_HAS_FIELD(api_, rlh_backend_api, visit_weight_pieces) && api_->visit_weight_pieces != nullptr;
}

int64_t Backend::visit_weight_pieces(rlh_model* model, rlh_weight_piece_fn fn, void* user) {
  if (!has_weight_pieces())
    throw Error(RLH_E_UNIMPLEMENTED, component_label("backend", name_) + " has no visit_weight_pieces (BACKEND 0.5)");
  int64_t version = -1;
  sdk::check(api_->visit_weight_pieces(self_, model, fn, user, &version),
             component_label("backend", name_) + ": visiting weight pieces");
  return version;
}

void Backend::visit_weights_on(rlh_model* model, const rlh_device& device, rlh_weight_fn fn, void* user,
                               int64_t* version) {
  if (RLH_HAS_FIELD(api_, rlh_backend_api, visit_weights_on) && api_->visit_weights_on != nullptr) {
    rlh_visit_args args{};
    args.struct_size = RLH_STRUCT_SIZE(rlh_visit_args, device);
    args.device = device;
    sdk::check(api_->visit_weights_on(self_, model, &args, fn, user, version),
               component_label("backend", name_) + ": visiting weights");
    return;
  }
  sdk::check(api_->visit_weights(self_, model, fn, user, version), component_label("backend", name_) + ": visiting weights");
}

std::optional<std::pair<int, int>> Backend::data_parallel(rlh_model* model) {
  if (!RLH_HAS_FIELD(api_, rlh_backend_api, data_parallel) || api_->data_parallel == nullptr) return std::nullopt;
  int32_t rank = -1, size = -1;
  sdk::check(api_->data_parallel(self_, model, &rank, &size),
             component_label("backend", name_) + ": asking the data-parallel layout");
  if (size < 1 || rank < 0 || rank >= size)
    throw Error(RLH_E_INTERNAL, component_label("backend", name_) + ": data_parallel gave rank " +
                                    std::to_string(rank) + " of " + std::to_string(size));
  return std::make_pair(int(rank), int(size));
}

void Backend::save_state(rlh_model* model, const std::string& dir) {
  sdk::check(api_->save_state(self_, model, dir.c_str()),
             component_label("backend", name_) + ": saving state to " + dir);
}

void Backend::load_state(rlh_model* model, const std::string& dir) {
  sdk::check(api_->load_state(self_, model, dir.c_str()),
             component_label("backend", name_) + ": loading state from " + dir);
}

// ---- Generator ---------------------------------------------------------------------------------

Generator::Generator(const sdk::Host& host, const std::string& name, const std::string& model_path,
                     const json& config)
    : host_(host), name_(name) {
  api_ = host_.find<rlh_generator_api>(RLH_KIND_GENERATOR, name.c_str(),
                                       RLH_STRUCT_SIZE(rlh_generator_api, generate));
  const std::string text = config.dump();
  sdk::check(api_->create(host_.api(), model_path.c_str(), text.data(), text.size(), &self_),
             component_label("generator", name));
}

Generator::Generator(std::string name, std::unique_ptr<GeneratorLink> link)
    : name_(std::move(name)), link_(std::move(link)) {}

Generator::~Generator() {
  if (api_ != nullptr && self_ != nullptr) api_->destroy(self_);
}

namespace {

struct Refit {
  const rlh_generator_api* api = nullptr;
  rlh_generator* generator = nullptr;
  rlh_device device{RLH_DEVICE_CPU, 0};  // what the generator reads besides host memory
  int64_t version = -1;                  // set by the backend before its first callback
  int64_t on_device = 0;                 // weights handed over in device memory
  std::vector<Generator::StagedWeight> staged;
};

// A weight in the generator's device memory goes straight to it (converted there before
// update_weights returns, as long as the view is valid); a host one is copied into the staging
// area (views are valid during the callback only) and goes with the rest after the visit.
rlh_status* stage_weight(void* user, const char* hf_name, const rlh_tensor* w) {
  auto* refit = static_cast<Refit*>(user);
  if (w->device.device_type != RLH_DEVICE_CPU) {
    if (w->device.device_type != refit->device.device_type || w->device.device_id != refit->device.device_id)
      return sdk::make_local_status(RLH_E_INVALID_ARGUMENT, std::string("refit: weight '") + hf_name +
                                                                "' is in the memory of a device the generator does not read");
    rlh_named_tensor t{};
    t.name = hf_name;
    t.tensor = *w;
    rlh_weight_update u{};
    u.struct_size = RLH_STRUCT_SIZE(rlh_weight_update, reserved0);
    u.version = refit->version;
    u.weights = &t;
    u.num_weights = 1;
    u.may_alias = 0;
    ++refit->on_device;
    return refit->api->update_weights(refit->generator, &u);
  }
  std::vector<Generator::StagedWeight>* staged = &refit->staged;
  if (w->dtype.lanes != 1 || w->dtype.bits % 8 != 0)
    return sdk::make_local_status(RLH_E_UNIMPLEMENTED,
                                  std::string("refit: weight '") + hf_name + "' is not a tensor of a scalar dtype");
  Generator::StagedWeight sw;
  sw.name = hf_name;
  sw.dtype = w->dtype;
  int64_t n = 1;
  for (int d = 0; d < w->ndim; ++d) {
    sw.shape.push_back(w->shape[d]);
    n *= w->shape[d];
  }
  const size_t esize = w->dtype.bits / 8;
  sw.bytes.reset(new char[static_cast<size_t>(n) * esize]);
  // Row-major contiguous copy honouring the view's strides: the innermost run of dims that is
  // already contiguous goes by memcpy (the whole tensor for a plain view; one element at a time
  // was ~10 s of a 1B model's refit).
  const char* base = static_cast<const char*>(w->data) + w->byte_offset;
  int64_t run = 1;  // elements per contiguous run
  int inner = w->ndim;  // dims [inner, ndim) form the run
  for (int d = w->ndim - 1; d >= 0; --d) {
    const int64_t stride = w->strides ? w->strides[d] : run;
    if (stride != run) break;
    run *= w->shape[d];
    inner = d;
  }
  const size_t run_bytes = static_cast<size_t>(run) * esize;
  std::vector<int64_t> idx(static_cast<size_t>(inner), 0);
  for (int64_t i = 0; run > 0 && i < n / run; ++i) {
    int64_t off = 0;
    for (int d = 0; d < inner; ++d) off += idx[static_cast<size_t>(d)] * w->strides[d];
    std::memcpy(sw.bytes.get() + static_cast<size_t>(i) * run_bytes, base + off * static_cast<int64_t>(esize), run_bytes);
    for (int d = inner - 1; d >= 0; --d) {
      if (++idx[static_cast<size_t>(d)] < w->shape[d]) break;
      idx[static_cast<size_t>(d)] = 0;
    }
  }
  staged->push_back(std::move(sw));
  return nullptr;
}

}  // namespace

size_t Generator::StagedWeight::num_bytes() const {
  size_t n = dtype.bits / 8;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

std::vector<Generator::StagedWeight> Generator::stage_on_host(Backend& backend, rlh_model* model, int64_t* version) {
  Refit refit;  // no generator: every weight is staged in host memory
  backend.visit_weights_on(model, refit.device, stage_weight, &refit, &refit.version);
  if (refit.staged.empty()) throw Error(RLH_E_INTERNAL, "refit: backend '" + backend.name() + "' visited no weights");
  *version = refit.version;
  return std::move(refit.staged);
}

void Generator::refit_from(Backend& backend, rlh_model* model) {
  if (link_) {
    version_ = link_->refit_from(backend, model);
    return;
  }
  // The backend's views live only during its callback (some are temporaries: q/k/v pieces cut
  // out of a fused tensor), so the weights are staged into buffers this object owns and keeps
  // unchanged until the next refit; the generator receives them as one version and may keep
  // views of them (may_alias) instead of copying again.
  // A generator that reads the trainer's device memory gets device views, converted on the
  // device (a colocated refit without a host round trip); the rest comes staged in host memory.
  Refit refit;
  refit.api = api_;
  refit.generator = self_;
  if (RLH_HAS_FIELD(api_, rlh_generator_api, weights_device) && api_->weights_device != nullptr)
    sdk::check(api_->weights_device(self_, &refit.device), "generator '" + name_ + "': weights device");
  backend.visit_weights_on(model, refit.device, stage_weight, &refit, &refit.version);
  const int64_t version = refit.version;
  std::vector<StagedWeight> staged = std::move(refit.staged);
  if (staged.empty() && refit.on_device == 0)
    throw Error(RLH_E_INTERNAL, "refit: backend '" + backend.name() + "' visited no weights");
  if (staged.empty()) {  // every weight went over in device memory: that version is in force
    staged_.clear();
    version_ = version;
    return;
  }
  install(std::move(staged), version);
}

void Generator::install(std::vector<StagedWeight> staged, int64_t version) {
  std::vector<rlh_named_tensor> views(staged.size());
  for (size_t i = 0; i < staged.size(); ++i) {
    StagedWeight& w = staged[i];
    w.strides.assign(w.shape.size(), 1);
    for (int d = static_cast<int>(w.shape.size()) - 2; d >= 0; --d)
      w.strides[static_cast<size_t>(d)] = w.strides[static_cast<size_t>(d) + 1] * w.shape[static_cast<size_t>(d) + 1];
    rlh_named_tensor& t = views[i];
    t.name = w.name.c_str();
    t.tensor.data = w.bytes.get();
    t.tensor.device = rlh_device{RLH_DEVICE_CPU, 0};
    t.tensor.ndim = static_cast<int32_t>(w.shape.size());
    t.tensor.dtype = w.dtype;
    t.tensor.shape = w.shape.data();
    t.tensor.strides = w.strides.data();
  }
  rlh_weight_update u{};
  u.struct_size = RLH_STRUCT_SIZE(rlh_weight_update, reserved0);
  u.version = version;
  u.weights = views.data();
  u.num_weights = views.size();
  u.may_alias = 1;
  sdk::check(api_->update_weights(self_, &u), "generator '" + name_ + "': refit to version " + std::to_string(version));
  staged_ = std::move(staged);  // kept alive (and unchanged) until the next refit
  version_ = version;
}

void Generator::generate(const rlh_generate_args& args, rlh_sample_fn fn, void* user) {
  if (split_) return split_(*this, args, fn, user);
  generate_here(args, fn, user);
}

void Generator::generate_here(const rlh_generate_args& args, rlh_sample_fn fn, void* user) {
  if (link_) {  // non-colocated: the generator ranks generate (generation_ranks.cpp)
    link_->generate(args, fn, user);
    return;
  }
  sdk::check(api_->generate(self_, &args, fn, user), component_label("generator", name_));
}

// ---- Environment -------------------------------------------------------------------------------

Environment::Environment(const sdk::Host& host, const std::string& name, const json& config)
    : host_(host), name_(name) {
  api_ = host_.find<rlh_environment_api>(RLH_KIND_ENVIRONMENT, name.c_str(),
                                         RLH_STRUCT_SIZE(rlh_environment_api, score));
  const std::string text = config.dump();
  sdk::check(api_->create(host_.api(), text.data(), text.size(), &self_),
             component_label("environment", name));
  std::string names;
  sdk::check(api_->reward_names(self_, sdk::write_to_string, &names),
             component_label("environment", name) + ": reward names");
  try {
    reward_names_ = json::parse(names).get<std::vector<std::string>>();
  } catch (const json::exception& e) {
    throw Error(RLH_E_INTERNAL, component_label("environment", name) +
                                    ": reward names are not a JSON array of strings: " + e.what());
  }
  bool has_main = false;
  for (const auto& n : reward_names_) has_main |= n == "reward";
  if (!has_main)
    throw Error(RLH_E_FAILED_PRECONDITION,
                component_label("environment", name) + " produces no 'reward' (it has " + names + ")");
}

Environment::~Environment() {
  if (api_ != nullptr && self_ != nullptr) api_->destroy(self_);
}

void Environment::score(const std::vector<rlh_env_sample>& samples, std::vector<double>& rewards) {
  std::vector<const char*> names;
  for (const auto& n : reward_names_) names.push_back(n.c_str());
  rewards.assign(samples.size() * names.size(), 0.0);
  std::vector<uint8_t> done(samples.size(), 0);
  rlh_env_result r{};
  r.struct_size = RLH_STRUCT_SIZE(rlh_env_result, user);
  r.num_rewards = names.size();
  r.reward_names = names.data();
  r.rewards = rewards.data();
  r.done = done.data();
  sdk::check(api_->score(self_, samples.data(), samples.size(), &r),
             component_label("environment", name_));
}

namespace {

struct ObservationSink {
  std::vector<std::string>* out;
  std::vector<std::optional<std::vector<std::string>>>* stops;
  std::string error;  // the first bad call (the callback cannot throw across the C boundary)
};

void on_stop_strings(void* user, size_t index, const char* const* strings, const size_t* lengths, size_t count) {
  auto* sink = static_cast<ObservationSink*>(user);
  if (!sink->error.empty()) return;
  const std::string where = "stop strings of sample " + std::to_string(index);
  if (index >= sink->stops->size()) {
    sink->error = where + " of a batch of " + std::to_string(sink->stops->size());
    return;
  }
  if (count > Environment::kMaxStopStrings) {
    sink->error = where + ": " + std::to_string(count) + " strings (the limit is " +
                  std::to_string(Environment::kMaxStopStrings) + ")";
    return;
  }
  if (count > 0 && (strings == nullptr || lengths == nullptr)) {
    sink->error = where + ": strings or lengths is NULL";
    return;
  }
  std::vector<std::string> v;
  for (size_t k = 0; k < count; ++k) {
    if (strings[k] == nullptr || lengths[k] == 0 || lengths[k] > Environment::kMaxStopStringBytes) {
      sink->error = where + ": string " + std::to_string(k) + " is NULL, empty or over " +
                    std::to_string(Environment::kMaxStopStringBytes) + " bytes";
      return;
    }
    v.emplace_back(strings[k], lengths[k]);
  }
  (*sink->stops)[index] = std::move(v);
}

void on_observation(void* user, size_t index, const char* text, size_t len) {
  auto* sink = static_cast<ObservationSink*>(user);
  if (!sink->error.empty()) return;
  if (index >= sink->out->size()) {
    sink->error = "observation for sample " + std::to_string(index) + " of a batch of " +
                  std::to_string(sink->out->size());
  } else if (text == nullptr && len > 0) {
    sink->error = "observation of sample " + std::to_string(index) + " is NULL with length " + std::to_string(len);
  } else if (len > Environment::kMaxObservationBytes) {
    sink->error = "observation of sample " + std::to_string(index) + " is " + std::to_string(len) +
                  " bytes (the limit is " + std::to_string(Environment::kMaxObservationBytes) + ")";
  } else {
    (*sink->out)[index].assign(text == nullptr ? "" : text, len);
  }
}

}  // namespace

void Environment::step(const std::vector<rlh_env_sample>& samples, Step& out) {
  std::vector<const char*> names;
  for (const auto& n : reward_names_) names.push_back(n.c_str());
  out.rewards.assign(samples.size() * names.size(), 0.0);
  // 2 marks "not written": an environment that leaves done unset is caught below.
  out.done.assign(samples.size(), 2);
  out.observations.assign(samples.size(), std::string());
  out.stop_strings.assign(samples.size(), std::nullopt);
  ObservationSink sink{&out.observations, &out.stop_strings, {}};
  rlh_env_result r{};
  r.struct_size = RLH_STRUCT_SIZE(rlh_env_result, stop_strings);
  r.num_rewards = names.size();
  r.reward_names = names.data();
  r.rewards = out.rewards.data();
  r.done = out.done.data();
  r.observation = on_observation;
  r.user = &sink;
  r.stop_strings = on_stop_strings;
  const std::string label = component_label("environment", name_);
  sdk::check(api_->score(self_, samples.data(), samples.size(), &r), label);
  if (!sink.error.empty()) throw Error(RLH_E_INVALID_ARGUMENT, label + ": " + sink.error);
  for (size_t i = 0; i < samples.size(); ++i) {
    if (out.done[i] > 1)
      throw Error(RLH_E_INVALID_ARGUMENT, label + ": sample " + std::to_string(i) + ": done is " +
                                              std::to_string(out.done[i]) + " (expected 0 or 1)");
    for (size_t k = 0; k < names.size(); ++k)
      if (!std::isfinite(out.rewards[i * names.size() + k]))
        throw Error(RLH_E_INVALID_ARGUMENT, label + ": sample " + std::to_string(i) + ": reward '" + names[k] +
                                                "' is not finite (" + std::to_string(out.rewards[i * names.size() + k]) + ")");
  }
}

// ---- Dataset -----------------------------------------------------------------------------------

Dataset::Dataset(const sdk::Host& host, const std::string& name, const json& config,
                 std::string origin)
    : host_(host), origin_(std::move(origin)) {
  api_ = host_.find<rlh_dataset_api>(RLH_KIND_DATASET, name.c_str(),
                                     RLH_STRUCT_SIZE(rlh_dataset_api, get));
  const std::string text = config.dump();
  sdk::check(api_->create(host_.api(), text.data(), text.size(), &self_),
             origin_ + ": dataset '" + name + "'");
  size_ = api_->size(self_);
  if (size_ <= 0) throw Error(RLH_E_INVALID_ARGUMENT, origin_ + ": dataset '" + name + "' is empty");
}

Dataset::~Dataset() {
  if (api_ != nullptr && self_ != nullptr) api_->destroy(self_);
}

json Dataset::row(int64_t index) const {
  std::string text;
  sdk::check(api_->get(self_, index, sdk::write_to_string, &text),
             origin_ + ": row " + std::to_string(index));
  json j = json::parse(text, nullptr, false);
  if (!j.is_object())
    throw Error(RLH_E_INVALID_ARGUMENT,
                origin_ + ": row " + std::to_string(index) + " is not a JSON object");
  return j;
}

// ---- Tokenizer ---------------------------------------------------------------------------------

namespace {
void append_ids(void* user, const void* data, size_t len) {
  auto* out = static_cast<std::vector<int32_t>*>(user);
  const size_t n = len / sizeof(int32_t);
  const size_t old = out->size();
  out->resize(old + n);
  std::memcpy(out->data() + old, data, n * sizeof(int32_t));
}
}  // namespace

Tokenizer::Tokenizer(const sdk::Host& host, const std::string& path) : host_(host) {
  api_ = host_.find<rlh_tokenizer_api>(RLH_KIND_TOKENIZER, nullptr,
                                       RLH_STRUCT_SIZE(rlh_tokenizer_api, info));
  sdk::check(api_->create(host_.api(), path.c_str(), &self_), "policy.tokenizer.name: " + path);
  std::string info;
  sdk::check(api_->info(self_, sdk::write_to_string, &info), "tokenizer info");
  const json j = json::parse(info);
  vocab_size_ = j.value("vocab_size", int64_t{0});
  has_chat_template_ = j.value("has_chat_template", false) && api_->apply_chat_template != nullptr;
  if (j.contains("eos_token_ids") && j["eos_token_ids"].is_array())
    for (const auto& e : j["eos_token_ids"]) eos_.push_back(e.get<int32_t>());
  if (j.contains("bos_token_id") && j["bos_token_id"].is_number_integer()) bos_ = j["bos_token_id"].get<int32_t>();
  // (A tokenizer component that does not say: the first EOS id.)
  if (j.contains("eos_token_id")) {
    if (j["eos_token_id"].is_number_integer()) eos_own_ = j["eos_token_id"].get<int32_t>();
  } else if (!eos_.empty()) {
    eos_own_ = eos_.front();
  }
  if (bos_) bos_text_ = decode(std::vector<int32_t>{*bos_}, false);
  if (eos_own_) eos_text_ = decode(std::vector<int32_t>{*eos_own_}, false);
}

Tokenizer::~Tokenizer() {
  if (api_ != nullptr && self_ != nullptr) api_->destroy(self_);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::vector<int32_t> ids;
  sdk::check(api_->encode(self_, text.data(), text.size(),
                          add_special_tokens ? RLH_ENCODE_ADD_SPECIAL_TOKENS : 0, append_ids, &ids),
             "tokenizer encode");
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::vector<int32_t> known;
  known.reserve(ids.size());
  for (int32_t id : ids)
    if (id >= 0 && id < vocab_size_) known.push_back(id);
  std::string text;
  sdk::check(api_->decode(self_, known.data(), known.size(),
                          skip_special_tokens ? RLH_DECODE_SKIP_SPECIAL_TOKENS : 0,
                          sdk::write_to_string, &text),
             "tokenizer decode");
  return text;
}

std::string Tokenizer::apply_chat_template(const json& messages, bool add_generation_prompt) const {
  if (!has_chat_template_)
    throw Error(RLH_E_FAILED_PRECONDITION, "the tokenizer has no chat template");
  const std::string m = messages.dump();
  std::string out;
  sdk::check(api_->apply_chat_template(self_, m.data(), m.size(), add_generation_prompt ? 1 : 0,
                                       template_kwargs_.empty() ? nullptr : template_kwargs_.data(),
                                       template_kwargs_.size(), sdk::write_to_string, &out),
             "chat template");
  return out;
}

ChunkedTrain train_in_chunks(Backend& backend, rlh_model* model, PackedBatch& b, int64_t gbs, LossAdapter& loss,
                             const std::vector<rlh_output_spec>& specs, int64_t mb_tokens, int64_t mb_seqs,
                             int64_t step, const std::string& what,
                             const std::function<ValidCounts(const PackedBatch&, const BatchMasks&)>& counts,
                             const std::function<Metrics(const Metrics&)>& reduce) {
  std::vector<int64_t> bounds;
  for (int64_t begin = 0; begin < b.num_seqs(); begin += gbs) bounds.push_back(begin);
  bounds.push_back(b.num_seqs());
  return train_in_chunks(backend, model, b, bounds, loss, specs, mb_tokens, mb_seqs, step, what, counts, reduce);
}

ChunkedTrain train_in_chunks(Backend& backend, rlh_model* model, PackedBatch& b, const std::vector<int64_t>& bounds,
                             LossAdapter& loss, const std::vector<rlh_output_spec>& specs, int64_t mb_tokens,
                             int64_t mb_seqs, int64_t step, const std::string& what,
                             const std::function<ValidCounts(const PackedBatch&, const BatchMasks&)>& counts,
                             const std::function<Metrics(const Metrics&)>& reduce) {
  ChunkedTrain out;
  auto absorb = [&](const json& obj) {
    for (const auto& [k, v] : obj.items()) {
      if (!v.is_number() || k == "loss" || k == "grad_norm") continue;
      // Extrema a device loss reported through metric_tensor (the backend combined them over
      // micro-batches): combined over chunks as extrema, not summed.
      if (const Reduce red = LossAdapter::reduce_of(k); red != Reduce::kSum) {
        out.extrema.add(k, v.get<double>(), red);
        continue;
      }
      if (k == "lr" || k == "wd" || k == "weight_decay" || k == "step" || k == "clip_coef") out.summed[k] = v.get<double>();
      else out.summed[k] += v.get<double>();
    }
  };
  for (size_t k = 0; k + 1 < bounds.size(); ++k) {
    PackedBatch chunk = b.slice(bounds[k], bounds[k + 1]);
    const BatchMasks masks(chunk);
    const ValidCounts global = counts(chunk, masks);
    loss.reset_step();
    const rlh_train_args a = train_args(chunk, specs, loss, global, mb_tokens, mb_seqs);
    const Backend::TrainResult r = backend.train_step(model, a);
    stop_on_nonfinite(r.loss, r.grad_norm, step, what);
    out.loss += r.loss;
    out.grad_norm += r.grad_norm;
    absorb(r.metrics);
    if (r.metrics.contains("metrics") && r.metrics["metrics"].is_object()) absorb(r.metrics["metrics"]);
    out.extrema.merge(reduce ? reduce(loss.step_extrema()) : loss.step_extrema());
  }
  return out;
}

void stop_on_nonfinite(double loss, double grad_norm, int64_t step, const std::string& what) {
  if (std::isfinite(loss) && std::isfinite(grad_norm)) return;
  auto text = [](double v) { return std::isnan(v) ? std::string("NaN") : std::to_string(v); };
  throw Error(RLH_E_ABORTED, what + " " + std::to_string(step) + ": the loss is " + text(loss) + " and the gradient norm " +
                                 text(grad_norm) +
                                 "; stopping (a non-finite loss ends the run, as in NeMo-RL; this step is not "
                                 "checkpointed, resume from the last checkpoint)");
}

// ---- checkpoints -------------------------------------------------------------------------------

std::optional<sdk::CheckpointInfo> resume_from_checkpoints(const sdk::Host& host, sdk::CheckpointManager& ckpt,
                                                           const std::function<void(const sdk::CheckpointInfo&)>& load) {
  std::vector<std::string> skipped;
  bool load_failed = false;
  auto loaded = ckpt.resume(load, &skipped, &load_failed);
  for (const auto& s : skipped) host.warn("checkpoint skipped: " + s);
  if (loaded) {
    host.info("resumed from " + loaded->dir.string() + " (step " + std::to_string(loaded->step) + ")");
    return loaded;
  }
  if (load_failed)
    throw Error(RLH_E_DATA_LOSS, "no checkpoint in " + ckpt.config().checkpoint_dir.string() +
                                     " could be resumed, and loading one failed part way (the model may be half "
                                     "loaded): stopping; move the damaged step_N folders away to start afresh");
  if (!skipped.empty())
    host.warn("no checkpoint in " + ckpt.config().checkpoint_dir.string() +
              " verifies: starting from step 0 (the skipped folders are kept and never overwritten)");
  return std::nullopt;
}

bool may_save_checkpoint(const sdk::Host& host, const sdk::CheckpointManager& ckpt, int64_t step) {
  std::string why;
  if (ckpt.may_write(step, &why)) return true;
  host.warn("checkpoint for step " + std::to_string(step) + " not saved: " + why);
  return false;
}

std::string stop_for_deadline(int64_t step, bool saved) {
  return "checkpointing.checkpoint_must_save_by: the time is up after step " + std::to_string(step) +
         (saved ? " (checkpoint saved)" : " (checkpointing is off: nothing saved)") + "; training stops early";
}

std::string resolve_policy_dir(const std::string& model_name) {
  try {
    return sdk::resolve_model_path(model_name).string();
  } catch (const std::exception& e) {
    throw sdk::Error(RLH_E_NOT_FOUND, std::string("policy.model_name: ") + e.what());
  }
}

void save_policy_folder(Backend& backend, rlh_model* policy, const std::string& dir, const std::string& tokenizer_name,
                        const std::string& model_dir, bool writer) {
  namespace fs = std::filesystem;
  const fs::path policy_dir(dir);
  if (writer) fs::create_directories(policy_dir);
  backend.save_state(policy, policy_dir.string());
  if (!writer) return;
  const fs::path tok_src = fs::is_directory(tokenizer_name) ? fs::path(tokenizer_name) : fs::path(model_dir);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"})
    if (fs::exists(tok_src / f) && !fs::exists(policy_dir / f)) fs::copy_file(tok_src / f, policy_dir / f);
}

}  // namespace rlh::grpo
