// describe(): every fixture config (globbed) against its own checkpoint, hand-written configs of
// each family member against what HF transformers built from them (configs/*.hf.json), and the
// refusals.
#include <gtest/gtest.h>

#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "model_test_util.hpp"
#include "rlhost/model/llama_family.hpp"

using namespace rlh;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

json load_json(const fs::path& p) {
  std::ifstream in(p);
  EXPECT_TRUE(in.good()) << p;
  return json::parse(in);
}

// HF name -> shape for every tensor the parameter table reads.
std::map<std::string, std::vector<int64_t>> hf_tensors_of(const sdk::TransformerDesc& d) {
  std::map<std::string, std::vector<int64_t>> out;
  for (const auto& p : d.params)
    for (size_t k = 0; k < p.hf_names.size(); ++k) {
      EXPECT_TRUE(out.emplace(p.hf_names[k], p.hf_shapes[k]).second) << "twice: " << p.hf_names[k];
    }
  return out;
}

std::vector<fs::path> hand_written_configs() {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(RLH_MODEL_TEST_CONFIGS)) {
    const auto name = e.path().filename().string();
    if (name.ends_with(".json") && !name.ends_with(".hf.json") && name != "rope_golden.json") out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  }
}

json base_llama() {
  return json::parse(R"({"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":32,"hidden_size":16,
    "intermediate_size":24,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2})");
}

}  // namespace

TEST(DescribeConfig, EveryFixtureMatchesItsCheckpoint) {
  int described = 0;
  for (const auto& dir : test::model_fixture_dirs()) {
    const json cfg = load_json(dir / "config.json");
    const std::string arch = cfg.at("architectures").at(0).get<std::string>();
    if (!model::is_supported_architecture(arch)) {
      expect_error([&] { model::describe(cfg); }, {arch});
      continue;
    }
    const auto d = model::describe_model_dir(dir.string());
    EXPECT_EQ(d.architecture, arch);
    EXPECT_EQ(static_cast<int64_t>(d.layers.size()), cfg.at("num_hidden_layers").get<int64_t>());
    const sdk::st::File f = sdk::st::File::open((dir / "model.safetensors").string());
    std::map<std::string, std::vector<int64_t>> in_file;
    for (const auto& t : f.tensors()) in_file[t.name] = t.shape;
    EXPECT_EQ(hf_tensors_of(d), in_file) << dir;
    ++described;
  }
  EXPECT_GT(described, 0);
}

TEST(DescribeConfig, FixtureFacts) {
  // Facts the fixture README states, checked where the fixture exists.
  const fs::path fx = test::fixtures_dir();
  if (fs::exists(fx / "llama-tiny/config.json")) {
    const auto d = model::describe_model_dir((fx / "llama-tiny").string());
    EXPECT_EQ(d.rope.kind, sdk::RopeKind::llama3);
    EXPECT_EQ(d.layers[0].attention.num_kv_heads, 2);
    EXPECT_EQ(d.layers[0].attention.head_dim, 16);
    EXPECT_FALSE(d.tie_word_embeddings);
  }
  if (fs::exists(fx / "qwen3-tiny/config.json")) {
    const auto d = model::describe_model_dir((fx / "qwen3-tiny").string());
    EXPECT_TRUE(d.layers[0].attention.qk_norm);
    EXPECT_EQ(d.layers[0].attention.head_dim, 32);
    EXPECT_TRUE(d.tie_word_embeddings);
    EXPECT_EQ(d.find_param(-1, sdk::ParamRole::lm_head), nullptr);
  }
  if (fs::exists(fx / "qwen2-swa-yarn-tiny/config.json")) {
    const auto d = model::describe_model_dir((fx / "qwen2-swa-yarn-tiny").string());
    EXPECT_EQ(d.rope.kind, sdk::RopeKind::yarn);
    EXPECT_EQ(d.rope.original_max_position_embeddings, 16);
    EXPECT_EQ(d.layers[0].attention.sliding_window, 0);
    EXPECT_EQ(d.layers[1].attention.sliding_window, 12);
    EXPECT_TRUE(d.layers[1].attention.q_bias && d.layers[1].attention.v_bias && !d.layers[1].attention.o_bias);
  }
  if (fs::exists(fx / "deepseek-v3-tiny/config.json")) {
    const auto d = model::describe_model_dir((fx / "deepseek-v3-tiny").string());
    EXPECT_EQ(d.layers[0].mlp.kind, sdk::MlpKind::dense);
    EXPECT_EQ(d.layers[1].mlp.kind, sdk::MlpKind::moe);
    EXPECT_EQ(d.layers[1].mlp.moe.scoring, sdk::MoeScoring::sigmoid);
    EXPECT_EQ(d.layers[1].attention.kind, sdk::AttentionKind::mla);
    EXPECT_EQ(d.rope.layout, sdk::RopeLayout::interleaved);
    EXPECT_EQ(d.rope.rotary_dim, 8);
    const auto* bias = d.find_param(1, sdk::ParamRole::expert_score_bias);
    ASSERT_NE(bias, nullptr);
    EXPECT_FALSE(bias->trainable);
  }
}

