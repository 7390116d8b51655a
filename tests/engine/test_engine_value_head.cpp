// The value head (ParamRole::value_head, HF's score.weight [1, hidden]): value[t] is
// score . final_norm(x_L)[t], unshifted (the prefix ending with token t), checked against a
// float64 sum over the engine's own final-normed hidden state (read through an identity block of
// lm_head); it depends on the prefix alone; its gradients match central differences of the loss,
// alone and together with logprob outputs; packing does not change them; a model without the
// head refuses the output by name.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "kernels_cpu_abi.hpp"
#include "rlhost/engine/engine.hpp"
#include "rlhost/model/llama_family.hpp"
#include "rlhost/sdk/layer_program.hpp"

using namespace rlh;
using engine::Engine;
using engine::MicroBatch;

namespace {

constexpr int64_t kV = 61, kC = 24;

// A small untied Llama with a value head appended as a backend adds it.
sdk::TransformerDesc value_desc(bool with_head = true) {
  nlohmann::json c = {{"architectures", {"LlamaForCausalLM"}},
                      {"vocab_size", kV},
                      {"hidden_size", kC},
                      {"intermediate_size", 40},
                      {"num_hidden_layers", 2},
                      {"num_attention_heads", 4},
                      {"num_key_value_heads", 2},
                      {"max_position_embeddings", 64},
                      {"rms_norm_eps", 1e-5},
                      {"tie_word_embeddings", false},
                      {"torch_dtype", "float32"}};
  sdk::TransformerDesc d = model::describe(c);
  if (with_head) {
    sdk::ParamDesc p;
    p.name = "score.weight";
    p.shape = {1, kC};
    p.role = sdk::ParamRole::value_head;
    p.hf_names = {"score.weight"};
    p.hf_shapes = {p.shape};
    d.params.push_back(p);
  }
  return d;
}

size_t index_of(const Engine& e, sdk::ParamRole role) {
  for (size_t i = 0; i < e.desc().params.size(); ++i)
    if (e.desc().params[i].role == role) return i;
  throw std::runtime_error("no such parameter");
}

void randomize(Engine& e, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0, 1);
  for (size_t i = 0; i < e.num_params(); ++i) {
    const auto& p = e.desc().params[i];
    const bool norm = p.shape.size() == 1;
    for (float& x : e.param(i)) x = norm ? 1.f + 0.2f * n01(rng) : 0.15f * n01(rng);
  }
  for (float& x : e.param(index_of(e, sdk::ParamRole::value_head))) x = n01(rng);
}

struct Batch {
  std::vector<int32_t> ids, cu;
  MicroBatch mb() const {
    MicroBatch m;
    m.input_ids = ids;
    m.cu_seqlens = cu;
    return m;
  }
};

Batch make_batch(const std::vector<int>& lens, int offset = 0) {
  Batch b;
  b.cu.push_back(0);
  for (size_t s = 0; s < lens.size(); ++s) {
    for (int t = 0; t < lens[s]; ++t) b.ids.push_back(int32_t((int(s) * 31 + t * 17 + 5 + offset) % kV));
    b.cu.push_back(int32_t(b.ids.size()));
  }
  return b;
}

engine::OutputRequest value_only() {
  engine::OutputRequest r;
  r.logprob = false;
  r.value = true;
  return r;
}

// Per-position weights of the test losses.
double value_weight(size_t t) { return 0.5 + 0.3 * double(t % 4) - 0.2 * double(t % 3); }

