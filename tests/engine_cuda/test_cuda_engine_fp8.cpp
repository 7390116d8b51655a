// The CUDA engine's FP8 linears (CudaEngineOptions::fp8, src/fp8_linear.hpp) against the same
// engine in bf16, on a synthetic Llama whose shapes FP8 takes (multiples of 128). Label `gpu`.
// The FP8 products come from whatever provider on the plugin path answers them (the engine names
// none): examples/vendor_fp8 in a device run (scripts/device_gpu.sh fp8 puts it on the path).
// Where no provider runs FP8 the tests skip naming why, unless RLH_EXPECT_FP8_PROVIDER=1 (the
// device run), where that is a failure.
//
// Bounds: an e4m3 operand carries 3 mantissa bits (relative rounding up to 2^-4), so each
// product differs from bf16 by up to a few percent per element; over a 4-layer model with the
// first and last layers and the head in bf16 the loss moves by well under 1% and the gradients
// by up to ~10% (the vendor's own linear-layer test bounds one product at 1e-1, e5m2 at 2e-1).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels_cuda_abi.hpp"
#include "nll_loss.hpp"
#include "rlhost/engine_cuda/cuda_engine.hpp"
#include "rlhost/model/llama_family.hpp"

using namespace rlh;

namespace {

constexpr int64_t kLayers = 4, kT = 128;

sdk::TransformerDesc tiny_llama() {
  const nlohmann::json cfg = {{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", 512}, {"hidden_size", 256},
                              {"intermediate_size", 512}, {"num_hidden_layers", kLayers}, {"num_attention_heads", 4},
                              {"num_key_value_heads", 2}, {"head_dim", 64}, {"max_position_embeddings", 4096},
                              {"rms_norm_eps", 1e-5}, {"rope_theta", 10000.0}, {"tie_word_embeddings", false},
                              {"torch_dtype", "bfloat16"}};
  return model::describe(cfg);
}

std::vector<std::vector<float>> random_weights(const sdk::TransformerDesc& d) {
  std::vector<std::vector<float>> w;
  uint32_t x = 2024;
  for (const auto& p : d.params) {
    int64_t n = 1;
    for (int64_t s : p.shape) n *= s;
    std::vector<float> t(static_cast<size_t>(n));
    for (float& v : t) {
      x = x * 1664525u + 1013904223u;
      v = p.shape.size() == 1 ? 1.0f : 0.08f * (float(x >> 8) * (1.0f / 16777216.0f) - 0.5f);
    }
    w.push_back(std::move(t));
  }
  return w;
}

// B sequences of T tokens: arithmetic progressions, so a few steps lower the loss.
struct Batch {
  std::vector<int32_t> ids, cu;
  engine::MicroBatch mb;
  Batch(int64_t B, int64_t T, int seed) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) ids.push_back(int32_t((seed * 37 + b * 11 + t * (1 + (b + seed) % 5)) % 512));
    for (int64_t b = 0; b <= B; ++b) cu.push_back(int32_t(b * T));
    mb.input_ids = ids;
    mb.cu_seqlens = cu;
  }
};

constexpr auto nll = test::nll_loss;

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::fabs(double(a[i]) - double(b[i])));
    m = std::max(m, std::fabs(double(b[i])));
  }
  return m > 0 ? d / m : d;
}

// An engine with fp8 (or bf16 when !f.enabled); null with *why where no provider runs it.
std::unique_ptr<engine::CudaEngine> make(const engine::Fp8Options& f, std::string* why) {
  if (!engine::cuda_engine_available(why)) return nullptr;
  if (test::cuda_registry() == nullptr) {
    *why = "no kernel provider runs on cuda:0";
    return nullptr;
  }
  engine::CudaEngineOptions o = test::cuda_options();
  o.optimizer.weight_decay = 0.0;
  o.optimizer.max_grad_norm = 0.0;
  o.fp8 = f;
  const sdk::TransformerDesc d = tiny_llama();
  try {
    auto e = std::make_unique<engine::CudaEngine>(d, o);
    e->load_parameters(random_weights(d));
    return e;
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    if (!f.enabled || m.find("fp8_cfg.enabled") == std::string::npos) throw;
    *why = m;
    return nullptr;
  }
}

#define MAKE_OR_SKIP(var, opts)                                                                         \
  std::string why_;                                                                                     \
  auto var = make(opts, &why_);                                                                         \
  if (!var) {                                                                                           \
    const char* expect = std::getenv("RLH_EXPECT_FP8_PROVIDER");                                        \
    if (expect && std::string(expect) == "1" && engine::cuda_engine_available(nullptr)) FAIL() << why_; \
    GTEST_SKIP() << why_;                                                                               \
  }

engine::Fp8Options recipe(bool blockwise, bool hybrid) {
  engine::Fp8Options f;
  f.enabled = true;
  f.blockwise = blockwise;
  f.hybrid = hybrid;
  return f;
}

struct Case {
  const char* name;
  bool blockwise, hybrid;
};
class Fp8Recipe : public ::testing::TestWithParam<Case> {};

