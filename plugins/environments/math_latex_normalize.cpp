// String-level normalisation of math answers before parsing. Each rule undoes a way the same
// answer is commonly written differently; tests/environments/sympy_verdicts.py applies the same
// rules in the same order before handing the result to sympy.
#include <algorithm>
#include <cctype>

#include "math_internal.hpp"

namespace rlh::environments::math {
namespace {

// One pass into a new string: replacing in place shifts the tail at every match, n^2 on a
// response of a thousand '$'.
void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty()) return;
  charge(s.size());
  size_t p = s.find(from);
  if (p == std::string::npos) return;
  std::string out;
  out.reserve(s.size());
  size_t at = 0;
  for (; p != std::string::npos; p = s.find(from, at)) {
    out.append(s, at, p - at);
    out.append(to);
    at = p + from.size();
  }
  out.append(s, at, std::string::npos);
  s.swap(out);
}

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

// Commands dropped outright: presentation only.
bool is_dropped_command(std::string_view name) {
  static const char* const kDrop[] = {"displaystyle", "textstyle", "left", "right", "bigl", "bigr", "Bigl",
                                      "Bigr", "big", "Big", "quad", "qquad", "degree", "circ"};
  for (const char* d : kDrop)
    if (name == d) return true;
  return false;
}

bool is_text_command(std::string_view name) {
  return name == "text" || name == "textbf" || name == "textrm" || name == "textit" || name == "mathrm" ||
         name == "mbox" || name == "mathbf" || name == "mathit";
}

// For every '{' the index of its matching '}' (npos when unclosed), in one pass: matching each
// \text{ separately costs n^2 when they are unclosed. A backslash escapes the next character.
std::vector<size_t> match_braces(const std::string& s) {
  charge(s.size());
  std::vector<size_t> close(s.size(), std::string::npos), open;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\') {
      ++i;
      continue;
    }
    if (s[i] == '{') {
      open.push_back(i);
    } else if (s[i] == '}' && !open.empty()) {
      close[open.back()] = i;
      open.pop_back();
    }
  }
  return close;
}

// \text{...}-style blocks: units after a number ("5\text{ cm}") are dropped; otherwise the block
// is the answer's words ("\text{Monday}") and keeps its content.
std::string resolve_text_blocks(const std::string& s) {
  struct Block {
    size_t begin, end;  // [begin, end) covers "\text{...}"
    std::string content;
  };
  std::vector<Block> blocks;
  if (s.find('\\') == std::string::npos) return s;
  const std::vector<size_t> match = match_braces(s);
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\') continue;
    size_t j = i + 1;
    while (j < s.size() && std::isalpha(static_cast<unsigned char>(s[j]))) ++j;
    const std::string_view name(s.data() + i + 1, j - i - 1);
    if (!is_text_command(name)) {
      i = j - 1;
      continue;
    }
    size_t k = j;
    while (k < s.size() && s[k] == ' ') ++k;
    if (k >= s.size() || s[k] != '{') continue;
    const size_t close = match[k];
    if (close == std::string::npos) continue;
    blocks.push_back({i, close + 1, s.substr(k + 1, close - k - 1)});
    i = close;
  }
  if (blocks.empty()) return s;
  std::string rest, kept;
  size_t at = 0;
  for (const auto& b : blocks) {
    rest += s.substr(at, b.begin - at);
    kept += s.substr(at, b.begin - at) + b.content;
    at = b.end;
  }
  rest += s.substr(at);
  kept += s.substr(at);
  bool has_digit = false;
  for (char c : rest) has_digit |= std::isdigit(static_cast<unsigned char>(c)) != 0;
  return has_digit ? rest : kept;
}

// Drops presentation commands and spacing, renames fraction variants, keeps everything else.
std::string drop_commands(const std::string& s) {
  charge(s.size());
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\') {
      out.push_back(s[i] == '~' ? ' ' : s[i]);
      continue;
    }
    if (i + 1 >= s.size()) break;
    const char next = s[i + 1];
    if (!std::isalpha(static_cast<unsigned char>(next))) {
      // \, \; \: \! \  are spacing; \\ a line break; \% \$ escaped signs; \{ \} kept (sets).
      if (next == ',' || next == ';' || next == ':' || next == '!' || next == ' ' || next == '\\') {
        ++i;
      } else if (next == '%') {
        out.push_back('%');
        ++i;
      } else {
        out.push_back('\\');
        out.push_back(next);
        ++i;
      }
      continue;
    }
    size_t j = i + 1;
    while (j < s.size() && std::isalpha(static_cast<unsigned char>(s[j]))) ++j;
    std::string name = s.substr(i + 1, j - i - 1);
    if (is_dropped_command(name)) {
      // \left. and \right. are invisible delimiters.
      if ((name == "left" || name == "right") && j < s.size() && s[j] == '.') ++j;
      i = j - 1;
      continue;
    }
    if (name == "dfrac" || name == "tfrac" || name == "cfrac") name = "frac";
    out += "\\" + name;
    // A command followed by a letter needs the separation it had ("\pi r" not "\pir").
    if (j < s.size() && std::isalpha(static_cast<unsigned char>(s[j]))) out.push_back(' ');
    i = j - 1;
  }
  return out;
}

