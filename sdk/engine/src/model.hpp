// Internal: the engine's state. The model's layer program (sdk/layer_program.hpp: which ops each
// layer runs, on which weights and activation columns, and how gradients flow), parameter
// storage (one allocation carved into tensors, in an order that makes fused weights such as
// q/k/v and gate/up adjacent so each group runs as one GEMM), activation storage (one allocation
// per micro-batch size: the program's values per layer, its statistics, its gradient buffers),
// and the pieces forward.cpp, backward.cpp and engine.cpp share. MoE and MLA layers are composite
// steps of the program, run by moe.cpp and mla.cpp with storage of their own.
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
#include "rlhost/sdk/layer_program.hpp"

namespace rlh::engine {

// Pointers of an MoE or MLA layer's tensors (the composite steps moe.cpp and mla.cpp run) into
// the parameter (or gradient) storage; nullptr = absent. The program's other steps name their
// weights by parameter index.
struct LayerParams {
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
  // MLA layers (mla.cpp); without q_lora_rank, q [Hq*(dn+dr), C] in wq
  float* wq = nullptr;
  float* q_a = nullptr;        // [rq, C]
  float* q_a_norm = nullptr;   // [rq]
  float* q_b = nullptr;        // [Hq*(dn+dr), rq]
  float* kv_a = nullptr;       // [rkv+dr, C]
  float* kv_a_norm = nullptr;  // [rkv]
  float* kv_b = nullptr;       // [Hq*(dn+dv), rkv]
};

// An MoE or MLA layer's sizes, read once from the description (engine.hpp's shared readings).
struct LayerShape : MoeBasics, MlaBasics {
  bool moe = false, mla = false;
  Ops::RouterAttrs router;  // the MoeBasics routing, as the router op takes it
  int64_t route_col = 0;    // first column of this layer's choices in the routing record [N, R]
  // First column of its choices in the replay field: route_col, or under PP the column in the
  // whole model's record (its chunk's PpLayout::Chunk::route_begin plus its place in the chunk).
  int64_t replay_col = 0;
  std::string act = "silu"; // the experts' activation
  // MLA: heads, q/k head dim (dn + dr), the q|k|v width, the attention's scale and window
  int64_t H = 0, D = 0, Wqkv = 0, window = 0;
  float scale = 0, softcap = 0;
  int rope = -1;            // RoPE table (-1: none)
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
  float* dqkv = nullptr;   // [N, Wqkv] d q|k|v
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

// Expert parallelism (ep_dispatch.cpp): what one MoE layer's exchange keeps for its backward.
// Rows arrive "source-major" (rank by rank, each rank's rows by local expert); the experts run
// "expert-major" (local expert by expert, each expert's rows by source rank). Sizes depend on the
// routing of every rank of the group, so the storage grows as needed.
struct EpActs {
  std::vector<int64_t> send_cnt, recv_cnt;    // [E]: rows per (rank, local expert), sent / received
  std::vector<int64_t> send_rows, recv_rows;  // [P]: rows per rank, sent / received
  std::vector<int64_t> etp_rows;              // [Te]: rows each rank of the etp group received
  std::vector<int32_t> perm;                  // [Rg] expert-major row -> source-major row
  std::vector<int32_t> loff;                  // [El + 1] expert-major rows of each local expert
  std::vector<float> xe, gu, a;               // [Rg, C], [Rg, 2Fe], [Rg, Fe]
  int64_t R = 0;                              // rows received
  int64_t Rg = 0;                             // rows the experts run on: R, or the etp group's
};
struct EpScratch {
  std::vector<float> rows, out;  // [R, C] source-major rows; [Rg, C] expert-major results
  std::vector<float> gathered;   // [Rg, C] the etp group's source-major rows (etp_size > 1)
  std::vector<float> rep;        // [Te R, C] an etp exchange's repeated or received blocks
  std::vector<int64_t> counts_out, counts_in;  // [P] float counts of an exchange
  std::vector<int64_t> etp_out, etp_in;        // [Te] likewise over the etp group
};

// One layer's activations for N tokens: the program's values (pointers into the activation
// storage; values sharing storage share the pointer) and its saved statistics (rstd, lse).
struct LayerActs {
  std::vector<float*> v;     // per LayerProgram value, N x width
  std::vector<float*> stat;  // per LayerProgram stat, rows x N
};

// A RoPE table of the program, as the rope op takes it.
struct RopeState {
  Buffer<float> inv_freq;   // [R/2] (per-sequence kinds compute theirs per sequence)
  int64_t R = 0;
  double scale = 1;
  bool interleaved = false;
  bool per_sequence = false;
  const sdk::RopeTable* table = nullptr;
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
  float* dxn = nullptr;       // [N, C] d xn (the backward)
  float* val = nullptr;       // [N] value head (output alignment: unshifted)
  float* dval = nullptr;      // [N] its gradient
};

// Context parallelism (cp_attention.cpp): one micro-batch's zigzag split over the group. Every
// rank has the same number of rows (nloc), so gathered row r * nloc + i is rank r's row i.
struct CpPlan {
  int64_t nloc = 0;
  std::vector<int32_t> ids, cu;   // this rank's micro-batch: token ids (0 at padding), [S+1]
  std::vector<int32_t> pos;       // [nloc] position in the sequence (global)
  std::vector<int32_t> target;    // [nloc] the next token (-1 at the last and at padding)
  std::vector<int32_t> seq;       // [nloc] the row's sequence
  std::vector<int32_t> src;       // [cp nloc] gathered row -> token of the whole micro-batch (-1: padding)
  std::vector<int32_t> key_row;   // per sequence, its padded positions -> gathered row
  std::vector<int64_t> key_begin; // [S+1] into key_row
  std::vector<int32_t> token;     // [nloc] this rank's row -> token of the whole micro-batch (-1: padding)
  std::vector<int64_t> seq_len;   // [S] each sequence's tokens (unpadded)
  const MicroBatch* whole = nullptr;  // the caller's micro-batch (its routing replay field)
  MicroBatch mb;                  // views of ids and cu
  int64_t whole_n() const { return whole != nullptr ? whole->num_tokens() : 0; }
};

struct Engine::Impl {
  sdk::TransformerDesc desc;
  sdk::ModelProgram prog;  // what the layers compute (sdk/layer_program.hpp)
  EngineOptions opt;
  CountingAllocator own_alloc;
  Allocator* alloc = nullptr;
  Ops* ops = nullptr;

