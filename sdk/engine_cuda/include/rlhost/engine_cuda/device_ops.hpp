// The CUDA engine's kernels, reached through the C ABI's kernel registry: a typed facade over
// resolved op handles for device pointers, one method per kind of call the engine (and the
// generator's CUDA executor) makes. Neither links a provider; whichever providers the registry holds for its device answer
// (kernels_cuda, kernels_cudnn for attention, a vendor's FP8 GEMMs), op by op.
//
// Every method builds DLPack-layout descriptors for its operands (on the engine's device,
// bf16 activations and weights, f32 statistics and gradients, f64 where the router runs in
// float64) and runs the op on the engine's stream. An op is resolved the first time a call of
// its kind (op name and dtypes) is made and kept: later calls cost one indirect call plus the
// descriptors. Scratch is the provider's (kernels_cuda: a stream-ordered pool that stops growing
// after the first step), so no call allocates device memory in steady state.
//
// Semantics and operand layouts are docs/ops.md's; where the engine needs more than the contract
// offers it passes optional operands the contract defines (the logprob head's logits cache,
// adamw_bf16's working copy).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <span>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "rlhost/sdk/kernels.hpp"

namespace rlh::engine::cuda {

// A tensor list of a multi-tensor op: element counts and device pointers.
struct DeviceList {
  std::vector<int64_t> n;
  std::vector<void*> p;
};

class DeviceOps {
 public:
  DeviceOps(const sdk::KernelRegistry& registry, int device, cudaStream_t stream)
      : reg_(registry), dev_(sdk::cuda_device(device)), stream_(stream) {}

  // Scratch every call gets as rlh_op_call.workspace (a provider that needs no more than this
  // takes nothing from its own pool: what a captured CUDA graph needs). Null: the provider's.
  void set_workspace(void* p, size_t bytes) {
    ws_ = p;
    ws_bytes_ = bytes;
  }
  // gemm and paged_attention resolved with batch_invariant = 1 (a generator's deterministic
  // mode): every row of C a function of its row of op(A) alone, whatever M, and every row's
  // attention of its own position and cache; a provider that does not promise it in op_info
  // falls through (docs/ops.md).
  void set_batch_invariant_gemm(bool on) { batch_invariant_ = on; }

