// FP8 GEMMs on cuBLASLt (fp8_gemm.hpp): the library through dlopen, one matmul descriptor and
// algorithm per shape, kept (making them per product cost a heuristic query each time).
#include "fp8_gemm.hpp"

#include <cublasLt.h>
#include <dlfcn.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace vfp8 {
namespace {

// The cuBLASLt entry points this file calls, resolved from the loaded library.
struct Lt {
  size_t (*GetVersion)() = nullptr;
  cublasStatus_t (*Create)(cublasLtHandle_t*) = nullptr;
  cublasStatus_t (*Destroy)(cublasLtHandle_t) = nullptr;
  cublasStatus_t (*DescCreate)(cublasLtMatmulDesc_t*, cublasComputeType_t, cudaDataType_t) = nullptr;
  cublasStatus_t (*DescDestroy)(cublasLtMatmulDesc_t) = nullptr;
  cublasStatus_t (*DescSet)(cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t, const void*, size_t) = nullptr;
  cublasStatus_t (*LayoutCreate)(cublasLtMatrixLayout_t*, cudaDataType, uint64_t, uint64_t, int64_t) = nullptr;
  cublasStatus_t (*LayoutDestroy)(cublasLtMatrixLayout_t) = nullptr;
  cublasStatus_t (*PrefCreate)(cublasLtMatmulPreference_t*) = nullptr;
  cublasStatus_t (*PrefDestroy)(cublasLtMatmulPreference_t) = nullptr;
  cublasStatus_t (*PrefSet)(cublasLtMatmulPreference_t, cublasLtMatmulPreferenceAttributes_t, const void*,
                            size_t) = nullptr;
  cublasStatus_t (*Heuristic)(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                              cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatmulPreference_t, int,
                              cublasLtMatmulHeuristicResult_t*, int*) = nullptr;
  cublasStatus_t (*Matmul)(cublasLtHandle_t, cublasLtMatmulDesc_t, const void*, const void*, cublasLtMatrixLayout_t,
                           const void*, cublasLtMatrixLayout_t, const void*, const void*, cublasLtMatrixLayout_t,
                           void*, cublasLtMatrixLayout_t, const cublasLtMatmulAlgo_t*, void*, size_t,
                           cudaStream_t) = nullptr;
  std::string path, error;
};

template <class F>
void bind(void* lib, const char* name, F& f, std::string& missing) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  if (!f) missing += std::string(missing.empty() ? "" : ", ") + name;
}

const Lt& lt() {
  static std::once_flag once;
  static Lt t;
  std::call_once(once, [] {
    // VENDOR_FP8_CUBLASLT names the library; else the major this was built against, by soname and
    // in the toolkit's usual place.
    std::vector<std::string> names;
    if (const char* env = std::getenv("VENDOR_FP8_CUBLASLT"); env && *env) names.push_back(env);
    const std::string major = std::to_string(CUBLAS_VER_MAJOR);
    names.push_back("libcublasLt.so." + major);
    names.push_back("/usr/local/cuda/lib64/libcublasLt.so." + major);
    void* lib = nullptr;
    std::string tried;
    for (const auto& n : names) {
      if ((lib = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL))) {
        t.path = n;
        break;
      }
      const char* e = dlerror();
      tried += std::string(tried.empty() ? "" : "; ") + n + " (" + (e ? e : "not found") + ")";
    }
    if (!lib) {
      t.error = "cannot load cuBLASLt " + major + " (set VENDOR_FP8_CUBLASLT to its path); tried " + tried;
      return;
    }
    std::string missing;
    bind(lib, "cublasLtGetVersion", t.GetVersion, missing);
    bind(lib, "cublasLtCreate", t.Create, missing);
    bind(lib, "cublasLtDestroy", t.Destroy, missing);
    bind(lib, "cublasLtMatmulDescCreate", t.DescCreate, missing);
    bind(lib, "cublasLtMatmulDescDestroy", t.DescDestroy, missing);
    bind(lib, "cublasLtMatmulDescSetAttribute", t.DescSet, missing);
    bind(lib, "cublasLtMatrixLayoutCreate", t.LayoutCreate, missing);
    bind(lib, "cublasLtMatrixLayoutDestroy", t.LayoutDestroy, missing);
    bind(lib, "cublasLtMatmulPreferenceCreate", t.PrefCreate, missing);
    bind(lib, "cublasLtMatmulPreferenceDestroy", t.PrefDestroy, missing);
    bind(lib, "cublasLtMatmulPreferenceSetAttribute", t.PrefSet, missing);
    bind(lib, "cublasLtMatmulAlgoGetHeuristic", t.Heuristic, missing);
    bind(lib, "cublasLtMatmul", t.Matmul, missing);
    if (!missing.empty()) t.error = t.path + " lacks " + missing;
    // Block scaling modes arrived in cuBLASLt 12.9; the header this was built with has them.
    else if (t.GetVersion() < 120900)
      t.error = t.path + " is version " + std::to_string(t.GetVersion()) + "; FP8 block scaling needs 12.9 or later";
  });
  return t;
}

