// rlh_engine_cuda: the engine's GPU path. bf16 compute with fp32 master weights, fp32 gradient
// accumulation and fp32 AdamW moments, on one CUDA device. It runs the model's layer program
// (sdk/layer_program.hpp) with ops resolved through the C ABI's kernel registry for its device
// (kernels_cuda's cuBLASLt GEMMs and fused kernels, kernels_cudnn's attention, a vendor's, op by
// op); it links no provider. Only glue of its own (casts, strided copies, the MoE losses'
// reductions, MLA's key assembly) is compiled in.
//
// Same model semantics and the same batch / output / loss-callback types as rlh::engine::Engine
// (engine.hpp), so a backend can hold either: a MicroBatch of packed sequences in, per-token
// outputs in NeMo-RL's alignment out, the algorithm's LossFn in between, then clip + AdamW.
//
// Precision: activations, the residual stream and the working copy of the weights are bf16;
// norms, softmax, logprob statistics and every accumulation are fp32; parameter gradients are
// accumulated in fp32 by the GEMMs themselves (bf16 operands, fp32 C, beta = 1); AdamW updates
// the fp32 master weights and refreshes the bf16 copy in one pass.
//
// Memory is planned, not allocated per step: parameters, gradients, moments and the bf16 copy
// are one allocation each; activations are one allocation sized for the largest micro-batch
// seen (or CudaEngineOptions::max_tokens up front); kernel scratch is one arena that only grows.
// stats() counts device allocations and host synchronisations, so a benchmark can report both
// per steady-state step.
//
// Activation recompute (CudaEngineOptions::recompute) trades compute for the memory of what a
// training step keeps per layer: `selective` keeps the GEMM and attention outputs and recomputes
// the norms and the SwiGLU product in backward (Megatron's "layernorm" and activation modules:
// elementwise work, about a third of a dense layer's activations); `full` keeps only each layer's
// input and runs the layer's forward again before its backward (one more forward, activations of
// one layer). Both give the same gradients as none: recomputing is the same kernels on the same
// inputs.
//
// Mixture-of-experts layers (Mixtral, Qwen2-MoE with its gated shared expert, Qwen3-MoE; dense
// and MoE layers mixed) run as the CPU engine's moe.cpp computes them: router GEMM, fp32 (or
// fp64, MoeOptions::router_fp64) scores and top-k, expert-sorted rows, grouped GEMMs over
// each expert's gate|up and down, the weighted combine; the auxiliary losses and their metrics
// are counted on the device. Offsets stay on the device: no host wait inside a layer.
//
// DeepSeek-V3: multi-head latent attention layers (src/mla_layer.cpp, as the CPU engine's
// mla.cpp) and group-limited routing (n_group / topk_group in the router kernel).
//
// Not on the GPU yet (refused with std::invalid_argument naming the feature, through the
// program's supports() answer): sequence-length-dependent RoPE (dynamic NTK, longrope),
// soft-capping (Gemma-2), processed (top-k/top-p) logprobs, logprob_at_ids.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "rlhost/engine/engine.hpp"
#include "rlhost/sdk/kernels.hpp"