  // Sizes (V: this rank's vocabulary rows under tensor parallelism)
  int64_t V = 0, C = 0, L = 0;
  // Tensor parallelism (tensor_parallel.hpp; tp_on when the group has several ranks): the
  // whole vocabulary and this rank's rows of it [vlo, vlo + vcount).
  bool tp_on = false;
  int64_t Vall = 0, vlo = 0, vcount = 0;
  // Pipeline parallelism (pipeline_parallel.hpp; pp_on when there are several stages): the
  // stage's boundary buffers for the current call ([N, C]; null on the first / last stage),
  // and under tensor parallelism the tp layout re-indexed to the stage's parameters (opt.tp
  // then points at it).
  bool pp_on = false;
  const float* pp_x_in = nullptr;
  const float* pp_dy = nullptr;
  float* pp_dx = nullptr;
  sdk::TpLayout tp_stage;
  // pipeline_stage.cpp: checks a stage call's boundary spans and points the buffers at them.
  void bind_stage(const MicroBatch& mb, std::span<const float> x_in, std::span<const float> dy, std::span<float> dx,
                  bool backward, int64_t chunk = 0);
  // The layers a forward / backward runs, [run_lo, run_hi), whether it starts from the embedding
  // and ends at the head: all of them (the program's ends) except in a stage call on one model
  // chunk of interleaved virtual stages (PpLayout::chunks).
  int64_t run_lo = 0, run_hi = 0;
  bool run_embed = true, run_head = true;
  void run_whole() { run_lo = 0, run_hi = L, run_embed = prog.pp_first, run_head = prog.pp_last; }
  // Per parameter, what its squares count in the gradient norm (TpPiece::norm_weight; 0 for the
  // last stage's copy of a tied embedding); empty when every weight is 1.
  std::vector<double> norm_w;
  std::vector<LayerShape> shapes;  // MoE / MLA readings per layer
  std::vector<RopeState> ropes;    // per program RoPE table

