// The kernels the CPU engine runs, as a typed interface over host float pointers. The engine
// never calls a provider directly: make_registry_ops resolves every op once through a kernel
// registry of the C ABI (the providers that run on the CPU, kernels_cpu the reference last).
//
// Semantics, operand shapes and accumulation rules are those of docs/ops.md (the same op names),
// restricted to float32 host pointers with row strides. Workspace comes from the Allocator given
// at construction.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "rlhost/engine/allocator.hpp"

namespace rlh::sdk {
class KernelRegistry;
}

namespace rlh::engine {

struct LogprobAttrs {
  double temperature = 1.0;
  int64_t top_k = 0;   // 0 = off
  double top_p = 1.0;  // 1 = off
  int64_t chunk_bytes = 0;
  double softcap = 0;  // Gemma-2's final_logit_softcapping; 0 = off
};

class Ops {
 public:
  virtual ~Ops() = default;
  virtual std::string name() const = 0;

  // C[M,N] = alpha op(A) op(B) + beta C
  virtual void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                    int64_t ldc) = 0;
  virtual void embedding_fwd(float* out, const int32_t* ids, const float* table, int64_t N,
                             int64_t C, int64_t V) = 0;
  virtual void embedding_bwd(float* dtable, const int32_t* ids, const float* dout, int64_t N,
                             int64_t C, int64_t V) = 0;
  virtual void rmsnorm_fwd(float* y, int64_t ldy, float* rstd, const float* x, int64_t ldx,
                           const float* w, int64_t N, int64_t C, float eps, float w_offset) = 0;
  virtual void rmsnorm_bwd(float* dx, int64_t lddx, float* dw, const float* dy, int64_t lddy,
                           const float* x, int64_t ldx, const float* w, const float* rstd,
                           int64_t N, int64_t C, float w_offset, bool accumulate) = 0;
  virtual void rope_fwd(float* y, int64_t ldy, const float* x, int64_t ldx, const int32_t* pos,
                        const float* inv_freq, int64_t N, int64_t H, int64_t D, int64_t R,
                        double scale, bool interleaved) = 0;
  virtual void rope_bwd(float* dx, int64_t lddx, const float* dy, int64_t lddy,
                        const int32_t* pos, const float* inv_freq, int64_t N, int64_t H,
                        int64_t D, int64_t R, double scale, bool interleaved) = 0;
  // softcap > 0 (Gemma-2's attn_logit_softcapping): scores become softcap tanh(score / softcap).
  virtual void attention_fwd(float* o, int64_t ldo, float* lse, const float* q, int64_t ldq,
                             const float* k, int64_t ldk, const float* v, int64_t ldv,
                             const int32_t* cu_seqlens, int64_t S, int64_t N, int64_t Hq,
                             int64_t Hkv, int64_t Dk, int64_t Dv, float scale,
                             int64_t window, float softcap) = 0;
  virtual void attention_bwd(float* dq, int64_t lddq, float* dk, int64_t lddk, float* dv,
                             int64_t lddv, const float* dout, int64_t lddo, const float* q,
                             int64_t ldq, const float* k, int64_t ldk, const float* v,
                             int64_t ldv, const float* o, int64_t ldo, const float* lse,
                             const int32_t* cu_seqlens, int64_t S, int64_t N, int64_t Hq,
                             int64_t Hkv, int64_t Dk, int64_t Dv, float scale,
                             int64_t window, float softcap) = 0;
  virtual void swiglu_fwd(float* h, int64_t ldh, const float* gate, int64_t ldg, const float* up,
                          int64_t ldu, int64_t N, int64_t F) = 0;
  virtual void swiglu_bwd(float* dgate, int64_t lddg, float* dup, int64_t lddu, const float* dh,
                          int64_t lddh, const float* gate, int64_t ldg, const float* up,
                          int64_t ldu, int64_t N, int64_t F) = 0;
  // GeGLU (Gemma): h = gelu(gate) * up, gelu in its tanh form (`tanh`) or exact (erf).
  virtual void geglu_fwd(float* h, int64_t ldh, const float* gate, int64_t ldg, const float* up,
                         int64_t ldu, int64_t N, int64_t F, bool tanh) = 0;
  virtual void geglu_bwd(float* dgate, int64_t lddg, float* dup, int64_t lddu, const float* dh,
                         int64_t lddh, const float* gate, int64_t ldg, const float* up,
                         int64_t ldu, int64_t N, int64_t F, bool tanh) = 0;
  // x[0:n] *= s
  virtual void scale(float* x, int64_t n, double s) = 0;
  virtual void bias_add_fwd(float* y, int64_t ldy, const float* b, int64_t N, int64_t M) = 0;
  virtual void bias_bwd(float* db, const float* dy, int64_t lddy, int64_t N, int64_t M) = 0;
  virtual void add_fwd(float* y, const float* a, const float* b, int64_t n) = 0;
  // target and logprob [N, K] (K targets per token)
  virtual void linear_logprob_fwd(float* logprob, float* lse, float* entropy, const float* h,
                                  const float* W, const int32_t* target, int64_t N, int64_t C,
                                  int64_t V, int64_t K, const LogprobAttrs& attrs) = 0;
  virtual void linear_logprob_bwd(float* dh, float* dW, const float* dlogprob,
                                  const float* dentropy, const float* h, const float* W,
                                  const int32_t* target, const float* lse, const float* entropy,
                                  int64_t N, int64_t C, int64_t V, int64_t K,
                                  const LogprobAttrs& attrs, bool accumulate) = 0;
  struct AdamW {
    double lr, beta1, beta2, eps, weight_decay;
    int64_t step;
    double grad_scale;
    bool zero_grad;
  };
  virtual void adamw(float* p, float* g, float* m, float* v, int64_t n, const AdamW& o) = 0;
  virtual double sumsq(const float* x, int64_t n) = 0;