// "x = 5" -> "5" when the left side is one variable (a letter or a Greek command).
std::string drop_variable_assignment(const std::string& s) {
  size_t eq = std::string::npos;
  int count = 0;
  for (size_t i = 0; i < s.size(); ++i)
    if (s[i] == '=' && (i == 0 || (s[i - 1] != '<' && s[i - 1] != '>' && s[i - 1] != '!'))) {
      eq = i;
      ++count;
    }
  if (count != 1) return s;
  const std::string lhs = trim(std::string_view(s).substr(0, eq));
  // ^([A-Za-z]|\\[A-Za-z]+)$, scanned by hand: std::regex recurses per character.
  auto alpha = [](char c) { return std::isalpha(static_cast<unsigned char>(c)) != 0; };
  const bool variable = (lhs.size() == 1 && alpha(lhs[0])) ||
                        (lhs.size() >= 2 && lhs[0] == '\\' && std::all_of(lhs.begin() + 1, lhs.end(), alpha));
  if (!variable) return s;
  return trim(std::string_view(s).substr(eq + 1));
}

}  // namespace

std::string normalize_latex(std::string_view raw) {
  charge(raw.size());
  std::string s(raw);
  // Unicode forms of ASCII/LaTeX notation.
  static const std::pair<const char*, const char*> kUnicode[] = {
      {"\xE2\x88\x92", "-"},        // U+2212 minus
      {"\xC3\x97", "\\times "},     // U+00D7 multiplication sign
      {"\xC2\xB7", "\\cdot "},      // U+00B7 middle dot
      {"\xE2\x8B\x85", "\\cdot "},  // U+22C5 dot operator
      {"\xC3\xB7", "\\div "},       // U+00F7 division sign
      {"\xCF\x80", "\\pi "},        // U+03C0 pi
      {"\xE2\x88\x9A", "\\sqrt"},   // U+221A square root
      {"\xE2\x88\x9E", "\\infty "}, // U+221E infinity
      {"\xC2\xB0", ""},             // U+00B0 degree sign
      {"\xC2\xA0", " "},            // U+00A0 no-break space
  };
  for (const auto& [from, to] : kUnicode) replace_all(s, from, to);
  // Degrees: ^\circ, ^{\circ}.
  for (const char* deg : {"^{\\circ}", "^\\circ", "^{ \\circ }", "^{\\circ }"}) replace_all(s, deg, "");
  // Math-mode delimiters and escaped dollars.
  replace_all(s, "\\$", "");
  replace_all(s, "$", "");
  s = trim(s);
  for (const auto& [open, close] : {std::pair<const char*, const char*>{"\\(", "\\)"}, {"\\[", "\\]"}}) {
    const std::string_view o(open), c(close);
    if (s.size() >= o.size() + c.size() && s.compare(0, o.size(), o) == 0 &&
        s.compare(s.size() - c.size(), c.size(), c) == 0)
      s = trim(std::string_view(s).substr(o.size(), s.size() - o.size() - c.size()));
  }
  replace_all(s, "{,}", "");  // 1{,}000: LaTeX thousands separator
  s = resolve_text_blocks(s);
  s = drop_commands(s);
  s = trim(s);
  // Trailing full stops (and the spaces between them), cut once: one copy per dot is n^2.
  size_t keep = s.size();
  while (keep > 0 && (s[keep - 1] == '.' || std::isspace(static_cast<unsigned char>(s[keep - 1])))) --keep;
  if (keep < s.size()) s = trim(std::string_view(s).substr(0, keep));
  s = drop_variable_assignment(s);
  return s;
}

namespace {

// ^[-+]?\d{1,3}(,\d{3})+(\.\d+)?$, scanned by hand.
bool thousands_separated(const std::string& s) {
  auto digit = [&](size_t i) { return i < s.size() && s[i] >= '0' && s[i] <= '9'; };
  size_t i = (!s.empty() && (s[0] == '-' || s[0] == '+')) ? 1 : 0;
  size_t lead = 0;
  while (digit(i) && lead < 4) ++i, ++lead;
  if (lead < 1 || lead > 3) return false;
  size_t groups = 0;
  while (i < s.size() && s[i] == ',') {
    if (!(digit(i + 1) && digit(i + 2) && digit(i + 3))) return false;
    i += 4;
    ++groups;
  }
  if (groups == 0) return false;
  if (i < s.size() && s[i] == '.') {
    if (!digit(i + 1)) return false;
    ++i;
    while (digit(i)) ++i;
  }
  return i == s.size();
}

}  // namespace

std::string drop_thousands_separators(const std::string& s) {
  charge(s.size());
  if (!thousands_separated(s)) return s;
  std::string out;
  for (char c : s)
    if (c != ',') out.push_back(c);
  return out;
}

std::string normalize_text(std::string_view raw) {
  const std::string s = normalize_latex(raw);
  std::string out;
  for (char c : s) {
    if (std::isspace(static_cast<unsigned char>(c)) || c == '{' || c == '}') continue;
    out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  return out;
}

}  // namespace rlh::environments::math
