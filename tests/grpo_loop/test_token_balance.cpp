// Token balancing across data-parallel ranks (plugins/grpo/src/token_balance.cpp): the
// assignment on very uneven lengths, its guarantee against the plain shards, and the batch bytes
// the ranks all-gather (label grpo). The collective part runs under mpirun in
// grpo.dp.balanced_tokens.
#include "token_balance.hpp"
#include "rollout_wire.hpp"

#include <gtest/gtest.h>

#include <numeric>

namespace rlh::grpo {
namespace {

TEST(TokenBalance, LongestFirstEvensVeryUnevenShares) {
  // The plain shards give rank 0 the four long sequences and rank 1 the four short ones.
  const std::vector<int64_t> lengths = {200, 190, 180, 170, 5, 5, 5, 5};
  const std::vector<int64_t> counts = {4, 4};
  const RankAssignment plain = assign_contiguous(lengths, counts);
  EXPECT_EQ(plain.tokens, (std::vector<int64_t>{740, 20}));
  const RankAssignment a = assign_balanced(lengths, counts);
  ASSERT_EQ(a.owner.size(), lengths.size());
  std::vector<int64_t> sum(2, 0);
  for (size_t i = 0; i < lengths.size(); ++i) {
    ASSERT_GE(a.owner[i], 0);
    ASSERT_LT(a.owner[i], 2);
    sum[static_cast<size_t>(a.owner[i])] += lengths[i];
  }
  EXPECT_EQ(sum, a.tokens);  // every sequence counted once, on its owner
  EXPECT_EQ(a.max_tokens(), 380);
  EXPECT_EQ(a.min_tokens(), 380);
  // Ties go to the lower rank, the earlier sequence first: every rank computes the same.
  EXPECT_EQ(a.owner, (std::vector<int>{0, 1, 1, 0, 0, 1, 0, 1}));
}

TEST(TokenBalance, NeverAbovePlainShards) {
  // Longest-first gives 7 / 5 here; the plain shards (2 and 3 sequences) are 6 / 6 and are kept.
  const std::vector<int64_t> lengths = {3, 3, 2, 2, 2};
  const std::vector<int64_t> counts = {2, 3};
  EXPECT_EQ(assign_longest_first(lengths, 2).max_tokens(), 7);
  const RankAssignment a = assign_balanced(lengths, counts);
  EXPECT_EQ(a.max_tokens(), 6);
  EXPECT_EQ(a.owner, (std::vector<int>{0, 0, 1, 1, 1}));
  // Four ranks, more ranks than long sequences: each long one alone.
  const std::vector<int64_t> four = {1, 1, 1, 1, 1, 1, 50, 40};
  const RankAssignment b = assign_balanced(four, std::vector<int64_t>{2, 2, 2, 2});
  EXPECT_EQ(b.max_tokens(), 50);
  EXPECT_EQ(b.min_tokens(), 3);
}

PackedBatch sample_batch() {
  PackedBatch b;
  b.add_sequence(std::vector<int32_t>{1, 2, 3});
  b.add_sequence(std::vector<int32_t>{4});
  b.add_sequence(std::vector<int32_t>{5, 6});
  auto& tm = b.field("token_mask", PackedBatch::Frame::kToken);
  std::iota(tm.begin(), tm.end(), 0.5f);
  b.field("sample_mask", PackedBatch::Frame::kSequence) = {1.0f, 0.0f, 1.0f};
  return b;
}

TEST(TokenBalance, BatchBytesRoundTripAndSelect) {
  const PackedBatch b = sample_batch();
  const std::vector<uint8_t> bytes = serialize_batch(b);
  const PackedBatch c = deserialize_batch(bytes, "rank 1");
  EXPECT_EQ(c.tokens(), b.tokens());
  EXPECT_EQ(c.offsets(), b.offsets());
  EXPECT_EQ(*c.find("token_mask"), *b.find("token_mask"));
  EXPECT_EQ(*c.find("sample_mask"), *b.find("sample_mask"));
  // Sequences picked from two parts keep their fields.
  const PackedBatch s = PackedBatch::select({&b, &c}, {{1, 2}, {0, 1}});
  EXPECT_EQ(s.tokens(), (std::vector<int32_t>{5, 6, 4}));
  EXPECT_EQ(s.offsets(), (std::vector<int64_t>{0, 2, 3}));
  EXPECT_EQ(*s.find("token_mask"), (std::vector<float>{4.5f, 5.5f, 3.5f}));
  EXPECT_EQ(*s.find("sample_mask"), (std::vector<float>{1.0f, 0.0f}));
  // Damaged bytes are one error naming the rank, never a read past the end.
  for (size_t cut : {size_t{0}, size_t{7}, bytes.size() / 2, bytes.size() - 1}) {
    try {
      deserialize_batch(std::span<const uint8_t>(bytes.data(), cut), "rank 1");
      ADD_FAILURE() << "truncated at " << cut << " was accepted";
    } catch (const sdk::Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
    }
  }
}

// A rollout as bytes (dynamic sampling at several ranks gathers whole generation batches): every
// field comes back, merged parts shift the prompt indices, and damaged bytes are one error.
TEST(RolloutWire, RoundTripMergeAndDamage) {
  Rollout r;
  r.samples_per_prompt = 2;
  for (int p = 0; p < 2; ++p) {
    Prompt q;
    q.row_index = 10 + p;
    q.row = nlohmann::json{{"problem", "1+" + std::to_string(p)}, {"expected_answer", p + 1}};
    q.text = "1+" + std::to_string(p) + "=";
    q.ids = {1, 2, 3 + p};
    q.too_long = p == 1;
    r.prompts.push_back(q);
    for (int k = 0; k < 2; ++k) {
      Response s;
      s.prompt = p;
      s.ids = {7, 8 + k};
      s.logprobs = {-0.5f, -1.25f * static_cast<float>(k + 1)};
      s.truncated = k == 1;
      s.weight_version = k == 0 ? -1 : 3;
      s.text = "x" + std::to_string(k);
      s.rewards = {1.0 * k, 0.5};
      s.mask = {1, static_cast<uint8_t>(k)};
      s.turns = 1 + k;
      s.terminated = k == 0;
      r.responses.push_back(s);
    }
  }
  const std::vector<uint8_t> bytes = serialize_rollout(r);
  const Rollout c = deserialize_rollout(bytes, "rank 1");
  ASSERT_EQ(c.prompts.size(), 2u);
  ASSERT_EQ(c.responses.size(), 4u);
  EXPECT_EQ(c.samples_per_prompt, 2);
  for (size_t p = 0; p < 2; ++p) {
    EXPECT_EQ(c.prompts[p].row_index, r.prompts[p].row_index);
    EXPECT_EQ(c.prompts[p].row, r.prompts[p].row);
    EXPECT_EQ(c.prompts[p].text, r.prompts[p].text);
    EXPECT_EQ(c.prompts[p].ids, r.prompts[p].ids);
    EXPECT_EQ(c.prompts[p].too_long, r.prompts[p].too_long);
  }
  for (size_t i = 0; i < 4; ++i) {
    const Response &a = r.responses[i], &b = c.responses[i];
    EXPECT_EQ(b.prompt, a.prompt);
    EXPECT_EQ(b.ids, a.ids);
    EXPECT_EQ(b.logprobs, a.logprobs);
    EXPECT_EQ(b.truncated, a.truncated);
    EXPECT_EQ(b.weight_version, a.weight_version);
    EXPECT_EQ(b.text, a.text);
    EXPECT_EQ(b.rewards, a.rewards);
    EXPECT_EQ(b.mask, a.mask);
    EXPECT_EQ(b.turns, a.turns);
    EXPECT_EQ(b.terminated, a.terminated);
  }
  std::vector<Rollout> parts = {r, c};
  const Rollout m = merge_rollouts(std::move(parts));
  ASSERT_EQ(m.responses.size(), 8u);
  EXPECT_EQ(m.responses[5].prompt, 2);  // the second part's first prompt follows the first part's two
  EXPECT_EQ(m.prompts[3].row_index, 11);
  for (size_t cut : {size_t{0}, size_t{7}, bytes.size() / 2, bytes.size() - 1}) {
    try {
      deserialize_rollout(std::span<const uint8_t>(bytes.data(), cut), "rank 1");
      ADD_FAILURE() << "truncated at " << cut << " was accepted";
    } catch (const sdk::Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
    }
  }
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  EXPECT_THROW(deserialize_rollout(longer, "rank 1"), sdk::Error);
}

}  // namespace
}  // namespace rlh::grpo
