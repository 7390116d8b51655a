// Internal: the engine's state. Parameter storage (one allocation carved into tensors, in an
// order that makes q/k/v and gate/up adjacent so each pair runs as one GEMM), activation storage
// (one allocation per micro-batch size, carved per layer), and the pieces forward.cpp,
// backward.cpp and engine.cpp share.
//
// Dimension letters (llm.c style): N tokens of the micro-batch, S sequences, C hidden size,
// V vocabulary, L layers, Hq / Hkv query / key-value heads, D head dim, F MLP width,
// Wqkv = (Hq + 2 Hkv) D the fused q|k|v width, R rotary dims.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "rlhost/engine/engine.hpp"

namespace rlh::engine {

// Pointers of one decoder layer into the parameter (or gradient) storage; nullptr = absent.
struct LayerParams {
  float* attn_norm = nullptr;  // [C]
  float* wqkv = nullptr;       // [Wqkv, C]: q [Hq*D, C], k [Hkv*D, C], v [Hkv*D, C] adjacent
  float* bq = nullptr;         // [Hq*D]
  float* bk = nullptr;         // [Hkv*D]
  float* bv = nullptr;         // [Hkv*D]
  float* q_norm = nullptr;     // [D]
  float* k_norm = nullptr;     // [D]
  float* wo = nullptr;         // [C, Hq*D]
  float* bo = nullptr;         // [C]
  float* mlp_norm = nullptr;   // [C]
  float* wgu = nullptr;        // [2F, C]: gate [F, C], up [F, C] adjacent
  float* bgate = nullptr;      // [F]
  float* bup = nullptr;        // [F]
  float* wdown = nullptr;      // [C, F]
  float* bdown = nullptr;      // [C]
};

struct ModelParams {
  float* embed = nullptr;       // [V, C]
  float* lm_head = nullptr;     // [V, C] (= embed when tied)
  float* final_norm = nullptr;  // [C]
  std::vector<LayerParams> layers;
};

// Shapes and settings of one layer, read once from the description.
struct LayerShape {
  int64_t Hq, Hkv, D, Wqkv, F;
  float eps_attn, off_attn, eps_mlp, off_mlp;  // norms: eps and weight offset
  bool qk_norm;
  bool use_rope;
  int64_t window;
  float scale;  // softmax scale
};

// Activations of one layer for N tokens (pointers into the activation storage). `x` is the
// layer input (residual stream); the layer writes its output into the next layer's x.
struct LayerActs {
  float* x = nullptr;      // [N, C]
  float* xn1 = nullptr;    // [N, C]   attn_norm(x)
  float* rstd1 = nullptr;  // [N]
  float* qkv = nullptr;    // [N, Wqkv] q|k|v after bias; q, k roped in place unless qk_norm
  float* qk = nullptr;     // [N, (Hq+Hkv) D] normed + roped q|k (qk_norm only)
  float* rstd_q = nullptr; // [Hq, N] (qk_norm only)
  float* rstd_k = nullptr; // [Hkv, N]
  float* att = nullptr;    // [N, Hq*D]  attention output
  float* lse = nullptr;    // [Hq, N]
  float* h = nullptr;      // [N, C]   x + o_proj(att)
  float* xn2 = nullptr;    // [N, C]   mlp_norm(h)
  float* rstd2 = nullptr;  // [N]
  float* gu = nullptr;     // [N, 2F]  gate|up
  float* a = nullptr;      // [N, F]   silu(gate) * up
};

// Gradient scratch shared by all layers in the backward.
struct GradActs {
  float* dres = nullptr;   // [N, C] d loss / d residual stream
  float* dxn = nullptr;    // [N, C]
  float* dqkv = nullptr;   // [N, Wqkv]
  float* datt = nullptr;   // [N, Hq*D]
  float* dgu = nullptr;    // [N, 2F]
  float* da = nullptr;     // [N, F]
};

// The head: final norm and the per-token outputs in kernel alignment (row t predicts t+1).
// The raw pass has kraw targets per row: the next token, then the K ids of logprob_at_ids.
struct HeadActs {
  int64_t kraw = 1;
  float* x = nullptr;         // [N, C] final residual stream (= x of layer L)
  float* xn = nullptr;        // [N, C]
  float* rstd = nullptr;      // [N]
  float* lp = nullptr;        // [N, kraw] raw logprobs of the targets
  float* lse = nullptr;       // [N]
  float* ent = nullptr;       // [N]
  float* lp_proc = nullptr;   // [N] processed logprob of the next token
  float* lse_proc = nullptr;  // [N]
  float* dlp = nullptr;       // [N, kraw] output gradients in kernel alignment
  float* dent = nullptr;      // [N]
  float* dlp_proc = nullptr;  // [N]
};

struct Engine::Impl {
  sdk::TransformerDesc desc;
  EngineOptions opt;
  CountingAllocator own_alloc;
  Allocator* alloc = nullptr;
  std::unique_ptr<Ops> own_ops;
  Ops* ops = nullptr;

