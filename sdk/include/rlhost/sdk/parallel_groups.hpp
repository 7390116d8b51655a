// Rank groups from parallel sizes: one pure function, no global state (static library
// rlh_parallel).
//
// Ranks are laid out the way Megatron-Core's RankGenerator lays them out for an order string
// (default "tp-cp-ep-dp-pp", the first name varying fastest): with that order and ep = 1 in the
// dense part,
//
//   world rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)).
//
// The expert part (MoE layers) is laid out by a second generator over the same ranks with
// expert tensor parallel size etp (default tp), ep, expert data parallel size
// edp = world / (etp * ep * pp) and cp = 1, as Megatron does. Every group of a kind is listed,
// each in Megatron's order (masked dimensions, the first of the order fastest), so that group
// index and position in the group are what a communicator split takes as color and key:
//
//   const ParallelLayout layout = make_parallel_layout(sizes, world.size());
//   const RankGroups mine = groups_of_rank(layout, world.rank());
//   Comm dp = world.split(mine.of(GroupKind::dp));   // color = group index, key = position
//
// The engines receive their groups (and the communicators split from them) as arguments;
// nothing here is global. docs/parallelism.md lists the kinds and what each is used for.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace rlh::sdk {

// Parallel sizes as Megatron-Core names them (NeMo-RL's megatron_cfg keys in brackets).
struct ParallelSizes {
  int64_t tp = 1;   // tensor_model_parallel_size
  int64_t cp = 1;   // context_parallel_size
  int64_t pp = 1;   // pipeline_model_parallel_size
  int64_t ep = 1;   // expert_model_parallel_size
  int64_t etp = 0;  // expert_tensor_parallel_size; 0 = tp (Megatron's default)
  int64_t dp = 0;   // data parallel size; 0 = world / (tp * cp * pp), otherwise checked against it
  // Replicas of the sharded state over the data-parallel ranks: Megatron's
  // num_distributed_optimizer_instances, FSDP2's HSDP dp_replicate. The dp x cp ranks of a model
  // replica split into dp_replicate groups of contiguous "shard" ranks; "replicate" groups take
  // one rank of each. Must divide dp * cp and edp.
  int64_t dp_replicate = 1;
  std::string order = "tp-cp-ep-dp-pp";
};

enum class GroupKind : int {
  tp = 0,              // tensor parallel
  cp,                  // context parallel
  dp,                  // data parallel (without cp)
  dp_cp,               // data parallel with cp: where dense gradients are reduced
  pp,                  // pipeline stages of one model replica
  mp,                  // model parallel: tp x pp ("tp-pp")
  tp_cp,               // tp x cp
  tp_dp,               // tp x dp
  tp_dp_cp,            // tp x dp x cp
  embedding,           // first and last pipeline stage of each pp group (only those ranks)
  position_embedding,  // first pipeline stage of each pp group (only those ranks)
  dp_cp_shard,         // the dp_cp ranks of one replica (dp_replicate > 1): the sharding group
  dp_cp_replicate,     // one rank of each shard group at the same position: replicas
  ep,                  // expert model parallel
  expert_tp,           // expert tensor parallel (etp)
  expert_tp_ep,        // etp x ep
  expert_tp_ep_pp,     // etp x ep x pp
  expert_dp,           // expert data parallel: where expert gradients are reduced
  expert_dp_shard,     // expert_dp split like dp_cp_shard
  expert_dp_replicate, // expert_dp split like dp_cp_replicate
};
inline constexpr int kNumGroupKinds = static_cast<int>(GroupKind::expert_dp_replicate) + 1;

// "tp", "dp_cp", "expert_dp", ... (the enum names).
const char* group_kind_name(GroupKind k);

struct ParallelLayout {
  int64_t world_size = 1;
  // Resolved sizes (dp, etp, edp filled in).
  int64_t tp = 1, cp = 1, pp = 1, dp = 1, ep = 1, etp = 1, edp = 1, dp_replicate = 1;
  std::string order;  // normalised: lower case, every name present
  // groups[kind][i] = world ranks of group i of that kind, in group order. Every kind except
  // embedding and position_embedding partitions the world.
  std::array<std::vector<std::vector<int>>, kNumGroupKinds> groups;

  const std::vector<std::vector<int>>& of(GroupKind k) const { return groups[static_cast<int>(k)]; }
};

// Validates the sizes against the world and builds every group. Throws
// rlh::sdk::Error(INVALID_ARGUMENT) with a one-line message naming the sizes at fault, e.g.
// "world size 6 is not divisible by tp x cp x pp = 2 x 1 x 2 = 4".
ParallelLayout make_parallel_layout(const ParallelSizes& sizes, int64_t world_size);

// One rank's place in one kind of group.
struct RankGroup {
  GroupKind kind = GroupKind::tp;
  int index = -1;     // which group of the kind (a split's color); -1: the rank is in none
  int position = -1;  // the rank's place in it (a split's key)
  std::vector<int> ranks;  // the group's world ranks; empty when index is -1
  bool member() const { return index >= 0; }
};

struct RankGroups {
  int rank = 0;
  // Coordinates in the dense and the expert layout.
  int tp_rank = 0, cp_rank = 0, dp_rank = 0, pp_rank = 0;
  int etp_rank = 0, ep_rank = 0, edp_rank = 0;
  std::array<RankGroup, kNumGroupKinds> groups;
  const RankGroup& of(GroupKind k) const { return groups[static_cast<int>(k)]; }
};

// The groups `rank` belongs to. Throws Error(INVALID_ARGUMENT) when rank is outside the world.
RankGroups groups_of_rank(const ParallelLayout& layout, int rank);

// Megatron's generate_masked_orthogonal_rank_groups: for dimensions `sizes` (the first fastest)
// and a mask of those that vary inside a group, every group's ranks. Exposed for tests.
std::vector<std::vector<int>> masked_rank_groups(const std::vector<int64_t>& sizes,
                                                 const std::vector<bool>& mask);

}  // namespace rlh::sdk
