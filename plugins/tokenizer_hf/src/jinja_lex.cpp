// Jinja lexer: splits a template into text and tag tokens, applying whitespace control.
//
// Rules (Jinja with trim_blocks=True, lstrip_blocks=True, as transformers configures it):
//   {%- / {{- / {#-  strip all whitespace before the tag;  -%} / -}} / -#} strip all after.
//   lstrip_blocks: spaces/tabs between a line start and a {% or {# tag are removed ({%+ keeps).
//   trim_blocks: one newline right after %} or #} is removed (+%} keeps it).
//   {% raw %}...{% endraw %} is copied as text.
#include <cctype>
#include <string>

#include "jinja_ast.hpp"

namespace rlh::tok::jinja {

namespace {

struct Lexer {
  const std::string& src;
  std::vector<Token> out;
  size_t pos = 0;
  int line = 1;

  [[noreturn]] void fail(const std::string& msg) const { throw Error("line " + std::to_string(line) + ": " + msg); }

  void count_lines(size_t from, size_t to) {
    for (size_t k = from; k < to && k < src.size(); ++k) if (src[k] == '\n') ++line;
  }

  void skip_ws() {
    while (pos < src.size() && std::isspace(static_cast<unsigned char>(src[pos]))) {
      if (src[pos] == '\n') ++line;
      ++pos;
    }
  }

  // At a closing delimiter ("}}" or "%}") with optional '-'/'+' before it? Returns its length.
  size_t closing(const char* close, char& mod) const {
    mod = 0;
    if ((src.compare(pos, 1, "-") == 0 || src.compare(pos, 1, "+") == 0) && src.compare(pos + 1, 2, close) == 0) {
      mod = src[pos];
      return 3;
    }
    if (src.compare(pos, 2, close) == 0) return 2;
    return 0;
  }

  void lex_string() {
    const char q = src[pos++];
    std::string s;
    while (true) {
      if (pos >= src.size()) fail("unterminated string");
      const char c = src[pos++];
      if (c == q) break;
      if (c == '\n') ++line;
      if (c == '\\' && pos < src.size()) {
        const char e = src[pos++];
        switch (e) {
          case 'n': s.push_back('\n'); break;
          case 't': s.push_back('\t'); break;
          case 'r': s.push_back('\r'); break;
          case '\\': s.push_back('\\'); break;
          case '\'': s.push_back('\''); break;
          case '"': s.push_back('"'); break;
          case '0': s.push_back('\0'); break;
          default: s.push_back('\\'); s.push_back(e);
        }
        continue;
      }
      s.push_back(c);
    }
    out.push_back({Tok::String, std::move(s), line});
  }

  // Expression tokens up to the closing delimiter; returns the whitespace modifier before it.
  char lex_tag(const char* close) {
    for (;;) {
      skip_ws();
      if (pos >= src.size()) fail(std::string("missing '") + close + "'");
      char mod;
      if (const size_t n = closing(close, mod)) {
        pos += n;
        return mod;
      }
      const char c = src[pos];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        const size_t b = pos;
        while (pos < src.size() && (std::isalnum(static_cast<unsigned char>(src[pos])) || src[pos] == '_')) ++pos;
        out.push_back({Tok::Name, src.substr(b, pos - b), line});
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        const size_t b = pos;
        bool is_float = false;
        while (pos < src.size() && (std::isdigit(static_cast<unsigned char>(src[pos])) || src[pos] == '_')) ++pos;
        if (pos + 1 < src.size() && src[pos] == '.' && std::isdigit(static_cast<unsigned char>(src[pos + 1]))) {
          is_float = true;
          ++pos;
          while (pos < src.size() && std::isdigit(static_cast<unsigned char>(src[pos]))) ++pos;
        }
        if (pos < src.size() && (src[pos] == 'e' || src[pos] == 'E')) {
          size_t k = pos + 1;
          if (k < src.size() && (src[k] == '+' || src[k] == '-')) ++k;
          if (k < src.size() && std::isdigit(static_cast<unsigned char>(src[k]))) {
            is_float = true;
            pos = k;
            while (pos < src.size() && std::isdigit(static_cast<unsigned char>(src[pos]))) ++pos;
          }
        }
        std::string num;
        for (size_t k = b; k < pos; ++k) if (src[k] != '_') num.push_back(src[k]);
        out.push_back({is_float ? Tok::Float : Tok::Int, num, line});
      } else if (c == '\'' || c == '"') {
        lex_string();
      } else {
        static const char* ops3[] = {"//=", "**="};
        (void)ops3;
        static const char* ops2[] = {"//", "**", "==", "!=", "<=", ">="};
        std::string op;
        for (const char* o : ops2) if (src.compare(pos, 2, o) == 0) { op = o; break; }
        if (op.empty()) {
          if (std::string("+-*/%~()[]{}.,:|=<>!").find(c) == std::string::npos) {
            fail(std::string("unexpected character '") + c + "'");
          }
          op = std::string(1, c);
        }
        pos += op.size();
        out.push_back({Tok::Op, op, line});
      }
    }
  }

