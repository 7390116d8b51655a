// gemm on cuBLASLt: bf16 operands with fp32 accumulation (CUBLAS_COMPUTE_32F; C bf16 or f32),
// or f32 operands in true fp32 (CUBLAS_COMPUTE_32F_PEDANTIC: no TF32 down-conversion, whatever
// the environment says) unless tf32 is asked for (CUBLAS_COMPUTE_32F_FAST_TF32). Row-major
// C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T. Plans (layouts, the
// heuristic's algorithm, or for large products the fastest of its candidates: tune() below) are
// cached per shape/stride/alignment; problems cuBLASLt has no algorithm for (odd strides of bf16
// rows, say) run on the SIMT fallback.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "cublaslt.hpp"
#include "rlhost/kernels_cuda/kernels.hpp"

namespace rlh::kcuda {

namespace {

void ck(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLASLt ") + what + " failed (status " +
                             std::to_string(int(s)) + ")");
}

int align_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  int al = 1;
  while (al < 256 && a % uintptr_t(al * 2) == 0) al *= 2;
  return al;
}

cudaDataType_t cu_type(DType t) { return t == DType::f32 ? CUDA_R_32F : CUDA_R_16BF; }

constexpr size_t kLtWorkspace = 32u << 20;

struct Plan {
  bool ok = false;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  std::vector<cublasLtMatmulHeuristicResult_t> cands;  // the heuristic's, best first
};

constexpr int kTuneCandidates = 8;
constexpr int kTuneShapes = 64;
constexpr float kTuneMargin = 1.03f;  // a candidate must be 3% faster than the first pick

using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       int64_t, int64_t, int64_t, int64_t, int>;

}  // namespace

class GemmEngine {
 public:
  explicit GemmEngine(const DeviceInfo& dev) : lt_(cublaslt()), dev_(dev) {
    ck(lt_.Create(&handle_), "create");
    info_ = "cuBLASLt " + std::to_string(lt_.GetVersion()) + " from " + lt_.path;
  }
  ~GemmEngine() {
    for (auto& [k, p] : plans_) {
      if (p->desc) lt_.MatmulDescDestroy(p->desc);
      if (p->a) lt_.MatrixLayoutDestroy(p->a);
      if (p->b) lt_.MatrixLayoutDestroy(p->b);
      if (p->c) lt_.MatrixLayoutDestroy(p->c);
    }
    lt_.Destroy(handle_);
  }
  const char* info() const { return info_.c_str(); }

