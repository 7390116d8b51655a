// Fuzzes the jsonl dataset as a user's file reaches it: the input is the file, indexed as
// NeMo-RL's ResponseDataset (input/output rows, or a file of 'messages' conversations, which its
// first row decides) and as both preference layouts, with a prompt file; every row is read back.
// Every problem must be one sdk::Error of one line; nothing may crash, hang or grow unbounded.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "rlhost/dataset_jsonl/jsonl_dataset.hpp"
#include "rlhost/sdk/status.hpp"

namespace fs = std::filesystem;

namespace {

struct Scratch {
  fs::path root = fs::temp_directory_path() / ("rlh_fuzz_jsonl_" + std::to_string(::getpid()));
  fs::path file = root / "data.jsonl";
  fs::path prompt = root / "prompt.txt";
  Scratch() {
    fs::create_directories(root);
    std::ofstream(prompt) << "Q: {}";
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Scratch scratch;
  std::ofstream(scratch.file, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data),
                                                                        static_cast<std::streamsize>(size));
  const nlohmann::json configs[] = {
      {{"data_path", scratch.file.string()}, {"prompt_file", scratch.prompt.string()}},
      {{"data_path", scratch.file.string()}, {"input_key", "problem"}, {"output_key", "answer"}},
      {{"data_path", scratch.file.string()}, {"dataset_name", "BinaryPreferenceDataset"}},
      {{"data_path", scratch.file.string()}, {"dataset_name", "PreferenceDataset"}},
      {{"data_path", scratch.file.string()}, {"split_validation_size", 0.5}, {"split", "validation"}}};
  for (const auto& cfg : configs) {
    try {
      rlh::dataset_jsonl::JsonlDataset d(cfg);
      for (int64_t i = 0; i < d.size() && i < 64; ++i) {
        const std::string row = d.row_json(i);
        if (!nlohmann::json::accept(row)) __builtin_trap();  // rows are valid JSON objects
      }
    } catch (const rlh::sdk::Error& e) {
      const std::string m = e.what();
      if (m.empty() || m.find('\n') != std::string::npos) __builtin_trap();
    }
  }
  return 0;
}
