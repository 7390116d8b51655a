// librlhost's component handles (rlhost/host.h, ABI 0.4): a tokenizer, a model in a backend for
// logprobs and a generator, with tensors in as borrowed DLPack views and out as DLPack 1.x
// managed tensors, so a language binding (the Python package) can hand them to numpy or torch
// without copying. Everything goes through the components' ABI tables, as `rlhost logprobs` and
// `rlhost generate` do, so the numbers are theirs.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "capi_internal.hpp"
#include "model_eos.hpp"
#include "rlhost/backend.h"
#include "rlhost/generator.h"
#include "rlhost/tokenizer.h"

using rlh::capi::call;
using rlh::capi::invalid;
using rlh::sdk::Error;

struct rlhost_tokenizer_t : rlhost_handle {
  const rlh_tokenizer_api* api = nullptr;
  rlh_tokenizer* tok = nullptr;
  using rlhost_handle::rlhost_handle;
  ~rlhost_tokenizer_t() override {
    if (tok != nullptr) api->destroy(tok);
  }
};

struct rlhost_model_t : rlhost_handle {
  const rlh_backend_api* api = nullptr;
  rlh_backend* backend = nullptr;
  rlh_model* model = nullptr;
  using rlhost_handle::rlhost_handle;
  ~rlhost_model_t() override {
    if (model != nullptr) api->unload_model(backend, model);
    if (backend != nullptr) api->destroy(backend);
  }
};

struct rlhost_generator_t : rlhost_handle {
  const rlh_generator_api* api = nullptr;
  rlh_generator* gen = nullptr;
  std::set<int32_t> eos;  // the model's EOS ids, joined to every call's stop ids
  using rlhost_handle::rlhost_handle;
  ~rlhost_generator_t() override {
    if (gen != nullptr) api->destroy(gen);
  }
};

