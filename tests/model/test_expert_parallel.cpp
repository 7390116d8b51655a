// Expert parallelism's plan and pass (sdk/expert_parallel.hpp): this rank's description and
// program, slicing and placing the stacked expert tensors, refusals.
#include <gtest/gtest.h>

#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/model/llama_family.hpp"
#include "rlhost/sdk/expert_parallel.hpp"

using namespace rlh;
using nlohmann::json;

namespace {

json qwen3_moe(int64_t experts = 8) {
  return json{{"architectures", {"Qwen3MoeForCausalLM"}}, {"vocab_size", 67}, {"hidden_size", 32},
              {"intermediate_size", 48}, {"moe_intermediate_size", 16}, {"num_hidden_layers", 2},
              {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 8},
              {"num_experts", experts}, {"num_experts_per_tok", 2}, {"norm_topk_prob", true},
              {"max_position_embeddings", 128}, {"rms_norm_eps", 1e-6}, {"torch_dtype", "float32"}};
}

int64_t numel(const std::vector<int64_t>& s) {
  return std::accumulate(s.begin(), s.end(), int64_t(1), std::multiplies<int64_t>());
}

}  // namespace

TEST(ExpertParallel, LocalDescriptionAndMarks) {
  const sdk::TransformerDesc d = model::describe(qwen3_moe());
  const sdk::EpLayout L = sdk::make_ep_layout(d, 4, 3);
  EXPECT_EQ(L.local.layers[1].mlp.moe.num_experts, 8);  // the router still scores every expert
  EXPECT_EQ(L.local.layers[1].mlp.moe.num_local_experts, 2);
  const sdk::ParamDesc* g = L.local.find_param(1, sdk::ParamRole::expert_gate);
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->shape, (std::vector<int64_t>{2, 16, 32}));
  ASSERT_EQ(g->hf_names.size(), 2u);  // experts 6 and 7
  EXPECT_NE(g->hf_names[0].find("experts.6."), std::string::npos) << g->hf_names[0];
  EXPECT_EQ(L.local.find_param(1, sdk::ParamRole::router)->shape, (std::vector<int64_t>{8, 32}));
  sdk::ModelProgram p = sdk::build_program(L.local);
  sdk::mark_expert_parallel(p, L);
  EXPECT_EQ(p.ep_size, 4);
  int marked = 0;
  for (const auto& l : p.layers)
    for (const auto& s : l.steps) marked += s.ep_dispatch;
  EXPECT_EQ(marked, 2);  // one MoE step per layer
  sdk::ExecutorCaps caps;
  caps.name = "cuda engine";
  caps.moe = true;
  EXPECT_EQ(sdk::unsupported(p, caps), "cuda engine: expert parallelism is not supported");
  // The local description's experts are what its program checks: the whole model's do not fit.
  sdk::TransformerDesc wrong = L.local;
  wrong.layers[1].mlp.moe.num_local_experts = 4;
  EXPECT_THROW(sdk::build_program(wrong), std::invalid_argument);
  wrong.layers[1].mlp.moe.num_local_experts = 3;  // not a divisor of the 8 experts
  EXPECT_THROW(sdk::build_program(wrong), std::invalid_argument);
}

// Every rank's block placed back gives the full tensor; replicated tensors are whole.
TEST(ExpertParallel, SlicesPlaceBack) {
  const sdk::TransformerDesc d = model::describe(qwen3_moe());
  for (int64_t P : {2, 4, 8}) {
    for (size_t i = 0; i < d.params.size(); ++i) {
      const int64_t n = numel(d.params[i].shape);
      std::vector<float> full(static_cast<size_t>(n)), back(static_cast<size_t>(n), -1.f);
      std::iota(full.begin(), full.end(), 0.f);
      for (int64_t r = 0; r < P; ++r) {
        const sdk::EpLayout L = sdk::make_ep_layout(d, P, r);
        const std::vector<float> part = sdk::ep_slice(L, i, full);
        EXPECT_EQ(int64_t(part.size()), numel(L.local.params[i].shape)) << d.params[i].name;
        if (!L.is_expert(i)) {
          EXPECT_EQ(part, full) << d.params[i].name;
          continue;
        }
        EXPECT_EQ(int64_t(part.size()) * P, n);
        sdk::ep_place(L, i, part, back);
      }
      if (sdk::ep_split_of(d.params[i].role) == sdk::EpSplit::experts) {
        EXPECT_EQ(back, full) << d.params[i].name << " P " << P;
      }
    }
  }
}

TEST(ExpertParallel, Refusals) {
  const sdk::TransformerDesc d = model::describe(qwen3_moe());
  EXPECT_EQ(sdk::ep_unsupported(d, 3, "policy.megatron_cfg.expert_model_parallel_size"),
            "policy.megatron_cfg.expert_model_parallel_size = 3: layer 0: num_experts = 8 is not a multiple of 3");
  EXPECT_EQ(sdk::ep_unsupported(d, 1), "");
  EXPECT_EQ(sdk::ep_unsupported(d, 0), "expert_model_parallel_size = 0: must be at least 1");
  json dense = qwen3_moe();
  dense["architectures"] = {"Qwen3ForCausalLM"};
  EXPECT_EQ(sdk::ep_unsupported(model::describe(dense), 2),
            "expert_model_parallel_size = 2: Qwen3ForCausalLM has no mixture-of-experts layer to split");
  EXPECT_THROW(sdk::make_ep_layout(d, 3, 0), std::invalid_argument);
  EXPECT_THROW(sdk::make_ep_layout(d, 2, 2), std::invalid_argument);
}