TEST(DescribeConfig, HandWrittenConfigsMatchHuggingFace) {
  int n = 0;
  for (const auto& path : hand_written_configs()) {
    SCOPED_TRACE(path.filename().string());
    fs::path hf_path = path;
    hf_path.replace_extension(".hf.json");
    ASSERT_TRUE(fs::exists(hf_path));
    const json hf = load_json(hf_path);
    const auto d = model::describe(load_json(path));
    // Tensors: names and shapes exactly as save_pretrained writes them.
    std::map<std::string, std::vector<int64_t>> want;
    for (const auto& [k, v] : hf.at("tensors").items()) want[k] = v.get<std::vector<int64_t>>();
    EXPECT_EQ(hf_tensors_of(d), want);
    // RoPE.
    const auto f = sdk::rope_inv_freq(d.rope, d.rope.rotary_dim);
    const auto hf_f = hf.at("inv_freq").get<std::vector<double>>();
    ASSERT_EQ(f.size(), hf_f.size());
    for (size_t i = 0; i < f.size(); ++i) EXPECT_NEAR(f[i], hf_f[i], 1e-6 * hf_f[i]) << i;
    EXPECT_NEAR(sdk::rope_attention_scaling(d.rope), hf.at("attention_scaling").get<double>(), 1e-9);
    // Attention per layer.
    const auto windows = hf.at("sliding_window").get<std::vector<int64_t>>();
    ASSERT_EQ(windows.size(), d.layers.size());
    for (size_t i = 0; i < windows.size(); ++i) EXPECT_EQ(d.layers[i].attention.sliding_window, windows[i]) << i;
    EXPECT_NEAR(d.layers[0].attention.softmax_scale, hf.at("softmax_scale").get<double>(), 1e-12);
    ++n;
  }
  EXPECT_GE(n, 8);
}

