// The configuration tree: YAML loading with `defaults:` chains, overrides, interpolation.
// See config.hpp for the conventions. Inputs are untrusted (fuzzed): every recursion has a depth
// bound and YAML alias expansion has a node budget.
#include "config.hpp"

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "rlhost/sdk/input_file.hpp"

namespace rlh::host {
namespace {

constexpr int kMaxDepth = 128;          // nesting of YAML maps/lists and of interpolations
constexpr size_t kMaxNodes = 2'000'000; // guards alias expansion ("billion laughs")
constexpr int kMaxDefaultsDepth = 32;   // length of a defaults chain
// A config file is a few KB; 8 MiB parses in about 2 s (yaml-cpp builds ~30 bytes of nodes per
// byte of text), so anything larger is refused before it is read.
constexpr uint64_t kMaxFileBytes = 8u << 20;
// Interpolation can copy a subtree or a string once per reference, so a few lines can stand for
// an exponential amount of data: the resolved tree is bounded in nodes and in string bytes.
constexpr size_t kMaxResolvedNodes = 10'000'000;
constexpr size_t kMaxStringBytes = 16u << 20;      // one interpolated string
constexpr size_t kMaxResolvedBytes = 256u << 20;   // all interpolated strings together

[[noreturn]] void fail(const std::string& msg) { throw ConfigError(msg); }

// Offset of the first byte that is not well-formed UTF-8 (RFC 3629: no overlong forms, no
// surrogates, nothing past U+10FFFF), or npos. Configs are UTF-8 text; a bad byte would
// otherwise surface far away, as a JSON serialisation error when the config is handed on.
size_t invalid_utf8_at(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t n;
    uint32_t cp;
    if ((c >> 5) == 0x6) { n = 1; cp = c & 0x1F; }
    else if ((c >> 4) == 0xE) { n = 2; cp = c & 0x0F; }
    else if ((c >> 3) == 0x1E) { n = 3; cp = c & 0x07; }
    else return i;
    if (i + n >= s.size()) return i;
    for (size_t k = 1; k <= n; ++k) {
      const unsigned char d = static_cast<unsigned char>(s[i + k]);
      if ((d >> 6) != 0x2) return i;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) ||
        cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      return i;
    i += n + 1;
  }
  return std::string::npos;
}

// ------------------------------------------------------------------------------------------
// YAML -> Json

bool is_null_word(const std::string& s) { return s.empty() || s == "~" || s == "null" || s == "Null" || s == "NULL"; }

// Scanners for YAML 1.2 core scalars, one pass each (std::regex recurses once per character and
// overflows the stack on a long value).
size_t skip_digits(const std::string& s, size_t i) {
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
  return i;
}
bool is_int_text(const std::string& s) {  // [-+]?[0-9]+
  const size_t b = (!s.empty() && (s[0] == '-' || s[0] == '+')) ? 1 : 0;
  return s.size() > b && skip_digits(s, b) == s.size();
}
bool is_hex_text(const std::string& s) {  // 0x[0-9a-fA-F]+
  if (s.size() < 3 || s[0] != '0' || s[1] != 'x') return false;
  return std::all_of(s.begin() + 2, s.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; });
}
bool is_float_text(const std::string& s) {  // [-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?
  size_t i = (!s.empty() && (s[0] == '-' || s[0] == '+')) ? 1 : 0;
  if (i < s.size() && s[i] == '.') {
    const size_t e = skip_digits(s, i + 1);
    if (e == i + 1) return false;
    i = e;
  } else {
    const size_t e = skip_digits(s, i);
    if (e == i) return false;
    i = e;
    if (i < s.size() && s[i] == '.') i = skip_digits(s, i + 1);
  }
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    size_t k = i + 1;
    if (k < s.size() && (s[k] == '-' || s[k] == '+')) ++k;
    const size_t e = skip_digits(s, k);
    if (e == k) return false;
    i = e;
  }
  return i == s.size();
}

