// The model as the generator runs it: a transformer description (rlh::sdk::TransformerDesc, the
// same one the training engine executes), its weights — views of a colocated trainer's buffers
// or owned copies — and the forward of one scheduler step over the paged KV cache.
//
// The math is the engine's, op for op (sdk/engine/src/forward.cpp): pre-norm decoder layers,
//   h   = x + o_proj(attention(rope(qk_norm(qkv_proj(attn_norm(x))))))
//   out = h + down(silu(gate(mlp_norm(h))) * up(mlp_norm(h)))
// with q/k/v/o and MLP biases, per-head q/k RMSNorm (Qwen3), RoPE of any kind the description
// names, GQA, per-layer sliding windows, then logits = lm_head(final_norm(x)) (the embedding when
// tied). MoE MLPs are moe_decode.cpp (sdk/engine/src/moe.cpp's math) and DeepSeek's multi-head
// latent attention mla_decode.cpp (sdk/engine/src/mla.cpp's): its expanded per-head keys and
// values go into the paged cache, as attention with Dk != Dv. RMSNorm, RoPE, SwiGLU, bias, add and embedding are kernels_cpu's ops through the
// engine's Ops interface; the projections are linear.hpp's row-invariant product and attention
// reads the paged cache (paged_attention.hpp), the two pieces a generator needs that a trainer
// does not.
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
#include "rlhost/generator/paged_attention.hpp"
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

// Shapes and settings of one decoder layer, read once from the description.
struct LayerShape : engine::LayerBasics {  // heads, widths, norms, RoPE, window, scale
  // D: the q/k head width; Dv: the value head width (D except in MLA layers); Wqkv = Hq D +
  // Hkv (D + Dv), the width of a row of the q|k|v buffer.
  int64_t Dv = 0, Wqkv = 0;
  // MoE layer (F = 0: no dense MLP): E experts, top Kx, expert width Fe, shared-expert width Fs
  bool moe = false;
  int64_t E = 0, Kx = 0, Fe = 0, Fs = 0;
  bool shared_gate = false;
  engine::Ops::RouterAttrs router;
  // MLA layer (DeepSeek-V2/V3): q_lora_rank rq (0: q projected directly), kv_lora_rank rkv, and
  // the nope / rope parts of a q/k head (D = dn + dr); Hkv = Hq, Dv = v_head_dim.
  bool mla = false;
  int64_t rq = 0, rkv = 0, dn = 0, dr = 0;
};

// Throws sdk::Error(RLH_E_UNIMPLEMENTED) naming the layer and feature when the description needs
// what this generator does not execute (non-SiLU activations, LayerNorm),
// RLH_E_INVALID_ARGUMENT for inconsistent sizes.
std::vector<LayerShape> layer_shapes(const sdk::TransformerDesc& desc);

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

// Per-layer and global weight pointers of the set in force.
struct LayerWeights {
  const float *attn_norm = nullptr, *q = nullptr, *k = nullptr, *v = nullptr;
  const float *bq = nullptr, *bk = nullptr, *bv = nullptr, *q_norm = nullptr, *k_norm = nullptr;
  const float *o = nullptr, *bo = nullptr, *mlp_norm = nullptr, *gate = nullptr, *up = nullptr;
  const float *bgate = nullptr, *bup = nullptr, *down = nullptr, *bdown = nullptr;
  // MoE: router [E, C] (+ bias, selection bias [E]), stacked experts, shared expert and its gate
  const float *router = nullptr, *router_b = nullptr, *score_bias = nullptr;
  // Expert e's gate / up [Fe, C] and down [C, Fe]: views may lie anywhere (refit by HF name
  // with one tensor per expert), so one pointer each.
  std::vector<const float*> e_gate, e_up, e_down;
  const float *ws_gate_proj = nullptr, *ws_up = nullptr, *ws_down = nullptr, *ws_gate = nullptr;
  // MLA: q_a [rq, C], q_a_norm [rq], q_b [Hq D, rq] (or q [Hq D, C] without rq), kv_a
  // [rkv + dr, C], kv_a_norm [rkv], kv_b [Hq (dn + Dv), rkv]; o is [C, Hq Dv].
  const float *q_a = nullptr, *q_a_norm = nullptr, *q_b = nullptr;
  const float *kv_a = nullptr, *kv_a_norm = nullptr, *kv_b = nullptr;
};