namespace {

// ---- tensors in --------------------------------------------------------------------------------

constexpr int64_t kMaxElements = int64_t(1) << 31;  // far beyond any batch; bounds the copies

// An integer tensor of rank 1 or 2 read into int64 values, row-major: rows x cols.
struct IntRows {
  int64_t rows = 0, cols = 0;
  bool batched = false;  // rank 2
  std::vector<int64_t> v;
  int64_t at(int64_t r, int64_t c) const { return v[size_t(r * cols + c)]; }
};

std::string dtype_text(const rlh_dtype& d) {
  static const char* const names[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
  std::string s = d.code < 7 ? names[d.code] : "code " + std::to_string(d.code) + " ";
  s += std::to_string(d.bits);
  if (d.lanes != 1) s += "x" + std::to_string(d.lanes);
  return s;
}

// Checks device, dtype (int32/int64) and rank (1..max_rank) of `t` and copies its values.
IntRows read_ints(const rlh_tensor* t, const std::string& what, int32_t max_rank) {
  if (t == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, what + ": NULL tensor");
  if (t->device.device_type != RLH_DEVICE_CPU && t->device.device_type != RLH_DEVICE_CUDA_HOST)
    throw Error(RLH_E_INVALID_ARGUMENT, what + ": a tensor on device type " + std::to_string(t->device.device_type) +
                                            " (" + (t->device.device_type == RLH_DEVICE_CUDA ? "CUDA" : "not the CPU") +
                                            "); rlhost reads it from CPU memory (copy it to the CPU first)");
  if (t->dtype.code != RLH_DTYPE_INT || (t->dtype.bits != 32 && t->dtype.bits != 64) || t->dtype.lanes != 1)
    throw Error(RLH_E_INVALID_ARGUMENT, what + ": dtype " + dtype_text(t->dtype) + ", expected int32 or int64");
  if (t->ndim < 1 || t->ndim > max_rank)
    throw Error(RLH_E_INVALID_ARGUMENT, what + ": rank " + std::to_string(t->ndim) + ", expected " +
                                            (max_rank == 1 ? std::string("1 ([n])") : std::string("1 ([T]) or 2 ([B, T])")));
  if (t->shape == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, what + ": shape is NULL");
  IntRows out;
  out.batched = t->ndim == 2;
  out.rows = out.batched ? t->shape[0] : 1;
  out.cols = t->shape[t->ndim - 1];
  if (out.rows < 0 || out.cols < 0 || (out.cols > 0 && out.rows > kMaxElements / out.cols))
    throw Error(RLH_E_INVALID_ARGUMENT, what + ": shape out of range");
  const int64_t n = out.rows * out.cols;
  if (n > 0 && t->data == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, what + ": data is NULL");
  // Strides in elements; NULL = row-major (DLPack < 1.2 allowed it).
  const int64_t s_row = t->strides != nullptr ? (out.batched ? t->strides[0] : 0) : out.cols;
  const int64_t s_col = t->strides != nullptr ? t->strides[t->ndim - 1] : 1;
  const auto* base = static_cast<const unsigned char*>(t->data) + t->byte_offset;
  out.v.resize(size_t(n));
  for (int64_t r = 0; r < out.rows; ++r)
    for (int64_t c = 0; c < out.cols; ++c) {
      const int64_t e = r * s_row + c * s_col;
      out.v[size_t(r * out.cols + c)] = t->dtype.bits == 32 ? int64_t(reinterpret_cast<const int32_t*>(base)[e])
                                                            : reinterpret_cast<const int64_t*>(base)[e];
    }
  return out;
}

// Row lengths: `lengths` ([rows], each in [min, cols]) or every row full.
std::vector<int64_t> read_lengths(const rlh_tensor* lengths, const IntRows& ids, const std::string& what,
                                  int64_t min) {
  if (lengths == nullptr) return std::vector<int64_t>(size_t(ids.rows), ids.cols);
  const IntRows l = read_ints(lengths, what, 1);
  if (l.cols != ids.rows)
    throw Error(RLH_E_INVALID_ARGUMENT, what + ": " + std::to_string(l.cols) + " lengths for " +
                                            std::to_string(ids.rows) + " rows");
  for (int64_t r = 0; r < l.cols; ++r)
    if (l.v[size_t(r)] < min || l.v[size_t(r)] > ids.cols)
      throw Error(RLH_E_INVALID_ARGUMENT, what + "[" + std::to_string(r) + "] = " + std::to_string(l.v[size_t(r)]) +
                                              ", expected " + std::to_string(min) + ".." + std::to_string(ids.cols));
  return l.v;
}

// One sequence's ids as the components take them (int32), checked.
std::vector<int32_t> row_ids(const IntRows& ids, int64_t r, int64_t len, const std::string& what) {
  std::vector<int32_t> out(static_cast<size_t>(len));
  for (int64_t t = 0; t < len; ++t) {
    const int64_t id = ids.at(r, t);
    if (id < 0 || id > INT32_MAX)
      throw Error(RLH_E_INVALID_ARGUMENT, what + (ids.batched ? "[" + std::to_string(r) + ", " : "[") +
                                              std::to_string(t) + "] = " + std::to_string(id) + " is not a token id");
    out[size_t(t)] = int32_t(id);
  }
  return out;
}

// ---- tensors out -------------------------------------------------------------------------------

// What a managed tensor points to. Shared by the managed tensors over it (rlhost_tensor_share):
// freed with the last one, from whichever thread runs its deleter.
struct Storage {
  std::vector<int64_t> shape, strides;
  std::unique_ptr<int64_t[]> data;  // 8-byte aligned storage for any element type
};

struct Owned {
  rlh_managed_tensor m{};
  std::shared_ptr<Storage> storage;
};

void owned_deleter(rlh_managed_tensor* self) { delete static_cast<Owned*>(self->manager_ctx); }

rlh_managed_tensor* managed_over(std::shared_ptr<Storage> s, rlh_dtype dtype) {
  auto o = std::make_unique<Owned>();
  o->storage = std::move(s);
  o->m.version = rlh_pack_version{RLH_PACK_VERSION_MAJOR, RLH_PACK_VERSION_MINOR};
  o->m.manager_ctx = o.get();
  o->m.deleter = owned_deleter;
  o->m.flags = 0;
  rlh_tensor& t = o->m.dl_tensor;
  t.data = o->storage->data.get();
  t.device = rlh_device{RLH_DEVICE_CPU, 0};
  t.ndim = int32_t(o->storage->shape.size());
  t.dtype = dtype;
  t.shape = o->storage->shape.data();
  t.strides = o->storage->strides.data();
  t.byte_offset = 0;
  return &o.release()->m;
}

rlh_managed_tensor* make_tensor(rlh_dtype dtype, std::vector<int64_t> shape) {
  auto s = std::make_shared<Storage>();
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  s->shape = std::move(shape);
  s->strides.assign(s->shape.size(), 1);
  for (size_t i = s->shape.size(); i-- > 1;) s->strides[i - 1] = s->strides[i] * s->shape[i];
  const size_t bytes = size_t(n) * dtype.bits / 8;
  s->data.reset(new int64_t[std::max<size_t>(1, (bytes + 7) / 8)]());  // zeroed; never NULL
  return managed_over(std::move(s), dtype);
}

template <typename T>
T* values(rlh_managed_tensor* m) {
  return static_cast<T*>(m->dl_tensor.data);
}

// Frees managed tensors on scope exit unless released (an error after some were made).
struct TensorGuard {
  std::vector<rlh_managed_tensor*> held;
  rlh_managed_tensor* add(rlh_managed_tensor* m) {
    held.push_back(m);
    return m;
  }
  ~TensorGuard() {
    for (rlh_managed_tensor* m : held) m->deleter(m);
  }
  void release() { held.clear(); }
};

constexpr rlh_dtype kI64{RLH_DTYPE_INT, 64, 1};
constexpr rlh_dtype kF32{RLH_DTYPE_FLOAT, 32, 1};
constexpr rlh_dtype kBool{RLH_DTYPE_BOOL, 8, 1};

std::string config_text(const char* json, size_t len, const std::string& what) {
  if (json == nullptr || len == 0) return "{}";
  std::string text(json, len);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(RLH_E_INVALID_ARGUMENT, what + ": invalid JSON: " + e.what());
  }
  if (!j.is_object()) throw Error(RLH_E_INVALID_ARGUMENT, what + ": expected a JSON object");
  return text;
}

void append_ids(void* user, const void* data, size_t len) {
  auto* v = static_cast<std::vector<int32_t>*>(user);
  const auto* p = static_cast<const int32_t*>(data);
  v->insert(v->end(), p, p + len / sizeof(int32_t));
}

// The legacy wrapper of rlhost_tensor_to_legacy.
struct Legacy {
  rlhost_legacy_tensor l{};
  rlh_managed_tensor* inner = nullptr;
};

}  // namespace

