// Loading OpenBLAS at run time with a core type chosen from cpuid, and verifying it
// (the why and the rules are in blas.hpp).
#include "rlhost/kernels_cpu/blas.hpp"

#include <dlfcn.h>  // dlopen, dlsym

#include <algorithm>
#include <atomic>
#include <cctype>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "gemm_internal.hpp"  // SgemmFn, sgemm_builtin
#include "rlhost/kernels_cpu/kernels.hpp"  // gemm_naive

namespace rlh::kcpu {
namespace {

// cblas enums (cblas.h), spelled out so we need no OpenBLAS header at build time.
constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112;
using CblasSgemm = void (*)(int order, int ta, int tb, int M, int N, int K, float alpha,
                            const float* A, int lda, const float* B, int ldb, float beta, float* C,
                            int ldc);
using SetThreads = void (*)(int);
using GetString = char* (*)();

CblasSgemm g_cblas_sgemm = nullptr;
std::atomic<bool> g_openblas_ok{false};
std::atomic<int> g_backend{static_cast<int>(GemmBackend::builtin)};

void sgemm_via_openblas(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                        const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                        float* C, int64_t ldc) {
  // Debian's OpenBLAS uses 32-bit ints; anything bigger goes to the builtin kernel.
  if (M > INT_MAX || N > INT_MAX || K > INT_MAX || lda > INT_MAX || ldb > INT_MAX ||
      ldc > INT_MAX) {
    detail::sgemm_builtin(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  g_cblas_sgemm(kCblasRowMajor, ta ? kCblasTrans : kCblasNoTrans, tb ? kCblasTrans : kCblasNoTrans,
                int(M), int(N), int(K), alpha, A, int(lda), B, int(ldb), beta, C, int(ldc));
}

bool iequals(const std::string& a, const char* b) {
  std::string bb(b);
  if (a.size() != bb.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(bb[i])))
      return false;
  return true;
}

// Sets an environment variable for the scope and restores the previous state after.
class EnvOverride {
 public:
  EnvOverride(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      had_ = true;
      old_ = old;
    }
    setenv(name, value.c_str(), 1);
  }
  ~EnvOverride() {
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

// Small problems covering every transpose case, alpha/beta, beta = 0 over NaN, and sizes that
// are not multiples of any kernel tile. Returns "" or what went wrong.
std::string verify_sgemm(detail::SgemmFn fn) {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> U(-1.f, 1.f);
  const int64_t shapes[][3] = {{37, 53, 71}, {64, 64, 64}, {1, 129, 33}, {130, 1, 17}, {5, 7, 300}};
  for (auto& s : shapes) {
    const int64_t M = s[0], N = s[1], K = s[2];
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      for (int b = 0; b < 2; ++b) {
        const float alpha = 0.75f, beta = b ? 0.5f : 0.0f;
        std::vector<float> A(M * K), B(K * N), C(M * N), R(M * N);
        for (auto& x : A) x = U(rng);
        for (auto& x : B) x = U(rng);
        for (size_t i = 0; i < C.size(); ++i) C[i] = R[i] = b ? U(rng) : NAN;
        const int64_t lda = ta ? M : K, ldb = tb ? K : N;
        fn(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(), N);
        gemm_naive<float>(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, R.data(), N);
        double maxref = 0, maxerr = 0;
        for (size_t i = 0; i < C.size(); ++i) {
          maxref = std::max(maxref, double(std::fabs(R[i])));
          const double e = std::fabs(double(C[i]) - R[i]);
          maxerr = std::isnan(e) ? INFINITY : std::max(maxerr, e);
        }
        if (!(maxerr <= 1e-5 * maxref))
          return "sgemm mismatch on M=" + std::to_string(M) + " N=" + std::to_string(N) +
                 " K=" + std::to_string(K) + " ta=" + std::to_string(ta) +
                 " tb=" + std::to_string(tb) + " beta=" + std::to_string(beta) +
                 ": max error " + std::to_string(maxerr) + " vs max |ref| " +
                 std::to_string(maxref);
      }
    }
  }
  return "";
}

BlasInfo load_openblas() {
  BlasInfo info;
  if (const char* want = std::getenv("RLH_KCPU_BLAS"); want && std::string(want) == "builtin") {
    info.error = "RLH_KCPU_BLAS=builtin";
    return info;
  }
  const char* lib_env = std::getenv("RLH_KCPU_OPENBLAS");
  const std::string lib = lib_env && *lib_env ? lib_env : "libopenblas.so.0";
  info.library = lib;

  const char* user = std::getenv("OPENBLAS_CORETYPE");
  info.coretype_user = user ? user : "";
  info.coretype_used =
      openblas_coretype_choice(user, cpu_features().level, &info.decision);

  void* handle = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (handle) {
    info.already_loaded = true;
    info.decision = "OpenBLAS was already loaded in this process; its core type was chosen by "
                    "that load (OPENBLAS_CORETYPE not applied)";
    info.coretype_used = info.coretype_user;
  } else {
    // Set the variables only for the constructor that runs inside dlopen.
    std::unique_ptr<EnvOverride> core, threads;
    if (!info.coretype_used.empty() && info.coretype_used != info.coretype_user)
      core = std::make_unique<EnvOverride>("OPENBLAS_CORETYPE", info.coretype_used);
    if (!std::getenv("OPENBLAS_NUM_THREADS"))
      threads = std::make_unique<EnvOverride>("OPENBLAS_NUM_THREADS", "1");
    handle = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  }
  if (!handle) {
    const char* e = dlerror();
    info.error = "dlopen(" + lib + ") failed: " + (e ? e : "?");
    return info;
  }
  g_cblas_sgemm = reinterpret_cast<CblasSgemm>(dlsym(handle, "cblas_sgemm"));
  auto set_threads = reinterpret_cast<SetThreads>(dlsym(handle, "openblas_set_num_threads"));
  auto corename = reinterpret_cast<GetString>(dlsym(handle, "openblas_get_corename"));
  auto config = reinterpret_cast<GetString>(dlsym(handle, "openblas_get_config"));
  if (!g_cblas_sgemm) {
    info.error = lib + " has no cblas_sgemm";
    return info;
  }
  // Calls come from our own threads, one problem part each.
  if (set_threads) set_threads(1);
  if (corename) info.corename = corename();
  if (config) info.config = config();
  info.error = verify_sgemm(sgemm_via_openblas);
  info.verified = info.error.empty();
  if (info.verified) {
    g_openblas_ok = true;
    info.backend = GemmBackend::openblas;
    g_backend = static_cast<int>(GemmBackend::openblas);
  }
  return info;
}

}  // namespace

std::string openblas_coretype_choice(const char* user, SimdLevel level, std::string* why) {
  std::string best;
  switch (level) {
    case SimdLevel::avx512: best = "SkylakeX"; break;
    case SimdLevel::avx2: best = "Haswell"; break;
    default:
      if (cpu_features().avx && cpu_features().os_ymm) best = "Sandybridge";
      break;
  }
  std::string w;
  std::string out;
  if (user && *user) {
    if (iequals(user, "Prescott") && !best.empty()) {
      out = best;
      w = std::string("OPENBLAS_CORETYPE=") + user + " is the known-slow SSE3 fallback; replaced by " +
          best + " from cpuid (" + to_string(level) + ")";
    } else {
      out = user;
      w = std::string("OPENBLAS_CORETYPE=") + user + " set by the user; respected";
    }
  } else if (!best.empty()) {
    out = best;
    w = "OPENBLAS_CORETYPE unset; set to " + best + " from cpuid (" + to_string(level) + ")";
  } else {
    w = "OPENBLAS_CORETYPE unset and no AVX: left to OpenBLAS's own detection";
  }
  if (why) *why = w;
  return out;
}

const BlasInfo& blas_info() {
  static const BlasInfo info = load_openblas();
  return info;
}

std::string blas_info_string() {
  const BlasInfo& b = blas_info();
  std::string s = std::string("gemm backend: ") +
                  (b.backend == GemmBackend::openblas ? "openblas" : "builtin");
  if (!b.library.empty()) s += "; library " + b.library;
  if (!b.decision.empty()) s += "; " + b.decision;
  if (!b.corename.empty()) s += "; core " + b.corename;
  if (!b.config.empty()) s += "; config '" + b.config + "'";
  s += b.verified ? "; verified against naive gemm" : "";
  if (!b.error.empty()) s += "; not used: " + b.error;
  s += "; simd " + std::string(to_string(cpu_features().level));
  return s;
}

GemmBackend gemm_backend_set(GemmBackend b) {
  blas_info();
  GemmBackend old = gemm_backend();
  if (b == GemmBackend::openblas && !g_openblas_ok) return old;
  g_backend = static_cast<int>(b);
  return old;
}

GemmBackend gemm_backend() {
  blas_info();
  return static_cast<GemmBackend>(g_backend.load());
}

namespace detail {
SgemmFn sgemm_openblas() {
  blas_info();
  return g_openblas_ok ? sgemm_via_openblas : nullptr;
}
}  // namespace detail

}  // namespace rlh::kcpu
