// Fuzzes encode/decode on real tokenizers: the first input byte picks one (byte-level Llama-3 and
// GPT-2 styles, SentencePiece-style with byte fallback, the component-heavy one), the rest is the
// text. Byte-level tokenizers without normalizer must round-trip: decode(encode(t)) == t.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "rlhost/tokenizer/tokenizer.hpp"

namespace {

struct Entry {
  std::unique_ptr<rlh::tok::Tokenizer> tok;
  bool lossless;
};

std::vector<Entry>& tokenizers() {
  static std::vector<Entry> all = [] {
    std::vector<Entry> v;
    const std::filesystem::path fx = RLH_FUZZ_FIXTURES, data = RLH_FUZZ_TOK_DATA;
    const std::pair<std::filesystem::path, bool> files[] = {
        {fx / "tokenizer-llama3" / "tokenizer.json", true}, {fx / "tokenizer-spbpe" / "tokenizer.json", false},
        {data / "gpt2" / "tokenizer.json", true},           {data / "mistral" / "tokenizer.json", false},
        {data / "misc" / "tokenizer.json", false},          {data / "qwen2" / "tokenizer.json", false}};
    for (const auto& [p, lossless] : files) {
      if (std::filesystem::exists(p)) {
        v.push_back({std::make_unique<rlh::tok::Tokenizer>(rlh::tok::Tokenizer::from_file(p)), lossless});
      }
    }
    if (v.empty()) __builtin_trap();  // nothing to fuzz: the paths are wrong
    return v;
  }();
  return all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  auto& all = tokenizers();
  const Entry& e = all[data[0] % all.size()];
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    const auto ids = e.tok->encode(text, (data[0] & 0x80) != 0);
    const std::string back = e.tok->decode(ids, false);
    if (e.lossless && (data[0] & 0x80) == 0 && back != text) __builtin_trap();
    // Arbitrary ids (from the raw bytes) must decode without trouble too.
    std::vector<int32_t> raw;
    for (size_t i = 1; i + 1 < size; i += 2) raw.push_back(static_cast<int32_t>(data[i] | (data[i + 1] << 8)));
    (void)e.tok->decode(raw, (data[0] & 1) != 0);
  } catch (const std::invalid_argument&) {
    // invalid UTF-8 input is rejected by design
  }
  return 0;
}
