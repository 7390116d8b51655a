// FP8 linears of the CUDA engine (engine.hpp's Fp8Options, NeMo-RL's megatron_cfg.fp8_cfg).
//
// A dense layer's linear step y = x W^T runs as FP8 products through the registry: the engine
// names no FP8 kernel, a vendor's provider answers quantize_fp8 and gemm on e4m3/e5m2 operands
// (examples/vendor_fp8). cuBLASLt's FP8 products read both operands K-major, so each product
// quantises its own copies:
//   forward  y[N, rows]  = X[N, K] . W[rows, K]^T        X e4m3, W e4m3
//   dX       dx[N, K]    = dY[N, rows] . (W^T)[K, rows]^T  dY e4m3 (e5m2: hybrid), W^T e4m3
//   dW       dW[rows, K] += (dY^T)[rows, N] . (X^T)[K, N]^T  both along tokens, fp32 C
// Scales are tensorwise from the current amax, or blockwise (1x128 tiles of X and dY, 128x128
// blocks of W; dW takes tiles x tiles), all on the device: no host wait.
//
// The weights' FP8 copies (W and W^T) are made once per engine call (train_step, forward) and
// reused by its micro-batches and recomputes: `new_call()` marks them stale, since the
// optimizer or a load may have changed the bf16 weights in between.
//
// Delayed scaling (Fp8Options::delayed, tensorwise): every quantisation site of the activations
// and gradients has a quantize_fp8 handle of its own, resolved at setup (add_sites), whose
// provider keeps the site's amax history on the device: a linear step's X (forward) and X^T
// (dW), and each weight group's dY (dX) and dY^T (dW). The engine names a step's input site and
// a group's gradient site by the parameter index of its first weight. Weights keep current
// scaling (one quantisation per call from the bf16 copy: its amax is exact and costs nothing to
// keep). TransformerEngine keeps one history per module for X, W and dY and transposes the FP8
// data, so X^T shares X's scale. Here, where the provider runs a site's handle with both copies
// (transpose = 2, probed at setup), X^T and dY^T are made beside X and dY with the site's one
// history; otherwise they are quantised from bf16 with histories of their own, which see the
// same amaxes as X's and dY's when each forward is followed by one backward. state() /
// load_state() are the histories, for checkpoints.
//
// A product whose shape FP8 cannot take (K, rows or tokens not multiples of 16, of 128 for
// blockwise) runs in bf16 instead; stats() counts both, so a run can show how much ran in FP8.
//
// The generator's FP8 rollouts (policy.generation.vllm_cfg.precision: fp8) use the forward
// alone: its weights' FP8 copies are made once per weight set (prepare_weight, after a load or
// refit) and the activation buffers reserved up front (reserve_input), so decoding steps
// captured as CUDA graphs keep their addresses and quantise nothing but their activations.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "rlhost/engine/engine.hpp"
#include "rlhost/engine_cuda/device_memory.hpp"
#include "rlhost/engine_cuda/device_ops.hpp"

namespace rlh::engine::cuda {

using bf16 = uint16_t;  // storage of __nv_bfloat16 (as moe_kernels.hpp)

class Fp8Linears {
 public:
  // Resolves every product the recipe runs on a small case, so a registry without an FP8
  // provider (or one that refuses this recipe) fails here, naming it, and not mid-step.
  // forward_only: only the forward product is resolved (generation); `key` names the setting
  // in the error.
  Fp8Linears(DeviceOps& ops, Counters& counters, const Fp8Options& o, int64_t layers, bool forward_only = false,
             const char* key = "policy.megatron_cfg.fp8_cfg.enabled");

  // The weights may have changed: their FP8 copies are remade at first use.
  // `train`: the call trains, so each weight's W^T is made beside W (one pass for both).
  void new_call(bool train = false) {
    ++epoch_;
    train_ = train;
  }
  // Layer l runs its dense linears in FP8 (not among the first / last kept in bf16).
  bool layer_in_fp8(int64_t l) const {
    return l >= opt_.bf16_first_layers && l < layers_ - opt_.bf16_last_layers;
  }