extern "C" {

// ---- tokenizer ---------------------------------------------------------------------------------

rlh_status* rlhost_tokenizer_open(rlhost_t* host, const char* path, rlhost_tokenizer_t** out) {
  if (host == nullptr || path == nullptr || out == nullptr) return invalid("rlhost_tokenizer_open: NULL argument");
  *out = nullptr;
  return call([&] {
    const auto& c = host->host.find_component(RLH_KIND_TOKENIZER, "");
    auto h = std::make_unique<rlhost_tokenizer_t>(host);
    h->api = static_cast<const rlh_tokenizer_api*>(c.desc->api);
    rlh::sdk::check(h->api->create(host->host.services(), path, &h->tok), std::string("tokenizer of ") + path);
    *out = h.release();
  });
}

void rlhost_tokenizer_close(rlhost_tokenizer_t* tokenizer) { delete tokenizer; }

rlh_status* rlhost_tokenize(rlhost_tokenizer_t* tokenizer, const char* text, size_t len, uint64_t flags,
                            rlh_managed_tensor** ids) {
  if (tokenizer == nullptr || ids == nullptr || (text == nullptr && len > 0))
    return invalid("rlhost_tokenize: NULL argument");
  *ids = nullptr;
  return call([&] {
    std::vector<int32_t> v;
    rlh::sdk::check(tokenizer->api->encode(tokenizer->tok, text != nullptr ? text : "", len, flags, append_ids, &v));
    rlh_managed_tensor* m = make_tensor(kI64, {int64_t(v.size())});
    for (size_t i = 0; i < v.size(); ++i) values<int64_t>(m)[i] = v[i];
    *ids = m;
  });
}

rlh_status* rlhost_detokenize(rlhost_tokenizer_t* tokenizer, const rlh_tensor* ids, uint64_t flags,
                              rlh_write_fn write, void* user) {
  if (tokenizer == nullptr) return invalid("rlhost_detokenize: NULL tokenizer");
  return call([&] {
    const IntRows r = read_ints(ids, "ids", 1);
    const std::vector<int32_t> v = row_ids(r, 0, r.cols, "ids");
    std::string text;
    rlh::sdk::check(tokenizer->api->decode(tokenizer->tok, v.data(), v.size(), flags, rlh::sdk::write_to_string, &text));
    if (write != nullptr) write(user, text.data(), text.size());
  });
}

// ---- model: logprobs ---------------------------------------------------------------------------

rlh_status* rlhost_model_open(rlhost_t* host, const rlhost_model_args* args, rlhost_model_t** out) {
  if (host == nullptr || args == nullptr || out == nullptr) return invalid("rlhost_model_open: NULL argument");
  *out = nullptr;
  if (args->struct_size < RLH_STRUCT_SIZE(rlhost_model_args, config_len))
    return invalid("rlhost_model_open: args->struct_size is smaller than rlhost_model_args of ABI 0.4");
  if (args->path == nullptr) return invalid("rlhost_model_open: path is NULL");
  return call([&] {
    const std::string name = args->backend != nullptr ? args->backend : "dtensor";
    const std::string config = config_text(args->config_json, args->config_len, "backend '" + name + "' config");
    const auto& c = host->host.find_component(RLH_KIND_BACKEND, name);
    auto h = std::make_unique<rlhost_model_t>(host);
    h->api = static_cast<const rlh_backend_api*>(c.desc->api);
    if (h->api->struct_size < RLH_STRUCT_SIZE(rlh_backend_api, forward))
      throw Error(RLH_E_ABI_MISMATCH, "backend '" + name + "' has an interface table older than logprobs need");
    rlh::sdk::check(h->api->create(host->host.services(), config.data(), config.size(), &h->backend),
                    "backend '" + name + "'");
    rlh_model_args margs{};
    margs.struct_size = RLH_STRUCT_SIZE(rlh_model_args, config_len);
    margs.role = "policy";
    margs.path = args->path;
    rlh::sdk::check(h->api->load_model(h->backend, &margs, &h->model));
    *out = h.release();
  });
}

void rlhost_model_close(rlhost_model_t* model) { delete model; }

rlh_status* rlhost_logprobs(rlhost_model_t* model, const rlhost_logprobs_args* args, rlh_managed_tensor** out) {
  if (model == nullptr || args == nullptr || out == nullptr) return invalid("rlhost_logprobs: NULL argument");
  *out = nullptr;
  if (args->struct_size < RLH_STRUCT_SIZE(rlhost_logprobs_args, temperature))
    return invalid("rlhost_logprobs: args->struct_size is smaller than rlhost_logprobs_args of ABI 0.4");
  return call([&] {
    if (!(args->temperature > 0) || !std::isfinite(args->temperature))
      throw Error(RLH_E_INVALID_ARGUMENT, "temperature must be a positive number, got " + std::to_string(args->temperature));
    const IntRows ids = read_ints(args->ids, "ids", 2);
    const std::vector<int64_t> lengths = read_lengths(args->lengths, ids, "lengths", 1);
    if (ids.cols == 0) throw Error(RLH_E_INVALID_ARGUMENT, "ids: no tokens");
    if (ids.rows == 0) {  // an empty batch: nothing to score
      *out = make_tensor(kF32, {0, ids.cols});
      return;
    }
    // The rows packed back to back, as the backend takes a batch.
    std::vector<int32_t> flat;
    std::vector<int64_t> offsets = {0};
    for (int64_t r = 0; r < ids.rows; ++r) {
      const std::vector<int32_t> row = row_ids(ids, r, lengths[size_t(r)], "ids");
      flat.insert(flat.end(), row.begin(), row.end());
      offsets.push_back(int64_t(flat.size()));
    }
    const int64_t T = int64_t(flat.size());
    rlh_batch batch{};
    batch.struct_size = RLH_STRUCT_SIZE(rlh_batch, constraints);
    batch.num_tokens = T;
    batch.num_seqs = ids.rows;
    batch.token_ids = flat.data();
    batch.seq_offsets = offsets.data();
    rlh_output_spec spec{};
    spec.struct_size = RLH_STRUCT_SIZE(rlh_output_spec, ids_field);
    spec.kind = RLH_OUTPUT_LOGPROB_RAW;
    spec.name = "logprobs";
    spec.temperature = args->temperature;
    spec.top_p = 1.0;
    std::vector<float> packed(size_t(T), 0.0f);
    int64_t shape[1] = {T}, strides[1] = {1};
    rlh_tensor out_t{};
    out_t.data = packed.data();
    out_t.device = rlh_device{RLH_DEVICE_CPU, 0};
    out_t.ndim = 1;
    out_t.dtype = kF32;
    out_t.shape = shape;
    out_t.strides = strides;
    rlh_forward_args fargs{};
    fargs.struct_size = RLH_STRUCT_SIZE(rlh_forward_args, micro_batch_tokens);
    fargs.batch = &batch;
    fargs.specs = &spec;
    fargs.num_outputs = 1;
    fargs.outputs = &out_t;
    rlh::sdk::check(model->api->forward(model->backend, model->model, &fargs));
    // Token-aligned already (output t = log p(token t | tokens < t), 0 at t = 0); zeros on padding.
    std::vector<int64_t> out_shape = ids.batched ? std::vector<int64_t>{ids.rows, ids.cols} : std::vector<int64_t>{ids.cols};
    rlh_managed_tensor* m = make_tensor(kF32, out_shape);
    for (int64_t r = 0; r < ids.rows; ++r)
      for (int64_t t = 1; t < lengths[size_t(r)]; ++t)
        values<float>(m)[r * ids.cols + t] = packed[size_t(offsets[size_t(r)] + t)];
    *out = m;
  });
}

// ---- generator ---------------------------------------------------------------------------------

rlh_status* rlhost_generator_open(rlhost_t* host, const rlhost_generator_args* args, rlhost_generator_t** out) {
  if (host == nullptr || args == nullptr || out == nullptr) return invalid("rlhost_generator_open: NULL argument");
  *out = nullptr;
  if (args->struct_size < RLH_STRUCT_SIZE(rlhost_generator_args, config_len))
    return invalid("rlhost_generator_open: args->struct_size is smaller than rlhost_generator_args of ABI 0.4");
  if (args->path == nullptr) return invalid("rlhost_generator_open: path is NULL");
  return call([&] {
    const std::string name = args->generator != nullptr ? args->generator : "";
    const std::string config = config_text(args->config_json, args->config_len, "generator config");
    const auto& c = host->host.find_component(RLH_KIND_GENERATOR, name);
    auto h = std::make_unique<rlhost_generator_t>(host);
    h->api = static_cast<const rlh_generator_api*>(c.desc->api);
    if (h->api->struct_size < RLH_STRUCT_SIZE(rlh_generator_api, generate))
      throw Error(RLH_E_ABI_MISMATCH, std::string("generator '") + c.desc->name + "' has an interface table older than this call needs");
    // The tokenizer's EOS ids too, as `rlhost generate` stops at them, when one is loaded and the
    // model has a tokenizer (ids in, ids out need none).
    const rlh_tokenizer_api* tapi = nullptr;
    rlh_tokenizer* tok = nullptr;
    if (!host->host.components(RLH_KIND_TOKENIZER).empty()) {
      try {
        tapi = static_cast<const rlh_tokenizer_api*>(host->host.find_component(RLH_KIND_TOKENIZER, "").desc->api);
        if (rlh_status* st = tapi->create(host->host.services(), args->path, &tok)) {
          rlh_status_destroy(st);
          tok = nullptr;
        }
      } catch (const std::exception&) {
        tok = nullptr;  // no usable tokenizer: the files' EOS ids only
      }
    }
    try {
      h->eos = rlh::host::model_eos_ids(args->path, tapi, tok);
    } catch (...) {
      if (tok != nullptr) tapi->destroy(tok);
      throw;
    }
    if (tok != nullptr) tapi->destroy(tok);
    rlh::sdk::check(h->api->create(host->host.services(), args->path, config.data(), config.size(), &h->gen),
                    std::string("generator '") + c.desc->name + "'");
    *out = h.release();
  });
}

void rlhost_generator_close(rlhost_generator_t* generator) { delete generator; }

rlh_status* rlhost_generate(rlhost_generator_t* generator, const rlhost_generate_args* args, rlhost_generation* out) {
  if (generator == nullptr || args == nullptr || out == nullptr) return invalid("rlhost_generate: NULL argument");
  if (args->struct_size < RLH_STRUCT_SIZE(rlhost_generate_args, flags))
    return invalid("rlhost_generate: args->struct_size is smaller than rlhost_generate_args of ABI 0.4");
  if (out->struct_size < RLH_STRUCT_SIZE(rlhost_generation, lengths))
    return invalid("rlhost_generate: out->struct_size is smaller than rlhost_generation's ids, logprobs and lengths");
  if (args->sampling == nullptr) return invalid("rlhost_generate: sampling is NULL");
  const bool want_truncated = out->struct_size >= RLH_STRUCT_SIZE(rlhost_generation, truncated);
  out->ids = out->logprobs = out->lengths = nullptr;
  if (want_truncated) out->truncated = nullptr;
  return call([&] {
    if (args->samples_per_prompt < 1)
      throw Error(RLH_E_INVALID_ARGUMENT, "samples_per_prompt must be at least 1, got " + std::to_string(args->samples_per_prompt));
    const IntRows ids = read_ints(args->prompt_ids, "prompt_ids", 2);
    const std::vector<int64_t> lengths = read_lengths(args->prompt_lengths, ids, "prompt_lengths", 1);
    if (ids.cols == 0) throw Error(RLH_E_INVALID_ARGUMENT, "prompt_ids: empty prompts");
    if (ids.rows == 0) throw Error(RLH_E_INVALID_ARGUMENT, "prompt_ids: no prompts");
    if (args->samples_per_prompt > kMaxElements / ids.rows)
      throw Error(RLH_E_INVALID_ARGUMENT, "samples_per_prompt: " + std::to_string(args->samples_per_prompt) + " x " +
                                              std::to_string(ids.rows) + " prompts is too many samples");
    std::vector<std::vector<int32_t>> prompts;
    std::vector<int32_t> flat;
    std::vector<int64_t> offsets = {0};
    for (int64_t r = 0; r < ids.rows; ++r) {
      prompts.push_back(row_ids(ids, r, lengths[size_t(r)], "prompt_ids"));
      flat.insert(flat.end(), prompts.back().begin(), prompts.back().end());
      offsets.push_back(int64_t(flat.size()));
    }
    // The caller's sampling with the model's EOS ids joined to its stop ids.
    rlh_sampling sp = *args->sampling;
    std::set<int32_t> stops;
    if (sp.num_stop_token_ids > 0 && sp.stop_token_ids == nullptr)
      throw Error(RLH_E_INVALID_ARGUMENT, "sampling.stop_token_ids is NULL with num_stop_token_ids > 0");
    for (size_t i = 0; i < sp.num_stop_token_ids; ++i) stops.insert(sp.stop_token_ids[i]);
    if ((args->flags & RLHOST_GENERATE_IGNORE_EOS) == 0) stops.insert(generator->eos.begin(), generator->eos.end());
    const std::vector<int32_t> stop_list(stops.begin(), stops.end());
    sp.stop_token_ids = stop_list.data();
    sp.num_stop_token_ids = stop_list.size();
    rlh_generate_args ga{};
    ga.struct_size = RLH_STRUCT_SIZE(rlh_generate_args, sampling);
    ga.prompt_ids = flat.data();
    ga.prompt_offsets = offsets.data();
    ga.num_prompts = ids.rows;
    ga.samples_per_prompt = args->samples_per_prompt;
    ga.sampling = &sp;
    struct Sample {
      std::vector<int32_t> ids;
      std::vector<float> logprobs;
      bool truncated = false;
    };
    std::map<std::pair<int64_t, int64_t>, Sample> got;
    auto collect = [](void* user, const rlh_sample* s) -> rlh_status* {
      Sample r;
      r.ids.assign(s->ids, s->ids + s->num_tokens);
      r.logprobs.assign(s->logprobs, s->logprobs + s->num_tokens);
      r.truncated = s->truncated != 0;
      (*static_cast<std::map<std::pair<int64_t, int64_t>, Sample>*>(user))[{s->prompt_index, s->sample_index}] =
          std::move(r);
      return nullptr;
    };
    rlh::sdk::check(generator->api->generate(generator->gen, &ga, collect, &got));
    const int64_t n = ids.rows * args->samples_per_prompt;
    if (int64_t(got.size()) != n)
      throw Error(RLH_E_INTERNAL, "the generator returned " + std::to_string(got.size()) + " samples, expected " +
                                      std::to_string(n));
    int64_t L = 0;
    for (const auto& [key, s] : got) L = std::max(L, int64_t(prompts[size_t(key.first)].size() + s.ids.size()));
    TensorGuard g;
    rlh_managed_tensor* o_ids = g.add(make_tensor(kI64, {n, L}));
    rlh_managed_tensor* o_lp = g.add(make_tensor(kF32, {n, L}));
    rlh_managed_tensor* o_len = g.add(make_tensor(kI64, {n}));
    rlh_managed_tensor* o_tr = want_truncated ? g.add(make_tensor(kBool, {n})) : nullptr;
    for (const auto& [key, s] : got) {
      const int64_t row = key.first * args->samples_per_prompt + key.second;
      const std::vector<int32_t>& p = prompts[size_t(key.first)];
      int64_t* ri = values<int64_t>(o_ids) + row * L;
      float* rl = values<float>(o_lp) + row * L;
      for (size_t t = 0; t < p.size(); ++t) ri[t] = p[t];
      for (size_t t = 0; t < s.ids.size(); ++t) {
        ri[p.size() + t] = s.ids[t];
        rl[p.size() + t] = s.logprobs[t];
      }
      values<int64_t>(o_len)[row] = int64_t(p.size() + s.ids.size());
      if (o_tr != nullptr) values<uint8_t>(o_tr)[row] = s.truncated ? 1 : 0;
    }
    g.release();
    out->ids = o_ids;
    out->logprobs = o_lp;
    out->lengths = o_len;
    if (want_truncated) out->truncated = o_tr;
  });
}

// ---- sharing, DLPack < 1.0 ---------------------------------------------------------------------

rlh_status* rlhost_tensor_share(rlh_managed_tensor* tensor, rlh_managed_tensor** out) {
  if (tensor == nullptr || out == nullptr) return invalid("rlhost_tensor_share: NULL argument");
  *out = nullptr;
  if (tensor->deleter != owned_deleter) return invalid("rlhost_tensor_share: not a tensor librlhost made");
  return call([&] { *out = managed_over(static_cast<Owned*>(tensor->manager_ctx)->storage, tensor->dl_tensor.dtype); });
}


rlh_status* rlhost_tensor_to_legacy(rlh_managed_tensor* tensor, rlhost_legacy_tensor** out) {
  if (tensor == nullptr || out == nullptr) return invalid("rlhost_tensor_to_legacy: NULL argument");
  *out = nullptr;
  if (tensor->version.major != 1)
    return invalid(("rlhost_tensor_to_legacy: DLPack major version " + std::to_string(tensor->version.major) +
                    " is not 1").c_str());
  return call([&] {
    auto w = std::make_unique<Legacy>();
    w->inner = tensor;
    w->l.dl_tensor = tensor->dl_tensor;  // the same data, shape and strides arrays
    w->l.manager_ctx = w.get();
    w->l.deleter = [](rlhost_legacy_tensor* self) {
      auto* lw = static_cast<Legacy*>(self->manager_ctx);
      lw->inner->deleter(lw->inner);
      delete lw;
    };
    *out = &w.release()->l;
  });
}

}  // extern "C"
