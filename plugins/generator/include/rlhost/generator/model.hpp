// The model as the generator runs it: a transformer description (rlh::sdk::TransformerDesc, the
// same one the training engine executes), its weights — views of a colocated trainer's buffers
// or owned copies — and the forward of one scheduler step over the paged KV cache.
//
// What a layer computes is the layer program (sdk/layer_program.hpp), the one the engines
// execute: DecodeModel interprets its steps for the rows of a step. Where the generator differs
// is only in how two steps run: every linear step is the batch-invariant gemm (a row's result
// never depends on the other rows, so a sequence decodes the same tokens whoever shares its
// batch), and attention writes the step's keys and values into the paged cache and attends over
// it (the kv_cache_write and paged_attention ops). MoE and MLA are composite steps
// (moe_decode.cpp, mla_decode.cpp: the engine's math). Every op is the kernel registry's, through
// the engine's Ops interface.
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
#include "rlhost/tensor.h"

namespace rlh::gen {

// std::vector's storage on 64-byte boundaries (a cache line, one AVX-512 register).
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const Aligned64<U>&) const { return true; }
};
using AlignedFloats = std::vector<float, Aligned64<float>>;

// What the composite steps and the cache need of one layer, read once from its program.
struct LayerShape : engine::MoeBasics, engine::MlaBasics {
  // Attention geometry: kv heads, key and value widths in the cache (MLA: Hq expanded heads,
  // Dk = dn + dr, Dv = v_head_dim)
  int64_t Hq = 0, Hkv = 0, Dk = 0, Dv = 0;
  double scale = 0;   // softmax scale (the description's)
  int64_t window = 0;
  // MoE: the experts' activation and the router's attributes
  bool moe = false;
  std::string act = "silu";
  engine::Ops::RouterAttrs router;
  // MLA: the width of its q|k|v value and its RoPE table (-1: none)
  bool mla = false;
  int64_t Wqkv = 0;
  int rope = -1;
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
  int64_t pieces_total_ = 0;
  int64_t pending_version_ = -1, pending_received_ = 0;
  int64_t version_ = -1, serial_ = 0;
  bool complete_ = false;
};

// Weight pointers of the composite steps of one layer (the set in force).
struct LayerWeights {
  // MoE: router [E, C] (+ bias, selection bias [E]), shared expert and its gate
  const float *router = nullptr, *router_b = nullptr, *score_bias = nullptr;
  // Expert e's gate / up [Fe, C] and down [C, Fe]: views may lie anywhere (refit by HF name
  // with one tensor per expert), so one pointer each.
  std::vector<const float*> e_gate, e_up, e_down;
  const float *ws_gate_proj = nullptr, *ws_up = nullptr, *ws_down = nullptr, *ws_gate = nullptr;
  // MLA: q_a [rq, C], q_a_norm [rq], q_b [Hq D, rq] (or q [Hq D, C] without rq), kv_a
  // [rkv + dr, C], kv_a_norm [rkv], kv_b [Hq (dn + Dv), rkv]
  const float *q = nullptr, *q_a = nullptr, *q_a_norm = nullptr, *q_b = nullptr;
  const float *kv_a = nullptr, *kv_a_norm = nullptr, *kv_b = nullptr;
  // The float64 router (router_fp64): the router weight widened, refreshed with the set
  std::vector<double> router64;
};

class DecodeModel {
 public:
  // ops: the kernels (required; not owned). Throws sdk::Error(RLH_E_UNIMPLEMENTED) naming the
  // layer and feature when the program needs what the generator does not execute,
  // RLH_E_INVALID_ARGUMENT when the description is inconsistent.
  DecodeModel(sdk::TransformerDesc desc, engine::Ops* ops);

  // The MoE router in float64 (the trainer's MoeOptions::router_fp64, NeMo-RL's
  // moe_router_dtype: fp64); float32 by default. No effect on models without MoE layers.
  void set_router_fp64(bool on) {
    router_fp64_ = on;
    bound_serial_ = -1;  // widen the router weights at the next bind
  }
  bool router_fp64() const { return router_fp64_; }
  ~DecodeModel();

