// rlhost SDK: parsing JSON that comes from outside, with a bound on nesting.
//
// Header-only; the including target links nlohmann_json. nlohmann's parser is iterative, but
// everything that walks the result afterwards (dump(), conversions into other trees, the
// template engine) recurses once per level, so a document nested 100,000 deep parses fine and
// then overflows the stack far from the reader. A linear pre-scan refuses such text first.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "rlhost/sdk/input_file.hpp"

namespace rlh::sdk {

// Nesting that every reader accepts: real configs, tokenizers and chats stay far below it.
inline constexpr int kMaxJsonDepth = 256;

// The byte offset at which `text` opens its (max_depth + 1)-th nested array or object, if any.
inline std::optional<size_t> json_too_deep_at(std::string_view text, int max_depth = kMaxJsonDepth) {
  int depth = 0;
  bool in_str = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_str) {
      if (c == '\\') ++i;
      else if (c == '"') in_str = false;
      continue;
    }
    if (c == '"') {
      in_str = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return i;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return std::nullopt;
}

// Parses `text` (named `what` in errors) into J (nlohmann::json or ordered_json). Throws
// InputError "<what>: nesting deeper than 256 levels at byte N" or "<what>: invalid JSON: ...".
template <class J = nlohmann::json>
J parse_json_input(std::string_view text, const std::string& what, int max_depth = kMaxJsonDepth) {
  if (const auto at = json_too_deep_at(text, max_depth))
    throw InputError(what + ": nesting deeper than " + std::to_string(max_depth) + " levels at byte " +
                     std::to_string(*at));
  try {
    return J::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    throw InputError(what + ": invalid JSON: " + e.what());
  }
}

// read_input_file + parse_json_input; `what` names the file kind ("config file").
template <class J = nlohmann::json>
J read_json_file(const std::string& path, uint64_t max_bytes, const std::string& what,
                 int max_depth = kMaxJsonDepth) {
  return parse_json_input<J>(read_input_file(path, max_bytes, what), what + " '" + path + "'", max_depth);
}

}  // namespace rlh::sdk
