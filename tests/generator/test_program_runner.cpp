// The decoder's layer runner (program_runner.hpp) against a recording backend: which backend
// calls a Llama program turns into, so the fusions the GPU executor counts on (a residual add
// with the norm after it, inside a layer and across the boundary into the next layer's first
// norm; gate|up with its GLU) are checked to fire, and their fallbacks to run the plain steps.
// The numbers of the fused paths are tested where they run (test_generator on the host
// executor, which runs the same fused path; test_generator_cuda on the GPU).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "generator_test_util.hpp"
#include "rlhost/generator/program_runner.hpp"

namespace rlh::gen {
namespace {

// Records each call's name; computes nothing. Buffers are real so the runner's pointer
// arithmetic stays inside them.
struct Recorder {
  using T = float;
  bool fuse = true;  // whether add_norm and linear_glu are offered
  std::map<std::string, int> calls;
  std::vector<float> buf = std::vector<float>(1 << 20), res0 = buf, res1 = buf, scratch0 = buf, scratch1 = buf;

  T* residual(int i) { return i == 0 ? res0.data() : res1.data(); }
  T* values() { return buf.data(); }
  // The parameters one after another in the description's order (gate then up: adjacent, as the
  // executors' fused gate|up storage has them), so the runner sees one 2F-row product.
  std::vector<float> params;
  std::vector<size_t> at;
  explicit Recorder(const sdk::TransformerDesc& d) {
    size_t n = 0;
    for (const auto& p : d.params) {
      at.push_back(n);
      size_t e = 1;
      for (int64_t x : p.shape) e *= size_t(x);
      n += e;
    }
    params.resize(n);
  }
  const T* w(int64_t p) const { return params.data() + at[size_t(p)]; }
  T* norm_scratch(int i) { return i == 0 ? scratch0.data() : scratch1.data(); }
  T* mla_scratch() { return buf.data(); }
  T* head_scratch() { return buf.data(); }
  const T* gather_rows(const T* x, int64_t) { return x; }
  void embed(T*, int64_t) { ++calls["embed"]; }
  void scale(T*, int64_t, double) { ++calls["scale"]; }
  void norm(T*, int64_t, const T*, int64_t, const T*, int64_t, int64_t, float, float) { ++calls["norm"]; }
  void linear(T*, int64_t, const T*, int64_t, const T*, int64_t, int64_t, int64_t) { ++calls["linear"]; }
  void bias_add(T*, int64_t, const T*, int64_t, int64_t) { ++calls["bias_add"]; }
  void rope(int, const T*, int64_t, T*, int64_t, int64_t, int64_t, int64_t) { ++calls["rope"]; }
  void attend(int64_t, const T*, int64_t, const T*, int64_t, const T*, int64_t, T*, int64_t, int64_t) {
    ++calls["attend"];
  }
  void glu(const std::string&, T*, int64_t, const T*, int64_t, int64_t, int64_t) { ++calls["glu"]; }
  void add(T*, const T*, const T*, int64_t) { ++calls["add"]; }
  void moe(int64_t, int64_t, const T*, T*) { ++calls["moe"]; }
  void copy2d(T*, int64_t, const T*, int64_t, int64_t, int64_t) { ++calls["copy2d"]; }
  void logits(const T*, const T*, int64_t) { ++calls["logits"]; }
  bool add_norm(T* y, T* yn, const T*, const T*, const T*, int64_t, int64_t, float, float) {
    if (!fuse) return false;
    ++calls[yn == scratch0.data() || yn == scratch1.data() ? "add_norm into the next layer" : "add_norm"];
    (void)y;
    return true;
  }
  bool linear_glu(const std::string&, T*, int64_t, const T*, int64_t, const T*, int64_t, int64_t, int64_t) {
    if (!fuse) return false;
    ++calls["linear_glu"];
    return true;
  }
};

TEST(ProgramRunner, LlamaLayersFuseEveryAddWithTheNormAfterIt) {
  const int64_t L = 3;
  DecodeModel m(test::llama_desc(64, 32, L, 4, 2, 8, 48));
  Recorder b(m.desc());
  ProgramRunner<Recorder> run(m, b);
  run.layers(2);
  // Each layer: its attention's add fused with the norm before the MLP; each layer but the last
  // ends in an add fused with the next layer's first norm, which then does not run again.
  EXPECT_EQ(b.calls["norm"], 1);  // the first layer's
  EXPECT_EQ(b.calls["add_norm"], L);
  EXPECT_EQ(b.calls["add_norm into the next layer"], L - 1);
  EXPECT_EQ(b.calls["add"], 1);  // the last layer's
  EXPECT_EQ(b.calls["linear_glu"], L);
  EXPECT_EQ(b.calls["glu"], 0);
  EXPECT_EQ(b.calls["attend"], L);
  EXPECT_EQ(b.calls["rope"], L);  // q and k in one call
}

TEST(ProgramRunner, WithoutTheFusedOpsEveryStepRuns) {
  const int64_t L = 3;
  DecodeModel m(test::llama_desc(64, 32, L, 4, 2, 8, 48));
  Recorder b(m.desc());
  b.fuse = false;
  ProgramRunner<Recorder> run(m, b);
  run.layers(2);
  EXPECT_EQ(b.calls["norm"], 2 * L);
  EXPECT_EQ(b.calls["add"], 2 * L);
  EXPECT_EQ(b.calls["glu"], L);
  EXPECT_EQ(b.calls["add_norm"] + b.calls["add_norm into the next layer"] + b.calls["linear_glu"], 0);
}

// A backend that wants to know which product a producer feeds (feeds_product: the GPU
// executor's FP8 rollouts, where the norms and the GLU then write their product's FP8 input),
// and that, like it for FP8 weights, fuses no product with its GLU. Every producer whose output
// one product reads whole, right after it, is announced with that product's weight: the first
// norm, each layer's add + norm before the MLP, the boundary's add + the next layer's first
// norm, and each GLU; and the announced product is the next call, reading that output.
struct FeedRecorder : Recorder {
  using Recorder::Recorder;
  const T* pending = nullptr;             // announced, not yet taken by a producer
  const T* fed_x = nullptr;               // what the last producer wrote for...
  const T* fed_w = nullptr;               // ...this product
  int announced = 0, fed = 0, stale = 0;  // stale: a call between a producer and its product
  void feeds_product(const T* W) {
    ++announced;
    pending = W;
  }
  void take(const T* out) {
    fed_x = pending ? out : nullptr;
    fed_w = pending;
    pending = nullptr;
  }
  void norm(T* y, int64_t, const T*, int64_t, const T*, int64_t, int64_t, float, float) {
    ++calls["norm"];
    take(y);
  }
  bool add_norm(T*, T* yn, const T*, const T*, const T*, int64_t, int64_t, float, float) {
    ++calls["add_norm"];
    take(yn);
    return true;
  }
  void glu(const std::string&, T* h, int64_t, const T*, int64_t, int64_t, int64_t) {
    ++calls["glu"];
    take(h);
  }
  bool linear_glu(const std::string&, T*, int64_t, const T*, int64_t, const T*, int64_t, int64_t, int64_t) {
    return false;
  }
  void linear(T*, int64_t, const T* x, int64_t, const T* W, int64_t, int64_t, int64_t) {
    ++calls["linear"];
    if (fed_w != nullptr) (fed_x == x && fed_w == W ? fed : stale) += 1;
    fed_x = fed_w = nullptr;
  }
  void rope(int, const T*, int64_t, T*, int64_t, int64_t, int64_t, int64_t) { fed_w = pending = nullptr; }
  void attend(int64_t, const T*, int64_t, const T*, int64_t, const T*, int64_t, T*, int64_t, int64_t) {
    fed_w = pending = nullptr;
  }
};

TEST(ProgramRunner, ProducersAreToldTheProductTheyFeed) {
  const int64_t L = 3;
  DecodeModel m(test::llama_desc(64, 32, L, 4, 2, 8, 48));
  FeedRecorder b(m.desc());
  ProgramRunner<FeedRecorder> run(m, b);
  run.layers(64);
  EXPECT_EQ(b.announced, 1 + L + (L - 1) + L);
  EXPECT_EQ(b.fed, 1 + L + (L - 1) + L);
  EXPECT_EQ(b.stale, 0);
  EXPECT_EQ(b.pending, nullptr);
}

// A backend that also offers a norm with the product after it, a product with the residual add
// after it (rmsnorm_gemm_fwd, gemm_add_fwd) and RoPE with the cache write (rope_kv_cache_write),
// at up to 4 rows as the host executor does.
struct ProductRecorder : Recorder {
  using Recorder::Recorder;
  std::vector<std::string> acts;
  bool norm_linear(const std::string& act, T*, int64_t, const T*, const T*, const T*, int64_t R, int64_t, int64_t,
                   float, float) {
    if (R > 4) return false;
    ++calls["norm_linear"];
    acts.push_back(act);
    return true;
  }
  bool linear_add(T* y, const T* r, const T* x, int64_t, const T*, int64_t R, int64_t, int64_t) {
    if (R > 4) return false;
    EXPECT_NE(y, x);  // the fused product never writes over its own input
    (void)r;
    ++calls["linear_add"];
    return true;
  }
  bool rope_attend(int, int64_t, T*, int64_t, int64_t Hq, int64_t Hk, int64_t, const T*, int64_t, T*, int64_t,
                   int64_t R) {
    if (R > 4) return false;
    EXPECT_GT(Hq, 0);
    EXPECT_GT(Hk, 0);
    ++calls["rope_attend"];
    return true;
  }
};

TEST(ProgramRunner, FewRowStepsRunEachNormInsideItsProductAndEachAddInsideItsProduct) {
  const int64_t L = 3;
  DecodeModel m(test::llama_desc(64, 32, L, 4, 2, 8, 48));
  {  // 2 rows: a layer is norm+q|k|v, RoPE+cache write with attention, o+add, norm+gate|up+GLU, down+add
    ProductRecorder b(m.desc());
    ProgramRunner<ProductRecorder> run(m, b);
    const float* out = run.layers(2);
    EXPECT_EQ(b.calls["norm_linear"], 2 * L);
    EXPECT_EQ(b.calls["linear_add"], 2 * L);
    EXPECT_EQ(b.calls["rope_attend"], L);
    for (const char* op : {"norm", "linear", "add", "add_norm", "add_norm into the next layer", "linear_glu", "glu",
                           "rope", "attend"})
      EXPECT_EQ(b.calls[op], 0) << op;
    ASSERT_EQ(b.acts.size(), size_t(2 * L));
    for (int64_t l = 0; l < L; ++l) {
      EXPECT_EQ(b.acts[size_t(2 * l)], "");  // q|k|v
      EXPECT_EQ(b.acts[size_t(2 * l + 1)], "silu");  // gate|up with its GLU
    }
    EXPECT_EQ(out, b.residual(int(L % 2)));
  }
  {  // 8 rows: refused, so the adds fuse with the norms after them as before
    ProductRecorder b(m.desc());
    ProgramRunner<ProductRecorder> run(m, b);
    run.layers(8);
    EXPECT_EQ(b.calls["norm_linear"] + b.calls["linear_add"] + b.calls["rope_attend"], 0);
    EXPECT_EQ(b.calls["rope"], L);
    EXPECT_EQ(b.calls["attend"], L);
    EXPECT_EQ(b.calls["add_norm"], L);
    EXPECT_EQ(b.calls["add_norm into the next layer"], L - 1);
    EXPECT_EQ(b.calls["linear_glu"], L);
  }
  // Other layer programs: biases, windows, MoE, MLA, sandwich norms take what fits and run the rest.
  for (const test::Model& mm : {test::qwen_like(), test::moe_like(), test::mla_like(), test::gemma_like()}) {
    DecodeModel dm(mm.desc);
    ProductRecorder b(dm.desc());
    ProgramRunner<ProductRecorder> run(dm, b);
    run.layers(2);
    EXPECT_GT(b.calls["attend"] + b.calls["rope_attend"], 0) << mm.desc.model_type;
  }
}

// A backend that also offers the whole layer in one op (decode_layer_fwd, as the CUDA executor).
struct LayerRecorder : Recorder {
  using Recorder::Recorder;
  int64_t refuse_at = -1;  // the layer it refuses (and every later one), -1: none
  std::vector<DenseLayerPlan> plans;
  std::vector<std::pair<const T*, T*>> io;
  bool dense_layer(int64_t l, const DenseLayerPlan& p, const T* x, T* y, int64_t R) {
    EXPECT_EQ(R, 1);
    if (refuse_at >= 0 && l >= refuse_at) return false;
    ++calls["dense_layer"];
    plans.push_back(p);
    io.emplace_back(x, y);
    return true;
  }
};

TEST(ProgramRunner, OneRowStepsOfAPlainDenseModelRunEachLayerAsOneOp) {
  const int64_t L = 3;
  DecodeModel m(test::llama_desc(64, 32, L, 4, 2, 8, 48));
  LayerRecorder b(m.desc());
  ProgramRunner<LayerRecorder> run(m, b);
  const float* out = run.layers(1);
  EXPECT_EQ(b.calls["dense_layer"], L);
  for (const char* op : {"norm", "linear", "attend", "rope", "add", "add_norm", "linear_glu", "glu"})
    EXPECT_EQ(b.calls[op], 0) << op;
  ASSERT_EQ(b.plans.size(), size_t(L));
  const sdk::TransformerDesc& d = m.desc();
  for (int64_t l = 0; l < L; ++l) {
    const DenseLayerPlan& p = b.plans[size_t(l)];
    EXPECT_EQ(p.Hq, 4);
    EXPECT_EQ(p.Hkv, 2);
    EXPECT_EQ(p.D, 8);
    EXPECT_EQ(p.F, 48);
    EXPECT_EQ(p.table, 0);
    EXPECT_NEAR(p.scale, 1 / std::sqrt(8.0), 1e-12);
    EXPECT_EQ(d.params[size_t(p.q)].role, sdk::ParamRole::q);
    EXPECT_EQ(d.params[size_t(p.o)].role, sdk::ParamRole::o);
    EXPECT_EQ(d.params[size_t(p.gate)].role, sdk::ParamRole::gate);
    EXPECT_EQ(d.params[size_t(p.down)].role, sdk::ParamRole::down);
    EXPECT_EQ(d.params[size_t(p.q)].layer, l);
    // the residual stream alternates: layer l reads residual(l % 2), writes the other
    EXPECT_EQ(b.io[size_t(l)].first, b.residual(int(l % 2)));
    EXPECT_EQ(b.io[size_t(l)].second, b.residual(int((l + 1) % 2)));
  }
  EXPECT_EQ(out, b.residual(int(L % 2)));
}

TEST(ProgramRunner, TheLayerOpIsForOneRowAndFallsBackWhereRefused) {
  const int64_t L = 3;
  DecodeModel m(test::llama_desc(64, 32, L, 4, 2, 8, 48));
  {  // two rows: the program, fused as before
    LayerRecorder b(m.desc());
    ProgramRunner<LayerRecorder> run(m, b);
    run.layers(2);
    EXPECT_EQ(b.calls["dense_layer"], 0);
    EXPECT_EQ(b.calls["attend"], L);
  }
  {  // refused from layer 1 on: layer 0 as one op, the rest step by step from the right residual
    LayerRecorder b(m.desc());
    b.refuse_at = 1;
    ProgramRunner<LayerRecorder> run(m, b);
    const float* out = run.layers(1);
    EXPECT_EQ(b.calls["dense_layer"], 1);
    EXPECT_EQ(b.calls["attend"], L - 1);
    EXPECT_EQ(b.calls["norm"], 1);  // layer 1's first norm (nothing fused it into layer 0)
    EXPECT_EQ(out, b.residual(int(L % 2)));
  }
}

TEST(ProgramRunner, LayersOtherThanThePlainDenseFormRunTheirSteps) {
  // Qwen3-like with biases and a window, MoE, MLA, Gemma's sandwich norms: none is the form
  // decode_layer_fwd computes, so a one-row step runs their programs.
  for (const test::Model& mm : {test::qwen_like(), test::moe_like(), test::mla_like(), test::gemma_like()}) {
    DecodeModel m(mm.desc);
    LayerRecorder b(m.desc());
    ProgramRunner<LayerRecorder> run(m, b);
    run.layers(1);
    EXPECT_EQ(b.calls["dense_layer"], 0) << mm.desc.model_type;
    EXPECT_GT(b.calls["attend"], 0) << mm.desc.model_type;
  }
}

}  // namespace
}  // namespace rlh::gen
