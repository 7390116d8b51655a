// Added and special tokens (HF tokenizers/src/tokenizer/added_vocabulary.rs).
//
// Added tokens are cut out of the text before normalization and the model run: first the tokens
// with normalized=false are matched on the raw text, then the remaining pieces are normalized and
// the normalized=true tokens are matched on them. Matching is leftmost-longest, non-overlapping;
// single_word rejects a match touching a word character, lstrip/rstrip swallow adjacent
// whitespace into the token.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "pretokenize.hpp"  // FnRef

namespace rlh::tok {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
  std::string match_form;  // the pattern matched: content, normalized when `normalized`
};

// (begin, end, token id or -1 for text between tokens)
using SegmentSink = FnRef<void(size_t, size_t, int32_t)>;

class AddedTokenMatcher {
 public:
  // `tokens` indices into the owner's token list.
  void build(const std::vector<AddedToken>& all, bool normalized_set);
  bool empty() const { return nodes_.size() <= 1; }
  // Splits s into text segments and tokens; reports every segment in order.
  void split(std::string_view s, const std::vector<AddedToken>& all, const SegmentSink& sink) const;

 private:
  struct Node {
    int32_t token = -1;  // index in `all` of a token ending here
    std::vector<std::pair<unsigned char, int32_t>> kids;  // sorted by byte
  };
  int32_t child(int32_t node, unsigned char b) const;
  std::vector<Node> nodes_{1};
  bool first_byte_[256] = {};
};

}  // namespace rlh::tok
