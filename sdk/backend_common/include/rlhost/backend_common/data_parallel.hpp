// Data parallelism with sharded training state, for both backends (docs/parallelism.md).
//
// Every rank of the world is a data-parallel rank (the other parallel sizes are refused) and
// trains on its own shard of the global batch; the algorithm passes the global token and
// sequence counts, so gradients summed over ranks are the global batch's. Three ways to keep
// the state:
//
//   fsdp (dtensor)                 parameters, gradients and optimizer moments sharded over the
//                                  shard group, per unit of the engine (a layer, or the global
//                                  tensors), flat: a unit is all-gathered before use and its
//                                  gradients reduce-scattered after its backward (FsdpStore, an
//                                  engine::UnitStore). HSDP (dp_replicate_size R): R replicas of
//                                  that sharding, gradient shards all-reduced over replicas.
//   distributed optimizer          Megatron's: every rank keeps the whole model and its gradient
//   (megatron)                     buffer; the buffer is reduce-scattered, AdamW updates this
//                                  rank's contiguous block of the fp32 weights with its block of
//                                  the moments, and the weights are all-gathered back.
//   ddp (megatron without          gradients all-reduced, every rank updates everything.
//   use_distributed_optimizer)
//
// The gradient norm is the global one (an all-reduce of the shards' sums of squares), so
// clipping, non-finite skips and the update agree on every rank. Sharded state is saved with
// global shapes (the same files as one rank writes) and loads at any data-parallel size.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "rlhost/backend_common/backend_config.hpp"
#include "rlhost/backend_common/optimizer.hpp"
#include "rlhost/engine/allocator.hpp"
#include "rlhost/engine/engine.hpp"
#include "rlhost/engine/unit_store.hpp"
#include "rlhost/sdk/comm.hpp"
#include "rlhost/sdk/plugin.hpp"

namespace rlh::backend {

// The data-parallel groups of a backend instance, split once from the host's world.
struct DpGroups {
  sdk::Comm dp;         // every data-parallel rank: batch shards, loss and metric sums
  sdk::Comm shard;      // the ranks one copy of the state is sharded over (dp without HSDP)
  sdk::Comm replicate;  // HSDP: the replicas of one shard (empty without)
  // Tensor parallelism (megatron_cfg.tensor_model_parallel_size = tp > 1): the ranks one
  // model's layers are split over (Megatron's order: tp ranks adjacent), and every rank of the
  // job (checkpoint writes and agreement). Without tensor parallelism `tp` is a group of one.
  sdk::Comm tp;
  sdk::Comm all;
  // Expert parallelism (megatron_cfg.expert_model_parallel_size = ep > 1; Megatron's expert
  // layout, carved from the tp x cp x dp ranks of a stage): the ranks one MoE layer's experts are split
  // over, and the expert data-parallel ranks that hold the same experts (where their gradients
  // are reduced). Empty without expert parallelism.
  sdk::Comm ep;
  sdk::Comm edp;
  // With expert parallelism, the expert tensor-parallel group (Megatron's expert_tp: the ranks
  // holding the other blocks of the same experts, etp ranks fastest); a group of one at etp 1.
  sdk::Comm etp;
  // Context parallelism (megatron_cfg.context_parallel_size = cp > 1; context_parallel.hpp): the
  // ranks that split every sequence (tp ranks fastest, then cp), and the data-parallel ranks
  // without them, over which losses, token counts and metrics are summed (every rank of a cp
  // group computes the same loss). Gradients and the distributed optimizer stay on `dp` (dp_cp).
  sdk::Comm cp;
  sdk::Comm dp_only;
  int cp_size() const { return cp ? cp.size() : 1; }
  const sdk::Comm& sums() const { return cp_size() > 1 ? dp_only : dp; }
  // Pipeline parallelism (megatron_cfg.pipeline_model_parallel_size = pp > 1): the stages of one
  // model replica (Megatron's order: pp varies slowest), and the first and last stage of each
  // (the embedding group: a tied embedding's gradients; empty on middle stages). Without it
  // `pp` is a group of one.
  sdk::Comm pp;
  sdk::Comm embedding;
  int size() const { return dp.size(); }
  int rank() const { return dp.rank(); }
  int tp_size() const { return tp ? tp.size() : 1; }
  int tp_rank() const { return tp ? tp.rank() : 0; }
  int ep_size() const { return ep ? ep.size() : 1; }
  int ep_rank() const { return ep ? ep.rank() : 0; }
  int pp_size() const { return pp ? pp.size() : 1; }
  int pp_rank() const { return pp ? pp.rank() : 0; }
};

// The world's size as the launcher started it (1 without a launcher).
int launched_world_size();

// Splits the groups for `dp_replicate` replicas and `tp` tensor-parallel ranks from the host's
// world (collective: every rank calls it in the same order). Throws Error naming the sizes when
// they do not fit.
// `etp`: the expert tensor-parallel size of Megatron's expert layout (0: tp).
std::unique_ptr<DpGroups> make_dp_groups(const sdk::Host& host, int64_t dp_replicate, const std::string& who,
                                         int64_t tp = 1, int64_t cp = 1, int64_t pp = 1, int64_t ep = 1,
                                         int64_t etp = 0);

// The engine's tensor-parallel group over a communicator, counting what it moves (ring traffic:
// 2 (T-1)/T of each all-reduced tensor; (T-1)/T of an all-gather's output and a reduce-scatter's
// input, sequence parallelism's).
class CommTpGroup : public engine::TpComm {
 public:
  explicit CommTpGroup(const sdk::Comm& c) : c_(c) {}
  void all_reduce_sum(float* data, int64_t n) override;
  void all_reduce_sum(double* data, int64_t n) override;
  void all_reduce_max(float* data, int64_t n) override;
  void all_gather(const float* in, int64_t n, float* out) override;
  void reduce_scatter_sum(const float* in, int64_t n, float* out) override;
  int64_t bytes() const { return bytes_; }
  double seconds() const { return seconds_; }

