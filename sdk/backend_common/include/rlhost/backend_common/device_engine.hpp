// The seam where a backend flavor runs a model on an accelerator instead of the CPU engine.
//
// backend_common itself knows no device: a flavor that has a device path (megatron: the CUDA
// engine, bf16 compute with fp32 master weights, through the kernel registry's ops for the device)
// supplies a DeviceEngineFactory in its BackendFlavor. The model then lives on the device whole: weights,
// gradients and the optimizer (its own fused AdamW, so no host round trip per step), and the
// backend reaches it only through this interface: batches and output views stay the CPU
// engine's types, so batching, the loss-callback trampoline, weights in HF naming and training
// states are shared with the CPU path unchanged.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "rlhost/engine/engine.hpp"
#include "rlhost/tensor.h"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/model_desc.hpp"
#include "rlhost/sdk/tensor_parallel.hpp"

namespace rlh::backend {

class DeviceEngine {
 public:
  virtual ~DeviceEngine() = default;
  // One line for logs: device, its name, precision.
  virtual std::string describe() const = 0;
  virtual int64_t num_elements() const = 0;

  virtual engine::Outputs forward(const engine::MicroBatch& mb, const engine::OutputRequest& req) = 0;
  // engine::Engine::train_step's contract. With so.apply_optimizer the device's AdamW applies the
  // update with so.lr and `weight_decay` (the schedule's, for parameters that decay), scaled by
  // the clip coefficient; a non-finite gradient norm skips it.
  virtual engine::StepResult train_step(std::span<const engine::MicroBatch> mbs, const engine::StepOptions& so,
                                        double weight_decay, const engine::LossFn& loss_fn) = 0;
  virtual int64_t steps() const = 0;  // optimizer updates applied (the weights version)

  // A loss that runs on the device (rlh_train_args.loss_on_device): per micro-batch it reads
  // the logprob output token-aligned in device memory and writes its gradient and loss there,
  // stream-ordered on `stream`, never synchronising. `inputs` is uploaded once, at the step's
  // start; `keep(value, slot)` copies a device scalar into one of the step's `slots`, which
  // come down with the gradient norm (the step's one host wait) into *kept.
  struct DeviceLossViews {
    const float* logprob = nullptr;  // [N]
    float* dlogprob = nullptr;       // [N], zeroed
    float* loss = nullptr;           // float32 scalar, zeroed
    const int32_t* cu_seqlens = nullptr;  // [S+1]
    const float* inputs = nullptr;
    void* stream = nullptr;
    std::function<void(const float* value, int64_t slot)> keep;
  };
  struct DeviceLoss {
    std::span<const float> inputs;
    int64_t slots = 0;
    std::function<void(const engine::LossContext&, const DeviceLossViews&)> run;
    std::vector<float>* kept = nullptr;
  };
  // Whether train_step_device_loss is offered (the request must read the logprob output alone).
  virtual bool device_loss() const { return false; }
  virtual engine::StepResult train_step_device_loss(std::span<const engine::MicroBatch> mbs,
                                                    const engine::StepOptions& so, double weight_decay,
                                                    const DeviceLoss& loss) {
    (void)mbs, (void)so, (void)weight_decay, (void)loss;
    throw std::logic_error("this device engine has no loss on the device");
  }

