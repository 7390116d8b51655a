// kernels_cpu: the reference kernels of rlhost, in fp32 (and fp64 for finite-difference checks).
//
// Every op here is a plain function over typed pointers and shapes, with forward/backward pairs.
// docs/ops.md is the contract every provider implements (names, operands, attributes); this
// header is its C++ form for the CPU. Conventions shared by all ops:
//   - Row-major. N = tokens (rows), C = model width, V = vocabulary, H = heads, D = head dim.
//   - `ld*` arguments are row strides in elements (>= the row width), so an op can read q/k/v or
//     gate/up out of one fused projection output without copies.
//   - Parameter gradients (dw, db, dtable, dW) are ACCUMULATED (+=): micro-batches add up.
//     Activation gradients are WRITTEN unless the op says otherwise (an `accumulate` flag).
//   - T is float or double. The double instantiations are the float64 oracle of the
//     finite-difference tests; the engine uses float.
//   - Token ids, positions and sequence offsets are int32.
//   - Work is spread over OpenMP threads (omp_get_max_threads(); see set_num_threads). Results do
//     not depend on the thread count except where an op says so (none today: every reduction is
//     split the same way for any thread count).
//   - Invalid arguments throw std::invalid_argument; the ABI layer turns that into a status.
#pragma once

#include <cstdint>

#include "rlhost/kernels_cpu/scratch.hpp"