Json plain_scalar(const std::string& s) {
  if (is_null_word(s)) return nullptr;
  if (s == "true" || s == "True" || s == "TRUE") return true;
  if (s == "false" || s == "False" || s == "FALSE") return false;
  if (is_int_text(s)) {
    try { return static_cast<int64_t>(std::stoll(s)); } catch (...) { /* too large: float */ }
    try { return std::stod(s); } catch (...) { return s; }
  }
  if (is_hex_text(s)) {
    try { return static_cast<int64_t>(std::stoll(s, nullptr, 16)); } catch (...) { return s; }
  }
  if (is_float_text(s)) {
    try { return std::stod(s); } catch (...) { return s; }
  }
  if (s == ".inf" || s == ".Inf" || s == "+.inf") return std::numeric_limits<double>::infinity();
  if (s == "-.inf" || s == "-.Inf") return -std::numeric_limits<double>::infinity();
  if (s == ".nan" || s == ".NaN") return std::numeric_limits<double>::quiet_NaN();
  return s;
}

// Appends a key known to be new. ordered_json's operator[] searches the key list, so building a
// map of n keys through it costs n^2 (a 3 MB config took 17 s).
void append_new_key(Json& obj, std::string key, Json value) {
  auto& items = obj.get_ref<Json::object_t&>();
  static_cast<Json::object_t::Container&>(items).emplace_back(std::move(key), std::move(value));
}

struct YamlConverter {
  const std::string& origin;
  size_t nodes = 0;

  Json convert(const YAML::Node& n, int depth) {
    if (depth > kMaxDepth) fail(origin + ": nesting deeper than " + std::to_string(kMaxDepth) + " levels");
    if (++nodes > kMaxNodes) fail(origin + ": document expands to more than 2,000,000 nodes (alias bomb?)");
    switch (n.Type()) {
      case YAML::NodeType::Null:
      case YAML::NodeType::Undefined:
        return nullptr;
      case YAML::NodeType::Scalar:
        // (checked after decoding; yaml-cpp itself refuses escapes of surrogates)
        if (invalid_utf8_at(n.Scalar()) != std::string::npos)
          fail(origin + ": line " + std::to_string(n.Mark().line + 1) + ": a value is not valid UTF-8");
        // Tag "!" marks a quoted (non-plain) scalar: always a string.
        if (n.Tag() == "!") return n.Scalar();
        return plain_scalar(n.Scalar());
      case YAML::NodeType::Sequence: {
        Json a = Json::array();
        for (const auto& item : n) a.push_back(convert(item, depth + 1));
        return a;
      }
      case YAML::NodeType::Map: {
        Json o = Json::object();
        std::unordered_set<std::string> seen;
        std::vector<Json> merged;  // values of `<<` merge keys, in order
        for (const auto& kv : n) {
          if (!kv.first.IsScalar())
            fail(origin + ": line " + std::to_string(kv.first.Mark().line + 1) + ": mapping keys must be scalars");
          const std::string key = kv.first.Scalar();
          if (key == "<<" && kv.first.Tag() != "!") {
            // YAML's merge key (yaml-cpp 0.7 keeps it as a plain key): `<<: *base` or a list of
            // anchors; the mapping's own keys win, then earlier merged mappings.
            Json m = convert(kv.second, depth + 1);
            if (m.is_object()) merged.push_back(std::move(m));
            else if (m.is_array()) {
              for (auto& e : m) {
                if (!e.is_object())
                  fail(origin + ": line " + std::to_string(kv.first.Mark().line + 1) + ": '<<' merges mappings only");
                merged.push_back(std::move(e));
              }
            } else {
              fail(origin + ": line " + std::to_string(kv.first.Mark().line + 1) + ": '<<' merges mappings only");
            }
            continue;
          }
          if (invalid_utf8_at(key) != std::string::npos)
            fail(origin + ": line " + std::to_string(kv.first.Mark().line + 1) + ": a key is not valid UTF-8");
          if (!seen.insert(key).second)
            fail(origin + ": line " + std::to_string(kv.first.Mark().line + 1) + ": duplicate key '" + key + "'");
          append_new_key(o, key, convert(kv.second, depth + 1));
        }
        // (`seen`, not o.contains(): an ordered_json lookup is a linear scan)
        for (const auto& m : merged)
          for (auto it = m.begin(); it != m.end(); ++it)
            if (seen.insert(it.key()).second) append_new_key(o, it.key(), it.value());
        return o;
      }
    }
    return nullptr;
  }
};

