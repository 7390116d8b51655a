// Fuzzes the tokenizer.json loader, then drives whatever loads through encode and decode.
// A bad file must end in std::runtime_error (one-line message); anything else -- a crash, a
// sanitizer report, another exception type, a hang -- is a finding.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "rlhost/tokenizer/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    auto tok = rlh::tok::Tokenizer::from_json_string(text);
    for (const char* s : {"Hello, world! 123", "  a\n\tb  ", "<s>x</s> ▁y", "中文🙂é", ""}) {
      try {
        const auto ids = tok.encode(s, true);
        (void)tok.decode(ids, false);
        (void)tok.decode(ids, true);
      } catch (const std::runtime_error&) {
      }
    }
    std::vector<int32_t> ids;
    for (int32_t i = -2; i < 300; ++i) ids.push_back(i);
    (void)tok.decode(ids, false);
    (void)tok.vocab_size();
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    if (m.empty() || m.find('\n') != std::string::npos) __builtin_trap();  // messages are one line
  }
  return 0;
}
