// The layer program (sdk/layer_program.hpp): what it derives from descriptions of each family,
// its gradient plan, and the one supports() answer executors share.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/model/llama_family.hpp"
#include "rlhost/sdk/layer_program.hpp"

using namespace rlh;
using nlohmann::json;
using sdk::StepOp;

namespace {

json base(const char* arch) {
  return json{{"architectures", {arch}}, {"vocab_size", 64},     {"hidden_size", 32},
              {"intermediate_size", 48}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
              {"num_key_value_heads", 2}, {"head_dim", 8},         {"max_position_embeddings", 128},
              {"rms_norm_eps", 1e-6},    {"torch_dtype", "float32"}};
}

std::vector<StepOp> ops(const sdk::LayerProgram& l) {
  std::vector<StepOp> v;
  for (const auto& s : l.steps) v.push_back(s.op);
  return v;
}

// Every description parameter is read by exactly one step (or the program's globals).
void every_param_used_once(const sdk::TransformerDesc& d, const sdk::ModelProgram& p) {
  std::map<int64_t, int> uses;
  uses[p.embed]++;
  uses[p.final_norm]++;
  if (p.head != p.embed) uses[p.head]++;
  for (const auto& l : p.layers)
    for (const auto& s : l.steps) {
      for (int64_t w : s.weights) uses[w]++;
      for (int64_t b : s.biases)
        if (b >= 0) uses[b]++;
    }
  for (size_t i = 0; i < d.params.size(); ++i) EXPECT_EQ(uses[int64_t(i)], 1) << d.params[i].name;
  EXPECT_EQ(uses.size(), d.params.size());
}

const sdk::LayerValue& value_of(const sdk::LayerProgram& l, const sdk::Cols& c) {
  return l.values[size_t(c.value)];
}

}  // namespace

TEST(LayerProgram, LlamaStepsAndGradientPlan) {
  json c = base("LlamaForCausalLM");
  const sdk::TransformerDesc d = model::describe(c);
  const sdk::ModelProgram p = sdk::build_program(d);
  ASSERT_EQ(p.layers.size(), 2u);
  const sdk::LayerProgram& l = p.layers[0];
  EXPECT_EQ(ops(l), (std::vector<StepOp>{StepOp::norm, StepOp::linear, StepOp::rope, StepOp::rope,
                                          StepOp::attention, StepOp::linear, StepOp::add, StepOp::norm,
                                          StepOp::linear, StepOp::glu, StepOp::linear, StepOp::add}));
  every_param_used_once(d, p);
  // q|k|v fused in one linear, gate|up in another.
  EXPECT_EQ(l.steps[1].weights.size(), 3u);
  EXPECT_EQ(l.steps[8].weights.size(), 2u);
  EXPECT_EQ(l.steps[9].act, "silu");
  // The residual stream's gradient (buffer 0) reaches the input and output; each norm that
  // reads the stream adds into it; the projections write their input gradients.
  EXPECT_EQ(l.values[0].grad, 0);
  EXPECT_EQ(l.values[size_t(l.output)].grad, 0);
  EXPECT_TRUE(l.steps[0].accumulate);
  EXPECT_TRUE(l.steps[7].accumulate);
  EXPECT_FALSE(l.steps[1].accumulate);
  EXPECT_FALSE(l.steps[4].accumulate || l.steps[4].accumulate2 || l.steps[4].accumulate3);
  // A residual add works in place: its output lives in the branch's storage.
  EXPECT_EQ(l.root(l.steps[6].out.value), l.steps[6].in2.value);
  // Gradient buffers are shared as values die: fewer than the values that need one.
  std::set<int> bufs;
  int needing = 0;
  for (const auto& v : l.values)
    if (v.grad >= 0) {
      bufs.insert(v.grad);
      ++needing;
    }
  EXPECT_LT(int(bufs.size()), needing);
  // Saved and recomputable values: the norm and activation outputs rebuild; q|k|v is kept.
  EXPECT_TRUE(value_of(l, l.steps[0].out).recomputable);
  EXPECT_TRUE(value_of(l, l.steps[9].out).recomputable);
  EXPECT_TRUE(value_of(l, l.steps[1].out).saved);
  EXPECT_FALSE(value_of(l, l.steps[1].out).recomputable);
  EXPECT_EQ(sdk::unsupported(p, sdk::ExecutorCaps{"x"}), "");
}