namespace rlh::kcpu {

// ---------------------------------------------------------------------------------------------
// Threads

// Threads every kernel uses (OpenMP team size). 0 = all cores.
void set_num_threads(int n);
int num_threads();

// ---------------------------------------------------------------------------------------------
// gemm: C = alpha * op(A) @ op(B) + beta * C
//   op(A) is [M,K]: A is [M,K] (lda >= K), or with trans_a A is [K,M] (lda >= M).
//   op(B) is [K,N]: B is [K,N] (ldb >= N), or with trans_b B is [N,K] (ldb >= K).
//   C is [M,N] (ldc >= N). beta == 0 overwrites C (NaNs in C do not propagate).
// float runs on OpenBLAS (loaded at run time, see blas.hpp) or the builtin SIMD kernel; double
// runs a blocked loop. Called inside an OpenMP parallel region it runs on the calling thread.
template <class T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// `batch` independent gemms; matrix b starts at A + b*stride_a, B + b*stride_b, C + b*stride_c.
template <class T>
void gemm_batched(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha,
                  const T* A, int64_t lda, int64_t stride_a, const T* B, int64_t ldb,
                  int64_t stride_b, T beta, T* C, int64_t ldc, int64_t stride_c, int64_t batch);

// The oracle: a triple loop accumulating in double. Slow; tests and BLAS verification only.
template <class T>
void gemm_naive(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// ---------------------------------------------------------------------------------------------
// embedding
//   fwd: out[n,:] = table[ids[n],:]                  out [N,C], table [V,C], ids [N] in [0,V)
//   bwd: dtable[ids[n],:] += dout[n,:]               dtable [V,C] accumulated
template <class T>
void embedding_fwd(T* out, const int32_t* ids, const T* table, int64_t N, int64_t C, int64_t V);
template <class T>
void embedding_bwd(T* dtable, const int32_t* ids, const T* dout, int64_t N, int64_t C, int64_t V);

// ---------------------------------------------------------------------------------------------
// rmsnorm over the last dim: y = x * rstd * (w + w_offset), rstd = 1/sqrt(mean(x^2) + eps)
//   x, y [N,C] (rows ldx / ldy apart), w [C], rstd [N] (saved for backward; may be null in fwd)
//   bwd: dx [N,C] written (accumulate: +=), dw [C] accumulated. y may be x, dx may be dy.
template <class T>
void rmsnorm_fwd(T* y, int64_t ldy, T* rstd, const T* x, int64_t ldx, const T* w, int64_t N,
                 int64_t C, T eps, T w_offset);
template <class T>
void rmsnorm_bwd(T* dx, int64_t lddx, T* dw, const T* dy, int64_t lddy, const T* x, int64_t ldx,
                 const T* w, const T* rstd, int64_t N, int64_t C, T w_offset, bool accumulate);

// ---------------------------------------------------------------------------------------------
// rope: rotate the first R dims of every head of x [N,H,D] (token rows ldx apart, heads D apart)
//   angle(n,i) = pos[n] * inv_freq[i] (i < R/2), c = cos(angle)*scale, s = sin(angle)*scale
//   half_split (HF rotate_half) pairs (i, i+R/2); interleaved (DeepSeek) pairs (2i, 2i+1):
//     y_a = x_a*c - x_b*s,  y_b = x_b*c + x_a*s.  Dims >= R are copied.
//   bwd is the transposed rotation (dx from dy). y may equal x. inv_freq [R/2] is float32 for
//   both T (HF keeps it in float32); angles are formed in double.
template <class T>
void rope_fwd(T* y, int64_t ldy, const T* x, int64_t ldx, const int32_t* pos,
              const float* inv_freq, int64_t N, int64_t H, int64_t D, int64_t R, double scale,
              bool interleaved);
template <class T>
void rope_bwd(T* dx, int64_t lddx, const T* dy, int64_t lddy, const int32_t* pos,
              const float* inv_freq, int64_t N, int64_t H, int64_t D, int64_t R, double scale,
              bool interleaved);

// ---------------------------------------------------------------------------------------------
// attention: causal softmax(scale * q k^T) v over packed sequences, GQA, optional sliding window
//   q [N,Hq,Dk] (rows ldq apart), k [N,Hkv,Dk] (ldk), v [N,Hkv,Dv] (ldv), o [N,Hq,Dv] (ldo)
//   cu_seqlens [S+1]: sequence s holds tokens cu_seqlens[s] .. cu_seqlens[s+1]-1, cu_seqlens[0]=0,
//     cu_seqlens[S] = N. Tokens never attend across sequences.
//   query head h reads kv head h / (Hq/Hkv).
//   window W > 0: query i sees keys j with i-W < j <= i (HF sliding window); 0 = no window.
//   lse [Hq,N]: log-sum-exp of each score row (saved for backward).
//   softcap c > 0 (Gemma-2's attn_logit_softcapping): each score s = scale q.k becomes
//   c tanh(s / c) before the mask and the softmax; 0 = none.
// Flash-style: keys are visited in tiles with an online softmax, so no [N,N] buffer exists; the
// backward recomputes the scores from lse. Workspace comes from `scratch`.
// bwd writes dq, dk, dv (same layouts as q, k, v).
template <class T>
void attention_fwd(T* o, int64_t ldo, T* lse, const T* q, int64_t ldq, const T* k, int64_t ldk,
                   const T* v, int64_t ldv, const int32_t* cu_seqlens, int64_t S, int64_t N,
                   int64_t Hq, int64_t Hkv, int64_t Dk, int64_t Dv, T scale, int64_t window,
                   const Scratch& scratch, T softcap = T(0));
template <class T>
void attention_bwd(T* dq, int64_t lddq, T* dk, int64_t lddk, T* dv, int64_t lddv, const T* dout,
                   int64_t lddo, const T* q, int64_t ldq, const T* k, int64_t ldk, const T* v,
                   int64_t ldv, const T* o, int64_t ldo, const T* lse, const int32_t* cu_seqlens,
                   int64_t S, int64_t N, int64_t Hq, int64_t Hkv, int64_t Dk, int64_t Dv, T scale,
                   int64_t window, const Scratch& scratch, T softcap = T(0));

// ---------------------------------------------------------------------------------------------
// swiglu: h = silu(gate) * up, silu(g) = g / (1 + exp(-g))
//   gate [N,F] (ldg), up [N,F] (ldu), h [N,F] (ldh). bwd writes dgate, dup.
template <class T>
void swiglu_fwd(T* h, int64_t ldh, const T* gate, int64_t ldg, const T* up, int64_t ldu,
                int64_t N, int64_t F);
template <class T>
void swiglu_bwd(T* dgate, int64_t lddg, T* dup, int64_t lddu, const T* dh, int64_t lddh,
                const T* gate, int64_t ldg, const T* up, int64_t ldu, int64_t N, int64_t F);

// ---------------------------------------------------------------------------------------------
// geglu: h = gelu(gate) * up, gelu in its tanh form (tanh_form) or exact (erf); layout as swiglu.
template <class T>
void geglu_fwd(T* h, int64_t ldh, const T* gate, int64_t ldg, const T* up, int64_t ldu, int64_t N,
               int64_t F, bool tanh_form);
template <class T>
void geglu_bwd(T* dgate, int64_t lddg, T* dup, int64_t lddu, const T* dh, int64_t lddh,
               const T* gate, int64_t ldg, const T* up, int64_t ldu, int64_t N, int64_t F,
               bool tanh_form);

// ---------------------------------------------------------------------------------------------
// bias and residual
//   bias_add_fwd: y[n,:] += b            y [N,M] (ldy), b [M]
//   bias_bwd:     db += sum_n dy[n,:]    db [M] accumulated
//   add_fwd:      y = a + b              [n] (y may equal a or b); its backward is the identity
template <class T>
void bias_add_fwd(T* y, int64_t ldy, const T* b, int64_t N, int64_t M);
template <class T>
void bias_bwd(T* db, const T* dy, int64_t lddy, int64_t N, int64_t M);
template <class T>
void add_fwd(T* y, const T* a, const T* b, int64_t n);

// ---------------------------------------------------------------------------------------------
// linear_logprob: per-token outputs of logits = h @ W^T without holding logits for all tokens.
//   h [N,C], W [V,C], target [N,K] (K targets per token: the next token, or the ids of a top-k
//   distillation; < 0: no target, logprob 0)
//   z = logits / temperature. With top_k > 0 and/or top_p < 1 the distribution is first
//   filtered as vLLM / NeMo-RL do (processed logprobs): keep logits >= the k-th largest, then in
//   descending order keep a token while the probability of the tokens before it is < top_p
//   (the largest is always kept); filtered logits become -inf.
//   fwd: logprob[n,k] = z[target[n,k]] - logsumexp(z) (-inf when the target was filtered out)
//        lse[n] = logsumexp(z)     (saved for backward)
//        entropy[n] = -sum p log p (optional, may be null)
//   bwd: given dlogprob [N,K] and/or dentropy [N] (null = zero), dh [N,C] is written
//        (accumulate: +=) and dW [V,C] accumulated. entropy is needed when dentropy is given.
// Logits exist only one chunk at a time: chunks of vocabulary rows (an online logsumexp across
// chunks) when no filter is set, chunks of tokens (whole rows, sorted) when one is. The chunk
// is at most `chunk_bytes` (0 = 32 MiB) from `scratch`.
// softcap c > 0 (Gemma-2's final_logit_softcapping): logits become c tanh(logits / c) before
// the temperature, filtering and softmax; 0 = none.
struct LogprobOpts {
  double temperature = 1.0;
  int64_t top_k = 0;    // 0 = off
  double top_p = 1.0;   // 1 = off
  int64_t chunk_bytes = 0;
  double softcap = 0;   // 0 = off
};
template <class T>
void linear_logprob_fwd(T* logprob, T* lse, T* entropy, const T* h, const T* W,
                        const int32_t* target, int64_t N, int64_t C, int64_t V, int64_t K,
                        const LogprobOpts& opts, const Scratch& scratch);
template <class T>
void linear_logprob_bwd(T* dh, T* dW, const T* dlogprob, const T* dentropy, const T* h,
                        const T* W, const int32_t* target, const T* lse, const T* entropy,
                        int64_t N, int64_t C, int64_t V, int64_t K, const LogprobOpts& opts,
                        bool accumulate, const Scratch& scratch);

// Scratch bytes the calls above take from their Scratch (each piece rounded up to 64 bytes, as a
// bump allocator over one workspace hands them out), for elements of `esize` bytes and at most
// `threads` threads: what a caller passes as the op's workspace so nothing is allocated per call.
size_t attention_workspace(bool backward, int64_t S, int64_t N, int64_t Hq, size_t esize, int threads,
                           bool softcap = false);
size_t linear_logprob_workspace(bool backward, int64_t N, int64_t V, int64_t K, const LogprobOpts& o,
                                bool entropy_grad, size_t esize, int threads);

// ---------------------------------------------------------------------------------------------
// Mixture of experts (router.cpp, moe_permute.cpp, grouped_gemm.cpp; docs/ops.md)
//
// moe_router: scores, top-k choice and routing weights from router logits [N,E] (rows ldl apart)
//   scoring 0: p = softmax(z) (lse [N] = logsumexp, optional); scoring 1: p = sigmoid(z)
//   experts [N,K]: the top-k of p + bias (bias [E] optional, selection only), descending, ties to
//     the lower index; n_group > 1 limits the choice to the topk_group best groups (DeepSeek-V3).
//     replay: experts are read (an earlier pass's choice), not chosen.
//   weights [N,K] = p[experts], renormalised to sum 1 with norm_topk_prob, times scaling_factor.
//   bwd: dlogits [N,E] (rows lddl apart, written) from dweights [N,K], plus dprobs [N,E] (optional:
//     a loss on p, e.g. load balancing) and dlse [N] (optional, softmax only: a loss on lse, the
//     router z-loss).
struct RouterOpts {
  int scoring = 0;  // 0 softmax, 1 sigmoid
  bool norm_topk_prob = false;
  double scaling_factor = 1.0;
  bool replay = false;
  int64_t n_group = 1, topk_group = 1;
};
template <class T>
void moe_router_fwd(T* weights, int32_t* experts, T* probs, T* lse, const T* logits, int64_t ldl,
                    const T* bias, int64_t N, int64_t E, int64_t K, const RouterOpts& opts);
template <class T>
void moe_router_bwd(T* dlogits, int64_t lddl, const T* dweights, const T* probs,
                    const int32_t* experts, const T* dprobs, const T* dlse, int64_t N, int64_t E,
                    int64_t K, const RouterOpts& opts);

// moe_permute: the N*K (token, choice) pairs in expert order (dropless). row [N,K] is the
//   permuted row of each pair; expert e owns rows offsets[e] .. offsets[e+1]-1 ([E+1]), its
//   pairs in (n, k) order. fwd: xp[row[n,k]] = x[n]  (xp [N*K,C], x [N,C]).
//   bwd: dx[n] (+)= sum_k dxp[row[n,k]]  (written, or added with accumulate).
// moe_permute_index computes row and offsets alone.
void moe_permute_index(int32_t* row, int32_t* offsets, const int32_t* experts, int64_t N,
                       int64_t K, int64_t E);
template <class T>
void moe_permute_fwd(T* xp, int64_t ldxp, int32_t* row, int32_t* offsets, const T* x, int64_t ldx,
                     const int32_t* experts, int64_t N, int64_t K, int64_t C, int64_t E);
template <class T>
void moe_permute_bwd(T* dx, int64_t lddx, const T* dxp, int64_t lddxp, const int32_t* row,
                     int64_t N, int64_t K, int64_t C, bool accumulate);
// moe_unpermute: the weighted combine y[n] (+)= sum_k weights[n,k] yp[row[n,k]].
//   bwd: dyp[row[n,k]] = weights[n,k] dy[n] (written); dweights[n,k] = <dy[n], yp[row[n,k]]>
//   (written; may be null). row must be a permutation of 0..N*K-1.
template <class T>
void moe_unpermute_fwd(T* y, int64_t ldy, const T* yp, int64_t ldyp, const int32_t* row,
                       const T* weights, int64_t N, int64_t K, int64_t C, bool accumulate);
template <class T>
void moe_unpermute_bwd(T* dyp, int64_t lddyp, T* dweights, const T* dy, int64_t lddy,
                       const T* yp, int64_t ldyp, const int32_t* row, const T* weights, int64_t N,
                       int64_t K, int64_t C);

// grouped_gemm over G groups of consecutive rows (offsets [G+1], offsets[0] = 0):
//   trans_a = false: C[r] = alpha A[r] op(B_g) + beta C[r] for rows r of group g;
//     A [T,K] (lda), B_g = B + g stride_b ([K,N], or [N,K] with trans_b; ldb), C [T,N] (ldc),
//     T = offsets[G]; M is unused.
//   trans_a = true (weight gradients): C_g = alpha A_g^T B_g + beta C_g, A [T,M], B [T,N] (rows of
//     group g), C_g = C + g stride_c [M,N]; K is unused and trans_b must be false.
template <class T>
void grouped_gemm(bool trans_a, bool trans_b, int64_t G, const int32_t* offsets, int64_t M,
                  int64_t N, int64_t K, T alpha, const T* A, int64_t lda, const T* B, int64_t ldb,
                  int64_t stride_b, T beta, T* C, int64_t ldc, int64_t stride_c);

// ---------------------------------------------------------------------------------------------
// Optimizer (float only)
//   adamw: decoupled weight decay (torch.optim.AdamW), step >= 1 for the bias correction:
//     g' = g * grad_scale;  p -= lr * wd * p;  m = b1 m + (1-b1) g';  v = b2 v + (1-b2) g'^2
//     p -= lr * (m / (1-b1^step)) / (sqrt(v / (1-b2^step)) + eps)
//   grad_scale folds global-norm clipping into the same pass; zero_grad clears g afterwards.
//   sumsq: sum of x^2 accumulated in double (global grad norm = sqrt of the sum over tensors).
//   scale: x *= s.
struct AdamWOpts {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  int64_t step = 1;
  double grad_scale = 1.0;
  bool zero_grad = false;
};
void adamw(float* p, float* g, float* m, float* v, int64_t n, const AdamWOpts& opts);
double sumsq(const float* x, int64_t n);
void scale(float* x, int64_t n, float s);

}  // namespace rlh::kcpu