  // C[M,N] = op(A) op(B) + beta C; A, B bf16 row-major; C bf16 or f32 (c_f32).
  void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, const void* B,
            int64_t ldb, double beta, void* C, int64_t ldc, bool c_f32);
  // Row groups by device offsets [G+1] over T rows: ta = 0: C[T,N] = A[T,K] op(B_g), B [G, K, N]
  // ([G, N, K] with tb), groups stride_b apart; ta = 1: C_g [M,N] (+)= A_g^T B_g, C groups
  // stride_c apart. bf16 A and B; C bf16 or f32.
  void grouped_gemm(bool ta, bool tb, int64_t G, int64_t T, const int32_t* offsets, int64_t M, int64_t N,
                    int64_t K, const void* A, int64_t lda, const void* B, int64_t ldb, int64_t stride_b,
                    double beta, void* C, int64_t ldc, int64_t stride_c, bool c_f32);
  // FP8 (docs/ops.md: gemm's FP8 variant and quantize_fp8, which only a vendor's provider
  // answers, e.g. examples/vendor_fp8). Grouping of the scales over the quantised matrix
  // [rows, inner]: 0 one per tensor (current amax), 1 per 1x128 tile of a row, 2 per 128x128 block.
  enum class Fp8 { e4m3, e5m2 };
  // q [rows, inner] (contiguous) = saturate(x / scale), x bf16 [R, C] (rows ldx apart), or x^T
  // with transpose (rows = C); its nscale f32 scales into `scale`.
  void quantize_fp8(const void* x, int64_t R, int64_t C, int64_t ldx, bool transpose, Fp8 f, int grouping, void* q,
                    float* scale, int64_t nscale);
  // The same per tensor with a scale already on the device (a second input: vendor_fp8's README),
  // for a copy of an operand already quantised (W^T after W, dY^T after dY: the same elements,
  // so the same amax, and no amax pass). False, and nothing queued, where no provider offers
  // that form (asked once per form).
  bool quantize_fp8_given(const void* x, int64_t R, int64_t C, int64_t ldx, bool transpose, Fp8 f, void* q,
                          const float* scale);
  // x and x^T (qt [C, R]) in one pass, per tensor from the current amax, one scale (vendor_fp8's
  // transpose = 2): false, and nothing queued, where no provider offers that form.
  bool quantize_fp8_both(const void* x, int64_t R, int64_t C, int64_t ldx, Fp8 f, void* q, void* qt, float* scale);
  // quantize_fp8 fused into the op that produces its x (vendor_fp8's `producer` form): the
  // produced [R, C] bf16 values written to y (rows ldy apart; may be null) and their codes to q
  // ([R, C], contiguous) with 1x128 tile scales (grouping 1), current scaling. False, and nothing
  // queued, where no provider offers that form (the caller runs the op, then quantises).
  //   rmsnorm      y = rmsnorm(x) with w [C], eps, offset; x rows ldx apart
  //   add_rmsnorm  sum = x + b (contiguous [R, C]; may be x or b), y = rmsnorm(sum)
  //   swiglu       y = silu(gate) up, x = gate | up [R, 2C] (rows ldx apart)
  enum class Producer { rmsnorm = 1, add_rmsnorm = 2, swiglu = 3 };
  struct Fp8Producer {
    Producer kind = Producer::rmsnorm;
    const void* x = nullptr;
    int64_t ldx = 0;
    const void* b = nullptr;
    void* sum = nullptr;
    const void* w = nullptr;
    float eps = 1e-6f, offset = 0.f;
    void* y = nullptr;
    int64_t ldy = 0;
  };
  bool quantize_fp8_producer(const Fp8Producer& p, int64_t R, int64_t C, Fp8 f, void* q, float* scale);
  // Why the registry refused that form for this producer and format ("" if it did not).
  std::string producer_refusal(Producer kind, Fp8 f) const;
  // Delayed scaling (Fp8Options::delayed): a quantize_fp8 handle of the caller's own per
  // quantisation site, resolved with recipe = 1 (per tensor) and the recipe's history length,
  // algorithm and margin, so the provider keeps that site's amax history on the device. A
  // provider whose handle is not stateful (op_info) did not run delayed scaling: refused.
  struct DelayedScaling {
    int64_t history_len = 1;
    bool max = false;  // amax_compute_algo max (false: most_recent)
    int64_t margin = 0;
  };
  sdk::Op resolve_quantize_fp8_delayed(bool transpose, Fp8 f, const DelayedScaling& d);
  // quantize_fp8's call on such a handle (its scale: one float).
  void quantize_fp8(const sdk::Op& op, const void* x, int64_t R, int64_t C, int64_t ldx, bool transpose, Fp8 f,
                    void* q, float* scale, const DelayedScaling& d);
  // The same handle asked for x and x^T (qt [C, R]) in one pass (transpose = 2 on the call), with
  // the site's one history. Throws where the provider does not run that form (Fp8Linears probes
  // it once at setup).
  void quantize_fp8_both(const sdk::Op& op, const void* x, int64_t R, int64_t C, int64_t ldx, Fp8 f, void* q,
                         void* qt, float* scale, const DelayedScaling& d);
  // A stateful handle's state as the provider writes it (state_save), and back (state_load).
  // The provider waits for the device in both: checkpoints only, never inside a step.
  static std::string op_state(const sdk::Op& op);
  static void load_op_state(const sdk::Op& op, const std::string& bytes);
  // C[M, N] (ldc; bf16, or f32 with c_f32) = (sa A)[M, K] (sb B)[N, K]^T + beta C, A and B FP8
  // K-major and contiguous; scaling 0 (tensor x tensor), 1 (1x128 tiles x 128x128 blocks) or 2
  // (tiles x tiles). fast_accum: the provider may skip promoting partial sums to fp32
  // (TransformerEngine's forward products; an attribute a provider without it ignores).
  // autotune: the provider may time its candidate kernels at a shape's first product and keep the
  // fastest (vendor_fp8's `autotune`; the generator's products, whose shapes repeat every step).
  void gemm_fp8(int64_t M, int64_t N, int64_t K, const void* A, Fp8 fa, const float* sa, int64_t na, const void* B,
                Fp8 fb, const float* sb, int64_t nb, int scaling, double beta, void* C, int64_t ldc, bool c_f32,
                bool fast_accum = false, bool autotune = false);
  // The weight-only form (an optional one): C[M, N] (bf16, ldc) = A[M, K] (bf16, lda) (sb B)[N, K]^T,
  // B e4m3 K-major and contiguous with its scales (scaling 0: one; 1: 128x128 blocks). False where
  // no provider offers it (asked once). With quantize_a (scaling 1 only), A's 1x128 tiles are
  // quantised to e4m3 inside the product, as quantize_fp8 would (examples/vendor_fp8's
  // `quantize_a`): the blockwise FP8 product without its quantisation pass.
  bool gemm_fp8_weight_only(int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, const void* B,
                            const float* sb, int64_t nb, int scaling, void* C, int64_t ldc, bool quantize_a = false);
  void embedding_fwd(void* out, const int32_t* ids, const void* table, int64_t N, int64_t C, int64_t V);
  void embedding_bwd(float* dtable, const int32_t* ids, const void* dout, int64_t N, int64_t C, int64_t V);
  // bf16 x, w, y; f32 rstd [N] (may be null)
  void rmsnorm_fwd(void* y, int64_t ldy, float* rstd, const void* x, int64_t ldx, const void* w, int64_t N,
                   int64_t C, double eps, double offset);
  // dx (+)= (accumulate), dw += (f32; may be null)
  void rmsnorm_bwd(void* dx, int64_t lddx, float* dw, const void* dy, int64_t lddy, const void* x, int64_t ldx,
                   const void* w, const float* rstd, int64_t N, int64_t C, double offset, bool accumulate);
  // H heads of D columns of x (rows ldx apart) into y (y may be x); the transposed rotation when
  // inverse.
  void rope(void* y, int64_t ldy, const void* x, int64_t ldx, const int32_t* pos, const float* inv_freq, int64_t N,
            int64_t H, int64_t D, int64_t R, double scale, bool interleaved, bool inverse);
  struct Attention {
    int64_t N = 0, S = 0, Hq = 0, Hkv = 0, Dk = 0, Dv = 0, window = 0;
    double scale = 1;
    double softcap = 0;  // Gemma-2's attn_logit_softcapping (0: none)
    const int32_t* cu = nullptr;
    const void* q = nullptr; int64_t ldq = 0;
    const void* k = nullptr; int64_t ldk = 0;
    const void* v = nullptr; int64_t ldv = 0;
    void* o = nullptr; int64_t ldo = 0;
    float* lse = nullptr;  // [Hq, N]
  };
  void attention_fwd(const Attention& a);
  void attention_bwd(const Attention& a, const void* dout, int64_t lddo, void* dq, int64_t lddq, void* dk,
                     int64_t lddk, void* dv, int64_t lddv);
  // h = act(gate) * up for gate|up side by side in gu [N, 2F] (rows ldgu apart); act "silu",
  // "gelu_tanh" or "gelu"; and its backward into dgu.
  void glu_fwd(const std::string& act, void* h, int64_t ldh, const void* gu, int64_t ldgu, int64_t N, int64_t F);
  void glu_bwd(const std::string& act, void* dgu, int64_t lddgu, const void* dh, int64_t lddh, const void* gu,
               int64_t ldgu, int64_t N, int64_t F);
  // y[N, M] += b in y's dtype (bf16, or f32 for the router's logits)
  void bias_add(bool f32, void* y, int64_t ldy, const void* b, int64_t N, int64_t M);
  void bias_bwd(bool dy_f32, float* db, const void* dy, int64_t lddy, int64_t N, int64_t M);
  void add(void* y, const void* a, const void* b, int64_t n);  // bf16
  // y = a + b, then yn = rmsnorm(y), [N, C] contiguous bf16 rows (y may be a or b), as one op
  // where a provider offers add_rmsnorm_fwd; false where none does (the caller runs add and
  // rmsnorm_fwd: the same bits).
  bool add_rmsnorm(void* y, void* yn, const void* a, const void* b, const void* w, int64_t N, int64_t C, double eps,
                   double offset);
  // h [N, F] (ldh) = act(x Wg^T) * (x Wu^T), x [N, K] (ldx), W = gate | up [2F, K] contiguous, as
  // one op where a provider offers gemm_glu_fwd (act as glu_fwd's: silu, gelu_tanh, gelu); false
  // where none does (the caller runs gemm and glu_fwd: the same bits), and under
  // set_batch_invariant_gemm (the fused op promises no batch invariance).
  bool gemm_glu(const std::string& act, void* h, int64_t ldh, const void* x, int64_t ldx, const void* W, int64_t N,
                int64_t F, int64_t K);
  // h [N, F] (ldh) = rmsnorm(x) W^T, x [N, K] and W [F, K] contiguous (act not empty: the GLU of
  // the product's halves, W = gate | up [2F, K]), as one op where a provider offers
  // rmsnorm_gemm_fwd; false where none does, and under set_batch_invariant_gemm (as gemm_glu).
  bool rmsnorm_gemm(const std::string& act, void* h, int64_t ldh, const void* x, const void* w, const void* W,
                    int64_t N, int64_t F, int64_t K, double eps, double offset);
  // y [N, M] = r + x W^T (y and r contiguous, y may be r; x [N, K] (ldx)), as one op where a
  // provider offers gemm_add_fwd; false where none does, and under set_batch_invariant_gemm.
  // round_product false: the product is added unrounded (gemm_add_fwd's round_product = 0, a
  // GEMM epilogue reading r: the training forward's residual adds).
  bool gemm_add(void* y, const void* r, const void* x, int64_t ldx, const void* W, int64_t N, int64_t M, int64_t K,
                bool round_product = true);
  void scale(void* x, int64_t n, double s);                    // bf16 x *= s, in place
  struct Logprob {
    int64_t N = 0, C = 0, V = 0;
    const void* h = nullptr;  // bf16 [N, C]
    const void* W = nullptr;  // bf16 [V, C]
    const int32_t* target = nullptr;
    double temperature = 1;
    double softcap = 0;  // Gemma-2's final_logit_softcapping (0: none)
    int64_t chunk_bytes = 0;
    float* logprob = nullptr;
    float* lse = nullptr;
    float* entropy = nullptr;  // may be null
    float* cache = nullptr;    // the logits of a training step's forward, [N, ld_cache] f32; may be null
    int64_t ld_cache = 0;
  };
  void logprob_fwd(const Logprob& a);
  // dh written (or added with accumulate), dW += (f32)
  void logprob_bwd(const Logprob& a, const float* dlogprob, const float* dentropy, void* dh, float* dW,
                   bool accumulate);
  // out[0] = sum of squares of the f32 tensors (one launch)
  void sumsq(const DeviceList& x, float* out);
  // AdamW over f32 p, g, m, v with the bf16 working copy p16 refreshed in the same pass.
  struct AdamW {
    double lr, beta1, beta2, eps, weight_decay;
    int64_t step;
    double grad_scale;
    bool zero_grad;
  };
  void adamw_bf16(const DeviceList& p, const DeviceList& g, const DeviceList& m, const DeviceList& v,
                  const DeviceList& p16, const AdamW& o);
  // MoE (docs/ops.md "Mixture of experts"): the router in f32 (f64 = false) or f64.
  struct Router {
    bool f64 = false;
    int64_t N = 0, E = 0, K = 0;
    int scoring = 0;
    bool norm_topk_prob = false;
    double scaling_factor = 1;
    bool replay = false;
    int64_t n_group = 1, topk_group = 1;
  };
  void router_fwd(const Router& r, const void* logits, int64_t ldl, const void* bias, void* weights,
                  int32_t* experts, void* probs, void* lse);
  void router_bwd(const Router& r, void* dlogits, const void* dweights, const void* probs,
                  const int32_t* experts, const void* dprobs, const void* dlse);
  void permute_fwd(void* xp, int32_t* row, int32_t* offsets, const void* x, int64_t ldx, const int32_t* experts,
                   int64_t N, int64_t K, int64_t C, int64_t E);
  void permute_bwd(void* dx, int64_t lddx, const void* dxp, const int32_t* row, int64_t N, int64_t K, int64_t C,
                   bool accumulate);
  void unpermute_fwd(void* y, int64_t ldy, const void* yp, const int32_t* row, const float* weights, int64_t N,
                     int64_t K, int64_t C, bool accumulate);
  void unpermute_bwd(void* dyp, float* dweights, const void* dy, int64_t lddy, const void* yp, const int32_t* row,
                     const float* weights, int64_t N, int64_t K, int64_t C);

