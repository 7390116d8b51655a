// The `reward_model` environment (NeMo-RL's RewardModelEnvironment, env.reward_model): scores a
// response with a trained Bradley-Terry reward model. The model runs on a backend component of
// the host (dtensor, found through the registry like any component: no plugin library is linked),
// loaded frozen as a value model, and the text is tokenized by the host's TOKENIZER component.
//
// A sample's reward is the value head's output at the last token of BOS + prompt, response + EOS
// (each added where missing, as NeMo-RL's environment and rm data both add them), the same place
// the rm loop reads its rewards, so a checkpoint of `--plugin rm` scores here as it was trained.
// Samples are scored in one forward pass, in micro-batches of `batch_size` sequences.
#include "reward_model_env.hpp"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "rlhost/backend.h"
#include "rlhost/sdk/message_special_tokens.hpp"
#include "rlhost/tokenizer.h"

namespace rlh::environments {

using json = nlohmann::json;
using sdk::Error;

namespace {

void write_ids(void* user, const void* data, size_t len) {
  auto* v = static_cast<std::vector<int32_t>*>(user);
  const size_t n = len / sizeof(int32_t);
  const size_t at = v->size();
  v->resize(at + n);
  std::memcpy(v->data() + at, data, n * sizeof(int32_t));
}

const json& at_key(const json& j, const char* key) {
  static const json kNull;
  auto it = j.find(key);
  return it == j.end() ? kNull : *it;
}

}  // namespace

struct RewardModelEnv::Impl {
  sdk::Host host;
  std::string model, tokenizer_name;
  int64_t batch_size = 1;
  int64_t max_model_len = 0;  // 0: the model's
  const rlh_tokenizer_api* tok_api = nullptr;
  rlh_tokenizer* tok = nullptr;
  std::string bos_text, eos_text;  // the tokens' texts ("" without one)
  const rlh_backend_api* be_api = nullptr;
  rlh_backend* be = nullptr;
  rlh_model* rm = nullptr;
  std::mutex mu;  // one forward at a time on the backend instance

  ~Impl() {
    if (be_api != nullptr && be != nullptr) be_api->destroy(be);  // destroys its models
    if (tok_api != nullptr) tok_api->destroy(tok);
  }
};

RewardModelEnv::RewardModelEnv(const sdk::Host& host, const json& cfg) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.host = host;
  const std::string at = "env.reward_model";
  auto bad = [&](const std::string& key, const std::string& want, const json& v) {
    throw Error(RLH_E_INVALID_ARGUMENT, at + "." + key + ": expected " + want + ", got " + v.dump());
  };
  json section = {{"dtensor_cfg", {{"enabled", true}}}, {"optimizer", nullptr}};  // the backend's
  for (const auto& [key, v] : cfg.items()) {
    if (key == "model_name" || key == "checkpoint_path") {
      if (v.is_null() && key == "checkpoint_path") continue;
      if (!v.is_string() || v.get<std::string>().empty()) bad(key, "a model folder or hub id", v);
      // NeMo-RL's checkpoint_path loads trained weights over model_name's; here the folder an rm
      // run saved (step_N/policy) is a whole HF model, so it is the model.
      if (key == "checkpoint_path" || m.model.empty()) m.model = v.get<std::string>();
    } else if (key == "tokenizer") {
      if (!v.is_object()) bad(key, "a mapping with 'name'", v);
      for (const auto& [k, t] : v.items()) {
        if (k == "name") {
          if (!t.is_string() || t.get<std::string>().empty()) bad("tokenizer.name", "a tokenizer path or hub id", t);
          m.tokenizer_name = t.get<std::string>();
        } else if (k == "chat_template" && t.is_null()) {
          // null: text as written, which is what this environment scores.
        } else {
          throw Error(RLH_E_UNIMPLEMENTED, at + ".tokenizer." + k + " = " + t.dump() +
                                               " is not supported (the prompt arrives already rendered)");
        }
      }
    } else if (key == "precision") {
      if (!v.is_string()) bad(key, "a precision name", v);
      section["precision"] = v;
    } else if (key == "batch_size" || key == "max_model_len") {
      if (!v.is_number_integer() || v.get<int64_t>() < 1) bad(key, "a positive integer", v);
      (key == "batch_size" ? m.batch_size : m.max_model_len) = v.get<int64_t>();
    } else if (key == "reward_model_cfg") {
      // NeMo-RL asserts enabled and bradley_terry; the backend reads both.
      if (at_key(v, "enabled") != true) bad("reward_model_cfg.enabled", "true", at_key(v, "enabled"));
      section["reward_model_cfg"] = v;
    } else if (key == "dtensor_cfg") {
      if (at_key(v, "enabled") != true) bad("dtensor_cfg.enabled", "true (the reward model runs on dtensor)", at_key(v, "enabled"));
      for (const char* k : {"cpu_offload", "activation_checkpointing", "sequence_parallel"})
        if (!at_key(v, k).is_null() && at_key(v, k) != false) bad(std::string("dtensor_cfg.") + k, "false", at_key(v, k));
      for (const char* k : {"tensor_parallel_size", "context_parallel_size"})
        if (!at_key(v, k).is_null() && at_key(v, k) != 1) bad(std::string("dtensor_cfg.") + k, "1", at_key(v, k));
    } else if (key == "dynamic_batching" || key == "sequence_packing") {
      if (at_key(v, "enabled") == true) bad(key + ".enabled", "false (as NeMo-RL requires)", at_key(v, "enabled"));
    } else if (key == "max_grad_norm") {
      if (!v.is_null()) bad(key, "null (the reward model is not trained)", v);
    } else if (key == "processor" || key == "resources" || key == "offload_optimizer_for_logprob" ||
               key == "num_workers") {
      // The data processor is the dataset's; placement and offloading do not apply in-process.
    } else {
      throw Error(RLH_E_INVALID_ARGUMENT, at + "." + key + ": unknown key (reward_model reads model_name, "
                                                         "checkpoint_path, tokenizer.name, precision, batch_size, "
                                                         "max_model_len, reward_model_cfg, dtensor_cfg)");
    }
  }
  if (m.model.empty()) throw Error(RLH_E_INVALID_ARGUMENT, at + ".model_name: missing (the reward model to score with)");
  if (m.tokenizer_name.empty()) m.tokenizer_name = m.model;
  if (!section.contains("reward_model_cfg")) section["reward_model_cfg"] = {{"enabled", true}};

