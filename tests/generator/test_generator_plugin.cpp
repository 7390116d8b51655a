// The generator plugin through the host's ABI (find the GENERATOR component, create, refit,
// generate) and `rlhost generate`: greedy decoding equals every fixture's reference (dense,
// MoE, MLA), text prompts, chat templates and stop strings go through the tokenizer component, and bad inputs
// are one-line errors with a non-zero exit.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <nlohmann/json.hpp>
#include <string>

#include "generator_test_util.hpp"
#include "kernels_cpu_abi.hpp"
#include "rlhost/generator.h"
#include "rlhost/host.h"
#include "rlhost/model/llama_family.hpp"
#include "rlhost/sdk/safetensors.hpp"
#include "rlhost/sdk/status.hpp"
#include "rlhost/tokenizer.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace rlh;

namespace {

// ---------------------------------------------------------------------------------------------
// Helpers

struct Host {
  rlhost_t* h = nullptr;
  Host() {
    sdk::check(rlhost_create(&h));
    rlhost_set_log_level(h, RLH_LOG_WARN);
    sdk::check(rlhost_add_plugin_dir(h, RLH_PLUGIN_DIR));
    sdk::check(rlhost_load_plugin(h, "model_llama"));
    sdk::check(rlhost_load_plugin(h, "tokenizer_hf"));
    sdk::check(rlhost_load_plugin(h, "generator"));
  }
  ~Host() { rlhost_destroy(h); }
  // The run's configuration, as `rlhost run` would have loaded it.
  void load_config(const std::string& yaml) { sdk::check(rlhost_load_config_text(h, yaml.data(), yaml.size(), "test")); }
  const rlh_host_api* services() const { return rlhost_services(h); }
  const rlh_generator_api* generator() const {
    const rlh_component_desc* d = nullptr;
    sdk::check(services()->find_component(services()->ctx, RLH_KIND_GENERATOR, "native", &d));
    EXPECT_EQ(d->iface_major, uint32_t(RLH_GENERATOR_API_VERSION_MAJOR));
    return static_cast<const rlh_generator_api*>(d->api);
  }
};

struct Got {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  bool truncated = false;
  int64_t version = -1;
};
using GotMap = std::map<std::pair<int64_t, int64_t>, Got>;

Got& at(GotMap& m, int64_t prompt, int64_t sample) { return m[std::make_pair(prompt, sample)]; }

rlh_status* collect(void* user, const rlh_sample* s) {
  Got g;
  g.ids.assign(s->ids, s->ids + s->num_tokens);
  g.logprobs.assign(s->logprobs, s->logprobs + s->num_tokens);
  g.truncated = s->truncated;
  g.version = s->weight_version;
  (*static_cast<GotMap*>(user))[{s->prompt_index, s->sample_index}] = g;
  return nullptr;
}

// Runs generate with one sampling setup; returns the status code (outputs into `out`).
rlh_code generate(const rlh_generator_api* api, rlh_generator* g, const std::vector<std::vector<int32_t>>& prompts,
                  rlh_sampling sp, GotMap& out, rlh_sample_fn fn = collect, std::string* message = nullptr) {
  std::vector<int32_t> ids;
  std::vector<int64_t> off = {0};
  for (const auto& p : prompts) {
    ids.insert(ids.end(), p.begin(), p.end());
    off.push_back(int64_t(ids.size()));
  }
  sp.struct_size = RLH_STRUCT_SIZE(rlh_sampling, num_stop_strings);
  rlh_generate_args a{};
  a.struct_size = RLH_STRUCT_SIZE(rlh_generate_args, sampling);
  a.prompt_ids = ids.data();
  a.prompt_offsets = off.data();
  a.num_prompts = int64_t(prompts.size());
  a.samples_per_prompt = 1;
  a.sampling = &sp;
  rlh_status* s = api->generate(g, &a, fn, &out);
  const rlh_code code = s ? s->code : RLH_OK;
  if (message) *message = sdk::status_message(s);
  rlh_status_destroy(s);
  return code;
}

rlh_sampling greedy(int64_t n) {
  rlh_sampling sp{};
  sp.temperature = 0;
  sp.top_p = 1;
  sp.max_new_tokens = n;
  return sp;
}

struct Reference {
  std::vector<std::vector<int32_t>> prompts, expected;
};
Reference greedy_reference(const std::string& dir) {
  const auto ref = sdk::st::File::open(dir + "/reference.safetensors");
  const auto& pi = ref.at("greedy_prompt");
  const auto& oi = ref.at("greedy_output");
  const std::vector<double> p = ref.read_f64("greedy_prompt"), o = ref.read_f64("greedy_output");
  Reference r;
  const int64_t B = pi.shape[0], P = pi.shape[1], T = oi.shape[1];
  for (int64_t b = 0; b < B; ++b) {
    r.prompts.emplace_back(p.begin() + b * P, p.begin() + (b + 1) * P);
    r.expected.emplace_back(o.begin() + b * T + P, o.begin() + (b + 1) * T);
  }
  return r;
}

bool listed_fixture(const std::string& dir, std::string* why) {
  std::ifstream in(dir + "/config.json");
  const std::string arch = json::parse(in).value("architectures", json::array({""}))[0];
  if (!model::is_supported_architecture(arch)) {
    *why = "no architecture table lists " + arch;
    return false;
  }
  return true;
}

// A random Llama model with the fixture tokenizer next to it (vocabulary 1500), a chat template
// and EOS ids, for the text paths.
fs::path text_model_dir() {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("rlh_gen_text_model_" + std::to_string(::getpid()));
    fs::create_directories(d);
    const json cfg = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"vocab_size", 1500},
                      {"hidden_size", 64},  {"num_hidden_layers", 2},     {"num_attention_heads", 4},
                      {"num_key_value_heads", 2}, {"head_dim", 16},       {"intermediate_size", 128},
                      {"max_position_embeddings", 512}, {"rms_norm_eps", 1e-5}, {"rope_theta", 10000.0},
                      {"tie_word_embeddings", false}, {"torch_dtype", "float32"}, {"eos_token_id", 2},
                      {"bos_token_id", 0}};
    std::ofstream(d / "config.json") << cfg.dump(2);
    std::ofstream(d / "generation_config.json") << json{{"eos_token_id", {1, 2}}, {"bos_token_id", 0}}.dump();
    const sdk::TransformerDesc desc = model::describe(cfg);
    sdk::save_weights_hf(desc, gen::test::random_weights(desc, 77), d.string());
    fs::copy_file(fs::path(gen::test::fixtures_root()) / "tokenizer-llama3" / "tokenizer.json", d / "tokenizer.json",
                  fs::copy_options::overwrite_existing);
    const json tc = {{"bos_token", "<|begin_of_text|>"},
                     {"eos_token", "<|eot_id|>"},
                     {"chat_template",
                      "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                      "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
                      "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"}};
    std::ofstream(d / "tokenizer_config.json") << tc.dump(2);
    return d;
  }();
  return dir;
}

