// The data-parallel ranks of a training loop (docs/parallelism.md). Each data-parallel rank takes
// its contiguous share of every global batch, as NeMo-RL shards each global batch over its
// data-parallel workers, and passes the backend the global batch's counts so the loss is
// normalised as on one rank. Without model parallelism every launched rank is a data-parallel
// rank. Under the backend's tensor, context or pipeline parallelism the backend names the layout
// (BACKEND 0.3's data_parallel): the ranks of one model-parallel group share a data-parallel rank
// and train on the same share (the backend's collectives need every rank of the group in the
// step), and what the loop sums over the batch (loss normalisers, validation rows, rollout
// statistics) is summed over the data-parallel ranks only (`sums()`), so no share counts twice.
// World rank 0 owns the checkpoint folders; the backend's save_state is collective.
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
  int world_rank = 0, world_size = 1;
  // This rank's data-parallel rank and size (the world's without model parallelism).
  int rank = 0, size = 1;
  // After follow_backend: the ranks of this rank's model-parallel group (those sharing its
  // data-parallel rank, in world order) and the data-parallel ranks at its position in the
  // group. Empty at one rank or when the backend does not name its layout.
  sdk::Comm group, dp;

  // The launch's world, every rank data-parallel (one rank without a launcher).
  static LoopRanks of_launch(const sdk::Host& host);
  // Takes `model`'s data-parallel layout from the backend (collective over the world: call it on
  // every rank, after the model loaded). A backend without data_parallel keeps the world's.
  void follow_backend(const sdk::Host& host, Backend& backend, rlh_model* model);
  // Where sums over the data-parallel ranks go (the world without model parallelism).
  const sdk::Comm& sums() const { return dp ? dp : world; }
  // Ranks per model-parallel group (1 without model parallelism).
  int group_size() const { return world_size / size; }
  bool writer() const { return world_rank == 0; }

  // This rank's contiguous share of `n` items: [n r / N, n (r + 1) / N).
  int64_t begin_of(int64_t n) const { return n * rank / size; }
  int64_t end_of(int64_t n) const { return n * (rank + 1) / size; }
  // This rank's share of `rows` (in order).
  std::vector<int64_t> share(const std::vector<int64_t>& rows) const;

  // Element-wise sums over the data-parallel ranks (nothing to do at one).
  void sum(std::vector<double>& v) const;
  ValidCounts sum(const ValidCounts& mine) const;
  // World rank 0's text on every rank.
  std::string broadcast_text(const std::string& text) const;
  // World rank 0's answer on every rank (a decision from its clock, which all must follow).
  bool rank0(bool mine) const;
  void barrier() const;  // over the world
};

// When a training loop saves and whether it stops for checkpointing.checkpoint_must_save_by, as
// NeMo-RL's training functions decide: a step saves on its number (save_period, ft_save_period),
// as the last, for a reason of the loop's (GRPO's early stop), or when the save deadline is due,
// which world rank 0's clock decides for every rank. Made where the loop starts (the deadline's
// budget counts from there).
class SaveSchedule {
 public:
  explicit SaveSchedule(std::optional<int64_t> budget_s) : deadline_(budget_s) {}
  // After step `step`'s training and validation: whether it is saved (may_save_checkpoint
  // included; never without a checkpoint manager).
  bool after_step(const LoopRanks& ranks, const sdk::Host& host, const sdk::CheckpointManager* ckpt, int64_t step,
                  bool last, bool forced = false);
  // The deadline was due at the last step: the loop stops after it.
  bool out_of_time() const { return out_of_time_; }

 private:
  sdk::SaveDeadline deadline_;
  bool out_of_time_ = false;
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
