// DeepSeek's multi-head latent attention and the MoE router's precision, generator against
// trainer: logprobs of random MLA models (yarn, direct q projection) at float rounding of the
// engine's, refit of an MLA model by views of the trainer's buffers, and the float64 router
// (NeMo-RL's moe_router_dtype: fp64) routing as the float64 trainer does — on every MoE fixture
// and on a model whose routers are built to tie, where a float32 router cannot.
// (The fixtures' greedy outputs, deepseek-v3-tiny's included, are test_generator.cpp's.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "generator_test_util.hpp"
#include "kernels_cpu_abi.hpp"
#include "rlhost/model/llama_family.hpp"
#include "rlhost/sdk/safetensors.hpp"

using namespace rlh;
using namespace rlh::gen;
using namespace rlh::gen::test;

namespace {

void expect_rounding(const Mismatch& m, const std::string& what) {
  std::printf("%s: mean |dlp| %.3g, max %.3g, token_mult_prob_error %.9f over %lld tokens\n", what.c_str(),
              m.mean_abs, m.max_abs, m.token_mult_prob_error, (long long)m.tokens);
  EXPECT_GT(m.tokens, 0) << what;
  EXPECT_LT(m.mean_abs, 1e-5) << what;
  EXPECT_LT(m.max_abs, 1e-4) << what;
  EXPECT_LT(m.token_mult_prob_error - 1.0, 1e-5) << what;
}

// ---------------------------------------------------------------------------------------------
// MLA

TEST(Mla, CachesExpandedKeysAndValuesOfTheirOwnWidths) {
  const sdk::TransformerDesc d = deepseek_desc();
  Generator g(d, gen_options());
  const KvLayout l = g.model().kv_layout(16);
  for (size_t i = 0; i < l.kv_heads.size(); ++i) {
    EXPECT_EQ(l.kv_heads[i], 4) << "one expanded key and value per query head";
    EXPECT_EQ(l.head_dim[i], 16 + 8) << "k_nope | k_rot";
    EXPECT_EQ(l.value_dim[i], 12);
  }
  EXPECT_EQ(l.block_elems, 3 * 16 * 4 * (24 + 12));
  // The description's softmax scale carries yarn's mscale(factor, mscale_all_dim)^2, and the
  // generator takes it as given.
  const double m = 0.1 * 0.8 * std::log(4.0) + 1.0;
  EXPECT_NEAR(g.model().shapes()[0].scale, 1.0 / std::sqrt(24.0) * m * m, 1e-7);
}

TEST(Mla, LogprobsMatchTheTrainerUnderEveryFilter) {
  // The default (q latent, yarn, interleaved) and the variant without q_lora_rank and with the
  // half-split default RoPE: both q paths and both rotations.
  for (const std::string& extra :
       {std::string("{}"),
        std::string(R"({"q_lora_rank": null, "rope_interleave": false, "rope_scaling": null})")}) {
    const sdk::TransformerDesc desc = deepseek_desc(extra);
    ASSERT_EQ(desc.layers[0].attention.kind, sdk::AttentionKind::mla);
    ASSERT_EQ(desc.layers[0].attention.q_lora_rank, extra == "{}" ? 24 : 0);
    const auto weights = random_weights(desc, 31);
    engine::Engine eng(desc, rlh::test::engine_options());
    eng.load_parameters(weights);
    Generator g(desc, gen_options());
    g.weights().load(weights, 0);
    // Prompts across block boundaries and a long one prefilled in chunks.
    const auto prompts = random_prompts(4, desc.vocab_size, 9, {3, 17, 40, 7});
    for (const SamplingParams sp : {SamplingParams{0.0, 0, 1.0, 0.0}, SamplingParams{0.7, 50, 1.0, 0.0},
                                    SamplingParams{1.3, 0, 0.9, 0.0}}) {
      Request r;
      r.sampling = sp;
      r.samples_per_prompt = 3;
      r.max_new_tokens = 24;
      r.seed = 5;
      Outs outs;
      run(g, prompts, r, 0, outs);
      const Mismatch m = trainer_mismatch(eng, prompts, 0, outs, sp);
      EXPECT_EQ(m.tokens, 4 * 3 * 24);
      char what[160];
      std::snprintf(what, sizeof what, "MLA %s T=%.1f top_k=%lld top_p=%.2f", extra == "{}" ? "q_lora" : "q_proj",
                    sp.temperature, (long long)sp.top_k, sp.top_p);
      expect_rounding(m, what);
    }
  }
}

TEST(Mla, RefitByViewsOfTheTrainersBuffers) {
  const sdk::TransformerDesc desc = deepseek_desc();
  const auto weights = random_weights(desc, 41);
  engine::Engine eng(desc, rlh::test::engine_options());
  eng.load_parameters(weights);
  // Every HF tensor as a view into the engine's own buffers: stacked experts as slabs of their
  // [E, ...] tensor, every MLA projection and norm whole.
  std::vector<rlh_named_tensor> views;
  std::vector<std::vector<int64_t>> shapes;
  size_t pieces = 0;
  for (const sdk::ParamDesc& p : desc.params) pieces += p.hf_names.size();
  shapes.reserve(pieces);
  int mla_params = 0;
  for (size_t i = 0; i < desc.params.size(); ++i) {
    const sdk::ParamDesc& p = desc.params[i];
    ASSERT_NE(p.transform, sdk::ParamTransform::concat) << p.name;
    mla_params += p.role == sdk::ParamRole::q_a || p.role == sdk::ParamRole::q_a_norm || p.role == sdk::ParamRole::q_b ||
                  p.role == sdk::ParamRole::kv_a || p.role == sdk::ParamRole::kv_a_norm || p.role == sdk::ParamRole::kv_b;
    int64_t n = 1;
    for (int64_t d : p.hf_shapes[0]) n *= d;
    for (size_t k = 0; k < p.hf_names.size(); ++k) {
      shapes.push_back(p.hf_shapes[k]);
      rlh_named_tensor t{};
      t.name = p.hf_names[k].c_str();
      t.tensor.data = eng.param(i).data() + (p.transform == sdk::ParamTransform::stack ? int64_t(k) * n : 0);
      t.tensor.device = rlh_device{RLH_DEVICE_CPU, 0};
      t.tensor.ndim = int32_t(shapes.back().size());
      t.tensor.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
      t.tensor.shape = shapes.back().data();
      views.push_back(t);
    }
  }
  EXPECT_EQ(mla_params, 3 * 6);
  Generator g(desc, gen_options());
  g.weights().update(1, views, true);
  EXPECT_EQ(g.weights().owned_bytes(), 0) << "no MLA or MoE weight may be copied";
  for (size_t i = 0; i < desc.params.size(); ++i) EXPECT_EQ(g.weights().param(i), eng.param(i).data()) << desc.params[i].name;

  const auto prompts = random_prompts(3, desc.vocab_size, 6, {5, 18, 2});
  Request r;
  r.sampling = SamplingParams{1.0, 0, 1.0, 0.0};
  r.samples_per_prompt = 2;
  r.max_new_tokens = 12;
  r.seed = 8;
  Generator loaded(desc, gen_options());
  loaded.weights().load(weights, 1);
  Outs want, got;
  run(loaded, prompts, r, 0, want);
  run(g, prompts, r, 0, got);
  expect_same(want, got, "MLA views");

  // The trainer updates in place; the next refit sees it without a copy.
  for (size_t i = 0; i < eng.num_params(); ++i)
    for (float& x : eng.param(i)) x *= 1.2f;
  g.weights().update(2, views, true);
  EXPECT_EQ(g.weights().owned_bytes(), 0);
  std::vector<std::vector<float>> scaled = weights;
  for (auto& t : scaled)
    for (float& x : t) x *= 1.2f;
  Generator fresh(desc, gen_options());
  fresh.weights().load(scaled, 2);
  Outs want2, got2;
  run(fresh, prompts, r, 0, want2);
  run(g, prompts, r, 0, got2);
  expect_same(want2, got2, "MLA views after the trainer's update");
  bool changed = false;
  for (const auto& [k, o] : got2) changed = changed || o.ids != want.at(k).ids;
  EXPECT_TRUE(changed);
}

// ---------------------------------------------------------------------------------------------
// The float64 router

bool has_moe(const sdk::TransformerDesc& d) {
  for (const auto& l : d.layers)
    if (l.mlp.kind == sdk::MlpKind::moe) return true;
  return false;
}

TEST(MoeRouterFp64, MatchesTheFp64TrainerOnEveryMoeFixture) {
  int ran = 0;
  for (const std::string& dir : fixture_models()) {
    const std::string name = std::filesystem::path(dir).filename().string();
    std::ifstream in(dir + "/config.json");
    const std::string arch = nlohmann::json::parse(in).value("architectures", nlohmann::json::array({""}))[0];
    if (!model::is_supported_architecture(arch)) continue;
    sdk::TransformerDesc desc = model::describe_model_dir(dir);
    if (!has_moe(desc)) continue;
    const auto ckpt = sdk::st::Checkpoint::open(dir + "/model.safetensors");
    const sdk::LoadResult w = sdk::load_weights_f32(desc, ckpt);
    engine::EngineOptions eo = rlh::test::engine_options();
    eo.moe.router_fp64 = true;
    engine::Engine eng(desc, eo);
    eng.load_parameters(w.tensors);
    Options o = gen_options();
    o.moe_router_fp64 = true;
    Generator g(desc, o);
    g.weights().load(w.tensors, 0);
    const auto ref = sdk::st::File::open(dir + "/reference.safetensors");
    const auto& pi = ref.at("greedy_prompt");
    const std::vector<double> p = ref.read_f64("greedy_prompt");
    std::vector<std::vector<int32_t>> prompts(size_t(pi.shape[0]));
    for (int64_t b = 0; b < pi.shape[0]; ++b)
      for (int64_t t = 0; t < pi.shape[1]; ++t) prompts[size_t(b)].push_back(int32_t(p[size_t(b * pi.shape[1] + t)]));
    for (const SamplingParams sp : {SamplingParams{0.0, 0, 1.0, 0.0}, SamplingParams{0.8, 40, 0.9, 0.0}}) {
      Request r;
      r.sampling = sp;
      r.samples_per_prompt = 4;
      r.max_new_tokens = 24;
      r.seed = 7;
      Outs outs;
      run(g, prompts, r, 0, outs);
      expect_rounding(trainer_mismatch(eng, prompts, 0, outs, sp),
                      name + " router fp64 " + (sp.greedy() ? "greedy" : "T=0.8 top_k=40 top_p=0.9"));
    }
    ++ran;
  }
  EXPECT_GE(ran, 4) << "mixtral, qwen2-moe, qwen3-moe and deepseek-v3 fixtures";
}

TEST(MoeRouterFp64, RoutesTiedExpertsAsTheFp64TrainerDoes) {
  const TiedRouterModel m = tied_router_moe();
  engine::EngineOptions eo = rlh::test::engine_options();
  eo.moe.router_fp64 = true;
  engine::Engine eng(m.desc, eo), eng32(m.desc, rlh::test::engine_options());
  eng.load_parameters(m.weights);
  eng32.load_parameters(m.weights);
  Options o64 = gen_options();
  o64.moe_router_fp64 = true;
  Generator g64(m.desc, o64), g32(m.desc, gen_options());
  g64.weights().load(m.weights, 0);
  g32.weights().load(m.weights, 0);
  EXPECT_TRUE(g64.model().router_fp64());
  EXPECT_FALSE(g32.model().router_fp64());
  const auto prompts = random_prompts(6, m.desc.vocab_size, 12, {9, 20, 4});
  // Greedy at temperature 1 logprobs, and sampling: the trainer scores the generator's tokens.
  for (const SamplingParams sp : {SamplingParams{0.0, 0, 1.0, 0.0}, SamplingParams{1.0, 0, 1.0, 0.0}}) {
    Request r;
    r.sampling = sp;
    r.samples_per_prompt = 2;
    r.max_new_tokens = 24;
    r.seed = 3;
    Outs o64s, o32s;
    run(g64, prompts, r, 0, o64s);
    run(g32, prompts, r, 0, o32s);
    const std::string what = sp.greedy() ? "greedy" : "T=1";
    expect_rounding(trainer_mismatch(eng, prompts, 0, o64s, sp), "tied routers, fp64 both sides, " + what);
    // The float32 router picks the other of two tied experts on some tokens, and those tokens'
    // logprobs are then off by far more than rounding: the float64 setting is what matches.
    const Mismatch m32 = trainer_mismatch(eng, prompts, 0, o32s, sp);
    std::printf("tied routers, generator fp32 vs trainer fp64, %s: mean |dlp| %.3g, max %.3g\n", what.c_str(),
                m32.mean_abs, m32.max_abs);
    EXPECT_GT(m32.max_abs, 1e-3) << "the tied routers were meant to split on rounding";
    // Both in float32 (the default on both sides) they split as well: their products round in
    // different orders. This is what the setting is for.
    const Mismatch both32 = trainer_mismatch(eng32, prompts, 0, o32s, sp);
    std::printf("tied routers, fp32 both sides, %s: mean |dlp| %.3g, max %.3g\n", what.c_str(), both32.mean_abs,
                both32.max_abs);
    EXPECT_GT(both32.max_abs, 1e-3) << "float32 routers of generator and trainer were meant to disagree here";
  }
  // Routing in float64 keeps a token's result independent of its batch.
  Request r;
  r.sampling = SamplingParams{1.0, 0, 1.0, 0.0};
  r.max_new_tokens = 16;
  r.seed = 4;
  Outs together, alone;
  run(g64, prompts, r, 0, together);
  for (int64_t i = int64_t(prompts.size()) - 1; i >= 0; --i) run(g64, {prompts[size_t(i)]}, r, i, alone);
  expect_same(together, alone, "fp64 router: batch vs one by one");
}

}  // namespace
