// Stop strings matched on decoded text across token boundaries (vLLM's `stop`).
//
// A sample stops after the token whose text completes a stop string; like vLLM, the token ids
// keep that token (and everything before it), only text would be cut. Detection decodes a
// window of the latest tokens rather than the whole response, so a step costs O(window), not
// O(response): the window is widened until its text is longer than the longest stop string by a
// margin (tokens can decode to nothing: skipped special tokens, partial UTF-8), and then any
// occurrence in the window is new — an older one would have stopped the sample when it
// appeared. Decoding a window that starts mid-character yields U+FFFD at its start and a
// SentencePiece-style decoder may drop a leading space there; neither can create a stop string
// that the full text lacks (only a stop string containing U+FFFD could, which is not supported).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace rlh::gen {

// Token ids -> UTF-8 text (special tokens skipped, as vLLM's detokenizer does by default).
class Detokenizer {
 public:
  virtual ~Detokenizer() = default;
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
};

class StopStrings {
 public:
  StopStrings() = default;
  // Empty strings are refused (std::invalid_argument): they would match before any token.
  explicit StopStrings(std::vector<std::string> strings);

  bool empty() const { return strings_.empty(); }
  const std::vector<std::string>& strings() const { return strings_; }

  // True when the decoded text of `generated` (the new tokens so far, the latest last) contains
  // a stop string. Call once per new token; `detok` must be non-null when !empty().
  bool matches(std::span<const int32_t> generated, const Detokenizer& detok) const;

 private:
  std::vector<std::string> strings_;
  size_t longest_ = 0;  // bytes
};

}  // namespace rlh::gen
