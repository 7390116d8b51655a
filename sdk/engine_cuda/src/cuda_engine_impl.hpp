// Internal: the CUDA engine's state, shared by cuda_engine.cpp (setup, memory plan, the layer
// program's steps, head, optimizer) and moe_layer.cpp / mla_layer.cpp (the program's moe and mla
// steps). The helper types live in rlh::engine::cuda, not in an anonymous namespace, because
// CudaEngine::Impl (external linkage) holds them and several translation units see it.
//
// Dimension letters: N tokens of the micro-batch, S sequences, C hidden size, V vocabulary,
// L layers, Hq / Hkv heads, D head dim, F MLP width, R rotary dims; MoE: E experts, K choices
// per token (top_k), NK = N K routed rows, Fe expert width, Fs shared-expert width. MLA
// (mla_layer.cpp): rq / rkv the q and kv latent ranks, dn / dr / dv the nope, rope and value head
// dims (D = dn + dr), W = H (2 D + dv) the width of the q|k|v it writes.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "rlhost/engine_cuda/device_memory.hpp"
#include "rlhost/engine_cuda/device_ops.hpp"
#include "rlhost/engine_cuda/fp8_linear.hpp"
#include "mla_kernels.hpp"
#include "moe_kernels.hpp"
#include "tp_kernels.hpp"
#include "rlhost/engine_cuda/cuda_engine.hpp"
#include "rlhost/sdk/layer_program.hpp"

