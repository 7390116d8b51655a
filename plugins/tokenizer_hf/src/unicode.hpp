// UTF-8 and Unicode helpers shared by the tokenizer stages.
//
// HF tokenizers is written in Rust, so character classes follow Rust's definitions
// (char::is_whitespace = White_Space, char::is_numeric = N*, regex \w, ...). Categories come from
// utf8proc; the few properties utf8proc lacks (White_Space, Other_Alphabetic) are listed here.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace rlh::tok::uni {

// Decodes one code point from valid UTF-8 at p (p < end). Returns its byte length. Invalid
// input gives some code point, but never a length past `end`: a sequence the end cuts short is
// U+FFFD of one byte (callers append p[0, n) and step by n; a Jinja string holding a cut
// sequence read past its buffer).
inline int decode(const char* p, const char* end, char32_t& cp) {
  const auto b0 = static_cast<unsigned char>(*p);
  if (b0 < 0x80) { cp = b0; return 1; }
  if (end - p < (b0 < 0xE0 ? 2 : b0 < 0xF0 ? 3 : 4)) { cp = 0xFFFD; return 1; }
  const auto cont = [&](int i) { return static_cast<unsigned char>(p[i]) & 0x3F; };
  if (b0 < 0xE0) { cp = (char32_t(b0 & 0x1F) << 6) | cont(1); return 2; }
  if (b0 < 0xF0) { cp = (char32_t(b0 & 0x0F) << 12) | (char32_t(cont(1)) << 6) | cont(2); return 3; }
  cp = (char32_t(b0 & 0x07) << 18) | (char32_t(cont(1)) << 12) | (char32_t(cont(2)) << 6) | cont(3);
  return 4;
}

// Byte length of the UTF-8 sequence that starts with lead byte b (1 for ASCII and stray bytes).
inline int seq_len(unsigned char b) { return b < 0xC0 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4; }

void append(std::string& out, char32_t cp);
inline std::string to_utf8(char32_t cp) { std::string s; append(s, cp); return s; }

// Offset of the first invalid UTF-8 byte, or npos when `s` is valid UTF-8.
size_t find_invalid(std::string_view s);
// Rust's String::from_utf8_lossy: each maximal invalid subpart becomes one U+FFFD.
std::string lossy(std::string_view bytes);

bool is_whitespace(char32_t c);    // Unicode White_Space (Rust char::is_whitespace, regex \s)
bool is_numeric(char32_t c);       // Nd | Nl | No (Rust char::is_numeric)
bool is_alphabetic(char32_t c);    // L* | Nl | Other_Alphabetic (approximated)
bool is_alphanumeric(char32_t c);  // Rust char::is_alphanumeric
bool is_word(char32_t c);          // Rust regex \w
bool is_punctuation(char32_t c);   // ASCII punctuation or P* (HF Punctuation/Bert pre-tokenizers)
bool is_combining_mark(char32_t c);  // Mn | Mc | Me
bool is_control(char32_t c);       // Cc | Cf (Bert's clean_text)
bool is_cjk(char32_t c);           // Bert's handle_chinese_chars ranges

// Rust char::to_lowercase / to_uppercase appended to out (full mappings where they differ).
void append_lower(std::string& out, char32_t c);
void append_upper(std::string& out, char32_t c);

// GPT-2's byte <-> printable character table used by ByteLevel.
struct ByteLevelTable {
  std::array<char32_t, 256> byte_to_cp{};
  std::array<std::string, 256> byte_to_utf8{};
  std::array<int16_t, 512> cp_to_byte{};  // -1 where a code point is not in the alphabet
  ByteLevelTable();
};
const ByteLevelTable& byte_level();

// Byte-level mapping of arbitrary bytes to the alphabet's UTF-8 text.
void append_byte_level(std::string& out, std::string_view bytes);

}  // namespace rlh::tok::uni
