// Helpers the fixture tests share: where the HF reference fixtures are, which folders hold a
// model, and the error measure every reference comparison uses. Header-only; a test target
// defines RLH_FIXTURES_DIR (the default root, tests/fixtures in the source tree).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace rlh::test {

#ifdef RLH_FIXTURES_DIR
// $RLHOST_FIXTURES, else the build's default.
inline std::string fixtures_root() {
  const char* env = std::getenv("RLHOST_FIXTURES");
  return env && *env ? env : RLH_FIXTURES_DIR;
}
#endif

// Full paths of the folders under `root` that hold a config.json and a reference.safetensors,
// sorted; none when `root` does not exist.
inline std::vector<std::string> model_folders_under(const std::string& root) {
  namespace fs = std::filesystem;
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec))
    if (e.is_directory() && fs::exists(e.path() / "config.json") &&
        fs::exists(e.path() / "reference.safetensors"))
      out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// max|got - ref| / max|ref| (infinite when a NaN appears).
template <class A, class R>
double rel_error(const A& got, const R& ref) {
  double maxref = 0, maxerr = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::fabs(double(got[i]) - double(ref[i]));
    if (std::isnan(e)) return INFINITY;
    maxref = std::max(maxref, std::fabs(double(ref[i])));
    maxerr = std::max(maxerr, e);
  }
  return maxerr / std::max(maxref, 1e-300);
}

}  // namespace rlh::test
