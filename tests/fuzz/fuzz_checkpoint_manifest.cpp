// Fuzzes checkpoint verification as a resume meets a damaged or hostile folder: the input is a
// checkpoint_manifest.json, NUL, a training_info.json. Both are written into a step_3/ folder
// (with one small file) and verified at both levels. Every problem must be a one-line
// VerifyResult error; no path may leave the folder, nothing may crash.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "rlhost/sdk/checkpoint.hpp"

namespace fs = std::filesystem;

namespace {

// The scratch folder, removed when the fuzzer exits normally (libFuzzer ends with exit()).
struct Scratch {
  fs::path root = fs::temp_directory_path() / ("rlh_fuzz_ckpt_" + std::to_string(::getpid()));
  fs::path dir = root / "step_3";
  Scratch() {
    fs::create_directories(dir / "policy");
    std::ofstream(dir / "policy" / "w.bin", std::ios::binary) << "weights";
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Scratch scratch;
  const fs::path& dir = scratch.dir;
  const std::string in(reinterpret_cast<const char*>(data), size);
  const size_t nul = in.find('\0');
  std::ofstream(dir / rlh::sdk::kCheckpointManifest, std::ios::binary | std::ios::trunc) << in.substr(0, nul);
  std::ofstream(dir / "training_info.json", std::ios::binary | std::ios::trunc)
      << (nul == std::string::npos ? std::string("{\"step\": 3}") : in.substr(nul + 1));
  (void)rlh::sdk::parse_manifest(in.substr(0, nul), "manifest");
  for (auto level : {rlh::sdk::VerifyLevel::kSizes, rlh::sdk::VerifyLevel::kChecksums}) {
    const auto v = rlh::sdk::verify_checkpoint(dir, level);
    if (!v.ok && (v.error.empty() || v.error.find('\n') != std::string::npos)) __builtin_trap();
  }
  return 0;
}
