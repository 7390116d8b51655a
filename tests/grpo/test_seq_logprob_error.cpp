// NeMo-RL's compute_and_apply_seq_logprob_error_masking against values worked by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "rlhost/grpo/seq_logprob_error.hpp"

using rlh::grpo::seq_logprob_error;
using rlh::grpo::seq_logprob_error_metrics;

namespace {

// Four sequences of 3 tokens, the first a prompt token (token_mask 0): sequence 0 matches,
// sequence 1 is off by 1 nat on one token, sequence 2 is off by 2 nats on both, sequence 3 is
// already out of the loss (sample_mask 0) and off by 5.
struct Batch {
  std::vector<int64_t> offsets = {0, 3, 6, 9, 12};
  std::vector<float> token_mask = {0, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1};
  std::vector<float> sample_mask = {1, 1, 1, 0};
  std::vector<float> prev = {0, -1, -2, 0, -1, -2, 0, -1, -2, 0, -1, -2};
  std::vector<float> gen = {9, -1, -2, 0, -2, -2, 0, -3, 0, 0, -6, -2};
  std::vector<double> rewards = {1, 1, 0, 1};
};

}  // namespace

TEST(SeqLogprobError, PerSequenceErrorAndMetrics) {
  Batch b;
  const auto e = seq_logprob_error(b.offsets, b.token_mask, b.sample_mask, b.prev, b.gen, b.rewards, std::nullopt);
  ASSERT_EQ(e.error.size(), 4u);
  EXPECT_DOUBLE_EQ(e.error[0], 1.0);  // the prompt token's mismatch does not count
  EXPECT_NEAR(e.error[1], (std::exp(1.0) + 1.0) / 2, 1e-12);
  EXPECT_NEAR(e.error[2], std::exp(2.0), 1e-12);
  EXPECT_EQ(e.error[3], 0.0);  // out of the loss already: no error, not in the statistics
  EXPECT_EQ(e.all.count, 3);
  EXPECT_EQ(e.sample_mask, b.sample_mask);
  EXPECT_EQ(e.masked, 0);
  const auto m = seq_logprob_error_metrics(e.all, e.kept, e.masked, e.masked_correct, false);
  EXPECT_NEAR(m.at("max_seq_mult_prob_error"), std::exp(2.0), 1e-12);
  EXPECT_DOUBLE_EQ(m.at("min_seq_mult_prob_error"), 1.0);
  EXPECT_NEAR(m.at("mean_seq_mult_prob_error"), (1.0 + (std::exp(1.0) + 1.0) / 2 + std::exp(2.0)) / 3, 1e-12);
  EXPECT_EQ(m.at("max_seq_mult_prob_error_after_mask"), m.at("max_seq_mult_prob_error"));
  EXPECT_EQ(m.at("num_masked_seqs_by_logprob_error"), 0);
  EXPECT_EQ(m.at("masked_correct_pct"), 0);
}

TEST(SeqLogprobError, ThresholdTakesSequencesOutOfTheLoss) {
  Batch b;
  // 2.0 keeps sequences 0 (1.0) and 1 (1.86), masks sequence 2 (7.39); sequence 3 stays 0.
  const auto e = seq_logprob_error(b.offsets, b.token_mask, b.sample_mask, b.prev, b.gen, b.rewards, 2.0);
  EXPECT_EQ(e.sample_mask, (std::vector<float>{1, 1, 0, 0}));
  EXPECT_EQ(e.masked, 1);
  EXPECT_EQ(e.masked_correct, 0);  // its reward is 0
  EXPECT_EQ(e.kept_tokens, 4);
  const auto m = seq_logprob_error_metrics(e.all, e.kept, e.masked, e.masked_correct, true);
  EXPECT_NEAR(m.at("max_seq_mult_prob_error_after_mask"), (std::exp(1.0) + 1.0) / 2, 1e-12);
  EXPECT_NEAR(m.at("max_seq_mult_prob_error"), std::exp(2.0), 1e-12);
  EXPECT_EQ(m.at("num_masked_seqs_by_logprob_error"), 1);
  // 1.5 also masks sequence 1, whose reward is 1: half the masked ones were correct.
  const auto f = seq_logprob_error(b.offsets, b.token_mask, b.sample_mask, b.prev, b.gen, b.rewards, 1.5);
  const auto n = seq_logprob_error_metrics(f.all, f.kept, f.masked, f.masked_correct, true);
  EXPECT_EQ(n.at("num_masked_seqs_by_logprob_error"), 2);
  EXPECT_DOUBLE_EQ(n.at("masked_correct_pct"), 0.5);
  // Everything masked: the after-mask statistics are 0, as NeMo-RL writes them.
  const auto g = seq_logprob_error(b.offsets, b.token_mask, b.sample_mask, b.prev, b.gen, b.rewards, 0.5);
  EXPECT_EQ(g.kept_tokens, 0);
  const auto z = seq_logprob_error_metrics(g.all, g.kept, g.masked, g.masked_correct, true);
  EXPECT_EQ(z.at("max_seq_mult_prob_error_after_mask"), 0);
  EXPECT_EQ(z.at("mean_seq_mult_prob_error_after_mask"), 0);
  EXPECT_EQ(z.at("num_masked_seqs_by_logprob_error"), 3);
}

TEST(SeqLogprobError, MismatchedFieldsAreRefused) {
  Batch b;
  b.prev.pop_back();
  EXPECT_THROW(seq_logprob_error(b.offsets, b.token_mask, b.sample_mask, b.prev, b.gen, b.rewards, std::nullopt),
               std::invalid_argument);
}