  m.tok_api = host.find<rlh_tokenizer_api>(RLH_KIND_TOKENIZER, nullptr, RLH_STRUCT_SIZE(rlh_tokenizer_api, info));
  sdk::check(m.tok_api->create(host.api(), m.tokenizer_name.c_str(), &m.tok), at + ".tokenizer.name");
  std::string info;
  sdk::check(m.tok_api->info(m.tok, sdk::write_to_string, &info), at + ": tokenizer info");
  const json ij = json::parse(info);
  auto text_of = [&](const json& id) {
    std::string t;
    if (!id.is_number_integer()) return t;
    const int32_t one = id.get<int32_t>();
    sdk::check(m.tok_api->decode(m.tok, &one, 1, 0, sdk::write_to_string, &t), at + ": tokenizer decode");
    return t;
  };
  m.bos_text = text_of(at_key(ij, "bos_token_id"));
  if (ij.contains("eos_token_id"))  // the tokenizer's own EOS (else the first stop id)
    m.eos_text = text_of(at_key(ij, "eos_token_id"));
  else if (const json& eos = at_key(ij, "eos_token_ids"); eos.is_array() && !eos.empty())
    m.eos_text = text_of(eos[0]);

  m.be_api = host.find<rlh_backend_api>(RLH_KIND_BACKEND, "dtensor", RLH_STRUCT_SIZE(rlh_backend_api, load_state));
  const std::string text = section.dump();
  sdk::check(m.be_api->create(host.api(), text.data(), text.size(), &m.be), at + ": reward model backend");
  rlh_model_args a{};
  a.struct_size = RLH_STRUCT_SIZE(rlh_model_args, config_len);
  a.role = "reward_model";
  a.path = m.model.c_str();
  a.flags = 0;  // frozen
  sdk::check(m.be_api->load_model(m.be, &a, &m.rm), at + ".model_name");
}

RewardModelEnv::~RewardModelEnv() = default;

std::vector<double> RewardModelEnv::score(const std::vector<std::string>& prompts,
                                          const std::vector<std::string>& responses) {
  Impl& m = *impl_;
  std::vector<int32_t> ids;
  std::vector<int64_t> offsets = {0};
  const size_t n = prompts.size();
  for (size_t i = 0; i < n; ++i) {
    std::string prompt = prompts[i], response = responses[i];
    sdk::add_bos_text(prompt, m.bos_text);
    sdk::add_eos_text(response, m.eos_text);
    std::vector<int32_t> one;
    for (const std::string* part : {&prompt, &response})
      sdk::check(m.tok_api->encode(m.tok, part->data(), part->size(), 0, write_ids, &one),
                 "env.reward_model: tokenizing sample " + std::to_string(i));
    if (one.empty()) throw Error(RLH_E_INVALID_ARGUMENT, "env.reward_model: sample " + std::to_string(i) + " is empty");
    if (m.max_model_len > 0 && static_cast<int64_t>(one.size()) > m.max_model_len) {
      // NeMo-RL cuts to max_model_len; the score then reads the last token kept.
      one.resize(static_cast<size_t>(m.max_model_len));
    }
    ids.insert(ids.end(), one.begin(), one.end());
    offsets.push_back(static_cast<int64_t>(ids.size()));
  }
  std::vector<double> out(n, 0.0);
  if (n == 0) return out;
  rlh_batch b{};
  b.struct_size = RLH_STRUCT_SIZE(rlh_batch, constraints);
  b.num_tokens = static_cast<int64_t>(ids.size());
  b.num_seqs = static_cast<int64_t>(n);
  b.token_ids = ids.data();
  b.seq_offsets = offsets.data();
  rlh_output_spec spec{};
  spec.struct_size = RLH_STRUCT_SIZE(rlh_output_spec, ids_field);
  spec.kind = RLH_OUTPUT_VALUE;
  spec.name = "values";
  spec.temperature = 1.0;
  spec.top_p = 1.0;
  std::vector<float> values(ids.size(), 0.0f);
  int64_t shape[1] = {b.num_tokens}, stride[1] = {1};
  rlh_tensor t{};
  t.data = values.data();
  t.device = rlh_device{RLH_DEVICE_CPU, 0};
  t.ndim = 1;
  t.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
  t.shape = shape;
  t.strides = stride;
  int64_t longest = 1;
  for (size_t i = 0; i + 1 < offsets.size(); ++i) longest = std::max(longest, offsets[i + 1] - offsets[i]);
  rlh_forward_args fa{};
  fa.struct_size = RLH_STRUCT_SIZE(rlh_forward_args, micro_batch_tokens);
  fa.batch = &b;
  fa.specs = &spec;
  fa.num_outputs = 1;
  fa.outputs = &t;
  fa.micro_batch_tokens = m.batch_size * longest;  // about batch_size sequences per pass
  {
    std::lock_guard<std::mutex> lock(m.mu);
    sdk::check(m.be_api->forward(m.be, m.rm, &fa), "env.reward_model: scoring");
  }
  for (size_t i = 0; i < n; ++i) out[i] = values[static_cast<size_t>(offsets[i + 1] - 1)];
  return out;
}

