// PCRE2 wrapper: see regex.hpp.
#include "regex.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>  // pcre2_compile, pcre2_jit_compile, pcre2_match, pcre2_jit_match

#include <stdexcept>

#include "unicode.hpp"

namespace rlh::tok {

namespace {

// Per-thread match scratch: match data, a match context with a generous JIT stack (deep
// backtracking on long whitespace runs needs more than PCRE2's 32 KiB default) and limits that
// turn pathological backtracking into an error instead of a hang.
struct MatchScratch {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mctx = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchScratch() {
    md = pcre2_match_data_create(1, nullptr);
    mctx = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
    if (!md || !mctx || !stack) throw std::bad_alloc();
    pcre2_jit_stack_assign(mctx, nullptr, stack);
    pcre2_set_match_limit(mctx, 20'000'000);
    pcre2_set_depth_limit(mctx, 200'000);
    pcre2_set_heap_limit(mctx, 256 * 1024);  // KiB
  }
  ~MatchScratch() {
    pcre2_match_data_free(md);
    pcre2_match_context_free(mctx);
    pcre2_jit_stack_free(stack);
  }
};

MatchScratch& scratch() {
  thread_local MatchScratch s;
  return s;
}

}  // namespace

Regex::Regex(std::string_view pattern, bool literal) : pattern_(pattern) {
  int err = 0;
  PCRE2_SIZE erroff = 0;
  uint32_t opts = PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK;
  if (literal) opts = PCRE2_UTF | PCRE2_LITERAL;
  // The pattern itself is checked for valid UTF-8 (NO_UTF_CHECK only applies when matching).
  if (uni::find_invalid(pattern) != std::string_view::npos) {
    throw std::runtime_error("pattern is not valid UTF-8");
  }
  opts &= ~static_cast<uint32_t>(PCRE2_NO_UTF_CHECK);
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   opts, &err, &erroff, nullptr);
  if (!code) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(err, buf, sizeof(buf));
    throw std::runtime_error("bad regex /" + std::string(pattern) + "/ at offset " +
                             std::to_string(erroff) + ": " + reinterpret_cast<char*>(buf));
  }
  code_ = code;
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

bool Regex::search(std::string_view subject, size_t from, size_t& start, size_t& end) const {
  auto& sc = scratch();
  const auto* subj = reinterpret_cast<PCRE2_SPTR>(subject.data());
  int rc;
  if (jit_) {
    rc = pcre2_jit_match(static_cast<pcre2_code*>(code_), subj, subject.size(), from, 0, sc.md,
                         sc.mctx);
  } else {
    rc = pcre2_match(static_cast<pcre2_code*>(code_), subj, subject.size(), from,
                     PCRE2_NO_UTF_CHECK, sc.md, sc.mctx);
  }
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0 && rc != 0) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(rc, buf, sizeof(buf));
    throw std::runtime_error("regex /" + pattern_ + "/: " + reinterpret_cast<char*>(buf));
  }
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(sc.md);
  start = ov[0];
  end = ov[1];
  return true;
}

size_t Regex::next_char_len(std::string_view s, size_t pos) {
  return static_cast<size_t>(uni::seq_len(static_cast<unsigned char>(s[pos])));
}

}  // namespace rlh::tok