// ------------------------------------------------------------------------------------------
// Merging with provenance

void record_leaves(const Json& j, const std::string& prefix, const std::string& origin,
                   std::map<std::string, std::string>& origins) {
  origins[prefix] = origin;
  if (j.is_object())
    for (auto it = j.begin(); it != j.end(); ++it)
      record_leaves(it.value(), prefix.empty() ? it.key() : prefix + "." + it.key(), origin, origins);
}

// Deep-merges src into dst: maps merge key by key, everything else is replaced.
// `origins` may be NULL: merging a parent's already-recorded tree keeps the parent's records.
// (Recursion is bounded: both trees come from parse_yaml, at most kMaxDepth deep.)
// NeMo-RL's marker for "replace this mapping, do not merge it": `_override_: true`.
constexpr const char* kOverrideMarker = "_override_";

bool replaces(const Json& v) {
  return v.is_object() && v.contains(kOverrideMarker) && v[kOverrideMarker].is_boolean() &&
         v[kOverrideMarker].get<bool>();
}

// Removes every `_override_` marker left in a tree (after merging, or in a file without parents).
void strip_markers(Json& j) {
  if (!j.is_object()) return;
  if (j.contains(kOverrideMarker) && j[kOverrideMarker].is_boolean()) j.erase(kOverrideMarker);
  for (auto it = j.begin(); it != j.end(); ++it) strip_markers(it.value());
}

void merge_into(Json& dst, const Json& src, const std::string& prefix, const std::string& origin,
                std::map<std::string, std::string>* origins) {
  // Positions of dst's keys, so merging n keys costs n, not n^2 (see append_new_key).
  auto& items = static_cast<Json::object_t::Container&>(dst.get_ref<Json::object_t&>());
  std::unordered_map<std::string, size_t> at;
  at.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) at.emplace(items[i].first, i);
  for (auto it = src.begin(); it != src.end(); ++it) {
    const std::string path = prefix.empty() ? it.key() : prefix + "." + it.key();
    const auto found = at.find(it.key());
    if (found != at.end() && items[found->second].second.is_object() && it.value().is_object() &&
        !replaces(it.value())) {
      merge_into(items[found->second].second, it.value(), path, origin, origins);
    } else {
      if (found != at.end()) {
        items[found->second].second = it.value();
      } else {
        at.emplace(it.key(), items.size());
        append_new_key(dst, it.key(), it.value());
      }
      if (origins != nullptr) record_leaves(it.value(), path, origin, *origins);
    }
  }
}

std::string read_file(const std::filesystem::path& p) {
  try {
    return sdk::read_input_file(p.string(), kMaxFileBytes, "config file");
  } catch (const sdk::InputError& e) {
    fail(e.what());
  }
}

struct ChainLoader {
  std::map<std::string, std::string>& origins;
  std::vector<std::string> stack;

  Json load(const std::filesystem::path& path) {
    std::error_code ec;
    std::filesystem::path canon = std::filesystem::weakly_canonical(path, ec);
    if (ec) canon = path;
    if (std::find(stack.begin(), stack.end(), canon.string()) != stack.end()) {
      std::string chain;
      for (const auto& s : stack) chain += s + " -> ";
      fail("config defaults cycle: " + chain + canon.string());
    }
    if (static_cast<int>(stack.size()) >= kMaxDefaultsDepth)
      fail("config defaults chain longer than " + std::to_string(kMaxDefaultsDepth) + " files at '" + path.string() + "'");
    stack.push_back(canon.string());
    Json self = parse_yaml(read_file(path), path.string());
    if (self.is_null()) self = Json::object();
    if (!self.is_object()) fail("config file '" + path.string() + "': the top level must be a mapping");

    Json merged = Json::object();
    if (self.contains("defaults")) {
      Json d = self["defaults"];
      self.erase("defaults");
      std::vector<std::string> parents;
      if (d.is_string()) parents.push_back(d.get<std::string>());
      else if (d.is_array()) {
        for (const auto& e : d) {
          if (!e.is_string()) fail("config file '" + path.string() + "': defaults entries must be file names");
          parents.push_back(e.get<std::string>());
        }
      } else if (!d.is_null()) {
        fail("config file '" + path.string() + "': defaults must be a file name or a list of them");
      }
      for (const auto& parent : parents) {
        std::filesystem::path pp = parent;
        if (pp.is_relative()) pp = path.parent_path() / pp;
        Json pj = load(pp);
        merge_into(merged, pj, "", pp.string(), nullptr);
      }
    }
    merge_into(merged, self, "", path.string(), &origins);
    strip_markers(merged);
    stack.pop_back();
    return merged;
  }
};

