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
  // MoE layers (moe.cpp): router, stacked experts, shared expert (gate_proj|up adjacent)
  float* router = nullptr;      // [E, C]
  float* router_b = nullptr;    // [E]
  float* score_bias = nullptr;  // [E] selection bias (a buffer, not trained)
  float* we_gate = nullptr;     // [E, Fe, C]
  float* we_up = nullptr;       // [E, Fe, C]
  float* we_down = nullptr;     // [E, C, Fe]
  float* ws_gu = nullptr;       // [2Fs, C]: shared gate_proj [Fs, C], up [Fs, C] adjacent
  float* ws_down = nullptr;     // [C, Fs]
  float* ws_gate = nullptr;     // [1, C] Qwen2-MoE sigmoid gate of the shared expert
  // MLA layers (mla.cpp); a direct q projection (no q_lora_rank) is wqkv, [Hq*(dn+dr), C]
  float* q_a = nullptr;        // [rq, C]
  float* q_a_norm = nullptr;   // [rq]
  float* q_b = nullptr;        // [Hq*(dn+dr), rq]
  float* kv_a = nullptr;       // [rkv+dr, C]
  float* kv_a_norm = nullptr;  // [rkv]
  float* kv_b = nullptr;       // [Hq*(dn+dv), rkv]
};

struct ModelParams {
  float* embed = nullptr;       // [V, C]
  float* lm_head = nullptr;     // [V, C] (= embed when tied)
  float* final_norm = nullptr;  // [C]
  std::vector<LayerParams> layers;
};

// Shapes and settings of one layer, read once from the description.
// The layer readings both engines share (engine.hpp): heads, widths, norms, RoPE, window, scale;
// an MoE layer's sizes and routing; an MLA layer's ranks and head dims.
struct LayerShape : LayerBasics, MoeBasics, MlaBasics {
  int64_t Wqkv = 0;
  bool moe = false;        // MoE layer (F = 0: no dense MLP)
  Ops::RouterAttrs router;  // the MoeBasics routing, as the router op takes it
  int64_t route_col = 0;  // first column of this layer's choices in the routing record [N, R]
  // MLA layer (DeepSeek-V3): D = dn + dr, Hkv = Hq, Wqkv = Hq (2 D + dv): q|k|v in qkv
  bool mla = false;
};

// Saved activations of one MLA layer (mla.cpp): the latents around their norms.
struct MlaActs {
  float* qa = nullptr;        // [N, rq]  q_a_proj(xn1)
  float* qan = nullptr;       // [N, rq]  q_a_layernorm(qa)
  float* rstd_qa = nullptr;   // [N]
  float* kva = nullptr;       // [N, rkv + dr] kv_a_proj_with_mqa(xn1): latent | k_rot (unrotated)
  float* ckv = nullptr;       // [N, rkv] kv_a_layernorm(latent)
  float* rstd_kva = nullptr;  // [N]
};
struct MlaScratch {
  float* dqan = nullptr;   // [N, rq]
  float* dckv = nullptr;   // [N, rkv]
  float* dkvc = nullptr;   // [N, rkv]
  float* dkrot = nullptr;  // [N, dr]
  float* tmp = nullptr;    // [N, dr]
};

// Saved activations of one MoE layer for N tokens (moe.cpp). The router's scores are float or
// double (MoeOptions::router_fp64): exactly one of probs / probs64 (lse / lse64) is set.
struct MoeActs {
  float* probs = nullptr;    // [N, E] router scores
  double* probs64 = nullptr;
  float* lse = nullptr;      // [N] logsumexp of the router logits (z-loss)
  double* lse64 = nullptr;
  float* w = nullptr;        // [N, K] routing weights
  int32_t* experts = nullptr;  // [N, K]
  int32_t* row = nullptr;      // [N, K] expert-sorted row of each choice
  int32_t* offsets = nullptr;  // [E+1] rows of each expert
  float* xp = nullptr;       // [NK, C] permuted mlp_norm output
  float* gu = nullptr;       // [NK, 2Fe] gate|up
  float* a = nullptr;        // [NK, Fe] silu(gate) * up
  float* yp = nullptr;       // [NK, C] expert outputs
  float* sgu = nullptr;      // [N, 2Fs] shared expert gate|up
  float* sa = nullptr;       // [N, Fs]
  float* sy = nullptr;       // [N, C] shared expert output
  float* sgl = nullptr;      // [N] shared gate logit
  float* sgw = nullptr;      // [N] sigmoid(logit): its weight (and its probs, the same values)
};

