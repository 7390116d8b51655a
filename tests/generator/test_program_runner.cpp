// The decoder's layer runner (program_runner.hpp) against a recording backend: which backend
// calls a Llama program turns into, so the fusions the GPU executor counts on (a residual add
// with the norm after it, inside a layer and across the boundary into the next layer's first
// norm; gate|up with its GLU) are checked to fire, and their fallbacks to run the plain steps.
// The numbers of the fused paths are tested where they run (test_generator on the host
// executor, which runs the same fused path; test_generator_cuda on the GPU).
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace rlh::gen