// ---------------------------------------------------------------------------------------------
// Through the ABI

TEST(GeneratorPlugin, GreedyEqualsEveryFixtureThroughTheAbi) {
  Host host;
  const rlh_generator_api* api = host.generator();
  int ran = 0;
  bool mla = false;
  for (const std::string& dir : gen::test::fixture_models()) {
    const std::string name = fs::path(dir).filename().string();
    std::string why;
    if (!listed_fixture(dir, &why)) {
      std::printf("skipping %s: %s\n", name.c_str(), why.c_str());
      continue;
    }
    for (const auto& l : model::describe_model_dir(dir).layers) mla = mla || l.attention.kind == sdk::AttentionKind::mla;
    const Reference ref = greedy_reference(dir);
    rlh_generator* g = nullptr;
    const std::string cfg = R"({"max_num_seqs": 1, "block_size": 4})";  // one at a time, small blocks
    sdk::check(api->create(host.services(), dir.c_str(), cfg.data(), cfg.size(), &g), name);
    GotMap out;
    ASSERT_EQ(generate(api, g, ref.prompts, greedy(int64_t(ref.expected[0].size())), out), RLH_OK);
    for (size_t b = 0; b < ref.prompts.size(); ++b) {
      EXPECT_EQ(at(out, int64_t(b), 0).ids, ref.expected[b]) << name << " prompt " << b;
      EXPECT_TRUE(at(out, int64_t(b), 0).truncated);
      EXPECT_EQ(at(out, int64_t(b), 0).version, 0);
    }
    api->destroy(g);
    ++ran;
  }
  EXPECT_GE(ran, 6) << "llama, qwen2, qwen3, the MoE fixtures and deepseek-v3 run";
  EXPECT_TRUE(mla) << "deepseek-v3-tiny (MLA) is among them";
}