// ------------------------------------------------------------------------------------------
// Paths

Json* find_node(Json& root, const std::vector<std::string>& parts, size_t upto) {
  Json* cur = &root;
  for (size_t i = 0; i < upto; ++i) {
    if (cur->is_object()) {
      auto it = cur->find(parts[i]);
      if (it == cur->end()) return nullptr;
      cur = &it.value();
    } else if (cur->is_array()) {
      size_t idx = 0;
      try { idx = std::stoul(parts[i]); } catch (...) { return nullptr; }
      if (idx >= cur->size()) return nullptr;
      cur = &(*cur)[idx];
    } else {
      return nullptr;
    }
  }
  return cur;
}

const Json* find_const(const Json& root, const std::vector<std::string>& parts) {
  return find_node(const_cast<Json&>(root), parts, parts.size());
}

std::string type_name(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return "an integer";
    case Json::value_t::number_float: return "a number";
    case Json::value_t::string: return "a string";
    case Json::value_t::array: return "a list";
    case Json::value_t::object: return "a mapping";
    default: return "a value";
  }
}

// ------------------------------------------------------------------------------------------
// Interpolation

struct Resolver {
  const Json& root;
  std::vector<std::string> stack;  // keys being resolved, for cycle detection
  size_t steps = 0;
  size_t nodes = 0;  // values produced (kMaxResolvedNodes)
  size_t bytes = 0;  // bytes of interpolated strings produced (kMaxResolvedBytes)

  // Counts `n` more bytes of interpolated text that `out` has grown to.
  void grow(const std::string& out, size_t n, const std::string& path) {
    bytes += n;
    if (out.size() > kMaxStringBytes)
      fail("config key '" + path + "': interpolation makes a string longer than " + std::to_string(kMaxStringBytes) +
           " bytes");
    if (bytes > kMaxResolvedBytes)
      fail("config key '" + path + "': interpolation produces more than " + std::to_string(kMaxResolvedBytes) +
           " bytes of text");
  }

