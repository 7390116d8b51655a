// dlopen of libcudnn.so.9 (cudnn_lib.hpp).
#include "cudnn_lib.hpp"

#include <dlfcn.h>
#include <glob.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

namespace rlh::kcudnn {
namespace {

constexpr const char* kSoname = "libcudnn.so.9";

// Folders matching a shell pattern, in glob's (sorted) order.
void add_glob(std::vector<std::string>& out, const std::string& pattern) {
  glob_t g{};
  if (glob(pattern.c_str(), GLOB_ONLYDIR | GLOB_NOSORT, nullptr, &g) == 0) {
    std::vector<std::string> found(g.gl_pathv, g.gl_pathv + g.gl_pathc);
    std::sort(found.rbegin(), found.rend());  // python3.12 before python3.11: the newest first
    for (const std::string& f : found) out.push_back(f + "/" + kSoname);
  }
  globfree(&g);
}

template <class F>
void sym(void* lib, const char* name, F& f, std::string& missing) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  if (f == nullptr) missing += std::string(missing.empty() ? "" : ", ") + name;
}

}  // namespace

std::vector<std::string> cudnn_candidates() {
  std::vector<std::string> c;
  if (const char* env = std::getenv("RLH_CUDNN_LIB"); env && *env) {
    const std::string e = env;
    // A folder or a file: a path ending in ".so..." is the library itself.
    c.push_back(e.find(".so") != std::string::npos ? e : e + "/" + kSoname);
  }
  c.push_back(kSoname);  // the default loader path (ld.so.cache, LD_LIBRARY_PATH, RUNPATH)
  if (const char* ld = std::getenv("LD_LIBRARY_PATH"); ld && *ld) {
    std::string s = ld;
    for (size_t p = 0; p <= s.size();) {
      const size_t q = std::min(s.find(':', p), s.size());
      if (q > p) c.push_back(s.substr(p, q - p) + "/" + kSoname);
      p = q + 1;
    }
  }
  c.push_back(std::string("/usr/local/cuda/lib64/") + kSoname);
  const std::string wheel = "nvidia/cudnn/lib";
  for (const char* prefix : {"VIRTUAL_ENV", "CONDA_PREFIX"})
    if (const char* p = std::getenv(prefix); p && *p) add_glob(c, std::string(p) + "/lib/python3*/site-packages/" + wheel);
  if (const char* home = std::getenv("HOME"); home && *home) {
    add_glob(c, std::string(home) + "/.local/lib/python3*/site-packages/" + wheel);
    add_glob(c, std::string(home) + "/.pyenv/versions/*/lib/python3*/site-packages/" + wheel);
  }
  for (const char* pattern : {"/usr/local/lib/python3*/dist-packages/", "/usr/local/lib/python3*/site-packages/",
                              "/usr/lib/python3/dist-packages/", "/usr/lib/python3*/site-packages/",
                              "/opt/conda/lib/python3*/site-packages/", "/opt/*/lib/python3*/site-packages/",
                              "/root/.pyenv/versions/*/lib/python3*/site-packages/"})
    add_glob(c, std::string(pattern) + wheel);
  // The same file reached twice is tried once.
  std::vector<std::string> unique;
  for (const std::string& p : c)
    if (std::find(unique.begin(), unique.end(), p) == unique.end()) unique.push_back(p);
  return unique;
}

std::string CudnnLib::version_string() const {
  return std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) + "." +
         std::to_string(version % 100);
}

std::string CudnnLib::error(cudnnStatus_t s) const {
  std::string m = GetErrorString ? GetErrorString(s) : ("cudnnStatus " + std::to_string(int(s)));
  if (GetLastErrorString) {
    char buf[512] = {0};
    GetLastErrorString(buf, sizeof(buf));
    std::string last = buf;
    for (char& ch : last)
      if (ch == '\n' || ch == '\r') ch = ' ';
    if (!last.empty()) m += ": " + last;
  }
  return m;
}

const CudnnLib& cudnn_lib() {
  static std::once_flag once;
  static CudnnLib lib;
  static std::string error;
  std::call_once(once, [] {
    // The first candidate that loads, has every function and is new enough wins; the reasons
    // of the others make the one-line error when none does.
    std::string tried;
    for (const std::string& path : cudnn_candidates()) {
      void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!h) {
        const char* e = dlerror();
        std::string why = e ? e : "not found";
        // dlerror repeats the path; keep its reason only.
        if (const size_t k = why.rfind(": "); k != std::string::npos) why = why.substr(k + 2);
        tried += (tried.empty() ? "" : "; ") + path + " (" + why + ")";
        continue;
      }
      CudnnLib l;
      l.path = path;
      std::string missing;
      sym(h, "cudnnGetVersion", l.GetVersion, missing);
      sym(h, "cudnnGetErrorString", l.GetErrorString, missing);
      sym(h, "cudnnCreate", l.Create, missing);
      sym(h, "cudnnDestroy", l.Destroy, missing);
      sym(h, "cudnnSetStream", l.SetStream, missing);
      sym(h, "cudnnBackendCreateDescriptor", l.BackendCreateDescriptor, missing);
      sym(h, "cudnnBackendDestroyDescriptor", l.BackendDestroyDescriptor, missing);
      sym(h, "cudnnBackendFinalize", l.BackendFinalize, missing);
      sym(h, "cudnnBackendSetAttribute", l.BackendSetAttribute, missing);
      sym(h, "cudnnBackendGetAttribute", l.BackendGetAttribute, missing);
      sym(h, "cudnnBackendExecute", l.BackendExecute, missing);
      l.GetLastErrorString = reinterpret_cast<void (*)(char*, size_t)>(dlsym(h, "cudnnGetLastErrorString"));
      if (!missing.empty()) {
        tried += (tried.empty() ? "" : "; ") + path + " (lacks " + missing + ")";
        continue;  // left loaded: a library is never unloaded while anything may point into it
      }
      l.version = l.GetVersion();
      if (l.version / 10000 != 9 || l.version < kMinCudnnVersion) {
        tried += (tried.empty() ? "" : "; ") + path + " (cuDNN " + l.version_string() + ", needs 9.6+ within 9.x)";
        continue;
      }
      // The frontend refuses bf16 attention on these two: known wrong results.
      if (l.version == 91000 || l.version == 91001) {
        tried += (tried.empty() ? "" : "; ") + path + " (cuDNN " + l.version_string() + ": known attention bugs)";
        continue;
      }
      lib = l;
      return;
    }
    error = std::string("cannot load a usable ") + kSoname + " (set RLH_CUDNN_LIB to its file or folder); tried " + tried;
  });
  if (!error.empty()) throw std::runtime_error(error);
  return lib;
}

}  // namespace rlh::kcudnn
