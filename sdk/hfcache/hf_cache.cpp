// Local Hugging Face cache lookup: see rlhost/sdk/hf_cache.hpp.
#include "rlhost/sdk/hf_cache.hpp"

#include "rlhost/sdk/input_file.hpp"

#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>

namespace rlh::sdk {

namespace fs = std::filesystem;

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// "org/name" with no empty parts, no "..", no backslashes: a plausible hub id.
bool looks_like_hub_id(std::string_view s) {
  if (s.empty() || s.front() == '/' || s.front() == '.' || s.find('\\') != std::string_view::npos) return false;
  const auto slash = s.find('/');
  if (slash == std::string_view::npos) return true;  // bare name ("gpt2")
  if (slash == 0 || slash + 1 >= s.size() || s.find('/', slash + 1) != std::string_view::npos) return false;
  return s.find("..") == std::string_view::npos;
}

std::string read_ref(const fs::path& p) {
  // A ref is one commit hash; a FIFO or device in its place is refused, not read forever.
  std::string s = sdk::read_input_file(p.string(), 4096, "HF cache ref");
  s = s.substr(0, s.find('\n'));
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}

std::string join(const std::vector<fs::path>& v) {
  std::string out;
  for (const auto& p : v) {
    if (!out.empty()) out += ", ";
    out += p.string();
  }
  return out;
}

}  // namespace

std::vector<fs::path> hf_cache_roots() {
  if (const char* c = env("HF_HUB_CACHE")) return {fs::path(c)};
  if (const char* h = env("HF_HOME")) return {fs::path(h) / "hub"};
  if (const char* home = env("HOME")) return {fs::path(home) / ".cache" / "huggingface" / "hub"};
  return {};
}

fs::path resolve_model_path(std::string_view spec) {
  std::error_code ec;
  const fs::path as_path(spec);
  if (!spec.empty() && fs::is_directory(as_path, ec)) return as_path;

  std::string_view id = spec, rev;
  if (const auto at = spec.rfind('@'); at != std::string_view::npos) {
    id = spec.substr(0, at);
    rev = spec.substr(at + 1);
  }
  const auto roots = hf_cache_roots();
  if (!looks_like_hub_id(id)) {
    throw std::runtime_error("model \"" + std::string(spec) +
                             "\": not a directory and not a hub id of the form org/name");
  }
  std::string folder = "models--";
  for (const char c : id) {
    if (c == '/') folder += "--";
    else folder += c;
  }
  std::vector<fs::path> searched;
  for (const auto& root : roots) {
    const fs::path repo = root / folder;
    const fs::path snaps = repo / "snapshots";
    searched.push_back(snaps);
    if (!fs::is_directory(snaps, ec)) continue;
    const std::string ref_name = rev.empty() ? "main" : std::string(rev);
    if (const fs::path ref = repo / "refs" / ref_name; fs::is_regular_file(ref, ec)) {
      const std::string commit = read_ref(ref);
      if (!commit.empty() && fs::is_directory(snaps / commit, ec)) return snaps / commit;
    }
    if (!rev.empty()) {
      if (fs::is_directory(snaps / std::string(rev), ec)) return snaps / std::string(rev);
      continue;
    }
    fs::path best;
    fs::file_time_type best_time{};
    for (const auto& e : fs::directory_iterator(snaps, ec)) {
      if (!e.is_directory(ec)) continue;
      const auto t = fs::last_write_time(e.path(), ec);
      if (best.empty() || t > best_time) {
        best = e.path();
        best_time = t;
      }
    }
    if (!best.empty()) return best;
  }
  throw std::runtime_error("model \"" + std::string(spec) + "\": not a local directory and not in the Hugging Face cache (searched " +
                           (searched.empty() ? std::string("no cache folder: HF_HUB_CACHE, HF_HOME and HOME are unset") : join(searched)) +
                           "; rlhost never downloads)");
}

}  // namespace rlh::sdk
