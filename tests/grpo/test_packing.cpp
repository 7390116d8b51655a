// Packed layouts: the loss frame, global counts, broadcasting, and the adapter's output specs.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "rlhost/grpo/loss_adapter.hpp"
#include "rlhost/grpo/packing.hpp"
#include "test_util.hpp"

namespace rlh::grpo::test {
namespace {

TEST(Packing, LossFramePairsOutputTWithFieldTPlusOne) {
  const std::vector<int64_t> off = {0, 3, 3, 4, 7};  // lengths 3, 0, 1, 3
  const LossFrame f = make_loss_frame(Packing{7, 4, off.data()});
  EXPECT_EQ(f.out_index, (std::vector<int64_t>{0, 1, 4, 5}));
  EXPECT_EQ(f.seq, (std::vector<int64_t>{0, 0, 3, 3}));
  EXPECT_EQ(f.seq_begin, (std::vector<int64_t>{0, 2, 2, 2, 4}));
  const std::vector<double> field = {10, 11, 12, 13, 14, 15, 16};
  EXPECT_EQ(gather_field(f, field.data()), (std::vector<double>{11, 12, 15, 16}));
  EXPECT_EQ(gather_output(f, field.data()), (std::vector<double>{10, 11, 14, 15}));
  std::vector<double> out(7, 9.0);
  scatter_output(f, std::vector<double>{1, 2, 3, 4}, out.data(), 7);
  EXPECT_EQ(out, (std::vector<double>{1, 2, 0, 0, 3, 4, 0}));
}

TEST(Packing, TokenAndOutputFramesConvertBothWays) {
  const std::vector<int64_t> off = {0, 3, 3, 4, 7};  // lengths 3, 0, 1, 3
  const Packing p{7, 4, off.data()};
  const std::vector<double> tok = {0, 11, 12, 0, 0, 15, 16};  // position 0 of each sequence: 0
  const std::vector<double> out = to_output_frame(p, tok);
  EXPECT_EQ(out, (std::vector<double>{11, 12, 0, 0, 15, 16, 0}));
  EXPECT_EQ(to_token_frame(p, out), tok);
  // Output frame's last entries and token frame's first entries hold no prediction: dropped.
  EXPECT_EQ(to_token_frame(p, std::vector<double>{1, 2, 3, 4, 5, 6, 7}), (std::vector<double>{0, 1, 2, 0, 0, 5, 6}));
  EXPECT_THROW(to_output_frame(p, std::vector<double>(6)), std::invalid_argument);
}

TEST(Packing, MalformedLayoutsAreRejected) {
  const std::vector<int64_t> decreasing = {0, 4, 2}, short_total = {0, 2, 3}, bad_start = {1, 3};
  EXPECT_THROW(validate(Packing{2, 2, decreasing.data()}), std::invalid_argument);
  EXPECT_THROW(validate(Packing{4, 2, short_total.data()}), std::invalid_argument);
  EXPECT_THROW(validate(Packing{3, 1, bad_start.data()}), std::invalid_argument);
  EXPECT_THROW(validate(Packing{3, 1, nullptr}), std::invalid_argument);
}

TEST(Packing, GlobalCountsMatchNeMoRlsDefinition) {
  GenOptions o;
  o.seed = 41;
  const Case c = make_case(o);
  const Packed p = pack(c.batch, c.lp, {3, 1, 6, 0, 2, 5, 4});
  const ValidCounts vc = valid_counts(p.packing(), p.tm.data(), p.sm.data());
  EXPECT_EQ(vc.tokens, c.batch.g_tok);
  EXPECT_EQ(vc.seqs, c.batch.g_seq);
  double pos = 0;
  for (const RefSeq& s : c.batch.seqs)
    for (size_t t = 1; t < s.length(); ++t) pos += s.token_mask[t] * s.sample_mask * (s.reward > 0);
  EXPECT_EQ(positive_valid_tokens(p.packing(), p.tm.data(), p.sm.data(), p.rewards.data()), pos);
  const std::vector<double> per_seq = {1, 2, 3, 4, 5, 6, 7};
  const std::vector<double> tok = broadcast_to_tokens(p.packing(), per_seq);
  for (size_t k = 0; k < p.order.size(); ++k)
    for (int64_t t = p.offsets[k]; t < p.offsets[k + 1]; ++t) EXPECT_EQ(tok[t], per_seq[k]);
}

TEST(LossAdapterSpecs, RequestsUnfilteredLogprobsOnlyWhenTheKlNeedsThem) {
  ClippedPGConfig cfg;
  LossAdapter a(cfg);
  std::vector<rlh_output_spec> s = a.output_specs(0.7, 0, 1.0);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].kind, RLH_OUTPUT_LOGPROB);
  EXPECT_STREQ(s[0].name, "logprobs");
  EXPECT_EQ(s[0].temperature, 0.7);
  s = a.output_specs(0.7, 50, 0.9);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].top_k, 50);
  EXPECT_EQ(s[0].top_p, 0.9);
  EXPECT_EQ(s[1].kind, RLH_OUTPUT_LOGPROB_RAW);
  EXPECT_STREQ(s[1].name, "logprobs_unfiltered");
  EXPECT_EQ(s[1].temperature, 0.7);
  EXPECT_EQ(s[1].top_k, 0);
  EXPECT_EQ(s[1].top_p, 1.0);
  cfg.reference_policy_kl_penalty = 0;
  LossAdapter no_kl(cfg);
  EXPECT_EQ(no_kl.output_specs(1.0, 50, 0.9).size(), 1u);
  LossAdapter sft{NllConfig{}};
  EXPECT_EQ(sft.output_specs(1.0, 0, 0.5).size(), 1u);
}

}  // namespace
}  // namespace rlh::grpo::test
