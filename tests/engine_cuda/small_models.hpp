// Small random models for the CUDA engine's tests (test_cuda_engine.cpp, test_cuda_engine_offload.cpp):
// a dense Llama and a Qwen3-MoE-like model, with one packed batch of uneven sequences.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "rlhost/engine/engine.hpp"
#include "rlhost/model/llama_family.hpp"
#include "rlhost/sdk/model_desc.hpp"

namespace rlh::test {

// A small random Llama (GQA, untied, head_dim 64 so attention takes the tensor-core path) and a
// packed batch of uneven sequences.
// Random weights for desc: N(0, 0.05) matrices (the router's scaled by router_scale), vectors
// (norms, and DeepSeek's selection bias) around 1.
inline std::vector<std::vector<float>> random_weights(const sdk::TransformerDesc& desc, std::mt19937& rng,
                                               float router_scale) {
  std::normal_distribution<float> nd(0.f, 0.05f);
  std::vector<std::vector<float>> weights;
  for (const auto& p : desc.params) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    std::vector<float> t(static_cast<size_t>(n));
    const bool norm = p.shape.size() == 1;
    const float scale = p.role == sdk::ParamRole::router ? router_scale : 1.f;
    for (float& x : t) x = norm ? 1.f + nd(rng) : scale * nd(rng);
    weights.push_back(std::move(t));
  }
  return weights;
}

struct Small {
  sdk::TransformerDesc desc;
  std::vector<std::vector<float>> weights;
  std::vector<int32_t> ids, cu;
  Small() {
    const nlohmann::json cfg = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"},
                                {"vocab_size", 512}, {"hidden_size", 256},
                                {"intermediate_size", 512}, {"num_hidden_layers", 2},
                                {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                                {"head_dim", 64}, {"rms_norm_eps", 1e-5},
                                {"max_position_embeddings", 512}, {"rope_theta", 10000.0},
                                {"tie_word_embeddings", false}};
    desc = model::describe(cfg);
    std::mt19937 rng(7);
    weights = random_weights(desc, rng, 1.f);
    std::uniform_int_distribution<int32_t> tok(0, 511);
    cu = {0};
    for (int len : {97, 160, 33, 222}) {
      for (int i = 0; i < len; ++i) ids.push_back(tok(rng));
      cu.push_back(int32_t(ids.size()));
    }
  }
  int64_t predicted() const { return int64_t(ids.size()) - int64_t(cu.size() - 1); }
  // The batch as micro-batches of at most 260 tokens (three of them), valid while this lives.
  std::vector<engine::MicroBatch> parts() { return engine::split_microbatches(ids, cu, 260, &part_cu); }

 private:
  std::vector<std::vector<int32_t>> part_cu;
};

// A small random Qwen3-MoE-like model: layer 0 routed (8 experts, top-2, renormalised, expert
// width 128), layer 1 dense (mlp_only_layers), head_dim 64, untied; the batch of Small.
struct SmallMoe {
  sdk::TransformerDesc desc;
  std::vector<std::vector<float>> weights;
  std::vector<int32_t> ids, cu;
  SmallMoe() {
    const nlohmann::json cfg = {{"architectures", {"Qwen3MoeForCausalLM"}}, {"model_type", "qwen3_moe"},
                                {"vocab_size", 512}, {"hidden_size", 256},
                                {"intermediate_size", 512}, {"moe_intermediate_size", 128},
                                {"num_experts", 8}, {"num_experts_per_tok", 2},
                                {"norm_topk_prob", true}, {"decoder_sparse_step", 1},
                                {"mlp_only_layers", {1}}, {"num_hidden_layers", 2},
                                {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                                {"head_dim", 64}, {"rms_norm_eps", 1e-6},
                                {"max_position_embeddings", 512}, {"rope_theta", 1000000.0},
                                {"tie_word_embeddings", false}};
    desc = model::describe(cfg);
    // A router 10x wider than the other weights: well-separated scores, so bf16 noise rarely
    // flips a top-2 choice between the CPU and GPU engines.
    std::mt19937 rng(11);
    weights = random_weights(desc, rng, 10.f);
    Small dense;  // the same packed batch
    ids = dense.ids;
    cu = dense.cu;
  }
  int64_t predicted() const { return int64_t(ids.size()) - int64_t(cu.size() - 1); }
};

}  // namespace rlh::test