  // Returns false when cuBLASLt has no algorithm (the caller falls back).
  bool run(const GemmArgs& g, Workspace& ws, cudaStream_t s) {
    const int flags = int(g.ta) | int(g.tb) << 1 | int(g.ab) << 2 | int(g.c_dt) << 3 |
                      int(g.allow_tf32) << 4 | int(g.bias != nullptr) << 5 |
                      int(g.bias_dt) << 6;
    const int64_t al = int64_t(align_of(g.A)) | int64_t(align_of(g.B)) << 9 |
                       int64_t(align_of(g.C)) << 18 | int64_t(g.bias ? align_of(g.bias) : 0) << 27;
    const Key key{flags, g.M, g.N, g.K, g.lda, g.ldb, g.ldc, g.batch, g.stride_a, g.stride_b,
                  g.stride_c, al, g.Cin ? align_of(g.Cin) : 0};
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(key);
    if (it == plans_.end()) {
      it = plans_.emplace(key, make_plan(g)).first;
      if (it->second->ok) tune(*it->second, g, ws, s);
      it->second->cands = {};  // only tuning reads them
    }
    Plan& p = *it->second;
    if (!p.ok) return false;
    if (g.bias)
      ck(lt_.MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias,
                                    sizeof(g.bias)),
         "bias pointer");
    const float alpha = float(g.alpha), beta = float(g.beta);
    void* work = p.workspace ? ws.get(p.workspace) : nullptr;
    ck(lt_.Matmul(handle_, p.desc, &alpha, g.B, p.a, g.A, p.b, &beta, g.Cin ? g.Cin : g.C, p.c, g.C, p.c, &p.algo,
                  work, p.workspace, s),
       "matmul");
    return true;
  }

 private:
  std::unique_ptr<Plan> make_plan(const GemmArgs& g) {
    auto p = std::make_unique<Plan>();
    const cublasComputeType_t ct = g.ab == DType::bf16 ? CUBLAS_COMPUTE_32F
                                   : g.allow_tf32      ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                       : CUBLAS_COMPUTE_32F_PEDANTIC;
    ck(lt_.MatmulDescCreate(&p->desc, ct, CUDA_R_32F), "desc");
    const cublasOperation_t opa = g.tb ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS A = our B
    const cublasOperation_t opb = g.ta ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS B = our A
    ck(lt_.MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)), "transa");
    ck(lt_.MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)), "transb");
    if (g.bias) {
      const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
      const cudaDataType_t bt = cu_type(g.bias_dt);
      ck(lt_.MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)), "epilogue");
      ck(lt_.MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)), "bias type");
    }
    // Stored (column-major) shapes: cuBLAS A = our B, cuBLAS B = our A, C^T.
    const uint64_t a_rows = g.tb ? g.K : g.N, a_cols = g.tb ? g.N : g.K;
    const uint64_t b_rows = g.ta ? g.M : g.K, b_cols = g.ta ? g.K : g.M;
    ck(lt_.MatrixLayoutCreate(&p->a, cu_type(g.ab), a_rows, a_cols, g.ldb), "layout B");
    ck(lt_.MatrixLayoutCreate(&p->b, cu_type(g.ab), b_rows, b_cols, g.lda), "layout A");
    ck(lt_.MatrixLayoutCreate(&p->c, cu_type(g.c_dt), g.N, g.M, g.ldc), "layout C");
    if (g.batch > 1) {
      const int32_t n = int32_t(g.batch);
      for (auto [l, st] : {std::pair{p->a, g.stride_b}, std::pair{p->b, g.stride_a},
                           std::pair{p->c, g.stride_c}}) {
        ck(lt_.MatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof(n)), "batch");
        ck(lt_.MatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &st, sizeof(st)),
           "batch stride");
      }
    }
    cublasLtMatmulPreference_t pref = nullptr;
    ck(lt_.MatmulPreferenceCreate(&pref), "preference");
    const uint64_t wsb = kLtWorkspace;
    const uint32_t aa = uint32_t(align_of(g.A)), ab = uint32_t(align_of(g.B)),
                   ac = uint32_t(std::min(align_of(g.C), g.Cin ? align_of(g.Cin) : 256));
    lt_.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb));
    lt_.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &ab, sizeof(ab));
    lt_.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &aa, sizeof(aa));
    lt_.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof(ac));
    lt_.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof(ac));
    int found = 0;
    p->cands.resize(tune_wanted(g) ? kTuneCandidates : 1);
    const cublasStatus_t st = lt_.MatmulAlgoGetHeuristic(handle_, p->desc, p->a, p->b, p->c, p->c, pref,
                                                         int(p->cands.size()), p->cands.data(), &found);
    lt_.MatmulPreferenceDestroy(pref);
    p->cands.resize(st == CUBLAS_STATUS_SUCCESS ? size_t(std::max(found, 0)) : 0);
    if (!p->cands.empty() && p->cands[0].state == CUBLAS_STATUS_SUCCESS) {
      p->ok = true;
      p->algo = p->cands[0].algo;
      p->workspace = p->cands[0].workspaceSize;
    }
    return p;
  }

  // Tuning (on by default; RLH_KCUDA_GEMM_TUNE=0: the heuristic's first pick always, 2: and a
  // line a tuned shape on stderr). A large product's first call, outside stream capture, times
  // up to kTuneCandidates of the heuristic's algorithms on the call's own operands (C into
  // scratch when beta is not 0, so the call's result is untouched; the call itself runs after)
  // and keeps the fastest if it beats the first pick by kTuneMargin. Why: at the 1B training
  // shapes the first pick left 6-13% on gate|up, the head's logits and dW and the down
  // projection's dX (H100, 2026-12-07). The margin keeps picks that timing noise could flip on
  // the heuristic's, so two runs choose alike wherever the difference is clear; the pick still
  // rests on timings, so runs that must round alike bit for bit set 0 (the deterministic mode's
  // invariant GEMM is another op and never tuned). At most kTuneShapes shapes an instance: a
  // generator's prefill sizes vary and would pay the timing again and again.
  static int tune_mode() {
    static const int m = [] {
      const char* e = std::getenv("RLH_KCUDA_GEMM_TUNE");
      return e ? std::atoi(e) : 1;
    }();
    return m;
  }

  // Whether a new plan's product is one to time: large, and within the instance's shape budget.
  bool tune_wanted(const GemmArgs& g) const {
    const double flops = 2.0 * double(g.M) * double(g.N) * double(g.K) * double(g.batch);
    return tune_mode() && flops >= 1e10 && tuned_ < kTuneShapes;
  }

  void tune(Plan& p, const GemmArgs& g, Workspace& ws, cudaStream_t s) {
    if (p.cands.size() < 2 || !tune_wanted(g)) return;  // (one candidate: not asked for, or the only one)
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(s, &cap) != cudaSuccess || cap != cudaStreamCaptureStatusNone) return;
    size_t wmax = 0;
    for (const auto& c : p.cands) wmax = std::max(wmax, c.workspaceSize);
    void* work = nullptr;
    try {
      work = wmax ? ws.get(wmax) : nullptr;
    } catch (const std::exception&) {
      return;  // no room to time the candidates: the first pick stands
    }
    // The candidates write the call's output (it runs after them) unless beta reads it.
    void* C = g.C;
    const void* Cin = g.Cin ? g.Cin : g.C;
    void* scratch = nullptr;
    const size_t es = g.c_dt == DType::f32 ? 4 : 2;
    const size_t cbytes = (size_t(g.ldc) * size_t(g.M) + size_t(g.batch - 1) * size_t(g.stride_c)) * es;
    if (g.beta != 0.0 && !g.Cin) {
      if (cudaMalloc(&scratch, cbytes) != cudaSuccess) {
        cudaGetLastError();
        return;
      }
      C = scratch;
    }
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    const float alpha = float(g.alpha), beta = float(g.beta);
    float first = -1.f, best = -1.f;
    size_t pick = 0;
    for (size_t i = 0; i < p.cands.size(); ++i) {
      const auto& c = p.cands[i];
      if (c.state != CUBLAS_STATUS_SUCCESS) continue;
      auto call = [&] {
        return lt_.Matmul(handle_, p.desc, &alpha, g.B, p.a, g.A, p.b, &beta, scratch ? C : Cin, p.c, C, p.c,
                          &c.algo, work, c.workspaceSize, s);
      };
      if (call() != CUBLAS_STATUS_SUCCESS) continue;  // warm-up; an algorithm that fails is skipped
      cudaEventRecord(e0, s);
      bool ok = true;
      for (int r = 0; r < 3 && ok; ++r) ok = call() == CUBLAS_STATUS_SUCCESS;
      cudaEventRecord(e1, s);
      float ms = 0.f;
      if (!ok || cudaEventSynchronize(e1) != cudaSuccess || cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess) continue;
      if (i == 0) first = ms;
      if (best < 0.f || ms < best) {
        best = ms;
        pick = i;
      }
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    if (scratch) {
      cudaStreamSynchronize(s);
      cudaFree(scratch);
    }
    cudaGetLastError();
    ++tuned_;
    if (best < 0.f || first < 0.f) return;
    const bool take = pick != 0 && best * kTuneMargin <= first;  // else the first pick stands
    if (tune_mode() >= 2)
      std::fprintf(stderr, "kernels_cuda gemm tune %lldx%lldx%lld ta %d tb %d C %s beta %g: heuristic %.1f us, "
                   "candidate %zu of %zu %.1f us (%.3fx)%s\n",
                   (long long)g.M, (long long)g.N, (long long)g.K, int(g.ta), int(g.tb),
                   g.c_dt == DType::f32 ? "f32" : "bf16", g.beta, first * 1e3 / 3, pick, p.cands.size(),
                   best * 1e3 / 3, first / best, take ? ", taken" : ", within the margin: first kept");
    if (!take) return;
    p.algo = p.cands[pick].algo;
    p.workspace = p.cands[pick].workspaceSize;
  }

  const CublasLt& lt_;
  DeviceInfo dev_;
  cublasLtHandle_t handle_ = nullptr;
  std::mutex mu_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
  int tuned_ = 0;  // shapes timed so far
  std::string info_;
};

