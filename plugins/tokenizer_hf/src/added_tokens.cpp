// Added-token matching: see added_tokens.hpp.
#include "added_tokens.hpp"

#include <algorithm>

#include "unicode.hpp"

namespace rlh::tok {

namespace {

// Code point ending at byte offset `end` (end > 0).
char32_t cp_before(std::string_view s, size_t end) {
  size_t k = end - 1;
  while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
  char32_t c;
  uni::decode(s.data() + k, s.data() + end, c);
  return c;
}

char32_t cp_at(std::string_view s, size_t pos) {
  char32_t c;
  uni::decode(s.data() + pos, s.data() + s.size(), c);
  return c;
}

}  // namespace

int32_t AddedTokenMatcher::child(int32_t node, unsigned char b) const {
  const auto& kids = nodes_[static_cast<size_t>(node)].kids;
  auto it = std::lower_bound(kids.begin(), kids.end(), b,
                             [](const std::pair<unsigned char, int32_t>& k, unsigned char x) { return k.first < x; });
  return it != kids.end() && it->first == b ? it->second : -1;
}

void AddedTokenMatcher::build(const std::vector<AddedToken>& all, bool normalized_set) {
  nodes_.assign(1, Node{});
  std::fill(std::begin(first_byte_), std::end(first_byte_), false);
  for (size_t t = 0; t < all.size(); ++t) {
    const AddedToken& tok = all[t];
    if (tok.normalized != normalized_set || tok.match_form.empty()) continue;
    int32_t node = 0;
    for (const char ch : tok.match_form) {
      const auto b = static_cast<unsigned char>(ch);
      int32_t next = child(node, b);
      if (next < 0) {
        next = static_cast<int32_t>(nodes_.size());
        nodes_.push_back(Node{});
        auto& kids = nodes_[static_cast<size_t>(node)].kids;
        kids.insert(std::upper_bound(kids.begin(), kids.end(), std::make_pair(b, next),
                                     [](const auto& x, const auto& y) { return x.first < y.first; }),
                    {b, next});
      }
      node = next;
    }
    // Two entries with the same pattern: the later one wins, as in a map keyed by content.
    nodes_[static_cast<size_t>(node)].token = static_cast<int32_t>(t);
    first_byte_[static_cast<unsigned char>(tok.match_form[0])] = true;
  }
}

void AddedTokenMatcher::split(std::string_view s, const std::vector<AddedToken>& all,
                              const SegmentSink& sink) const {
  if (empty()) {
    sink(0, s.size(), -1);
    return;
  }
  size_t start_offset = 0;  // end of the last emitted token
  size_t pos = 0;
  const size_t n = s.size();
  while (pos < n) {
    if (!first_byte_[static_cast<unsigned char>(s[pos])]) {
      ++pos;
      continue;
    }
    // Longest token starting at pos.
    int32_t node = 0, best = -1;
    size_t best_end = 0;
    for (size_t k = pos; k < n; ++k) {
      node = child(node, static_cast<unsigned char>(s[k]));
      if (node < 0) break;
      if (nodes_[static_cast<size_t>(node)].token >= 0) {
        best = nodes_[static_cast<size_t>(node)].token;
        best_end = k + 1;
      }
    }
    if (best < 0) {
      ++pos;
      continue;
    }
    const AddedToken& tok = all[static_cast<size_t>(best)];
    size_t start = pos, stop = best_end;
    pos = best_end;  // the match is consumed even when rejected below (HF iterates matches)
    if (tok.single_word) {
      const bool start_ok = start == 0 || !uni::is_word(cp_before(s, start));
      const bool stop_ok = stop == n || !uni::is_word(cp_at(s, stop));
      if (!start_ok || !stop_ok) continue;
    }
    if (tok.lstrip) {
      size_t b = start;
      while (b > 0) {
        size_t k = b - 1;
        while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
        if (!uni::is_whitespace(cp_at(s, k))) break;
        b = k;
      }
      start = std::max(b, start_offset);
    }
    if (tok.rstrip) {
      while (stop < n) {
        char32_t c;
        const int len = uni::decode(s.data() + stop, s.data() + n, c);
        if (!uni::is_whitespace(c)) break;
        stop += static_cast<size_t>(len);
      }
    }
    if (start_offset < start) sink(start_offset, start, -1);
    sink(start, stop, tok.id);
    start_offset = stop;
  }
  if (start_offset < n) sink(start_offset, n, -1);
}

}  // namespace rlh::tok
