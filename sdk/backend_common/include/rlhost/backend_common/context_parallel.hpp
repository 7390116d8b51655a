// Context parallelism for the backends (megatron_cfg.context_parallel_size; docs/model_parallelism.md):
// the engine's group over a communicator, counting what it moves.
#pragma once

#include <cstdint>

#include "rlhost/backend_common/data_parallel.hpp"
#include "rlhost/engine/engine.hpp"
#include "rlhost/sdk/comm.hpp"

namespace rlh::backend {

// The engine's context-parallel group (engine::CpComm) over the backend's cp communicator.
// bytes(): ring traffic, (S-1)/S of each all-gather's output and each reduce-scatter's input,
// 2 (S-1)/S of each all-reduce.
// The collectives and their counts are CommTpGroup's (sequence parallelism's all-gather and
// reduce-scatter), over the cp communicator.
class CommCpGroup : public engine::CpComm {
 public:
  explicit CommCpGroup(const sdk::Comm& c) : c_(c), counted_(c) {}
  int size() const override { return c_.size(); }
  int rank() const override { return c_.rank(); }
  void all_gather(const float* in, int64_t n, float* out) override { counted_.all_gather(in, n, out); }
  void reduce_scatter_sum(const float* in, int64_t n, float* out) override { counted_.reduce_scatter_sum(in, n, out); }
  void all_reduce_sum(double* data, int64_t n) override { counted_.all_reduce_sum(data, n); }
  int64_t bytes() const { return counted_.bytes(); }
  double seconds() const { return counted_.seconds(); }

 private:
  const sdk::Comm& c_;
  CommTpGroup counted_;
};

}  // namespace rlh::backend