  // Decoding (docs/ops.md kv_cache_write, paged_attention, sample). A layer's paged cache in
  // bf16: block b's keys at k + b block_stride, [Hkv][bs][Dk] (row-major), values at
  // v + b block_stride, [Hkv][bs][Dv]; B blocks.
  // With k_scale and v_scale (device float32 [1] each) the caches are FP8 e4m3 codes, a
  // key's value k_scale x code (vLLM's kv_cache_dtype fp8), strides in elements of one byte.
  struct PagedCache {
    void* k = nullptr;
    void* v = nullptr;
    int64_t num_blocks = 0, block_stride = 0, block_size = 0, Hkv = 0, Dk = 0, Dv = 0;
    const float* k_scale = nullptr;
    const float* v_scale = nullptr;
  };
  // Row r's keys k [R, Hkv Dk] (ldk) and values v [R, Hkv Dv] (ldv) into slot slots[r] (-1: skip).
  void kv_cache_write(const void* k, int64_t ldk, const void* v, int64_t ldv, int64_t R, const int32_t* slots,
                      const PagedCache& c);
  // y = RoPE of the Hq query heads and c.Hkv key heads of x [R, (Hq + Hkv) Dk] (ldx; y may be x),
  // then the rotated keys and v [R, Hkv Dv] (ldv) into the cache (as kv_cache_write), as one op
  // where a provider offers rope_kv_cache_write; false where none does (the caller runs rope and
  // kv_cache_write: the same bits).
  bool rope_kv_cache_write(void* y, int64_t ldy, const void* x, int64_t ldx, int64_t Hq, const void* v, int64_t ldv,
                           int64_t R, const int32_t* pos, const float* inv_freq, int64_t rot, double scale,
                           bool interleaved, const int32_t* slots, const PagedCache& c);
  // o [R, Hq Dv] (ldo) = attention of q [R, Hq Dk] (ldq) over the cache: row r's blocks at
  // table + r width, its position pos[r].
  void paged_attention(void* o, int64_t ldo, const void* q, int64_t ldq, int64_t R, int64_t Hq, const PagedCache& c,
                       const int32_t* table, int64_t width, const int32_t* pos, double scale, int64_t window,
                       double softcap = 0);
  // One dense decoder layer for ONE token (docs/ops.md decode_layer_fwd): y [1, C] = the layer
  // of x [1, C] (RMSNorm, q|k|v, RoPE, the cache write, paged attention, o, residual, RMSNorm,
  // gate|up + SwiGLU, down, residual), where a provider offers it for these sizes (resolved once,
  // with shapes); false where none does, and under set_batch_invariant_gemm (the fused op is not
  // batch-invariant): the caller runs the ops it fuses.
  struct DecodeLayer {
    const void* x = nullptr;
    void* y = nullptr;
    const void *norm1 = nullptr, *wqkv = nullptr, *wo = nullptr, *norm2 = nullptr, *wgu = nullptr, *wdown = nullptr;
    int64_t C = 0, F = 0, Hq = 0;
    double eps = 1e-6, eps2 = 1e-6, offset = 0, rope_scale = 1, scale = 1;
    PagedCache cache;  // Dk = Dv = the head dim
    const int32_t *table = nullptr, *pos = nullptr, *slots = nullptr;
    int64_t width = 0;
    const float* inv_freq = nullptr;  // [D/2]
  };
  bool decode_layer(const DecodeLayer& d);
  // One token per row of f32 logits [S, V] (ld) with the row's uniform u[s] (f64); with `given`
  // [S] no draw: each row scores its given id (an id outside [0, V): token -1, logprob 0).
  struct Sample {
    double temperature = 1;
    int64_t top_k = 0;
    double top_p = 1, min_p = 0;
    double softcap = 0;  // the logits capped first (Gemma-2's final_logit_softcapping)
  };
  void sample(int32_t* tokens, float* logprobs, const float* logits, int64_t ld, int64_t S, int64_t V, const double* u,
              const Sample& a, const int32_t* given = nullptr);

