// What lives behind the opaque rlh_backend / rlh_model handles, shared by the files that
// implement the table's slots (backend_api.cpp, model_loading.cpp, training_state.cpp).
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/backend_common/backend.hpp"
#include "rlhost/backend_common/backend_config.hpp"
#include "rlhost/backend_common/context_parallel.hpp"
#include "rlhost/backend_common/data_parallel.hpp"
#include "rlhost/backend_common/optimizer.hpp"
#include "rlhost/engine/engine.hpp"
#include "rlhost/sdk/expert_parallel.hpp"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/model_desc.hpp"
#include "rlhost/sdk/pipeline_parallel.hpp"
#include "rlhost/sdk/plugin.hpp"
#include "rlhost/sdk/safetensors.hpp"

namespace rlh::backend {

// Elements of a tensor of this shape.
inline int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

struct Backend;

struct Model {
  Backend* owner = nullptr;
  std::string role;
  std::string dir;  // resolved HF folder it was loaded from
  bool trainable = false;
  BackendConfig config;  // the backend's section with this model's overrides
  sdk::TransformerDesc desc;
  // The checkpoint the weights came from, kept open so tensors that are no parameter (a stored
  // tied lm_head, rotary buffers) pass through into saved states unchanged.
  sdk::st::Checkpoint checkpoint;
  std::vector<std::string> passthrough;
  // Declaration order is destruction order reversed: the optimizer goes before the engine, the
  // engine before its ops, the ops before the registry and the allocator they draw from.
  engine::CountingAllocator alloc;
  // The training state (parameters, gradients, optimizer moments; shards of them at DP > 1)
  // apart from activations and scratch: train_step reports it as memory/state_bytes.
  engine::CountingAllocator state_alloc;
  std::unique_ptr<sdk::KernelRegistry> registry;
  std::unique_ptr<engine::Ops> ops;
  std::string kernels;  // which kernels run it, for logs
  // Data parallelism (data_parallel.hpp), with the backend's groups at DP > 1.
  enum class Dp { none, ddp, distributed_optimizer, fsdp };
  Dp dp_mode = Dp::none;
  const DpGroups* dp = nullptr;
  std::unique_ptr<FsdpStore> fsdp;  // made before the engine, which points at it
  // Tensor parallelism (megatron_cfg.tensor_model_parallel_size > 1; sdk/tensor_parallel.hpp):
  // every rank's layout of the group (this rank's is tp_layouts[dp->tp_rank()]) and the
  // engine's group. `desc` stays the whole model's; the engine holds this rank's pieces.
  std::vector<sdk::TpLayout> tp_layouts;
  std::unique_ptr<CommTpGroup> tp_comm;
  const sdk::TpLayout* tp() const { return tp_layouts.empty() ? nullptr : &tp_layouts[size_t(dp->tp_rank())]; }
  // Expert parallelism (megatron_cfg.expert_model_parallel_size > 1; sdk/expert_parallel.hpp):
  // every ep rank's layout (this rank's is ep_layouts[dp->ep_rank()]) and the engine's group.
  std::vector<sdk::EpLayout> ep_layouts;
  std::unique_ptr<CommEpGroup> ep_comm;
  // With the experts cut over fewer tensor-parallel ranks than the tp group
  // (1 < expert_tensor_parallel_size < tp): the engine's expert tensor-parallel group.
  std::unique_ptr<CommEpGroup> etp_comm;
  const sdk::EpLayout* ep() const { return ep_layouts.empty() ? nullptr : &ep_layouts[size_t(dp->ep_rank())]; }
  // Context parallelism (megatron_cfg.context_parallel_size > 1): the engine's group.
  std::unique_ptr<CommCpGroup> cp_comm;
  // Pipeline parallelism (megatron_cfg.pipeline_model_parallel_size > 1;
  // sdk/pipeline_parallel.hpp): this rank's stage of `desc` (of tp()->local under tensor
  // parallelism); the engine holds the stage's tensors. pp_model.cpp runs the schedule.
  std::unique_ptr<sdk::PpLayout> pp_layout;
  const sdk::PpLayout* pp() const { return pp_layout.get(); }
  // Bytes this rank sent to its neighbour stages, and the embedding group's traffic, so far.
  int64_t pp_bytes = 0;
  std::unique_ptr<engine::Engine> engine;
  std::unique_ptr<Optimizer> optimizer;  // trainable models only (DP 1)
  std::unique_ptr<ShardLayout> shards;   // DP > 1: this rank's part of the state
  std::unique_ptr<ShardOptimizer> shard_opt;  // DP > 1, trainable models
  engine::Buffer<float> grad_shard;      // distributed optimizer: the reduce-scattered block
  // A model on the flavor's device path (policy.device) has this instead of engine/ops/optimizer:
  // the device engine keeps weights, gradients and optimizer state itself.
  std::unique_ptr<DeviceEngine> device;
  int64_t loaded_version = 0;  // weights version of a non-trainable model's state
  // A value model loaded from an HF *ForSequenceClassification checkpoint without lm_head: it has
  // no language-model head, so logprob outputs are refused.
  bool value_only = false;

