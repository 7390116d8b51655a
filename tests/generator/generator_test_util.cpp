// Helpers of the generator tests (see generator_test_util.hpp).
#include "generator_test_util.hpp"

#include "kernels_cpu_abi.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>

#include <nlohmann/json.hpp>

#include "rlhost/model/llama_family.hpp"

namespace fs = std::filesystem;

namespace rlh::gen::test {

Options gen_options(int num_threads) {
  Options o;
  if (num_threads <= 0) {
    o.ops = &rlh::test::cpu_ops();
    return o;
  }
  // kernels_cpu instances with their own decode threads, one per count, kept for the process
  // (the map too is never destroyed, so what it holds stays reachable at exit for LeakSanitizer)
  static auto* by_threads = new std::map<int, rlh::test::KernelsCpuThroughAbi*>;
  rlh::test::KernelsCpuThroughAbi*& k = (*by_threads)[num_threads];
  if (!k) {
    const std::string cfg = "{\"num_threads\": " + std::to_string(num_threads) + "}";
    k = new rlh::test::KernelsCpuThroughAbi({}, cfg.c_str());
  }
  o.ops = &k->ops();
  return o;
}


std::string fixtures_root() {
  const char* env = std::getenv("RLHOST_FIXTURES");
  return env && *env ? env : RLH_FIXTURES_DIR;
}

std::string fixture_test_name(const std::string& dir) {
  std::string n = std::filesystem::path(dir).filename().string();
  for (char& c : n)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return n;
}

std::vector<std::string> fixture_models() {
  std::vector<std::string> out;
  for (const std::string& root : {fixtures_root(), std::string(RLH_ENGINE_FIXTURES_DIR)}) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(root, ec))
      if (e.is_directory() && fs::exists(e.path() / "config.json") && fs::exists(e.path() / "reference.safetensors"))
        out.push_back(e.path().string());
  }
  std::stable_sort(out.begin(), out.end(), [](const std::string& a, const std::string& b) {
    return fs::path(a).filename() < fs::path(b).filename();
  });
  // $RLHOST_FIXTURES may already hold the engine's fixtures (scripts/device_gpu.sh links both
  // folders into one): a model is listed once, from the first root that has it.
  out.erase(std::unique(out.begin(), out.end(),
                        [](const std::string& a, const std::string& b) {
                          return fs::path(a).filename() == fs::path(b).filename();
                        }),
            out.end());
  return out;
}

sdk::TransformerDesc llama_desc(int64_t vocab, int64_t hidden, int64_t layers, int64_t heads, int64_t kv_heads,
                                int64_t head_dim, int64_t ffn, const std::string& extra_json) {
  nlohmann::json cfg = {{"architectures", {"LlamaForCausalLM"}},
                        {"model_type", "llama"},
                        {"vocab_size", vocab},
                        {"hidden_size", hidden},
                        {"num_hidden_layers", layers},
                        {"num_attention_heads", heads},
                        {"num_key_value_heads", kv_heads},
                        {"head_dim", head_dim},
                        {"intermediate_size", ffn},
                        {"max_position_embeddings", 4096},
                        {"rms_norm_eps", 1e-5},
                        {"rope_theta", 10000.0},
                        {"tie_word_embeddings", false},
                        {"torch_dtype", "float32"}};
  cfg.update(nlohmann::json::parse(extra_json));
  return model::describe(cfg);
}

sdk::TransformerDesc deepseek_desc(const std::string& extra_json) {
  nlohmann::json cfg = {{"architectures", {"DeepseekV3ForCausalLM"}},
                        {"model_type", "deepseek_v3"},
                        {"vocab_size", 384},
                        {"hidden_size", 64},
                        {"intermediate_size", 96},
                        {"moe_intermediate_size", 32},
                        {"num_hidden_layers", 3},
                        {"first_k_dense_replace", 1},
                        {"num_attention_heads", 4},
                        {"num_key_value_heads", 4},
                        {"q_lora_rank", 24},
                        {"kv_lora_rank", 16},
                        {"qk_nope_head_dim", 16},
                        {"qk_rope_head_dim", 8},
                        {"v_head_dim", 12},
                        {"n_routed_experts", 8},
                        {"num_experts_per_tok", 2},
                        {"n_group", 4},
                        {"topk_group", 2},
                        {"n_shared_experts", 1},
                        {"norm_topk_prob", true},
                        {"routed_scaling_factor", 2.5},
                        {"rope_interleave", true},
                        {"max_position_embeddings", 4096},
                        {"rope_theta", 10000.0},
                        {"rope_scaling",
                         {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 1024},
                          {"beta_fast", 32}, {"beta_slow", 1}, {"mscale", 1.0}, {"mscale_all_dim", 0.8}}},
                        {"rms_norm_eps", 1e-6},
                        {"tie_word_embeddings", false},
                        {"torch_dtype", "float32"}};
  cfg.update(nlohmann::json::parse(extra_json));
  return model::describe(cfg);
}

