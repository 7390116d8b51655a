// Settings a training backend reads from its config section, in a form both backends share.
//
// The backend's config section (what rlh_backend_api.create receives) is the `policy` subtree of
// the job's configuration, NeMo-RL's layout. dtensor and megatron read different keys of it
// (policy.optimizer vs policy.megatron_cfg.optimizer, ...) but end up with the same settings:
// an optimizer, a learning-rate / weight-decay schedule, how batches become micro-batches, and
// whether layers are recomputed. docs/backends.md lists every key and default.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/sdk/kernel_registry.hpp"

#include "rlhost/engine/engine.hpp"  // engine::MoeOptions

namespace rlh::backend {

// ---------------------------------------------------------------------------------------------
// Reading a JSON config section with errors that name the full key.

class ConfigReader {
 public:
  // `root` is the section, `prefix` its dotted name in the job's configuration ("policy").
  ConfigReader(const nlohmann::json& root, std::string prefix);

  // The value at a dotted path below the root; nullptr when absent or null.
  const nlohmann::json* find(std::string_view path);
  bool has(std::string_view path) { return find(path) != nullptr; }
  // Present and explicitly null (NeMo-RL's "off" for max_grad_norm and friends).
  bool is_null(std::string_view path);
  // Typed reads with a fallback for absent/null keys. A value of the wrong type throws
  // rlh::sdk::Error(INVALID_ARGUMENT) naming the key and what it holds.
  double number(std::string_view path, double fallback);
  int64_t integer(std::string_view path, int64_t fallback);
  bool boolean(std::string_view path, bool fallback);
  std::string string(std::string_view path, const std::string& fallback);
  // Marks every key below `path` as read (subtrees read as a whole, or known and ignored).
  void mark_subtree(std::string_view path);

  // "policy.x.y" for a relative path.
  std::string full(std::string_view path) const;
  [[noreturn]] void fail(std::string_view path, const std::string& what) const;

  // Leaf keys below `subtree` (relative) that nothing read, as full names.
  std::vector<std::string> unread(std::string_view subtree) const;

 private:
  const nlohmann::json* lookup(std::string_view path) const;
  const nlohmann::json& root_;
  std::string prefix_;
  std::vector<std::string> read_;  // relative paths read (leaves or subtrees)
};

// ---------------------------------------------------------------------------------------------
// Optimizer

enum class OptimizerKind { adamw, sgd };
const char* to_string(OptimizerKind k);

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::adamw;
  double lr = 5e-6;  // base (peak) learning rate the schedule scales
  double weight_decay = 0.01;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // adamw
  double momentum = 0.0;                          // sgd (torch semantics, no dampening)
  // torch AdamW over model.parameters() (dtensor) decays every tensor; Megatron leaves 1-D
  // tensors (norm weights, biases) out of weight decay.
  bool decay_1d_params = true;
  double max_grad_norm = 1.0;  // global-norm clipping before the update; 0 = none
};

// ---------------------------------------------------------------------------------------------
// Schedules, evaluated at optimizer step s = the number of steps taken before this one (so the
// first update uses s = 0, as torch schedulers and Megatron's OptimizerParamScheduler do).

// One torch.optim.lr_scheduler, as a factor on the base lr (its closed form).
struct TorchScheduler {
  enum class Kind { constant, linear, cosine, exponential, step, multi_step, polynomial };
  Kind kind = Kind::constant;
  double factor = 1.0 / 3;       // ConstantLR
  double start_factor = 1.0 / 3;  // LinearLR
  double end_factor = 1.0;        // LinearLR
  int64_t total_iters = 5;        // ConstantLR, LinearLR, PolynomialLR
  int64_t t_max = 1;              // CosineAnnealingLR
  double eta_min = 0.0;           // CosineAnnealingLR (absolute lr)
  double gamma = 0.1;             // ExponentialLR, StepLR, MultiStepLR
  int64_t step_size = 1;          // StepLR
  std::vector<int64_t> milestones;  // MultiStepLR
  double power = 1.0;             // PolynomialLR
  double lr(double base, int64_t step) const;
};