TEST(GeneratorPlugin, DummyLoadThenRefitByViews) {
  Host host;
  const rlh_generator_api* api = host.generator();
  const std::string dir = gen::test::fixtures_root() + "/qwen3-tiny";
  const Reference ref = greedy_reference(dir);
  rlh_generator* g = nullptr;
  const std::string cfg = R"({"native_cfg": {"load_format": "dummy"}, "temperature": 1.0})";
  sdk::check(api->create(host.services(), dir.c_str(), cfg.data(), cfg.size(), &g));
  GotMap out;
  std::string msg;
  EXPECT_EQ(generate(api, g, ref.prompts, greedy(4), out, collect, &msg), RLH_E_FAILED_PRECONDITION);
  EXPECT_NE(msg.find("update_weights"), std::string::npos) << msg;

  // The trainer's buffers: float32 in engine layout, named by HF name.
  sdk::TransformerDesc desc = model::describe_model_dir(dir);
  const auto ckpt = sdk::st::Checkpoint::open(dir);
  sdk::LoadResult w = sdk::load_weights_f32(desc, ckpt);
  std::vector<rlh_named_tensor> views;
  std::vector<std::vector<int64_t>> shapes;
  shapes.reserve(desc.params.size());
  for (size_t i = 0; i < desc.params.size(); ++i) {
    shapes.push_back(desc.params[i].shape);
    rlh_named_tensor t{};
    t.name = desc.params[i].hf_names[0].c_str();
    t.tensor.data = w.tensors[i].data();
    t.tensor.device = rlh_device{RLH_DEVICE_CPU, 0};
    t.tensor.ndim = int32_t(shapes.back().size());
    t.tensor.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
    t.tensor.shape = shapes.back().data();
    views.push_back(t);
  }
  rlh_weight_update u{};
  u.struct_size = RLH_STRUCT_SIZE(rlh_weight_update, may_alias);
  u.version = 7;
  u.weights = views.data();
  u.num_weights = views.size();
  u.may_alias = 1;
  sdk::check(api->update_weights(g, &u));
  out.clear();
  ASSERT_EQ(generate(api, g, ref.prompts, greedy(int64_t(ref.expected[0].size())), out), RLH_OK);
  for (size_t b = 0; b < ref.prompts.size(); ++b) {
    EXPECT_EQ(at(out, int64_t(b), 0).ids, ref.expected[b]);
    EXPECT_EQ(at(out, int64_t(b), 0).version, 7);
  }
  // A failing sample callback stops generate with its code.
  auto fail = [](void*, const rlh_sample*) -> rlh_status* {
    return sdk::make_local_status(RLH_E_ABORTED, "consumer is full");
  };
  out.clear();
  EXPECT_EQ(generate(api, g, ref.prompts, greedy(3), out, fail, &msg), RLH_E_ABORTED);
  EXPECT_NE(msg.find("consumer is full"), std::string::npos) << msg;
  // Bad arguments.
  u.struct_size = 8;
  rlh_status* s = api->update_weights(g, &u);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->code, RLH_E_INVALID_ARGUMENT);
  rlh_status_destroy(s);
  api->destroy(g);

  for (const char* bad : {"[1]", "{\"kv_cache_bytes\": \"lots\"}", "{\"load_format\": \"pt\"}", "{\"nope\": 1}", "{"}) {
    rlh_generator* b = nullptr;
    rlh_status* st = api->create(host.services(), dir.c_str(), bad, std::strlen(bad), &b);
    ASSERT_NE(st, nullptr) << bad;
    EXPECT_EQ(st->code, RLH_E_INVALID_ARGUMENT) << bad << ": " << sdk::status_message(st);
    rlh_status_destroy(st);
  }
  {  // FP8 rollouts on the CPU: refused by name
    const std::string bad = R"({"native_cfg": {"device": "cpu"}, "vllm_cfg": {"precision": "fp8"}})";
    rlh_generator* b = nullptr;
    rlh_status* st = api->create(host.services(), dir.c_str(), bad.data(), bad.size(), &b);
    ASSERT_NE(st, nullptr);
    EXPECT_EQ(st->code, RLH_E_UNIMPLEMENTED);
    EXPECT_NE(sdk::status_message(st).find("vllm_cfg.precision = fp8: FP8 rollouts run on a CUDA device"),
              std::string::npos) << sdk::status_message(st);
    rlh_status_destroy(st);
  }
  // vllm_cfg.kv_cache_dtype: fp8 makes an FP8 cache (the executor says so); e5m2 and non-strings
  // are refused naming the key.
  {
    const std::string ok = R"({"vllm_cfg": {"kv_cache_dtype": "fp8"}})";  // (a section without native_cfg)
    rlh_generator* f = nullptr;
    ASSERT_EQ(api->create(host.services(), dir.c_str(), ok.data(), ok.size(), &f), nullptr);
    out.clear();
    ASSERT_EQ(generate(api, f, ref.prompts, greedy(3), out), RLH_OK);
    EXPECT_EQ(at(out, 0, 0).ids.size(), 3u);
    api->destroy(f);
    for (const std::string v : {"\"fp8_e5m2\"", "8"}) {
      const std::string bad = R"({"native_cfg": {"device": "cpu"}, "vllm_cfg": {"kv_cache_dtype": )" + v + "}}";
      rlh_generator* b = nullptr;
      rlh_status* st = api->create(host.services(), dir.c_str(), bad.data(), bad.size(), &b);
      ASSERT_NE(st, nullptr) << bad;
      EXPECT_NE(sdk::status_message(st).find("policy.generation.vllm_cfg.kv_cache_dtype"), std::string::npos)
          << sdk::status_message(st);
      rlh_status_destroy(st);
    }
  }
  // The GPU's settings on the CPU are errors naming the key, not silently ignored.
  for (const char* key : {"gpu_memory_utilization", "cuda_graphs", "kv_cache_sleep"}) {
    const std::string bad = std::string(R"({"device": "cpu", ")") + key + (key[0] == 'g' ? "\": 0.5}" : "\": true}");
    rlh_generator* b = nullptr;
    rlh_status* st = api->create(host.services(), dir.c_str(), bad.data(), bad.size(), &b);
    ASSERT_NE(st, nullptr) << bad;
    EXPECT_EQ(st->code, RLH_E_INVALID_ARGUMENT) << bad;
    EXPECT_NE(sdk::status_message(st).find(std::string("'") + key + "' applies to a CUDA device"), std::string::npos)
        << sdk::status_message(st);
    rlh_status_destroy(st);
  }
}