std::vector<std::vector<int32_t>> random_prompts(int64_t n, int64_t vocab, uint64_t seed, std::vector<int64_t> lens) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> out;
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int32_t> p(static_cast<size_t>(lens[size_t(i) % lens.size()]));
    for (int32_t& t : p) t = int32_t(rng() % uint64_t(vocab));
    out.push_back(p);
  }
  return out;
}

TiedRouterModel tied_router_moe() {
  TiedRouterModel m;
  nlohmann::json cfg = {{"architectures", {"MixtralForCausalLM"}},
                        {"model_type", "mixtral"},
                        {"vocab_size", 384},
                        {"hidden_size", 64},
                        {"num_hidden_layers", 2},
                        {"num_attention_heads", 4},
                        {"num_key_value_heads", 2},
                        {"head_dim", 16},
                        {"intermediate_size", 96},
                        {"num_local_experts", 4},
                        {"num_experts_per_tok", 1},
                        {"max_position_embeddings", 4096},
                        {"rms_norm_eps", 1e-5},
                        {"rope_theta", 1000.0},
                        {"tie_word_embeddings", false},
                        {"torch_dtype", "float32"}};
  m.config_json = cfg.dump(2);
  m.desc = model::describe(cfg);
  // Experts large enough that which one a token takes shows in its logprobs.
  m.weights = random_weights(m.desc, 21, 0.2f);
  for (size_t i = 0; i < m.desc.params.size(); ++i) {
    if (m.desc.params[i].role != sdk::ParamRole::router) continue;
    std::vector<float>& w = m.weights[i];  // [4, C]
    const size_t C = w.size() / 4;
    for (size_t c = 0; c < C; ++c) {
      const float r0 = w[c] * 2.5f;  // logits of a few units: one or two experts carry the softmax
      w[c] = r0;
      w[C + c] = std::nextafter(r0, INFINITY);
      w[2 * C + c] = -r0;
      w[3 * C + c] = std::nextafter(-r0, -INFINITY);
    }
  }
  return m;
}

Model qwen_like() {
  Model m;
  m.desc = llama_desc(384, 64, 3, 4, 2, 16, 96,
                      R"({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": true,
                          "use_sliding_window": true, "sliding_window": 9, "max_window_layers": 1,
                          "tie_word_embeddings": true, "rope_theta": 1000.0})");
  m.weights = random_weights(m.desc, 11);
  return m;
}

Model moe_like() {
  Model m;
  m.desc = llama_desc(384, 64, 3, 4, 2, 16, 96,
                      R"({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "num_experts": 6,
                          "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                          "shared_expert_intermediate_size": 80, "decoder_sparse_step": 2, "norm_topk_prob": false,
                          "mlp_only_layers": [], "rope_theta": 1000.0})");
  m.weights = random_weights(m.desc, 12);
  return m;
}

Model mla_like() {
  Model m;
  m.desc = deepseek_desc();
  m.weights = random_weights(m.desc, 13);
  return m;
}

Model gemma_like() {
  Model m;
  m.desc = llama_desc(384, 64, 3, 4, 2, 16, 96,
                      R"({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                          "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                          "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "sliding_window": 7,
                          "sliding_window_pattern": 2, "query_pre_attn_scalar": 24, "rms_norm_eps": 1e-6})");
  m.weights = random_weights(m.desc, 14);
  return m;
}

// Gemma-2: Gemma-3's layout without q/k norms, with soft-capped attention scores and logits;
// caps small enough that tanh bends this random model's scores and logits.
Model gemma2_like() {
  Model m;
  m.desc = llama_desc(384, 64, 3, 4, 2, 16, 96,
                      R"({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                          "rope_theta": 10000.0, "sliding_window": 7, "query_pre_attn_scalar": 16,
                          "attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0, "rms_norm_eps": 1e-6})");
  m.weights = random_weights(m.desc, 15);
  return m;
}

std::string CharDetok::decode(std::span<const int32_t> ids) const {
  std::string s;
  for (int32_t t : ids)
    if (t != 0) s += char('a' + t % 26);
  return s;
}