// NeMo-RL's policy.scheduler: schedulers chained by SequentialLR at `milestones`; empty = a
// constant learning rate.
struct TorchSchedule {
  std::vector<TorchScheduler> schedulers;
  std::vector<int64_t> milestones;  // schedulers.size() - 1 entries
};

// Megatron's OptimizerParamScheduler (policy.megatron_cfg.scheduler with optimizer.lr/min_lr).
struct MegatronSchedule {
  enum class Decay { constant, linear, cosine, inverse_square_root };
  enum class WdIncrement { constant, linear, cosine };
  double warmup_init_lr = 0.0;
  int64_t warmup_iters = 0;
  Decay decay = Decay::constant;
  int64_t decay_iters = 0;  // end of the decay (counted from step 0, warmup included)
  double min_lr = 0.0;
  double start_weight_decay = 0.0, end_weight_decay = 0.0;
  WdIncrement wd_increment = WdIncrement::constant;
  int64_t wd_incr_iters = 0;
};

struct Schedule {
  std::variant<TorchSchedule, MegatronSchedule> rule;
  struct Point {
    double lr = 0;
    double weight_decay = 0;
  };
  Point at(int64_t step, const OptimizerConfig& opt) const;
};

// ---------------------------------------------------------------------------------------------
// Batching: how a batch is cut into micro-batches when the caller leaves it to the backend.

struct BatchingConfig {
  int64_t train_micro_batch_size = 4;  // sequences per train micro-batch
  int64_t logprob_batch_size = 4;      // sequences per forward micro-batch
  // sequence_packing or dynamic_batching: micro-batches by token budget. The engine always
  // packs (no padding), so on it the two differ only in how sequences are grouped.
  bool by_tokens = false;
  int64_t train_mb_tokens = 0;
  int64_t logprob_mb_tokens = 0;
  bool first_fit_decreasing = false;  // packing algorithm: FFD bins, else in batch order
};

