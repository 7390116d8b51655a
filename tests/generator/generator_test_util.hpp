// Shared helpers of the generator tests: fixture folders, random models of given shapes, the
// trainer-side logprobs of generated sequences (the engine's forward), and collecting samples.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "rlhost/engine/engine.hpp"
#include "rlhost/generator/generator.hpp"
#include "rlhost/sdk/model_desc.hpp"

namespace rlh::gen::test {

// Generator options on the reference kernels through the C ABI (tests/common/kernels_cpu_abi.hpp);
// num_threads > 0: a kernels_cpu instance with that many decode threads.
Options gen_options(int num_threads = 0);

// $RLHOST_FIXTURES, else the fixtures folder next to the source tree.
std::string fixtures_root();
// Model folders (config.json + reference.safetensors) under it and under the engine's in-tree
// fixtures (tests/engine/fixtures: more MoE configurations), as full paths, sorted by name.
std::vector<std::string> fixture_models();
// A fixture folder's name as a gtest parameter name (letters and digits, the rest '_').
std::string fixture_test_name(const std::string& dir);

// A description from an HF-style config (LlamaForCausalLM unless `extra` overrides keys).
sdk::TransformerDesc llama_desc(int64_t vocab, int64_t hidden, int64_t layers, int64_t heads, int64_t kv_heads,
                                int64_t head_dim, int64_t ffn, const std::string& extra_json = "{}");
// A small DeepSeek-V3 description: MLA (q_lora_rank 24, kv_lora_rank 16, q/k heads 16 + 8 rope
// dims, values 12: Dk != Dv), interleaved yarn RoPE with mscale_all_dim (the softmax scale and
// cos/sin factor both change), a dense first layer, then MoE with sigmoid scores, a selection
// bias, group limits and a shared expert. `extra` overrides keys ({"q_lora_rank": null}: q
// projected directly).
sdk::TransformerDesc deepseek_desc(const std::string& extra_json = "{}");
// Random weights for desc (normal * scale, norms around 1), deterministic in seed.
std::vector<std::vector<float>> random_weights(const sdk::TransformerDesc& desc, uint64_t seed, float scale = 0.08f);
// n prompts of random tokens, lengths cycling through lens.
std::vector<std::vector<int32_t>> random_prompts(int64_t n, int64_t vocab, uint64_t seed, std::vector<int64_t> lens);

// A Mixtral-like model (2 MoE layers, 4 experts, top 1) whose routers are built to tie: rows 1
// and 3 are rows 0 and 2 moved by one float ulp per element, row 2 = -row 0. Every token's best
// two experts then differ in logit by about as much as float32 rounding moves a logit, so a
// float32 router's choice depends on its summation order, while float64 resolves the true one.
struct TiedRouterModel {
  std::string config_json;  // its HF config.json
  sdk::TransformerDesc desc;
  std::vector<std::vector<float>> weights;
};
TiedRouterModel tied_router_moe();

// Random models of the kinds the tests run (deterministic): a Qwen3-like dense model with every
// dense feature the description can switch on (biases, q/k norms, a window on the upper layers,
// GQA 4/2, tied); Qwen2-MoE-like (6 experts top-2 with a gated shared expert on every other
// layer); DeepSeek-V3-like (deepseek_desc: MLA and sigmoid-routed MoE with groups); Gemma-3-like
// (sandwich and (1 + w) norms, q/k norms, GeGLU, scaled embedding, a window on every other layer
// with its own RoPE table, linear-scaled RoPE on the others, query_pre_attn_scalar, tied).
struct Model {
  sdk::TransformerDesc desc;
  std::vector<std::vector<float>> weights;
};
Model qwen_like();
Model moe_like();
Model mla_like();
Model gemma_like();
Model gemma2_like();

// Token t decodes to one letter ('a' + t % 26); token 0 to nothing (a special token).
class CharDetok : public Detokenizer {
 public:
  std::string decode(std::span<const int32_t> ids) const override;
};

// One finished sample, copied out of the callback.
struct Out {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  bool truncated = false;
  int64_t weight_version = -1;
};
// Keyed by (global prompt index, sample index).
using Outs = std::map<std::pair<int64_t, int64_t>, Out>;
// gtest expectations: the same samples, logprobs bitwise.
void expect_same(const Outs& a, const Outs& b, const std::string& what);

// Runs g.generate over `prompts` (each a token list) starting at global prompt index `first`,
// adding the results to `outs` under global indices.
Stats run(Generator& g, const std::vector<std::vector<int32_t>>& prompts, Request base, int64_t first, Outs& outs);

// The engine's processed logprobs (temperature, top-k, top-p) of every generated token of
// `outs`, in the order of the sample's ids: the trainer's side of the mismatch measurement.
struct Mismatch {
  double mean_abs = 0, max_abs = 0;
  double token_mult_prob_error = 0;  // NeMo-RL: mean exp|lp_gen - lp_train|
  int64_t tokens = 0;
};
Mismatch trainer_mismatch(engine::Engine& eng, const std::vector<std::vector<int32_t>>& prompts,
                          int64_t first, const Outs& outs, const SamplingParams& sp);

}  // namespace rlh::gen::test