TEST(EngineValueHead, ValueIsTheScoreOfTheFinalNormedHiddenState) {
  Engine e(value_desc(), test::engine_options());
  randomize(e, 3);
  // lm_head rows 0..C-1 = identity: logits[t, c] = final_norm(x_L)[t, c] for c < C.
  std::span<float> head = e.param(index_of(e, sdk::ParamRole::lm_head));
  for (int64_t r = 0; r < kC; ++r)
    for (int64_t c = 0; c < kC; ++c) head[size_t(r * kC + c)] = r == c ? 1.f : 0.f;
  const std::span<const float> score = e.param(index_of(e, sdk::ParamRole::value_head));
  const Batch b = make_batch({9, 1, 14});
  engine::OutputRequest req = value_only();
  req.logits = true;
  const engine::Outputs o = e.forward(b.mb(), req);
  ASSERT_EQ(o.value.size(), b.ids.size());
  double worst = 0;
  for (size_t t = 0; t < b.ids.size(); ++t) {
    double ref = 0;  // float64 dot product of the same hidden state
    for (int64_t c = 0; c < kC; ++c) ref += double(score[size_t(c)]) * double(o.logits[t * size_t(kV) + size_t(c)]);
    worst = std::max(worst, std::fabs(double(o.value[t]) - ref) / std::max(1.0, std::fabs(ref)));
    EXPECT_NE(o.value[t], 0.0f) << "position " << t << " (no position is left out: the value is not shifted)";
  }
  EXPECT_LT(worst, 1e-5);
}

TEST(EngineValueHead, ValueDependsOnThePrefixAlone) {
  Engine e(value_desc(), test::engine_options());
  randomize(e, 5);
  const Batch b = make_batch({12, 7});
  const engine::Outputs packed = e.forward(b.mb(), value_only());
  for (int len : {1, 5, 12}) {
    Batch prefix;
    prefix.ids.assign(b.ids.begin(), b.ids.begin() + len);
    prefix.cu = {0, len};
    const engine::Outputs o = e.forward(prefix.mb(), value_only());
    EXPECT_NEAR(o.value.back(), packed.value[size_t(len - 1)], 1e-5 * std::max(1.f, std::fabs(o.value.back())))
        << "the last position of a prefix of length " << len;
  }
}

// Central differences of the loss in float32 on a sample of every tensor, as the engine's own
// gradient test does: values alone (lm_head then gets no gradient), and values with logprobs.
TEST(EngineValueHead, GradientsMatchFiniteDifferences) {
  for (bool with_logprob : {false, true}) {
    SCOPED_TRACE(with_logprob ? "value + logprob" : "value only");
    Engine e(value_desc(), test::engine_options());
    randomize(e, 11);
    const Batch b = make_batch({9, 14});
    const MicroBatch mb = b.mb();
    engine::StepOptions so;
    so.global_tokens = int64_t(b.ids.size());
    so.apply_optimizer = false;
    so.outputs = value_only();
    so.outputs.logprob = with_logprob;
    const double inv = 1.0 / double(b.ids.size());
    auto loss = [&](const engine::LossContext&, const engine::OutputViews& o, engine::OutputGrads& g) {
      engine::LossResult r;
      for (size_t t = 0; t < o.value.size(); ++t) {
        r.loss += value_weight(t) * o.value[t] * inv;
        g.value[t] = float(value_weight(t) * inv);
        if (with_logprob) {
          r.loss -= 0.7 * o.logprob[t] * inv;
          g.logprob[t] = float(-0.7 * inv);
        }
      }
      return r;
    };
    e.train_step({&mb, 1}, so, loss);
    std::vector<float> analytic;
    for (size_t i = 0; i < e.num_params(); ++i) analytic.insert(analytic.end(), e.grad(i).begin(), e.grad(i).end());
    auto loss_at = [&]() {
      const engine::Outputs o = e.forward(mb, so.outputs);
      double l = 0;
      for (size_t t = 0; t < o.value.size(); ++t)
        l += (value_weight(t) * o.value[t] - (with_logprob ? 0.7 * o.logprob[t] : 0.0)) * inv;
      return l;
    };
    int64_t at = 0, checked = 0;
    for (size_t i = 0; i < e.num_params(); ++i) {
      std::span<float> p = e.param(i);
      const bool lm_head = e.desc().params[i].role == sdk::ParamRole::lm_head;
      for (size_t j : {size_t(0), p.size() / 2, p.size() - 1}) {
        const float keep = p[j];
        const float h = 1e-3f * std::max(1.0f, std::fabs(keep));
        const float hi = keep + h, lo = keep - h;
        p[j] = hi;
        const double up = loss_at();
        p[j] = lo;
        const double down = loss_at();
        p[j] = keep;
        const double fd = (up - down) / (double(hi) - double(lo));
        const double g = analytic[size_t(at) + j];
        EXPECT_NEAR(g, fd, 2e-3 * std::max(1.0, std::fabs(fd)) + 1e-4) << e.desc().params[i].name << "[" << j << "]";
        if (lm_head && !with_logprob) {
          EXPECT_EQ(g, 0.0) << "lm_head has no part in a value-only loss";
        }
        ++checked;
      }
      at += int64_t(p.size());
    }
    EXPECT_GT(checked, 25);
    // The score's gradient is the weighted sum of hidden states: never all zero here.
    double score_norm = 0;
    for (float x : e.grad(index_of(e, sdk::ParamRole::value_head))) score_norm += double(x) * double(x);
    EXPECT_GT(score_norm, 0.0);
  }
}

