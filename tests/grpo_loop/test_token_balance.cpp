// Token balancing across data-parallel ranks (plugins/grpo/src/token_balance.cpp): the
// assignment on very uneven lengths, its guarantee against the plain shards, and the batch bytes
// the ranks all-gather (label grpo). The collective part runs under mpirun in
// grpo.dp.balanced_tokens.
#include "token_balance.hpp"

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

}  // namespace
}  // namespace rlh::grpo
