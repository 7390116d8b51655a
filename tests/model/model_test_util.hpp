// Helpers shared by the model tests: fixture location, scratch folders, raw file edits.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace rlh::test {

// $RLHOST_FIXTURES, else the compiled-in default.
std::filesystem::path fixtures_dir();
// Model fixture folders (those holding a config.json), sorted.
std::vector<std::filesystem::path> model_fixture_dirs();

// A fresh empty folder under the system temp dir, removed by the destructor.
class ScratchDir {
 public:
  ScratchDir();
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

std::string read_file(const std::filesystem::path& p);
void write_file(const std::filesystem::path& p, const std::string& bytes);

// A safetensors image from a header JSON text and a data section (length prefix added; no
// padding, so callers control every byte).
std::string safetensors_image(const std::string& header_json, const std::string& data);

}  // namespace rlh::test
