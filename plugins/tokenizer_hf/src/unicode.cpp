// UTF-8 and Unicode helpers: see unicode.hpp.
#include "unicode.hpp"

#include <utf8proc.h>  // utf8proc_category, utf8proc_tolower/toupper

namespace rlh::tok::uni {

void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Length of the valid prefix of the sequence at s[i] per the Unicode "maximal subpart" rules:
// returns the full sequence length when valid, else -(bytes belonging to the broken subpart).
static int check_seq(std::string_view s, size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return 1;
  int need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) need = 1;
  else if (b0 >= 0xE0 && b0 <= 0xEF) { need = 2; if (b0 == 0xE0) lo = 0xA0; if (b0 == 0xED) hi = 0x9F; }
  else if (b0 >= 0xF0 && b0 <= 0xF4) { need = 3; if (b0 == 0xF0) lo = 0x90; if (b0 == 0xF4) hi = 0x8F; }
  else return -1;
  int got = 0;
  for (int k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return -(1 + got);
    const auto b = static_cast<unsigned char>(s[i + k]);
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) return -(1 + got);
    ++got;
  }
  return need + 1;
}

size_t find_invalid(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    // Fast path over ASCII, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      __builtin_memcpy(&w, s.data() + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    const int r = check_seq(s, i);
    if (r < 0) return i;
    i += static_cast<size_t>(r);
  }
  return std::string_view::npos;
}

std::string lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const int r = check_seq(s, i);
    if (r > 0) {
      out.append(s.data() + i, static_cast<size_t>(r));
      i += static_cast<size_t>(r);
    } else {
      out.append("\xEF\xBF\xBD");
      i += static_cast<size_t>(-r);
    }
  }
  return out;
}

bool is_whitespace(char32_t c) {
  if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0D);
  switch (c) {
    case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F:
    case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

static int cat(char32_t c) { return utf8proc_category(static_cast<utf8proc_int32_t>(c)); }

bool is_numeric(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  const int k = cat(c);
  return k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO;
}

bool is_alphabetic(char32_t c) {
  if (c < 0x80) return (c | 0x20) >= 'a' && (c | 0x20) <= 'z';
  const int k = cat(c);
  if (k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO) return true;
  if (k == UTF8PROC_CATEGORY_NL) return true;
  // Other_Alphabetic: mostly spacing/nonspacing vowel signs (counted as marks here) plus the
  // circled and squared Latin letters, which are So.
  if (k == UTF8PROC_CATEGORY_MC) return true;
  return (c >= 0x24B6 && c <= 0x24E9) || (c >= 0x1F130 && c <= 0x1F149) ||
         (c >= 0x1F150 && c <= 0x1F169) || (c >= 0x1F170 && c <= 0x1F189);
}

bool is_alphanumeric(char32_t c) { return is_alphabetic(c) || is_numeric(c); }

bool is_word(char32_t c) {
  if (c < 0x80) return c == '_' || (c >= '0' && c <= '9') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'z');
  if (c == 0x200C || c == 0x200D) return true;
  const int k = cat(c);
  if (k >= UTF8PROC_CATEGORY_MN && k <= UTF8PROC_CATEGORY_ND) return true;  // M*, Nd
  if (k == UTF8PROC_CATEGORY_PC) return true;
  return is_alphabetic(c);
}

bool is_punctuation(char32_t c) {
  if (c < 0x80) {
    return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) ||
           (c >= 0x7B && c <= 0x7E);
  }
  const int k = cat(c);
  return k >= UTF8PROC_CATEGORY_PC && k <= UTF8PROC_CATEGORY_PO;
}

bool is_combining_mark(char32_t c) {
  if (c < 0x300) return false;
  const int k = cat(c);
  return k == UTF8PROC_CATEGORY_MN || k == UTF8PROC_CATEGORY_MC || k == UTF8PROC_CATEGORY_ME;
}

bool is_control(char32_t c) {
  const int k = cat(c);
  return k == UTF8PROC_CATEGORY_CC || k == UTF8PROC_CATEGORY_CF;
}

bool is_cjk(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
         (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
         (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

void append_lower(std::string& out, char32_t c) {
  if (c < 0x80) { out.push_back(static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c)); return; }
  if (c == 0x130) { out.append("i\xCC\x87"); return; }  // the one multi-char lowercase mapping
  append(out, static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
}

void append_upper(std::string& out, char32_t c) {
  if (c < 0x80) { out.push_back(static_cast<char>(c >= 'a' && c <= 'z' ? c - 32 : c)); return; }
  if (c == 0xDF) { out.append("SS"); return; }  // the common full uppercase mapping
  append(out, static_cast<char32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(c))));
}

ByteLevelTable::ByteLevelTable() {
  cp_to_byte.fill(-1);
  // Printable bytes keep their own code point; the rest map to 256 + n in byte order.
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    byte_to_cp[b] = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
  }
  for (int b = 0; b < 256; ++b) {
    byte_to_utf8[b] = to_utf8(byte_to_cp[b]);
    cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
  }
}

const ByteLevelTable& byte_level() {
  static const ByteLevelTable t;
  return t;
}

void append_byte_level(std::string& out, std::string_view bytes) {
  const auto& t = byte_level();
  for (const char ch : bytes) out += t.byte_to_utf8[static_cast<unsigned char>(ch)];
}

}  // namespace rlh::tok::uni