const Lt& need_lt() {
  const Lt& t = lt();
  if (!t.error.empty()) throw std::runtime_error(t.error);
  return t;
}

std::string status_text(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    default: return "cublasStatus " + std::to_string(int(s));
  }
}

void ck(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string("cuBLASLt ") + what + ": " + status_text(s));
}

cudaDataType_t fp8_type(Fmt f) { return f == Fmt::e4m3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

// Descriptors of one product, destroyed together. Row-major C[M, N] = A B^T is column-major
// C^T[N, M] = B^T... in cuBLASLt's terms: its "A" is our B (K x N column-major, transposed),
// its "B" our A (K x M, not transposed), its "C"/"D" our C (N x M, ld = ldc).
class Plan {
 public:
  Plan(const Lt& t, const GemmArgs& g) : t_(t) {
    try {
      build(g);
    } catch (...) {  // the destructor does not run for a constructor that throws
      release();
      throw;
    }
  }
  ~Plan() { release(); }
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  // The first algorithm cuBLASLt's heuristic offers; false when none.
  bool pick(cublasLtHandle_t h, cublasLtMatmulHeuristicResult_t* r, cublasStatus_t* why) const {
    int n = 0;
    *why = t_.Heuristic(h, desc_, la_, lb_, lc_, lc_, pref_, 1, r, &n);
    return *why == CUBLAS_STATUS_SUCCESS && n > 0;
  }
  // Up to `max` candidates, best guess first (none on failure).
  std::vector<cublasLtMatmulHeuristicResult_t> candidates(cublasLtHandle_t h, int max) const {
    std::vector<cublasLtMatmulHeuristicResult_t> r(static_cast<size_t>(max));
    int n = 0;
    if (t_.Heuristic(h, desc_, la_, lb_, lc_, lc_, pref_, max, r.data(), &n) != CUBLAS_STATUS_SUCCESS) n = 0;
    r.resize(static_cast<size_t>(n));
    return r;
  }
  // The operands' scales of this product (the descriptor keeps pointers, not values).
  void set_scales(const GemmArgs& g) {
    set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g.sb, sizeof g.sb);
    set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g.sa, sizeof g.sa);
  }
  void run(cublasLtHandle_t h, const GemmArgs& g, const cublasLtMatmulHeuristicResult_t& r, void* ws,
           cudaStream_t st) const {
    ck(t_.Matmul(h, desc_, &g.alpha, g.b, la_, g.a, lb_, &g.beta, g.c, lc_, g.c, lc_, &r.algo, ws, kGemmWorkspace, st),
       "matmul");
  }

 private:
  void build(const GemmArgs& g) {
    const Lt& t = t_;
    ck(t.DescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor");
    const cublasOperation_t T = CUBLAS_OP_T, N = CUBLAS_OP_N;
    set(CUBLASLT_MATMUL_DESC_TRANSA, &T, sizeof T);
    set(CUBLASLT_MATMUL_DESC_TRANSB, &N, sizeof N);
    // Its A is our B: B's scales go to A_SCALE, A's to B_SCALE.
    set_scales(g);
    if (g.scaling == Scaling::rows) {  // C[i, j] = sa[i] sb[j] (A B^T)[i, j]
      const int32_t outer = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer, sizeof outer);
      set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer, sizeof outer);
    } else if (g.scaling != Scaling::tensor) {
      const int32_t tiles = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, blocks = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
      const int32_t mode_b = g.scaling == Scaling::tiles_blocks ? blocks : tiles;
      set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_b, sizeof mode_b);
      set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &tiles, sizeof tiles);
    }
    const int8_t fast = g.fast_accum ? 1 : 0;
    set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast);
    const cudaDataType_t ct = g.c_bf16 ? CUDA_R_16BF : CUDA_R_32F;
    ck(t.LayoutCreate(&la_, fp8_type(g.fb), uint64_t(g.K), uint64_t(g.N), g.ldb), "layout of B");
    ck(t.LayoutCreate(&lb_, fp8_type(g.fa), uint64_t(g.K), uint64_t(g.M), g.lda), "layout of A");
    ck(t.LayoutCreate(&lc_, ct, uint64_t(g.N), uint64_t(g.M), g.ldc), "layout of C");
    ck(t.PrefCreate(&pref_), "preference");
    const uint64_t ws = kGemmWorkspace;
    ck(t.PrefSet(pref_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws), "workspace preference");
  }
  void release() {
    if (pref_) t_.PrefDestroy(pref_);
    if (lc_) t_.LayoutDestroy(lc_);
    if (lb_) t_.LayoutDestroy(lb_);
    if (la_) t_.LayoutDestroy(la_);
    if (desc_) t_.DescDestroy(desc_);
    pref_ = nullptr;
    lc_ = lb_ = la_ = nullptr;
    desc_ = nullptr;
  }
  void set(cublasLtMatmulDescAttributes_t a, const void* v, size_t n) { ck(t_.DescSet(desc_, a, v, n), "attribute"); }
  const Lt& t_;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t la_ = nullptr, lb_ = nullptr, lc_ = nullptr;
  cublasLtMatmulPreference_t pref_ = nullptr;
};

}  // namespace

