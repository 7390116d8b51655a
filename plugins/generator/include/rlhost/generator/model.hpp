// The model as the generator runs it: a transformer description (rlh::sdk::TransformerDesc, the
// same one the training engine executes), its weights — views of a colocated trainer's buffers
// or owned copies — and the forward of one scheduler step over the paged KV cache.
//
// What a layer computes is the layer program (sdk/layer_program.hpp), the one the engines
// execute. DecodeModel holds the program and what the executors read of it once (LayerShape,
// the RoPE tables); a StepExecutor runs a step: on the host (decode.cpp, float32 over the CPU's
// kernel registry) or on a CUDA device (cuda_executor.hpp, bf16 over the device's registry).
// Both interpret the program with the same code (program_runner.hpp) and differ only in where
// values live and in how a few steps run: linear steps are the batch-invariant gemm on the host
// (a row's result never depends on the other rows, so a sequence decodes the same tokens
// whoever shares its batch), attention writes the step's keys and values into the paged cache
// and attends over it (the kv_cache_write and paged_attention ops), MoE and MLA are composite
// steps (moe_decode.cpp, mla_decode.cpp: the engine's math). Every op is a kernel registry's.
#pragma once

#include <cstdint>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <vector>

#include "rlhost/engine/allocator.hpp"
#include "rlhost/engine/engine.hpp"  // LayerBasics
#include "rlhost/engine/ops.hpp"
#include "rlhost/generator/kv_cache.hpp"
#include "rlhost/sdk/layer_program.hpp"
#include "rlhost/sdk/model_desc.hpp"
#include "rlhost/sdk/tensor_parallel.hpp"
#include "rlhost/tensor.h"

namespace rlh::gen {


// One contiguous run of a refit piece: `count` elements from element `src` of the source tensor
// to element `dst` of its parameter's engine tensor.
struct WeightRun {
  int64_t dst = 0, src = 0, count = 0;
};

// The group of ranks one tensor-parallel generator is spread over (vLLM's tensor_parallel_size,
// Megatron's layout: sdk/tensor_parallel.hpp), as the host executor needs it. Every rank of the
// group runs the same generate calls and the same steps; the collectives below are its only
// communication. The plugin gives one over the host's communicator (comm_mpi).
class TpGroup {
 public:
  virtual ~TpGroup() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // Elementwise sum over the group, in place.
  virtual void all_reduce_sum(float* data, int64_t n) = 0;
  // Every rank's n floats of `in`, in rank order, into out [size * n].
  virtual void all_gather(const float* in, int64_t n, float* out) = 0;
};

// A device's memory that update_weights reads (GENERATOR 0.2's weights_device): the CUDA
// executor converts a piece from there into its device weight arena; that parameter then has no
// host copy (Weights::on_device).
class DeviceWeightSink {
 public:
  virtual ~DeviceWeightSink() = default;
  virtual rlh_device device() const = 0;
  // Piece data of parameter `param` in dtype `dtype` (f32 or bf16; others are refused), placed by
  // `runs`. The copies may still be running when this returns: see flush().
  virtual void put(size_t param, const rlh_dtype& dtype, const void* data, std::span<const WeightRun> runs) = 0;
  // Returns once every copy put so far has read its source (the caller's views may then go).
  virtual void flush() = 0;
};

// Weights by description parameter, engine layout (row-major desc shapes): each one either a
// view of memory someone else owns (refit with may_alias) or a slice of one owned arena laid out
// like the engine's (q|k|v and gate|up adjacent, so they run as one product each).
class Weights {
 public:
  explicit Weights(const sdk::TransformerDesc& desc);
  ~Weights();

  // Owned copies of a whole set (desc.params order, engine layout), e.g. from a checkpoint.
  void load(const std::vector<std::vector<float>>& tensors, int64_t version);

  // Installs a set, or the next bucket of one, by HF name (rlh_weight_update's semantics).
  // may_alias: float32 CPU tensors, contiguous, are kept as views (the caller keeps them alive
  // and unchanged until its next update); anything else (other dtypes, strides, copies asked
  // for) is converted into owned memory. A version is in force once every HF tensor of the
  // description has arrived for it; a new version number starts a new set.
  void update(int64_t version, std::span<const rlh_named_tensor> weights, bool may_alias);