namespace rlh::engine {

enum class Recompute { none, selective, full };


struct CudaEngineOptions {
  int device = 0;
  // The kernels (required; not owned, must outlive the engine): a registry of providers created
  // for CUDA device `device` (sdk::make_kernel_registry).
  const sdk::KernelRegistry* kernels = nullptr;
  int64_t logprob_chunk_bytes = 0;  // the head's logits tile (0 = 512 MiB)
  // A training step keeps the head's fp32 logits of a micro-batch from its forward to its
  // backward when N x V x 4 bytes fit this budget, instead of recomputing them (one of the
  // head's four GEMMs); 0 = always recompute.
  int64_t head_logits_cache_bytes = int64_t(8) << 30;
  OptimizerOptions optimizer;
  // Plan activations for micro-batches of up to this many tokens at construction (0 = on the
  // first micro-batch; a larger one later re-plans, counted in stats()).
  int64_t max_tokens = 0;
  // false: a frozen model (a reference policy) holds only its fp32 and bf16 weights, no
  // gradients or AdamW moments, and train_step is refused.
  bool trainable = true;
  // The deterministic mode (policy.generation.native_cfg.batch_invariant): forward-only calls
  // (logprobs, values) run the GPU generator's batch-invariant kernels on its arithmetic, so a
  // sequence's token logprobs are bitwise what the generator computed while decoding it in its
  // own deterministic mode (deterministic.cpp): every product on the batch-invariant gemm,
  // attention on paged_attention (batch_invariant = 1) over this call's keys laid out as the
  // generator's cache, the head's logprobs through the `sample` op scoring the given tokens.
  // Training steps keep the fast kernels. Refused with FP8 linears and tensor parallelism.
  bool batch_invariant = false;
  // Which of the three the deterministic mode replaces (all by default). One part alone shows
  // what it contributes to the default mode's mismatch (bench_generator_cuda --trainer); only
  // all three together give the generator's bits.
  struct InvariantParts {
    bool gemm = true, attention = true, head = true;
  } invariant_parts;
  // Selective recompute leaves an MoE layer's routed activations kept (they are GEMM outputs
  // and permutations); full recompute re-runs the whole layer, routing included.
  Recompute recompute = Recompute::none;
  // MoE settings (engine.hpp): freeze_router, router_fp64, load_balancing + aux_loss_coef,
  // z_loss_coef; StepOptions::moe_global_tokens / moe_global_sequences normalise the losses.
  MoeOptions moe;
  // Data parallelism (not owned; null: one rank). Every rank holds the whole model. After the
  // backward the gradients are summed over the group (the loss callback normalises by the
  // global batch, StepOptions::global_tokens), so every rank applies the same update:
  //  - shard_optimizer false (DDP): one all-reduce of the gradients;
  //  - shard_optimizer true (Megatron's distributed optimizer): a reduce-scatter into this
  //    rank's block of the flat storage, the gradient norm from every rank's block, AdamW on
  //    this rank's block with moments kept for it alone (8/S bytes a parameter, not 8), then
  //    an all-gather of the updated fp32 masters and their bf16 copy.
  // A rank with no micro-batch still takes part (train_step accepts none then).
  DeviceDpComm* dp = nullptr;
  bool shard_optimizer = false;
  // FP8 linears (engine.hpp's Fp8Options; fp8_linear.hpp): the dense layers' linear steps
  // through the registry's FP8 provider. Construction fails, naming it, when no provider on the
  // device runs the recipe's products.
  Fp8Options fp8;
  // FSDP (dtensor; needs shard_optimizer; ZeRO-3): the model is cut into units (each layer,
  // and the root: embedding, final norm, head), and of each unit this rank keeps one block of
  // the fp32 masters, both moments, the summed gradients and the bf16 weights (18/S bytes a
  // parameter). A unit's bf16 weights are all-gathered into a staging slot before it runs
  // (a layer again for its backward; the root once per step or forward call) and its fp32
  // gradients reduce-scattered out of a staging slot after its backward (a layer's after every
  // micro-batch, the root's once per step), so the staging holds two layers and the root (6 bytes
  // a parameter of each). Every collective is per unit and micro-batch: a rank with fewer
  // micro-batches runs idle passes (StepOptions::group_microbatches, else asked of the group at
  // the step's start; idle_forward()). Whole
  // tensors move unit by unit (save_parameters, adam_state, gradients, visit_master_views:
  // collective over `dp`). The few fp32 tensors the MoE router reads from the masters (router
  // bias, selection bias, the fp64 router's weight) are kept whole in a side buffer, refreshed
  // after each update. FP8 linears are refused with it.
  bool shard_masters = false;
  // FSDP's collectives on a stream of their own, overlapping the layers' compute as FSDP2's
  // prefetch does: the next layer's gather runs during a layer's forward or backward, and a
  // layer's reduce-scatter during the next one's backward (two layer slots of staging). false:
  // the same collectives in the same order on the compute stream (the same bits, no overlap).
  bool fsdp_comm_stream = true;
  // HSDP (with shard_masters; not owned; null: none): the replicas of this rank's shard. The
  // gradient blocks reduce-scattered over `dp` (the shard group) are summed over it too.
  DeviceDpComm* dp_replicate = nullptr;
  // CPU offload of the optimizer state (dtensor's cpu_offload, FSDP2's CPUOffloadPolicy): the
  // fp32 masters and both AdamW moments (whole on one rank, this rank's block under FSDP) live
  // in page-locked host memory, 12 bytes a parameter (12/S under FSDP) off the device. The
  // update streams them through a fixed device staging buffer in chunks (host to device, the
  // same AdamW kernel, device to host), so it computes the same bits as without offload; the
  // chunk boundaries keep the buffers' 256-byte alignment. What the forward reads from the
  // masters (the MoE router's fp32 tensors) is kept on the device in a side copy, as under
  // FSDP; whole masters (save_parameters, master_views) are staged through the gradient
  // buffer. One rank or FSDP only (the distributed optimizer and DDP are refused).
  bool offload_state = false;
  int64_t offload_chunk_elems = int64_t(32) << 20;  // elements per streamed chunk (x 12 bytes staged)
  // Tensor parallelism, Megatron's without sequence parallelism (sdk/tensor_parallel.hpp; neither
  // owned), with tp->size > 1: the engine runs this rank's part of the model given to the
  // constructor (desc() is tp->local; load_parameters / save_parameters / gradients hold this
  // rank's pieces, tp_slice / tp_place convert) and communicates as the program's marks say
  // (src/tensor_parallel.cpp): a row-parallel linear's output and a column-parallel one's input
  // gradient are summed over `tp_comm` in fp32, then rounded to bf16 once; the embedding and the
  // fused logprob head are vocabulary-parallel (per-rank statistics all-gathered and combined);
  // the q/k norms' gradients are summed after the micro-batches; the gradient norm is the whole
  // model's (replicated tensors counted once). Composes with `dp` (DDP or the distributed
  // optimizer, each tp rank's data-parallel group its own). Refused under it: MoE and MLA
  // layers, key/value heads replicated over ranks (fewer kv heads than ranks), a value head,
  // FSDP (shard_masters), FP8 linears, the logits output.
  const sdk::TpLayout* tp = nullptr;
  DeviceDpComm* tp_comm = nullptr;
};

struct CudaEngineStats {
  int64_t device_allocations = 0;  // cudaMalloc calls so far
  int64_t device_bytes = 0;        // bytes held now
  int64_t host_syncs = 0;          // host waits on the stream so far
  int64_t dp_bytes = 0;            // data-parallel traffic so far (ring bytes, as sent per rank)
  double dp_seconds = 0;           // time in data-parallel collectives so far
  int64_t tp_bytes = 0;            // tensor-parallel traffic so far (CudaEngineOptions::tp), likewise
  double tp_seconds = 0;
  // FP8 (CudaEngineOptions::fp8): the products of the FP8 layers' linears so far, by how they
  // ran (bf16 where a shape does not fit FP8).
  int64_t fp8_gemms = 0, fp8_layer_bf16_gemms = 0;
  // The training state held on this rank: fp32 masters, AdamW moments and the gradient block
  // of the sharded optimizer (whole, or this rank's block), the router's side copy under FSDP.
  // The bf16 weights and the flat fp32 gradient buffer are counted apart.
  int64_t state_bytes = 0;
  int64_t weight_bytes = 0;  // the bf16 working copy (FSDP: this rank's blocks)
  int64_t grad_bytes = 0;    // the flat fp32 gradient buffer (none under FSDP)
  // FSDP: the gathered units' bf16 weights and fp32 gradients (two layers and the root), and
  // the reduce-scattered block.
  int64_t weight_stage_bytes = 0, grad_stage_bytes = 0;
  // CudaEngineOptions::offload_state: the masters and moments in page-locked host memory (then
  // out of state_bytes, which counts the device staging buffer instead).
  int64_t host_state_bytes = 0;
};

class CudaEngine {
 public:
  // Throws std::invalid_argument for a description this path does not execute (see above) and
  // std::runtime_error when the device or cuBLASLt is unavailable.
  CudaEngine(sdk::TransformerDesc desc, CudaEngineOptions options = {});
  ~CudaEngine();
  CudaEngine(const CudaEngine&) = delete;
  CudaEngine& operator=(const CudaEngine&) = delete;

