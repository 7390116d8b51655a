// The CUDA engine's FP8 linears (CudaEngineOptions::fp8, src/fp8_linear.hpp) against the same
// engine in bf16, on a synthetic Llama whose shapes FP8 takes (multiples of 128). Label `gpu`.
// The FP8 products come from whatever provider on the plugin path answers them (the engine names
// none): examples/vendor_fp8 in a device run (scripts/device_gpu.sh fp8 puts it on the path).
// Where no provider runs FP8 the tests skip naming why, unless RLH_EXPECT_FP8_PROVIDER=1 (the
// device run), where that is a failure.
//
// Delayed scaling (Fp8Options::delayed) runs the recipes' tests too, and its own below: the
// amax history sets the scale, and its state carries a run across a checkpoint bit for bit.
//
// Bounds: an e4m3 operand carries 3 mantissa bits (relative rounding up to 2^-4), so each
// product differs from bf16 by up to a few percent per element; over a 4-layer model with the
// first and last layers and the head in bf16 the loss moves by well under 1% and the gradients
// by up to ~10% (the vendor's own linear-layer test bounds one product at 1e-1, e5m2 at 2e-1).
#include <array>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
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

engine::Fp8Options recipe(bool blockwise, bool hybrid, bool delayed = false) {
  engine::Fp8Options f;
  f.enabled = true;
  f.blockwise = blockwise;
  f.hybrid = hybrid;
  f.delayed = delayed;
  return f;
}

struct Case {
  const char* name;
  bool blockwise, hybrid, delayed = false;
};
class Fp8Recipe : public ::testing::TestWithParam<Case> {};

// One training step's loss, logprobs and every gradient against bf16; the FP8 layers' products
// all ran in FP8 (2 layers of 4 x 4 linear steps: 8 forward, 16 backward products).
TEST_P(Fp8Recipe, StepFollowsBf16) {
  const Case c = GetParam();
  MAKE_OR_SKIP(f8, recipe(c.blockwise, c.hybrid, c.delayed));
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
  MAKE_OR_SKIP(f8, recipe(c.blockwise, c.hybrid, c.delayed));
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
  // The FP8 run's fall within 10% of bf16's (delayed scaling: 20%). H100 (2026-12-05), 6.294 ->
  // bf16 4.476: tensorwise e4m3 4.475, hybrid 4.380, blockwise 4.384 (5.3% of the fall); delayed
  // e4m3 4.518 (2.3%), delayed hybrid 4.742 (14.6%): a gradient scale from the last step's amax
  // (Megatron's default history of 1) saturates the largest entries wherever this step's
  // gradients grew, which this quickly memorising run does. Stale FP8 weight copies would stall
  // it far outside.
  EXPECT_NEAR(first - last_f8, first - last_ref, (c.delayed ? 0.2 : 0.1) * (first - last_ref)) << c.name;
}

INSTANTIATE_TEST_SUITE_P(Recipes, Fp8Recipe,
                         ::testing::Values(Case{"tensorwise_e4m3", false, false}, Case{"tensorwise_hybrid", false, true},
                                           Case{"blockwise_e4m3", true, false},
                                           Case{"delayed_e4m3", false, false, true},
                                           Case{"delayed_hybrid", false, true, true}),
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

// Blockwise: cuBLASLt's per-token scales take token counts in multiples of 16 for the forward
// and dX (it had no algorithm for 378), of 128 for dW. 200 tokens run every product in bf16
// rather than failing mid-step; 208 run the forward and dX in FP8, dW in bf16.
TEST(Fp8Shapes, BlockwiseTokenCountsFallBackToBf16WhereTheScalesCannotLieAligned) {
  for (const auto [T, want_fp8, want_bf16] : {std::array<int64_t, 3>{200, 0, 24}, std::array<int64_t, 3>{208, 16, 8}}) {
    MAKE_OR_SKIP(f8, recipe(true, false));
    Batch b(1, T, 3);
    engine::StepOptions so;
    so.lr = 0;
    so.apply_optimizer = false;
    so.global_tokens = T - 1;
    const double loss = f8->train_step({&b.mb, 1}, so, nll).loss;
    EXPECT_TRUE(std::isfinite(loss)) << T;
    EXPECT_EQ(f8->stats().fp8_gemms, want_fp8) << T;
    EXPECT_EQ(f8->stats().fp8_layer_bf16_gemms, want_bf16) << T;
  }
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

// ---- Delayed scaling (Fp8Options::delayed)

engine::Fp8Options delayed(int64_t len, bool max) {
  engine::Fp8Options f = recipe(false, false, true);
  f.amax_history_len = len;
  f.amax_max = max;
  return f;
}

bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0)
      return false;
  return true;
}