// Scratch of the MoE layers (one set for all of them, forward and backward).
struct MoeScratch {
  float* logits = nullptr;   // [N, E]
  float* dw = nullptr;       // [N, K]
  float* dyp = nullptr;      // [NK, C] (also dxp)
  float* da = nullptr;       // [NK, Fe]
  float* dgu = nullptr;      // [NK, 2Fe]
  float* dlogits = nullptr;  // [N, E]
  float* dprobs = nullptr;   // [N, E]
  float* dlse = nullptr;     // [N]
  float* dsy = nullptr;      // [N, C]
  float* dsa = nullptr;      // [N, Fs]
  float* dsgu = nullptr;     // [N, 2Fs]
  float* dsgw = nullptr;     // [N]
  float* dsgl = nullptr;     // [N]
  int32_t* srow = nullptr;   // [N] identity: the shared expert as a one-choice route
  int32_t* szero = nullptr;  // [N] expert 0 of that route
  // router_fp64
  double* logits64 = nullptr;  // [N, E]
  double* w64 = nullptr;       // [N, K]
  double* x64 = nullptr;       // [N, C] the router input (or d input) in float64
  double* wr64 = nullptr;      // [E, C] router weight (or its gradient) in float64
  double* b64 = nullptr;       // [E] router / selection bias in float64
  double* dw64 = nullptr;      // [N, K]
  double* dlogits64 = nullptr; // [N, E]
  double* dprobs64 = nullptr;  // [N, E]
  double* dlse64 = nullptr;    // [N]
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

  // MoE (moe.cpp): routing width R, the record of the current forward, the replay field, the
  // auxiliary losses of the current train step, activation storage.
  int64_t route_width = 0;
  bool router64 = false;
  std::vector<int32_t> route_record;  // [N, R] when requested
  const rlh_tensor* replay = nullptr;  // [N, R] field, when replaying
  bool moe_train = false;             // inside train_step: add the auxiliary losses
  double moe_tokens = 0, moe_seqs = 0;  // their normalisers
  double moe_aux = 0, moe_z = 0, moe_max_load = 0;  // this step's values
  Buffer<float> moe_f;
  Buffer<double> moe_d;
  Buffer<int32_t> moe_i;
  std::vector<MoeActs> moe_acts;  // per layer (MoE layers only) or 1 set reused (recompute)
  MoeScratch moe_scratch;
  Buffer<float> mla_f;  // MLA (mla.cpp): saved latents per layer (or one set) and scratch
  std::vector<MlaActs> mla_acts;
  MlaScratch mla_scratch;
  bool mla_saved_all = false;
  int64_t moe_tokens_planned = -1;
  bool moe_saved_all = false;

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
  void apply_rope_to(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t H, int64_t D,
                     const MicroBatch& mb, bool backward);
  LayerActs& acts_of(int64_t l) { return layer_acts[acts_saved_all ? l : 0]; }

  // backward.cpp
  void backward(const MicroBatch& mb, const OutputRequest& req);
  void backward_layer(int64_t l, const MicroBatch& mb, LayerActs& a);

  // engine.cpp
  void optimizer_step(const StepOptions& so, double clip_coef);

  // moe.cpp
  void describe_moe_layer(const sdk::LayerDesc& ld, LayerShape& s);
  void plan_moe(int64_t N, bool save_all);
  void prepare_routing(const MicroBatch& mb, const OutputRequest& req);
  MoeActs& moe_of(int64_t l) { return moe_acts[moe_saved_all ? size_t(l) : 0]; }
  void forward_moe(int64_t l, const MicroBatch& mb, LayerActs& a, float* x_out);
  void backward_moe(int64_t l, const MicroBatch& mb, LayerActs& a);
  // mla.cpp
  void describe_mla_layer(const sdk::LayerDesc& ld, LayerShape& s);
  void plan_mla(int64_t N, bool save_all);
  MlaActs& mla_of(int64_t l) { return mla_acts[mla_saved_all ? size_t(l) : 0]; }
  void forward_mla(int64_t l, const MicroBatch& mb, LayerActs& a);
  void backward_mla(int64_t l, const MicroBatch& mb, LayerActs& a);
  template <class T>
  void moe_losses(int64_t l, const MicroBatch& mb, const MoeActs& m, const T* probs, const T* lse,
                  T* dprobs, T* dlse, bool grads);
};

}  // namespace rlh::engine