namespace rlh::engine {

namespace cuda {

[[noreturn]] inline void unsupported(const std::string& what) {
  throw std::invalid_argument("cuda engine: " + what + " is not supported on the GPU path yet");
}

inline int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// An MoE or MLA layer's readings (engine.hpp's shared ones) for the composite steps.
struct LayerShape : MoeBasics, MlaBasics {
  bool moe = false, mla = false;
  int64_t route_col = 0;   // first column of this layer's choices in the routing record [N, R]
  std::string act = "silu";  // the experts' activation
  // MLA: heads, q/k head dim (dn + dr), the width of its q|k|v, attention scale and window,
  // RoPE table (-1: none)
  int64_t H = 0, D = 0, Wqkv = 0, window = 0;
  double scale = 0, softcap = 0;
  int rope = -1;
};

// Where one description tensor lives in the flat buffers: `pieces` runs of `piece` elements,
// `stride` apart, from `off`. One run for every tensor but the routed experts' gate and up,
// which are interleaved per expert (expert e's gate rows, then its up rows: one [2 Fe, C]
// matrix per expert, experts 2 Fe C apart) so one grouped GEMM computes gate|up.
struct ParamPlace {
  int64_t off = -1, pieces = 1, piece = 0, stride = 0;
};

// Element offsets of an MoE or MLA layer's tensors in the flat parameter (and gradient)
// buffers; -1 absent. (The program's other steps name their weights by parameter index.)
struct LayerOffsets {
  // MoE: router [E, C] (+ bias [E]), selection bias [E] (a buffer), experts' gate|up
  // [E, 2 Fe, C] (interleaved, see ParamPlace), down [E, C, Fe], shared expert gate_proj|up
  // [2 Fs, C], down [C, Fs], its sigmoid gate [1, C]
  int64_t router = -1, router_b = -1, score_bias = -1, we_gu = -1, we_down = -1, ws_gu = -1,
          ws_down = -1, ws_gate = -1;
  // MLA: q_a [rq, C], q_a_norm [rq], q_b [H D, rq] (or q [H D, C] without a q latent),
  // kv_a [rkv + dr, C], kv_a_norm [rkv], kv_b [H (dn + dv), rkv]
  int64_t wq = -1, q_a = -1, q_a_norm = -1, q_b = -1, kv_a = -1, kv_a_norm = -1, kv_b = -1;
};

// One layer's activations for N tokens: the program's values (bf16; values sharing storage share
// the pointer) and its saved statistics (f32 rstd, lse).
struct LayerActs {
  std::vector<bf16*> v;
  std::vector<float*> stat;
};

// What an MoE layer keeps from its forward for its backward (one set per MoE layer in
// training, one shared set otherwise). The router's scores are fp32 or fp64
// (MoeOptions::router_fp64): exactly one of probs / probs64 (lse / lse64) is set.
struct MoeActs {
  float* probs = nullptr;      // [N, E] router scores
  double* probs64 = nullptr;
  float* lse = nullptr;        // [N] logsumexp of the router logits (z-loss)
  double* lse64 = nullptr;
  float* w = nullptr;          // [NK] routing weights (fp32 also with the fp64 router)
  int32_t* experts = nullptr;  // [NK]
  int32_t* row = nullptr;      // [NK] expert-sorted row of each choice
  int32_t* offsets = nullptr;  // [E+1] rows of each expert, on the device only
  bf16* xp = nullptr;          // [NK, C] permuted mlp_norm output
  bf16* gu = nullptr;          // [NK, 2Fe] gate|up
  bf16* a = nullptr;           // [NK, Fe] silu(gate) * up
  bf16* yp = nullptr;          // [NK, C] expert outputs
  bf16* sgu = nullptr;         // [N, 2Fs] shared expert gate|up
  bf16* sa = nullptr;          // [N, Fs]
  bf16* sy = nullptr;          // [N, C] shared expert output
  float* sgl = nullptr;        // [N] shared gate logit
  float* sgw = nullptr;        // [N] sigmoid(logit): its weight (and its score)
};

// What an MLA layer keeps from its forward for its backward (one set per MLA layer in training
// without full recompute, one shared set otherwise). Selective recompute keeps them too: the
// latents are GEMM outputs and their norms, 2 rq + 2 rkv + dr values a token, small beside q|k|v.
struct MlaActs {
  bf16* qa = nullptr;         // [N, rq] q_a(xn1)
  bf16* qan = nullptr;        // [N, rq] q_a_norm(qa)
  float* rstd_qa = nullptr;   // [N]
  bf16* kva = nullptr;        // [N, rkv + dr] kv_a(xn1): latent | k_rope (not rotated)
  bf16* ckv = nullptr;        // [N, rkv] kv_a_norm(latent)
  float* rstd_kva = nullptr;  // [N]
};

// Scratch of the MLA layers (one set for all of them).
struct MlaScratch {
  bf16* dqkv = nullptr;  // [N, W] d q|k|v (backward)
  bf16* kv = nullptr;    // [N, H (dn + dv)] kv_b's product (forward), d of it (backward)
  bf16* krot = nullptr;  // [N, dr] the rotated shared key (forward)
  bf16* dkva = nullptr;  // [N, rkv + dr] d kva: d latent | d k_rope
  bf16* dckv = nullptr;  // [N, rkv]
  bf16* dqan = nullptr;  // [N, rq]
  bf16* dqa = nullptr;   // [N, rq]
};

// Scratch of the MoE layers (one set for all of them, forward and backward).
struct MoeScratch {
  float* logits = nullptr;     // [N, E]
  double* logits64 = nullptr;
  double* w64 = nullptr;       // [NK] fp64 router's weights before they become fp32
  double* bias64 = nullptr;    // [E] the selection bias in fp64
  float* dw = nullptr;         // [NK]
  double* dw64 = nullptr;
  bf16* dyp = nullptr;         // [NK, C] (also dxp)
  bf16* da = nullptr;          // [NK, Fe]
  bf16* dgu = nullptr;         // [NK, 2Fe]
  float* dlogits = nullptr;    // [N, E]
  double* dlogits64 = nullptr;
  bf16* dlogits16 = nullptr;   // [N, E] the bf16 operand of the router's backward GEMMs
  float* dprobs = nullptr;     // [N, E]
  double* dprobs64 = nullptr;
  float* dlse = nullptr;       // [N]
  double* dlse64 = nullptr;
  bf16* dsy = nullptr;         // [N, C]
  bf16* dsa = nullptr;         // [N, Fs]
  bf16* dsgu = nullptr;        // [N, 2Fs]
  float* sprob = nullptr;      // [N] the shared gate's score output (= its weight; unused)
  float* dsgw = nullptr;       // [N]
  float* dsgl = nullptr;       // [N]
  bf16* dsgl16 = nullptr;      // [N]
  int32_t* srow = nullptr;     // [N] identity: the shared expert as a one-choice route
  int32_t* szero = nullptr;    // [N] expert 0 of that route
};

// Runs a collective, adding its bytes and its time to a group's counters.
template <class F>
void timed_into(int64_t& bytes_so_far, double& seconds_so_far, int64_t bytes, F&& call) {
  const auto t0 = std::chrono::steady_clock::now();
  call();
  seconds_so_far += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  bytes_so_far += bytes;
}

// Carves 256-byte aligned pieces out of one block; with a null base it only measures.
struct Carver {
  char* base;
  size_t at = 0;
  template <class T>
  T* take(int64_t n) {
    at = (at + 255) & ~size_t(255);
    T* p = base ? reinterpret_cast<T*>(base + at) : nullptr;
    at += size_t(n) * sizeof(T);
    return p;
  }
};

}  // namespace cuda

struct CudaEngine::Impl {
  using bf16 = cuda::bf16;
  using LayerShape = cuda::LayerShape;
  using LayerOffsets = cuda::LayerOffsets;
  using LayerActs = cuda::LayerActs;

