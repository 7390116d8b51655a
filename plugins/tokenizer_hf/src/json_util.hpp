// Field access on nlohmann::json with one-line errors naming the file and the JSON path, e.g.
// "tokenizer.json: model.merges[17]: expected \"a b\" or [a, b]".
#pragma once

#include <nlohmann/json.hpp>  // nlohmann::json

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace rlh::tok {

using json = nlohmann::json;

// `m` as one line of at most about max_bytes: newlines and other control characters escaped
// (\n, \t, \xNN), the rest cut on a UTF-8 boundary with "...". Error messages quote the
// file's own text (a type name, a key, a template's token), which may hold any of these.
std::string one_line(std::string_view m, size_t max_bytes = 1024);

struct JPath {
  std::string file;  // e.g. "tokenizer.json"
  std::string path;  // e.g. "model.merges[17]"

  JPath at(std::string_view key) const {
    return {file, path.empty() ? std::string(key) : path + "." + std::string(key)};
  }
  JPath at(size_t index) const { return {file, path + "[" + std::to_string(index) + "]"}; }

  [[noreturn]] void fail(std::string_view msg) const {
    throw std::runtime_error(one_line(file + ": " + (path.empty() ? std::string("(root)") : path) + ": " +
                                      std::string(msg)));
  }
};

// Type name for messages.
inline const char* json_kind(const json& j) {
  switch (j.type()) {
    case json::value_t::null: return "null";
    case json::value_t::object: return "an object";
    case json::value_t::array: return "an array";
    case json::value_t::string: return "a string";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer";
    case json::value_t::number_float: return "a number";
    default: return "an unsupported value";
  }
}

// The member `key` of object `o`, or nullptr when absent or null.
inline const json* member(const json& o, std::string_view key) {
  if (!o.is_object()) return nullptr;
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return nullptr;
  return &*it;
}

inline const json& need(const json& o, std::string_view key, const JPath& p) {
  const json* m = member(o, key);
  if (!m) p.at(key).fail("missing");
  return *m;
}

inline std::string need_string(const json& o, std::string_view key, const JPath& p) {
  const json& v = need(o, key, p);
  if (!v.is_string()) p.at(key).fail(std::string("expected a string, got ") + json_kind(v));
  return v.get<std::string>();
}

inline std::optional<std::string> opt_string(const json& o, std::string_view key, const JPath& p) {
  const json* v = member(o, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) p.at(key).fail(std::string("expected a string, got ") + json_kind(*v));
  return v->get<std::string>();
}

inline bool opt_bool(const json& o, std::string_view key, const JPath& p, bool dflt) {
  const json* v = member(o, key);
  if (!v) return dflt;
  if (!v->is_boolean()) p.at(key).fail(std::string("expected true or false, got ") + json_kind(*v));
  return v->get<bool>();
}

inline bool need_bool(const json& o, std::string_view key, const JPath& p) {
  const json& v = need(o, key, p);
  if (!v.is_boolean()) p.at(key).fail(std::string("expected true or false, got ") + json_kind(v));
  return v.get<bool>();
}

inline uint64_t need_uint(const json& v, const JPath& p, uint64_t max) {
  if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0)) {
    p.fail(std::string("expected a non-negative integer, got ") + json_kind(v));
  }
  const uint64_t x = v.get<uint64_t>();
  if (x > max) p.fail("value " + std::to_string(x) + " is too large (max " + std::to_string(max) + ")");
  return x;
}

// A single Unicode character given as a JSON string (Metaspace replacement, Strip content).
char32_t need_char(const json& o, std::string_view key, const JPath& p);

// Parses JSON text after checking its nesting depth, so hostile files cannot exhaust the stack.
json parse_json_text(std::string_view text, const std::string& file, int max_depth = 128);

}  // namespace rlh::tok