  // Parameter storage: params/grads/m/v are each one allocation; offset[i] locates desc.params[i]
  // in that flat layout. The layout is cut into units (layer l = unit l, the global tensors =
  // unit L, unit_store.hpp); pu[u] / gu[u] point at unit u's parameters / gradients: into
  // params / grads, or, with a UnitStore, what the store handed out (nullptr when not held).
  Allocator* state_alloc = nullptr;
  int64_t total = 0;
  std::vector<int64_t> offset;
  std::vector<int64_t> unit_begin;  // [L + 2]: unit u spans [unit_begin[u], unit_begin[u + 1])
  std::vector<int32_t> unit_of;     // per parameter
  std::vector<float*> pu, gu;
  UnitStore* store = nullptr;
  Buffer<float> params, grads, adam_m, adam_v;
  std::vector<LayerParams> P, G;  // MoE/MLA pointers into params and grads, per layer
  float* w(int64_t param) const {
    if (param < 0) return nullptr;
    const int32_t u = unit_of[size_t(param)];
    return pu[size_t(u)] + (offset[size_t(param)] - unit_begin[size_t(u)]);
  }
  float* g(int64_t param) const {
    if (param < 0) return nullptr;
    const int32_t u = unit_of[size_t(param)];
    return gu[size_t(u)] + (offset[size_t(param)] - unit_begin[size_t(u)]);
  }
  // Layer l's MoE/MLA pointers into its parameters (or gradients), as w() / g() give them.
  LayerParams layer_params(int64_t l, bool grads) const;
  // A unit's parameters / gradients for use (no-ops without a store, or when already held).
  void use_params(int64_t u);
  void drop_params(int64_t u);
  void use_grads(int64_t u);
  void drop_grads(int64_t u);
  void forget_units();  // after an exception: nothing is held (the store's owner resets it)
  std::vector<char> p_held, g_held;
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
  int64_t replay_width = 0;  // its R (PP: the whole model's, pp->route_total)
  bool moe_train = false;             // inside train_step: add the auxiliary losses
  double moe_tokens = 0, moe_seqs = 0;  // their normalisers
  double moe_aux = 0, moe_z = 0, moe_max_load = 0;  // this step's values
  // Under context parallelism: per MoE layer, the current micro-batch's routing counts ([E], or
  // [S, E] for seq_aux_loss) summed over the group in the forward, read again by the backward.
  std::vector<std::vector<double>> moe_counts;
  Buffer<float> moe_f;
  Buffer<double> moe_d;
  Buffer<int32_t> moe_i;
  std::vector<MoeActs> moe_acts;  // per layer (MoE layers only) or 1 set reused (recompute)
  MoeScratch moe_scratch;
  Buffer<float> mla_f;  // MLA (mla.cpp): saved latents per layer (or one set) and scratch
  std::vector<MlaActs> mla_acts;
  MlaScratch mla_scratch;
  bool mla_saved_all = false;
  bool moe_saved_all = false;

  // Expert parallelism (ep_dispatch.cpp; ep_on when the group has several ranks): the group, this
  // rank's place in it, the flat range of the expert tensors, each MoE layer's exchange state.
  bool ep_on = false;
  int64_t ep_size = 1, ep_rank = 0;
  // The experts' tensor-parallel group under moe_own_rows (EngineOptions::etp_comm): its size
  // (1: each expert whole here) and this rank's place in it.
  int64_t etp_size = 1, etp_rank = 0;
  int64_t expert_begin = 0, expert_end = 0;
  std::vector<EpActs> ep_acts;  // per layer (or set 0 reused under recompute)
  EpScratch ep_scratch;
  EpActs& ep_of(int64_t l) { return ep_acts[opt.recompute ? 0 : size_t(l)]; }
  // Layer l's routed rows xp [rows, C] (sorted by global expert, offsets [E+1]) to their experts'
  // ranks, this rank's experts over what it receives, the outputs back into yp [rows, C].
  void ep_forward(int64_t l, const int32_t* offsets, const float* xp, float* yp);
  // The backward of that: d yp -> d xp (may be the same buffer), the expert gradients added.
  void ep_backward(int64_t l, const float* dyp, float* dxp);
  // The etp group's exchanges (etp_size > 1): this rank's R received rows `mine` [R, C] to
  // every rank of the group, all of theirs into `all` [Rg, C] in group order; and the adjoint,
  // `all` [Rg, C] partial sums over the group, each rank's rows summed into `mine` [R, C].
  void etp_all_gather(const EpActs& e, const float* mine, float* all);
  void etp_reduce_scatter(const EpActs& e, const float* all, float* mine);