void expect_same(const Outs& a, const Outs& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [key, o] : a) {
    auto it = b.find(key);
    ASSERT_NE(it, b.end()) << what;
    EXPECT_EQ(o.ids, it->second.ids) << what << ": prompt " << key.first << " sample " << key.second;
    // Bitwise: the same floats, not merely close ones.
    ASSERT_EQ(o.logprobs.size(), it->second.logprobs.size());
    EXPECT_EQ(0, std::memcmp(o.logprobs.data(), it->second.logprobs.data(), o.logprobs.size() * sizeof(float)))
        << what << ": prompt " << key.first << " sample " << key.second;
    EXPECT_EQ(o.truncated, it->second.truncated) << what;
  }
}

std::vector<std::vector<float>> random_weights(const sdk::TransformerDesc& desc, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<std::vector<float>> out;
  for (const sdk::ParamDesc& p : desc.params) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    std::vector<float> t(static_cast<size_t>(n));
    const bool norm = p.role == sdk::ParamRole::attn_norm || p.role == sdk::ParamRole::mlp_norm ||
                      p.role == sdk::ParamRole::final_norm || p.role == sdk::ParamRole::q_norm ||
                      p.role == sdk::ParamRole::k_norm || p.role == sdk::ParamRole::q_a_norm ||
                      p.role == sdk::ParamRole::kv_a_norm;
    for (float& x : t) x = norm ? 1.f + 0.1f * nd(rng) : scale * nd(rng);
    // Embeddings larger, so logits have some spread and samples some structure.
    if (p.role == sdk::ParamRole::embed || p.role == sdk::ParamRole::lm_head)
      for (float& x : t) x *= 3.f;
    out.push_back(std::move(t));
  }
  return out;
}

Stats run(Generator& g, const std::vector<std::vector<int32_t>>& prompts, Request base, int64_t first, Outs& outs) {
  std::vector<int32_t> ids;
  std::vector<int64_t> off = {0};
  for (const auto& p : prompts) {
    ids.insert(ids.end(), p.begin(), p.end());
    off.push_back(int64_t(ids.size()));
  }
  base.prompt_ids = ids;
  base.prompt_offsets = off;
  base.first_prompt_index = first;
  return g.generate(base, [&](const Sample& s) {
    Out o;
    o.ids.assign(s.ids.begin(), s.ids.end());
    o.logprobs.assign(s.logprobs.begin(), s.logprobs.end());
    o.truncated = s.truncated;
    o.weight_version = s.weight_version;
    outs[{first + s.prompt_index, s.sample_index}] = std::move(o);
  });
}

Mismatch trainer_mismatch(engine::Engine& eng, const std::vector<std::vector<int32_t>>& prompts, int64_t first,
                          const Outs& outs, const SamplingParams& sp) {
  std::vector<int32_t> ids, cu = {0};
  std::vector<std::pair<int64_t, const Out*>> seqs;  // (start of the new tokens, sample)
  for (const auto& [key, o] : outs) {
    const auto& p = prompts.at(size_t(key.first - first));
    ids.insert(ids.end(), p.begin(), p.end());
    seqs.push_back({int64_t(ids.size()), &o});
    ids.insert(ids.end(), o.ids.begin(), o.ids.end());
    cu.push_back(int32_t(ids.size()));
  }
  engine::MicroBatch mb;
  mb.input_ids = ids;
  mb.cu_seqlens = cu;
  engine::OutputRequest req;
  req.logprob = false;
  req.processed_logprob = true;
  // Greedy: vLLM reports the unfiltered logprobs at temperature 1.
  req.temperature = sp.greedy() ? 1.0 : sp.temperature;
  req.top_k = sp.greedy() ? 0 : std::max<int64_t>(0, sp.top_k);
  req.top_p = sp.greedy() ? 1.0 : sp.top_p;
  const engine::Outputs out = eng.forward(mb, req);
  Mismatch m;
  double sum_abs = 0, sum_mult = 0;
  for (const auto& [start, o] : seqs)
    for (size_t t = 0; t < o->ids.size(); ++t) {
      const double d = std::fabs(double(o->logprobs[t]) - double(out.processed_logprob[size_t(start) + t]));
      sum_abs += d;
      sum_mult += std::exp(d);
      m.max_abs = std::max(m.max_abs, d);
      ++m.tokens;
    }
  if (m.tokens) {
    m.mean_abs = sum_abs / double(m.tokens);
    m.token_mult_prob_error = sum_mult / double(m.tokens);
  }
  return m;
}

}  // namespace rlh::gen::test