  static std::string stringify(const Json& v) {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_null()) return "None";
    if (v.is_boolean()) return v.get<bool>() ? "True" : "False";
    return v.dump();
  }

  // Resolves every string in `v` (located at `path`), recursively.
  Json resolve_tree(const Json& v, const std::string& path, int depth) {
    if (depth > kMaxDepth) fail("config: nesting too deep at '" + path + "'");
    if (++nodes > kMaxResolvedNodes)
      fail("config: interpolation expands to more than " + std::to_string(kMaxResolvedNodes) + " values at '" + path + "'");
    if (v.is_string()) return resolve_string(v.get<std::string>(), path, depth);
    if (v.is_object()) {
      Json o = Json::object();
      for (auto it = v.begin(); it != v.end(); ++it)
        append_new_key(o, it.key(), resolve_tree(it.value(), path.empty() ? it.key() : path + "." + it.key(), depth + 1));
      return o;
    }
    if (v.is_array()) {
      Json a = Json::array();
      for (size_t i = 0; i < v.size(); ++i) a.push_back(resolve_tree(v[i], path + "." + std::to_string(i), depth + 1));
      return a;
    }
    return v;
  }

  // Finds the end of the ${...} starting at s[pos] == '$'; returns index of the matching '}'.
  static size_t match_close(const std::string& s, size_t pos, const std::string& path) {
    int level = 0;
    for (size_t i = pos; i < s.size(); ++i) {
      if (s[i] == '$' && i + 1 < s.size() && s[i + 1] == '{') { ++level; ++i; continue; }
      if (s[i] == '}') { if (--level == 0) return i; }
    }
    fail("config key '" + path + "': unterminated interpolation in \"" + s + "\"");
  }

  Json resolve_string(const std::string& s, const std::string& path, int depth) {
    if (s.find("${") == std::string::npos) return s;
    if (depth > kMaxDepth) fail("config key '" + path + "': interpolation nested too deeply");
    // A value that is exactly one interpolation keeps the referenced value's type.
    if (s.rfind("${", 0) == 0 && match_close(s, 0, path) == s.size() - 1)
      return eval_expr(s.substr(2, s.size() - 3), path, depth + 1);
    std::string out;
    for (size_t i = 0; i < s.size();) {
      if (s[i] == '$' && i + 1 < s.size() && s[i + 1] == '{') {
        size_t close = match_close(s, i, path);
        const std::string piece = stringify(eval_expr(s.substr(i + 2, close - i - 2), path, depth + 1));
        out += piece;
        grow(out, piece.size(), path);
        i = close + 1;
      } else {
        out += s[i++];
      }
    }
    return out;
  }

  Json eval_expr(const std::string& expr_in, const std::string& path, int depth) {
    if (++steps > 1'000'000) fail("config: interpolation does too much work at '" + path + "'");
    std::string expr = trim(expr_in);
    // A resolver call "name:args" has a colon before any nested interpolation.
    size_t colon = expr.find(':');
    size_t nested = expr.find("${");
    if (colon != std::string::npos && (nested == std::string::npos || colon < nested))
      return call_resolver(trim(expr.substr(0, colon)), expr.substr(colon + 1), path, depth);
    return lookup(expr, path, depth);
  }

  static std::string trim(const std::string& s) {
    size_t b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
    return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
  }

  Json lookup(const std::string& ref, const std::string& path, int depth) {
    if (ref.empty()) fail("config key '" + path + "': empty interpolation ${}");
    std::string target;
    if (ref[0] == '.') {
      // Relative: one dot is the map holding this key, each further dot one level up.
      size_t dots = 0;
      while (dots < ref.size() && ref[dots] == '.') ++dots;
      std::vector<std::string> base = split_path_loose(path);
      if (!base.empty()) base.pop_back();  // the key itself
      for (size_t i = 1; i < dots; ++i) {
        if (base.empty()) fail("config key '" + path + "': '${" + ref + "}' goes above the top level");
        base.pop_back();
      }
      for (const auto& p : split_path(ref.substr(dots))) base.push_back(p);
      for (size_t i = 0; i < base.size(); ++i) target += (i ? "." : "") + base[i];
    } else {
      target = ref;
    }
    std::vector<std::string> parts;
    try { parts = split_path(target); } catch (const ConfigError&) {
      fail("config key '" + path + "': bad interpolation '${" + ref + "}'");
    }
    const Json* node = find_const(root, parts);
    if (node == nullptr) fail("config key '" + path + "': interpolation '${" + ref + "}' refers to missing key '" + target + "'");
    if (std::find(stack.begin(), stack.end(), target) != stack.end()) {
      std::string chain;
      for (const auto& k : stack) chain += k + " -> ";
      fail("config interpolation cycle: " + chain + target);
    }
    stack.push_back(target);
    Json v = resolve_tree(*node, target, depth + 1);
    stack.pop_back();
    return v;
  }

  static std::vector<std::string> split_path_loose(const std::string& p) {
    std::vector<std::string> out;
    std::string cur;
    for (char c : p) { if (c == '.') { out.push_back(cur); cur.clear(); } else cur += c; }
    if (!p.empty()) out.push_back(cur);
    return out;
  }

  Json call_resolver(const std::string& name, const std::string& args_text, const std::string& path, int depth) {
    // Split args at top-level commas (not inside ${...}).
    std::vector<std::string> raw;
    int level = 0;
    std::string cur;
    for (size_t i = 0; i < args_text.size(); ++i) {
      char c = args_text[i];
      if (c == '$' && i + 1 < args_text.size() && args_text[i + 1] == '{') { ++level; cur += "${"; ++i; continue; }
      if (c == '}' && level > 0) --level;
      if (c == ',' && level == 0) { raw.push_back(cur); cur.clear(); continue; }
      cur += c;
    }
    raw.push_back(cur);
    std::vector<Json> args;
    for (const auto& a : raw) {
      const std::string t = trim(a);
      // A quoted argument is a string as written (OmegaConf's grammar), not a number or null.
      if (t.size() >= 2 && (t.front() == '\'' || t.front() == '"') && t.back() == t.front()) {
        args.push_back(resolve_string(t.substr(1, t.size() - 2), path, depth + 1));
        continue;
      }
      Json v = resolve_string(t, path, depth + 1);
      if (v.is_string()) v = plain_scalar(v.get<std::string>());
      args.push_back(v);
    }
    if (name == "oc.env") return env_resolver(raw, args, path);
    auto num = [&](const Json& v) -> double {
      if (!v.is_number()) fail("config key '" + path + "': resolver '" + name + "' needs numbers, got " + type_name(v));
      return v.get<double>();
    };
    auto all_int = [&]() { return std::all_of(args.begin(), args.end(), [](const Json& v) { return v.is_number_integer(); }); };
    if (args.size() < 2 && name != "max" && name != "min")
      fail("config key '" + path + "': resolver '" + name + "' needs two arguments");
    // Integers are 64-bit here; Python's are unbounded, so a result outside the range is an
    // error rather than a wrapped (or, for INT64_MIN / -1, trapping) value.
    auto overflow = [&]() -> Json {
      std::string list;
      for (const auto& a : args) list += (list.empty() ? "" : ", ") + a.dump();
      fail("config key '" + path + "': resolver '" + name + "' overflows 64-bit integers (" + list + ")");
    };
    if (name == "mul" || name == "add") {
      if (all_int()) {
        int64_t r = name == "mul" ? 1 : 0;
        for (const auto& a : args) {
          const int64_t x = a.get<int64_t>();
          if (name == "mul" ? __builtin_mul_overflow(r, x, &r) : __builtin_add_overflow(r, x, &r)) return overflow();
        }
        return r;
      }
      double r = name == "mul" ? 1.0 : 0.0;
      for (const auto& a : args) r = name == "mul" ? r * num(a) : r + num(a);
      return r;
    }
    if (name == "div") {
      // NeMo-RL registers `lambda a, b: a / b`: true division, a float even for 8 / 4.
      if (args.size() != 2) fail("config key '" + path + "': resolver 'div' needs two arguments");
      double b = num(args[1]);
      if (b == 0) fail("config key '" + path + "': division by zero in resolver 'div'");
      return num(args[0]) / b;
    }
    if (name == "max" || name == "min") {
      if (args.empty()) fail("config key '" + path + "': resolver '" + name + "' needs arguments");
      Json best = args[0];
      for (const auto& a : args) {
        double x = num(a), y = num(best);
        if (name == "max" ? x > y : x < y) best = a;
      }
      return best;
    }
    fail("config key '" + path + "': unknown resolver '" + name + "' (known: mul, add, div, max, min, oc.env)");
  }

  // OmegaConf's oc.env: the variable's value as a string; when it is unset, the default (a string
  // or null) if one is given, else an error naming the variable.
  static Json env_resolver(const std::vector<std::string>& raw, const std::vector<Json>& args, const std::string& path) {
    if (args.empty() || args.size() > 2 || !args[0].is_string() || args[0].get<std::string>().empty())
      fail("config key '" + path + "': resolver 'oc.env' takes a variable name and an optional default");
    const std::string var = args[0].get<std::string>();
    if (const char* v = std::getenv(var.c_str())) return std::string(v);
    if (args.size() == 1)
      fail("config key '" + path + "': environment variable '" + var + "' is not set (${oc.env:" + var +
           "}; set it, or give a default: ${oc.env:" + var + ",default})");
    if (args[1].is_null()) return nullptr;
    // An unquoted default is taken as written (OmegaConf would refuse a non-string one).
    if (args[1].is_string()) return args[1];
    return trim(raw[1]);
  }
};

}  // namespace