  sdk::TransformerDesc desc;
  sdk::ModelProgram prog;  // what the layers compute (sdk/layer_program.hpp)
  CudaEngineOptions opt;
  int64_t C = 0, V = 0, L = 0;
  std::vector<LayerShape> shapes;  // MoE / MLA readings per layer
  // MoE: the largest of each dimension over the MoE layers (0 without any)
  int64_t maxE = 0, maxK = 0, maxFe = 0, maxFs = 0, moe_layers = 0;
  int64_t route_width = 0;  // R: the sum of top_k over the MoE layers

  // Parameters
  std::vector<cuda::ParamPlace> place;  // per desc param
  std::vector<LayerOffsets> lo;         // MoE / MLA layers' tensors
  int64_t total = 0;

  cuda::Counters counters;
  cudaStream_t stream = nullptr;
  std::unique_ptr<cuda::DeviceOps> ops;  // the registry's kernels on this device and stream
  std::unique_ptr<cuda::Fp8Linears> fp8;  // CudaEngineOptions::fp8 (null: every linear in bf16)
  // The deterministic mode (CudaEngineOptions::batch_invariant; deterministic.cpp): the ops with
  // gemm and paged_attention resolved batch-invariant, swapped into `ops` for a forward-only
  // call (det_on), this call's cache slots and block tables (int32: slots [N], table [N,
  // det_width]), one layer's paged cache of the call's keys and values, and the head's scratch
  // (a logits tile f32, its tokens, zero uniforms).
  std::unique_ptr<cuda::DeviceOps> invariant_ops;
  cuda::DeviceOps* det_ops = nullptr;  // the invariant ops during such a call (in `ops` or not)
  bool det_on = false;
  int64_t det_width = 0, det_blocks = 0;
  std::vector<int32_t> det_host;
  cuda::DeviceBuffer det_index, det_kv, det_head_buf;
  void det_prepare(const MicroBatch& mb);
  void det_attention(const cuda::DeviceOps::Attention& at);
  void det_head(const OutputRequest& req, int64_t N);
  // An attention step's forward: the registry's fused kernel, or det_attention under det_on.
  void attention_forward(const cuda::DeviceOps::Attention& at) {
    if (det_on && opt.invariant_parts.attention)
      det_attention(at);
    else
      ops->attention_fwd(at);
  }
  cuda::DeviceBuffer op_workspace;  // every op call's scratch (set with FP8: its provider's GEMMs ask 32 MiB)
  cuda::DeviceBuffer master, grads, adam_m, adam_v, w16, scalars;
  // RoPE tables (f32 inv_freq on the device), per program table.
  struct Rope {
    cuda::DeviceBuffer inv_freq;
    int64_t R = 0;
    double scale = 1;
    bool interleaved = false;
  };
  std::vector<Rope> ropes;
  bool grads_clear = true;
  int64_t steps = 0;
  // Gradient overwrite (grad_overwrite_ok: one GPU, no sharding, offload or tensor
  // parallelism). AdamW then leaves the summed gradients as they are (grads_stale) instead of
  // clearing them, 4 bytes a parameter written for nothing: the next step's first product of each
  // linear weight's gradient overwrites it (beta 0, so it does not read the stale values either),
  // and every other gradient (norms, biases, the head and embedding, MoE, MLA, FP8 layers, which
  // only accumulate) is cleared at the step's start. grad_fresh marks, per parameter, a gradient
  // not yet written this step; one a backward never reached is cleared before the norm reads it.
  bool grads_stale = false;
  std::vector<char> grad_fresh;
  std::vector<int64_t> overwritten;  // the linear weights whose first product overwrites
  std::vector<std::pair<int64_t, int64_t>> cleared;  // [off, elements) of the rest, merged
  bool grad_overwrite_ok() const;
  void clear_grads();  // the whole summed-gradient buffer zeroed (zero_grad)
  void plan_overwrite();
  void begin_overwrite_step();
  void end_overwrite_backward();
  // beta of the weight-gradient product of weights [i, j) of a linear step (adjacent, one
  // product): 0 for its first write of the step in overwrite mode, else 1.
  double dw_beta(const sdk::LayerStep& st, size_t i, size_t j);