// One training step's loss, logprobs and every gradient against bf16; the FP8 layers' products
// all ran in FP8 (2 layers of 4 x 4 linear steps: 8 forward, 16 backward products).
TEST_P(Fp8Recipe, StepFollowsBf16) {
  const Case c = GetParam();
  MAKE_OR_SKIP(f8, recipe(c.blockwise, c.hybrid));
  std::string why;
  auto ref = make(engine::Fp8Options{}, &why);
  ASSERT_TRUE(ref) << why;
  Batch b(2, kT, 1);
  engine::StepOptions so;
  so.lr = 0;  // gradients only: no update
  so.global_tokens = 2 * (kT - 1);
  so.apply_optimizer = false;
  const double l_ref = ref->train_step({&b.mb, 1}, so, nll).loss;
  const double l_f8 = f8->train_step({&b.mb, 1}, so, nll).loss;
  EXPECT_NEAR(l_f8, l_ref, 1e-2 * std::fabs(l_ref)) << c.name;
  const auto g_ref = ref->gradients(), g_f8 = f8->gradients();
  double worst = 0;
  for (size_t i = 0; i < g_ref.size(); ++i) worst = std::max(worst, rel(g_f8[i], g_ref[i]));
  EXPECT_LE(worst, c.hybrid ? 2e-1 : 1.6e-1) << c.name;  // H100: 0.114 tensorwise, 0.146 blockwise, 0.149 hybrid
  const auto st = f8->stats();
  EXPECT_EQ(st.fp8_gemms, 24) << c.name;
  EXPECT_EQ(st.fp8_layer_bf16_gemms, 0) << c.name;
  // Forward logprobs through the same weights (their FP8 copies are remade for the call).
  engine::OutputRequest req;
  const auto lp_ref = ref->forward(b.mb, req).logprob, lp_f8 = f8->forward(b.mb, req).logprob;
  double mean = 0;
  for (size_t i = 0; i < lp_ref.size(); ++i) mean += std::fabs(double(lp_f8[i]) - double(lp_ref[i])) / double(lp_ref.size());
  std::printf("%s: loss %.6f (bf16 %.6f), worst gradient %.3g, mean |dlogprob| %.3g\n", c.name, l_f8, l_ref, worst,
              mean);
  EXPECT_LE(mean, 5e-2) << c.name;
}

// AdamW steps on one batch: the FP8 run's loss falls as bf16's does (its FP8 weight copies are
// remade after each update, or it would stall). On new batches every step at lr 3e-3 neither
// learned in 8 steps (H100: 6.30 -> 6.60 in bf16), so the steps revisit one batch at 1e-3.
TEST_P(Fp8Recipe, AdamStepsFollowBf16) {
  const Case c = GetParam();
  MAKE_OR_SKIP(f8, recipe(c.blockwise, c.hybrid));
  std::string why;
  auto ref = make(engine::Fp8Options{}, &why);
  ASSERT_TRUE(ref) << why;
  double first = 0, last_ref = 0, last_f8 = 0;
  Batch b(2, kT, 5);
  for (int i = 0; i < 8; ++i) {
    engine::StepOptions so;
    so.lr = 1e-3;
    so.global_tokens = 2 * (kT - 1);
    last_ref = ref->train_step({&b.mb, 1}, so, nll).loss;
    last_f8 = f8->train_step({&b.mb, 1}, so, nll).loss;
    if (i == 0) first = last_ref;
  }
  std::printf("%s: loss %.5f -> bf16 %.5f, fp8 %.5f\n", c.name, first, last_ref, last_f8);
  EXPECT_LT(last_ref, first);
  EXPECT_LT(last_f8, first) << c.name;
  // The FP8 run's fall within 10% of bf16's. H100 (2026-12-05), 6.294 -> bf16 4.476: tensorwise
  // e4m3 4.475, hybrid 4.380, blockwise 4.384 (5.3% of the fall). Stale FP8 weight copies would
  // stall it far outside.
  EXPECT_NEAR(first - last_f8, first - last_ref, 0.1 * (first - last_ref)) << c.name;
}

INSTANTIATE_TEST_SUITE_P(Recipes, Fp8Recipe,
                         ::testing::Values(Case{"tensorwise_e4m3", false, false}, Case{"tensorwise_hybrid", false, true},
                                           Case{"blockwise_e4m3", true, false}),
                         [](const auto& i) { return std::string(i.param.name); });

// Shapes FP8 cannot take run in bf16: 200 tokens are no multiple of 16, so every weight
// gradient (a product along tokens) falls back, while the forward and input-gradient products
// stay FP8 (tensorwise).
TEST(Fp8Shapes, TokensNotAMultipleOf16RunTheWeightGradientsInBf16) {
  MAKE_OR_SKIP(f8, recipe(false, false));
  Batch b(1, 200, 3);
  engine::StepOptions so;
  so.lr = 0;
  so.apply_optimizer = false;
  so.global_tokens = 199;
  f8->train_step({&b.mb, 1}, so, nll);
  EXPECT_EQ(f8->stats().fp8_gemms, 16);
  EXPECT_EQ(f8->stats().fp8_layer_bf16_gemms, 8);
}

// The first and last layers stay in bf16 by default; with none kept, every layer's products
// run in FP8.
TEST(Fp8Shapes, Bf16LayersAreTheConfiguredOnes) {
  engine::Fp8Options f = recipe(false, false);
  f.bf16_first_layers = 0;
  f.bf16_last_layers = 0;
  MAKE_OR_SKIP(f8, f);
  Batch b(2, kT, 4);
  engine::StepOptions so;
  so.lr = 0;
  so.apply_optimizer = false;
  so.global_tokens = 2 * (kT - 1);
  f8->train_step({&b.mb, 1}, so, nll);
  EXPECT_EQ(f8->stats().fp8_gemms, 4 * 4 * 3);
}

}  // namespace
