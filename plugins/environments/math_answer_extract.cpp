// Finding the final answer in a model's response: the last closed \boxed{...}, else the last
// "the answer is X", else the last number.
#include <cctype>
#include <optional>

#include "rlhost/environments/math_answer.hpp"

namespace rlh::environments {
namespace {

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

// Content of the \boxed / \fbox at `cmd_end` (just past the command name), or nullopt when it is
// unclosed (a truncated response) or empty.
std::optional<std::string> boxed_content(std::string_view r, size_t cmd_end) {
  size_t i = cmd_end;
  while (i < r.size() && r[i] == ' ') ++i;
  if (i >= r.size()) return std::nullopt;
  if (r[i] != '{') {
    // "\boxed 5": TeX takes one token; we take the word.
    size_t j = i;
    while (j < r.size() && !std::isspace(static_cast<unsigned char>(r[j])) && r[j] != '$') ++j;
    if (j == i) return std::nullopt;
    return std::string(r.substr(i, j - i));
  }
  int depth = 0;
  for (size_t j = i; j < r.size(); ++j) {
    if (r[j] == '\\') {  // \{ and \} are literal braces inside the answer
      ++j;
      continue;
    }
    if (r[j] == '{') ++depth;
    if (r[j] == '}' && --depth == 0) {
      std::string inner = trim(r.substr(i + 1, j - i - 1));
      if (inner.empty()) return std::nullopt;
      return inner;
    }
  }
  return std::nullopt;
}

std::optional<std::string> last_boxed(std::string_view r) {
  // Walk back over the occurrences so an unclosed last one falls back to the previous answer.
  size_t pos = r.size();
  for (;;) {
    size_t best = std::string_view::npos, name_len = 0;
    for (std::string_view cmd : {std::string_view("\\boxed"), std::string_view("\\fbox")}) {
      const size_t p = pos == 0 ? std::string_view::npos : r.rfind(cmd, pos - 1);
      if (p != std::string_view::npos && (best == std::string_view::npos || p > best)) {
        best = p;
        name_len = cmd.size();
      }
    }
    if (best == std::string_view::npos) return std::nullopt;
    if (auto c = boxed_content(r, best + name_len)) return c;
    pos = best;
  }
}

char lower(char c) { return static_cast<char>(std::tolower(static_cast<unsigned char>(c))); }

// The text after the last "answer is" / "answer:" up to the end of its line or sentence.
std::optional<std::string> last_answer_is(std::string_view r) {
  std::string low(r);
  for (char& c : low) c = lower(c);
  std::optional<std::string> found;
  for (size_t p = low.find("answer"); p != std::string::npos; p = low.find("answer", p + 1)) {
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
    const size_t stop = low.find(". ", i);
    if (stop != std::string::npos && stop < end) end = stop;
    std::string x = trim(r.substr(i, end - i));
    while (!x.empty() && (x.back() == '.' || x.back() == '*' || x.back() == ',' || x.back() == ';' || x.back() == '!'))
      x = trim(std::string_view(x).substr(0, x.size() - 1));
    while (!x.empty() && x.front() == '*') x.erase(0, 1);
    if (!x.empty()) found = x;
  }
  return found;
}

// The last number: digits with ",ddd" groups, a decimal part, an exponent, a "/digits"
// denominator, and a minus sign that is not a subtraction.
std::optional<std::string> last_number(std::string_view r) {
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
