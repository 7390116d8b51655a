// PCRE2 (JIT) regular expressions with the match iteration HF tokenizers gets from Oniguruma.
//
// Patterns compile with PCRE2_UTF | PCRE2_UCP so \s, \w, \d and \p{..} are Unicode-aware like
// Oniguruma's. Subjects must be valid UTF-8 (the tokenizer validates input once up front and
// matching then skips PCRE2's per-call UTF check, which would otherwise rescan the subject on
// every call). Iteration follows rust-onig's FindMatches: an empty match directly at the end of
// the previous match is skipped by advancing one character.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

namespace rlh::tok {

class Regex {
 public:
  // literal=true matches `pattern` as plain text (HF's {"String": ...} patterns).
  // Throws std::runtime_error with PCRE2's message and offset on a bad pattern.
  Regex(std::string_view pattern, bool literal);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Leftmost match at or after `from`; false when there is none.
  bool search(std::string_view subject, size_t from, size_t& start, size_t& end) const;

  // Calls f(start, end) for every match, in order.
  template <class F>
  void for_each_match(std::string_view subject, F&& f) const {
    size_t pos = 0, last_end = static_cast<size_t>(-1);
    const size_t n = subject.size();
    size_t s, e;
    while (pos <= n && search(subject, pos, s, e)) {
      if (s == e && e == last_end) {
        if (pos >= n) break;
        pos += next_char_len(subject, pos);
        continue;
      }
      f(s, e);
      pos = e;
      last_end = e;
    }
  }

  const std::string& pattern() const { return pattern_; }

 private:
  static size_t next_char_len(std::string_view s, size_t pos);
  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
};

}  // namespace rlh::tok
