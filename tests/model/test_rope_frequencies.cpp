// RoPE inverse frequencies: against values Hugging Face computed (configs/rope_golden.json, made
// by configs/make_hf_expectations.py; HF works in float32, hence the 1e-6 tolerance) and against
// the HF formulas re-derived here in double precision (1e-12).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <numbers>

#include <nlohmann/json.hpp>

#include "rlhost/sdk/model_desc.hpp"

using namespace rlh::sdk;
using nlohmann::json;

namespace {

constexpr double kPi = std::numbers::pi;

json load_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return json::parse(in);
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, double rel, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], rel * std::fabs(want[i]) + 1e-30) << what << " [" << i << "]";
}

// theta^(-2i/dim), written as exp(-2i/dim * ln theta) to differ from the library's pow form.
std::vector<double> plain(double theta, int dim) {
  std::vector<double> f;
  for (int i = 0; i < dim; i += 2) f.push_back(std::exp(-static_cast<double>(i) / dim * std::log(theta)));
  return f;
}

// Llama 3.1 scaling, from the wavelength bands.
std::vector<double> llama3(double theta, int dim, double factor, double lo, double hi, double ctx) {
  std::vector<double> out;
  for (double f : plain(theta, dim)) {
    const double wl = 2 * kPi / f;
    if (wl < ctx / hi) {
      out.push_back(f);
    } else if (wl > ctx / lo) {
      out.push_back(f / factor);
    } else {
      const double s = (ctx / wl - lo) / (hi - lo);
      out.push_back((1 - s) * f / factor + s * f);
    }
  }
  return out;
}

// YaRN: the blend between interpolated and extrapolated frequencies over a linear ramp.
std::vector<double> yarn(double theta, int dim, double factor, double orig, double bf, double bs, bool truncate) {
  auto corr = [&](double rot) { return dim * std::log(orig / (rot * 2 * kPi)) / (2 * std::log(theta)); };
  double low = corr(bf), high = corr(bs);
  if (truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1.0);
  if (low == high) high += 0.001;
  std::vector<double> out;
  const auto base = plain(theta, dim);
  for (size_t i = 0; i < base.size(); ++i) {
    const double ramp = std::min(1.0, std::max(0.0, (static_cast<double>(i) - low) / (high - low)));
    // ramp 0 -> keep the original frequency, ramp 1 -> divide by factor.
    out.push_back(base[i] * (1 - ramp) + base[i] / factor * ramp);
  }
  return out;
}

RopeDesc rope(RopeKind kind, double theta, double factor, int dim) {
  RopeDesc r;
  r.kind = kind;
  r.theta = theta;
  r.factor = factor;
  r.rotary_dim = dim;
  return r;
}

}  // namespace

TEST(RopeFrequencies, MatchValuesComputedByHuggingFace) {
  const json golden = load_json(std::string(RLH_MODEL_TEST_CONFIGS) + "/rope_golden.json");
  ASSERT_FALSE(golden.empty());
  for (const auto& g : golden) {
    const RopeDesc r = g.at("desc").get<RopeDesc>();
    const int64_t seq = g.at("seq_len").get<int64_t>();
    const auto f = rope_inv_freq(r, r.rotary_dim, seq);
    expect_close(f, g.at("inv_freq").get<std::vector<double>>(), 1e-6, g.at("label").get<std::string>());
    EXPECT_NEAR(rope_attention_scaling(r), g.at("attention_scaling").get<double>(), 1e-9)
        << g.at("label").get<std::string>();
  }
}

TEST(RopeFrequencies, DefaultAndLinear) {
  expect_close(rope_inv_freq(rope(RopeKind::default_, 10000, 1, 64), 64), plain(10000, 64), 1e-13, "default");
  auto lin = plain(500000, 128);
  for (double& x : lin) x /= 4.0;
  expect_close(rope_inv_freq(rope(RopeKind::linear, 500000, 4, 128), 128), lin, 1e-13, "linear");
  EXPECT_EQ(rope_attention_scaling(rope(RopeKind::linear, 500000, 4, 128)), 1.0);
}