TEST(DescribeConfig, HandWrittenConfigFacts) {
  const fs::path dir = RLH_MODEL_TEST_CONFIGS;
  auto d = [&](const char* name) { return model::describe(load_json(dir / (std::string(name) + ".json"))); };
  {
    const auto m = d("llama31_legacy_llama3_scaling");
    EXPECT_EQ(m.eos_token_ids, (std::vector<int64_t>{128001, 128008, 128009}));
    EXPECT_EQ(m.torch_dtype, sdk::st::DType::BF16);
    EXPECT_EQ(m.params[0].dtype, sdk::st::DType::BF16);
    EXPECT_EQ(m.rope.kind, sdk::RopeKind::llama3);
    EXPECT_EQ(m.rope.theta, 500000.0);
  }
  {
    const auto m = d("llama_linear_type_key_bias_tied");
    EXPECT_EQ(m.rope.kind, sdk::RopeKind::linear);  // legacy "type" key
    EXPECT_EQ(m.rope.factor, 2.0);
    EXPECT_TRUE(m.tie_word_embeddings);
    EXPECT_TRUE(m.layers[0].attention.o_bias);
    EXPECT_TRUE(m.layers[0].mlp.bias);
    EXPECT_EQ(m.torch_dtype, sdk::st::DType::F16);
  }
  {
    const auto m = d("qwen3_default_head_dim");
    EXPECT_EQ(m.layers[0].attention.head_dim, 128);  // Qwen3Config default, not hidden/heads
  }
  {
    const auto m = d("qwen2_moe_shared");
    EXPECT_EQ(m.layers[1].mlp.kind, sdk::MlpKind::dense);  // mlp_only_layers
    EXPECT_EQ(m.layers[0].mlp.kind, sdk::MlpKind::moe);
    EXPECT_TRUE(m.layers[0].mlp.moe.shared_expert_gate);
    EXPECT_EQ(m.layers[0].mlp.moe.shared_expert_intermediate_size, 40);
    const auto* up = m.find_param(0, sdk::ParamRole::expert_up);
    ASSERT_NE(up, nullptr);
    EXPECT_EQ(up->transform, sdk::ParamTransform::stack);
    EXPECT_EQ(up->shape, (std::vector<int64_t>{4, 24, 64}));
    EXPECT_EQ(up->name, "model.layers.0.mlp.experts.up_proj.weight");
  }
  {
    const auto m = d("qwen3_moe_sparse_step");
    EXPECT_EQ(m.layers[0].mlp.kind, sdk::MlpKind::dense);
    EXPECT_EQ(m.layers[1].mlp.kind, sdk::MlpKind::moe);
    EXPECT_TRUE(m.layers[1].mlp.moe.norm_topk_prob);
  }
  {
    const auto m = d("mixtral_moe");
    EXPECT_TRUE(m.layers[0].mlp.moe.norm_topk_prob);
    EXPECT_EQ(m.layers[0].mlp.moe.expert_intermediate_size, 80);
  }
  {
    const auto m = d("deepseek_v3_yarn_mla");
    EXPECT_EQ(m.layers[1].mlp.moe.shared_expert_intermediate_size, 32);  // 2 x 16
    EXPECT_EQ(m.layers[1].mlp.moe.n_group, 2);
    EXPECT_EQ(m.layers[1].mlp.moe.routed_scaling_factor, 2.5);
  }
}