  // The HF shape the set expects for `name` (nullptr: not a weight of the description).
  const std::vector<int64_t>* hf_shape(const std::string& name) const;
  // Frees the owned arena and forgets every version (nothing is in force until the next load or
  // complete set): a tensor-parallel rank's whole set once its pieces come by themselves.
  void release();

  // Throws sdk::Error(RLH_E_FAILED_PRECONDITION) unless a complete version is in force (none
  // loaded yet, or a newer version only partly received).
  void require_complete() const;
  bool complete() const { return complete_ && pending_received_ == 0; }
  int64_t version() const { return version_; }
  // Changes whenever the pointers in force may have changed (each load or completed set).
  int64_t serial() const { return serial_; }
  // Bytes of owned weight storage (0 when everything is a view).
  int64_t owned_bytes() const;
  // Where parameter i is (nullptr before it is installed, and for a stacked parameter whose
  // pieces are views that do not lie back to back: use piece() then).
  const float* param(size_t i) const { return ptr_[i]; }
  // Piece k of parameter i (a stacked parameter's expert k; for others piece 0 = param(i)).
  const float* piece(size_t i, size_t k) const { return piece_[i][k]; }
  // The owned arena's layout, which a device copy of the weights repeats (in elements): where
  // parameter i starts, and the whole size. Adjacent parameters (q|k|v, gate|up) stay adjacent.
  int64_t arena_offset(size_t i) const { return arena_off_[i]; }
  int64_t arena_elems() const { return arena_floats_; }
  // Where update_weights sends device tensors (nullptr: it accepts host memory only). Not owned.
  void set_device_sink(DeviceWeightSink* sink) { sink_ = sink; }
  const DeviceWeightSink* device_sink() const { return sink_; }
  // Parameter i of the version in force came in device memory: the sink's arena holds it and
  // param()/piece() are nullptr.
  bool on_device(size_t i) const { return on_device_[i] != 0; }

 private:
  void ensure_arena();
  void finalize();  // a complete pending set becomes the version in force
  void set_pieces(size_t i, const float* whole);

