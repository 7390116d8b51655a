// rlh_engine: the single-rank fp32 training engine both backends (dtensor, megatron) run.
//
// It executes a model description (rlh::sdk::TransformerDesc, the Llama family: RMSNorm,
// GQA attention with RoPE variants, optional q/k/v/o biases, q/k norms and sliding windows, or
// DeepSeek's multi-head latent attention; SwiGLU MLPs or mixture-of-experts layers (Mixtral,
// Qwen2-MoE, Qwen3-MoE, DeepSeek-V3: dropless top-k routing, shared experts, routing
// record/replay, MoeOptions); tied or untied head) on packed batches:
//
//   MicroBatch (token ids + sequence offsets + named fields)
//     -> forward -> per-token outputs (logprob of each token with temperature, processed
//        logprob after top-k/top-p, entropy; logits on request for tests)
//     -> loss callback (the algorithm's: outputs in, loss + one gradient per output out)
//     -> backward -> gradients accumulated over micro-batches
//   -> global grad-norm clip + AdamW (fp32 master weights; lr given per step by the caller)
//
// Output alignment (NeMo-RL's): outputs are [N] over the packed tokens; position t holds the
// quantity for predicting token t from the tokens before it in its sequence, and the first
// token of every sequence holds 0. Gradients of the loss callback use the same alignment.
//
// Global normalisation: the callback receives the caller's global token/sequence counts and
// normalises by them, and the engine sums losses and gradients over micro-batches, so a step
// gives the same result however the batch is split or packed.
//
// Memory: one Allocator (allocator.hpp) for everything; parameters, gradients and optimizer state
// are single allocations carved into tensors; activations are one allocation sized for the
// largest micro-batch; with `recompute` only each layer's input is kept and the layer is re-run
// inside the backward. Attention never materialises [N, N] and the head never [N, V] (the
// kernels tile them).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "rlhost/engine/allocator.hpp"
#include "rlhost/engine/ops.hpp"
#include "rlhost/engine/unit_store.hpp"
#include "rlhost/sdk/expert_parallel.hpp"
#include "rlhost/sdk/model_desc.hpp"
#include "rlhost/sdk/pipeline_parallel.hpp"
#include "rlhost/sdk/tensor_parallel.hpp"
#include "rlhost/tensor.h"  // rlh_named_tensor (batch fields)

namespace rlh::engine {

// ---------------------------------------------------------------------------------------------
// Batches

// One packed micro-batch: sequences s = 0..S-1 hold tokens cu_seqlens[s] .. cu_seqlens[s+1]-1.
// Everything is borrowed for the duration of a call.
struct MicroBatch {
  std::span<const int32_t> input_ids;   // [N]
  std::span<const int32_t> cu_seqlens;  // [S+1], 0 .. N, non-decreasing
  // The algorithm's named fields (advantages, masks, old logprobs, ...) aligned with the tokens
  // or the sequences of this micro-batch; the engine only hands them to the loss callback.
  std::vector<rlh_named_tensor> fields;