 private:
  // Descriptors of one call (their shapes and strides live here).
  class Args;
  // Resolved once per key; `shapes`: with the operands' shapes (a provider may then refuse sizes).
  const sdk::Op& op(const char* key, const char* name, const std::vector<rlh_tensor>& in,
                    const std::vector<rlh_tensor>& out, std::span<const rlh_named_value> attrs = {},
                    bool shapes = false);
  void run(const sdk::Op& o, const std::vector<rlh_tensor>& in, const std::vector<rlh_tensor>& out,
           std::span<const rlh_named_value> attrs);
  // An optional (fused) op: resolved and run, or false once no provider offers it (`none`).
  bool run_optional(const char* key, const char* name, bool& none, const std::vector<rlh_tensor>& in,
                    const std::vector<rlh_tensor>& out, std::span<const rlh_named_value> attrs,
                    bool shapes = false);

  const sdk::KernelRegistry& reg_;
  rlh_device dev_;
  cudaStream_t stream_;
  std::unordered_map<const void*, sdk::Op> ops_;  // by the call site's key (a string literal)
  std::unordered_map<const void*, std::string> refused_;  // optional forms no provider offers, by key: why
  // Resolves (once per key) and runs an optional form of an op: false where no provider answers
  // it (remembered), so the caller falls back to the general form.
  bool run_optional(const char* key, const char* name, const std::vector<rlh_tensor>& in,
                    const std::vector<rlh_tensor>& out, std::span<const rlh_named_value> attrs);
  static std::vector<rlh_tensor> both_outputs(Args& a, int64_t R, int64_t C, Fp8 f, void* q, void* qt, float* scale);
  void* ws_ = nullptr;
  size_t ws_bytes_ = 0;
  bool batch_invariant_ = false;
  bool no_add_rmsnorm_ = false;  // no provider offers it (asked once)
  bool no_gemm_glu_ = false;
  bool no_rmsnorm_gemm_ = false;
  bool no_gemm_add_ = false;
  bool no_rope_kv_ = false;
  bool no_decode_layer_ = false;
};

}  // namespace rlh::engine::cuda