  // Activation storage for the current micro-batch size and mode.
  Buffer<float> acts;
  Buffer<int32_t> ints;  // positions [N], targets [N]
  int64_t acts_tokens = -1, acts_kraw = 0;
  bool acts_saved_all = false;
  std::vector<LayerActs> layer_acts;  // L sets (all saved), or none and the shared block
  float* shared_block = nullptr;      // recompute: one layer's storage, reused by every layer
  std::vector<float*> xs;             // [L+1] layer inputs, xs[L] = final residual stream
  std::vector<float*> gbuf;           // the program's gradient buffers; gbuf[0] = d residual
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
  // Runs layer l's steps; `recompute`: inside the backward, only the steps whose results the
  // backward reads (no output, no routing record, no auxiliary losses counted again).
  void forward_layer(int64_t l, const MicroBatch& mb, LayerActs& a, bool recompute);
  void forward(const MicroBatch& mb, const OutputRequest& req, bool save_all);
  // RoPE (table t) on H heads of D columns of x (rows ld apart) into y; the transposed rotation
  // when `backward`. y may be x.
  void apply_rope(int t, float* y, int64_t ldy, const float* x, int64_t ldx, int64_t H, int64_t D,
                  const MicroBatch& mb, bool backward);
  // Layer l's values and statistics (its own, or views of the shared block under recompute), its
  // input and output bound to the residual stream xs[l], xs[l+1].
  LayerActs acts_of(int64_t l);
  // h = act(gate) * up for gate|up side by side (gu [N, 2F], rows ldgu apart): swiglu for
  // "silu", geglu for "gelu_tanh" / "gelu"; and its backward into dgu.
  void glu_fwd(const std::string& act, float* h, int64_t ldh, const float* gu, int64_t ldgu, int64_t N, int64_t F);
  void glu_bwd(const std::string& act, float* dgu, int64_t lddgu, const float* dh, int64_t lddh, const float* gu,
               int64_t ldgu, int64_t N, int64_t F);
  LayerActs carve_layer(const sdk::LayerProgram& lp, float* block, int64_t N) const;

  // backward.cpp
  void backward(const MicroBatch& mb, const OutputRequest& req);
  void backward_layer(int64_t l, const MicroBatch& mb, LayerActs& a);

  // engine.cpp
  void optimizer_step(const StepOptions& so, double clip_coef);
  // The loss callback on the head's outputs of micro-batch `index` (after forward), its output
  // gradients placed for the backward. `whole` is the caller's micro-batch (not cp_prepare's copy).
  LossResult call_loss(const MicroBatch& whole, int64_t index, int64_t count, const StepOptions& so, const LossFn& loss_fn);

  // sequence_parallel.cpp: sequence parallelism (sp_on: EngineOptions::sequence_parallel under
  // tensor parallelism). This micro-batch's rows are cut in T blocks; this rank's residual-stream
  // steps run on rows [sp_begin, sp_begin + sp_rows).
  bool sp_on = false;
  int64_t sp_rows = 0, sp_begin = 0;
  // Per parameter: read by an MoE or MLA step, which runs on every row (its input gathered), so a
  // replicated one's gradient is whole on every rank, not a partial sum over the rows.
  std::vector<bool> sp_whole_rows;
  void sp_plan(int64_t N);
  // Expert parallelism with tensor parallelism (Megatron's expert_tensor_parallel_size below
  // tp, under sequence parallelism, which Megatron requires there): each MoE block routes and
  // dispatches this rank's rows only (every tp rank holds distinct tokens; the experts are whole
  // on their ep rank, or cut over an etp group that gathers its received rows: etp_size), so
  // its router's gradients are partial sums over the group and its
  // routing counts and loss values are summed over it. Only a shared expert (cut over the group
  // as a dense MLP) reads every row: the block's input is gathered for it alone.
  bool moe_own_rows = false;
  // Rows [moe_r0, moe_r0 + moe_n) of the micro-batch that the MoE block in flight routes.
  int64_t moe_r0 = 0, moe_n = 0;
  // Whether MoE layer l reads every row (its input all-gathered under sequence parallelism).
  bool moe_reads_every_row(int64_t l) const { return !moe_own_rows || shapes[size_t(l)].Fs > 0; }
  // p [N, width] contiguous: every rank's block into all rows (in place); the rows summed over the
  // group into this rank's block (in place; other rows are left as they were).
  void sp_gather(float* p, int64_t width);
  void sp_scatter(float* p, int64_t width);
  // Row pointer of this rank's block of a [N, ld] value.
  template <class T>
  T* sp_own(T* p, int64_t ld) const { return sp_on ? p + sp_begin * ld : p; }