  int64_t num_tokens() const { return int64_t(input_ids.size()); }
  int64_t num_sequences() const { return int64_t(cu_seqlens.size()) - 1; }
  const rlh_tensor* field(const std::string& name) const;
};

// ---------------------------------------------------------------------------------------------
// Outputs

struct OutputRequest {
  bool logprob = true;             // log p(token | prefix) of the temperature-scaled logits
  bool processed_logprob = false;  // the same after top-k / top-p filtering (vLLM's)
  bool entropy = false;            // entropy of the temperature-scaled distribution
  // log p of given ids (top-k distillation): the micro-batch field `ids_field`, [N, K] (or [N])
  // int32/int64, holds at position t the K ids whose log p (predicting token t, temperature-
  // scaled, unfiltered) is wanted; ids < 0 give 0. Output [N, K].
  bool logprob_at_ids = false;
  std::string ids_field;
  bool logits = false;             // logits [N, V] before the temperature, unshifted (position t
                                   // predicts t+1; final-soft-capped as HF returns Gemma-2's); tests
  // The scalar head (a model with a value head, ParamRole::value_head): value[t] =
  // score . final_norm(x_L)[t], the hidden state after reading tokens 0..t of its sequence. Not
  // shifted: position t is about the prefix that ends with token t (HF's
  // *ForTokenClassification), so a sequence's last position scores the whole sequence (HF's
  // *ForSequenceClassification pools there). Independent of temperature.
  bool value = false;
  double temperature = 1.0;
  int64_t top_k = 0;   // 0 = off
  double top_p = 1.0;  // 1 = off
  // MoE routing record: Outputs::routed_experts [N, R] int32, R = Engine::routing_width() (the
  // sum of top_k over the MoE layers): per token, layer by layer, the experts it was sent to in
  // descending router score (the layout of NeMo-RL's / vLLM's routed_experts, [tokens, layers,
  // top_k]). Token-aligned like the input ids (position t = the routing of token t itself).
  bool routed_experts = false;
  // Routing replay: the name of a micro-batch field, int32/int64 [N, R] (or [N, L_moe, top_k])
  // in that layout; every MoE layer then sends each token to those experts instead of its own
  // top-k, with weights from this pass's router scores at them (Megatron's router replay, R3).
  // Empty = route normally.
  std::string replay_routing_field;
};

// [N] each, logprob_at_ids [N, K] (empty when not requested); logits [N * V];
// routed_experts [N, R] (MoE, when requested).
struct Outputs {
  std::vector<float> logprob, processed_logprob, entropy, logprob_at_ids, logits, value;
  int64_t ids_per_token = 0;  // K
  std::vector<int32_t> routed_experts;
  int64_t routing_width = 0;  // R
};

// What the loss callback sees: views of the requested outputs of one micro-batch.
struct OutputViews {
  std::span<const float> logprob, processed_logprob, entropy;
  std::span<const float> logprob_at_ids;  // [N, K] row-major
  int64_t ids_per_token = 0;
  std::span<const float> value;  // [N]
};
// Where it writes d loss / d output (zeroed by the engine; an output it does not use stays 0).
struct OutputGrads {
  std::span<float> logprob, processed_logprob, entropy, logprob_at_ids, value;
};

struct LossContext {
  const MicroBatch* microbatch = nullptr;
  int64_t index = 0;             // micro-batch index within the step
  int64_t num_microbatches = 0;
  int64_t global_tokens = 0;     // as given in StepOptions
  int64_t global_sequences = 0;
};

struct LossResult {
  double loss = 0;  // this micro-batch's contribution (already globally normalised)
  std::vector<std::pair<std::string, double>> metrics;  // summed over micro-batches
};

using LossFn = std::function<LossResult(const LossContext&, const OutputViews&, OutputGrads&)>;

// ---------------------------------------------------------------------------------------------
// Steps

struct OptimizerOptions {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  // Megatron leaves 1-D parameters (norm weights, biases) out of weight decay; torch AdamW over
  // model.parameters() (the dtensor path) does not.
  bool decay_1d_params = true;
  double max_grad_norm = 1.0;  // 0 = no clipping
};

struct StepOptions {
  double lr = 1e-5;  // this step's learning rate (the caller runs the schedule)
  int64_t global_tokens = 0;
  int64_t global_sequences = 0;
  OutputRequest outputs;
  bool apply_optimizer = true;  // false: only accumulate gradients (tests, larger batches)
  // Counts the MoE auxiliary losses are normalised by (MoeOptions): every routed token and
  // every sequence of the global batch, over all data-parallel ranks. 0 = this step's own
  // micro-batches (right on one rank).
  int64_t moe_global_tokens = 0;
  int64_t moe_global_sequences = 0;
  // The most micro-batches any rank of the data-parallel group runs in this step (0: this
  // rank's own count). A device engine under FSDP gathers and reduces per unit and micro-batch,
  // so a rank with fewer runs that many idle passes to meet its peers' collectives.
  int64_t group_microbatches = 0;
};

// StepResult's MoE metrics (a model with MoE layers) from a step's values, in train_step's
// order; present as the options say. A pipeline's owner gives the values summed (aux, z) or
// maximised (max_load) over the stages.
struct MoeOptions;
std::vector<std::pair<std::string, double>> moe_step_metrics(const MoeOptions& options, double aux, double z,
                                                             double max_load);

// The counts a step's MoE auxiliary losses are normalised by, as both engines take them:
// StepOptions' global counts, or else the step's own tokens and non-empty sequences.
struct MoeNormCounts {
  double tokens = 0, sequences = 0;
};
MoeNormCounts moe_norm_counts(std::span<const MicroBatch> microbatches, const StepOptions& options);

struct StepResult {
  double loss = 0;
  double grad_norm = 0;  // before clipping
  double clip_coef = 1;  // applied to the gradients (min(1, max_norm / (norm + 1e-6)))
  int64_t tokens = 0;
  int64_t step = 0;      // optimizer steps taken so far
  bool skipped = false;  // the gradient norm was not finite: no update was applied
  // The loss callback's metrics, summed over micro-batches; MoE models add "moe/aux_loss" and
  // "moe/z_loss" (the values added to the objective, summed over layers; present when their
  // coefficient is set) and "moe/max_expert_load" (the largest share of routed tokens any
  // expert of any layer got, 1/E when balanced). `loss` stays the callback's alone.
  std::vector<std::pair<std::string, double>> metrics;
  // Per micro-batch, with options.outputs.routed_experts: the routing record [N, R].
  std::vector<std::vector<int32_t>> routed_experts;
};

// MoE settings of the engine, NeMo-RL's megatron_cfg keys in brackets. The engine's defaults
// are plain training (the router learns, no auxiliary loss, float32 router); NeMo-RL's RL
// recipes set freeze_router, router_fp64 and load_balancing none.
struct MoeOptions {
  // [freeze_moe_router] The router (and its bias) is not updated and has no gradient; tokens
  // still backpropagate through the routing weights into the layer input.
  bool freeze_router = false;
  // [moe_router_dtype: fp64] Router logits, scores, top-k choice and weights in float64 (the
  // router GEMM included); float32 otherwise.
  bool router_fp64 = false;
  // [moe_router_load_balancing_type] none | aux_loss (Megatron switch_load_balancing_loss_func,
  // per micro-batch) | seq_aux_loss (Megatron sequence_load_balancing_loss_func, per sequence).
  enum class LoadBalancing { none, aux_loss, seq_aux_loss };
  LoadBalancing load_balancing = LoadBalancing::none;
  double aux_loss_coef = 0.0;  // [moe_aux_loss_coeff]
  double z_loss_coef = 0.0;    // [moe_z_loss_coeff] Megatron z_loss_func: coef * mean(lse^2)
};

// FP8 linears (NeMo-RL's policy.megatron_cfg.fp8_cfg), run by the CUDA engine through the
// registry's FP8 provider (a vendor's plugin: the engine names none). The dense layers' linears
// quantise their operands and multiply in FP8; the first and last layers, the head, the MoE
// experts, MLA's projections and every shape FP8 cannot take stay in bf16. The CPU engine
// refuses FP8.
struct Fp8Options {
  bool enabled = false;
  // [fp8: hybrid] gradients (dY) in e5m2; e4m3 otherwise. Weights and activations are e4m3.
  bool hybrid = false;
  // [fp8_recipe: blockwise] DeepSeek-V3's scaling: 1x128 tiles of activations and gradients,
  // 128x128 blocks of weights; tensorwise: one scale per tensor from its current amax.
  bool blockwise = false;
  // [fp8_recipe: delayed] TransformerEngine's DelayedScaling, tensorwise: each quantisation site
  // of the activations and gradients (a linear's X and X^T, each weight group's dY and dY^T)
  // takes its scale from the amaxes of its own earlier calls (the max over the last
  // amax_history_len, or with amax_max false the most recent one; the first call uses its
  // own), with 2^margin headroom. Weights use current scaling (they are quantised once per call
  // from the bf16 copy, whose amax is then exact). The histories are the engine's state, saved
  // and restored with its checkpoints (CudaEngine::fp8_state). Megatron's defaults: 1,
  // most_recent, 0.
  bool delayed = false;
  int64_t amax_history_len = 1;
  bool amax_max = false;
  int64_t margin = 0;
  // Megatron's num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16 (NeMo-RL's default 1, 1).
  int64_t bf16_first_layers = 1, bf16_last_layers = 1;
};

// The tensor-parallel group as the engine uses it (the owner implements it over its
// communicator, so the engine names no communication library). Every rank of the group calls
// these in the same order; each reduces `n` values in place.
class TpComm {
 public:
  virtual ~TpComm() = default;
  virtual void all_reduce_sum(float* data, int64_t n) = 0;
  virtual void all_reduce_sum(double* data, int64_t n) = 0;
  virtual void all_reduce_max(float* data, int64_t n) = 0;
  // Sequence parallelism: `in` [n] of every rank into `out` [size n], rank blocks in rank order;
  // `in` [size n] summed over the group, this rank's block of n into `out`.
  virtual void all_gather(const float* in, int64_t n, float* out) = 0;
  virtual void reduce_scatter_sum(const float* in, int64_t n, float* out) = 0;
};

// The context-parallel group as the engine uses it (src/cp_attention.cpp): every rank of the
// group calls these in the same order with the same n. all_gather: `in` [n] of every rank into
// `out` [size() n], rank blocks in rank order; reduce_scatter_sum: `in` [size() n] summed over
// the group, this rank's block of n into `out`.
class CpComm {
 public:
  virtual ~CpComm() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  virtual void all_gather(const float* in, int64_t n, float* out) = 0;
  virtual void reduce_scatter_sum(const float* in, int64_t n, float* out) = 0;
  // MoE layers: the routing counts and the auxiliary losses' values, summed in place.
  virtual void all_reduce_sum(double* data, int64_t n) = 0;
};

// Data parallelism of a device engine (CudaEngineOptions::dp): collectives over the data-parallel
// group on the engine's device memory, ordered on `stream` (they may wait for it: comm_mpi stages through the
// host). The backend implements it over its communicator (comm_nccl; comm_mpi where several
// ranks share a GPU), so the engine names no communicator. Every rank of the group makes the
// same calls in the same order.
class DeviceDpComm {
 public:
  virtual ~DeviceDpComm() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  virtual void all_reduce_sum(float* data, int64_t n, void* stream) = 0;
  // out[0:block] = the sum over ranks of in[rank * block : (rank + 1) * block]
  virtual void reduce_scatter_sum(const float* in, float* out, int64_t block, void* stream) = 0;
  // all[r * block : (r + 1) * block] = rank r's `mine` (`mine` may be this rank's block of
  // `all`); elements of `element_bytes` (4: f32, 2: bf16)
  virtual void all_gather(const void* mine, void* all, int64_t block, int element_bytes, void* stream) = 0;
};

// The expert-parallel group as the engine uses it (the owner implements it over its
// communicator). Every rank of the group calls these in the same order.
class EpComm {
 public:
  virtual ~EpComm() = default;
  // `n` values to every rank: send [size * n] in rank order, recv [size * n] from each.
  virtual void all_to_all(const int64_t* send, int64_t* recv, int64_t n) = 0;
  // send_counts[j] floats to rank j (the blocks contiguous in rank order in `send`), and
  // recv_counts[s] floats from rank s into `recv` likewise. Both sides know the counts.
  virtual void all_to_all_v(const float* send, std::span<const int64_t> send_counts, float* recv,
                            std::span<const int64_t> recv_counts) = 0;
};

struct EngineOptions {
  bool recompute = false;   // keep only layer inputs; re-run each layer inside the backward
  int64_t logprob_chunk_bytes = 0;  // head tile size (0 = kernel default, 32 MiB)
  OptimizerOptions optimizer;
  MoeOptions moe;
  Allocator* allocator = nullptr;  // nullptr: the engine's own CountingAllocator
  // Where parameters, gradients and the engine's AdamW moments live (nullptr: `allocator`), so
  // an owner can count the training state apart from activations and scratch.
  Allocator* state_allocator = nullptr;
  // Sharded parameters (unit_store.hpp; not owned): the engine then holds no parameters or
  // gradients, reads every unit through the store, and leaves the gradient norm and the update
  // to the store's owner (train_step reports grad_norm 0 and refuses apply_optimizer).
  UnitStore* units = nullptr;
  // The flat parameter and gradient buffers are allocated with room for a multiple of this many
  // elements (the tail zero), so a data-parallel owner can reduce-scatter and all-gather them in
  // equal blocks (Megatron's padded gradient buffer). flat_params/flat_grads include the tail.
  int64_t pad_storage_to = 1;
  // Tensor parallelism (sdk/tensor_parallel.hpp; neither owned), with tp->size > 1: the engine
  // runs this rank's part of the model given to the constructor: desc() is tp->local, and
  // param/grad/load_parameters/save_parameters/flat_* hold this rank's pieces (tp_slice /
  // tp_place convert). Layers communicate as the program's marks say; the embedding and the
  // fused logprob head are vocabulary-parallel; after the micro-batches the gradients the group
  // shares are summed, and the gradient norm is the whole model's (grad_sumsq). Not with a
  // UnitStore; logits and top-k/top-p processed logprobs are refused.
  const sdk::TpLayout* tp = nullptr;
  TpComm* tp_comm = nullptr;
  // Expert parallelism (sdk/expert_parallel.hpp; neither owned), with ep->size > 1: the engine
  // holds this rank's block of every MoE layer's routed experts (desc() is ep->local) and each
  // MoE step sends its rows to the experts' ranks and back through `ep_comm` (dropless). The
  // expert tensors are stored apart, after every other parameter (expert_range()), the two
  // regions each padded to a multiple of pad_storage_to and pad_experts_to, so an owner reduces
  // them over different groups. Not with a UnitStore nor with tensor parallelism.
  const sdk::EpLayout* ep = nullptr;
  EpComm* ep_comm = nullptr;
  int64_t pad_experts_to = 1;
  // With `tp` whose experts are cut over fewer ranks than the tp group (1 < tp->expert_size <
  // tp->size, Megatron's expert_tensor_parallel_size between 1 and tp): the expert
  // tensor-parallel group (tp->expert_size ranks holding the same experts' other blocks, in
  // block order; not owned). Each rank routes its own rows as at expert_size 1; the rows its
  // experts receive are all-gathered over this group, each rank computes its blocks' partial
  // outputs for all of them, and those are reduce-scattered back (the backward likewise).
  EpComm* etp_comm = nullptr;
  // Megatron's sequence parallelism on top of `tp` (src/sequence_parallel.cpp): the residual
  // stream, its norms and adds run on this rank's 1/T of the rows; the input of a
  // column-parallel linear (and of the head) is all-gathered over the group, the output of a
  // row-parallel one (and of the embedding) reduce-scattered, instead of all-reduced. A
  // micro-batch is padded to a multiple of T rows (a trailing sequence, or each sequence under
  // context parallelism). MoE and MLA blocks gather their input and scatter their output (MoE)
  // and d input; padding rows stay out of the routing counts. The results are plain tensor
  // parallelism's.
  bool sequence_parallel = false;
  // Context parallelism (not owned; cp_comm->size() > 1): every rank of the group is given the
  // same micro-batches and computes its zigzag share of every sequence's tokens (the sequence
  // padded to a multiple of 2 cp and cut into 2 cp chunks; rank r runs chunks r and 2cp-1-r),
  // RoPE and the causal mask on global positions, attention over the group's all-gathered keys
  // and values. Outputs are all-gathered, so forward and the loss callback see the whole
  // micro-batch as one rank does; each rank backpropagates its own tokens, so the dense
  // gradients are partial sums the owner reduces over the group (with the data-parallel ranks:
  // Megatron's dp_cp group). Composes with `tp`. MoE layers route each rank's own tokens; their
  // load-balancing counts are summed over the group, so the auxiliary losses, z-loss and
  // moe/max_expert_load are one rank's; routing records and replay follow the zigzag order. MLA
  // attends over the group's gathered k and v like any attention. Per-sequence RoPE kinds are
  // refused at construction, logits and logprob_at_ids at run time.
  CpComm* cp_comm = nullptr;
  // Pipeline parallelism (sdk/pipeline_parallel.hpp; not owned), with pp->size > 1: the engine
  // runs one stage of the model given to the constructor (with tensor parallelism: of tp->local):
  // desc() is pp->local, param/grad/... hold the stage's tensors. It is driven by the *_stage
  // calls below (the owner moves activations between stages and runs the schedule); forward and
  // train_step refuse. Not with a UnitStore, nor with context or sequence parallelism.
  const sdk::PpLayout* pp = nullptr;
  // The kernels (required; not owned): make_registry_ops over a kernel registry.
  Ops* ops = nullptr;
};

// ---------------------------------------------------------------------------------------------
// The engine

class Engine {
 public:
  // Validates that the description is one this engine executes (GQA or MLA attention, RMSNorm,
  // SwiGLU MLP or MoE layers); throws std::invalid_argument naming what is not supported (other
  // activations and norms). Allocates parameters (zero) and gradients.
  Engine(sdk::TransformerDesc desc, EngineOptions options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const sdk::TransformerDesc& desc() const;
  Allocator& allocator();
  // The engine's own allocator when EngineOptions::allocator was null (else nullptr).
  CountingAllocator* counting_allocator();

  // Parameters and gradients in desc().params order, engine layout (row-major desc shapes).
  // Without a UnitStore only (with one they throw std::logic_error): param, grad,
  // load_parameters, save_parameters, zero_grad, flat_params, flat_grads.
  size_t num_params() const;
  int64_t num_elements() const;  // total parameter count
  // The flat storage: parameter i at [param_offset(i), param_offset(i) + its numel); units (see
  // unit_store.hpp) are the contiguous ranges [unit_range(u).first, unit_range(u).second),
  // u = 0 .. num_units() - 1 (layers, then the global tensors).
  int64_t param_offset(size_t i) const;
  int64_t num_units() const;
  std::pair<int64_t, int64_t> unit_range(int64_t unit) const;
  std::span<float> flat_params();
  std::span<float> flat_grads();
  std::span<float> param(size_t i);
  std::span<float> grad(size_t i);
  // Copies weights in (e.g. rlh::sdk::load_weights_f32(...).tensors); sizes must match.
  void load_parameters(const std::vector<std::vector<float>>& tensors);
  std::vector<std::vector<float>> save_parameters() const;
  void zero_grad();
  // The sum of squares of gradients g, where g[k] is the gradient at flat index flat_begin + k,
  // each parameter's weighted so that the sum over a tensor-parallel group counts every element
  // of the whole model's gradient once (TpPiece::norm_weight; 1 without tensor parallelism).
  double grad_sumsq(std::span<const float> g, int64_t flat_begin) const;

  // Forward only (no activations kept for a backward).
  Outputs forward(const MicroBatch& mb, const OutputRequest& request);

  // One optimizer step over the micro-batches: forward, loss callback, backward for each, then
  // clip + AdamW (unless options.apply_optimizer is false). Gradients start from zero; they stay
  // readable through grad() after a step without the optimizer, and are cleared by the AdamW
  // pass itself after a step with it.
  StepResult train_step(std::span<const MicroBatch> microbatches, const StepOptions& options,
                        const LossFn& loss_fn);

  int64_t step() const;

  // Pipeline parallelism (EngineOptions::pp): one stage's part of forward and train_step.
  // Activations crossing a stage boundary are [N, C] row-major (C the hidden size).
  // forward_stage: forward only. `x_in` is the previous stage's output (empty on the first
  // stage). A stage that is not the last writes its output to `x_out` and returns no outputs;
  // the last returns the outputs forward() would.
  // `chunk`: which of the stage's model chunks runs (interleaved virtual stages,
  // PpLayout::chunks; 0 without them): its layers, from the embedding if it is the first chunk
  // of stage 0, to the head if it is the last of the last stage.
  Outputs forward_stage(const MicroBatch& mb, const OutputRequest& request, std::span<const float> x_in,
                        std::span<float> x_out, int64_t chunk = 0);
  // The rows of a stage boundary for `mb` (x_in, x_out, dy and dx hold stage_rows(mb) x C
  // values): mb.num_tokens(), or under context parallelism this rank's rows of the zigzag split
  // (each sequence padded to a multiple of 2 cp, 2 of its 2 cp chunks), which the same cp rank
  // of the next stage holds.
  int64_t stage_rows(const MicroBatch& mb) const;
  // A train step on a stage: begin_stage_step (gradients zeroed; the step's micro-batches and
  // options give the MoE auxiliary losses' normalisers, as train_step takes them), then per
  // micro-batch backward_stage, then end_stage_step (the tensor-parallel group's shared
  // gradients summed). The gradient norm and the update are the owner's, as with
  // apply_optimizer = false.
  // MoE under PP: the routing replay field is the whole model's [N, R] (R = pp->route_total);
  // each stage reads its own columns. A routing record (forward_stage with routed_experts, on
  // every stage) holds the run model chunk's columns only: Outputs::routing_width of them
  // (pp->chunks[chunk].route_count), the first at pp->chunks[chunk].route_begin of the whole
  // record (without virtual stages: routing_width() columns at pp->route_begin). With virtual
  // stages a rank's chunks are separate runs, so the caller places each chunk's record where
  // it belongs. The auxiliary losses of a stage's layers are added
  // to its own gradients; their values are stage_moe_values() after the step's backward_stage
  // calls, for the owner to sum over the stages (moe_step_metrics).
  void begin_stage_step(std::span<const MicroBatch> microbatches, const StepOptions& options);
  // One micro-batch: its forward from `x_in` (empty on the first stage) with activations kept
  // (or layer inputs only, with recompute), then its backward: on the last stage from the loss
  // callback (called with index / count / the step's counts, as train_step calls it; its result
  // is returned), elsewhere from `dy` = d loss / d output. A stage that is not the first writes
  // d loss / d input to `dx`.
  LossResult backward_stage(const MicroBatch& mb, int64_t index, int64_t count, const StepOptions& options,
                            const LossFn& loss_fn, std::span<const float> x_in, std::span<const float> dy,
                            std::span<float> dx, int64_t chunk = 0);
  void end_stage_step();
  struct MoeValues {
    double aux = 0, z = 0, max_load = 0;  // StepResult's moe/aux_loss, moe/z_loss, moe/max_expert_load
  };
  MoeValues stage_moe_values() const;

  // MoE: R of the routing record and replay (the sum of top_k over MoE layers; 0 when dense).
  int64_t routing_width() const;

  // Expert parallelism: the flat range [first, second) of the expert tensors (and their padding);
  // empty (both num_elements(), padding included) without expert parallelism.
  std::pair<int64_t, int64_t> expert_range() const;
  // Expert parallelism: what a rank with no (further) micro-batch runs so that its peers'
  // exchanges meet: every MoE layer's experts over the rows the other ranks send it (none of its
  // own), forward, and with `train` backward too (adding to the expert gradients) in the order a
  // train step runs them. Collective over the ep group; a no-op without expert parallelism.
  // `chunk` >= 0: a pipeline stage's model chunk only (the layers a forward_stage or
  // backward_stage call of that chunk runs); -1: every layer.
  void ep_idle_microbatch(bool train, int64_t chunk = -1);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Pieces every executor of this contract shares (the CPU engine, rlh_engine_cuda):
// Output alignment: kernel row t (predicting token t+1) <-> output position t+1; the first
// position of each sequence is 0. `width` columns are moved, from/to rows ld apart.
void shift_to_outputs(const float* kernel, int64_t ldk, float* out, int64_t ldo, int64_t width,
                      std::span<const int32_t> cu);
void shift_to_kernel(const float* out, int64_t ldo, float* kernel, int64_t ldk, int64_t width,
                     std::span<const int32_t> cu);
// Storage order of parameters in the engines' flat buffers: each layer's tensors in
// layer_param_order() (q|k|v, gate|up and the shared expert's gate_proj|up adjacent, so each
// group is one GEMM), then the global ones in global_param_order(). The generator lays out its
// own weights the same way, so its views of a colocated engine's buffers line up.
std::span<const sdk::ParamRole> layer_param_order();
std::span<const sdk::ParamRole> global_param_order();
// What every executor reads alike from a layer's description (each adds its own MoE/MLA
// fields): query and key-value heads, head width, dense MLP width (0 for an MoE layer), the two
// norms' eps and weight offset, Qwen3's q/k norms, whether RoPE applies, the sliding window and
// the softmax scale (the description's, else 1/sqrt(head_dim)). No validation: callers check
// what they execute first.
struct LayerBasics {
  int64_t Hq = 0, Hkv = 0, D = 0, F = 0;
  float eps_attn = 0, off_attn = 0, eps_mlp = 0, off_mlp = 0;
  bool qk_norm = false, use_rope = false;
  int64_t window = 0;
  float scale = 0;
};
LayerBasics layer_basics(const sdk::TransformerDesc& desc, const sdk::LayerDesc& layer);

// An MoE layer's sizes and routing as both engines execute them (the description's MoeDesc),
// checked: throws std::invalid_argument starting with `at` ("engine: layer 3: ") for sizes the
// engines do not support, and for auxiliary losses (per `options`) with sigmoid scores.
struct MoeBasics {
  int64_t E = 0, Kx = 0, Fe = 0, Fs = 0;  // experts, top k, expert width, shared-expert width
  bool shared_gate = false, score_bias = false, router_bias = false;
  int scoring = 0;  // 0 softmax, 1 sigmoid
  bool norm_topk_prob = false;
  double scaling_factor = 1;
  int64_t n_group = 1, topk_group = 1;  // DeepSeek's group-limited routing
};
MoeBasics moe_basics(const sdk::LayerDesc& layer, const MoeOptions& options, const std::string& at);

// Routing replay (OutputRequest::replay_routing_field), as both engines read it: the field of
// `mb` named `field`, checked to be int32/int64 [N, R] (or [N, moe layers, top_k]) and
// contiguous, R = `route_width`; nullptr when `field` is empty. Throws std::invalid_argument
// naming `who` ("engine", "cuda engine") and the field.
const rlh_tensor* replay_routing_tensor(const MicroBatch& mb, const std::string& field,
                                        int64_t route_width, const std::string& who);
// Element `at` of such a field as an expert of a layer with E experts (throws outside [0, E)).
int32_t replayed_expert(const rlh_tensor& f, int64_t at, int64_t E, const std::string& who);

// An MLA layer's latent ranks and head dims (D = dn + dr), checked likewise.
struct MlaBasics {
  int64_t rq = 0, rkv = 0, dn = 0, dr = 0, dv = 0;
};
MlaBasics mla_basics(const sdk::LayerDesc& layer, const std::string& at);

// Adds a loss callback's metrics into a step's, by name (a new name is appended).
void accumulate_metrics(std::vector<std::pair<std::string, double>>& into,
                        const std::vector<std::pair<std::string, double>>& add);

// Splits packed sequences into micro-batches of at most max_tokens tokens each without splitting
// a sequence (a longer sequence gets a micro-batch of its own). The results borrow ids.
std::vector<MicroBatch> split_microbatches(std::span<const int32_t> input_ids,
                                           std::span<const int32_t> cu_seqlens,
                                           int64_t max_tokens,
                                           std::vector<std::vector<int32_t>>* cu_storage);

}  // namespace rlh::engine
