// NeMo-RL's PreferenceLossFn (the reward model's Bradley-Terry loss, preference_loss.hpp): value,
// metrics and gradient against a long-double reference written from NeMo-RL's formula, the
// gradient against central differences, pair-preserving micro-batches summing to the whole
// batch, and the edge cases (huge margins, ties, masked pairs, malformed batches).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "rlhost/grpo/preference_loss.hpp"

namespace rlh::grpo {
namespace {

struct Case {
  std::vector<int64_t> offsets;  // sequences: chosen, rejected, ...
  std::vector<double> values;    // [num_tokens]
  std::vector<double> mask;      // per sequence
  double global_valid_seqs = 0;
};

Case make_case(uint64_t seed, int pairs) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> len(1, 9);
  std::normal_distribution<double> n01(0, 1.5);
  Case c;
  c.offsets.push_back(0);
  for (int i = 0; i < 2 * pairs; ++i) c.offsets.push_back(c.offsets.back() + len(rng));
  for (int64_t t = 0; t < c.offsets.back(); ++t) c.values.push_back(n01(rng));
  for (int k = 0; k < pairs; ++k) {
    const double m = k % 4 == 3 ? 0.0 : 1.0;  // every fourth pair left out (too long)
    c.mask.push_back(m);
    c.mask.push_back(m);
  }
  for (double m : c.mask) c.global_valid_seqs += m;
  return c;
}

PreferenceInputs inputs(const Case& c) {
  PreferenceInputs in;
  in.packing.num_tokens = int64_t(c.values.size());
  in.packing.num_seqs = int64_t(c.offsets.size()) - 1;
  in.packing.seq_offsets = c.offsets.data();
  in.values = c.values.data();
  in.sample_mask = c.mask.data();
  in.global_valid_seqs = c.global_valid_seqs;
  return in;
}

// NeMo-RL's _preference_loss, in long double: rewards = values at the last token of each
// sequence, per-pair -logsigmoid(delta) * mask, masked means over G = global_valid_seqs / 2.
std::map<std::string, long double> reference(const Case& c) {
  const size_t ns = c.offsets.size() - 1;
  const long double G = (long double)c.global_valid_seqs / 2 + 1e-8L;
  std::map<std::string, long double> m;
  for (size_t k = 0; 2 * k < ns; ++k) {
    const long double rc = c.values[size_t(c.offsets[2 * k + 1] - 1)];
    const long double rr = c.values[size_t(c.offsets[2 * k + 2] - 1)];
    const long double sc = c.mask[2 * k], sr = c.mask[2 * k + 1];
    m["loss"] += std::log1p(std::exp(-(rc - rr))) * sc * sc / G;
    m["accuracy"] += (rc > rr ? 1.0L : 0.0L) * sc / G;
    m["rewards_chosen_mean"] += rc * sc / G;
    m["rewards_rejected_mean"] += rr * sr / G;
    m["num_valid_samples"] += (sc + sr) / 2;
  }
  return m;
}

double metric(const LossResult& r, const std::string& name) {
  for (const Metric& m : r.metrics.items())
    if (m.name == name) return m.value;
  throw std::runtime_error("no metric " + name);
}

TEST(PreferenceLoss, MatchesReferenceMetricsAndGradient) {
  for (uint64_t seed : {1, 2, 3}) {
    Case c = make_case(seed, 6);
    std::vector<double> grad(c.values.size(), 7.0);  // overwritten everywhere
    const LossResult r = preference_loss(inputs(c), grad.data());
    const auto ref = reference(c);
    EXPECT_NEAR(r.loss, double(ref.at("loss")), 1e-12);
    for (const auto& [k, v] : ref) EXPECT_NEAR(metric(r, k), double(v), 1e-12) << k;
    // Only the last token of each sequence carries a gradient; central differences of the
    // reference there.
    std::vector<bool> last(c.values.size(), false);
    for (size_t i = 1; i < c.offsets.size(); ++i) last[size_t(c.offsets[i] - 1)] = true;
    for (size_t t = 0; t < c.values.size(); ++t) {
      if (!last[t]) {
        EXPECT_EQ(grad[t], 0.0) << t;
        continue;
      }
      const double keep = c.values[t], h = 1e-5;
      c.values[t] = keep + h;
      const long double up = reference(c).at("loss");
      c.values[t] = keep - h;
      const long double down = reference(c).at("loss");
      c.values[t] = keep;
      EXPECT_NEAR(grad[t], double((up - down) / (2 * h)), 1e-8) << "seed " << seed << " token " << t;
    }
  }
}

// Micro-batches of whole pairs, each normalised by the global count, sum to the whole batch.
TEST(PreferenceLoss, PairPreservingMicroBatchesSumToTheWholeBatch) {
  const Case c = make_case(9, 8);
  std::vector<double> whole(c.values.size());
  const LossResult all = preference_loss(inputs(c), whole.data());
  double loss = 0, acc = 0, n = 0;
  std::vector<double> grad;
  for (size_t k0 = 0; k0 < 8; k0 += 3) {  // pairs [k0, k0 + 3)
    const size_t k1 = std::min<size_t>(k0 + 3, 8);
    Case part;
    part.global_valid_seqs = c.global_valid_seqs;
    const int64_t base = c.offsets[2 * k0];
    for (size_t i = 2 * k0; i <= 2 * k1; ++i) part.offsets.push_back(c.offsets[i] - base);
    part.values.assign(c.values.begin() + base, c.values.begin() + c.offsets[2 * k1]);
    part.mask.assign(c.mask.begin() + int64_t(2 * k0), c.mask.begin() + int64_t(2 * k1));
    std::vector<double> g(part.values.size());
    const LossResult r = preference_loss(inputs(part), g.data());
    loss += r.loss;
    acc += metric(r, "accuracy");
    n += metric(r, "num_valid_samples");
    grad.insert(grad.end(), g.begin(), g.end());
  }
  EXPECT_NEAR(loss, all.loss, 1e-12);
  EXPECT_NEAR(acc, metric(all, "accuracy"), 1e-12);
  EXPECT_EQ(n, metric(all, "num_valid_samples"));
  EXPECT_EQ(grad, whole);
}

TEST(PreferenceLossEdgeCases, HugeMarginsStayFinite) {
  Case c;
  c.offsets = {0, 2, 3, 4, 6};
  c.values = {0, 1000, -1000, -1000, 0, 1000};  // rewards at tokens 1, 2, 3, 5
  c.mask = {1, 1, 1, 1};
  c.global_valid_seqs = 4;
  std::vector<double> g(c.values.size());
  const LossResult r = preference_loss(inputs(c), g.data());
  // Pair 0: delta +2000 -> loss 0, gradient 0; pair 1: delta -2000 -> loss 2000 / G, gradient -1 / G.
  // (G carries NeMo-RL's + 1e-8: results are exact to ~1e-8 relative.)
  EXPECT_NEAR(r.loss, 2000.0 / 2, 1e-4);
  for (double x : g) EXPECT_TRUE(std::isfinite(x));
  EXPECT_NEAR(g[3], -0.5, 1e-7);
  EXPECT_NEAR(g[5], 0.5, 1e-7);
  EXPECT_EQ(g[1], 0.0);
  EXPECT_NEAR(metric(r, "accuracy"), 0.5, 1e-7);
}

TEST(PreferenceLossEdgeCases, TiesAreNotCorrectAndCostLog2) {
  Case c;
  c.offsets = {0, 1, 2};
  c.values = {0.25, 0.25};
  c.mask = {1, 1};
  c.global_valid_seqs = 2;
  std::vector<double> g(2);
  const LossResult r = preference_loss(inputs(c), g.data());
  EXPECT_EQ(metric(r, "accuracy"), 0.0);
  EXPECT_NEAR(r.loss, std::log(2.0), 1e-7);
  EXPECT_NEAR(g[0], -0.5, 1e-7);
  EXPECT_NEAR(g[1], 0.5, 1e-7);
}

TEST(PreferenceLossEdgeCases, AllPairsMaskedGiveZero) {
  Case c = make_case(4, 3);
  for (double& m : c.mask) m = 0;
  c.global_valid_seqs = 0;
  std::vector<double> g(c.values.size(), 1.0);
  const LossResult r = preference_loss(inputs(c), g.data());
  EXPECT_EQ(r.loss, 0.0);
  EXPECT_EQ(metric(r, "num_valid_samples"), 0.0);
  for (double x : g) EXPECT_EQ(x, 0.0);
}

TEST(PreferenceLossEdgeCases, MalformedBatchesThrowOneLine) {
  Case c;
  c.offsets = {0, 2, 3, 5};
  c.values = {1, 2, 3, 4, 5};
  c.mask = {1, 1, 1};
  c.global_valid_seqs = 3;
  std::vector<double> g(5);
  EXPECT_THROW(preference_loss(inputs(c), g.data()), std::invalid_argument);  // three sequences
  c.offsets = {0, 2, 2};
  c.values = {1, 2};
  c.mask = {1, 1};
  g.resize(2);
  try {
    preference_loss(inputs(c), g.data());
    FAIL() << "an empty sequence has no reward";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("sequence 1 is empty"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace rlh::grpo
