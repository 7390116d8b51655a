// The optimizer a backend runs over an engine's parameters: AdamW (through the engine's Ops, the
// kernel registry's `adamw`) or SGD, with its state kept here so it can be checkpointed.
//
// Why not the engine's own AdamW: the backend must save and restore the optimizer state
// (save_state/load_state) and the engine does not expose its moments or step count. The engine
// still computes the gradients, their global norm and the clip coefficient (train_step with
// apply_optimizer = false); this class applies the update with the same op.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "rlhost/backend_common/backend_config.hpp"
#include "rlhost/engine/allocator.hpp"
#include "rlhost/engine/engine.hpp"
#include "rlhost/engine/ops.hpp"

namespace rlh::backend {

class Optimizer {
 public:
  // `engine` and `ops` must outlive the optimizer. Moments are allocated at the first step (or
  // when a checkpoint brings them). Parameters the description marks untrainable, and those
  // `frozen` names (a frozen MoE router), are never updated and have no state.
  // The moments come from `state` (nullptr: the engine's allocator).
  Optimizer(OptimizerConfig config, Schedule schedule, engine::Engine& engine, engine::Ops& ops,
            const std::function<bool(const sdk::ParamDesc&)>& frozen = {}, engine::Allocator* state = nullptr);

  struct StepInfo {
    double lr = 0;
    double weight_decay = 0;
  };
  // The learning rate and weight decay of the next step: lr_override >= 0 replaces the
  // schedule's lr (the algorithm runs the schedule), weight decay always follows the schedule.
  StepInfo next(double lr_override) const;
  // Applies one update with the engine's accumulated gradients scaled by `grad_scale` (the clip
  // coefficient). Gradients are left in place (the engine clears them at its next step).
  StepInfo step(double lr_override, double grad_scale);
  int64_t steps() const { return steps_; }
  const OptimizerConfig& config() const { return config_; }

  // State for checkpoints: (name, tensor) pairs, torch's names with the engine parameter name
  // ("exp_avg.model.layers.0.mlp.up_proj.weight"); empty before the first step.
  struct StateTensor {
    std::string name;
    std::vector<int64_t> shape;
    std::span<float> data;
  };
  std::vector<StateTensor> state();
  // Makes room for the state (zeros) so a checkpoint can be read into state().
  void allocate_state();
  void set_steps(int64_t s) { steps_ = s; }

 private:
  // A run of parameters adjacent in the engine's storage with the same update rule.
  struct Run {
    float* param;
    float* grad;
    int64_t offset;  // into the state buffers
    int64_t n;
    bool decay;
  };
  OptimizerConfig config_;
  Schedule schedule_;
  engine::Engine& engine_;
  engine::Ops& ops_;
  engine::Allocator* state_ = nullptr;
  std::vector<Run> runs_;
  std::vector<size_t> trainable_;         // parameter indices with state
  std::vector<int64_t> state_offset_;     // per parameter (trainable ones)
  int64_t state_size_ = 0;
  engine::Buffer<float> m_, v_;  // adamw moments, or m_ = sgd momentum buffer
  int64_t steps_ = 0;
};

}  // namespace rlh::backend