  // cp_attention.cpp: context parallelism (cp_on when the group has several ranks)
  bool cp_on = false;
  int64_t cp = 1, cp_rank = 0;
  CpPlan cpp;
  // Builds this rank's share of `mb` (cpp) and returns its micro-batch.
  const MicroBatch& cp_prepare(const MicroBatch& mb);
  // After prepare_batch: positions and targets of the global sequences.
  void cp_positions();
  // Rows [nloc, width] (ld apart) of every rank into the whole micro-batch's [N, width] (padding dropped),
  // and back: this rank's rows of [N, width] (zero at padding).
  void cp_gather_rows(const float* local, int64_t ld, int64_t width, float* full, int64_t N);
  void cp_take_rows(const float* full, int64_t width, float* local, int64_t ld);
  // One kernel-aligned head output of one target per row as rows of the whole micro-batch: `rows`
  // itself, or under context parallelism every rank's rows gathered into `store`.
  const float* cp_whole_rows(const float* rows, int64_t N, std::vector<float>& store);
  // The routing record of this forward ([rows, route_width]) in the whole micro-batch's token order.
  std::vector<int32_t> whole_route_record(int64_t N);
  void cp_attention_fwd(const sdk::LayerStep& st, float* o, int64_t ldo, float* lse, const float* q, int64_t ldq,
                        const float* k, int64_t ldk, const float* v, int64_t ldv);
  void cp_attention_bwd(const sdk::LayerStep& st, float* dq, int64_t lddq, float* dk, int64_t lddk, float* dv,
                        int64_t lddv, const float* dout, int64_t lddo, const float* q, int64_t ldq, const float* k,
                        int64_t ldk, const float* v, int64_t ldv, const float* o, int64_t ldo, const float* lse);
  // k and v of every rank, [cp nloc, width] each, contiguous.
  void cp_gather_kv(const float* k, int64_t ldk, int64_t wk, const float* v, int64_t ldv, int64_t wv,
                    Buffer<float>& kall, Buffer<float>& vall);

  // tp_head.cpp: the vocabulary-parallel embedding and logprob head, and the gradients the
  // group shares. The head writes lp [N, K], lse [N] and ent [N] (nullable) for targets [N, K];
  // its backward adds d xn (whole, reduced) and this rank's d lm_head rows.
  void tp_embedding_fwd(float* x, const int32_t* ids, int64_t N);
  void tp_embedding_bwd(const int32_t* ids, const float* dx, int64_t N);
  void tp_head_fwd(float* lp, float* lse, float* ent, const int32_t* tg, int64_t N, int64_t K, double temperature);
  void tp_head_bwd(float* dxn, const float* dlp, const float* dent, const int32_t* tg, const float* lse,
                   const float* ent, int64_t N, int64_t K, double temperature);
  void tp_sync_grads();
  void tp_reduce(float* data, int64_t n) { opt.tp_comm->all_reduce_sum(data, n); }

  // moe.cpp: the moe step, xn [N, C] -> out [N, C]; backward: d out -> d xn (+= with accumulate)
  void describe_moe_layer(const sdk::LayerDesc& ld, const sdk::LayerStep& step, LayerShape& s);
  void plan_moe(int64_t N, bool save_all);
  void prepare_routing(const MicroBatch& mb, const OutputRequest& req);
  MoeActs& moe_of(int64_t l) { return moe_acts[moe_saved_all ? size_t(l) : 0]; }
  void forward_moe(int64_t l, const MicroBatch& mb, const float* xn, float* out, bool recompute);
  void backward_moe(int64_t l, const MicroBatch& mb, const float* xn, const float* dout, float* dxn,
                    bool accumulate);
  // mla.cpp: the mla step, xn [N, C] -> att [N, H dv] (q|k|v into qkv, lse [H, N]); backward:
  // d att -> d xn (+= with accumulate)
  void describe_mla_layer(const sdk::LayerDesc& ld, const sdk::LayerStep& step, LayerShape& s);
  void plan_mla(int64_t N, bool save_all);
  MlaActs& mla_of(int64_t l) { return mla_acts[mla_saved_all ? size_t(l) : 0]; }
  void forward_mla(int64_t l, const MicroBatch& mb, const float* xn, float* qkv, float* att, float* lse);
  void backward_mla(int64_t l, const MicroBatch& mb, const float* xn, const float* qkv, const float* att,
                    const float* lse, const float* datt, float* dxn, bool accumulate);
  template <class T>
  void moe_losses(int64_t l, const MicroBatch& mb, const MoeActs& m, const T* probs, const T* lse,
                  T* dprobs, T* dlse, bool grads);
};

}  // namespace rlh::engine