// ------------------------------------------------------------------------------------------

Json parse_yaml(const std::string& text, const std::string& origin) {
  YAML::Node node;
  try {
    node = YAML::Load(text);
  } catch (const YAML::DeepRecursion& e) {
    // (yaml-cpp 0.7 gives this one the message "bad file")
    fail(origin + ": line " + std::to_string(e.mark.line + 1) + ", column " + std::to_string(e.mark.column + 1) +
         ": invalid YAML: nested deeper than " + std::to_string(e.depth()) + " levels");
  } catch (const YAML::Exception& e) {
    fail(origin + ": line " + std::to_string(e.mark.line + 1) + ", column " + std::to_string(e.mark.column + 1) +
         ": invalid YAML: " + e.msg);
  }
  YamlConverter conv{origin};
  try {
    return conv.convert(node, 0);
  } catch (const YAML::Exception& e) {
    fail(origin + ": invalid YAML: " + e.msg);
  }
}

namespace {
void emit(YAML::Emitter& out, const Json& j) {
  switch (j.type()) {
    case Json::value_t::object:
      out << YAML::BeginMap;
      for (auto it = j.begin(); it != j.end(); ++it) { out << YAML::Key << it.key() << YAML::Value; emit(out, it.value()); }
      out << YAML::EndMap;
      break;
    case Json::value_t::array:
      out << YAML::BeginSeq;
      for (const auto& e : j) emit(out, e);
      out << YAML::EndSeq;
      break;
    case Json::value_t::string: {
      // Quote strings that would read back as another type.
      const std::string s = j.get<std::string>();
      Json back = plain_scalar(s);
      if (!back.is_string()) out << YAML::DoubleQuoted << s; else out << s;
      break;
    }
    case Json::value_t::null: out << YAML::Null; break;
    case Json::value_t::boolean: out << (j.get<bool>() ? "true" : "false"); break;
    case Json::value_t::number_float: {
      double d = j.get<double>();
      if (std::isnan(d)) out << ".nan";
      else if (std::isinf(d)) out << (d > 0 ? ".inf" : "-.inf");
      else out << j.dump();
      break;
    }
    default: out << j.dump(); break;
  }
}
}  // namespace

