// Internal: kernels_cpu's decode-sized ops, run on the instance's worker pool (worker_pool.hpp)
// rather than OpenMP: the batch-invariant gemm (gemm_rows.cpp), paged attention
// (paged_attention.cpp) and sampling (sample.cpp). Contracts in docs/ops.md.
#pragma once

#include <cstdint>

namespace rlh::kcpu {

class WorkerPool;

// y[m * ldy + n] = sum_k x[m * ldx + k] * W[n * ldw + k]    (m < M, n < N, k < K)
// y is written (not accumulated); x, W, y must not overlap. Row m of y depends only on row m of
// x, bitwise, whatever M and the thread count.
void gemm_rows(float* y, int64_t ldy, const float* x, int64_t ldx, const float* W, int64_t ldw, int64_t M,
               int64_t N, int64_t K, WorkerPool& pool);
void gemm_rows(double* y, int64_t ldy, const double* x, int64_t ldx, const double* W, int64_t ldw, int64_t M,
               int64_t N, int64_t K, WorkerPool& pool);

// out [R, Hq Dv] (rows ldo apart) = softmax(scale q k^T) v per row and head over the row's
// cached keys; q [R, Hq Dk] (ldq). Keys of block b, kv head h: k + b k_block + h Dk bs, [Dk][bs];
// values: v + b v_block + h bs Dv, [bs][Dv]. Row r's blocks: blocks + r ld_blocks, table_width
// entries; its position pos[r].
struct PagedAttentionArgs {
  float* out = nullptr;
  int64_t ldo = 0;
  const float* q = nullptr;
  int64_t ldq = 0;
  int64_t R = 0, Hq = 0, Hkv = 0, Dk = 0, Dv = 0, bs = 0;
  const float* k = nullptr;
  int64_t k_block = 0;
  const float* v = nullptr;
  int64_t v_block = 0;
  const int32_t* blocks = nullptr;
  int64_t ld_blocks = 0, table_width = 0;
  const int32_t* pos = nullptr;
  float scale = 1;
  int64_t window = 0;
  float softcap = 0;  // > 0: scores become softcap tanh(score / softcap) (Gemma-2)
  // FP8 caches instead of k, v (same layout, one byte an element): e4m3 codes, a key's value
  // k_scale x code, a value's v_scale x code.
  const uint8_t* k8 = nullptr;
  const uint8_t* v8 = nullptr;
  float k_scale = 1, v_scale = 1;
};
void paged_attention(const PagedAttentionArgs& a, WorkerPool& pool);

// One token per row of logits [S, V] (rows ld apart), as vLLM's V1 sampler and NeMo-RL's
// trainer define them (docs/ops.md `sample`); u[s] in [0, 1) the row's uniform draw (ignored
// when greedy). Writes tokens[s] and logprobs[s] (the processed logprob of the token). With
// `given` [S] there is no draw: row s scores given[s] (-inf where the filter cuts it; an id
// outside [0, V): token -1, logprob 0).
struct SampleParams {
  double temperature = 1.0;  // 0 = greedy
  int64_t top_k = 0;         // <= 0 or >= V: off
  double top_p = 1.0;        // 1 = off
  double min_p = 0.0;        // 0 = off
  double softcap = 0.0;      // > 0: logits become softcap tanh(logits / softcap) first (Gemma-2)
};
void sample(const float* logits, int64_t ld, int64_t S, int64_t V, const double* u, const SampleParams& p,
            int32_t* tokens, float* logprobs, WorkerPool& pool, const int32_t* given = nullptr);

// The kept-set threshold of linear_logprob's top-k / top-p filter (logprob.cpp) for one row of
// scaled logits: tokens with z >= the returned value survive (-inf when nothing is cut). `tmp`
// holds V floats.
float sample_filter_threshold(const float* z, int64_t V, int64_t top_k, double top_p, float* tmp);

}  // namespace rlh::kcpu

namespace rlh::kcpu {

// decode_layer_fwd's reference (decode_layer.cpp; docs/ops.md): contiguous weights, caches of
// any strides (kc, vc: the four strides of [B, Hkv, bs, D]). Throws std::invalid_argument
// naming a slot, block id or position outside the cache or table.
struct DecodeLayerRefArgs {
  int64_t R = 0, C = 0, F = 0, Hq = 0, Hkv = 0, D = 0, bs = 0, num_blocks = 0;
  const float* x = nullptr;
  int64_t ldx = 0;
  const float *norm1 = nullptr, *wqkv = nullptr, *wo = nullptr, *norm2 = nullptr, *wgu = nullptr, *wdown = nullptr;
  const int32_t *pos = nullptr, *slots = nullptr, *table = nullptr;
  int64_t ld_table = 0, table_width = 0;
  const float* inv_freq = nullptr;
  float* y = nullptr;
  int64_t ldy = 0;
  float* k_cache = nullptr;
  int64_t kc[4] = {0, 0, 0, 0};
  float* v_cache = nullptr;
  int64_t vc[4] = {0, 0, 0, 0};
  double eps1 = 1e-6, eps2 = 1e-6, woff = 0, rope_scale = 1, scale = 1;
};
void decode_layer_ref(const DecodeLayerRefArgs& a);

}  // namespace rlh::kcpu
