// Stop-string detection over a widening window of the latest tokens (rationale in the header).
#include "rlhost/generator/stop_strings.hpp"

#include <algorithm>
#include <stdexcept>

namespace rlh::gen {

namespace {
// Bytes of text beyond the longest stop string the window must hold, so a match that ends in
// the latest token lies entirely inside it, clear of any damage at the window's start.
constexpr size_t kMarginBytes = 8;
}  // namespace

StopStrings::StopStrings(std::vector<std::string> strings) : strings_(std::move(strings)) {
  for (const std::string& s : strings_) {
    if (s.empty()) throw std::invalid_argument("stop strings: an empty stop string would stop every sample at once");
    longest_ = std::max(longest_, s.size());
  }
}

bool StopStrings::matches(std::span<const int32_t> generated, const Detokenizer& detok) const {
  if (strings_.empty() || generated.empty()) return false;
  // A token yields at least one byte in the common case, so start with that many tokens.
  size_t window = std::min(generated.size(), longest_ + kMarginBytes);
  std::string text;
  for (;;) {
    text = detok.decode(generated.subspan(generated.size() - window));
    if (text.size() >= longest_ + kMarginBytes || window == generated.size()) break;
    window = std::min(generated.size(), window * 2);
  }
  for (const std::string& s : strings_)
    if (text.find(s) != std::string::npos) return true;
  return false;
}

}  // namespace rlh::gen
