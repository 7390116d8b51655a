// FP8 GEMMs on cuBLASLt. libcublasLt is opened with dlopen when the first instance is created,
// so the plugin loads (and lists its ops, and says why it cannot run) on a machine without the
// CUDA libraries; only the toolkit's header is needed to build.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "fp8_kernels.hpp"

typedef struct cublasLtContext* cublasLtHandle_t;

namespace vfp8 {

// Which scaling a product uses (the gemm op's `scaling` attribute).
enum class Scaling : int {
  tensor = 0,       // one float per operand (tensorwise: current or delayed)
  tiles_blocks = 1, // A 1x128 tiles, B 128x128 blocks (DeepSeek-V3: activations x weights)
  tiles_tiles = 2,  // A and B 1x128 tiles (the weight gradient: dY^T x X, both along tokens)
  rows = 3,         // a float per row of A (token) and of B (output channel): cuBLASLt's outer vectors
};

// C[M, N] = alpha * (sa . A)[M, K] (sb . B)[N, K]^T + beta * C, row-major, A and B K-major (the
// only FP8 layout cuBLASLt runs on Hopper: "TN"), scales as fp8_kernels.hpp lays them out.
struct GemmArgs {
  int64_t M = 0, N = 0, K = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  Fmt fa = Fmt::e4m3;
  const void* b = nullptr;
  int64_t ldb = 0;
  Fmt fb = Fmt::e4m3;
  const float* sa = nullptr;  // device
  const float* sb = nullptr;
  Scaling scaling = Scaling::tensor;
  void* c = nullptr;
  int64_t ldc = 0;
  bool c_bf16 = false;  // else float32
  float alpha = 1, beta = 0;
  // cuBLASLt's fast accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM: the FP8 products' partial
  // sums are not promoted to fp32 every few k-blocks); TransformerEngine's default for the
  // forward product, not for the gradients'.
  bool fast_accum = false;
  // Pick the fastest of cuBLASLt's heuristic candidates by timing them on this call's operands,
  // at the shape's first product (gemm's `autotune` call attribute). Only with beta 0 (the
  // timed runs overwrite C), outside stream capture, for up to 512 rows and 64 shapes an
  // instance; else the heuristic's first.
  bool autotune = false;
  // The few-row kernel only (gemm_few_rows): A in bf16, its 1x128 tiles quantised to e4m3 in the
  // product (current scaling, scale = amax / 448 * a_margin_mult) as quantize_fp8 would; sa unused.
  bool a_bf16 = false;
  float a_margin_mult = 1;
};

// The block-scaled product (Scaling::tiles_blocks, e4m3 x e4m3) of a few rows on a kernel of our
// own (fp8_few_rows.cu), where cuBLASLt's tiles leave the weights' bandwidth unused: any M, N
// and K multiples of 128, Hopper (sm_90) only. "" when it takes g's shape, else why not.
std::string few_rows_unsupported(const GemmArgs& g);
void gemm_few_rows(const GemmArgs& g, cudaStream_t st);  // throws std::runtime_error
// Sets the kernels' shared-memory allowance on the current device (once): called at resolution,
// so that a first product inside a CUDA graph's capture makes no such call.
void few_rows_prepare();
// The rows up to which gemm takes it by default (the `few_rows` attribute: README.md):
// VFP8_FEW_ROWS_MAX, else 16 (at 64 rows batch-64 decoding ran 38.2K tok/s with it against
// 39.0K on cuBLASLt's autotuned products: H100, 2026-12-07).
int64_t few_rows_bound();

// The workspace a product is given (cuBLASLt's recommendation for Hopper).
constexpr size_t kGemmWorkspace = size_t(32) << 20;

// cuBLASLt itself: "" when loaded, else why not (every path tried). Thread-safe, loads once.
std::string cublaslt_error();
std::string cublaslt_path();

class Gemm {
 public:
  Gemm();  // throws std::runtime_error (cuBLASLt missing, or no handle)
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // "" when cuBLASLt offers an algorithm for these operands (pointers unused), else why not.
  std::string unsupported(const GemmArgs& g) const;
  // Queues the product on `st`; `ws` of kGemmWorkspace bytes (256-byte aligned). Throws
  // std::runtime_error naming the cuBLASLt status.
  void run(const GemmArgs& g, void* ws, cudaStream_t st) const;

 private:
  struct Cached;  // a shape's descriptors and chosen algorithm (fp8_gemm.cpp)
  // The plan for g's shape, made (descriptors and cuBLASLt's heuristic, tens of microseconds)
  // at its first product and kept: an engine runs the same few shapes every step. Throws when
  // cuBLASLt has no algorithm. With g.autotune, that first product times the candidates (ws and
  // st are the call's). Call with mu_ held.
  Cached& plan(const GemmArgs& g, void* ws, cudaStream_t st) const;
  static constexpr int64_t kTuneRows = 512, kTuneShapes = 64;  // autotune's bounds (fp8_gemm.cpp)
  cublasLtHandle_t handle_ = nullptr;
  mutable int64_t tuned_ = 0;  // shapes timed so far
  mutable std::mutex mu_;  // the cache, and a cached descriptor's scale pointers set per call
  mutable std::map<std::array<int64_t, 12>, std::unique_ptr<Cached>> cache_;
};

}  // namespace vfp8