// ---- the C table ------------------------------------------------------------------------------

namespace {

struct Handle {
  sdk::MakeStatusFn make = nullptr;
  std::unique_ptr<RewardModelEnv> env;
};

rlh_status* rm_create(const rlh_host_api* host, const char* config_json, size_t config_len, rlh_environment** out) {
  const sdk::MakeStatusFn make = host != nullptr ? host->make_status : nullptr;
  return sdk::guard(make, [&] {
    if (out == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "env.reward_model: create: out is NULL");
    json cfg = json::object();
    if (config_json != nullptr && config_len > 0) {
      cfg = json::parse(std::string(config_json, config_len), nullptr, false);
      if (cfg.is_discarded() || !(cfg.is_object() || cfg.is_null()))
        throw Error(RLH_E_INVALID_ARGUMENT, "env.reward_model: expected a mapping");
      if (cfg.is_null()) cfg = json::object();
    }
    auto h = std::make_unique<Handle>();
    h->make = make;
    h->env = std::make_unique<RewardModelEnv>(sdk::Host(host), cfg);
    *out = reinterpret_cast<rlh_environment*>(h.release());
  });
}

void rm_destroy(rlh_environment* self) { delete reinterpret_cast<Handle*>(self); }

rlh_status* rm_reward_names(rlh_environment* self, rlh_write_fn write, void* user) {
  auto* h = reinterpret_cast<Handle*>(self);
  return sdk::guard(h->make, [&] {
    const std::string names = R"(["reward"])";
    write(user, names.data(), names.size());
  });
}

rlh_status* rm_score(rlh_environment* self, const rlh_env_sample* samples, size_t n, rlh_env_result* result) {
  auto* h = reinterpret_cast<Handle*>(self);
  return sdk::guard(h->make, [&] {
    if (result == nullptr || !RLH_HAS_FIELD(result, rlh_env_result, done))
      throw Error(RLH_E_INVALID_ARGUMENT, "env.reward_model: score: result is NULL or too old");
    if (n > 0 && (samples == nullptr || result->done == nullptr || (result->num_rewards > 0 && result->rewards == nullptr)))
      throw Error(RLH_E_INVALID_ARGUMENT, "env.reward_model: score: samples, rewards or done is NULL");
    for (size_t r = 0; r < result->num_rewards; ++r) {
      const char* want = result->reward_names != nullptr ? result->reward_names[r] : nullptr;
      if (want == nullptr || std::strcmp(want, "reward") != 0)
        throw Error(RLH_E_INVALID_ARGUMENT, std::string("env.reward_model: unknown reward '") + (want ? want : "(null)") +
                                                "' (this environment produces [\"reward\"])");
    }
    std::vector<std::string> prompts(n), responses(n);
    for (size_t i = 0; i < n; ++i) {
      const rlh_env_sample& s = samples[i];
      prompts[i].assign(s.prompt != nullptr ? s.prompt : "", s.prompt != nullptr ? s.prompt_len : 0);
      responses[i].assign(s.response != nullptr ? s.response : "", s.response != nullptr ? s.response_len : 0);
    }
    const std::vector<double> scores = h->env->score(prompts, responses);
    for (size_t i = 0; i < n; ++i) {
      for (size_t r = 0; r < result->num_rewards; ++r) result->rewards[i * result->num_rewards + r] = scores[i];
      result->done[i] = 1;  // single-turn
    }
  });
}

}  // namespace

const rlh_environment_api kRewardModelEnvApi = {RLH_STRUCT_SIZE(rlh_environment_api, score), rm_create, rm_destroy,
                                               rm_reward_names, rm_score};

}  // namespace rlh::environments