  // Forward of a linear step over weight groups sharing the input x [N, K]: `input` quantises x
  // once (false: the step's shape does not fit, run it in bf16), then `forward` per group of
  // `rows` output features writes y [N, rows] (ldy) in bf16. Inputs of up to weight_only_rows()
  // rows are not quantised: their products are weight-only (x in bf16, W's FP8 copy).
  // `site` (delayed scaling only, else ignored): the step's input site, as registered.
  bool input(const bf16* x, int64_t ldx, int64_t N, int64_t K, int64_t site = -1);
  bool fits_group(int64_t rows, int64_t ldy) const;
  void forward(const bf16* W, int64_t rows, bf16* y, int64_t ldy);
  // W's FP8 copy for the current call, made now (forward then launches only the product).
  void prepare_weight(const bf16* W, int64_t rows, int64_t K) { weight(W, rows, K, false); }
  // The activation buffers grown now for inputs of up to N x K (so later inputs move nothing).
  void reserve_input(int64_t N, int64_t K);
  // Generation, blockwise: the buffers (codes [N, K], 1x128 tile scales) that the next input()
  // of N x K would quantise into, for a producer that writes them itself (a provider's
  // quantize_fp8 fused into the norm or GLU that makes the input: DeviceOps::quantize_fp8_producer);
  // false where that input would not be quantised so (weight-only rows, shapes FP8 cannot take,
  // a training call, other recipes).
  bool input_buffers(int64_t N, int64_t K, void** q, float** scale);
  // The producer has written x [N, K] (row stride ldx)'s codes and scales there: the next input()
  // takes them for x as they are. Any input() or drop_produced() ends this, matched or not, so
  // the caller marks only the input its very next product reads.
  void input_produced(const bf16* x, int64_t ldx, int64_t N, int64_t K) { produced_ = {x, N, K, ldx}; }
  void drop_produced() { produced_ = {}; }
  // Generation: inputs of up to `rows` rows run weight-only products (gemm's optional form A bf16
  // x B e4m3, examples/vendor_fp8), where a provider offers it (probed by the forward-only
  // constructor); a decoding step then reads the FP8 weights and quantises no activation. Returns
  // the bound in force (0: no provider offers the form). Never in a training call.
  int64_t set_weight_only_rows(int64_t rows) { return w8_rows_ = w8_offered_ ? rows : 0; }
  int64_t weight_only_rows() const { return w8_rows_; }
  // Generation, blockwise: inputs past weight_only_rows() and up to `rows` rows that no producer
  // quantised run gemm's weight-only form with quantize_a (the provider quantises A's tiles inside
  // the product, examples/vendor_fp8), where offered (probed by the forward-only constructor):
  // the quantisation pass is saved. Returns the bound in force (0: not offered).
  int64_t set_quantize_in_product_rows(int64_t rows) { return qa_rows_ = qa_offered_ ? rows : 0; }

  // Backward of one group: dx (lddx; bf16, added with beta 1) from dy [N, rows] (lddy), and
  // dW [rows, K] (fp32, accumulated). `input_t` quantises X^T for the step's dW products once;
  // each returns false where the shape does not fit (that product then runs in bf16).
  // `site` (delayed scaling): input_t the step's input site, backward_dx / backward_dw the
  // group's gradient site.
  bool backward_dx(const bf16* dy, int64_t lddy, int64_t N, int64_t rows, int64_t K, const bf16* W, double beta,
                   bf16* dx, int64_t lddx, int64_t site = -1);
  bool input_t(const bf16* x, int64_t ldx, int64_t N, int64_t K, int64_t site = -1);
  bool backward_dw(const bf16* dy, int64_t lddy, int64_t N, int64_t rows, int64_t K, float* dW, int64_t site = -1);

  // Delayed scaling: resolves the handles of the steps' input sites and the groups' gradient
  // sites (ids >= 0, each list without repeats), once, at setup. No-op for the other recipes.
  void add_sites(const std::vector<int64_t>& inputs, const std::vector<int64_t>& groups);
  bool delayed() const { return opt_.delayed; }
  // The amax histories of every site (empty for the other recipes): a header (format, history
  // length, algorithm, margin, the site ids) and each handle's provider state. load_state
  // refuses by name another history length or another set of sites; a different algorithm or
  // margin loads (the histories are amaxes either way). Both wait for the device.
  std::string state() const;
  void load_state(const std::string& bytes);

  struct Stats {
    int64_t fp8_gemms = 0, bf16_gemms = 0;  // the products of FP8 layers, by how they ran
    int64_t weight_only = 0;                 // of fp8_gemms, the weight-only ones
    int64_t quantized_in_product = 0;        // of fp8_gemms, those whose A the product quantised
  };
  const Stats& stats() const { return stats_; }
  void count_bf16() { ++stats_.bf16_gemms; }