  // Tensor parallelism (tensor_parallel.cpp; CudaEngineOptions::tp): this rank's vocabulary rows
  // [vlo, vlo + vcount) of Vall; in the activation block (plan) an fp32 scratch tp32 [N, tp_width]
  // for the partial sums reduced over the group, the head's local targets [N], its statistics
  // (this rank's [3, N], the group's [T, 3, N]) and its backward's logits tile (f32) and their
  // gradient (bf16), tp_rows rows tp_ld apart each.
  bool tp_on = false;
  int64_t tp_size = 1, Vall = 0, vlo = 0, vcount = 0, tp_width = 0, tp_rows = 0, tp_ld = 0;
  float* tp32 = nullptr;
  int32_t* tp_target = nullptr;
  float *tp_mine = nullptr, *tp_all = nullptr, *tp_tile = nullptr;
  bf16* tp_dtile = nullptr;
  void tp_check();  // before the program: what tensor parallelism refuses, desc = tp->local
  void tp_check_program();  // after it: the marks, MoE / MLA refused, the scratch width
  void carve_tp(cuda::Carver& c, int64_t N, bool train);
  // The group's sum of an fp32 buffer (on the stream), its ring bytes and time counted.
  void tp_sum(float* x, int64_t n) {
    tp_timed(2 * n * 4 * (tp_size - 1) / tp_size, [&] { opt.tp_comm->all_reduce_sum(x, n, stream); });
  }
  int64_t tp_bytes = 0;  // the tp group's traffic so far (ring bytes sent per rank) and time in it
  double tp_seconds = 0;
  template <class F>
  void tp_timed(int64_t bytes, F&& call) {
    cuda::timed_into(tp_bytes, tp_seconds, bytes, call);
  }
  void tp_embedding_fwd(int64_t N);   // xs[0] from ids
  void tp_embedding_bwd(const bf16* dres, int64_t N);
  void tp_head_fwd(const OutputRequest& req, int64_t N);  // lp, lse, ent (the group's)
  void tp_head_bwd(const OutputRequest& req, int64_t N);  // dxn from dlp / dent, the head's dW
  void tp_sync_grads();  // after the micro-batches: the q/k norms' gradients summed