class DecodeModel {
 public:
  // ops: the shared kernels (required; not owned).
  DecodeModel(sdk::TransformerDesc desc, engine::Ops* ops);

  // The MoE router in float64 (the trainer's MoeOptions::router_fp64, NeMo-RL's
  // moe_router_dtype: fp64); float32 by default. No effect on models without MoE layers.
  void set_router_fp64(bool on) { router_fp64_ = on; }
  bool router_fp64() const { return router_fp64_; }
  ~DecodeModel();

  const sdk::TransformerDesc& desc() const { return desc_; }
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
  void apply_rope(float* x, int64_t ld, int64_t H, int64_t D, std::span<const CacheRow> rows) {
    apply_rope_to(x, ld, x, ld, H, D, rows);
  }
  // y = rope(x) on H heads of D dims of every row (y may be x).
  void apply_rope_to(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t H, int64_t D,
                     std::span<const CacheRow> rows);
  // moe_decode.cpp: y [R,C] = the MoE block of layer l on xn [R,C] (no residual).
  void moe_block(int64_t l, int64_t R, const float* xn, float* y);
  // moe_decode.cpp: z [R,E] (float64) = xn [R,C] Wr^T, each element its own k-ordered sum.
  void router_logits_f64(double* z, const float* xn, const float* w, int64_t R, int64_t E);
  // mla_decode.cpp: q [R, Hq D], k [R, Hq D], v [R, Hq Dv] of layer l (rows Wqkv apart in the
  // q|k|v buffer) from xn [R,C], RoPE applied: what attention and the cache read.
  void mla_qkv(int64_t l, const float* xn, std::span<const CacheRow> rows);

  sdk::TransformerDesc desc_;
  std::vector<LayerShape> shapes_;
  int64_t V_ = 0, C_ = 0, L_ = 0;
  engine::Ops* ops_ = nullptr;
  std::unique_ptr<Weights> weights_;
  int64_t bound_serial_ = -1;  // Weights::serial() the pointers below were read at
  std::vector<LayerWeights> lw_;
  const float *embed_ = nullptr, *final_norm_ = nullptr, *lm_head_ = nullptr;

  // RoPE
  int64_t R_ = 0;
  double rope_scale_ = 1;
  bool rope_interleaved_ = false;
  int64_t rope_dynamic_from_ = 0;  // > 0: rows at positions >= this need their own table
  std::vector<float> inv_freq_;    // [R/2], the table for positions below it
  std::vector<float> row_freq_;    // [rows, R/2] per-row tables of a step (dynamic kinds)
  std::vector<uint8_t> row_own_freq_;
  std::vector<int32_t> pos_;

  // Activations of a step (grown on demand), 64-byte aligned like the weights: linear.cpp's
  // 64-byte loads each straddle two cache lines otherwise (glibc's malloc aligns to 16), which
  // measured 75-87 GFLOP/s per core instead of 108-112.
  int64_t cap_rows_ = 0, cap_samples_ = 0;
  AlignedFloats x_, xn_, qkv_, att_, h_, gu_, a_, hs_;
  AlignedFloats moe_f_;         // MoE scratch (router logits, weights, expert rows, shared expert)
  std::vector<int32_t> moe_i_;  // MoE choices, permuted rows, offsets
  std::vector<double> moe_d_;   // the float64 router's logits, scores and weights
  bool router_fp64_ = false;
  AlignedFloats mla_f_;         // MLA scratch (q latent, kv latent and its norm, kv_b's output)
};

}  // namespace rlh::gen