 private:
  // A quantised matrix: FP8 values [rows, inner] and their scales.
  struct Quantised {
    DeviceBuffer q, scale;
    int64_t rows = 0, inner = 0, nscale = 0, epoch = -1;
    const float* given = nullptr;  // the scale of the copy this one was quantised with, if any
    const float* sc() const { return given ? given : scale.get<float>(); }
  };
  // Per tensor with current scaling, a transposed copy of an operand just quantised takes that
  // operand's scale (same elements, same amax): one read of the source instead of two.
  bool reuse_scale() const { return !opt_.blockwise && !opt_.delayed; }
  int64_t scale_count(int grouping, int64_t rows, int64_t inner) const;
  // Quantises x [R, C] (or x^T) into `out`, growing its buffers when needed.
  void quantise(Quantised& out, const bf16* x, int64_t R, int64_t C, int64_t ldx, bool transpose,
                DeviceOps::Fp8 f, int grouping);
  // The same per tensor with `scale` (the copy's operand's, on the device): false where no
  // provider offers that form (the caller then quantises in full).
  bool quantise_given(Quantised& out, const bf16* x, int64_t R, int64_t C, int64_t ldx, bool transpose,
                      DeviceOps::Fp8 f, const float* scale);
  // x into `out` and x^T into `out_t` in one pass with one per-tensor scale, kept in `out` (in
  // `out_t` with scale_in_t: the copy that outlives the other), the other copy pointing at it.
  // With `op` (delayed scaling) the site's handle runs it with its history. False where the
  // provider has no such form.
  bool quantise_both(Quantised& out, Quantised& out_t, const bf16* x, int64_t R, int64_t C, int64_t ldx,
                     DeviceOps::Fp8 f, bool scale_in_t = false, const sdk::Op* op = nullptr);
  // W's copy (transposed: W^T [K, rows]) for this call.
  const Quantised& weight(const bf16* W, int64_t rows, int64_t K, bool transposed);
  bool aligned(int64_t n) const { return n % (opt_.blockwise ? 128 : 16) == 0; }
  // The token count of a product whose A runs down the tokens (the forward's X, dX's dY):
  // blockwise's per-token scales need multiples of 16 (cuBLASLt had no algorithm for 378 rows
  // on the H100, 2026-12-05); tensorwise takes any.
  bool tokens_fit(int64_t N) const { return N > 0 && (!opt_.blockwise || N % 16 == 0); }
  int act_grouping() const { return opt_.blockwise ? 1 : 0; }
  int weight_grouping() const { return opt_.blockwise ? 2 : 0; }
  DeviceOps::Fp8 grad_format() const { return opt_.hybrid ? DeviceOps::Fp8::e5m2 : DeviceOps::Fp8::e4m3; }
  // Delayed scaling: a site's two handles (X and X^T, or dY and dY^T).
  struct Site {
    sdk::Op q, qt;
  };
  Site& site(std::map<int64_t, Site>& sites, int64_t id, const char* what);
  // quantise's delayed form: through the site's handle, one scale.
  void quantise_delayed(Quantised& out, const sdk::Op& op, const bf16* x, int64_t R, int64_t C, int64_t ldx,
                        bool transpose, DeviceOps::Fp8 f);
  // An activation or gradient operand: through its site's handle (delayed), else current scaling.
  void quantise_operand(Quantised& out, std::map<int64_t, Site>& sites, int64_t id, const char* what, const bf16* x,
                        int64_t R, int64_t C, int64_t ldx, bool transpose, DeviceOps::Fp8 f);
  DeviceOps::DelayedScaling delayed_scaling() const { return {opt_.amax_history_len, opt_.amax_max, opt_.margin}; }

  DeviceOps& ops_;
  Counters& counters_;
  Fp8Options opt_;
  int64_t layers_;
  int64_t epoch_ = 0;
  Quantised x_, xt_, dy_, dyt_;
  // What dy_ holds (dY^T reuses its scale only for the same source).
  struct Src {
    const bf16* p = nullptr;
    int64_t N = 0, cols = 0, ld = 0;
    bool operator==(const Src&) const = default;
  } dy_src_, dyt_src_;  // dyt_src_: dY^T made beside dY (backward_dw then quantises nothing)
  Src produced_;         // the input whose codes a producer wrote into x_ (input_produced)
  bool autotune_ = false;  // forward products ask the provider to time its candidates (generation)
  bool train_ = false;
  // X^T made beside X in a training call's forward, per input site, for that step's dW: used
  // when the backward passes the same source (pointer, shape, stride) in the same call. Costs a
  // byte per element of each FP8 linear's input while the step runs; saves the backward's pass
  // over X (and its amax). Under pipeline schedules another micro-batch's forward may replace a
  // site's copy first: the source then differs and X^T is quantised again.
  struct KeptT {
    Quantised q;
    Src src;
    int64_t epoch = -1;
  };
  std::unordered_map<int64_t, KeptT> kept_t_;
  const Quantised* xt_use_ = &xt_;  // dW's X^T: xt_, or a kept one
  bool delayed_both_ = false;       // the provider runs a delayed-scaling handle with transpose = 2
  int64_t xN_ = 0, xK_ = 0;  // the shape `input` quantised (x_), and `input_t` (xt_)
  // A weight-only input (input() quantised nothing): x itself and its row stride.
  const bf16* xw_ = nullptr;
  int64_t xw_ld_ = 0;
  bool w8_offered_ = false;  // a provider ran the weight-only form at construction
  int64_t w8_rows_ = 0;
  bool xqa_ = false;         // the weight-only input's A is quantised in the product
  bool qa_offered_ = false;  // a provider ran the form with quantize_a at construction
  int64_t qa_rows_ = 0;
  int64_t xtN_ = 0, xtK_ = 0;
  std::unordered_map<const void*, Quantised> w_, wt_;  // by the weight's bf16 address
  std::map<int64_t, Site> in_sites_, grad_sites_;       // delayed scaling, by site id
  Stats stats_;
};

}  // namespace rlh::engine::cuda