  // Data parallelism (data_parallel.cpp; CudaEngineOptions::dp). With the sharded optimizer the
  // flat buffers are padded to S blocks of `block` elements; this rank's block is
  // [shard_lo, shard_lo + block) and adam_m / adam_v / gshard hold only it.
  int dp_size = 1, dp_rank = 0;
  int64_t block = 0, shard_lo = 0;
  cuda::DeviceBuffer gshard;  // this rank's block of the summed gradients
  int64_t dp_bytes = 0;
  double dp_seconds = 0;
  bool sharded() const { return opt.dp != nullptr && opt.shard_optimizer; }
  // FSDP (CudaEngineOptions::shard_masters): ZeRO-3. The flat storage is cut into units (unit
  // l < L: layer l's tensors; unit L: the global ones, embedding, final norm, head), each padded
  // to dp_size blocks of its own `block` elements; rank r keeps block r of every unit at `at`
  // of its local buffers (masters, moments, summed gradients and the bf16 weights alike). A unit's
  // bf16 weights are all-gathered into a staging slot before it runs and its gradients
  // reduce-scattered out of one after its backward (data_parallel.cpp).
  bool fsdp() const { return sharded() && opt.shard_masters && opt.trainable; }
  struct Unit {
    int64_t begin = 0, block = 0, at = 0;  // flat [begin, begin + dp_size block); local [at, at + block)
  };
  std::vector<Unit> units;
  std::vector<std::vector<size_t>> unit_params;  // the parameters stored in each unit
  // bf16 weights (wstage) and fp32 gradients (gstage) of the gathered units: the root's slot
  // first, then two layer slots (layer l in slot l % 2); `gred` one reduce-scattered block before
  // it is added to gshard. gstage is also the scratch through which whole units move between the
  // host and the blocks.
  cuda::DeviceBuffer wstage, gstage, gred;
  int64_t layer_slot_elems = 0;
  int64_t gathered[2] = {-1, -1};  // the layer whose weights each slot holds (or is gathering)
  int64_t grad_in[2] = {-1, -1};   // the layer whose gradients each slot holds
  int64_t pending_rs = -1;         // the layer whose reduce-scatter is issued after the next backward
  bool held_global = false, grad_global = false;
  // The collectives run on their own stream (CudaEngineOptions::fsdp_comm_stream; else on the
  // compute stream, in the same order), ordered with the compute stream by events per slot:
  // gathered (ready), no longer read (free), gradients written (gdone), gradients reduced
  // (rsdone); the root's gather; a mark on either stream (compute, comm).
  cudaStream_t cstream = nullptr;
  cudaEvent_t ev_ready[2] = {}, ev_free[2] = {}, ev_gdone[2] = {}, ev_rsdone[2] = {}, ev_root = nullptr,
              ev_compute = nullptr, ev_comm = nullptr;
  cudaStream_t comm_stream() const { return cstream != nullptr ? cstream : stream; }
  size_t unit_of(int64_t off) const {
    const auto it = std::upper_bound(units.begin(), units.end(), off,
                                     [](int64_t o, const Unit& u) { return o < u.begin; });
    return size_t(it - units.begin()) - 1;
  }
  int64_t slot_of(size_t u) const {
    return int64_t(u) == L ? 0 : units[size_t(L)].block * dp_size + int64_t(u % 2) * layer_slot_elems;
  }
  // Flat [lo, lo + block) of unit u that this rank keeps.
  int64_t mine_lo(size_t u) const { return units[u].begin + int64_t(dp_rank) * units[u].block; }
  void plan_units();  // the stages and each unit's parameters (carve_params)
  // Unit u's bf16 blocks all-gathered into `slot` on the collectives' stream, after event
  // `after` (the slot's last reader; null: none), `done` recorded when it is there.
  void gather_unit(size_t u, bf16* slot, cudaEvent_t after, cudaEvent_t done);
  // The pipeline around the layers (data_parallel.cpp), the same calls on every rank, idle
  // passes included: the root held for the call; each layer's weights held before its forward
  // and the next layer's gather started after it; before a layer's backward its weights and a
  // zeroed gradient slot, after it the previous layer's gradients reduced and the next
  // (l - 1) gathered; the last reduction after the micro-batch's backward.
  void hold_global();
  void prefetch_layer(int64_t l);
  void hold_layer(int64_t l);
  void layer_forward_end(int64_t l);
  void layer_backward_begin(int64_t l);
  void layer_backward_end(int64_t l);
  void backward_units_end();
  void reduce_layer(int64_t l);  // its gradients summed over the group, added into gshard's block
  void open_root_grads();        // the root's zeroed gradient slot, for the step
  void reduce_root_grads();      // ... summed over the group at the step's end
  // Forgets what the slots hold (weights change between calls) and orders the compute stream
  // after every collective issued so far. `loud` false (the calls' scope guards, which run while
  // an exception unwinds): a CUDA error is left for the next call to report, not thrown.
  void release_units(bool loud = true);
  // The collectives of one micro-batch without data (a rank with fewer micro-batches than its
  // peers): every unit gathered, and in training every layer's zero gradients reduced.
  void idle_microbatch(bool train);
  // The most micro-batches any rank of the group runs (one small all-gather and a host wait;
  // for callers that do not give StepOptions::group_microbatches).
  int64_t group_count(int64_t mine);
  cuda::DeviceBuffer counts;  // [dp_size] floats for group_count
  // Unit u of a local buffer (fp32 blocks: masters, moments, gradients; device or host) whole
  // in gstage; and this rank's block of gstage's whole unit into a local buffer.
  float* stage_unit(size_t u, const float* local);
  void keep_block(size_t u, float* local);
  // FSDP or offload: the fp32 tensors the MoE router reads from the masters (mf), whole, in
  // `kept32`: flat range [off, off + n) at `at` in it.
  struct Kept {
    int64_t off, n, at;
  };
  std::vector<Kept> kept;
  cuda::DeviceBuffer kept32;
  int64_t kept_elems = 0;
  void plan_kept();
  // kept32 from a flat fp32 layout holding flat element `origin` first (load_parameters'
  // staging: the whole storage, or one FSDP unit, whose kept ranges alone are copied), or from
  // every rank's blocks of the masters (after an FSDP update: each rank writes its part, one
  // all-reduce sums).
  void kept_from_whole(const float* whole, int64_t origin = 0, int64_t end = -1);
  void kept_from_blocks();

