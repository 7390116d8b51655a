// Fuzzes the config tree end to end. The input is split at NUL bytes: part 0 is main.yaml,
// part 1 is b.yaml (so `defaults:` chains, including cycles, are reachable), the remaining parts
// are command-line overrides. Loading, overriding, resolving and printing must either succeed or
// throw ConfigError — any other exception, crash, hang or runaway recursion is a finding.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "config.hpp"

namespace fs = std::filesystem;

static fs::path workdir() {
  static fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("rlh_fuzz_config_" + std::to_string(getpid()));
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> parts(1);
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0) parts.emplace_back();
    else parts.back() += static_cast<char>(data[i]);
  }
  const fs::path dir = workdir();
  std::ofstream(dir / "main.yaml", std::ios::binary | std::ios::trunc) << parts[0];
  std::ofstream(dir / "b.yaml", std::ios::binary | std::ios::trunc) << (parts.size() > 1 ? parts[1] : "");
  rlh::host::Config cfg;
  try {
    cfg.load_file(dir / "main.yaml");
    for (size_t i = 2; i < parts.size() && i < 16; ++i) cfg.apply_override(parts[i]);
    rlh::host::Json r = cfg.resolved();
    (void)rlh::host::to_yaml(r);
    std::vector<std::string> keys;
    rlh::host::collect_keys(r, "", keys);
  } catch (const rlh::host::ConfigError&) {
  }
  return 0;
}
