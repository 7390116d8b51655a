// JSON helpers: see json_util.hpp.
#include "json_util.hpp"

#include <cstdio>

#include "unicode.hpp"

namespace rlh::tok {

std::string one_line(std::string_view m, size_t max_bytes) {
  std::string out;
  for (const char c : m) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (u < 0x20 || u == 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "\\x%02x", u);
      out += hex;
    } else {
      out += c;
    }
    if (out.size() > max_bytes) {
      size_t cut = max_bytes;
      while (cut > 0 && (static_cast<unsigned char>(out[cut]) & 0xC0) == 0x80) --cut;
      out.resize(cut);
      out += "...";
      break;
    }
  }
  return out;
}

char32_t need_char(const json& o, std::string_view key, const JPath& p) {
  const std::string s = need_string(o, key, p);
  if (s.empty() || uni::find_invalid(s) != std::string_view::npos) {
    p.at(key).fail("expected a single character");
  }
  char32_t cp;
  const int n = uni::decode(s.data(), s.data() + s.size(), cp);
  if (static_cast<size_t>(n) != s.size()) p.at(key).fail("expected a single character, got \"" + s + "\"");
  return cp;
}

json parse_json_text(std::string_view text, const std::string& file, int max_depth) {
  // Linear pre-scan of bracket depth outside strings.
  int depth = 0;
  bool in_str = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_str) {
      if (c == '\\') ++i;
      else if (c == '"') in_str = false;
      continue;
    }
    if (c == '"') in_str = true;
    else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        throw std::runtime_error(file + ": nesting deeper than " + std::to_string(max_depth) +
                                 " levels at byte " + std::to_string(i));
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    // parse_error, and out_of_range for a number past double's range (5e3333): both are the
    // file's fault. nlohmann messages look like "[json.exception.parse_error.101] parse error
    // at line 1, ...".
    std::string what = e.what();
    const auto pos = what.find("] ");
    if (pos != std::string::npos) what = what.substr(pos + 2);
    throw std::runtime_error(one_line(file + ": invalid JSON: " + what));
  }
}

}  // namespace rlh::tok