  const sdk::TransformerDesc& desc_;
  std::vector<const float*> ptr_;   // per param, in force
  std::vector<std::vector<const float*>> piece_;  // per param, per piece, in force
  std::vector<int64_t> arena_off_;  // per param offset in the arena (layer order)
  int64_t arena_floats_ = 0;
  float* arena_ = nullptr;
  struct Piece {
    size_t param = 0, index = 0;  // desc.params[param].hf_names[index]
  };
  std::vector<std::pair<std::string, Piece>> by_name_;  // sorted by HF name
  std::vector<std::vector<const float*>> alias_;        // per param, per piece: view or nullptr
  std::vector<std::vector<uint8_t>> got_;               // per param, per piece: received
  std::vector<std::vector<uint8_t>> got_on_device_;     // per param, per piece: came to the sink
  std::vector<uint8_t> on_device_;                      // per param, in force
  // per param: its HF pieces hold fewer elements than the engine tensor (a tensor-parallel
  // rank's padded vocabulary block): always copied into the arena, whose padding stays zero
  std::vector<uint8_t> short_;
  DeviceWeightSink* sink_ = nullptr;
  int64_t pieces_total_ = 0;
  int64_t pending_version_ = -1, pending_received_ = 0;
  int64_t version_ = -1, serial_ = 0;
  bool complete_ = false;
};

// What the composite steps and the cache need of one layer, read once from its program.
struct LayerShape : engine::MoeBasics, engine::MlaBasics {
  // Attention geometry: kv heads, key and value widths in the cache (MLA: Hq expanded heads,
  // Dk = dn + dr, Dv = v_head_dim)
  int64_t Hq = 0, Hkv = 0, Dk = 0, Dv = 0;
  double scale = 0;   // softmax scale (the description's)
  int64_t window = 0;
  double softcap = 0;  // Gemma-2's attn_logit_softcapping (0: none)
  // MoE: the experts' activation and the router's attributes
  bool moe = false;
  std::string act = "silu";
  engine::Ops::RouterAttrs router;
  // MLA: the width of its q|k|v value and its RoPE table (-1: none)
  bool mla = false;
  int64_t Wqkv = 0;
  int rope = -1;
  // Parameter indices (desc.params; -1: absent) of the composite steps: MLA's projections and
  // latent norms; MoE's router (+ bias, selection bias), experts, shared expert and its gate.
  int64_t p_q = -1, p_q_a = -1, p_q_a_norm = -1, p_q_b = -1, p_kv_a = -1, p_kv_a_norm = -1, p_kv_b = -1;
  int64_t p_router = -1, p_router_b = -1, p_score_bias = -1, p_gate = -1, p_up = -1, p_down = -1;
  int64_t p_ws_gate_proj = -1, p_ws_up = -1, p_ws_down = -1, p_ws_gate = -1;
};

// One RoPE table of the program, as the executors read it.
struct RopeTable {
  std::vector<float> inv_freq;  // [R/2]: the table for positions below dynamic_from
  int64_t R = 0;
  double scale = 1;
  bool interleaved = false;
  int64_t dynamic_from = 0;  // > 0: rows at positions >= this need their own table (dynamic NTK, longrope)
};

// The rows of one step, as the scheduler planned them, in the form every executor reads: row r
// is token ids[r] at position pos[r] of a sequence whose block table is table[r * width ..] and
// whose keys and values go to cache slot slots[r] (block * block_size + offset). sample_rows: the
// rows whose logits draw a token, in the order of the draws.
struct StepRows {
  std::vector<int32_t> ids, pos, slots, table;
  int64_t width = 0;                 // block table entries per row (unused ones -1)
  std::vector<int64_t> sample_rows;  // indices into the rows
  std::span<const CacheRow> rows;    // the scheduler's rows (the host executor's per-row RoPE)
  int64_t R() const { return int64_t(ids.size()); }
  int64_t S() const { return int64_t(sample_rows.size()); }
  // Fills every field from the scheduler's rows (block tables as wide as the longest row needs,
  // at least min_width).
  void build(std::span<const int32_t> ids, std::span<const CacheRow> rows, std::span<const int64_t> sample_rows,
             int64_t block_size, int64_t min_width = 1);
};

// The draw of one step: per sampling row its uniform, and the sampling parameters (docs/ops.md
// "sample"); results per sampling row.
struct StepDraws {
  std::span<const double> u;
  engine::Ops::SampleAttrs attrs;
  std::span<int32_t> tokens;
  std::span<float> logprobs;
};

class DecodeModel {
 public:
  // Throws sdk::Error(RLH_E_UNIMPLEMENTED) naming the layer and feature when the program needs
  // what the generator does not execute, RLH_E_INVALID_ARGUMENT when the description is
  // inconsistent.
  //
  // With a group `tp` of more than one rank (not owned) the model is this rank's part of the
  // tensor-parallel layout (sdk::make_tp_layout): desc() and weights() are the rank's (its heads,
  // widths and vocabulary rows; the program marked by mark_tensor_parallel), while whole
  // weights arrive in input_weights() (the full description's) and sync_weights() slices them.
  // A layout the group cannot run is refused naming policy.generation.vllm_cfg.tensor_parallel_size.
  explicit DecodeModel(sdk::TransformerDesc desc, TpGroup* tp = nullptr);

  // The MoE router in float64 (the trainer's MoeOptions::router_fp64, NeMo-RL's
  // moe_router_dtype: fp64); float32 by default. No effect on models without MoE layers.
  void set_router_fp64(bool on) { router_fp64_ = on; }
  bool router_fp64() const { return router_fp64_; }
  ~DecodeModel();