  int64_t version() const {
    if (optimizer) return optimizer->steps();
    if (shard_opt) return shard_opt->steps();
    return device && trainable ? device->steps() : loaded_version;
  }
  // The schedule's learning rate and weight decay for the next update (lr_override >= 0 wins).
  Optimizer::StepInfo next_update(double lr_override) const;
};

struct Backend {
  const BackendFlavor* flavor = nullptr;
  sdk::Host host;
  nlohmann::json policy;  // the config section as given to create
  BackendConfig config;
  std::unique_ptr<DpGroups> dp;  // several launched ranks: made at the first load_model
  // Tensor parallelism on the device: the communicator over the world, which `device_dp` and
  // `device_tp` are split from (declared first: it goes last).
  std::unique_ptr<CommDeviceDp> device_world;
  // Several ranks on the device path: the data-parallel group over a communicator for device
  // memory, made at the first such model (before `models`: they point at it). Without tensor
  // parallelism it is the world's communicator itself; with it the ranks of one tp rank.
  std::unique_ptr<CommDeviceDp> device_dp;
  // HSDP on the device: the shard group and the replicas over the device communicator, split
  // as `dp`'s shard and replicate groups are (made at the first such model).
  std::unique_ptr<CommDeviceDp> device_shard, device_replicate;
  // Tensor parallelism on the device: the tp group, split from `device_world` as `dp`'s tp group
  // is (the ranks of one data-parallel rank).
  std::unique_ptr<CommDeviceDp> device_tp;
  std::vector<std::unique_ptr<Model>> models;
};

// The value head's HF tensor (*ForSequenceClassification's `score` with one label).
inline constexpr const char* kScoreWeight = "score.weight";
// "LlamaForCausalLM" for "LlamaForSequenceClassification" / "LlamaForTokenClassification"; empty
// for any other name.
std::string causal_lm_of(const std::string& architecture);
bool has_value_head(const Model& m);

inline Backend* as_backend(rlh_backend* b) { return reinterpret_cast<Backend*>(b); }
inline Model* as_model(rlh_model* m) { return reinterpret_cast<Model*>(m); }

// model_loading.cpp
// The description of the HF folder `dir` (config.json text `config_text`), from the caller's
// JSON or the host's MODEL component that lists the config's architecture.
sdk::TransformerDesc describe_model(const sdk::Host& host, const std::string& dir, const std::string& config_text,
                                    const rlh_model_args& args);
// Kernels for one model: a KERNELS component through the registry (flavor preference first,
// then the best-scoring one), else kernels_cpu called directly.
void select_kernels(const sdk::Host& host, const BackendFlavor& flavor, Model& m);
std::unique_ptr<Model> load_model(Backend& b, const rlh_model_args& args);

// The optimizer a trainable model gets (its frozen parameters follow the model's config).
std::unique_ptr<Optimizer> make_optimizer(Model& m);
// Whether the optimizer leaves `p` alone: untrainable, or a router frozen by the config. Such
// parameters have no optimizer state, on either path.
bool without_update(const Model& m, const sdk::ParamDesc& p);

// training_state.cpp
void save_state(Model& m, const std::string& dir);
void load_state(Model& m, const std::string& dir);

// dp_model.cpp: a model at DP > 1 (data_parallel.hpp), or under tensor parallelism
// Before the engine: the mode, the FSDP store, storage padding. After it: the shard layout, the
// weights into their shards, the shard optimizer.
void prepare_data_parallel(Backend& b, Model& m, engine::EngineOptions& eo);
void finish_data_parallel(Model& m, const std::vector<std::vector<float>>& weights);
struct DpStepResult {
  engine::StepResult r;
  Optimizer::StepInfo info;
  bool updated = false;
  // Bytes this rank's collectives of the step moved, as a ring moves them: (S-1)/S of an
  // all-gather's output or a reduce-scatter's input, 2 (S-1)/S of an all-reduce's tensor.
  int64_t comm_bytes = 0;
  double comm_seconds = 0;  // spent inside the step's collectives
  // The tensor-parallel group's traffic (ring bytes of its all-reduces) and time in the step.
  int64_t tp_comm_bytes = 0;
  double tp_comm_seconds = 0;
  // The expert-parallel group's traffic (what this rank sent in the all-to-alls) and time.
  int64_t ep_comm_bytes = 0;
  double ep_comm_seconds = 0;
  // The context-parallel group's traffic (its all-gathers and reduce-scatters) and time.
  int64_t cp_comm_bytes = 0;
  double cp_comm_seconds = 0;
  // Pipeline parallelism: bytes sent to neighbour stages, the embedding group's and the norm's
  // ring traffic (Model::pp_bytes over the step).
  int64_t pp_comm_bytes = 0;
};
// The step over this rank's micro-batches (possibly none), gradients reduced, the global norm,
// the sharded update, loss and engine metrics summed over ranks. Collective.
DpStepResult dp_train_step(Model& m, const std::vector<engine::MicroBatch>& views, engine::StepOptions so,
                           const engine::LossFn& loss, bool eval_only, double lr_override);
// A model on the device path (Model::device), in full whatever its tensor parallelism: under
// it the engine holds this rank's pieces, so parameters and AdamW moments are gathered over the
// tp group on the way out (collective: every rank of the group calls in the same order) and
// sliced on the way in; without it they pass through.
std::vector<std::vector<float>> device_parameters(Model& m);
void device_load_parameters(Model& m, const std::vector<std::vector<float>>& full);
DeviceEngine::AdamState device_adam_state(Model& m);
void device_load_adam_state(Model& m, const DeviceEngine::AdamState& full);
// expert_parallel.cpp, under expert parallelism: parameter i's block on this rank from the full
// tensor (the tensor itself when replicated), and the full tensor from every ep rank's block
// (collective over the ep group for an expert tensor).
std::vector<float> ep_local(const Model& m, size_t i, const std::vector<float>& full);
std::vector<float> ep_full(const Model& m, size_t i, std::span<const float> local);
// Expert parallelism at load: every rank's layout, the engine's group and options, or one line
// naming what stops it (collective-free; the groups exist already).
void prepare_expert_parallel(const Backend& b, Model& m, engine::EngineOptions& eo);
// pp_model.cpp: pipeline parallelism (docs/model_parallelism.md). pp_forward: one micro-batch's
// forward through the stages (every stage calls it), its outputs on every stage. pp_train_step:
// this rank's micro-batches through the 1F1B schedule, gradients accumulated in the engine
// (the tied embedding's summed over the embedding group), the loss and engine metrics of the
// last stage on every stage. pp_share_named: the last stage's named values on every stage.
// At load: this rank's stage (the layers split as the config says), refusing what does not fit.
void make_pipeline_stage(const Backend& b, Model& m);
// The stage's layers for the load message: "layers 0..1" (one run per model chunk).
std::string pp_layers_note(const sdk::PpLayout& L);
engine::Outputs pp_forward(Model& m, const engine::MicroBatch& mb, const engine::OutputRequest& req);
engine::StepResult pp_train_step(Model& m, const std::vector<engine::MicroBatch>& views, const engine::StepOptions& so,
                                 const engine::LossFn& loss);
std::vector<std::pair<std::string, double>> pp_share_named(const Model& m,
                                                           const std::vector<std::pair<std::string, double>>& mine);
// The local (engine) index of whole-model parameter i, -1 when this stage does not hold it; and
// the whole-model parameter of engine parameter j.
int64_t local_param(const Model& m, size_t i);
const sdk::ParamDesc& model_param(const Model& m, size_t j);
// Context parallelism at load (context_parallel.cpp): checks the groups fit the size and makes
// the engine's group (place_on_device keeps the model on the CPU engine). Nothing at cp = 1.
void check_context_parallel(Backend& b, Model& m);
// Under tensor or context parallelism: every rank of the tp (and cp) group holds the same batch,
// else an error on all of them naming it (collective over the groups; nothing without either).
void tp_check_batch(const Model& m, const rlh_batch& batch, const char* what);
// Forward over this rank's micro-batches, FSDP ranks keeping their peers' gathers company.
void dp_forward(Model& m, size_t local_microbatches, const std::function<void(size_t)>& run,
                const engine::OutputRequest& req);
// Every parameter in full (FSDP gathers unit by unit; collective), handed to `fn` in storage
// order of units.
void dp_visit_parameters(Model& m, const std::function<void(size_t, std::span<float>)>& fn);
// The full parameters and optimizer moments (collective; only `keep` ranks hold the result).
std::vector<std::vector<float>> dp_full_parameters(Model& m, bool keep);
std::vector<Optimizer::StateTensor> dp_full_optimizer_state(Model& m, bool keep, std::vector<std::vector<float>>& storage);
// Loads full tensors into this rank's shards (weights) and moments (`first`/`second` per
// parameter index, empty when absent).
void dp_load_parameters(Model& m, const std::vector<std::vector<float>>& weights);
void dp_load_optimizer(Model& m, const std::vector<std::vector<float>>& first, const std::vector<std::vector<float>>& second,
                       int64_t steps);

}  // namespace rlh::backend