  // This rank's pieces of the storage ranges (sharded: clipped to its block; `local` is the
  // offset in the block's buffers; otherwise every range, local = off).
  struct Piece {
    int64_t flat, local, n;
    size_t param;
  };
  std::vector<Piece> optimizer_pieces() const;
  // After the backward: the gradients summed over the group (DDP: in place; distributed
  // optimizer: this rank's block into gshard, the full buffer cleared; FSDP: the global unit's,
  // the layers' were reduced after their backward; HSDP: then over the replicas).
  void sync_gradients();
  // After the sharded update: every rank's block of the masters and their bf16 copy (FSDP: only
  // the router's side copy; the weights are gathered unit by unit when used).
  void gather_weights();
  // The distributed optimizer's moments (this rank's block) <-> full flat layout, through the
  // (clear) gradient buffer.
  void gather_moment(const float* shard);
  void scatter_moment(float* shard);
  // CPU offload (CudaEngineOptions::offload_state; offload.cpp): the masters and moments in
  // page-locked host memory (`master`, `adam_m`, `adam_v` then stay empty), streamed through
  // `ostage` (3 x ostage_elems floats) by the update.
  cuda::PinnedBuffer h_master, h_adam_m, h_adam_v;
  cuda::DeviceBuffer ostage;
  int64_t ostage_elems = 0;
  bool offload() const { return opt.offload_state && opt.trainable; }
  // The masters are not whole on the device (FSDP's block, or offloaded): what the forward
  // reads from them comes from the side copy `kept32`.
  bool masters_apart() const { return fsdp() || offload(); }
  // This rank's fp32 masters and moments, wherever they live (device, or page-locked host):
  // copies to and from them use cudaMemcpyDefault.
  float* master32() const { return offload() ? h_master.get<float>() : master.get<float>(); }
  float* moment_m() const { return offload() ? h_adam_m.get<float>() : adam_m.get<float>(); }
  float* moment_v() const { return offload() ? h_adam_v.get<float>() : adam_v.get<float>(); }
  size_t master_bytes() const { return offload() ? h_master.size() : master.size(); }
  void carve_offload(size_t master_bytes, size_t moment_bytes);
  // One offloaded rank's whole masters into the (clear) gradient buffer.
  void stage_masters_whole();
  // AdamW over the pieces' parts within [lo, hi) of this rank's local range, the masters and
  // moments at P0 / M0 / V0 holding local element `origin` first (the device buffers: 0; a
  // staged chunk: its start).
  void adamw_pieces(const std::vector<Piece>& pieces, float* P0, float* M0, float* V0, int64_t origin, int64_t lo,
                    int64_t hi, const StepOptions& so, double clip);
  void offloaded_update(const std::vector<Piece>& pieces, const StepOptions& so, double clip);
  // Runs a collective, counting its bytes (ring traffic per rank) and time into stats().
  template <class F>
  void dp_timed(int64_t bytes, F&& call) {
    cuda::timed_into(dp_bytes, dp_seconds, bytes, call);
  }

  // Activations (one block, carved by plan()).
  cuda::DeviceBuffer act_block;
  cuda::PinnedBuffer pinned;
  int64_t planned_tokens = 0;
  bool planned_train = false;
  // Per-layer sets (training without full recompute) or none (forward only, full recompute:
  // every layer carves its view of `shared` when it runs). Selective recompute keeps the
  // recomputable values (norm and activation outputs) in `rebuilt`, one layer at a time.
  std::vector<LayerActs> acts;
  bool acts_per_layer = false;
  char* shared = nullptr;
  char* rebuilt = nullptr;
  std::vector<cuda::MoeActs> moe_acts;  // per layer (set for MoE layers) or 1 shared set
  cuda::MoeScratch moe_x;
  std::vector<cuda::MlaActs> mla_acts;  // per layer (set for MLA layers) or 1 shared set
  cuda::MlaScratch mla_x;
  // MLA: the largest of each dimension over the MLA layers (0 without any)
  int64_t mla_layers = 0, maxRq = 0, maxRkv = 0, maxDr = 0, maxKvb = 0, maxMlaW = 0;
  std::vector<bf16*> xs;  // residual stream: L+1 (training) or 2 (forward only, in turn)
  std::vector<bf16*> gbuf;  // the program's gradient buffers (training); gbuf[0] = d residual
  // head_norm steps whose input is a slice of a wider value: its rows packed contiguous (the
  // norm then runs as one launch over N x heads rows), and the input gradient before it is
  // copied into its slice.
  bf16* pack = nullptr;
  bf16* dpack = nullptr;
  float* head_cache = nullptr;  // training: the head's fp32 logits [N, ld_head_cache], or null
  int64_t ld_head_cache = 0;
  bf16 *xn = nullptr, *dxn = nullptr;  // head: final norm output [N, C] and its gradient
  float *rstd = nullptr, *lp = nullptr, *lse = nullptr, *ent = nullptr, *dlp = nullptr,
        *dent = nullptr;
  float *val = nullptr, *dval = nullptr;  // the value head's output and its gradient [N]
  bf16* dval16 = nullptr;                 // the gradient as the backward GEMMs' bf16 operand
  int32_t *ids = nullptr, *pos = nullptr, *target = nullptr, *cu = nullptr;
  // pinned staging: ids, pos, target, cu (int32 [N] x3, [N+1]); lp, ent, dlp, dent (f32 [N] x4)
  int32_t *h_ids = nullptr, *h_pos = nullptr, *h_target = nullptr, *h_cu = nullptr;
  float *h_lp = nullptr, *h_ent = nullptr, *h_dlp = nullptr, *h_dent = nullptr, *h_scalar = nullptr;
  float *h_val = nullptr, *h_dval = nullptr;  // the value head's (f32 [N] x2)

