// SFT's NLLLossFn and DPOLossFn against the float64 reference, finite differences and
// micro-batch splits.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "reference.hpp"
#include "test_util.hpp"

namespace rlh::grpo::test {
namespace {

NllInputs nll_inputs(const Packed& p, const RefBatch& B) {
  NllInputs in;
  in.packing = p.packing();
  in.logprobs = p.lp.data();
  in.token_mask = p.tm.data();
  in.sample_mask = p.sm.data();
  in.global_valid_toks = B.g_tok;
  return in;
}

DpoInputs dpo_inputs(const Packed& p, const RefBatch& B) {
  DpoInputs in;
  in.packing = p.packing();
  in.logprobs = p.lp.data();
  in.reference_policy_logprobs = p.ref.data();
  in.token_mask = p.tm.data();
  in.sample_mask = p.sm.data();
  in.global_valid_seqs = B.g_seq;
  return in;
}

TEST(NllLoss, MatchesReferenceAndGradient) {
  GenOptions o;
  o.seed = 11;
  const Case c = make_case(o);
  const RefBatch& B = c.batch;
  const Packed p = pack(B, c.lp, iota_order(B.seqs.size()), nullptr, 3.0);
  std::vector<double> g(p.num_tokens());
  const LossResult r = nll_loss(nll_inputs(p, B), g.data());
  expect_close(r.loss, ref_nll(B, c.lp), 1e-13, "nll loss");
  expect_close(*r.metrics.get("loss"), r.loss, 0, "loss metric");
  double unmasked = 0, valid = 0;
  for (const RefSeq& s : B.seqs) {
    valid += s.sample_mask;
    for (size_t t = 1; t < s.length(); ++t) unmasked += s.token_mask[t] * s.sample_mask;
  }
  EXPECT_EQ(*r.metrics.get("num_unmasked_tokens"), unmasked);
  EXPECT_EQ(*r.metrics.get("num_valid_samples"), valid);
  const Rows fd = finite_difference([&](const Rows& x) { return ref_nll(B, x); }, c.lp);
  expect_rows_near(unpack_grad(p, g, B), fd, 1e-9, 1e-6, "nll gradient");
}

TEST(NllLoss, MicroBatchSumsEqualTheWholeBatch) {
  GenOptions o;
  o.seed = 12;
  const Case c = make_case(o);
  const RefBatch& B = c.batch;
  const Packed whole = pack(B, c.lp, iota_order(B.seqs.size()));
  std::vector<double> gw(whole.num_tokens());
  const LossResult w = nll_loss(nll_inputs(whole, B), gw.data());
  double loss = 0;
  Rows g = unpack_grad(whole, gw, B);
  Rows gs = g;
  for (const std::vector<int>& chunk : {std::vector<int>{5, 2}, {0, 6, 3}, {1, 4}}) {
    const Packed p = pack(B, c.lp, chunk);
    std::vector<double> gc(p.num_tokens());
    loss += nll_loss(nll_inputs(p, B), gc.data()).loss;
    const Rows rows = unpack_grad(p, gc, B);
    for (int b : chunk) gs[b] = rows[b];
  }
  expect_close(loss, w.loss, 1e-13, "split nll");
  expect_rows_near(gs, g, 0, 1e-14, "split nll gradient");
}

// A batch of (chosen, rejected) pairs: sequences 2k, 2k+1.
Case dpo_case(uint64_t seed) {
  GenOptions o;
  o.seed = seed;
  o.lengths = {6, 8, 9, 4, 7, 7, 3, 10, 5, 6};
  o.zero_sample_mask_seq = 4;  // a chosen response masked out
  o.ref_noise = 0.6;
  return make_case(o);
}

struct DpoVariant {
  std::string name;
  DpoConfig cfg;
};

void PrintTo(const DpoVariant& v, std::ostream* os) { *os << v.name; }

std::vector<DpoVariant> dpo_variants() {
  std::vector<DpoVariant> v;
  v.push_back({"defaults", DpoConfig{}});
  DpoConfig c;
  c.preference_average_log_probs = true;
  c.reference_policy_kl_penalty = 0.5;
  v.push_back({"average_log_probs", c});
  c = DpoConfig{};
  c.sft_loss_weight = 0.4;
  c.preference_loss_weight = 0.7;
  c.reference_policy_kl_penalty = 0.2;
  v.push_back({"with_sft", c});
  c.sft_average_log_probs = true;
  c.preference_average_log_probs = true;
  v.push_back({"with_sft_averaged", c});
  return v;
}

class Dpo : public ::testing::TestWithParam<DpoVariant> {};

TEST_P(Dpo, MatchesReferenceValueMetricsAndGradient) {
  const DpoConfig& cfg = GetParam().cfg;
  const Case c = dpo_case(21);
  const RefBatch& B = c.batch;
  const Packed p = pack(B, c.lp, iota_order(B.seqs.size()), nullptr, -1.0);
  std::vector<double> g(p.num_tokens());
  const LossResult r = dpo_loss(cfg, dpo_inputs(p, B), g.data());
  const RefOut want = ref_dpo(cfg, B, c.lp);
  expect_close(r.loss, want.loss, 1e-12, "dpo loss");
  for (const auto& [name, value] : want.m) {
    const auto m = r.metrics.get(name);
    ASSERT_TRUE(m.has_value()) << name;
    expect_close(*m, value, 1e-12, "dpo metric " + name);
  }
  const Rows fd = finite_difference([&](const Rows& x) { return ref_dpo(cfg, B, x).loss; }, c.lp);
  expect_rows_near(unpack_grad(p, g, B), fd, 1e-9, 1e-6, "dpo gradient");
}

TEST_P(Dpo, PairPreservingMicroBatchesSumToTheWholeBatch) {
  const DpoConfig& cfg = GetParam().cfg;
  const Case c = dpo_case(22);
  const RefBatch& B = c.batch;
  const Packed whole = pack(B, c.lp, iota_order(B.seqs.size()));
  std::vector<double> gw(whole.num_tokens());
  const LossResult w = dpo_loss(cfg, dpo_inputs(whole, B), gw.data());
  const Rows g = unpack_grad(whole, gw, B);
  Rows gs = g;
  double loss = 0;
  Metrics merged;
  for (const std::vector<int>& chunk : {std::vector<int>{6, 7, 0, 1}, {8, 9}, {4, 5, 2, 3}}) {
    const Packed p = pack(B, c.lp, chunk);
    std::vector<double> gc(p.num_tokens());
    const LossResult r = dpo_loss(cfg, dpo_inputs(p, B), gc.data());
    loss += r.loss;
    merged.merge(r.metrics);
    const Rows rows = unpack_grad(p, gc, B);
    for (int b : chunk) gs[b] = rows[b];
  }
  expect_close(loss, w.loss, 1e-12, "split dpo loss");
  expect_rows_near(gs, g, 1e-16, 1e-12, "split dpo gradient");
  for (const Metric& m : w.metrics.items())
    expect_close(*merged.get(m.name), m.value, 1e-12, "split dpo metric " + m.name);
}

INSTANTIATE_TEST_SUITE_P(Variants, Dpo, ::testing::ValuesIn(dpo_variants()),
                         [](const ::testing::TestParamInfo<DpoVariant>& i) { return i.param.name; });

TEST(DpoByHand, OnePairWithSummedRewards) {
  // chosen: 2 response tokens, rejected: 1; beta = 0.5.
  std::vector<int64_t> off = {0, 3, 5};
  std::vector<double> lp = {-0.5, -1.0, 0, -2.0, 0}, ref = {0, -1.0, -1.5, 0, -1.0},
                      tm = {0, 1, 1, 0, 1}, sm = {1, 1};
  DpoInputs in;
  in.packing = Packing{5, 2, off.data()};
  in.logprobs = lp.data();
  in.reference_policy_logprobs = ref.data();
  in.token_mask = tm.data();
  in.sample_mask = sm.data();
  in.global_valid_seqs = 2;
  DpoConfig cfg;
  cfg.reference_policy_kl_penalty = 0.5;
  std::vector<double> g(5);
  const LossResult r = dpo_loss(cfg, in, g.data());
  // r_c = (-0.5 - -1.0) + (-1.0 - -1.5) = 1.0; r_r = (-2.0 - -1.0) = -1.0; delta = 2.
  const double x = 0.5 * 2.0;
  const double want = std::log1p(std::exp(-x)) / (1 + 1e-8);
  EXPECT_NEAR(r.loss, want, 1e-14);
  EXPECT_NEAR(*r.metrics.get("accuracy"), 1 / (1 + 1e-8), 1e-14);
  EXPECT_NEAR(*r.metrics.get("rewards_chosen_mean"), 1.0 / (1 + 1e-8), 1e-14);
  EXPECT_NEAR(*r.metrics.get("rewards_rejected_mean"), -1.0 / (1 + 1e-8), 1e-14);
  const double dl = -0.5 / (1 + std::exp(x)) / (1 + 1e-8);  // d/d r_c of -logsigmoid(beta delta)
  EXPECT_NEAR(g[0], dl, 1e-14);
  EXPECT_NEAR(g[1], dl, 1e-14);
  EXPECT_EQ(g[2], 0.0);
  EXPECT_NEAR(g[3], -dl, 1e-14);
  EXPECT_EQ(g[4], 0.0);
}

// One pair (chosen: tokens 1-2, rejected: token 4) with chosen reward rc and rejected reward rr
// (summed), for the edge cases below. Logprobs are in the output frame (entry t scores token t+1).
struct OnePair {
  std::vector<int64_t> off = {0, 3, 5};
  std::vector<double> lp, ref = {0, 0, 0, 0, 0}, tm = {0, 1, 1, 0, 1}, sm = {1, 1};
  OnePair(double rc, double rr) : lp{rc / 2, rc / 2, 0, rr, 0} {}
  DpoInputs inputs() {
    DpoInputs in;
    in.packing = Packing{5, 2, off.data()};
    in.logprobs = lp.data();
    in.reference_policy_logprobs = ref.data();
    in.token_mask = tm.data();
    in.sample_mask = sm.data();
    in.global_valid_seqs = sm[0] + sm[1];
    return in;
  }
};

// Margins far into either tail: -logsigmoid is evaluated without overflow (x for x << 0, ~0 for
// x >> 0) and its gradient saturates at -beta or 0, never NaN.
TEST(DpoEdgeCases, HugeMarginsStayFinite) {
  DpoConfig cfg;
  cfg.reference_policy_kl_penalty = 1.0;
  for (double delta : {2000.0, -2000.0}) {
    OnePair p(delta / 2, -delta / 2);
    std::vector<double> g(5);
    const LossResult r = dpo_loss(cfg, p.inputs(), g.data());
    const double want = delta > 0 ? 0.0 : -delta;  // -logsigmoid(delta) in double
    EXPECT_NEAR(r.loss, want / (1 + 1e-8), 1e-9) << delta;
    const double dl = (delta > 0 ? 0.0 : -1.0) / (1 + 1e-8);
    EXPECT_NEAR(g[0], dl, 1e-12) << delta;
    EXPECT_NEAR(g[3], -dl, 1e-12) << delta;
    for (double x : g) EXPECT_TRUE(std::isfinite(x));
  }
}

// Equal rewards: accuracy counts a pair only when chosen is strictly ahead (NeMo-RL's >).
TEST(DpoEdgeCases, TiesAreNotCorrect) {
  OnePair p(0.3, 0.3);
  std::vector<double> g(5);
  const LossResult r = dpo_loss(DpoConfig{}, p.inputs(), g.data());
  EXPECT_EQ(*r.metrics.get("accuracy"), 0.0);
  EXPECT_NEAR(r.loss, std::log(2.0) / (1 + 1e-8), 1e-14);
}

// A completion with no trained token: its averaged reward divides by max(0, 1), so it is 0, not NaN.
TEST(DpoEdgeCases, EmptyCompletionWithAveragedLogProbs) {
  OnePair p(1.0, 0.0);
  p.tm = {0, 1, 1, 0, 0};
  DpoConfig cfg;
  cfg.preference_average_log_probs = true;
  cfg.sft_loss_weight = 1.0;
  cfg.sft_average_log_probs = true;
  std::vector<double> g(5);
  const LossResult r = dpo_loss(cfg, p.inputs(), g.data());
  EXPECT_NEAR(*r.metrics.get("rewards_chosen_mean"), 0.5 / (1 + 1e-8), 1e-14);  // (0.5 + 0.5) / 2 tokens
  EXPECT_EQ(*r.metrics.get("rewards_rejected_mean"), 0.0);
  EXPECT_EQ(g[3], 0.0);
  for (double x : g) EXPECT_TRUE(std::isfinite(x));
}

// Every pair masked out (both too long): loss, metrics and gradient are 0, not 0/0.
TEST(DpoEdgeCases, AllPairsMaskedGiveZero) {
  OnePair p(1.0, -1.0);
  p.sm = {0, 0};
  DpoConfig cfg;
  cfg.sft_loss_weight = 0.5;
  std::vector<double> g(5, 7.0);
  const LossResult r = dpo_loss(cfg, p.inputs(), g.data());
  EXPECT_EQ(r.loss, 0.0);
  EXPECT_EQ(*r.metrics.get("accuracy"), 0.0);
  EXPECT_EQ(*r.metrics.get("num_valid_samples"), 0.0);
  for (double x : g) EXPECT_EQ(x, 0.0);
}

TEST(DpoInputsCheck, OddSequenceCountThrows) {
  std::vector<int64_t> off = {0, 2, 4, 6};
  std::vector<double> z(6, 0.0), sm = {1, 1, 1};
  DpoInputs in;
  in.packing = Packing{6, 3, off.data()};
  in.logprobs = z.data();
  in.reference_policy_logprobs = z.data();
  in.token_mask = z.data();
  in.sample_mask = sm.data();
  in.global_valid_seqs = 3;
  std::vector<double> g(6);
  EXPECT_THROW(dpo_loss(DpoConfig{}, in, g.data()), std::invalid_argument);
}

}  // namespace
}  // namespace rlh::grpo::test