  // Mixture of experts (docs/ops.md: moe_router_*, moe_permute_*, moe_unpermute_*,
  // grouped_gemm). The router also comes in float64 with a float64 gemm (NeMo-RL's
  // moe_router_dtype: fp64).
  struct RouterAttrs {
    int scoring = 0;  // 0 softmax, 1 sigmoid
    bool norm_topk_prob = false;
    double scaling_factor = 1.0;
    bool replay = false;  // experts are read (routing replay), not chosen
    int64_t n_group = 1, topk_group = 1;
  };
  // logits [N,E] (ldl), bias [E] (selection only, may be null) -> weights, experts [N,K],
  // probs [N,E], lse [N] (may be null)
  virtual void moe_router_fwd(float* weights, int32_t* experts, float* probs, float* lse,
                              const float* logits, int64_t ldl, const float* bias, int64_t N,
                              int64_t E, int64_t K, const RouterAttrs& a) = 0;
  virtual void moe_router_fwd_f64(double* weights, int32_t* experts, double* probs, double* lse,
                                  const double* logits, int64_t ldl, const double* bias,
                                  int64_t N, int64_t E, int64_t K, const RouterAttrs& a) = 0;
  // dlogits [N,E] (written) from dweights [N,K], probs, experts; dprobs [N,E] and dlse [N] may be
  // null
  virtual void moe_router_bwd(float* dlogits, const float* dweights, const float* probs,
                              const int32_t* experts, const float* dprobs, const float* dlse,
                              int64_t N, int64_t E, int64_t K, const RouterAttrs& a) = 0;
  virtual void moe_router_bwd_f64(double* dlogits, const double* dweights, const double* probs,
                                  const int32_t* experts, const double* dprobs,
                                  const double* dlse, int64_t N, int64_t E, int64_t K,
                                  const RouterAttrs& a) = 0;
  virtual void gemm_f64(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                        const double* A, int64_t lda, const double* B, int64_t ldb, double beta,
                        double* C, int64_t ldc) = 0;
  // x [N,C] (ldx) -> xp [N*K,C] (contiguous), row [N,K], offsets [E+1]
  virtual void moe_permute_fwd(float* xp, int32_t* row, int32_t* offsets, const float* x,
                               int64_t ldx, const int32_t* experts, int64_t N, int64_t K,
                               int64_t C, int64_t E) = 0;
  // dx [N,C] (lddx) (+)= sum_k dxp[row[n,k]]
  virtual void moe_permute_bwd(float* dx, int64_t lddx, const float* dxp, const int32_t* row,
                               int64_t N, int64_t K, int64_t C, bool accumulate) = 0;
  // y [N,C] (ldy) (+)= sum_k weights[n,k] yp[row[n,k]]
  virtual void moe_unpermute_fwd(float* y, int64_t ldy, const float* yp, const int32_t* row,
                                 const float* weights, int64_t N, int64_t K, int64_t C,
                                 bool accumulate) = 0;
  // dyp [N*K,C], dweights [N,K] (may be null) from dy [N,C] (lddy)
  virtual void moe_unpermute_bwd(float* dyp, float* dweights, const float* dy, int64_t lddy,
                                 const float* yp, const int32_t* row, const float* weights,
                                 int64_t N, int64_t K, int64_t C) = 0;
  // Decoding (the generator). gemm_rows: y[M,N] = x[M,K] W[N,K]^T with every row of y a function
  // of its own row of x alone, bitwise, whatever M (gemm with batch_invariant = 1; docs/ops.md),
  // in float32 and float64.
  virtual void gemm_rows(float* y, int64_t ldy, const float* x, int64_t ldx, const float* W, int64_t ldw,
                         int64_t M, int64_t N, int64_t K) = 0;
  virtual void gemm_rows_f64(double* y, int64_t ldy, const double* x, int64_t ldx, const double* W,
                             int64_t ldw, int64_t M, int64_t N, int64_t K) = 0;
  // paged_attention: o [R, Hq Dv] (ldo) of q [R, Hq Dk] (ldq) over the paged KV cache of one
  // layer: keys of block b at k_cache + b block_stride, [Hkv][Dk][bs] (transposed), values at
  // v_cache + b block_stride, [Hkv][bs][Dv]; B blocks; row r's block table at
  // blocks + r table_width, its position pos[r].
  // An FP8 cache (k8, v8 instead of k, v; the same layout and strides in elements of one byte)
  // holds e4m3 codes: a key's value is k_scale x its code, a value's v_scale x its code
  // (vLLM's kv_cache_dtype fp8).
  struct PagedCache {
    float* k = nullptr;
    float* v = nullptr;
    int64_t num_blocks = 0, block_stride = 0, block_size = 0, Hkv = 0, Dk = 0, Dv = 0;
    uint8_t* k8 = nullptr;
    uint8_t* v8 = nullptr;
    float k_scale = 1, v_scale = 1;
  };
  // kv_cache_write: row r's keys k [R, Hkv Dk] (ldk) and values v [R, Hkv Dv] (ldv) into slot
  // slots[r] = block * block_size + offset of the cache (-1: skip the row).
  virtual void kv_cache_write(const float* k, int64_t ldk, const float* v, int64_t ldv, int64_t R,
                              const int32_t* slots, const PagedCache& cache) = 0;
  virtual void paged_attention(float* o, int64_t ldo, const float* q, int64_t ldq, int64_t R, int64_t Hq,
                               const PagedCache& cache, const int32_t* blocks, int64_t table_width,
                               const int32_t* pos, float scale, int64_t window, float softcap) = 0;
  // sample: one token per row of logits [S, V] (ld) with the row's uniform u[s] (docs/ops.md).
  struct SampleAttrs {
    double temperature = 1.0;  // 0 = greedy
    int64_t top_k = 0;
    double top_p = 1.0;
    double min_p = 0.0;
    double softcap = 0.0;  // Gemma-2's final_logit_softcapping; 0 = off
  };
  virtual void sample(int32_t* tokens, float* logprobs, const float* logits, int64_t ld, int64_t S, int64_t V,
                      const double* u, const SampleAttrs& a) = 0;