// Everything a backend instance (or one model, after its per-model overrides) runs with.
struct BackendConfig {
  std::string backend;  // "dtensor" / "megatron", for messages
  // nullopt: no optimizer is configured (NeMo-RL's `optimizer: null`); trainable models are then
  // refused with `optimizer_missing` as the reason.
  std::optional<OptimizerConfig> optimizer;
  std::string optimizer_missing;
  Schedule schedule;
  BatchingConfig batching;
  bool recompute = false;  // activation checkpointing
  // With recompute, the device path's granularity: selective recomputes norms and the MLP
  // activation only, else whole layers. The CPU engine always recomputes whole layers.
  bool recompute_selective = false;
  engine::MoeOptions moe;  // router precision/freezing and auxiliary losses of MoE layers
  // megatron_cfg.fp8_cfg: FP8 linears on the device path (the CUDA engine and a loaded FP8
  // kernel provider); the CPU engine refuses it.
  engine::Fp8Options fp8;
  std::string precision = "float32";
  // dtensor_cfg.moe_parallelizer.lm_head_precision = float32 (Automodel, MoE models only): the
  // head's weight and its input in float32. The CPU engine computes the head in float32 anyway;
  // the device path multiplies bf16 operands, so it declines an MoE model with this set.
  bool moe_head_fp32 = false;
  // megatron_cfg.moe_router_bias_update_rate: the expert bias's per-step update (Megatron's
  // aux-loss-free balancing), which the engines do not run: above 0 a model with an expert score
  // bias is refused at load.
  double expert_bias_update_rate = 0;
  // policy.device: "auto" (the flavor's device path when one is usable and precision is
  // bfloat16, else the CPU engine), "cpu", "cuda" or "cuda:N" (that device or an error).
  std::string device = "auto";
  // policy.generation.native_cfg.batch_invariant (the generator's deterministic mode, read here
  // too): on the device path the CUDA engine's logprob and value passes then run the generator's
  // batch-invariant kernels, so the train-generation mismatch is exactly 0
  // (CudaEngineOptions::batch_invariant).
  bool batch_invariant = false;
  // policy.kernels: op (or op family) -> kernel provider pins for the executors' registries.
  sdk::KernelPins kernel_pins;
  // policy.kernels.verify: check every provider but the reference before choosing it.
  bool kernel_verify = true;
  // Data parallelism over the launcher's ranks (data_parallel.hpp): dtensor shards parameters,
  // gradients and moments (FSDP, dp_replicate_size replicas of it: HSDP); megatron runs the
  // distributed optimizer (use_distributed_optimizer) or plain all-reduce.
  struct Parallel {
    bool fsdp = false;
    bool distributed_optimizer = false;
    int64_t dp_replicate = 1;
    // dtensor_cfg.cpu_offload: FSDP's CPUOffloadPolicy (the CPU engine's state is in host
    // memory already; the device path refuses it by name).
    bool cpu_offload = false;
    // megatron_cfg.tensor_model_parallel_size: ranks a model's layers are split over
    // (sdk/tensor_parallel.hpp); the data-parallel ranks are the world / tp.
    int64_t tp = 1;
    // megatron_cfg.expert_model_parallel_size: ranks each MoE layer's routed experts are split
    // over (sdk/expert_parallel.hpp), carved from the data-parallel ranks.
    int64_t ep = 1;
    // megatron_cfg.expert_tensor_parallel_size (null: tp, Megatron's default): under tensor
    // parallelism alone an MoE model's experts are split over the tp group (etp = tp); with
    // expert parallelism too they are whole on their ep rank (etp = 1), cut over an etp group
    // of etp ranks (a divisor of tp between) or over the tp group (etp = tp).
    int64_t etp = 1;
    // megatron_cfg.context_parallel_size: ranks every sequence is split over (context_parallel.hpp);
    // the data-parallel ranks are the world / (tp cp).
    int64_t cp = 1;
    // megatron_cfg.sequence_parallel with tp > 1 (engine.hpp's EngineOptions::sequence_parallel).
    bool sequence_parallel = false;
    // megatron_cfg.pipeline_model_parallel_size: stages a model's layers are split over
    // (sdk/pipeline_parallel.hpp), with num_layers_in_{first,last}_pipeline_stage (0: not set).
    int64_t pp = 1;
    int64_t pp_first_layers = 0, pp_last_layers = 0;
    // megatron_cfg.virtual_pipeline_model_parallel_size: model chunks per pipeline rank
    // (Megatron's interleaved 1F1B schedule, pp_model.cpp); 1 = one chunk.
    int64_t vpp = 1;
  } parallel;
  bool bf16() const { return precision == "bfloat16" || precision == "bf16"; }
  // save_dtype: the dtype of the HF weights save_state writes ("float32": the master weights
  // themselves; "bfloat16": a round-to-nearest-even copy, the float32 masters kept beside it for
  // load_state). A per-model override the training loops pass from their
  // checkpointing.model_save_dtype; not a key users set in the policy section.
  std::string save_dtype = "float32";
  std::vector<std::string> notes;  // one-line remarks logged once (ignored keys, precision)
};

// Reads the keys both backends share (docs/backends.md): policy.precision, device, kernels.*,
// max_grad_norm, train_micro_batch_size, logprob_batch_size, sequence_packing.*,
// dynamic_batching.*.
void read_shared_policy_keys(ConfigReader& r, BackendConfig& cfg);

// Reads NeMo-RL's torch-style policy.scheduler (a dict, or a list of {name, kwargs} ending in
// {milestones: [...]}) at `path`.
TorchSchedule read_torch_schedule(ConfigReader& r, std::string_view path);

// Refuses a parallel size other than 1 (absent/null = 1): only data parallelism is implemented.
void require_single_rank(ConfigReader& r, std::string_view path);

// RFC 7386 merge patch (per-model overrides over the backend's section).
nlohmann::json merge_patch(nlohmann::json target, const nlohmann::json& patch);

}  // namespace rlh::backend
