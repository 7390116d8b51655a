// Pipeline parallelism's split and a stage's description and program (sdk/pipeline_parallel.hpp):
// Megatron's layer counts with first/last stages, owners of every tensor, the tied embedding's
// copy, stage programs, the MoE routing record's columns per stage, interleaved virtual
// stages' chunks, refusals.
#include <gtest/gtest.h>

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/model/llama_family.hpp"
#include "rlhost/sdk/expert_parallel.hpp"
#include "rlhost/sdk/pipeline_parallel.hpp"

using namespace rlh;
using nlohmann::json;

namespace {

json llama(int64_t layers, bool tied) {
  return json{{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", 67}, {"hidden_size", 32},
              {"intermediate_size", 48}, {"num_hidden_layers", layers}, {"num_attention_heads", 4},
              {"num_key_value_heads", 2}, {"head_dim", 8}, {"max_position_embeddings", 128},
              {"rms_norm_eps", 1e-6}, {"torch_dtype", "float32"}, {"tie_word_embeddings", tied}};
}

std::string what(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(PipelineParallel, StageLayers) {
  using V = std::vector<int64_t>;
  EXPECT_EQ(sdk::pp_stage_layers(8, 4, {}), (V{2, 2, 2, 2}));
  EXPECT_EQ(sdk::pp_stage_layers(9, 4, {3, 0}), (V{3, 2, 2, 2}));
  EXPECT_EQ(sdk::pp_stage_layers(7, 4, {0, 1}), (V{2, 2, 2, 1}));
  EXPECT_EQ(sdk::pp_stage_layers(6, 3, {1, 1}), (V{1, 4, 1}));
  EXPECT_EQ(sdk::pp_stage_layers(5, 2, {2, 3}), (V{2, 3}));
  EXPECT_EQ(sdk::pp_stage_layers(5, 1, {2, 0}), (V{5}));  // one stage: every layer
  EXPECT_EQ(what([] { sdk::pp_stage_layers(6, 4, {}); }),
            "pipeline_model_parallel_size = 4: the layers do not split over the stages (6 layers: 6 left for 4 stages)");
  EXPECT_EQ(what([] { sdk::pp_stage_layers(4, 2, {2, 1}); }),
            "pipeline_model_parallel_size = 2: the layers do not split over the stages (4 layers, "
            "num_layers_in_first_pipeline_stage = 2, num_layers_in_last_pipeline_stage = 1: 1 left over)");
  EXPECT_EQ(what([] { sdk::pp_stage_layers(3, 3, {2, 0}); }),
            "pipeline_model_parallel_size = 3: the layers do not split over the stages (3 layers, "
            "num_layers_in_first_pipeline_stage = 2: 1 left for 2 stages)");
}

TEST(PipelineParallel, StageDescriptionsOwnersAndPrograms) {
  for (const bool tied : {false, true}) {
    const sdk::TransformerDesc d = model::describe(llama(5, tied));
    std::vector<int> held(d.params.size(), 0);
    for (int64_t s = 0; s < 3; ++s) {
      const sdk::PpLayout L = sdk::make_pp_layout(d, 3, s, {1, 0});  // layers 1 + 2 + 2
      EXPECT_EQ(L.layer_begin, s == 0 ? 0 : 1 + 2 * (s - 1));
      EXPECT_EQ(L.local.num_layers, s == 0 ? 1 : 2);
      for (size_t j = 0; j < L.local.params.size(); ++j) {
        const sdk::ParamDesc& p = L.local.params[j];
        const sdk::ParamDesc& full = d.params[size_t(L.full_index[j])];
        EXPECT_EQ(p.name, full.name);
        if (p.layer >= 0) EXPECT_EQ(p.layer + L.layer_begin, full.layer);
        EXPECT_EQ(L.local_index[size_t(L.full_index[j])], int64_t(j));
        if (L.owner[size_t(L.full_index[j])] == s) ++held[size_t(L.full_index[j])];
      }
      // The embedding on the first stage (and the last stage's tied head), the final norm and
      // the head on the last.
      EXPECT_EQ(L.local.find_param(-1, sdk::ParamRole::embed) != nullptr, s == 0 || (tied && s == 2));
      EXPECT_EQ(L.local.find_param(-1, sdk::ParamRole::final_norm) != nullptr, s == 2);
      EXPECT_EQ(L.local.find_param(-1, sdk::ParamRole::lm_head) != nullptr, !tied && s == 2);
      EXPECT_EQ(L.shares_embedding, tied && s != 1);
      const sdk::ModelProgram prog = sdk::build_stage_program(L.local, L.first, L.last);
      EXPECT_EQ(prog.pp_first, s == 0);
      EXPECT_EQ(prog.pp_last, s == 2);
      EXPECT_EQ(prog.layers.size(), size_t(L.local.num_layers));
      EXPECT_EQ(prog.embed >= 0, s == 0 || (tied && s == 2));
      EXPECT_EQ(prog.head >= 0, s == 2);
      sdk::ExecutorCaps caps;
      caps.name = "x";
      EXPECT_EQ(sdk::unsupported(prog, caps), "x: pipeline parallelism is not supported");  // a stage program
      caps.pipeline_stage = true;
      EXPECT_EQ(sdk::unsupported(prog, caps), "");
    }
    for (size_t i = 0; i < held.size(); ++i) EXPECT_EQ(held[i], 1) << d.params[i].name << ": exactly one owner";
  }
}

// MoE layers split like any other; each stage records and replays its own columns of the whole
// routing record (top_k per MoE layer, in layer order).
TEST(PipelineParallel, MoeRoutingColumns) {
  json moe = llama(4, false);
  moe["architectures"] = {"MixtralForCausalLM"};
  moe["num_local_experts"] = 4;
  moe["num_experts_per_tok"] = 2;
  const sdk::TransformerDesc m = model::describe(moe);
  EXPECT_EQ(sdk::pp_unsupported(m, 2, {}), "");
  const int64_t begin[3] = {0, 2, 6};  // layers 1 + 2 + 1
  for (int64_t s = 0; s < 3; ++s) {
    const sdk::PpLayout L = sdk::make_pp_layout(m, 3, s, {1, 1});
    EXPECT_EQ(L.route_total, 8);
    EXPECT_EQ(L.route_begin, begin[s]) << "stage " << s;
  }
  EXPECT_EQ(sdk::make_pp_layout(model::describe(llama(2, false)), 2, 1, {}).route_total, 0);  // dense

  // Interleaved virtual stages (P 2 x V 2, one layer a chunk): a rank's chunks are runs apart,
  // rank 0 columns [0, 2) and [4, 6), rank 1 [2, 4) and [6, 8).
  sdk::PpSplit v2;
  v2.virtual_size = 2;
  for (int64_t s = 0; s < 2; ++s) {
    const sdk::PpLayout L = sdk::make_pp_layout(m, 2, s, v2);
    EXPECT_EQ(L.route_total, 8);
    ASSERT_EQ(L.chunks.size(), 2u);
    for (int64_t c = 0; c < 2; ++c) {
      EXPECT_EQ(L.chunks[size_t(c)].route_begin, 2 * (c * 2 + s)) << "stage " << s << " chunk " << c;
      EXPECT_EQ(L.chunks[size_t(c)].route_count, 2) << "stage " << s << " chunk " << c;
    }
    EXPECT_EQ(L.route_begin, L.chunks[0].route_begin);
  }
}

// Expert parallelism within a stage: the stage is cut from the ep layout's description, so it
// holds its layers' block of experts (and the stage's full_index maps back to the ep layout's
// parameters, whose pieces say which are experts).
TEST(PipelineParallel, StagesOfAnExpertParallelDescription) {
  json moe = llama(4, false);
  moe["architectures"] = {"MixtralForCausalLM"};
  moe["num_local_experts"] = 4;
  moe["num_experts_per_tok"] = 2;
  const sdk::TransformerDesc m = model::describe(moe);
  const sdk::EpLayout E = sdk::make_ep_layout(m, 2, 1);
  const sdk::PpLayout L = sdk::make_pp_layout(E.local, 2, 1, {});
  ASSERT_EQ(L.local.layers.size(), 2u);
  for (const sdk::LayerDesc& l : L.local.layers) EXPECT_EQ(l.mlp.moe.num_local_experts, 2);
  int64_t experts = 0;
  for (size_t j = 0; j < L.local.params.size(); ++j) {
    const size_t i = size_t(L.full_index[j]);
    EXPECT_EQ(L.local.params[j].shape, E.local.params[i].shape);
    if (E.is_expert(i)) {
      ++experts;
      EXPECT_EQ(L.local.params[j].shape[0], 2) << L.local.params[j].name;
      EXPECT_GE(L.local.params[j].layer, 0);
    }
  }
  EXPECT_EQ(experts, 2 * 3);  // gate, up, down of each of the stage's two layers
}

// Interleaved virtual stages: 8 layers in P x V = 4 chunks of 2; virtual stage v = c P + s, so
// rank 0 holds layers 0-1 and 4-5, rank 1 layers 2-3 and 6-7; the embedding goes with the first
// chunk of rank 0, the head with the last chunk of the last rank.
TEST(PipelineParallel, VirtualStageChunks) {
  for (const bool tied : {false, true}) {
    const sdk::TransformerDesc d = model::describe(llama(8, tied));
    std::vector<int> held(d.params.size(), 0);
    for (int64_t s = 0; s < 2; ++s) {
      sdk::PpSplit split;
      split.virtual_size = 2;
      const sdk::PpLayout L = sdk::make_pp_layout(d, 2, s, split);
      ASSERT_EQ(L.chunks.size(), 2u);
      EXPECT_EQ(L.local.num_layers, 4);
      EXPECT_EQ(L.stage_layers, (std::vector<int64_t>{4, 4}));
      for (int64_t c = 0; c < 2; ++c) {
        const sdk::PpLayout::Chunk& k = L.chunks[size_t(c)];
        EXPECT_EQ(k.local_begin, 2 * c);
        EXPECT_EQ(k.count, 2);
        EXPECT_EQ(k.global_begin, 2 * (2 * c + s));
        EXPECT_EQ(k.embed, s == 0 && c == 0);
        EXPECT_EQ(k.head, s == 1 && c == 1);
      }
      for (size_t j = 0; j < L.local.params.size(); ++j) {
        const sdk::ParamDesc& full = d.params[size_t(L.full_index[j])];
        if (full.layer >= 0) {  // local layer l is global layer 2 (2 (l / 2) + s) + l % 2
          const int64_t l = L.local.params[j].layer;
          EXPECT_EQ(full.layer, 2 * (2 * (l / 2) + s) + l % 2) << full.name;
        }
        if (L.owner[size_t(L.full_index[j])] == s) ++held[size_t(L.full_index[j])];
      }
      EXPECT_EQ(L.local.find_param(-1, sdk::ParamRole::embed) != nullptr, s == 0 || tied);
      EXPECT_EQ(L.local.find_param(-1, sdk::ParamRole::final_norm) != nullptr, s == 1);
    }
    for (size_t i = 0; i < held.size(); ++i) EXPECT_EQ(held[i], 1) << d.params[i].name << ": exactly one owner";
  }
  sdk::PpSplit v3;
  v3.virtual_size = 3;
  EXPECT_NE(sdk::pp_unsupported(model::describe(llama(8, false)), 2, v3).find(
                "virtual_pipeline_model_parallel_size = 3: the 8 layers do not split into pipeline_model_parallel_size x "
                "virtual_pipeline_model_parallel_size = 6 model chunks"),
            std::string::npos);
  sdk::PpSplit first;
  first.virtual_size = 2;
  first.first = 2;
  EXPECT_NE(sdk::pp_unsupported(model::describe(llama(8, false)), 2, first).find("with interleaved virtual stages"),
            std::string::npos);
}

TEST(PipelineParallel, Refusals) {
  EXPECT_NE(what([] { sdk::make_pp_layout(model::describe(llama(3, false)), 2, 0, {}); }).find("do not split"),
            std::string::npos);
}