  void run() {
    bool strip_next = false;  // previous tag ended with '-'
    bool trim_nl = false;     // previous block/comment tag: drop one newline
    while (pos <= src.size()) {
      size_t t = pos;
      while ((t = src.find('{', t)) != std::string::npos) {
        if (t + 1 < src.size() && (src[t + 1] == '{' || src[t + 1] == '%' || src[t + 1] == '#')) break;
        ++t;
      }
      const size_t text_end = t == std::string::npos ? src.size() : t;
      std::string text = src.substr(pos, text_end - pos);
      const size_t text_begin = pos;
      if (strip_next) {
        size_t k = 0;
        while (k < text.size() && std::isspace(static_cast<unsigned char>(text[k]))) ++k;
        text.erase(0, k);
      } else if (trim_nl) {
        if (text.compare(0, 1, "\n") == 0) text.erase(0, 1);
        else if (text.compare(0, 2, "\r\n") == 0) text.erase(0, 2);
      }
      strip_next = trim_nl = false;
      const int text_line = line;
      count_lines(text_begin, text_end);
      if (t == std::string::npos) {
        if (!text.empty()) out.push_back({Tok::Text, std::move(text), text_line});
        break;
      }
      const char kind = src[t + 1];
      const char mod = t + 2 < src.size() ? src[t + 2] : 0;
      if (mod == '-') {
        while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
      } else if ((kind == '%' || kind == '#') && mod != '+') {
        // lstrip_blocks: only when the tag is the first thing on its line (checked in the source).
        size_t k = text_end;
        while (k > text_begin && (src[k - 1] == ' ' || src[k - 1] == '\t')) --k;
        if (k == 0 || src[k - 1] == '\n') {
          const size_t drop = text_end - k;
          text.erase(text.size() - std::min(drop, text.size()));
        }
      }
      if (!text.empty()) out.push_back({Tok::Text, std::move(text), text_line});
      pos = t + 2 + ((mod == '-' || mod == '+') ? 1 : 0);

      if (kind == '#') {
        const size_t e = src.find("#}", pos);
        if (e == std::string::npos) fail("unclosed comment");
        count_lines(pos, e);
        const char cm = e > pos ? src[e - 1] : 0;
        pos = e + 2;
        if (cm == '-') strip_next = true;
        else if (cm != '+') trim_nl = true;
        continue;
      }
      const bool block = kind == '%';
      const int tag_line = line;
      out.push_back({block ? Tok::BlockBegin : Tok::VarBegin, "", tag_line});
      const size_t first_tok = out.size();
      const char cm = lex_tag(block ? "%}" : "}}");
      out.push_back({block ? Tok::BlockEnd : Tok::VarEnd, "", line});
      if (cm == '-') strip_next = true;
      else if (block && cm != '+') trim_nl = true;

      if (block && out.size() == first_tok + 2 && out[first_tok].type == Tok::Name && out[first_tok].text == "raw") {
        out.resize(first_tok - 1);  // drop the raw tag itself
        lex_raw(strip_next, trim_nl);
        strip_next = trim_nl = false;
      }
    }
    out.push_back({Tok::End, "", line});
  }

  // Copies text up to {% endraw %} verbatim.
  void lex_raw(bool strip_first, bool trim_first) {
    size_t k = pos;
    for (;;) {
      k = src.find("{%", k);
      if (k == std::string::npos) fail("missing {% endraw %}");
      size_t j = k + 2;
      char lmod = 0;
      if (j < src.size() && (src[j] == '-' || src[j] == '+')) lmod = src[j++];
      while (j < src.size() && std::isspace(static_cast<unsigned char>(src[j]))) ++j;
      if (src.compare(j, 6, "endraw") != 0) { k += 2; continue; }
      j += 6;
      while (j < src.size() && std::isspace(static_cast<unsigned char>(src[j]))) ++j;
      char rmod = 0;
      if (j < src.size() && (src[j] == '-' || src[j] == '+')) rmod = src[j++];
      if (src.compare(j, 2, "%}") != 0) { k += 2; continue; }
      std::string text = src.substr(pos, k - pos);
      if (strip_first) {
        size_t s = 0;
        while (s < text.size() && std::isspace(static_cast<unsigned char>(text[s]))) ++s;
        text.erase(0, s);
      } else if (trim_first && text.compare(0, 1, "\n") == 0) {
        text.erase(0, 1);
      }
      if (lmod == '-') while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
      if (!text.empty()) out.push_back({Tok::Text, text, line});
      count_lines(pos, j + 2);
      pos = j + 2;
      // What follows {% endraw %} obeys its own modifier.
      if (rmod == '-') {
        while (pos < src.size() && std::isspace(static_cast<unsigned char>(src[pos]))) { if (src[pos] == '\n') ++line; ++pos; }
      } else if (rmod != '+' && src.compare(pos, 1, "\n") == 0) {
        ++pos;
        ++line;
      }
      return;
    }
  }
};

}  // namespace

std::vector<Token> lex(const std::string& src) {
  Lexer lx{src, {}, 0, 1};
  lx.run();
  return std::move(lx.out);
}

}  // namespace rlh::tok::jinja
