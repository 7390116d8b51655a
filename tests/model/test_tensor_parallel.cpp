// Tensor parallelism's plan and pass (sdk/tensor_parallel.hpp): this rank's description and
// program, slicing and placing full tensors (a vocabulary that does not divide; every fixture:
// biases, MoE experts, MLA), marks, refusals.
#include <gtest/gtest.h>

#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model_test_util.hpp"
#include "rlhost/model/llama_family.hpp"
#include "rlhost/sdk/tensor_parallel.hpp"

using namespace rlh;
using nlohmann::json;

namespace {

json llama(int64_t vocab = 67, int64_t kv = 2) {
  return json{{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", vocab}, {"hidden_size", 32},
              {"intermediate_size", 48}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
              {"num_key_value_heads", kv}, {"head_dim", 8}, {"max_position_embeddings", 128},
              {"rms_norm_eps", 1e-6}, {"torch_dtype", "float32"}};
}

int64_t numel(const std::vector<int64_t>& s) {
  return std::accumulate(s.begin(), s.end(), int64_t(1), std::multiplies<int64_t>());
}

// Every rank's layout of `d` at T, checking that every parameter's slices of all ranks place
// back to the full tensor (and have the local shape).
std::vector<sdk::TpLayout> expect_slices_place_back(const sdk::TransformerDesc& d, int64_t T, const std::string& what) {
  std::vector<sdk::TpLayout> layouts;
  for (int64_t r = 0; r < T; ++r) layouts.push_back(sdk::make_tp_layout(d, T, r));
  for (size_t i = 0; i < d.params.size(); ++i) {
    std::vector<float> full(size_t(numel(d.params[i].shape)));
    std::iota(full.begin(), full.end(), 1.f);
    std::vector<float> back(full.size(), 0.f);
    for (const auto& L : layouts) {
      const std::vector<float> piece = sdk::tp_slice(L, i, full);
      EXPECT_EQ(int64_t(piece.size()), numel(L.local.params[i].shape)) << what << ": " << d.params[i].name;
      sdk::tp_place(L, i, piece, back);
    }
    EXPECT_EQ(back, full) << what << ": " << d.params[i].name << " at tp " << T;
  }
  return layouts;
}

}  // namespace

TEST(TensorParallel, LocalDescriptionAndMarks) {
  const sdk::TransformerDesc d = model::describe(llama());
  const sdk::TpLayout L = sdk::make_tp_layout(d, 2, 1);
  EXPECT_EQ(L.local.layers[0].attention.num_heads, 2);
  EXPECT_EQ(L.local.layers[0].attention.num_kv_heads, 1);
  EXPECT_EQ(L.local.layers[0].mlp.intermediate_size, 24);
  EXPECT_EQ(L.vocab_block, 34);  // ceil(67 / 2)
  EXPECT_EQ(L.vocab_begin, 34);
  EXPECT_EQ(L.vocab_count, 33);  // the last block is padded by one row
  EXPECT_EQ(L.local.find_param(0, sdk::ParamRole::o)->shape, (std::vector<int64_t>{32, 16}));
  EXPECT_EQ(L.local.find_param(0, sdk::ParamRole::k)->shape, (std::vector<int64_t>{8, 32}));
  sdk::ModelProgram p = sdk::build_program(L.local);
  sdk::mark_tensor_parallel(p, L);
  EXPECT_EQ(p.tp_size, 2);
  int din = 0, out = 0;
  for (const auto& s : p.layers[0].steps) {
    din += s.tp_reduce_din;
    out += s.tp_reduce_out;
  }
  EXPECT_EQ(din, 2);  // q|k|v and gate|up
  EXPECT_EQ(out, 2);  // o and down
  sdk::ExecutorCaps caps;
  caps.name = "generator";
  EXPECT_EQ(sdk::unsupported(p, caps), "generator: tensor parallelism is not supported");
}

// Every rank's slice placed back gives the full tensor, for every split (kv heads replicated
// at TP 4 with 2 kv heads; the vocabulary 67 over 4 ranks: blocks of 17, the last one 16).
TEST(TensorParallel, SlicesPlaceBackToTheFullTensors) {
  for (int64_t T : {2, 4}) {
    const sdk::TransformerDesc d = model::describe(llama(67, 2));
    const std::vector<sdk::TpLayout> layouts = expect_slices_place_back(d, T, "llama");
    if (T == 4) {
      const sdk::TpPiece& k = layouts[3].pieces[size_t(d.find_param(0, sdk::ParamRole::k) - d.params.data())];
      EXPECT_EQ(k.split, sdk::TpSplit::kv_rows);
      EXPECT_EQ(k.begin, 8);  // rank 3's query heads read kv head 1
      EXPECT_TRUE(k.sum_grads);
      EXPECT_DOUBLE_EQ(k.norm_weight, 0.5);
      EXPECT_EQ(layouts[3].vocab_count, 16);
    }
  }
}

// Every fixture (dense, biases, MoE with stacked experts and a shared expert, MLA) at T 2 and 4:
// every rank's slices place back to the full tensors, and the local program builds and marks.
TEST(TensorParallel, EveryFixtureSlicesPlacesAndMarks) {
  int moe = 0, mla = 0;
  for (const auto& dir : test::model_fixture_dirs()) {
    const sdk::TransformerDesc d = model::describe(json::parse(test::read_file(dir / "config.json")));
    for (int64_t T : {2, 4}) {
      if (!sdk::tp_unsupported(d, T).empty()) continue;
      const std::vector<sdk::TpLayout> layouts = expect_slices_place_back(d, T, dir.filename().string());
      sdk::ModelProgram p = sdk::build_program(layouts[1].local);
      sdk::mark_tensor_parallel(p, layouts[1]);
      for (const auto& lp : p.layers)
        for (const auto& st : lp.steps) {
          if (st.op == sdk::StepOp::moe) {
            ++moe;
            EXPECT_TRUE(st.tp_reduce_out && st.tp_reduce_din);
          }
          if (st.op == sdk::StepOp::mla) {
            ++mla;
            EXPECT_TRUE(st.tp_reduce_din && !st.tp_reduce_out);
          }
        }
    }
  }
  EXPECT_GT(moe, 0);
  EXPECT_GT(mla, 0);
}

// The MoE plan: each expert's rows (gate, up: axis 1) and columns (down: axis 2), the shared
// expert as a dense MLP, the router whole; MLA: q_b / kv_b by heads, the latents summed.
TEST(TensorParallel, ExpertAndLatentSplits) {
  const sdk::TransformerDesc d =
      model::describe(json::parse(test::read_file(test::fixtures_dir() / "deepseek-v3-tiny" / "config.json")));
  const sdk::TpLayout L = sdk::make_tp_layout(d, 2, 1);
  auto piece = [&](int64_t layer, sdk::ParamRole role) {
    return L.pieces[size_t(d.find_param(layer, role) - d.params.data())];
  };
  auto shape = [&](int64_t layer, sdk::ParamRole role) { return L.local.find_param(layer, role)->shape; };
  EXPECT_EQ(piece(1, sdk::ParamRole::expert_gate).split, sdk::TpSplit::expert_rows);
  EXPECT_EQ(piece(1, sdk::ParamRole::expert_gate).begin, 16);
  EXPECT_EQ(shape(1, sdk::ParamRole::expert_gate), (std::vector<int64_t>{8, 16, 64}));
  EXPECT_EQ(shape(1, sdk::ParamRole::expert_down), (std::vector<int64_t>{8, 64, 16}));
  EXPECT_EQ(shape(1, sdk::ParamRole::shared_expert_down), (std::vector<int64_t>{64, 16}));
  EXPECT_EQ(shape(1, sdk::ParamRole::router), (std::vector<int64_t>{8, 64}));
  EXPECT_EQ(piece(1, sdk::ParamRole::router).split, sdk::TpSplit::replicated);
  EXPECT_EQ(shape(0, sdk::ParamRole::kv_b), (std::vector<int64_t>{2 * 32, 32}));  // 2 heads of nope 16 + v 16
  EXPECT_EQ(shape(0, sdk::ParamRole::q_b), (std::vector<int64_t>{2 * 24, 48}));
  EXPECT_TRUE(piece(0, sdk::ParamRole::kv_a).sum_grads);
  EXPECT_TRUE(piece(0, sdk::ParamRole::q_a_norm).sum_grads);
  EXPECT_EQ(L.local.layers[1].mlp.moe.expert_intermediate_size, 16);
}

// expert_tensor_parallel_size = 1 (with expert parallelism): the routed experts stay whole on every
// tp rank (their own split, norm weight 1, never summed), the shared expert is cut as a dense MLP,
// and a width T does not divide is no longer refused for the experts.
TEST(TensorParallel, ExpertsWholeUnderExpertParallelism) {
  const sdk::TransformerDesc d =
      model::describe(json::parse(test::read_file(test::fixtures_dir() / "deepseek-v3-tiny" / "config.json")));
  const sdk::TpLayout L = sdk::make_tp_layout(d, 2, 1, "tensor_model_parallel_size", 1);
  auto piece = [&](int64_t layer, sdk::ParamRole role) {
    return L.pieces[size_t(d.find_param(layer, role) - d.params.data())];
  };
  auto shape = [&](int64_t layer, sdk::ParamRole role) { return L.local.find_param(layer, role)->shape; };
  for (const sdk::ParamRole r : {sdk::ParamRole::expert_gate, sdk::ParamRole::expert_up, sdk::ParamRole::expert_down}) {
    EXPECT_EQ(piece(1, r).split, sdk::TpSplit::experts_whole);
    EXPECT_EQ(piece(1, r).norm_weight, 1.0);
    EXPECT_FALSE(piece(1, r).sum_grads);
    EXPECT_EQ(shape(1, r), d.find_param(1, r)->shape);
  }
  EXPECT_EQ(L.local.layers[1].mlp.moe.expert_intermediate_size, 32);
  EXPECT_EQ(shape(1, sdk::ParamRole::shared_expert_down), (std::vector<int64_t>{64, 16}));
  const std::vector<float> full(size_t(8 * 32 * 64), 1.5f);
  EXPECT_EQ(sdk::tp_slice(L, size_t(d.find_param(1, sdk::ParamRole::expert_gate) - d.params.data()), full), full);
  sdk::TransformerDesc odd = d;
  for (sdk::LayerDesc& l : odd.layers)
    if (l.mlp.kind == sdk::MlpKind::moe) l.mlp.moe.expert_intermediate_size = 33;
  EXPECT_EQ(sdk::tp_unsupported(odd, 2, "tensor_model_parallel_size", 1), "");
  EXPECT_NE(sdk::tp_unsupported(odd, 2), "");
}

// expert_tensor_parallel_size Te between 1 and T (with expert parallelism): each routed expert
// is cut in Te blocks (gate/up rows, down columns), tp rank r holding block r mod Te (its place
// in Megatron's expert order); norm weight 1 (the owner sums the blocks over etp x ep), no sum
// over tp; everything else, the shared expert included, is cut over all T ranks. The blocks of
// ranks r and r + Te are the same, and the Te blocks tile each expert tensor once. Te must
// divide T and the expert width.
TEST(TensorParallel, ExpertsCutOverAnExpertTensorParallelGroup) {
  const sdk::TransformerDesc d =
      model::describe(json::parse(test::read_file(test::fixtures_dir() / "deepseek-v3-tiny" / "config.json")));
  const int64_t T = 4, Te = 2;
  std::vector<sdk::TpLayout> Ls;
  for (int64_t r = 0; r < T; ++r) Ls.push_back(sdk::make_tp_layout(d, T, r, "tensor_model_parallel_size", Te));
  const size_t gate = size_t(d.find_param(1, sdk::ParamRole::expert_gate) - d.params.data());
  const size_t down = size_t(d.find_param(1, sdk::ParamRole::expert_down) - d.params.data());
  for (int64_t r = 0; r < T; ++r) {
    const sdk::TpLayout& L = Ls[size_t(r)];
    EXPECT_EQ(L.expert_size, Te);
    EXPECT_EQ(L.expert_rank, r % Te);
    EXPECT_EQ(L.local.layers[1].mlp.moe.expert_intermediate_size, 32 / Te);
    EXPECT_EQ(L.local.layers[1].mlp.moe.shared_expert_intermediate_size, 32 / T);
    const sdk::TpPiece& g = L.pieces[gate];
    EXPECT_EQ(g.split, sdk::TpSplit::expert_rows);
    EXPECT_EQ(g.axis, 1);
    EXPECT_EQ(g.begin, (r % Te) * 16);
    EXPECT_EQ(g.count, 16);
    EXPECT_EQ(g.norm_weight, 1.0);
    EXPECT_FALSE(g.sum_grads);
    EXPECT_EQ(L.pieces[down].split, sdk::TpSplit::expert_cols);
    EXPECT_EQ(L.pieces[down].axis, 2);
    EXPECT_EQ(L.pieces[down].begin, (r % Te) * 16);
    EXPECT_EQ(L.local.params[gate].shape, (std::vector<int64_t>{8, 16, 64}));
    EXPECT_EQ(L.local.params[down].shape, (std::vector<int64_t>{8, 64, 16}));
    EXPECT_EQ(L.local.find_param(1, sdk::ParamRole::shared_expert_down)->shape, (std::vector<int64_t>{64, 8}));
  }
  // Blocks placed back from ranks 0 and 1 (an etp group) rebuild the tensor; 2 and 3 repeat them.
  std::vector<float> full(size_t(8 * 64 * 32));
  for (size_t i = 0; i < full.size(); ++i) full[i] = float(i);
  std::vector<float> back(full.size(), -1.f);
  for (int64_t r = 0; r < Te; ++r) sdk::tp_place(Ls[size_t(r)], down, sdk::tp_slice(Ls[size_t(r)], down, full), back);
  EXPECT_EQ(back, full);
  EXPECT_EQ(sdk::tp_slice(Ls[2], down, full), sdk::tp_slice(Ls[0], down, full));
  EXPECT_EQ(sdk::make_tp_layout(d, T, 3).pieces[gate].begin, 3 * 8);  // Te = T (0): the tp rank's block of 4
  EXPECT_EQ(sdk::tp_unsupported(d, T, "tensor_model_parallel_size", 3),
            "tensor_model_parallel_size = 4: expert tensor-parallel size 3 does not divide it");
  sdk::TransformerDesc odd = d;
  for (sdk::LayerDesc& l : odd.layers)
    if (l.mlp.kind == sdk::MlpKind::moe) l.mlp.moe.expert_intermediate_size = 30;  // a multiple of 2, not of 4
  EXPECT_EQ(sdk::tp_unsupported(odd, T, "tensor_model_parallel_size", Te), "");
  odd.layers[1].mlp.moe.expert_intermediate_size = 33;
  EXPECT_EQ(sdk::tp_unsupported(odd, T, "tensor_model_parallel_size", Te),
            "tensor_model_parallel_size = 4: layer 1: moe_intermediate_size = 33 is not a multiple of 2");
}

TEST(TensorParallel, RefusesWhatItDoesNotRunByName) {
  EXPECT_EQ(sdk::tp_unsupported(model::describe(llama()), 1), "");
  EXPECT_EQ(sdk::tp_unsupported(model::describe(llama()), 3),
            "tensor_model_parallel_size = 3: layer 0: num_attention_heads = 4 is not a multiple of 3");
  json c = llama();
  c["attention_bias"] = true;
  c["mlp_bias"] = true;
  EXPECT_EQ(sdk::tp_unsupported(model::describe(c), 2), "");  // q/k/v/gate/up biases cut, o/down whole
  {
    const sdk::TransformerDesc d = model::describe(c);
    const sdk::TpLayout L = sdk::make_tp_layout(d, 2, 0);
    EXPECT_EQ(L.local.find_param(0, sdk::ParamRole::q_bias)->shape, (std::vector<int64_t>{16}));
    EXPECT_EQ(L.local.find_param(0, sdk::ParamRole::o_bias)->shape, (std::vector<int64_t>{32}));
    EXPECT_EQ(L.local.find_param(0, sdk::ParamRole::up_bias)->shape, (std::vector<int64_t>{24}));
    EXPECT_EQ(L.local.find_param(0, sdk::ParamRole::down_bias)->shape, (std::vector<int64_t>{32}));
  }
  c = llama();
  c["intermediate_size"] = 50;
  EXPECT_EQ(sdk::tp_unsupported(model::describe(c), 4),
            "tensor_model_parallel_size = 4: layer 0: intermediate_size = 50 is not a multiple of 4");
  {
    json m = json::parse(test::read_file(test::fixtures_dir() / "qwen3-moe-tiny" / "config.json"));
    m["moe_intermediate_size"] = 50;
    EXPECT_EQ(sdk::tp_unsupported(model::describe(m), 4),
              "tensor_model_parallel_size = 4: layer 0: moe_intermediate_size = 50 is not a multiple of 4");
  }
  c = llama();
  c["num_key_value_heads"] = 4;
  c["num_attention_heads"] = 8;
  c["head_dim"] = 4;
  EXPECT_EQ(sdk::tp_unsupported(model::describe(c), 8), "");
  c["num_key_value_heads"] = 1;
  EXPECT_EQ(sdk::tp_unsupported(model::describe(c), 8), "");  // MQA: one kv head on every rank
  EXPECT_THROW(sdk::make_tp_layout(model::describe(llama()), 3, 0), std::invalid_argument);
}