GemmEngine* gemm_engine_create(const DeviceInfo& dev) { return new GemmEngine(dev); }
void gemm_engine_destroy(GemmEngine* e) { delete e; }
const char* gemm_engine_info(GemmEngine* e) { return e ? e->info() : "none"; }

void gemm(GemmEngine* e, const GemmArgs& in, Workspace& ws, cudaStream_t s) {
  if (in.M == 0 || in.N == 0 || in.batch == 0) return;
  GemmArgs a = in;
  if (a.Cin == a.C || a.beta == 0.0) a.Cin = nullptr;  // in place, or not read
  if (a.Cin && a.batch != 1) throw std::invalid_argument("kernels_cuda gemm: a separate C input is for batch 1 only");
  if (a.Cin && (a.K == 0 || !e || std::getenv("RLH_KCUDA_GEMM_FALLBACK") || !e->run(a, ws, s))) {
    // Where cuBLASLt does not take it: Cin copied into C, then the product in place.
    const size_t es = a.c_dt == DType::f32 ? 4 : 2;
    if (cudaMemcpy2DAsync(a.C, size_t(a.ldc) * es, a.Cin, size_t(a.ldc) * es, size_t(a.N) * es, size_t(a.M),
                          cudaMemcpyDeviceToDevice, s) != cudaSuccess)
      throw std::runtime_error(std::string("kernels_cuda gemm: copying C: ") + cudaGetErrorString(cudaGetLastError()));
    a.Cin = nullptr;
  } else if (a.Cin) {
    return;  // cuBLASLt ran it
  }
  if (a.K == 0) {  // C = beta C (+ bias): no cuBLASLt call needed
    GemmArgs z = a;
    gemm_fallback(z, s);
    return;
  }
  if (gemv_rows(a, s)) return;  // a decoding step's few rows (gemv.cu)
  if (e && !std::getenv("RLH_KCUDA_GEMM_FALLBACK") && e->run(a, ws, s)) return;
  gemm_fallback(a, s);
}

}  // namespace rlh::kcuda