 private:
  template <typename T>
  void reduce(T* data, int64_t n, int32_t op);
  const sdk::Comm& c_;
  int64_t bytes_ = 0;
  double seconds_ = 0;
};

// The engine's expert-parallel group over a communicator (expert_parallel.cpp), counting what
// this rank sends to the others: the counts' all-to-alls and every row it dispatches or combines
// (the exchanges are pairwise sends of exactly the routed rows: dropless, no padding).
class CommEpGroup : public engine::EpComm {
 public:
  explicit CommEpGroup(const sdk::Comm& c) : c_(c) {}
  void all_to_all(const int64_t* send, int64_t* recv, int64_t n) override;
  void all_to_all_v(const float* send, std::span<const int64_t> send_counts, float* recv,
                    std::span<const int64_t> recv_counts) override;
  int64_t bytes() const { return bytes_; }
  double seconds() const { return seconds_; }

 private:
  const sdk::Comm& c_;
  int64_t bytes_ = 0;
  double seconds_ = 0;
};

// A device engine's data-parallel group (engine::DeviceDpComm) over a communicator whose
// collectives take tensors on `device` (sdk::make_device_comm: comm_nccl, or comm_mpi staging
// through the host where ranks share a GPU).
class CommDeviceDp : public engine::DeviceDpComm {
 public:
  CommDeviceDp(sdk::Comm comm, rlh_device device) : c_(std::move(comm)), device_(device) {}
  int size() const override { return c_.size(); }
  int rank() const override { return c_.rank(); }
  void all_reduce_sum(float* data, int64_t n, void* stream) override;
  void reduce_scatter_sum(const float* in, float* out, int64_t block, void* stream) override;
  void all_gather(const void* mine, void* all, int64_t block, int element_bytes, void* stream) override;
  const sdk::Comm& comm() const { return c_; }

 private:
  sdk::Comm c_;
  rlh_device device_;
};

// ---------------------------------------------------------------------------------------------
// Where a rank's shard lies in the engine's flat storage.

// A range [begin, end) of the flat storage cut into `size` equal blocks of `block` elements (the
// last ones padded): rank r holds [begin + r*block, begin + (r+1)*block) (clipped at end) at
// [at, at + block) of its shard storage.
struct ShardSegment {
  int64_t begin = 0, end = 0, block = 0, at = 0;
  int rank = 0, size = 1;  // this rank's place in the segment's group
};
// A piece of this rank's shard the optimizer updates alike (decayed or not).
struct ShardRun {
  int64_t at = 0;    // in the shard storage
  int64_t flat = 0;  // in the engine's flat storage
  int64_t n = 0;
  bool decay = true;
};

class ShardLayout {
 public:
  // `ranges`: the segments (FSDP: the engine's units; Megatron: the whole padded storage).
  // `updated(i)`: whether parameter i gets updates (trainable and not a frozen router).
  ShardLayout(const engine::Engine& e, const std::vector<std::pair<int64_t, int64_t>>& ranges, int rank, int size,
              const std::function<bool(size_t)>& updated, bool decay_1d_params);
  // Each range sharded over its own group ({rank, size} per range): Megatron's distributed
  // optimizer under expert parallelism shards the dense parameters over the data-parallel group
  // and the experts over the expert data-parallel group.
  ShardLayout(const engine::Engine& e, const std::vector<std::pair<int64_t, int64_t>>& ranges,
              const std::vector<std::pair<int, int>>& groups, const std::function<bool(size_t)>& updated,
              bool decay_1d_params);
  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::vector<ShardSegment>& segments() const { return segments_; }
  const std::vector<ShardRun>& runs() const { return runs_; }
  int64_t elements() const { return elements_; }  // this rank's shard storage, padding included
  // Copies this rank's part of a parameter (n elements at flat offset `flat`) into shard storage.
  void scatter_param(int64_t flat, const float* data, int64_t n, float* shard) const;
  // Which segment holds flat index `i`.
  size_t segment_of(int64_t flat) const;