  // kernels.hpp grouped_gemm: row groups (ta = false, B + g stride_b per group) or the weight
  // gradient form (ta = true, C + g stride_c per group)
  virtual void grouped_gemm(bool ta, bool tb, int64_t G, const int32_t* offsets, int64_t M,
                            int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                            const float* B, int64_t ldb, int64_t stride_b, float beta, float* C,
                            int64_t ldc, int64_t stride_c) = 0;
};

// Wraps `inner`, timing every call by op name (wall clock); profiling_report() prints the table
// (empty for Ops not made here), profiling_reset() clears it.
std::unique_ptr<Ops> make_profiling_ops(Ops& inner);
std::string profiling_report(const Ops& ops);
void profiling_reset(Ops& ops);

// Every op resolved once through a kernel registry of the C ABI (per op, the first provider that
// answers wins, or the one policy.kernels pins; `only` restricts to one provider). Kernel
// workspace: where the provider sizes it (the ABI's workspace_size), one block from `workspace`
// (the engine's Allocator, which then counts it), grown to the largest need and kept; otherwise,
// or with `workspace` null, the provider's own (kernels_cpu: the host's allocator). Throws when
// an op has no provider. The registry (and the allocator) must outlive the Ops.
std::unique_ptr<Ops> make_registry_ops(const sdk::KernelRegistry& registry, Allocator* workspace = nullptr,
                                       const std::string& only = {});

}  // namespace rlh::engine