// One packed micro-batch or one micro-batch per sequence: the same values and gradients.
TEST(EngineValueHead, MicroBatchingDoesNotChangeGradients) {
  const Batch b = make_batch({9, 4, 14});
  std::vector<Batch> singles;
  for (size_t s = 0; s + 1 < b.cu.size(); ++s) {
    Batch o;
    o.ids.assign(b.ids.begin() + b.cu[s], b.ids.begin() + b.cu[s + 1]);
    o.cu = {0, int32_t(o.ids.size())};
    singles.push_back(o);
  }
  std::vector<float> grads[2];
  for (int k = 0; k < 2; ++k) {
    Engine e(value_desc(), test::engine_options());
    randomize(e, 17);
    std::vector<MicroBatch> mbs;
    if (k == 0)
      mbs.push_back(b.mb());
    else
      for (const Batch& s : singles) mbs.push_back(s.mb());
    engine::StepOptions so;
    so.global_tokens = int64_t(b.ids.size());
    so.apply_optimizer = false;
    so.outputs = value_only();
    auto loss = [&](const engine::LossContext& ctx, const engine::OutputViews& o, engine::OutputGrads& g) {
      engine::LossResult r;
      const auto& cu = ctx.microbatch->cu_seqlens;
      for (size_t s = 0; s + 1 < cu.size(); ++s) {  // the last position of each sequence, as a reward
        const size_t last = size_t(cu[s + 1] - 1);
        r.loss += o.value[last] / double(ctx.global_tokens);
        g.value[last] = float(1.0 / double(ctx.global_tokens));
      }
      return r;
    };
    e.train_step(mbs, so, loss);
    for (size_t i = 0; i < e.num_params(); ++i) grads[k].insert(grads[k].end(), e.grad(i).begin(), e.grad(i).end());
  }
  double worst = 0, scale = 0;
  for (size_t i = 0; i < grads[0].size(); ++i) {
    worst = std::max(worst, double(std::fabs(grads[0][i] - grads[1][i])));
    scale = std::max(scale, double(std::fabs(grads[0][i])));
  }
  EXPECT_GT(scale, 0.0);
  EXPECT_LE(worst, 1e-5 * scale);
}

TEST(EngineValueHead, RefusedWithoutAValueHeadAndCheckedForShape) {
  Engine e(value_desc(false), test::engine_options());
  const Batch b = make_batch({5});
  try {
    e.forward(b.mb(), value_only());
    FAIL() << "a value output without a value head";
  } catch (const std::invalid_argument& ex) {
    EXPECT_NE(std::string(ex.what()).find("score.weight"), std::string::npos) << ex.what();
  }
  // Executors without the head (the generator; the CUDA engine before it had one) refuse the program by name.
  sdk::ExecutorCaps cuda;
  cuda.name = "cuda engine";
  const std::string why = sdk::unsupported(sdk::build_program(value_desc()), cuda);
  EXPECT_NE(why.find("cuda engine: the value head (score.weight, RLH_OUTPUT_VALUE"), std::string::npos) << why;
  EXPECT_EQ(sdk::unsupported(sdk::build_program(value_desc(false)), cuda), "");
  sdk::TransformerDesc wide = value_desc();
  wide.params.back().shape = {2, kC};
  wide.params.back().hf_shapes = {{2, kC}};
  try {
    Engine bad(wide, test::engine_options());
    FAIL() << "a two-label score head";
  } catch (const std::invalid_argument& ex) {
    EXPECT_NE(std::string(ex.what()).find("score.weight"), std::string::npos) << ex.what();
  }
}

}  // namespace
