// Fuzzes normalizers and pre-tokenizers: the input is a normalizer JSON, NUL, a pre-tokenizer
// JSON, NUL, and a text. They are put into a tokenizer.json with a byte-fallback BPE model (any
// text encodes) and the text is encoded. Chains that multiply the text must stop at 16x the
// input with a one-line std::runtime_error; nothing may crash, hang or run out of memory.
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "rlhost/tokenizer/tokenizer.hpp"

namespace {

const nlohmann::json& model() {
  static const nlohmann::json m = [] {
    nlohmann::json vocab = nlohmann::json::object();
    vocab["<unk>"] = 0;
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      vocab[name] = b + 1;
    }
    return nlohmann::json{{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()},
                          {"byte_fallback", true}, {"unk_token", "<unk>"}};
  }();
  return m;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in(reinterpret_cast<const char*>(data), size);
  const size_t a = in.find('\0');
  const size_t b = a == std::string::npos ? std::string::npos : in.find('\0', a + 1);
  if (b == std::string::npos) return 0;
  const auto norm = nlohmann::json::parse(in.substr(0, a), nullptr, false);
  const auto pre = nlohmann::json::parse(in.substr(a + 1, b - a - 1), nullptr, false);
  if (norm.is_discarded() || pre.is_discarded()) return 0;
  const std::string text = in.substr(b + 1);
  nlohmann::json tj = {{"version", "1.0"}, {"normalizer", norm}, {"pre_tokenizer", pre}, {"model", model()}};
  try {
    auto tok = rlh::tok::Tokenizer::from_json_string(tj.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    for (const std::string& s : {text, text + text, std::string("a b  c")}) {
      try {
        (void)tok.encode(s, false);
      } catch (const std::invalid_argument&) {  // input not UTF-8
      } catch (const std::runtime_error& e) {
        const std::string m = e.what();
        if (m.empty() || m.find('\n') != std::string::npos) __builtin_trap();
      }
    }
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    if (m.empty() || m.find('\n') != std::string::npos) __builtin_trap();
  }
  return 0;
}