  // Sizes
  int64_t V = 0, C = 0, L = 0;
  std::vector<LayerShape> shapes;
  int64_t R = 0;          // rotary dims
  double rope_scale = 1;  // attention scaling on cos/sin
  bool rope_interleaved = false;
  bool rope_per_sequence = false;  // dynamic / longrope: inv_freq depends on the sequence length
  Buffer<float> inv_freq;          // [R/2] for the other kinds

  // Parameter storage: params/grads/m/v are each one allocation; offset[i] locates desc.params[i].
  int64_t total = 0;
  std::vector<int64_t> offset;
  Buffer<float> params, grads, adam_m, adam_v;
  ModelParams P, G;  // pointers into params and grads
  int64_t steps = 0;
  // Storage in runs of adjacent tensors that the optimizer treats alike (trainable, decayed), so
  // the norm and AdamW run as a few long calls instead of one per tensor.
  struct Run {
    int64_t begin, end;
    bool trainable, decay;
  };
  std::vector<Run> runs;
  bool grads_clear = true;  // grads are all zero (AdamW clears them in its pass)

  // Activation storage for the current micro-batch size and mode.
  Buffer<float> acts;
  Buffer<int32_t> ints;  // positions [N], targets [N]
  int64_t acts_tokens = -1, acts_kraw = 0;
  bool acts_saved_all = false;
  std::vector<LayerActs> layer_acts;  // L sets (all saved) or 1 set reused (recompute)
  std::vector<float*> xs;             // [L+1] layer inputs, xs[L] = final residual stream
  GradActs grad_acts;
  HeadActs head;
  int32_t* pos = nullptr;         // [N] position within the sequence
  int32_t* target = nullptr;      // [N] next token (-1 at the end of a sequence)
  int32_t* target_raw = nullptr;  // [N, kraw] next token, then the ids (= target when kraw = 1)

  Impl(sdk::TransformerDesc d, EngineOptions o);
  void carve_params();
  void plan_acts(int64_t N, bool save_all, int64_t kraw);
  int64_t ids_per_token(const MicroBatch& mb, const OutputRequest& req) const;
  void prepare_batch(const MicroBatch& mb, const OutputRequest& req);

  // forward.cpp
  void forward_layer(int64_t l, const MicroBatch& mb, LayerActs& a, float* x_out);
  void forward(const MicroBatch& mb, const OutputRequest& req, bool save_all);
  void apply_rope(float* x, int64_t ld, int64_t H, int64_t D, const MicroBatch& mb, bool backward);
  LayerActs& acts_of(int64_t l) { return layer_acts[acts_saved_all ? l : 0]; }

  // backward.cpp
  void backward(const MicroBatch& mb, const OutputRequest& req);
  void backward_layer(int64_t l, const MicroBatch& mb, LayerActs& a);

  // engine.cpp
  void optimizer_step(const StepOptions& so, double clip_coef);
};

// Output alignment: kernel row t (predicting token t+1) <-> output position t+1; the first
// position of each sequence is 0. `width` columns are moved, from/to rows ld apart.
void shift_to_outputs(const float* kernel, int64_t ldk, float* out, int64_t ldo, int64_t width,
                      std::span<const int32_t> cu);
void shift_to_kernel(const float* out, int64_t ldo, float* kernel, int64_t ldk, int64_t width,
                     std::span<const int32_t> cu);

}  // namespace rlh::engine
