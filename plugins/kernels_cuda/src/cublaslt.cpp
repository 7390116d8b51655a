// dlopen of cuBLASLt (see cublaslt.hpp).
#include "cublaslt.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace rlh::kcuda {
namespace {

template <class F>
void sym(void* lib, const char* name, F& f, std::string& missing) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  if (f == nullptr) missing += std::string(missing.empty() ? "" : ", ") + name;
}

}  // namespace

const CublasLt& cublaslt() {
  static std::once_flag once;
  static CublasLt lt;
  static std::string error;
  std::call_once(once, [] {
    std::vector<std::string> names;
    if (const char* env = std::getenv("RLH_CUBLASLT"); env && *env) names.push_back(env);
    names.push_back("libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR));
    names.push_back("/usr/local/cuda/lib64/libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR));
    names.push_back("libcublasLt.so");
    void* lib = nullptr;
    std::string tried;
    for (const std::string& n : names) {
      lib = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib) {
        lt.path = n;
        break;
      }
      const char* e = dlerror();
      tried += "\n  " + n + ": " + (e ? e : "not found");
    }
    if (!lib) {
      error = "cannot load cuBLASLt (set RLH_CUBLASLT to its path); tried:" + tried;
      return;
    }
    std::string missing;
    sym(lib, "cublasLtGetVersion", lt.GetVersion, missing);
    sym(lib, "cublasLtCreate", lt.Create, missing);
    sym(lib, "cublasLtDestroy", lt.Destroy, missing);
    sym(lib, "cublasLtMatmulDescCreate", lt.MatmulDescCreate, missing);
    sym(lib, "cublasLtMatmulDescDestroy", lt.MatmulDescDestroy, missing);
    sym(lib, "cublasLtMatmulDescSetAttribute", lt.MatmulDescSetAttribute, missing);
    sym(lib, "cublasLtMatrixLayoutCreate", lt.MatrixLayoutCreate, missing);
    sym(lib, "cublasLtMatrixLayoutDestroy", lt.MatrixLayoutDestroy, missing);
    sym(lib, "cublasLtMatrixLayoutSetAttribute", lt.MatrixLayoutSetAttribute, missing);
    sym(lib, "cublasLtMatmulPreferenceCreate", lt.MatmulPreferenceCreate, missing);
    sym(lib, "cublasLtMatmulPreferenceDestroy", lt.MatmulPreferenceDestroy, missing);
    sym(lib, "cublasLtMatmulPreferenceSetAttribute", lt.MatmulPreferenceSetAttribute, missing);
    sym(lib, "cublasLtMatmulAlgoGetHeuristic", lt.MatmulAlgoGetHeuristic, missing);
    sym(lib, "cublasLtMatmul", lt.Matmul, missing);
    if (!missing.empty()) error = lt.path + " lacks " + missing;
    else if (lt.GetVersion() / 10000 != CUBLAS_VER_MAJOR)
      error = lt.path + " is version " + std::to_string(lt.GetVersion()) + "; built against " +
              std::to_string(CUBLAS_VERSION);
  });
  if (!error.empty()) throw std::runtime_error(error);
  return lt;
}

}  // namespace rlh::kcuda