double worst_rel(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double w = 0;
  for (size_t i = 0; i < a.size(); ++i) w = std::max(w, rel(a[i], b[i]));
  return w;
}

// Gradients only (no update): the weights stay, so each step sees the same activations.
engine::StepOptions grads_only(int64_t global_tokens) {
  engine::StepOptions so;
  so.lr = 0;
  so.apply_optimizer = false;
  so.global_tokens = global_tokens;
  return so;
}

// The history sets the scale: after a step whose loss gradients are 254 times larger
// (global_tokens 1 instead of 254), a delayed engine keeping the max of 2 entries quantises the
// next step's gradients with the old, larger amax, so its gradients differ from current
// scaling's; a fresh delayed engine's first step takes its own amax and matches current scaling
// bit for bit (the same scale, the same products).
TEST(Fp8Delayed, HistoryMaxKeepsAnEarlierLargeAmax) {
  MAKE_OR_SKIP(d, delayed(2, true));
  std::string why;
  auto cur = make(recipe(false, false), &why);
  auto fresh = make(delayed(2, true), &why);
  ASSERT_TRUE(cur && fresh) << why;
  Batch b(2, kT, 6);
  const int64_t n = 2 * (kT - 1);
  cur->train_step({&b.mb, 1}, grads_only(1), nll);
  d->train_step({&b.mb, 1}, grads_only(1), nll);
  EXPECT_TRUE(same_bits(cur->gradients(), d->gradients())) << "a first step scales by its own amax";
  cur->train_step({&b.mb, 1}, grads_only(n), nll);
  d->train_step({&b.mb, 1}, grads_only(n), nll);
  fresh->train_step({&b.mb, 1}, grads_only(n), nll);
  const auto g_cur = cur->gradients(), g_d = d->gradients(), g_fresh = fresh->gradients();
  EXPECT_TRUE(same_bits(g_fresh, g_cur));
  const double off = worst_rel(g_d, g_cur);
  std::printf("delayed (max of 2) after a 254x step: worst gradient vs current scaling %.3g\n", off);
  EXPECT_GT(off, 1e-3);
}

// most_recent with one entry (Megatron's default): each step scales by the previous step's
// amax. After the large step the next one's gradients differ from current scaling's. The forward
// inputs see the same amax every step (same batch, same weights), so the third step's loss is
// current scaling's exactly. (Its gradients are not: the second step's distorted dX left other
// amaxes in the histories of the gradient sites below the first one the backward reaches.)
TEST(Fp8Delayed, MostRecentForgetsAfterOneStep) {
  MAKE_OR_SKIP(d, delayed(1, false));
  std::string why;
  auto cur = make(recipe(false, false), &why);
  ASSERT_TRUE(cur) << why;
  Batch b(2, kT, 7);
  const int64_t n = 2 * (kT - 1);
  cur->train_step({&b.mb, 1}, grads_only(1), nll);
  d->train_step({&b.mb, 1}, grads_only(1), nll);
  cur->train_step({&b.mb, 1}, grads_only(n), nll);
  d->train_step({&b.mb, 1}, grads_only(n), nll);
  EXPECT_GT(worst_rel(d->gradients(), cur->gradients()), 1e-3);
  // The forward's inputs saw the same amax every step: the loss is current scaling's exactly.
  const double l_cur = cur->train_step({&b.mb, 1}, grads_only(n), nll).loss;
  const double l_d = d->train_step({&b.mb, 1}, grads_only(n), nll).loss;
  EXPECT_EQ(l_d, l_cur);
}

