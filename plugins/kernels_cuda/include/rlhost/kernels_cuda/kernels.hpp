// kernels_cuda: launchers of the CUDA kernel provider (device pointers, stream-ordered, no host
// synchronisation). docs/ops.md is the contract (operands, attributes, semantics);
// docs/kernels_cuda.md says what each op computes here and at what precision.
//
// Conventions (those of kernels_cpu, plus):
//   - DType is the op's float dtype: f32 (fp32 arithmetic throughout; the GEMM is true fp32
//     unless tf32 is asked for) or bf16 (bf16 operands, fp32 accumulation and fp32 statistics).
//   - Flex operands (per-row statistics such as rstd and lse, the logprob outputs, parameter
//     gradients dw/db/dtable/dW, gemm's C in a bf16 gemm) may be f32 or bf16 in a bf16 op; in
//     an f32 op they are f32. They are read and written through Flex.
//   - Launchers validate what they can on the host and throw std::invalid_argument; launch
//     failures throw std::runtime_error. Nothing here synchronises the stream.
//   - Scratch memory comes from a Workspace (stream-ordered: valid for work queued on the
//     call's stream until the call returns and the workspace releases it in stream order).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

struct __nv_bfloat16;  // cuda_bf16.h's

namespace rlh::kcuda {

// f64 is offered by the MoE router only (moe_router_*: the engine's router_fp64).
enum class DType : int { f32 = 0, bf16 = 1, f64 = 2 };
inline size_t dtype_size(DType t) { return t == DType::f32 ? 4 : t == DType::bf16 ? 2 : 8; }

struct Flex {
  void* p = nullptr;
  bool bf16 = false;
};

// Stream-ordered scratch for one call.
class Workspace {
 public:
  virtual ~Workspace() = default;
  virtual void* get(size_t bytes) = 0;  // 256-byte aligned; throws on failure
};

// Device facts the launchers use (read once per instance).
struct DeviceInfo {
  int device = 0;
  int sm_count = 132;
  int cc_major = 9, cc_minor = 0;
  size_t smem_optin = 227 * 1024;
};

// ---------------------------------------------------------------------------------------------
// gemm (gemm_cublaslt.cpp): C = alpha op(A) op(B) + beta C, row-major, batched when batch > 1.
// A and B have dtype `ab`; C has dtype c_dt (bf16 A/B may write an f32 C). bias (optional,
// length N, dtype of C... or f32) is added by the GEMM epilogue. Cin (optional, batch 1): beta's
// C when it is not the output, C = alpha op(A) op(B) + beta Cin with Cin laid out as C (ldc):
// the epilogue reads it, so an add of the product to another value needs no pass of its own.
struct GemmArgs {
  bool ta = false, tb = false;
  int64_t M = 0, N = 0, K = 0;
  double alpha = 1, beta = 0;
  const void* A = nullptr; int64_t lda = 0, stride_a = 0;
  const void* B = nullptr; int64_t ldb = 0, stride_b = 0;
  void* C = nullptr; int64_t ldc = 0, stride_c = 0;
  int64_t batch = 1;
  DType ab = DType::f32, c_dt = DType::f32;
  bool allow_tf32 = false;  // f32 only: CUBLAS_COMPUTE_32F_FAST_TF32
  const void* bias = nullptr; DType bias_dt = DType::f32;
  const void* Cin = nullptr;
};
class GemmEngine;  // cuBLASLt handle, heuristics cache; thread-safe
GemmEngine* gemm_engine_create(const DeviceInfo& dev);  // throws when cuBLASLt cannot load
void gemm_engine_destroy(GemmEngine* e);
const char* gemm_engine_info(GemmEngine* e);  // "cuBLASLt 130000 from libcublasLt.so.13"
// Runs on cuBLASLt when it has an algorithm for the problem, else on gemm_fallback.
void gemm(GemmEngine* e, const GemmArgs& a, Workspace& ws, cudaStream_t s);
// The SIMT fallback: any shape, stride and alignment; fp32 accumulation. Bias as in GemmArgs.
void gemm_fallback(const GemmArgs& a, cudaStream_t s);
// C = A B^T for up to kGemvRows rows of bf16 A and a contiguous, 16-byte aligned bf16 B of at
// most 64 Mi elements (RLH_KCUDA_GEMV_MAX; alpha 1, beta 0): a decoding step's linears at batch
// 1-4 (gemv.cu). Returns false, launching nothing, for anything else.
inline constexpr int64_t kGemvRows = 4;
bool gemv_rows(const GemmArgs& a, cudaStream_t s);
// The same with B = gate | up [2N, K] and C [M, N] bf16 = act(gate) * up, the product's halves
// rounded to bf16 first (gemm then swiglu_fwd / geglu_fwd, bitwise). act 0: silu; 1: gelu (tanh
// form); 2: gelu (erf). No bias. False, launching nothing, where the few-row path does not apply.
bool gemv_glu_rows(const GemmArgs& a, int act, cudaStream_t s);
// The few-row product's fused forms (gemv.cu), each bitwise the ops it replaces, false
// (launching nothing) where the few-row path does not apply (or RLH_KCUDA_GEMV_PRELOAD=0):
//   gemv_norm_rows: C = rmsnorm(A) B^T with the norm's weight, eps and offset (rmsnorm_fwd then
//                   the product; act -1, or 0: the SwiGLU of gemv_glu_rows);
//   gemv_add_rows:  C = res + A B^T, the product rounded to bf16 first (then add_fwd; C may be res).
struct GemvExtra {
  const uint16_t* norm_w = nullptr;  // bf16 [K], 16-byte aligned
  float eps = 1e-6f, woff = 0.f;
  const uint16_t* res = nullptr;  // bf16 [M, N] (ldres)
  int64_t ldres = 0;
};
bool gemv_norm_rows(const GemmArgs& a, int act, const GemvExtra& ex, cudaStream_t s);
bool gemv_add_rows(const GemmArgs& a, const GemvExtra& ex, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// embedding: out[n] = table[ids[n]] (ids outside [0,V) give zero rows and set *err).
// bwd: dtable[ids[n]] += dout[n], deterministic (stable sort of ids; each row sums its tokens in
// token order).
void embedding_fwd(DType t, void* out, const int32_t* ids, const void* table, int64_t N,
                   int64_t C, int64_t V, int* err, cudaStream_t s);
void embedding_bwd(DType t, Flex dtable, const int32_t* ids, const void* dout, int64_t N,
                   int64_t C, int64_t V, int* err, Workspace& ws, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// rmsnorm
void rmsnorm_fwd(DType t, void* y, int64_t ldy, Flex rstd, const void* x, int64_t ldx,
                 const void* w, int64_t N, int64_t C, float eps, float w_offset, cudaStream_t s);
// y = a + b, yn = rmsnorm_fwd(y), contiguous rows: bitwise add_fwd then rmsnorm_fwd.
void add_rmsnorm_fwd(DType t, void* y, void* yn, const void* a, const void* b, const void* w, int64_t N, int64_t C,
                     float eps, float w_offset, cudaStream_t s);
void rmsnorm_bwd(DType t, void* dx, int64_t lddx, Flex dw, const void* dy, int64_t lddy,
                 const void* x, int64_t ldx, const void* w, Flex rstd, int64_t N, int64_t C,
                 float w_offset, bool accumulate, Workspace& ws, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// rope (inverse = the transposed rotation, rope_bwd)
void rope(DType t, void* y, int64_t ldy, const void* x, int64_t ldx, const int32_t* pos,
          const float* inv_freq, int64_t N, int64_t H, int64_t D, int64_t R, double scale,
          bool interleaved, bool inverse, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// attention (causal, packed by cu_seqlens, GQA, sliding window; lse [Hq,N])
struct AttnArgs {
  DType t = DType::bf16;
  int64_t N = 0, S = 0, Hq = 0, Hkv = 0, Dk = 0, Dv = 0, window = 0;
  float scale = 1;
  float softcap = 0;  // > 0: scores s become softcap tanh(s / softcap) (Gemma-2); the generic path runs it
  const int32_t* cu = nullptr;
  const void* q = nullptr; int64_t ldq = 0;
  const void* k = nullptr; int64_t ldk = 0;
  const void* v = nullptr; int64_t ldv = 0;
  void* o = nullptr; int64_t ldo = 0;  // fwd: written; bwd: read
  Flex lse;                            // fwd: written; bwd: read
  const void* dout = nullptr; int64_t lddo = 0;
  void* dq = nullptr; int64_t lddq = 0;
  void* dk = nullptr; int64_t lddk = 0;
  void* dv = nullptr; int64_t lddv = 0;
  bool force_simt = false;  // tests: take the generic path even where tensor cores apply
  int variant = 0;          // tests/benchmarks: tile configuration of the tensor-core kernels
                            // (0 = default; attention_fwd.cu / attention_bwd.cu list them)
};
// Which implementation runs: "mma_d64", "mma_d128" (bf16 tensor cores) or "simt".
const char* attention_path(const AttnArgs& a);
void attention_fwd(const AttnArgs& a, const DeviceInfo& dev, cudaStream_t s);
void attention_bwd(const AttnArgs& a, const DeviceInfo& dev, Workspace& ws, cudaStream_t s);
// Internals shared by the files (tensor-core kernels for D = 64/128, the generic kernels).
bool attention_mma_ok(const AttnArgs& a, bool backward);
void attention_fwd_mma(const AttnArgs& a, const DeviceInfo& dev, cudaStream_t s);
void attention_bwd_mma(const AttnArgs& a, const DeviceInfo& dev, float* delta, cudaStream_t s);
void attention_fwd_simt(const AttnArgs& a, const DeviceInfo& dev, cudaStream_t s);
void attention_bwd_simt(const AttnArgs& a, const DeviceInfo& dev, float* delta, cudaStream_t s);
void attention_delta(const AttnArgs& a, float* delta, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// swiglu, geglu, bias, add, sumsq, scale
void swiglu_fwd(DType t, void* h, int64_t ldh, const void* gate, int64_t ldg, const void* up,
                int64_t ldu, int64_t N, int64_t F, cudaStream_t s);
void swiglu_bwd(DType t, void* dgate, int64_t lddg, void* dup, int64_t lddu, const void* dh,
                int64_t lddh, const void* gate, int64_t ldg, const void* up, int64_t ldu,
                int64_t N, int64_t F, cudaStream_t s);
// geglu: h = gelu(gate) * up, gelu in its tanh form (Gemma's gelu_pytorch_tanh) or exact.
void geglu_fwd(DType t, void* h, int64_t ldh, const void* gate, int64_t ldg, const void* up,
               int64_t ldu, int64_t N, int64_t F, bool tanh_form, cudaStream_t s);
void geglu_bwd(DType t, void* dgate, int64_t lddg, void* dup, int64_t lddu, const void* dh,
               int64_t lddh, const void* gate, int64_t ldg, const void* up, int64_t ldu,
               int64_t N, int64_t F, bool tanh_form, cudaStream_t s);
void bias_add_fwd(DType t, void* y, int64_t ldy, const void* b, int64_t N, int64_t M,
                  cudaStream_t s);
void bias_bwd(DType t, Flex db, const void* dy, int64_t lddy, int64_t N, int64_t M,
              Workspace& ws, cudaStream_t s);
void add_fwd(DType t, void* y, const void* a, const void* b, int64_t n, cudaStream_t s);
// Tensor lists (multi-tensor): one launch over every tensor.
struct TensorList {
  const int64_t* n = nullptr;  // element counts
  void* const* p = nullptr;    // device pointers
  const bool* bf16 = nullptr;  // dtype per tensor (nullptr: all f32)
  size_t count = 0;
};
// out[0] (f32) = sum over tensors of sum x^2, accumulated in double, deterministic.
void sumsq(const TensorList& x, float* out, Workspace& ws, cudaStream_t s);
void scale(const TensorList& x, float factor, Workspace& ws, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// linear_logprob (unfiltered: top_k = 0, top_p = 1; linear_logprob.cpp)
struct LogprobArgs {
  DType t = DType::bf16;
  int64_t N = 0, C = 0, V = 0;
  int64_t K = 1;  // targets per token: target [N,K], logprob and dlogprob [N,K]
  const void* h = nullptr;
  const void* W = nullptr;
  const int32_t* target = nullptr;
  double temperature = 1;
  float softcap = 0;        // > 0: z = softcap tanh(logit / softcap) / temperature (Gemma-2's final cap)
  int64_t chunk_bytes = 0;  // 0 = 32 MiB
  // fwd outputs (entropy optional)
  Flex logprob, lse, entropy;
  // bwd inputs (dlogprob, entropy, dentropy optional) and outputs
  Flex dlogprob, dentropy;
  void* dh = nullptr;
  Flex dW;
  bool accumulate = false;
  int* err = nullptr;  // set when a target is >= V
  // Optional fp32 [N, ld_cache] buffer (an engine's training step): the forward leaves every
  // logits tile there and the backward reads it instead of recomputing it, saving one of the
  // head's four GEMMs for N x V x 4 bytes. Both passes must get the same buffer, N and tiling.
  float* logits_cache = nullptr;
  int64_t ld_cache = 0;  // >= V
};
void linear_logprob_fwd(GemmEngine* g, const LogprobArgs& a, Workspace& ws, cudaStream_t s);
void linear_logprob_bwd(GemmEngine* g, const LogprobArgs& a, Workspace& ws, cudaStream_t s);
// Kernels of linear_logprob (linear_logprob.cu): the row statistics of one logits tile,
// merged into the running (m, s, t, zt) state, and the gradient of a tile.
// target/zt/logprob/dlogprob hold K entries per row.
void logprob_tile_stats(const float* logits, int64_t rows, int64_t cols, int64_t ld,
                        int64_t v0, const int32_t* target, int64_t K, float inv_temp, float softcap,
                        float* m, float* sum, float* tz, float* zt, bool first, int* err, int64_t V,
                        cudaStream_t s);
void logprob_finish(const float* m, const float* sum, const float* tz, const float* zt,
                    const int32_t* target, int64_t N, int64_t K, Flex logprob, Flex lse,
                    Flex entropy, cudaStream_t s);
void logprob_tile_grad(DType t, const float* logits, int64_t rows, int64_t cols, int64_t ld,
                       int64_t v0, const int32_t* target, int64_t K, float inv_temp, float softcap,
                       Flex lse, Flex dlogprob, Flex entropy, Flex dentropy, void* dlogits, int64_t ldd,
                       cudaStream_t s);
void store_rows(DType t, void* dst, const float* src, int64_t n, bool accumulate, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// adamw over tensor lists (p, m, v f32; g f32 or bf16), torch.optim.AdamW
struct AdamWArgs {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  int64_t step = 1;
  double grad_scale = 1;
  bool zero_grad = false;
  // Optional list parallel to p (bf16 tensors): receives the updated p rounded to bf16, the
  // working copy an engine computes with, in the same pass (no second read of p).
  const TensorList* p_bf16 = nullptr;
};
void adamw(const TensorList& p, const TensorList& g, const TensorList& m, const TensorList& v,
           const AdamWArgs& o, Workspace& ws, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// Mixture of experts (moe_router.cu, moe_permute.cu, grouped_gemm.cu): the ops of docs/ops.md
// "Mixture of experts". Integer operands (experts, row, offsets) are int32 device arrays. Errors
// only the device can see (an expert outside [0, E), a row that is not a permutation, offsets
// that are not a partition of the rows, a replayed choice that repeats) raise *err (when err is
// not null) and leave the offending rows out; RLH_KCUDA_CHECK=1 turns the flag into a status.

// moe_router_fwd / moe_router_bwd, one warp per token row. t is the dtype of logits (fwd) and
// dlogits (bwd): f32 (fp32 math), bf16 (fp32 math; the other float operands are Flex: f32 or
// bf16) or f64 (fp64 math, the engine's router_fp64: then every float operand is f64 and the
// Flex pointers point to doubles). Top-k: descending, ties to the lower expert index.
struct RouterArgs {
  DType t = DType::f32;
  int64_t N = 0, E = 0, K = 0;
  int scoring = 0;  // 0 softmax, 1 sigmoid
  bool norm_topk_prob = false;
  double scaling_factor = 1;
  bool replay = false;             // fwd: experts are read (given), not chosen
  int64_t n_group = 1, topk_group = 1;
  const void* logits = nullptr; int64_t ldl = 0;  // fwd: [N, E], row stride ldl
  Flex bias;                       // fwd: [E] selection bias (optional)
  Flex weights;                    // fwd: [N, K] written
  int32_t* experts = nullptr;      // fwd: [N, K] written (read with replay); bwd: read
  Flex probs;                      // fwd: [N, E] written; bwd: read
  Flex lse;                        // fwd: [N] written (optional)
  Flex dweights, dprobs, dlse;     // bwd: [N, K], [N, E] (optional), [N] (optional; softmax only)
  void* dlogits = nullptr; int64_t lddl = 0;      // bwd: [N, E] written, row stride lddl
  int* err = nullptr;
};
void moe_router_fwd(const RouterArgs& a, cudaStream_t s);
void moe_router_bwd(const RouterArgs& a, cudaStream_t s);

// Permutation to expert order: a stable sort of the N*K (token, choice) pairs by expert (cub
// radix sort), so row[n,k] and offsets [E+1] are exactly kernels_cpu's. No host sync.
void moe_permute_index(int32_t* row, int32_t* offsets, const int32_t* experts, int64_t N,
                       int64_t K, int64_t E, int* err, Workspace& ws, cudaStream_t s);
// xp [N*K, C] (row stride ldxp) = x[n] at row[n,k]; row and offsets as moe_permute_index.
void moe_permute_fwd(DType t, void* xp, int64_t ldxp, int32_t* row, int32_t* offsets,
                     const void* x, int64_t ldx, const int32_t* experts, int64_t N, int64_t K,
                     int64_t C, int64_t E, int* err, Workspace& ws, cudaStream_t s);
// dx[n] (+)= sum_k dxp[row[n,k]]  (fp32 sums, k in order)
void moe_permute_bwd(DType t, void* dx, int64_t lddx, const void* dxp, int64_t lddxp,
                     const int32_t* row, int64_t N, int64_t K, int64_t C, bool accumulate,
                     int* err, Workspace& ws, cudaStream_t s);
// y[n] (+)= sum_k weights[n,k] yp[row[n,k]]  (weights f32 or bf16 in a bf16 op)
void moe_unpermute_fwd(DType t, void* y, int64_t ldy, const void* yp, int64_t ldyp,
                       const int32_t* row, Flex weights, int64_t N, int64_t K, int64_t C,
                       bool accumulate, int* err, Workspace& ws, cudaStream_t s);
// dyp[row[n,k]] = weights[n,k] dy[n];  dweights[n,k] = <dy[n], yp[row[n,k]]> (optional: p null)
void moe_unpermute_bwd(DType t, void* dyp, int64_t lddyp, Flex dweights, const void* dy,
                       int64_t lddy, const void* yp, int64_t ldyp, const int32_t* row,
                       Flex weights, int64_t N, int64_t K, int64_t C, int* err, Workspace& ws,
                       cudaStream_t s);

// grouped_gemm: offsets [G+1] on the device (never read on the host; the grid is sized for the
// worst case and each block finds its group). ta = 0: rows r of group g:
// C[r] = alpha A[r] op(B_g) + beta C[r], A [T,K], B [G,K,N] ([G,N,K] with tb), C [T,N].
// ta = 1: C_g = alpha A_g^T B_g + beta C_g, A [T,M], B [T,N], C [G,M,N] (tb must be 0).
// ab f32: true fp32 (CUDA cores). ab bf16: mma.sync tensor cores, fp32 accumulation, when the
// contiguous extents and leading dimensions are multiples of 8 and the pointers 16-byte
// aligned; otherwise CUDA cores. C is f32 or bf16 (c_dt) in a bf16 gemm.
struct GroupedGemmArgs {
  bool ta = false, tb = false;
  int64_t G = 0, T = 0;          // groups; rows of A (= offsets[G])
  int64_t M = 0, N = 0, K = 0;   // ta = 0: K inner, M unused; ta = 1: M x N per group, K unused
  double alpha = 1, beta = 0;
  const int32_t* offsets = nullptr;
  const void* A = nullptr; int64_t lda = 0;
  const void* B = nullptr; int64_t ldb = 0, stride_b = 0;  // stride_b: group stride (ta = 0)
  void* C = nullptr; int64_t ldc = 0, stride_c = 0;        // stride_c: group stride (ta = 1)
  DType ab = DType::f32, c_dt = DType::f32;
  int* err = nullptr;
  bool force_simt = false;  // tests: take the CUDA-core path even where tensor cores apply
  // gemm with batch_invariant = 1 (one group, no offsets, tb): K cut into chunks fixed by N and
  // K (gemm_rows_kchunk), the same sums at every M; few rows split the chunks over blocks, with
  // scratch for their partial sums (gemm_rows_partial_bytes per band of rows), many rows run
  // them in one block.
  bool invariant_split = false;
  void* split_ws = nullptr;
  size_t split_ws_bytes = 0;
};
const char* grouped_gemm_path(const GroupedGemmArgs& a);  // "mma" or "simt"
// The split of K the batch-invariant gemm takes (k-blocks per chunk, 0: none; from N and K only)
// and the bytes of partial sums it needs for `rows` rows (0 where it needs none: no split, or
// a call of many rows, whose chunks run in one block).
int64_t gemm_rows_kchunk(const GroupedGemmArgs& a);
int64_t gemm_rows_partial_bytes(const GroupedGemmArgs& a, int64_t rows);
void grouped_gemm(const GroupedGemmArgs& a, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// Decoding (decode.cu): the KV cache writes, attention over the paged cache, sampling.
// Caches are [B, Hkv, bs, D] with any strides (strides[] in elements, dims contiguous or not).
struct KvWriteArgs {
  DType t = DType::bf16;
  int64_t R = 0, Hkv = 0, Dk = 0, Dv = 0, bs = 0, num_blocks = 0;
  const void* k = nullptr; int64_t ldk = 0;  // [R, Hkv Dk]
  const void* v = nullptr; int64_t ldv = 0;  // [R, Hkv Dv]
  const int32_t* slots = nullptr;            // [R]: block * bs + offset, -1 = skip the row
  void* k_cache = nullptr; int64_t kc_strides[4] = {0, 0, 0, 0};
  void* v_cache = nullptr; int64_t vc_strides[4] = {0, 0, 0, 0};
  int* err = nullptr;                        // set when a slot lies outside the cache
  // FP8 caches (docs/ops.md): e4m3 codes of k / k_scale and v / v_scale (device float32 [1]
  // each), rounded to nearest even, saturated past 448; null: caches of the op's dtype.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
};
void kv_cache_write(const KvWriteArgs& a, cudaStream_t s);
// rope_kv_cache_write (docs/ops.md): y = rope(x) over the Hq query heads and the kv.Hkv key heads
// of x [R, (Hq + Hkv) D] (y may be x), then kv_cache_write of y's key heads and kv.v: bitwise
// the two ops. kv.k and kv.ldk are not read. One launch for bf16 half-split rows that vectorise
// (a decoding step's RoPE and cache write: a launch fewer a layer), else the two ops.
struct RopeKvArgs {
  KvWriteArgs kv;
  void* y = nullptr; int64_t ldy = 0;
  const void* x = nullptr; int64_t ldx = 0;
  int64_t Hq = 0, rot = 0;  // query heads; rotary dims (<= kv.Dk, even)
  const int32_t* pos = nullptr;
  const float* inv_freq = nullptr;  // [rot / 2]
  double scale = 1;
  bool interleaved = false;
};
void rope_kv_cache_write(const RopeKvArgs& a, cudaStream_t s);

struct PagedAttnArgs {
  DType t = DType::bf16;
  int64_t R = 0, Hq = 0, Hkv = 0, Dk = 0, Dv = 0, bs = 0, window = 0;
  float scale = 1;
  float softcap = 0;  // as AttnArgs::softcap
  const void* q = nullptr; int64_t ldq = 0;  // [R, Hq Dk]
  void* o = nullptr; int64_t ldo = 0;        // [R, Hq Dv]
  const void* k_cache = nullptr; int64_t kc_strides[4] = {0, 0, 0, 0};
  const void* v_cache = nullptr; int64_t vc_strides[4] = {0, 0, 0, 0};
  const int32_t* blocks = nullptr; int64_t ld_blocks = 0;  // [R, T] block tables
  int64_t table_width = 0;                                 // T (0: ld_blocks)
  const int32_t* pos = nullptr;                            // [R]
  float* partials = nullptr;  // paged_attention_workspace_bytes(*this) of device scratch, or null when 0
  bool batch_invariant = false;  // every row's output independent of the launch (docs/ops.md)
  // The tensor-core kernel's partitions of a row, when they fit one block's warps: combined in
  // the block (1), or through `partials` and the combine kernel (0); -1: 1 at small batch (up
  // to 32 rows x kv heads) unless RLH_KCUDA_PAGED_BLOCK_COMBINE=0. (The tests run both.)
  int block_combine = -1;
  // FP8 caches (e4m3 codes, value = scale x code; device float32 [1] each): the tensor-core
  // kernel only (bf16 q and o, head dims 64 and 128). Null: caches of the op's dtype.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
};
// Scratch the split-over-keys kernels need for a call (0 when every row fits one partition).
int64_t paged_attention_workspace_bytes(const PagedAttnArgs& a);
void paged_attention(const PagedAttnArgs& a, cudaStream_t s);
// The tensor-core kernel (paged_attention_mma.cu), which paged_attention runs where it applies.
bool paged_attention_mma_ok(const PagedAttnArgs& a);
int64_t paged_attention_mma_workspace_bytes(const PagedAttnArgs& a);
void paged_attention_mma(const PagedAttnArgs& a, cudaStream_t s);

// decode_layer_fwd (decode_layer.cu): one dense decoder layer for one token in one persistent
// launch. bf16 throughout; the caller's workspace holds q|k|v, the GLU's output and attention's
// partials (decode_layer_workspace_bytes); `sync` is 256 bytes owned by the resolved op, zeroed
// once before its first launch: its grid barrier and tile-claim counters, whose state (a
// generation or arrival count, the claim counters' parity) carries from launch to launch, so
// calls of one op are stream-ordered and the bytes are never zeroed again between them.
struct DecodeLayerArgs {
  using bf16 = __nv_bfloat16;
  int64_t C = 0, F = 0, Hq = 0, Hkv = 0, D = 0;
  const bf16* x = nullptr;       // [C] the residual stream in
  const bf16* w_norm1 = nullptr; // [C]
  const bf16* w_qkv = nullptr;   // [(Hq + 2 Hkv) D, C]
  const bf16* w_o = nullptr;     // [C, Hq D]
  const bf16* w_norm2 = nullptr; // [C]
  const bf16* w_gu = nullptr;    // [2F, C] gate rows, then up
  const bf16* w_down = nullptr;  // [C, F]
  bf16* y = nullptr;             // [C] the residual stream out (not x)
  bf16* k_cache = nullptr; int64_t kc[4] = {0, 0, 0, 0};
  bf16* v_cache = nullptr; int64_t vc[4] = {0, 0, 0, 0};
  int64_t bs = 0, num_blocks = 0;
  const int32_t* pos = nullptr;    // [1]
  const int32_t* slots = nullptr;  // [1]
  const int32_t* blocks = nullptr; // [T] the row's block table
  int64_t max_positions = 0;       // T bs: positions the table can hold
  const float* inv_freq = nullptr; // [D/2]
  float rope_scale = 1, eps1 = 1e-6f, eps2 = 1e-6f, woff1 = 0, woff2 = 0, scale = 1;
  bf16* qkv = nullptr;   // scratch (decode_layer_carve)
  bf16* act = nullptr;
  float* part = nullptr;
  unsigned* sync = nullptr;
  int* err = nullptr;    // set when the slot lies outside the cache
  int sms = 0;           // the device's SMs: one block each
};
// Empty when the kernel runs these sizes, else what it lacks.
std::string decode_layer_refusal(const DecodeLayerArgs& a);
// Empty when one block of the kernel for head dim D fits an SM of the current device (its grid
// barrier needs every block resident), else why not.
std::string decode_layer_device_refusal(int64_t D);
int64_t decode_layer_workspace_bytes(const DecodeLayerArgs& a);
void decode_layer_carve(DecodeLayerArgs& a, void* ws);
void decode_layer(const DecodeLayerArgs& a, cudaStream_t s);

struct SampleArgs {
  int64_t S = 0, V = 0, ld = 0;
  const float* logits = nullptr;  // [S, V]
  const double* u = nullptr;      // [S]
  double temperature = 1, top_p = 1, min_p = 0;
  float softcap = 0;              // > 0: the logits are first capped (softcap tanh(x / softcap))
  int64_t top_k = 0;
  int32_t* tokens = nullptr;      // [S]; -1 for a row with non-finite logits
  float* logprobs = nullptr;      // [S]
  void* parts = nullptr;          // sample_workspace_bytes of scratch: the partitioned draw
  // [S] or null: no draw; each row scores its given id (its logprob under the same z and kept
  // set as a draw's, -inf where the filter cuts it; an id outside [0, V): token -1, logprob 0).
  // What a trainer's deterministic logprobs call (docs/ops.md "sample").
  const int32_t* given = nullptr;
};
void sample(const SampleArgs& a, cudaStream_t s);
// Scratch of the partitioned draw (no top-k, top-p or min-p): 0 when the call does not take it.
int64_t sample_workspace_bytes(const SampleArgs& a);

// Throws std::runtime_error naming `what` when the last launch failed.
void check_launch(const char* what);

}  // namespace rlh::kcuda
