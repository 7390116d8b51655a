// Context parallelism for the backends (megatron_cfg.context_parallel_size; docs/parallelism.md):
// the engine's group over a communicator, counting what it moves.
#pragma once

#include <cstdint>

#include "rlhost/engine/engine.hpp"
#include "rlhost/sdk/comm.hpp"

namespace rlh::backend {

// The engine's context-parallel group (engine::CpComm) over the backend's cp communicator.
// bytes(): ring traffic, (S-1)/S of each all-gather's output and each reduce-scatter's input.
class CommCpGroup : public engine::CpComm {
 public:
  explicit CommCpGroup(const sdk::Comm& c) : c_(c) {}
  int size() const override { return c_.size(); }
  int rank() const override { return c_.rank(); }
  void all_gather(const float* in, int64_t n, float* out) override;
  void reduce_scatter_sum(const float* in, int64_t n, float* out) override;
  int64_t bytes() const { return bytes_; }
  double seconds() const { return seconds_; }

 private:
  const sdk::Comm& c_;
  int64_t bytes_ = 0;
  double seconds_ = 0;
};

}  // namespace rlh::backend