TEST(LayerProgram, Qwen3HeadNormsBeforeRope) {
  json c = base("Qwen3ForCausalLM");
  const sdk::TransformerDesc d = model::describe(c);
  const sdk::ModelProgram p = sdk::build_program(d);
  const sdk::LayerProgram& l = p.layers[0];
  EXPECT_EQ(ops(l)[2], StepOp::head_norm);
  EXPECT_EQ(ops(l)[3], StepOp::head_norm);
  EXPECT_EQ(ops(l)[4], StepOp::rope);
  EXPECT_EQ(l.steps[2].heads, 4);
  EXPECT_EQ(l.steps[3].heads, 2);
  EXPECT_EQ(l.steps[2].offset, 0.0);
  // The normed q and k (values of their own) are what attention reads; the projected q|k stays
  // for the norms' backward.
  EXPECT_EQ(l.steps[6].in.value, l.steps[2].out.value);
  EXPECT_EQ(l.steps[6].in2.value, l.steps[3].out.value);
  EXPECT_EQ(l.steps[2].out.col, 0);
  EXPECT_EQ(l.values[size_t(l.steps[2].out.value)].width, 4 * 8);
  EXPECT_EQ(l.steps[6].in3.value, l.steps[1].out.value);
  every_param_used_once(d, p);
}

// Gemma-3 in both config layouts: the features it added are all in the program.
TEST(LayerProgram, Gemma3SandwichNormsGegluScaledEmbeddingLocalRope) {
  json legacy = base("Gemma3ForCausalLM");
  legacy["num_hidden_layers"] = 4;
  legacy["sliding_window"] = 16;
  legacy["sliding_window_pattern"] = 2;
  legacy["query_pre_attn_scalar"] = 12;
  legacy["rope_theta"] = 1000000.0;
  legacy["rope_local_base_freq"] = 10000.0;
  legacy["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 8.0}};
  json v5 = legacy;
  v5.erase("rope_theta");
  v5.erase("rope_local_base_freq");
  v5.erase("rope_scaling");
  v5.erase("sliding_window_pattern");
  v5["layer_types"] = {"sliding_attention", "full_attention", "sliding_attention", "full_attention"};
  v5["rope_parameters"] = {
      {"full_attention", {{"rope_type", "linear"}, {"factor", 8.0}, {"rope_theta", 1000000.0}}},
      {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10000.0}}}};
  for (const json& c : {legacy, v5}) {
    const sdk::TransformerDesc d = model::describe(c);
    const sdk::ModelProgram p = sdk::build_program(d);
    every_param_used_once(d, p);
    EXPECT_NEAR(p.embed_scale, std::sqrt(32.0), 1e-12);
    EXPECT_EQ(p.final_offset, 1.0);
    EXPECT_EQ(p.head, p.embed);  // tied by default
    ASSERT_EQ(p.ropes.size(), 2u);
    for (size_t i = 0; i < p.layers.size(); ++i) {
      const sdk::LayerProgram& l = p.layers[i];
      EXPECT_EQ(ops(l), (std::vector<StepOp>{StepOp::norm, StepOp::linear, StepOp::head_norm, StepOp::head_norm,
                                              StepOp::rope, StepOp::rope, StepOp::attention, StepOp::linear,
                                              StepOp::norm, StepOp::add, StepOp::norm, StepOp::linear,
                                              StepOp::glu, StepOp::linear, StepOp::norm, StepOp::add}));
      const bool sliding = i % 2 == 0;
      const sdk::LayerStep& att = l.steps[6];
      EXPECT_EQ(att.window, sliding ? 16 : 0);
      EXPECT_NEAR(att.scale, 1.0 / std::sqrt(12.0), 1e-12);
      const sdk::RopeTable& t = p.ropes[size_t(l.steps[4].table)];
      EXPECT_EQ(t.rope.kind, sliding ? sdk::RopeKind::default_ : sdk::RopeKind::linear);
      EXPECT_EQ(t.rope.theta, sliding ? 10000.0 : 1000000.0);
      for (int s : {0, 2, 3, 8, 10, 14}) EXPECT_EQ(l.steps[size_t(s)].offset, 1.0) << s;
      EXPECT_EQ(l.steps[12].act, "gelu_tanh");
      // The post-norm's input is kept (its backward reads it); its output becomes h in place.
      EXPECT_TRUE(value_of(l, l.steps[8].in).saved);
      EXPECT_EQ(l.root(l.steps[9].out.value), l.steps[8].out.value);
    }
    sdk::ExecutorCaps silu_only{"old executor"};
    EXPECT_NE(sdk::unsupported(p, silu_only).find("gelu_tanh"), std::string::npos);
  }
}

TEST(LayerProgram, Gemma2SoftcappingIsNamedByUnsupported) {
  json c = base("Gemma2ForCausalLM");
  const sdk::ModelProgram p = sdk::build_program(model::describe(c));
  sdk::ExecutorCaps caps{"engine"};
  caps.activations = {"silu", "gelu_tanh"};
  const std::string why = sdk::unsupported(p, caps);
  EXPECT_NE(why.find("soft-capping"), std::string::npos) << why;
  EXPECT_EQ(why.rfind("engine: ", 0), 0u) << why;
  caps.logit_softcap = caps.attention_softcap = true;
  EXPECT_EQ(sdk::unsupported(p, caps), "");
}