  const sdk::TransformerDesc& desc() const;
  std::string device_name() const;
  size_t num_params() const;
  int64_t num_elements() const;

  // fp32 weights in desc().params order (e.g. rlh::sdk::load_weights_f32(...).tensors).
  void load_parameters(const std::vector<std::vector<float>>& tensors);
  std::vector<std::vector<float>> save_parameters() const;  // the fp32 master weights
  // The fp32 master weights in device memory, desc().params order: `pieces` runs of `piece`
  // elements `stride` apart (one run: contiguous; MoE experts' gate and up are interleaved).
  // Valid until the next train_step or load_parameters; the stream is synchronised first.
  struct ParamView {
    const float* data = nullptr;
    int64_t pieces = 1, piece = 0, stride = 0;
  };
  // (Under FSDP no rank holds them whole: master_views throws; visit_master_views gathers them
  // unit by unit, collective over `dp`, each view valid during its call.)
  std::vector<ParamView> master_views() const;
  void visit_master_views(const std::function<void(size_t param, const ParamView&)>& fn) const;
  int device_index() const;
  std::vector<std::vector<float>> gradients() const;        // the fp32 accumulated gradients
  void zero_grad();

  // Forward only. Host outputs as Engine::forward (logprob, entropy; logits for tests).
  Outputs forward(const MicroBatch& mb, const OutputRequest& request);
  // FSDP: the collectives of one forward without data, for a rank with fewer micro-batches
  // than its peers (no-op otherwise). The request is checked as forward checks it, so a
  // request the peers refuse is refused here too instead of leaving this rank in a gather.
  void idle_forward(const OutputRequest& request);