  // fp32 master weights, desc().params order (host copies).
  virtual std::vector<std::vector<float>> parameters() const = 0;
  // The same weights where they live, for a refit that reads device memory (visit_weights_on):
  // per parameter, `pieces` runs of `piece` fp32 elements `stride` apart (one run: contiguous).
  // The engine's pending writes are complete when a view is given.
  struct ParamView {
    const float* data = nullptr;
    int64_t pieces = 1, piece = 0, stride = 0;
  };
  virtual rlh_device device() const = 0;
  // fn(param index, its view) for every parameter in desc().params order; under FSDP the
  // masters are gathered unit by unit (collective over the group) and a view is valid only
  // during its call.
  virtual void visit_master_views(const std::function<void(size_t, const ParamView&)>& fn) const = 0;
  // FSDP: one forward's collectives without data (a rank with fewer micro-batches than its
  // peers; dp_forward), the request refused as forward refuses it; nothing otherwise.
  virtual void idle_forward(const engine::OutputRequest& req) { (void)req; }
  virtual void load_parameters(const std::vector<std::vector<float>>& tensors) = 0;
  // AdamW moments per parameter, desc().params order (zeros for untrainable ones).
  struct AdamState {
    int64_t step = 0;
    std::vector<std::vector<float>> exp_avg, exp_avg_sq;
  };
  // With a sharded optimizer (DeviceEngineOptions::shard_optimizer) adam_state() is collective
  // over the data-parallel group and load_adam_state() keeps this rank's block.
  virtual AdamState adam_state() const = 0;
  virtual void load_adam_state(const AdamState& state) = 0;
  // FP8 delayed scaling's amax histories (engine::Fp8Options::delayed; the CUDA engine's
  // fp8_state): this rank's, as opaque bytes; empty when the model runs no delayed scaling.
  // load_fp8_state refuses by name a state it cannot continue (another history length, other
  // quantisation sites, no delayed scaling here).
  virtual std::string fp8_state() const { return {}; }
  virtual void load_fp8_state(const std::string& bytes) {
    (void)bytes;
    throw std::invalid_argument("this device engine keeps no FP8 delayed-scaling state");
  }
  // This rank's training state in device memory: fp32 masters and AdamW moments, whole or
  // this rank's blocks (distributed optimizer: the moments; FSDP: both, and the gradient block).
  // train_step reports it as memory/state_bytes.
  virtual int64_t state_bytes() const { return 0; }
  // Its bf16 weights and fp32 gradient buffer (FSDP: its blocks, and the gathered units'
  // staging apart): memory/weight_bytes, memory/grad_bytes, memory/stage_bytes.
  virtual int64_t weight_bytes() const { return 0; }
  virtual int64_t grad_bytes() const { return 0; }
  virtual int64_t stage_bytes() const { return 0; }
  // The part of that state kept in host memory instead (DeviceEngineOptions::offload_state):
  // memory/host_state_bytes.
  virtual int64_t host_state_bytes() const { return 0; }
  // Data-parallel traffic so far (ring bytes sent per rank) and time in it.
  virtual int64_t dp_bytes() const { return 0; }
  virtual double dp_seconds() const { return 0; }
  // The tensor-parallel group's likewise (DeviceEngineOptions::tp).
  virtual int64_t tp_bytes() const { return 0; }
  virtual double tp_seconds() const { return 0; }
};

struct DeviceEngineOptions {
  std::string device;  // "cuda" or "cuda:N"
  bool trainable = false;
  bool recompute = false;  // activation checkpointing (BackendConfig::recompute)
  bool recompute_selective = false;
  engine::OptimizerOptions optimizer;  // betas, eps, clipping, which parameters decay
  engine::MoeOptions moe;              // router precision, frozen router, auxiliary losses
  engine::Fp8Options fp8;              // FP8 linears (BackendConfig::fp8)
  bool batch_invariant = false;        // the deterministic mode's forward calls (BackendConfig::batch_invariant)
  // The kernels for `device`: the registry the backend built from the providers the host holds
  // (policy.kernels pins applied). Outlives the engine.
  const sdk::KernelRegistry* kernels = nullptr;
  // Data parallelism (not owned; null: one rank): the gradients are summed over the group on
  // the device; shard_optimizer: Megatron's distributed optimizer (engine.hpp's DeviceDpComm).
  engine::DeviceDpComm* dp = nullptr;
  bool shard_optimizer = false;
  // FSDP (dtensor; with shard_optimizer, `dp` the shard group): ZeRO-3, every unit's weights,
  // gradients and optimizer state kept as this rank's block (engine_cuda's data_parallel.cpp);
  // parameters() and visit_master_views() then gather (collective over `dp`).
  // dp_replicate (HSDP; not owned, null: none): the replicas, over which the gradient blocks
  // are summed too.
  bool shard_masters = false;
  engine::DeviceDpComm* dp_replicate = nullptr;
  // dtensor_cfg.cpu_offload: the fp32 masters and AdamW moments in page-locked host memory,
  // streamed through the device by the update (one rank or FSDP; engine_cuda's offload.cpp).
  bool offload_state = false;
  // Tensor parallelism (megatron_cfg.tensor_model_parallel_size > 1, dense models; neither owned,
  // null: none): this rank's layout (sdk::make_tp_layout over the whole model `desc`) and the
  // tp group on the device. The engine then holds this rank's pieces: parameters(),
  // load_parameters(), adam_state(), load_adam_state() and visit_master_views() are in
  // tp->local's shapes (the backend slices and gathers over its host tp group). `dp` is then
  // this rank's data-parallel group (the ranks of the same tp rank). The engine refuses what its
  // tensor parallelism does not run (MoE, MLA, a value head, FSDP, FP8) with
  // std::invalid_argument at creation.
  const sdk::TpLayout* tp = nullptr;
  engine::DeviceDpComm* tp_comm = nullptr;
};

struct DeviceEngineFactory {
  // True when this process can run models on `device`; otherwise false and *why.
  bool (*available)(const std::string& device, std::string* why);
  // Throws std::invalid_argument naming what the device path does not execute (the model is
  // then refused or, with policy.device = auto, run on the CPU engine) and std::runtime_error
  // when the device fails.
  std::unique_ptr<DeviceEngine> (*create)(const sdk::TransformerDesc& desc, const DeviceEngineOptions& options);
  // The devices this process sees (0 when none), for placing "cuda" without an index
  // (sdk::local_device); null: such a device means device 0.
  int (*device_count)() = nullptr;
};

}  // namespace rlh::backend