TEST(LayerProgram, MoeAndMlaAreCompositeSteps) {
  json m = base("MixtralForCausalLM");
  m["num_local_experts"] = 4;
  m["num_experts_per_tok"] = 2;
  const sdk::TransformerDesc md = model::describe(m);
  const sdk::ModelProgram mp = sdk::build_program(md);
  EXPECT_EQ(ops(mp.layers[0])[8], StepOp::moe);
  every_param_used_once(md, mp);
  sdk::ExecutorCaps caps{"gen"};
  EXPECT_NE(sdk::unsupported(mp, caps).find("mixture-of-experts"), std::string::npos);

  json ds = base("DeepseekV3ForCausalLM");
  ds.update({{"n_routed_experts", 4}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 16},
             {"first_k_dense_replace", 1}, {"n_group", 1}, {"topk_group", 1}, {"q_lora_rank", 12},
             {"kv_lora_rank", 8}, {"qk_rope_head_dim", 4}, {"qk_nope_head_dim", 8}, {"v_head_dim", 6},
             {"num_key_value_heads", 4}});
  const sdk::TransformerDesc dd = model::describe(ds);
  const sdk::ModelProgram dp = sdk::build_program(dd);
  const sdk::LayerProgram& l = dp.layers[0];
  EXPECT_EQ(ops(l)[1], StepOp::mla);
  EXPECT_EQ(l.steps[1].out2.width, 4 * (2 * 12 + 6));
  EXPECT_EQ(l.steps[1].out.width, 4 * 6);
  EXPECT_EQ(ops(dp.layers[1])[5], StepOp::moe);
  every_param_used_once(dd, dp);
  caps.moe = true;
  EXPECT_NE(sdk::unsupported(dp, caps).find("latent attention"), std::string::npos);
}

// Which products an executor may run with their residual add as one op (gemm_add_fwd): the o
// and down projections of a dense layer; not Gemma-3's (a norm sits between them and the add),
// not a mixture-of-experts block's; and not once another step reads the product's value.
TEST(LayerProgram, ProductThenResidualAdd) {
  auto fusable = [](const sdk::LayerProgram& l) {
    std::vector<size_t> v;
    for (size_t i = 0; i < l.steps.size(); ++i)
      if (sdk::product_then_residual_add(l, i)) v.push_back(i);
    return v;
  };
  const sdk::ModelProgram p = sdk::build_program(model::describe(base("LlamaForCausalLM")));
  EXPECT_EQ(fusable(p.layers[0]), (std::vector<size_t>{5, 10}));  // o, down
  json b = base("LlamaForCausalLM");
  b["attention_bias"] = true;  // biases are the executor's to check: the structure is the same
  EXPECT_EQ(fusable(sdk::build_program(model::describe(b)).layers[1]), (std::vector<size_t>{5, 10}));

  json g = base("Gemma3ForCausalLM");
  g["query_pre_attn_scalar"] = 8;
  EXPECT_TRUE(fusable(sdk::build_program(model::describe(g)).layers[0]).empty());

  json m = base("MixtralForCausalLM");
  m["num_local_experts"] = 4;
  m["num_experts_per_tok"] = 2;
  EXPECT_EQ(fusable(sdk::build_program(model::describe(m)).layers[0]), (std::vector<size_t>{5}));  // o only

  // Another reader of o's output (say a step added after the add): not fusable; the last step
  // (nothing after it) never is.
  sdk::LayerProgram l = p.layers[0];
  sdk::LayerStep extra = l.steps[6];
  extra.in2 = l.steps[5].out;
  l.steps.push_back(extra);
  EXPECT_FALSE(sdk::product_then_residual_add(l, 5));
  EXPECT_FALSE(sdk::product_then_residual_add(l, l.steps.size() - 1));
  // The add's output in the product's input storage: the product would overwrite what it reads.
  sdk::LayerProgram a = p.layers[0];
  a.values[size_t(a.steps[6].out.value)].storage = a.steps[5].in.value;
  EXPECT_FALSE(sdk::product_then_residual_add(a, 5));
}

TEST(LayerProgram, RefusesInconsistentDescriptionsNamingTheLayer) {
  sdk::TransformerDesc d = model::describe(base("LlamaForCausalLM"));
  for (auto& p : d.params)
    if (p.layer == 1 && p.role == sdk::ParamRole::up) p.shape = {47, 32};
  try {
    sdk::build_program(d);
    ADD_FAILURE() << "a wrong shape was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("layer 1"), std::string::npos) << m;
    EXPECT_NE(m.find("up_proj"), std::string::npos) << m;
  }
  d = model::describe(base("LlamaForCausalLM"));
  d.layers[0].mlp.hidden_act = "relu";
  EXPECT_THROW(sdk::build_program(d), std::invalid_argument);
}