// A checkpoint: after 3 AdamW steps the weights, moments and amax histories are saved; a fresh
// engine given all three continues bit for bit as the first does; one without the histories
// (fresh ones: each site's first call takes its own amax) does not. Bad states are refused.
TEST(Fp8Delayed, CheckpointContinuesBitwise) {
  MAKE_OR_SKIP(a, delayed(4, true));
  std::string why;
  auto restored = make(delayed(4, true), &why);
  auto without = make(delayed(4, true), &why);
  ASSERT_TRUE(restored && without) << why;
  const int64_t n = 2 * (kT - 1);
  auto step = [&](engine::CudaEngine& e, int i) {
    Batch b(2, kT, 10 + i);
    engine::StepOptions so;
    so.lr = 1e-3;
    so.global_tokens = i == 1 ? 8 : n;  // one step with large gradients, which the histories keep
    return e.train_step({&b.mb, 1}, so, nll).loss;
  };
  for (int i = 0; i < 3; ++i) step(*a, i);
  const auto params = a->save_parameters();
  const auto adam = a->adam_state();
  const std::string fp8 = a->fp8_state();
  ASSERT_FALSE(fp8.empty());
  std::vector<double> want;
  for (int i = 3; i < 5; ++i) want.push_back(step(*a, i));
  const auto want_params = a->save_parameters();

  for (engine::CudaEngine* e : {restored.get(), without.get()}) {
    e->load_parameters(params);
    e->load_adam_state(adam);
  }
  restored->load_fp8_state(fp8);
  EXPECT_EQ(restored->fp8_state(), fp8) << "the state reads back as saved";
  for (int i = 3; i < 5; ++i) EXPECT_EQ(step(*restored, i), want[size_t(i - 3)]) << "step " << i;
  EXPECT_TRUE(same_bits(restored->save_parameters(), want_params));
  for (int i = 3; i < 5; ++i) step(*without, i);
  EXPECT_FALSE(same_bits(without->save_parameters(), want_params)) << "fresh histories scale otherwise";

  // Refusals, by name: another history length, an engine without delayed scaling, bytes that
  // are no state; an engine without delayed scaling has no state to save.
  auto other_len = make(delayed(8, true), &why);
  auto current = make(recipe(false, false), &why);
  ASSERT_TRUE(other_len && current) << why;
  try {
    other_len->load_fp8_state(fp8);
    ADD_FAILURE() << "another history length loaded";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fp8_amax_history_len = 4, this run has 8"), std::string::npos) << e.what();
  }
  EXPECT_THROW(current->load_fp8_state(fp8), std::invalid_argument);
  EXPECT_TRUE(current->fp8_state().empty());
  EXPECT_THROW(restored->load_fp8_state(fp8.substr(0, fp8.size() - 3)), std::invalid_argument);
  EXPECT_THROW(restored->load_fp8_state("not a state"), std::invalid_argument);
}

// Full activation recompute would quantise each input a second time: refused by name.
TEST(Fp8Delayed, FullRecomputeIsRefused) {
  std::string why;
  if (!engine::cuda_engine_available(&why) || test::cuda_registry() == nullptr) GTEST_SKIP() << why;
  engine::CudaEngineOptions o = test::cuda_options();
  o.fp8 = delayed(1, false);
  o.recompute = engine::Recompute::full;
  try {
    engine::CudaEngine e(tiny_llama(), o);
    ADD_FAILURE() << "full recompute with delayed scaling was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fp8_recipe = delayed with full activation recompute"), std::string::npos)
        << e.what();
  }
}

}  // namespace