// The MoE router's precision through the ABI: native_cfg.moe_router_dtype, else the megatron
// backend's setting when the run's configuration enables megatron, else dtensor's Automodel
// gate_precision, else float32. Seen on a model
// whose routers tie to within float32 rounding (generator_test_util.hpp), where the two
// precisions decode differently.
TEST(GeneratorPlugin, MoeRouterDtypeFollowsTheBackendOrItsOwnKey) {
  const gen::test::TiedRouterModel m = gen::test::tied_router_moe();
  const fs::path dir = fs::temp_directory_path() / ("rlh_gen_tied_router_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << m.config_json;
  sdk::save_weights_hf(m.desc, m.weights, dir.string());
  const auto prompts = gen::test::random_prompts(4, m.desc.vocab_size, 12, {9, 20, 4});
  // The library's decodes at each precision.
  auto direct = [&](bool fp64) {
    gen::Options o = gen::test::gen_options();
    o.moe_router_fp64 = fp64;
    gen::Generator g(m.desc, o);
    g.weights().load(m.weights, 0);
    gen::Request r;
    r.sampling.temperature = 0;
    r.max_new_tokens = 16;
    gen::test::Outs outs;
    gen::test::run(g, prompts, r, 0, outs);
    std::vector<std::vector<int32_t>> ids;
    for (const auto& [k, o] : outs) ids.push_back(o.ids);
    return ids;
  };
  const auto want64 = direct(true), want32 = direct(false);
  ASSERT_NE(want64, want32) << "the tied routers were meant to decode differently at the two precisions";

  auto decode = [&](const std::string& yaml, const std::string& cfg) {
    Host host;
    if (!yaml.empty()) host.load_config(yaml);
    const rlh_generator_api* api = host.generator();
    rlh_generator* g = nullptr;
    sdk::check(api->create(host.services(), dir.c_str(), cfg.data(), cfg.size(), &g), cfg);
    GotMap out;
    EXPECT_EQ(generate(api, g, prompts, greedy(16), out), RLH_OK);
    api->destroy(g);
    std::vector<std::vector<int32_t>> ids;
    for (const auto& [k, o] : out) ids.push_back(o.ids);
    return ids;
  };
  const std::string megatron64 = "policy:\n  megatron_cfg:\n    enabled: true\n    moe_router_dtype: fp64\n";
  EXPECT_EQ(decode("", "{}"), want32) << "no backend configured: float32";
  EXPECT_EQ(decode("", R"({"moe_router_dtype": "fp64"})"), want64) << "the generator's own key";
  EXPECT_EQ(decode(megatron64, "{}"), want64) << "following megatron's moe_router_dtype";
  EXPECT_EQ(decode(megatron64, R"({"native_cfg": {}})"), want64) << "policy.generation passed whole";
  EXPECT_EQ(decode(megatron64, R"({"native_cfg": {"moe_router_dtype": "fp32"}})"), want32) << "own key wins";
  EXPECT_EQ(decode("policy:\n  megatron_cfg:\n    enabled: true\n", "{}"), want32) << "megatron's default fp32";
  EXPECT_EQ(decode("policy:\n  dtensor_cfg:\n    enabled: true\n  megatron_cfg:\n    enabled: false\n"
                   "    moe_router_dtype: fp64\n",
                   "{}"),
            want32)
      << "megatron not the backend: its setting does not apply";
  const std::string gate = "policy:\n  dtensor_cfg:\n    automodel_kwargs:\n      backend:\n        gate_precision: ";
  EXPECT_EQ(decode(gate + "float64\n", "{}"), want64) << "following dtensor's gate_precision";
  EXPECT_EQ(decode(gate + "torch.float64\n", "{}"), want64) << "dtensor's gate_precision as torch names it";
  EXPECT_EQ(decode(gate + "float32\n", "{}"), want32) << "dtensor's gate_precision float32";
  EXPECT_EQ(decode(gate + "float64\n", R"({"moe_router_dtype": "fp32"})"), want32) << "own key wins over dtensor's";
  EXPECT_EQ(decode(gate + "float64\n  megatron_cfg:\n    enabled: true\n", "{}"), want32)
      << "megatron the backend: dtensor's setting does not apply";

  // Bad values, in either place, are one-line errors naming the key.
  for (const auto& [yaml, cfg] : std::vector<std::pair<std::string, std::string>>{
           {"", R"({"moe_router_dtype": "bf16"})"},
           {"", R"({"moe_router_dtype": 64})"},
           {"policy:\n  megatron_cfg:\n    enabled: true\n    moe_router_dtype: fp16\n", "{}"},
           {"policy:\n  dtensor_cfg:\n    automodel_kwargs:\n      backend:\n        gate_precision: bfloat16\n", "{}"}}) {
    Host host;
    if (!yaml.empty()) host.load_config(yaml);
    rlh_generator* g = nullptr;
    rlh_status* st = host.generator()->create(host.services(), dir.c_str(), cfg.data(), cfg.size(), &g);
    ASSERT_NE(st, nullptr) << cfg;
    EXPECT_EQ(st->code, RLH_E_INVALID_ARGUMENT) << cfg;
    const std::string msg = sdk::status_message(st);
    EXPECT_TRUE(msg.find("moe_router_dtype") != std::string::npos || msg.find("gate_precision") != std::string::npos)
        << msg;
    rlh_status_destroy(st);
  }
  fs::remove_all(dir);
}

TEST(GeneratorPlugin, StopStringsUseTheTokenizerComponent) {
  Host host;
  const rlh_generator_api* api = host.generator();
  const std::string dir = text_model_dir().string();
  rlh_generator* g = nullptr;
  sdk::check(api->create(host.services(), dir.c_str(), nullptr, 0, &g));
  const std::vector<std::vector<int32_t>> prompts = {{44, 645, 337, 16}};
  rlh_sampling sp{};
  sp.temperature = 1.0;
  sp.top_p = 1.0;
  sp.max_new_tokens = 30;
  sp.seed = 5;
  GotMap free_run;
  ASSERT_EQ(generate(api, g, prompts, sp, free_run), RLH_OK);
  // The decoded text of the free run, and a stop string taken from its middle.
  const rlh_component_desc* td = nullptr;
  sdk::check(host.services()->find_component(host.services()->ctx, RLH_KIND_TOKENIZER, nullptr, &td));
  const auto* tapi = static_cast<const rlh_tokenizer_api*>(td->api);
  rlh_tokenizer* tok = nullptr;
  sdk::check(tapi->create(host.services(), dir.c_str(), &tok));
  auto decode = [&](const std::vector<int32_t>& ids, size_t n) {
    std::string text;
    sdk::check(tapi->decode(tok, ids.data(), n, RLH_DECODE_SKIP_SPECIAL_TOKENS, sdk::write_to_string, &text));
    return text;
  };
  const std::vector<int32_t>& ids = at(free_run, 0, 0).ids;
  const std::string text = decode(ids, ids.size());
  ASSERT_GT(text.size(), 20u);
  const std::string stop = text.substr(text.size() / 2, 3);
  size_t end = ids.size();
  for (size_t t = 1; t <= ids.size(); ++t)
    if (decode(ids, t).find(stop) != std::string::npos) {
      end = t;
      break;
    }
  const char* stops[] = {stop.c_str()};
  sp.stop_strings = stops;
  sp.num_stop_strings = 1;
  GotMap stopped;
  ASSERT_EQ(generate(api, g, prompts, sp, stopped), RLH_OK);
  EXPECT_EQ(at(stopped, 0, 0).ids, std::vector<int32_t>(ids.begin(), ids.begin() + long(end)));
  EXPECT_FALSE(at(stopped, 0, 0).truncated);
  tapi->destroy(tok);
  api->destroy(g);
}

TEST(GeneratorPlugin, CancellationStopsGenerate) {
  Host host;
  const rlh_generator_api* api = host.generator();
  const std::string dir = gen::test::fixtures_root() + "/llama-tiny";
  rlh_generator* g = nullptr;
  sdk::check(api->create(host.services(), dir.c_str(), "{}", 2, &g));
  rlhost_cancel(host.h);
  GotMap out;
  EXPECT_EQ(generate(api, g, {{1, 2, 3}}, greedy(5), out), RLH_E_CANCELLED);
  EXPECT_TRUE(out.empty());
  api->destroy(g);
}

// ---------------------------------------------------------------------------------------------
// rlhost generate

struct CliRun {
  int code = -1;
  std::string out, err;
};

CliRun rlhost(const std::string& args) {
  static int n = 0;
  const fs::path err = fs::temp_directory_path() / ("rlh_gen_err_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
  const std::string cmd = std::string(RLHOST_EXE) + " generate " + args + " 2>" + err.string();
  CliRun r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf{};
  size_t got;
  while ((got = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), got);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(err);
  r.err.assign(std::istreambuf_iterator<char>(in), {});
  fs::remove(err);
  return r;
}

std::vector<json> json_lines(const std::string& out) {
  std::vector<json> v;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) v.push_back(json::parse(line));
  return v;
}

TEST(GenerateCli, GreedyJsonEqualsTheFixture) {
  const std::string dir = gen::test::fixtures_root() + "/qwen2-swa-yarn-tiny";
  const Reference ref = greedy_reference(dir);
  std::string args = "--model " + dir + " --temperature 0 --ignore-eos --json --max-new-tokens " +
                     std::to_string(ref.expected[0].size());
  for (const auto& p : ref.prompts) {
    args += " --prompt-ids ";
    for (size_t i = 0; i < p.size(); ++i) args += (i ? "," : "") + std::to_string(p[i]);
  }
  const CliRun r = rlhost(args);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto lines = json_lines(r.out);
  ASSERT_EQ(lines.size(), ref.prompts.size());
  for (size_t b = 0; b < lines.size(); ++b) {
    std::vector<int32_t> want = ref.prompts[b];
    want.insert(want.end(), ref.expected[b].begin(), ref.expected[b].end());
    EXPECT_EQ(lines[b]["ids"].get<std::vector<int32_t>>(), want);
    const auto lps = lines[b]["logprobs"].get<std::vector<float>>();
    ASSERT_EQ(lps.size(), want.size());
    for (size_t t = 0; t < lps.size(); ++t) {
      if (t < ref.prompts[b].size()) EXPECT_EQ(lps[t], 0.f);  // the prompt's entries
      else EXPECT_LT(lps[t], 0.f);
    }
    EXPECT_EQ(lines[b]["num_prompt_tokens"].get<size_t>(), ref.prompts[b].size());
    EXPECT_TRUE(lines[b]["truncated"].get<bool>());
  }
}

TEST(GenerateCli, TextChatStopsAndSamples) {
  const std::string dir = text_model_dir().string();
  // Text in, text out; n samples; the same seed gives the same samples, another seed others.
  CliRun a = rlhost("--model " + dir + " --prompt 'Hello, world!' --n 3 --seed 4 --max-new-tokens 12 --json");
  ASSERT_EQ(a.code, 0) << a.err;
  auto la = json_lines(a.out);
  ASSERT_EQ(la.size(), 3u);
  EXPECT_EQ(la[0]["num_prompt_tokens"].get<int>(), 9);  // the fixture's ids of this text
  EXPECT_TRUE(la[0].contains("text"));
  CliRun b = rlhost("--model " + dir + " --prompt 'Hello, world!' --n 3 --seed 4 --max-new-tokens 12 --json");
  EXPECT_EQ(a.out, b.out);
  CliRun c = rlhost("--model " + dir + " --prompt 'Hello, world!' --n 3 --seed 5 --max-new-tokens 12 --json");
  EXPECT_NE(a.out, c.out);
  // EOS (generation_config: 1, 2) stops a sample unless --ignore-eos: never beyond the first.
  for (const auto& l : la) {
    const auto ids = l["ids"].get<std::vector<int32_t>>();
    for (size_t t = 9; t + 1 < ids.size(); ++t) EXPECT_TRUE(ids[t] != 1 && ids[t] != 2);
  }
  // --chat renders the template: BOS, headers, the message, the assistant header.
  CliRun chat = rlhost("--model " + dir + " --prompt 'Hi' --chat --temperature 0 --max-new-tokens 3 --json");
  ASSERT_EQ(chat.code, 0) << chat.err;
  const auto ids = json_lines(chat.out)[0]["ids"].get<std::vector<int32_t>>();
  ASSERT_GT(ids.size(), 6u);
  EXPECT_EQ(ids[0], 0);  // <|begin_of_text|>
  EXPECT_EQ(ids[1], 3);  // <|start_header_id|>
  EXPECT_NE(std::find(ids.begin(), ids.end(), 2), ids.end());  // <|eot_id|> after the user turn
  // Plain output is the decoded text.
  CliRun plain = rlhost("--model " + dir + " --prompt 'Hello' --temperature 0 --max-new-tokens 5");
  ASSERT_EQ(plain.code, 0) << plain.err;
  EXPECT_FALSE(plain.out.empty());
  // --stop cuts at the first occurrence of a string taken from the free run's text.
  CliRun free_run = rlhost("--model " + dir + " --prompt 'Hello' --temperature 0 --ignore-eos --max-new-tokens 40 --json");
  const std::string text = json_lines(free_run.out)[0]["text"];
  ASSERT_GT(text.size(), 10u);
  const std::string stop = text.substr(text.size() / 2, 2);
  CliRun stopped = rlhost("--model " + dir + " --prompt 'Hello' --temperature 0 --ignore-eos --max-new-tokens 40 --json --stop '" +
                       stop + "'");
  ASSERT_EQ(stopped.code, 0) << stopped.err;
  const std::string stext = json_lines(stopped.out)[0]["text"];
  EXPECT_LT(stext.size(), text.size());
  EXPECT_NE(stext.find(stop), std::string::npos);
  EXPECT_EQ(stext.find(stop) + stop.size() + 4 > stext.size(), true) << "stops soon after the match";
  EXPECT_FALSE(json_lines(stopped.out)[0]["truncated"].get<bool>());
}

TEST(GenerateCli, BadInputsAreOneLineErrors) {
  const std::string fx = gen::test::fixtures_root() + "/llama-tiny";
  const std::string text = text_model_dir().string();
  struct Case {
    std::string args, needle;
  };
  const Case cases[] = {
      {"--prompt-ids 1,2", "--model is required"},
      {"--model " + fx, "--prompt or --prompt-ids"},
      {"--model " + fx + " --prompt-ids 1,x", "'x' is not a token id"},
      {"--model " + fx + " --prompt-ids 1,99999", "outside the vocabulary"},
      {"--model " + fx + " --prompt-ids 1 --top-p 1.5", "top_p"},
      {"--model " + fx + " --prompt-ids 1 --temperature -1", "temperature"},
      {"--model " + fx + " --prompt-ids 1 --n 0", "--n"},
      {"--model " + fx + " --prompt-ids 1 --max-new-tokens 0", "max_new_tokens"},
      {"--model " + fx + " --prompt hello", "tokenizer"},
      {"--model " + fx + " --prompt-ids 1 --stop x", "tokenizer"},
      {"--model " + fx + " --prompt-ids 1 --generator-config '{\"bogus\": 1}'", "unknown key 'bogus'"},
      {"--model " + fx + " --prompt-ids 1 --generator-config 'nope'", "--generator-config"},
      {"--model /nonexistent/model --prompt-ids 1", "/nonexistent/model"},
      {"--model " + fx + " --prompt-ids 1 --generator-config '{\"moe_router_dtype\": \"fp16\"}'", "moe_router_dtype"},
      {"--model " + text + " --prompt-ids 1 --chat", "--chat"},
      {"--model " + fx + " --prompt-ids 1 --frobnicate", "frobnicate"},
  };
  for (const Case& c : cases) {
    const CliRun r = rlhost(c.args);
    EXPECT_NE(r.code, 0) << c.args;
    std::string e = r.err;
    while (!e.empty() && e.back() == '\n') e.pop_back();
    EXPECT_EQ(e.find('\n'), std::string::npos) << "more than one line for " << c.args << ":\n" << r.err;
    EXPECT_NE(e.find("error"), std::string::npos) << c.args << ": " << r.err;
    EXPECT_NE(e.find(c.needle), std::string::npos) << c.args << ": wanted '" << c.needle << "' in " << r.err;
  }
}

}  // namespace
