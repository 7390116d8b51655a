// String-level normalisation of math answers before parsing. Each rule undoes a way the same
// answer is commonly written differently; tests/environments/sympy_verdicts.py applies the same
// rules in the same order before handing the result to sympy.
#include <cctype>
#include <regex>

#include "math_internal.hpp"

namespace rlh::environments::math {
namespace {

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty()) return;
  for (size_t p = s.find(from); p != std::string::npos; p = s.find(from, p + to.size()))
    s.replace(p, from.size(), to);
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

// End of the {...} group starting at s[open] == '{' (index of its '}'), or npos.
size_t match_brace(const std::string& s, size_t open) {
  int depth = 0;
  for (size_t i = open; i < s.size(); ++i) {
    if (s[i] == '\\') {
      ++i;
      continue;
    }
    if (s[i] == '{') ++depth;
    if (s[i] == '}' && --depth == 0) return i;
  }
  return std::string::npos;
}

// \text{...}-style blocks: units after a number ("5\text{ cm}") are dropped; otherwise the block
// is the answer's words ("\text{Monday}") and keeps its content.
std::string resolve_text_blocks(const std::string& s) {
  struct Block {
    size_t begin, end;  // [begin, end) covers "\text{...}"
    std::string content;
  };
  std::vector<Block> blocks;
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
    const size_t close = match_brace(s, k);
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
  static const std::regex kVariable(R"(^([A-Za-z]|\\[A-Za-z]+)$)");
  if (!std::regex_match(lhs, kVariable)) return s;
  return trim(std::string_view(s).substr(eq + 1));
}

}  // namespace

std::string normalize_latex(std::string_view raw) {
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
  while (!s.empty() && s.back() == '.') s = trim(std::string_view(s).substr(0, s.size() - 1));
  s = drop_variable_assignment(s);
  return s;
}

std::string drop_thousands_separators(const std::string& s) {
  static const std::regex kThousands(R"(^[-+]?\d{1,3}(,\d{3})+(\.\d+)?$)");
  if (!std::regex_match(s, kThousands)) return s;
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