  // MoE auxiliary losses of the current train step (moe_layer.cpp): counted on the device in
  // moe_stats() (aux, z, max load; read with the gradient norm, so no extra host wait).
  bool moe_train = false;
  double moe_tokens = 1, moe_seqs = 1;
  // Routing record / replay (OutputRequest::routed_experts / replay_routing_field): [N, R]
  // int32 on the device (each MoE layer copies its choices in, or its replayed choices out)
  // and its pinned staging.
  int32_t* route = nullptr;
  int32_t* h_route = nullptr;
  bool replay_active = false, record_active = false;
  // A loss on the device (train_step's DeviceLoss): token-aligned logprob and gradient [N] each,
  // the loss scalar, the kept slots and the step's uploaded inputs, in one block grown only
  // when a step needs more (so the steady state allocates nothing), and their pinned staging.
  cuda::DeviceBuffer loss_block;
  cuda::PinnedBuffer loss_pinned;
  int32_t* batch_stage = nullptr;  // set: prepare_batch stages this micro-batch here (loss_pinned)
  void prepare_routing(const MicroBatch& mb, const OutputRequest& req);  // moe_layer.cpp

  Impl(sdk::TransformerDesc d, CudaEngineOptions o);
  ~Impl();
  void describe();
  void describe_moe_layer(const sdk::LayerDesc& ld, const sdk::LayerStep& st, LayerShape& s);  // moe_layer.cpp
  void describe_mla_layer(const sdk::LayerDesc& ld, const sdk::LayerStep& st, LayerShape& s);  // mla_layer.cpp
  void carve_params();
  std::vector<int64_t> fp8_sites(bool groups) const;  // delayed scaling's sites (cuda_engine.cpp)
  void plan(int64_t N, bool train);
  // The MoE / MLA parts of the plan: measure with a null base, like Carver.
  void carve_moe(cuda::Carver& c, int64_t N, bool per_layer, bool train);
  void carve_mla(cuda::Carver& c, int64_t N, bool per_layer, bool train);  // mla_layer.cpp
  // Layer l's values and statistics for N tokens (its own set, or its view of the shared block;
  // the recomputable values in `rebuilt` under selective recompute), input and output bound
  // to the residual stream.
  LayerActs acts_of(int64_t l);
  void require_trainable(const char* what) const {
    if (!opt.trainable)
      throw std::invalid_argument(std::string("cuda engine: ") + what +
                                  ": the engine was created untrainable (no gradients or optimizer state)");
  }
  void sync() {
    cuda::check(cudaStreamSynchronize(stream), "stream synchronize");
    ++counters.syncs;
  }

  // Weights: bf16 working copy (w), fp32 master (mf) and gradient (g) of a flat offset, or of a
  // description parameter (wp, gp). Under FSDP they point into the staging slots of the units
  // held now (a read of another unit is a bug in the holding order: it throws).
  bf16* w(int64_t off) const {
    if (off < 0) return nullptr;
    if (!fsdp()) return master_bf16() + off;
    const size_t u = unit_of(off);
    if (!(int64_t(u) == L ? held_global : gathered[u % 2] == int64_t(u)))
      throw std::logic_error("cuda engine: weights of unit " + std::to_string(u) + " read but not gathered (FSDP)");
    return wstage.get<bf16>() + slot_of(u) + (off - units[u].begin);
  }
  bf16* master_bf16() const { return w16.get<bf16>(); }
  float* mf(int64_t off) const {
    if (off < 0) return nullptr;
    if (!masters_apart()) return master.get<float>() + off;
    for (const Kept& k : kept)
      if (off >= k.off && off < k.off + k.n) return kept32.get<float>() + k.at + (off - k.off);
    throw std::logic_error("cuda engine: fp32 master at " + std::to_string(off) +
                           " read but not kept on the device (FSDP or offload)");
  }
  float* g(int64_t off) const {
    if (off < 0) return nullptr;
    if (!fsdp()) return grads.get<float>() + off;
    const size_t u = unit_of(off);
    if (!(int64_t(u) == L ? grad_global : grad_in[u % 2] == int64_t(u)))
      throw std::logic_error("cuda engine: gradients of unit " + std::to_string(u) + " written but not open (FSDP)");
    return gstage.get<float>() + slot_of(u) + (off - units[u].begin);
  }
  bf16* wp(int64_t param) const { return param < 0 ? nullptr : w(place[size_t(param)].off); }
  float* gp(int64_t param) const { return param < 0 ? nullptr : g(place[size_t(param)].off); }
  double* moe_stats() const { return reinterpret_cast<double*>(scalars.get<char>() + 64); }
  bool router_frozen(sdk::ParamRole r) const {
    return opt.moe.freeze_router &&
           (r == sdk::ParamRole::router || r == sdk::ParamRole::router_bias);
  }
  // Storage ranges the optimizer and the gradient norm walk: one per tensor, except the
  // interleaved expert gate|up, one range for both (param index of the gate).
  struct Range {
    int64_t off, n;
    size_t param;
  };
  std::vector<Range> storage_ranges() const;
  // Parameter i between host memory and a flat fp32 layout at `base` holding flat element
  // `origin` first (a whole buffer: 0; a staged unit: its begin).
  void upload(size_t i, float* base, const float* src, int64_t origin = 0);
  void download_one(size_t i, const float* base, float* dst, int64_t origin = 0);

