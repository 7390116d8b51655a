// The data-parallel ranks of a training loop (docs/parallelism.md). Every launched rank is a
// data-parallel rank of the policy; each takes its contiguous share of every global batch, as
// NeMo-RL shards each global batch over its data-parallel workers, and passes the backend the
// global batch's counts so the loss is normalised as on one rank. What the loop itself sums over
// the batch (validation rows, rollout statistics) is summed over `world`. Rank 0 owns the
// checkpoint folders; the backend's save_state is collective.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "components.hpp"
#include "rlhost/grpo/packing.hpp"
#include "rlhost/sdk/checkpoint.hpp"
#include "rlhost/sdk/comm.hpp"
#include "rlhost/sdk/plugin.hpp"

namespace rlh::grpo {

struct LoopRanks {
  sdk::Comm world;  // the host's world; empty when one rank was launched
  int rank = 0, size = 1;

  // The launch's world (one rank without a launcher).
  static LoopRanks of_launch(const sdk::Host& host);
  bool writer() const { return rank == 0; }

  // This rank's contiguous share of `n` items: [n r / N, n (r + 1) / N).
  int64_t begin_of(int64_t n) const { return n * rank / size; }
  int64_t end_of(int64_t n) const { return n * (rank + 1) / size; }
  // This rank's share of `rows` (in order).
  std::vector<int64_t> share(const std::vector<int64_t>& rows) const;

  // Element-wise sums over the ranks (nothing to do at one rank).
  void sum(std::vector<double>& v) const;
  ValidCounts sum(const ValidCounts& mine) const;
  // Rank 0's text on every rank.
  std::string broadcast_text(const std::string& text) const;
  void barrier() const;
};

// Step `step`'s checkpoint with the policy folder saved in it (save_policy_folder): rank 0 owns
// the folder and gets the pending checkpoint back to add its files and commit; every rank takes
// part in the backend's save_state and the others get nullopt.
std::optional<sdk::PendingCheckpoint> begin_policy_checkpoint(const LoopRanks& ranks, sdk::CheckpointManager& ckpt,
                                                              int64_t step, Backend& backend, rlh_model* policy,
                                                              const std::string& tokenizer_name,
                                                              const std::string& model_dir);

// Sums `v` element-wise over the group (a no-op for an empty or one-rank group).
void sum_over(const sdk::Comm& c, std::vector<double>& v);
// Rank 0's text on every rank of the group.
std::string broadcast_text(const sdk::Comm& c, const std::string& text);

}  // namespace rlh::grpo