std::string cublaslt_error() { return lt().error; }
std::string cublaslt_path() { return lt().path; }

Gemm::Gemm() { ck(need_lt().Create(&handle_), "create"); }

Gemm::~Gemm() {
  if (handle_) lt().Destroy(handle_);
}

std::string Gemm::unsupported(const GemmArgs& g) const {
  try {
    const Plan p(need_lt(), g);
    cublasLtMatmulHeuristicResult_t r{};
    cublasStatus_t why = CUBLAS_STATUS_SUCCESS;
    if (!p.pick(handle_, &r, &why))
      return "cuBLASLt " + std::to_string(lt().GetVersion()) + " has no algorithm for it (" +
             (why == CUBLAS_STATUS_SUCCESS ? std::string("0 results") : status_text(why)) + ")";
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

struct Gemm::Cached {
  Plan plan;
  cublasLtMatmulHeuristicResult_t algo{};
  explicit Cached(const GemmArgs& g) : plan(need_lt(), g) {}
};

namespace {

// The candidate that ran `reps` products fastest on g's operands (ws and st the call's), the
// first on ties; candidates that fail to run are passed over. Why: at a decoding step's 64-256
// rows cuBLASLt's first guess for the block-scaled products left the memory mostly idle (the
// 1B shape's q|k|v, o and down products at 0.6-0.7 TB/s on an H100, with split K where one
// wave of smaller tiles would do; ncu, 2026-12-06).
size_t fastest(const Plan& p, cublasLtHandle_t h, const GemmArgs& g,
               const std::vector<cublasLtMatmulHeuristicResult_t>& cands, void* ws, cudaStream_t st) {
  constexpr int reps = 5;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess) {
    if (e0) cudaEventDestroy(e0);
    return 0;
  }
  size_t best = 0;
  float best_ms = -1;
  for (size_t i = 0; i < cands.size(); ++i) {
    try {
      p.run(h, g, cands[i], ws, st);  // warm-up (and the check that it runs)
      cudaEventRecord(e0, st);
      for (int r = 0; r < reps; ++r) p.run(h, g, cands[i], ws, st);
      cudaEventRecord(e1, st);
      float ms = 0;
      if (cudaEventSynchronize(e1) != cudaSuccess || cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess) continue;
      if (best_ms < 0 || ms < best_ms) {
        best_ms = ms;
        best = i;
      }
    } catch (const std::runtime_error&) {
    }
  }
  cudaGetLastError();  // (a candidate's launch failure is not the call's)
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return best;
}

}  // namespace

Gemm::Cached& Gemm::plan(const GemmArgs& g, void* ws, cudaStream_t st) const {
  // Everything the descriptors and layouts hold but the pointers (and alpha/beta, passed per call).
  const std::array<int64_t, 12> key = {g.M, g.N, g.K, g.lda, g.ldb, g.ldc, int64_t(g.fa), int64_t(g.fb),
                                       int64_t(g.scaling), g.c_bf16 ? 1 : 0, g.fast_accum ? 1 : 0,
                                       g.autotune ? 1 : 0};
  auto it = cache_.find(key);
  if (it != cache_.end()) return *it->second;
  auto c = std::make_unique<Cached>(g);
  cublasStatus_t why = CUBLAS_STATUS_SUCCESS;
  if (!c->plan.pick(handle_, &c->algo, &why))
    throw std::runtime_error("cuBLASLt has no algorithm for this FP8 product (" + status_text(why) + ")");
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  // Tuned: products of up to kTuneRows rows (a decoding step's, whose few padded sizes repeat
  // every step), at most kTuneShapes shapes an instance; a prefill's row counts vary from step to
  // step and would pay the timing again and again.
  if (g.autotune && g.beta == 0.0f && g.M <= kTuneRows && tuned_ < kTuneShapes &&
      cudaStreamIsCapturing(st, &cap) == cudaSuccess && cap == cudaStreamCaptureStatusNone) {
    ++tuned_;
    const std::vector<cublasLtMatmulHeuristicResult_t> cands = c->plan.candidates(handle_, 8);
    if (cands.size() > 1) {
      c->plan.set_scales(g);
      c->algo = cands[fastest(c->plan, handle_, g, cands, ws, st)];
    }
  }
  return *cache_.emplace(key, std::move(c)).first->second;
}

void Gemm::run(const GemmArgs& g, void* ws, cudaStream_t st) const {
  std::lock_guard<std::mutex> lock(mu_);
  Cached& c = plan(g, ws, st);
  c.plan.set_scales(g);
  c.plan.run(handle_, g, c.algo, ws, st);
}

}  // namespace vfp8
