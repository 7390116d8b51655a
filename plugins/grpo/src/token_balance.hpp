// Token balancing across data-parallel ranks. With sequence packing or dynamic batching on, a
// rank's step costs about its tokens, so the slowest rank sets the pace: NeMo-RL balances the
// tokens its workers get. After generation, rewards, advantages and logprobs, the ranks of the
// GRPO loop all-gather their shares of each global batch, agree on an assignment of its
// sequences to ranks from the gathered lengths (deterministic: every rank computes the same), and
// each trains on its assigned sequences with the global counts, so results equal plain sharding
// within fp32 rounding. Without packing or dynamic batching the loop keeps the plain shards.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "components.hpp"
#include "rlhost/sdk/comm.hpp"

namespace rlh::grpo {

// Sequences of `lengths` (tokens, in batch order) on `ranks` ranks.
struct RankAssignment {
  std::vector<int> owner;        // per sequence
  std::vector<int64_t> tokens;   // per rank
  int64_t max_tokens() const;
  int64_t min_tokens() const;
};
// Longest first, each to the least-loaded rank (ties: the earlier sequence, the lower rank).
RankAssignment assign_longest_first(std::span<const int64_t> lengths, int ranks);
// The plain shards: rank r holds the `counts[r]` sequences after ranks 0..r-1's, in order.
RankAssignment assign_contiguous(std::span<const int64_t> lengths, std::span<const int64_t> counts);
// The balanced assignment: longest-first, unless the plain shards already have the lower
// maximum (longest-first is within 4/3 of the best, not always better than a lucky split), so
// balancing never raises the largest rank's tokens.
RankAssignment assign_balanced(std::span<const int64_t> lengths, std::span<const int64_t> counts);

// A batch as bytes and back (for the all-gather; the same fields on every rank). `from` names
// where the bytes came from in an error.
std::vector<uint8_t> serialize_batch(const PackedBatch& b);
PackedBatch deserialize_batch(std::span<const uint8_t> bytes, const std::string& from);

// Every rank's bytes, in rank order (collective over `c`).
std::vector<std::vector<uint8_t>> all_gather_bytes(const sdk::Comm& c, const std::vector<uint8_t>& mine);

// This rank's sequences after balancing each chunk of `chunk_seqs` local sequences of `mine` over
// the ranks of `c` (every rank holds the same number of chunks). `bounds` are the chunk starts in
// the result plus its end; the token figures are summed over chunks per rank.
struct BalancedBatch {
  PackedBatch batch;
  std::vector<int64_t> bounds;
  int64_t max_tokens = 0, min_tokens = 0;              // after balancing
  int64_t plain_max_tokens = 0, plain_min_tokens = 0;  // the plain shards'
};
BalancedBatch balance_tokens(const sdk::Comm& c, const PackedBatch& mine, int64_t chunk_seqs);

}  // namespace rlh::grpo