TEST(RopeFrequencies, Llama3) {
  for (double ctx : {8192.0, 64.0, 1024.0}) {
    RopeDesc r = rope(RopeKind::llama3, 500000, 8, 128);
    r.low_freq_factor = 1;
    r.high_freq_factor = 4;
    r.original_max_position_embeddings = static_cast<int64_t>(ctx);
    expect_close(rope_inv_freq(r, 128), llama3(500000, 128, 8, 1, 4, ctx), 1e-12, "llama3");
  }
  RopeDesc r = rope(RopeKind::llama3, 10000, 32, 64);
  r.low_freq_factor = 2;
  r.high_freq_factor = 8;
  r.original_max_position_embeddings = 256;
  expect_close(rope_inv_freq(r, 64), llama3(10000, 64, 32, 2, 8, 256), 1e-12, "llama3 b");
}

TEST(RopeFrequencies, Yarn) {
  struct Case {
    double theta, factor, orig, bf, bs;
    bool truncate;
    int dim;
  } cases[] = {{1e6, 4, 16, 32, 1, true, 16},   {10000, 40, 4096, 32, 1, true, 64},
               {500000, 8, 8192, 16, 2, false, 128}, {10000, 2, 64, 32, 1, true, 8}};
  for (const auto& c : cases) {
    RopeDesc r = rope(RopeKind::yarn, c.theta, c.factor, c.dim);
    r.original_max_position_embeddings = static_cast<int64_t>(c.orig);
    r.beta_fast = c.bf;
    r.beta_slow = c.bs;
    r.truncate = c.truncate;
    expect_close(rope_inv_freq(r, c.dim), yarn(c.theta, c.dim, c.factor, c.orig, c.bf, c.bs, c.truncate), 1e-12, "yarn");
    // Attention factor: 0.1 ln(factor) + 1 without mscale settings.
    EXPECT_NEAR(rope_attention_scaling(r), 0.1 * std::log(c.factor) + 1.0, 1e-15);
  }
  RopeDesc r = rope(RopeKind::yarn, 10000, 40, 64);
  r.original_max_position_embeddings = 4096;
  r.mscale = 1.0;
  r.mscale_all_dim = 0.707;
  EXPECT_NEAR(rope_attention_scaling(r), (0.1 * std::log(40.0) + 1) / (0.1 * 0.707 * std::log(40.0) + 1), 1e-15);
  r.attention_factor = 0.5;
  EXPECT_EQ(rope_attention_scaling(r), 0.5);
}

TEST(RopeFrequencies, DynamicNtk) {
  RopeDesc r = rope(RopeKind::dynamic, 10000, 2, 64);
  r.max_position_embeddings = 2048;
  // Within the context: theta unchanged ((2 * L / L) - 1 = 1).
  expect_close(rope_inv_freq(r, 64), plain(10000, 64), 1e-12, "dynamic within");
  expect_close(rope_inv_freq(r, 64, 1000), plain(10000, 64), 1e-12, "dynamic short");
  const double theta = 10000 * std::pow(2.0 * 8192 / 2048 - 1.0, 64.0 / 62.0);
  expect_close(rope_inv_freq(r, 64, 8192), plain(theta, 64), 1e-12, "dynamic beyond");
}

TEST(RopeFrequencies, InvalidInput) {
  EXPECT_THROW(rope_inv_freq(rope(RopeKind::default_, 10000, 1, 63), 63), std::invalid_argument);
  EXPECT_THROW(rope_inv_freq(rope(RopeKind::default_, 10000, 1, 0), 0), std::invalid_argument);
  RopeDesc r = rope(RopeKind::llama3, 10000, 8, 64);
  EXPECT_THROW(rope_inv_freq(r, 64), std::invalid_argument);  // no original context
  RopeDesc lr = rope(RopeKind::longrope, 10000, 4, 16);
  lr.original_max_position_embeddings = 64;
  lr.short_factor = {1, 2};
  EXPECT_THROW(rope_inv_freq(lr, 16), std::invalid_argument);
}