  // As Engine::train_step: per micro-batch forward, loss callback (on the host, over host
  // copies of the requested outputs), backward; then the global gradient norm, clipping and
  // AdamW unless options.apply_optimizer is false. Host waits: one per micro-batch (the
  // callback needs its outputs) and one for the gradient norm.
  StepResult train_step(std::span<const MicroBatch> microbatches, const StepOptions& options,
                        const LossFn& loss_fn);

  // What a loss on the device sees of one micro-batch: device memory, valid during the call,
  // written stream-ordered on `stream` (the call never synchronises).
  struct DeviceLossViews {
    const float* logprob = nullptr;  // [N] token-aligned (0 at each sequence's first token)
    float* dlogprob = nullptr;       // [N] d loss / d logprob, token-aligned, zeroed
    float* loss = nullptr;           // this micro-batch's loss (a float32 scalar, zeroed)
    const int32_t* cu_seqlens = nullptr;  // [S+1]
    const float* inputs = nullptr;   // DeviceLoss::inputs, uploaded at the step's start
    void* stream = nullptr;          // the engine's cudaStream_t
    // Copies the device scalar at `value` into slot `slot` of the step (stream-ordered, so the
    // caller may reuse `value` afterwards); the slots come down with the gradient norm.
    std::function<void(const float* value, int64_t slot)> keep;
  };
  struct DeviceLoss {
    std::span<const float> inputs;  // host floats the loss reads, uploaded once (pinned, async)
    int64_t slots = 0;              // scalars kept per step
    std::function<void(const LossContext&, const DeviceLossViews&)> run;
    std::vector<float>* kept = nullptr;  // receives the slots' values after the step
  };
  // train_step with the loss on the device: the logprob output only (OutputRequest::logprob;
  // entropy, value and logprob_at_ids need the host LossFn). Host waits: one per step (the
  // gradient norm's, which brings the kept slots along). StepResult::loss and metrics are left
  // to the caller, which reads them from the slots.
  StepResult train_step(std::span<const MicroBatch> microbatches, const StepOptions& options,
                        const DeviceLoss& loss);

  int64_t step() const;
  CudaEngineStats stats() const;
  // MoE: R of the routing record and replay (the sum of top_k over MoE layers; 0 when dense),
  // as Engine::routing_width(): OutputRequest::routed_experts and replay_routing_field work as
  // on the CPU engine (the record comes down with the outputs, no extra host wait).
  int64_t routing_width() const;

  // AdamW's state for checkpoints: the step count and fp32 moments per parameter in
  // desc().params order (all zero before the first step and for untrainable parameters).
  // With a sharded optimizer adam_state() gathers the blocks (collective over the group) and
  // load_adam_state() keeps this rank's block of the full moments it is given. With sharded
  // masters (shard_masters) save_parameters(), gradients() and visit_master_views() gather
  // too (collective, unit by unit), and load_parameters() keeps this rank's blocks of the whole
  // weights it is given.
  struct AdamState {
    int64_t step = 0;
    std::vector<std::vector<float>> exp_avg, exp_avg_sq;
  };
  AdamState adam_state() const;
  void load_adam_state(const AdamState& state);  // sizes checked against the description
  // FP8 delayed scaling's state for checkpoints (Fp8Options::delayed): the amax history of every
  // quantisation site (fp8_linear.hpp), as the FP8 provider saves it; empty when the engine runs
  // no delayed scaling. load_fp8_state restores it into an engine of the same model and recipe,
  // so the steps that follow quantise as the saved engine's would have; it refuses by name
  // another history length, other sites, or an engine without delayed scaling. Both wait for
  // the device (checkpoints only). Under data or tensor parallelism each rank has its own.
  std::string fp8_state() const;
  void load_fp8_state(const std::string& bytes);
  // Betas, eps, weight decay and clipping of the steps that follow (a backend's schedule moves
  // the weight decay; the learning rate comes with each StepOptions).
  void set_optimizer_options(const OptimizerOptions& options);

 private:
  StepResult step(std::span<const MicroBatch> microbatches, const StepOptions& options, const LossFn* host_loss,
                  const DeviceLoss* device_loss);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// True when CUDA device `device` is usable here and of compute capability 9.0; otherwise false
// and *why (for test skips and error messages).
bool cuda_engine_available(std::string* why, int device = 0);

}  // namespace rlh::engine