std::string to_yaml(const Json& j) {
  YAML::Emitter out;
  emit(out, j);
  std::string s = out.c_str();
  if (!s.empty() && s.back() != '\n') s += '\n';
  return s;
}

std::vector<std::string> split_path(const std::string& dotted) {
  std::vector<std::string> parts;
  std::string cur;
  for (char c : dotted) {
    if (c == '.') {
      if (cur.empty()) throw ConfigError("bad key '" + dotted + "': empty segment");
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (cur.empty()) throw ConfigError("bad key '" + dotted + "': empty segment");
  parts.push_back(cur);
  return parts;
}

void collect_keys(const Json& j, const std::string& prefix, std::vector<std::string>& out) {
  if (j.is_object() && !j.empty()) {
    for (auto it = j.begin(); it != j.end(); ++it)
      collect_keys(it.value(), prefix.empty() ? it.key() : prefix + "." + it.key(), out);
  } else if (!prefix.empty()) {
    out.push_back(prefix);
  }
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

void Config::load_file(const std::filesystem::path& path) {
  origins_.clear();
  ChainLoader loader{origins_, {}};
  tree_ = loader.load(path);
}

void Config::load_text(const std::string& yaml, const std::string& origin) {
  origins_.clear();
  Json j = parse_yaml(yaml, origin);
  if (j.is_null()) j = Json::object();
  if (!j.is_object()) fail(origin + ": the top level must be a mapping");
  if (j.contains("defaults")) fail(origin + ": 'defaults' needs a config file (relative paths)");
  tree_ = Json::object();
  merge_into(tree_, j, "", origin, &origins_);
  strip_markers(tree_);
}

void Config::apply_override(const std::string& text) {
  if (const size_t bad = invalid_utf8_at(text); bad != std::string::npos)  // not echoed: not text
    fail("override: byte " + std::to_string(bad + 1) + " is not valid UTF-8");
  const std::string where = "override '" + text + "'";
  std::string t = text;
  enum { kSet, kForce, kAdd, kDelete } mode = kSet;
  if (t.rfind("++", 0) == 0) { mode = kForce; t = t.substr(2); }
  else if (t.rfind("+", 0) == 0) { mode = kAdd; t = t.substr(1); }
  else if (t.rfind("~", 0) == 0) { mode = kDelete; t = t.substr(1); }

  std::string key = t, value_text;
  size_t eq = t.find('=');
  if (eq != std::string::npos) { key = t.substr(0, eq); value_text = t.substr(eq + 1); }
  else if (mode != kDelete) fail(where + ": expected key=value");
  if (key.empty()) fail(where + ": empty key");
  std::vector<std::string> parts;
  try { parts = split_path(key); } catch (const ConfigError& e) { fail(where + ": " + e.what()); }

  Json* parent = find_node(tree_, parts, parts.size() - 1);
  Json* existing = find_node(tree_, parts, parts.size());
  if (mode == kDelete) {
    if (existing == nullptr || parent == nullptr || !parent->is_object()) fail(where + ": key '" + key + "' is not in the config");
    parent->erase(parts.back());
    return;
  }
  Json value;
  try {
    value = value_text.empty() ? Json(std::string()) : parse_yaml(value_text, where);
  } catch (const ConfigError& e) {
    fail(e.what());
  }
  if (mode == kSet) {
    if (existing == nullptr)
      fail(where + ": key '" + key + "' is not in the config (use ++" + key + "=" + value_text + " to add it)");
    // Type check against the value being replaced.
    const Json& old = *existing;
    bool ok = true;
    if (old.is_null() || value.is_null()) ok = true;
    else if (old.is_boolean()) ok = value.is_boolean();
    else if (old.is_number_integer()) ok = value.is_number_integer();
    else if (old.is_number_float()) { ok = value.is_number(); if (ok) value = value.get<double>(); }
    else if (old.is_string()) {
      // An interpolation ("${mul:...}") stands for a value of any type: the override's own type
      // wins. A plain string keeps the text as written.
      if (!value.is_string() && old.get<std::string>().find("${") == std::string::npos) value = value_text;
    }
    else if (old.is_array()) ok = value.is_array();
    else if (old.is_object()) ok = value.is_object();
    if (!ok) fail(where + ": '" + key + "' expects " + type_name(old) + " (it is " + old.dump() + "), got " + type_name(value));
    *existing = value;
  } else {
    if (mode == kAdd && existing != nullptr) fail(where + ": key '" + key + "' already exists (use ++ to override)");
    // Create intermediate maps as needed.
    Json* cur = &tree_;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      if (!cur->is_object()) fail(where + ": '" + parts[i - 1] + "' is not a mapping");
      cur = &(*cur)[parts[i]];
      if (cur->is_null()) *cur = Json::object();
    }
    if (!cur->is_object()) fail(where + ": parent of '" + key + "' is not a mapping");
    (*cur)[parts.back()] = value;
  }
  record_leaves(value, key, "command line", origins_);
}

Json Config::resolved() const {
  Resolver r{tree_, {}};
  return r.resolve_tree(tree_, "", 0);
}

std::string Config::origin_of(const std::string& dotted) const {
  std::string k = dotted;
  while (true) {
    auto it = origins_.find(k);
    if (it != origins_.end()) return it->second;
    size_t dot = k.rfind('.');
    if (dot == std::string::npos) break;
    k = k.substr(0, dot);
  }
  return "config";
}

}  // namespace rlh::host