TEST(DescribeConfig, BothRopeLayoutsDescribeTheSameModel) {
  json legacy = base_llama();
  legacy["rope_theta"] = 500000.0;
  legacy["rope_scaling"] = {{"type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                            {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 64}};
  json modern = base_llama();
  modern["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 8.0},
                               {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                               {"original_max_position_embeddings", 64}};
  EXPECT_EQ(json(model::describe(legacy)), json(model::describe(modern)));
  // And a config without any RoPE keys gets the default kind and the architecture's theta.
  const auto plain = model::describe(base_llama());
  EXPECT_EQ(plain.rope.kind, sdk::RopeKind::default_);
  EXPECT_EQ(plain.rope.theta, 10000.0);
}

TEST(DescribeConfig, UnlistedArchitectureIsRefusedByName) {
  json cfg = base_llama();
  cfg["architectures"] = {"GPT2LMHeadModel"};
  expect_error([&] { model::describe(cfg); }, {"GPT2LMHeadModel", "not supported", "LlamaForCausalLM"});
  cfg["architectures"] = json::array();
  expect_error([&] { model::describe(cfg); }, {"architectures"});
  // Without "architectures", model_type picks the row.
  cfg.erase("architectures");
  EXPECT_EQ(model::describe(cfg).architecture, "LlamaForCausalLM");
  cfg["model_type"] = "gpt2";
  expect_error([&] { model::describe(cfg); }, {"model_type gpt2", "not supported"});
  expect_error([&] { model::describe(json::array()); }, {"object"});
}

TEST(DescribeConfig, BadValuesNameTheKey) {
  auto with = [](const char* key, json v) {
    json c = base_llama();
    if (v.is_discarded()) c.erase(key); else c[key] = v;
    return c;
  };
  expect_error([&] { model::describe(with("hidden_size", json::value_t::discarded)); }, {"missing required key 'hidden_size'"});
  expect_error([&] { model::describe(with("num_key_value_heads", 3)); }, {"num_attention_heads", "num_key_value_heads"});
  expect_error([&] { model::describe(with("num_hidden_layers", "two")); }, {"'num_hidden_layers' must be an integer"});
  expect_error([&] { model::describe(with("vocab_size", -5)); }, {"vocab_size"});
  expect_error([&] { model::describe(with("rms_norm_eps", 0)); }, {"rms_norm_eps"});
  expect_error([&] { model::describe(with("torch_dtype", "int4")); }, {"torch_dtype", "int4"});
  expect_error([&] { model::describe(with("rope_scaling", json{{"rope_type", "mystery"}})); }, {"mystery"});
  expect_error([&] { model::describe(with("rope_scaling", json{{"rope_type", "llama3"}, {"factor", 8}})); },
               {"low_freq_factor", "llama3"});
  expect_error([&] { model::describe(with("rope_scaling", json{{"type", "linear"}})); }, {"factor", "linear"});
  expect_error([&] {
    model::describe(with("rope_parameters", json{{"full_attention", {{"rope_type", "default"}}}}));
  }, {"per-layer"});
  json q = base_llama();
  q["architectures"] = {"Qwen2ForCausalLM"};
  q["use_sliding_window"] = true;
  q["layer_types"] = {"full_attention", "local"};
  expect_error([&] { model::describe(q); }, {"layer_types[1]"});
  q["layer_types"] = {"full_attention"};
  expect_error([&] { model::describe(q); }, {"layer_types"});
  json m = base_llama();
  m["architectures"] = {"Qwen3MoeForCausalLM"};
  m["num_experts"] = 4;
  m["num_experts_per_tok"] = 9;
  expect_error([&] { model::describe(m); }, {"num_experts_per_tok"});
  m["num_experts_per_tok"] = 2;
  m["decoder_sparse_step"] = 0;
  expect_error([&] { model::describe(m); }, {"decoder_sparse_step"});
}

// DeepSeek-V3's FP8 checkpoint (quantization_config fp8, 128x128 weight_scale_inv blocks) and
// other quantized ones are refused by name, never loaded as if their weights were plain floats.
TEST(DescribeConfig, QuantizedCheckpointsAreRefusedByName) {
  json cfg = base_llama();
  cfg["quantization_config"] = {{"activation_scheme", "dynamic"}, {"fmt", "e4m3"}, {"quant_method", "fp8"},
                                {"weight_block_size", {128, 128}}};
  expect_error([&] { model::describe(cfg); },
               {"quantization_config", "quant_method 'fp8'", "weight_block_size [128,128]", "weight_scale_inv"});
  cfg["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 4}};
  expect_error([&] { model::describe(cfg); }, {"quantization_config", "quant_method 'gptq'"});
  cfg["quantization_config"] = nullptr;  // null: not quantized
  EXPECT_EQ(model::describe(cfg).architecture, "LlamaForCausalLM");
}

TEST(DescribeConfig, StrictJsonTextAndHugeTables) {
  expect_error([] { model::describe_json_text(R"({"a":1,"a":2})", "cfg.json"); }, {"cfg.json", "duplicate key 'a'"});
  expect_error([] { model::describe_json_text(std::string(200, '[') , "cfg.json"); }, {"cfg.json", "nested"});
  json m = base_llama();
  m["architectures"] = {"MixtralForCausalLM"};
  m["num_hidden_layers"] = 4096;
  m["num_local_experts"] = 60000;
  expect_error([&] { model::describe(m); }, {"too many tensors"});
}