  void prepare_batch(const MicroBatch& mb);
  // RoPE table t on H heads of D columns of x into y (y may be x); transposed when inverse.
  void rope(int t, bf16* y, int64_t ldy, const bf16* x, int64_t ldx, int64_t H, int64_t D, int64_t N,
            bool inverse);
  // dst[r, 0:cols] = src[r, 0:cols] for r < rows (bf16, leading dimensions in elements): a
  // strided block copy on the stream.
  void copy_cols(bf16* dst, int64_t ldd, const bf16* src, int64_t lds, int64_t rows, int64_t cols) {
    if (rows == 0 || cols == 0) return;
    cuda::check(cudaMemcpy2DAsync(dst, size_t(ldd) * sizeof(bf16), src, size_t(lds) * sizeof(bf16),
                            size_t(cols) * sizeof(bf16), size_t(rows), cudaMemcpyDeviceToDevice, stream),
          "strided copy");
  }
  void check_request(const OutputRequest& req) const;  // what forward refuses of a request alone
  void forward(const MicroBatch& mb, const OutputRequest& req, bool train);
  // The layer's steps in order. `recompute`: inside the backward, rebuild what it reads (no
  // output, no routing record, auxiliary losses not counted again); `only_cheap`: just the
  // recomputable steps (selective recompute).
  void forward_layer(int64_t l, const MicroBatch& mb, LayerActs& a, bool recompute, bool only_cheap = false);
  bool residual_product(int64_t l, size_t i) const;  // steps i, i + 1: a linear and its residual add as one op
  void run_step(int64_t l, const sdk::LayerStep& st, const MicroBatch& mb, LayerActs& a, bool recompute);
  void backward(const MicroBatch& mb, const OutputRequest& req);
  void backward_layer(int64_t l, const MicroBatch& mb, LayerActs& a);
  // moe_layer.cpp: the moe step (xn [N, C] -> out [N, C]) and its backward (d out -> d xn, added
  // with accumulate).
  cuda::MoeActs& moe_of(int64_t l) { return moe_acts[acts_per_layer ? size_t(l) : 0]; }
  void forward_moe(int64_t l, const MicroBatch& mb, const bf16* xn, bf16* out, bool recompute);
  void backward_moe(int64_t l, const MicroBatch& mb, const bf16* xn, const bf16* dout, bf16* dxn, bool accumulate);
  // mla_layer.cpp: the mla step (xn [N, C] -> att [N, H dv], q|k|v into qkv [N, W], lse [H, N])
  // and its backward (d att -> d xn, added with accumulate).
  cuda::MlaActs& mla_of(int64_t l) { return mla_acts[acts_per_layer ? size_t(l) : 0]; }
  void forward_mla(int64_t l, const MicroBatch& mb, const bf16* xn, bf16* qkv, bf16* att, float* lse);
  void backward_mla(int64_t l, const MicroBatch& mb, const bf16* xn, const bf16* qkv, const bf16* att,
                    const float* lse, const bf16* datt, bf16* dxn, bool accumulate);
  // The attention op's operands of an MLA layer (q|k|v heads in qkv, att, lse).
  cuda::DeviceOps::Attention mla_attention(const LayerShape& s, int64_t N, int64_t S, const bf16* qkv,
                                           const bf16* att, const float* lse) const;
  cuda::MoeLossArgs moe_loss_args(int64_t l, const MicroBatch& mb, const cuda::MoeActs& m) const;
  cuda::DeviceOps::Logprob head_args(const OutputRequest& req, int64_t N, bool cache) const;
  double grad_norm();
  void optimizer_step(const StepOptions& so, double clip);
  std::vector<std::vector<float>> download(const float* base);
  // FSDP: every parameter of a local fp32 buffer (this rank's blocks), gathered unit by unit.
  std::vector<std::vector<float>> download_units(const float* local);
};

}  // namespace rlh::engine