 private:
  int rank_ = 0, size_ = 1;
  std::vector<ShardSegment> segments_;
  std::vector<ShardRun> runs_;
  int64_t elements_ = 0;
};

// ---------------------------------------------------------------------------------------------
// AdamW / SGD over a shard (the rules of optimizer.hpp, elementwise, so a shard's update is the
// update of those elements).

class ShardOptimizer {
 public:
  ShardOptimizer(OptimizerConfig config, Schedule schedule, const ShardLayout& layout, engine::Ops& ops,
                 engine::Allocator& state);
  Optimizer::StepInfo next(double lr_override) const;
  // One update: parameters at `params` (indexed by ShardRun::flat when `by_flat`, else by
  // ShardRun::at), gradients in shard storage, scaled by `grad_scale`.
  Optimizer::StepInfo step(double lr_override, double grad_scale, float* params, bool by_flat, float* grad_shard);
  int64_t steps() const { return steps_; }
  void set_steps(int64_t s) { steps_ = s; }
  const OptimizerConfig& config() const { return config_; }
  void allocate_state();
  bool has_state() const { return m_.size() != 0; }
  // The moments in shard storage (empty before the first step or allocate_state): exp_avg (or
  // SGD's momentum buffer) and exp_avg_sq.
  float* first() const { return m_.data(); }
  float* second() const { return v_.data(); }

 private:
  OptimizerConfig config_;
  Schedule schedule_;
  const ShardLayout& layout_;
  engine::Ops& ops_;
  engine::Allocator& alloc_;
  engine::Buffer<float> m_, v_;
  int64_t steps_ = 0;
};

// ---------------------------------------------------------------------------------------------
// FSDP: the engine's UnitStore over flat shards of every unit.

class FsdpStore : public engine::UnitStore {
 public:
  // `state`: the shards (parameters, gradients); `work`: gathered units while in use. The
  // engine is made with the store, then the layout of its units is bound (allocating the shards).
  FsdpStore(const DpGroups& groups, engine::Allocator& state, engine::Allocator& work);
  void bind(const ShardLayout& layout);

  float* acquire_params(int64_t unit) override;
  void release_params(int64_t unit) override;
  float* acquire_grads(int64_t unit) override;
  void release_grads(int64_t unit) override;

  float* param_shard() const { return params_.data(); }
  float* grad_shard() const { return grads_.data(); }
  // A step's gradients start from zero; after the last micro-batch, HSDP replicas sum theirs.
  void begin_step();
  void end_step();
  // What a rank without a (further) micro-batch does so its peers' collectives meet: the
  // gathers of a forward, or of a forward and backward with zero gradients (the engine's order,
  // unit_store.hpp).
  void idle_forward();
  void idle_microbatch();
  // Drops whatever is held (after an exception in an engine call).
  void reset();
  // The whole unit's parameters (collective), e.g. for visit_weights and save_state.
  std::vector<float> gather_unit(int64_t unit) const;
  // Bytes moved by this rank's collectives since construction (benchmarks).
  int64_t bytes_gathered() const { return bytes_gathered_; }
  int64_t bytes_reduced() const { return bytes_reduced_; }
  double comm_seconds() const { return comm_seconds_; }  // inside collectives, since construction

 private:
  void gather_into(int64_t unit, float* full) const;
  // Work buffers of a unit's size, kept between uses (a step asks for the same sizes again).
  engine::Buffer<float> take(size_t n);
  void give_back(engine::Buffer<float> b);
  std::vector<engine::Buffer<float>> pool_;
  const DpGroups& g_;
  const ShardLayout* layout_ = nullptr;
  engine::Allocator& state_;
  engine::Allocator& work_;
  engine::Buffer<float> params_, grads_;
  std::map<int64_t, engine::Buffer<float>> held_params_, held_grads_;
  engine::Buffer<float> reduced_;  // one block: a unit's reduce-scatter result
  mutable int64_t bytes_gathered_ = 0;
  int64_t bytes_reduced_ = 0;
  mutable double comm_seconds_ = 0;
};

// Sums (or max for names starting "moe/max") named values over the group; names missing on a
// rank count as 0 there. Collective.
std::vector<std::pair<std::string, double>> all_reduce_named(const sdk::Comm& c,
                                                             const std::vector<std::pair<std::string, double>>& mine);

// A float range as a 1-d host tensor for sdk::Comm calls.
struct FloatView {
  int64_t n = 0;
  rlh_tensor t{};
  FloatView(float* p, int64_t count);
  FloatView(const FloatView&) = delete;
  const rlh_tensor& operator*() const { return t; }
};

}  // namespace rlh::backend
