// Finding the final answer in a model's response: the last closed \boxed{...}, else the last
// "the answer is X", else the last number.
#include <cctype>
#include <optional>
#include <vector>

#include "math_internal.hpp"

#include "rlhost/environments/math_answer.hpp"

namespace rlh::environments {
namespace {

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

// For every '{' the index of its matching '}' (npos when unclosed), in one pass: scanning from
// each \boxed{ to its end would cost n^2 on "\boxed{" repeated (a policy can write that).
// A backslash escapes the next character (\{ and \} are literal braces inside an answer).
std::vector<size_t> match_braces(std::string_view r) {
  math::charge(r.size());
  std::vector<size_t> close(r.size(), std::string_view::npos), open;
  for (size_t j = 0; j < r.size(); ++j) {
    if (r[j] == '\\') {
      ++j;
      continue;
    }
    if (r[j] == '{') {
      open.push_back(j);
    } else if (r[j] == '}' && !open.empty()) {
      close[open.back()] = j;
      open.pop_back();
    }
  }
  return close;
}

// Content of the \boxed / \fbox at `cmd_end` (just past the command name), or nullopt when it is
// unclosed (a truncated response) or empty.
std::optional<std::string> boxed_content(std::string_view r, size_t cmd_end, const std::vector<size_t>& close) {
  size_t i = cmd_end;
  while (i < r.size() && r[i] == ' ') ++i;
  if (i >= r.size()) return std::nullopt;
  if (r[i] != '{') {
    // "\boxed 5": TeX takes one token; we take the word.
    size_t j = i;
    while (j < r.size() && !std::isspace(static_cast<unsigned char>(r[j])) && r[j] != '$') ++j;
    if (j == i) return std::nullopt;
    math::charge(j - i);
    return std::string(r.substr(i, j - i));
  }
  const size_t j = close[i];
  if (j == std::string_view::npos) return std::nullopt;
  math::charge(j - i);
  std::string inner = trim(r.substr(i + 1, j - i - 1));
  if (inner.empty()) return std::nullopt;
  return inner;
}

std::optional<std::string> last_boxed(std::string_view r) {
  if (r.find("\\boxed") == std::string_view::npos && r.find("\\fbox") == std::string_view::npos) return std::nullopt;
  const std::vector<size_t> close = match_braces(r);
  // Walk back over the occurrences so an unclosed last one falls back to the previous answer.
  // Each occurrence is found once per command name (rfind from just before the last one).
  size_t next_boxed = r.size(), next_fbox = r.size();
  auto prev = [&](std::string_view cmd, size_t& from) {
    if (from == std::string_view::npos) return std::string_view::npos;
    from = from == 0 ? std::string_view::npos : r.rfind(cmd, from - 1);
    return from;
  };
  size_t b = prev("\\boxed", next_boxed), f = prev("\\fbox", next_fbox);
  math::charge(r.size());
  while (b != std::string_view::npos || f != std::string_view::npos) {
    const bool is_boxed = f == std::string_view::npos || (b != std::string_view::npos && b > f);
    const size_t at = is_boxed ? b : f;
    if (auto c = boxed_content(r, at + (is_boxed ? 6 : 5), close)) return c;
    if (is_boxed) b = prev("\\boxed", next_boxed);
    else f = prev("\\fbox", next_fbox);
  }
  return std::nullopt;
}

char lower(char c) { return static_cast<char>(std::tolower(static_cast<unsigned char>(c))); }

// The text after the last "answer is" / "answer:" up to the end of its line or sentence. The
// occurrences are tried from the last one back, so the first that yields text is the answer and
// the scan stays linear however often "answer" repeats.
std::optional<std::string> last_answer_is(std::string_view r) {
  math::charge(2 * r.size());
  std::string low(r);
  for (char& c : low) c = lower(c);
  // An occurrence that yields no text is followed only by spaces and punctuation up to its end,
  // so no later occurrence lies inside its span: the spans scanned are disjoint, the scan linear.
  for (size_t p = low.rfind("answer"); p != std::string::npos; p = p == 0 ? std::string::npos : low.rfind("answer", p - 1)) {
    size_t i = p + 6;
    while (i < low.size() && low[i] == ' ') ++i;
    if (low.compare(i, 2, "is") == 0) {
      i += 2;
      if (i < low.size() && std::isalpha(static_cast<unsigned char>(low[i]))) continue;  // "answer isn't"
    } else if (i >= low.size() || low[i] != ':') {
      continue;
    }
    while (i < low.size() && (low[i] == ' ' || low[i] == ':' || low[i] == '*')) ++i;
    size_t end = low.find('\n', i);
    if (end == std::string::npos) end = low.size();
    // A sentence ends at ". " (a decimal point is followed by a digit, not a space).
    // (searched within the line only, so the scans stay disjoint)
    const size_t stop = std::string_view(low).substr(0, end).find(". ", i);
    if (stop != std::string::npos) end = stop;
    math::charge(end - i);
    std::string x = trim(r.substr(i, end - i));
    while (!x.empty() && (x.back() == '.' || x.back() == '*' || x.back() == ',' || x.back() == ';' || x.back() == '!'))
      x.pop_back(), x = trim(x);
    size_t lead = 0;
    while (lead < x.size() && x[lead] == '*') ++lead;
    x.erase(0, lead);
    if (!x.empty()) return x;
  }
  return std::nullopt;
}

// The last number: digits with ",ddd" groups, a decimal part, an exponent, a "/digits"
// denominator, and a minus sign that is not a subtraction.
std::optional<std::string> last_number(std::string_view r) {
  math::charge(r.size());
  std::optional<std::string> found;
  auto digit = [&](size_t i) { return i < r.size() && std::isdigit(static_cast<unsigned char>(r[i])); };
  for (size_t i = 0; i < r.size(); ++i) {
    if (!digit(i)) continue;
    if (i > 0 && (std::isalnum(static_cast<unsigned char>(r[i - 1])) || r[i - 1] == '.' || r[i - 1] == '_')) {
      while (digit(i + 1)) ++i;
      continue;
    }
    size_t start = i, j = i;
    while (digit(j)) ++j;
    while (r.size() > j && r[j] == ',' && digit(j + 1) && digit(j + 2) && digit(j + 3) && !digit(j + 4)) j += 4;
    if (j < r.size() && r[j] == '.' && digit(j + 1)) {
      ++j;
      while (digit(j)) ++j;
    }
    if (j < r.size() && (r[j] == 'e' || r[j] == 'E')) {
      size_t k = j + 1;
      if (k < r.size() && (r[k] == '+' || r[k] == '-')) ++k;
      if (digit(k)) {
        while (digit(k)) ++k;
        j = k;
      }
    }
    if (j < r.size() && r[j] == '/' && digit(j + 1)) {
      ++j;
      while (digit(j)) ++j;
    }
    if (start > 0 && r[start - 1] == '-' &&
        (start == 1 || !(std::isalnum(static_cast<unsigned char>(r[start - 2])) || r[start - 2] == ')')))
      --start;
    found = std::string(r.substr(start, j - start));
    i = j - 1;
  }
  return found;
}

}  // namespace

ExtractedAnswer extract_answer(std::string_view response) {
  if (auto b = last_boxed(response)) return {*b, AnswerSource::kBoxed};
  if (auto a = last_answer_is(response)) return {*a, AnswerSource::kAnswerIs};
  if (auto n = last_number(response)) return {*n, AnswerSource::kLastNumber};
  return {};
}

}  // namespace rlh::environments