  // This rank's description (the whole model's without tensor parallelism).
  const sdk::TransformerDesc& desc() const { return desc_; }
  // The whole model's description (what refits and checkpoints name).
  const sdk::TransformerDesc& full_desc() const { return tp_on() ? full_desc_ : desc_; }
  const sdk::ModelProgram& program() const { return prog_; }
  // Tensor parallelism: the group (nullptr without) and this rank's layout.
  TpGroup* tp() const { return tp_on() ? tp_ : nullptr; }
  bool tp_on() const { return tp_ != nullptr && tp_->size() > 1; }
  const sdk::TpLayout& tp_layout() const { return tp_layout_; }
  const std::vector<LayerShape>& shapes() const { return shapes_; }
  const std::vector<RopeTable>& ropes() const { return ropes_; }
  // The whole vocabulary (every rank draws over it), and the rows of it this rank's embedding and
  // head hold (vocab() without tensor parallelism; a padded block of it with).
  int64_t vocab() const { return V_; }
  int64_t vocab_rows() const { return Vrows_; }
  int64_t hidden() const { return C_; }
  int64_t num_layers() const { return L_; }
  // The weights the executors read (this rank's under tensor parallelism).
  Weights& weights() { return *weights_; }
  const Weights& weights() const { return *weights_; }
  // Where whole weights are loaded and refit: weights() itself, or under tensor parallelism the
  // whole model's set, sliced into weights() by sync_weights() once it is complete.
  Weights& input_weights() { return full_weights_ ? *full_weights_ : *weights_; }
  const Weights& input_weights() const { return full_weights_ ? *full_weights_ : *weights_; }
  // Under tensor parallelism: this rank's pieces of a whole set that changed since the last call
  // (tp_slice), installed as owned weights of the same version. Requires a complete input set.
  // Nothing to do once pieces came by themselves (update_weights).
  void sync_weights();
  // rlh_weight_update's install. Under tensor parallelism an update of this rank's pieces (each
  // tensor the box of its HF tensor this rank holds, as sdk::tp_box / sdk::hf_box give it, a
  // padded vocabulary block without its padding; at least one of them smaller than its HF
  // tensor) goes straight to weights(), and the whole set is released (no whole copy stays
  // resident); an update of whole tensors goes to input_weights() as before. A bucket of only
  // uncut tensors counts as whole, so a pieces update comes in one call.
  void update_weights(int64_t version, std::span<const rlh_named_tensor> weights, bool may_alias);
  // A complete version is in force in the set the last update went to (Weights::require_complete).
  void require_complete() const;
  // The paged cache's layout for this model: keys transposed within a block (the host's
  // paged_attention) or row-major (a GPU's), elements of elem_bytes.
  KvLayout kv_layout(int64_t block_size, bool keys_transposed = true, int64_t elem_bytes = 4) const;
  // Elements of a layer's values for R rows beside the residual stream (the worst layer), each
  // value starting on a 16-element boundary, and of MLA's scratch.
  int64_t values_elems(int64_t rows) const;
  int64_t mla_scratch_elems(int64_t rows) const;

 private:
  sdk::TransformerDesc desc_;
  sdk::ModelProgram prog_;
  std::vector<LayerShape> shapes_;
  std::vector<RopeTable> ropes_;
  int64_t V_ = 0, Vrows_ = 0, C_ = 0, L_ = 0;
  std::unique_ptr<Weights> weights_;
  TpGroup* tp_ = nullptr;
  sdk::TpLayout tp_layout_;
  sdk::TransformerDesc full_desc_;         // under tensor parallelism
  std::unique_ptr<Weights> full_weights_;  // under tensor parallelism: what refits fill
  int64_t synced_serial_ = -1;             // full_weights_'s serial() sliced last
  bool pieces_in_force_ = false;           // the last update brought this rank's pieces
  bool router_fp64_ = false;
};

// Runs the steps of a DecodeModel: the step's forward (logits of its sampling rows) and draws.
class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  virtual std::string name() const = 0;
  // One step: the rows' keys and values go into `kv` (blocks already allocated), then one token
  // per sampling row is drawn into `draws`. Requires complete weights. A row's results depend
  // only on its sequence's tokens (on the host bitwise; on a device, as its kernels promise).
  virtual void step(const StepRows& rows, KvCache& kv, const StepDraws& draws) = 0;
  // The KV cache of a generate() call: the layout the executor's attention reads (keys
  // transposed or not, element size), its budget in bytes (configured_bytes unless the executor
  // has a rule of its own, e.g. a share of the device's memory) and where its pool lives (an
  // empty allocator: the generator's, on the host).
  virtual bool keys_transposed() const { return true; }
  virtual int64_t elem_bytes() const { return 4; }
  virtual int64_t kv_budget(const KvLayout& layout, int64_t configured_bytes) {
    (void)layout;
    return configured_bytes;
  }
  virtual PoolAllocator kv_allocator() = 0;
  // A generate() call begins (its longest sequence in tokens, the cache's block size) or ends.
  virtual void begin_generate(int64_t max_len, int64_t block_size) {
    (void)max_len;
    (void)block_size;
  }
  virtual void end_generate() {}
};

// The host executor: float32 on the CPU's kernels (ops: a registry's, not owned).
// kv_fp8: the cache in FP8 e4m3 (vLLM's kv_cache_dtype fp8; Options::kv_cache_fp8).
std::unique_ptr<StepExecutor> make_host_executor(DecodeModel& model, engine::Ops* ops, bool kv_fp8 = false);

}  // namespace rlh::gen