  const sdk::TransformerDesc& desc() const { return desc_; }
  const sdk::ModelProgram& program() const { return prog_; }
  const std::vector<LayerShape>& shapes() const { return shapes_; }
  int64_t vocab() const { return V_; }
  Weights& weights() { return *weights_; }
  const Weights& weights() const { return *weights_; }
  KvLayout kv_layout(int64_t block_size) const;

  // One step: rows r = 0..R-1 are tokens ids[r] of the sequences rows[r] names (at rows[r].pos),
  // in any order and grouping; their keys and values go into `kv` (blocks already allocated).
  // Writes the logits of rows sample_rows[i] into logits + i * vocab(). Requires complete
  // weights. A row's results depend only on its sequence's tokens, never on the other rows.
  void forward(std::span<const int32_t> ids, std::span<const CacheRow> rows,
               std::span<const int64_t> sample_rows, KvCache& kv, float* logits);

 private:
  void bind_weights();
  void reserve(int64_t rows, int64_t samples);
  const float* wp(int64_t param) const { return param < 0 ? nullptr : weights_->param(size_t(param)); }
  // The rows' RoPE tables (a row past a dynamic table's threshold gets its own) and block tables.
  void prepare_rows(std::span<const CacheRow> rows);
  // y = rope(x) with table t on H heads of D dims of every row (y may be x).
  void rope(int t, float* y, int64_t ldy, const float* x, int64_t ldx, int64_t H, int64_t D, int64_t R);
  void run_step(int64_t l, const sdk::LayerStep& st, std::vector<float*>& v, std::span<const CacheRow> rows,
                KvCache& kv);
  // Writes k, v of the rows into layer l's cache (the kv_cache_write op), then out = attention
  // of q over it (paged_attention).
  void attend(int64_t l, const float* q, int64_t ldq, const float* k, int64_t ldk, const float* v, int64_t ldv,
              float* out, int64_t ldo, std::span<const CacheRow> rows, KvCache& kv);
  // moe_decode.cpp: y [R,C] = the MoE block of layer l on xn [R,C] (no residual).
  void moe_block(int64_t l, int64_t R, const float* xn, float* y);
  // mla_decode.cpp: q [R, Hq D], k [R, Hq D], v [R, Hq Dv] of layer l into qkv (rows Wqkv
  // apart) from xn [R,C], RoPE applied: what attention and the cache read.
  void mla_qkv(int64_t l, const float* xn, float* qkv, int64_t R);

  sdk::TransformerDesc desc_;
  sdk::ModelProgram prog_;
  std::vector<LayerShape> shapes_;
  int64_t V_ = 0, C_ = 0, L_ = 0;
  engine::Ops* ops_ = nullptr;
  std::unique_ptr<Weights> weights_;
  int64_t bound_serial_ = -1;  // Weights::serial() the pointers below were read at
  std::vector<LayerWeights> lw_;
  bool router_fp64_ = false;

  // RoPE tables of the program, and per forward the rows' own tables past a dynamic threshold.
  struct Rope {
    std::vector<float> inv_freq;  // [R/2]: the table for positions below dynamic_from
    int64_t R = 0;
    double scale = 1;
    bool interleaved = false;
    int64_t dynamic_from = 0;         // > 0: rows at positions >= this need their own table
    std::vector<float> row_freq;      // [rows, R/2]
    std::vector<uint8_t> row_own;     // [rows]
  };
  std::vector<Rope> ropes_;

  // Scratch for up to cap_rows_ rows (grown on demand; no state survives a step).
  int64_t cap_rows_ = 0, cap_samples_ = 0;
  AlignedFloats xs_[2];        // the residual stream, layer by layer in turn [R, C]
  AlignedFloats values_;       // a layer's other values (the worst layer's worth)
  AlignedFloats hs_, xn_;      // the sampled rows' hidden states and their final norm [S, C]
  std::vector<int32_t> pos_;   // [R]
  std::vector<int32_t> table_; // [R, table_width_] each row's block table
  std::vector<int32_t> slots_; // [R] each row's cache slot (block * block_size + offset)
  int64_t table_width_ = 0;
  AlignedFloats mla_f_;                  // MLA scratch
  AlignedFloats moe_f_;                  // MoE scratch
  std::vector<double> moe_d_;            // float64 router scratch
  std::vector<int32_t> moe_i_;
};

}  // namespace rlh::gen
