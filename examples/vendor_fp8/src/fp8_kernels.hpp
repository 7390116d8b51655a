// The plugin's own CUDA kernels (fp8_kernels.cu): amax, quantisation to FP8 with its scales
// (per tensor, 1x128 tiles, 128x128 blocks) and the delayed-scaling history update. Plain C++
// declarations, so plugin.cpp needs no CUDA compiler.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#ifdef __CUDACC__
#define VFP8_HD __host__ __device__
#else
#define VFP8_HD
#endif

namespace vfp8 {

enum class Fmt : int { e4m3 = 0, e5m2 = 1 };
enum class In : int { f32 = 0, bf16 = 1 };

// Largest finite value of a format: 448 (e4m3fn) and 57344 (e5m2).
inline float fmt_max(Fmt f) { return f == Fmt::e4m3 ? 448.0f : 57344.0f; }

// How scales are grouped over the quantised matrix [rows, inner] (inner contiguous). Layouts are
// cuBLASLt's (cublasLt.h, CUBLASLT_MATMUL_MATRIX_SCALE_*):
//   tensor     one float (scalar)
//   tile1x128  VEC128_32F: a float per 128 consecutive inner elements of a row,
//              s[kb * rows + r] (the row index fastest), kb < ceil(inner / 128)
//   block128   BLK128x128_32F: a float per 128x128 block,
//              s[rb * kb4 + kb], kb4 = ceil(ceil(inner / 128) / 4) * 4 (padding: 1.0)
//   row        OUTER_VEC_32F: a float per row, s[r] (x itself only, not x^T)
enum class Grouping : int { tensor = 0, tile1x128 = 1, block128 = 2, row = 3 };

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t scale_count(Grouping g, int64_t rows, int64_t inner) {
  switch (g) {
    case Grouping::tensor: return 1;
    case Grouping::tile1x128: return ceil_div(inner, 128) * rows;
    case Grouping::block128: return ceil_div(rows, 128) * (ceil_div(ceil_div(inner, 128), 4) * 4);
    case Grouping::row: return rows;
  }
  return 0;
}

// The source of a quantisation: x [R, C] row-major with row stride ldx; the quantised matrix is
// x itself (rows = R, inner = C) or, with transpose, x^T (rows = C, inner = R): what the backward
// products need, since cuBLASLt's FP8 GEMMs read both operands K-major.
struct Source {
  const void* x = nullptr;
  In type = In::f32;
  int64_t R = 0, C = 0, ldx = 0;
  bool transpose = false;
  VFP8_HD int64_t rows() const { return transpose ? C : R; }
  VFP8_HD int64_t inner() const { return transpose ? R : C; }
};

// amax = max |x| over the whole source, into a device float (NaN if any element is NaN).
// `bits` is device scratch of one uint32.
void amax(const Source& s, float* out, uint32_t* bits, cudaStream_t st);

// Quantises with a scale already on the device (tensor grouping): q = sat(x / scale), q written
// [rows, inner] with row stride ldq. With qt (x itself as the source, not transposed), x^T goes
// to qt [C, R] (row stride ldqt) in the same pass; the same holds for the two calls below.
void quantize_with_scale(const Source& s, Fmt f, const float* scale, void* q, int64_t ldq, cudaStream_t st,
                         void* qt = nullptr, int64_t ldqt = 0);

// Current scaling: scale = amax / fmt_max * 2^margin (1 when amax is 0 or not finite), for the
// grouping, then q. `amax_out` (tensor grouping only; may be null) receives the amax.
void quantize_current(const Source& s, Fmt f, Grouping g, double margin, void* q, int64_t ldq, float* scale,
                      float* amax_out, uint32_t* bits, cudaStream_t st, void* qt = nullptr, int64_t ldqt = 0);

// Delayed scaling (tensor grouping): the scale comes from the amax history of earlier calls
// (its max, or its most recent entry); the first call, with an empty history, uses its own amax.
// Then the current amax enters the history. `hist` [len] and `pos_count` [2] live on the device.
// `history_filled`: the caller knows the history holds an entry (it counts its calls), so the
// scale needs no pass of its own and the amax is gathered while quantising (one read of x, not
// two); false takes the two-pass path, which also reads the count on the device.
void quantize_delayed(const Source& s, Fmt f, double margin, bool most_recent, float* hist, int32_t len,
                      int32_t* pos_count, bool history_filled, void* q, int64_t ldq, float* scale, float* amax_out,
                      float* cur, uint32_t* bits, cudaStream_t st, void* qt = nullptr, int64_t ldqt = 0);

// Quantisation fused into the kernel that produces the activations (fp8_producers.cu): a
// decoding step's RMSNorm (after its residual add or not) and SwiGLU write the FP8 codes and 1x128
// tile scales (Grouping::tile1x128, current scaling) of what they produce, so the product that
// reads them needs no quantisation pass of its own. The produced values are rounded to bf16
// first, as the unfused op writes them and the pass would read them, and `y` (may be null)
// receives them too.
//   rmsnorm      y = x rstd (w + offset), rstd = 1 / sqrt(mean(x^2) + eps): x [R, C]
//   add_rmsnorm  sum = a + b (rounded to bf16, written; may be a or b), y = rmsnorm(sum)
//   swiglu       y = silu(gate) up, gate | up [R, 2C] side by side (x, ldx)
enum class Producer : int { none = 0, rmsnorm = 1, add_rmsnorm = 2, swiglu = 3 };
struct ProducerArgs {
  Producer kind = Producer::none;
  int64_t R = 0, C = 0;                 // the produced matrix [R, C]
  const void* x = nullptr;              // bf16: x, a, or gate | up
  int64_t ldx = 0;
  const void* b = nullptr;              // bf16, add_rmsnorm's second addend
  int64_t ldb = 0;
  const void* w = nullptr;              // bf16 [C], the norms' weight
  float eps = 1e-6f, offset = 0.0f;
  void* sum = nullptr;                  // bf16, add_rmsnorm's a + b
  int64_t ld_sum = 0;
  void* y = nullptr;                    // bf16 or null
  int64_t ldy = 0;
  void* q = nullptr;                    // [R, C] codes
  int64_t ldq = 0;
  float* scale = nullptr;               // ceil(C / 128) * R, s[kb * R + r]
  Fmt fmt = Fmt::e4m3;
  double margin = 0.0;
};
// "" when the kernels take these strides and alignments (16-byte rows of 8-element multiples),
// else why not.
std::string producer_unsupported(const ProducerArgs& p);
void quantize_producer(const ProducerArgs& p, cudaStream_t st);

// The weight-only product (fp8_weight_only.cu): C[M, N] = alpha A (s B)^T + beta C, A bf16 [M, K]
// (row stride lda), B e4m3 [N, K] (ldb), s one float or B's 128x128 block scales
// (Grouping::block128's layout), C bf16 or float32 (ldc). Hopper (sm_90) only: it reduces split K
// across a thread-block cluster. Any M; made for decoding's few rows (up to 64 a chunk).
struct WeightOnlyArgs {
  int64_t M = 0, N = 0, K = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  const float* sb = nullptr;
  bool block_scales = false;
  void* c = nullptr;
  int64_t ldc = 0;
  bool c_bf16 = true;
  float alpha = 1, beta = 0;
};
// "" when the kernel takes these shapes and strides, else why not.
std::string weight_only_unsupported(const WeightOnlyArgs& w);
void gemm_weight_only(const WeightOnlyArgs& w, cudaStream_t st);

}  // namespace vfp8
