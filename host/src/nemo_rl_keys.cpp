// Parsing and looking up the embedded NeMo-RL key list and support rules (nemo_rl_keys.hpp).
#include "nemo_rl_keys.hpp"

#include <algorithm>
#include <sstream>
#include <tuple>

namespace rlh::host {

namespace detail {
extern const char* const kNemoRlKeysTsv;
extern const char* const kNemoRlSupportTsv;
}  // namespace detail

namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r"), e = s.find_last_not_of(" \t\r");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

bool same_value(const Json& a, const Json& b) {
  if (a.is_number() && b.is_number()) return a.get<double>() == b.get<double>();
  return a == b;
}

}  // namespace

Json support_value(const std::string& text) {
  const std::string t = trim(text);
  if (t == "{}") return Json::object();
  if (t == "[]") return Json::array();
  if (t.size() >= 2 && t.front() == '"' && t.back() == '"') return t.substr(1, t.size() - 2);
  Json v = parse_yaml(t, "nemo_rl_support.tsv");
  return v;
}

const char* to_string(SupportRule::Kind k) {
  switch (k) {
    case SupportRule::Kind::impl: return "impl";
    case SupportRule::Kind::noop: return "noop";
    case SupportRule::Kind::off: return "off";
    case SupportRule::Kind::only: return "only";
    case SupportRule::Kind::refuse: return "refuse";
    case SupportRule::Kind::provider: return "provider";
  }
  return "?";
}

bool SupportRule::matches(const std::vector<std::string>& key) const {
  if (key.size() < parts.size()) return false;
  if (key.size() > parts.size() && !subtree) return false;
  for (size_t i = 0; i < parts.size(); ++i)
    if (parts[i] != "*" && parts[i] != key[i]) return false;
  return true;
}

bool SupportRule::accepts(const Json& v) const {
  switch (kind) {
    case Kind::impl:
    case Kind::noop: return true;
    case Kind::refuse: return false;
    case Kind::provider:
      if (!accepted.empty())
        return std::any_of(accepted.begin(), accepted.end(), [&](const Json& a) { return same_value(a, v); });
      [[fallthrough]];
    case Kind::off:
      return v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_number() && v.get<double>() == 0) ||
             (v.is_string() && v.get<std::string>().empty()) || ((v.is_array() || v.is_object()) && v.empty());
    case Kind::only:
      return std::any_of(accepted.begin(), accepted.end(), [&](const Json& a) { return same_value(a, v); });
  }
  return false;
}

std::string SupportRule::accepted_text() const {
  if (kind == Kind::off || (kind == Kind::provider && accepted.empty())) return "false, null, 0 or empty";
  std::string out;
  for (const auto& a : accepted) out += (out.empty() ? "" : ", ") + (a.is_string() ? a.get<std::string>() : a.dump());
  return out;
}

const NemoRlTables& NemoRlTables::embedded() {
  static const NemoRlTables t(detail::kNemoRlKeysTsv, detail::kNemoRlSupportTsv);
  return t;
}

NemoRlTables::NemoRlTables(const std::string& keys_tsv, const std::string& support_tsv) {
  std::istringstream keys(keys_tsv);
  std::string line;
  size_t n = 0;
  while (std::getline(keys, line)) {
    ++n;
    if (line.rfind("# refs", 0) == 0) {
      const size_t colon = line.find(':');
      refs_ = trim(line.substr(colon == std::string::npos ? 0 : colon + 1));
    }
    if (line.empty() || line[0] == '#') continue;
    auto f = split(line, '\t');
    if (f.size() != 4 || f[0].empty() || (f[1] != "leaf" && f[1] != "map" && f[1] != "tree"))
      throw ConfigError("nemo_rl_keys.tsv: line " + std::to_string(n) + ": expected key, kind, refs, sources");
    index_.emplace(f[0], keys_.size());
    keys_.push_back(Key{f[0], f[1], f[2], f[3]});
  }
  std::istringstream support(support_tsv);
  n = 0;
  while (std::getline(support, line)) {
    ++n;
    if (trim(line).empty() || line[0] == '#') continue;
    auto f = split(line, '\t');
    const std::string where = "nemo_rl_support.tsv: line " + std::to_string(n);
    if (f.size() != 3 || f[0].empty()) throw ConfigError(where + ": expected pattern, rule, detail");
    SupportRule r;
    r.pattern = f[0];
    r.line = n;
    r.parts = split_path(r.pattern);
    if (r.parts.size() > 1 && r.parts.back() == "*") {
      r.subtree = true;
      r.parts.pop_back();
    }
    const std::string rule = f[1];
    r.detail = f[2];
    if (rule == "impl") {
      r.kind = SupportRule::Kind::impl;
      r.plugins = split(r.detail, ',');
    } else if (rule == "noop") {
      r.kind = SupportRule::Kind::noop;
    } else if (rule == "off") {
      r.kind = SupportRule::Kind::off;
    } else if (rule == "refuse") {
      r.kind = SupportRule::Kind::refuse;
    } else if (rule.rfind("provider ", 0) == 0) {
      // "provider P" (without a provider: as off) or "provider P only V|V..." (without one: these)
      r.kind = SupportRule::Kind::provider;
      std::string claim = rule.substr(9);
      const size_t only = claim.find(" only ");
      if (only != std::string::npos) {
        for (const auto& v : split(claim.substr(only + 6), '|')) r.accepted.push_back(support_value(v));
        claim.resize(only);
      }
      r.claim = trim(claim);
      if (r.claim.empty()) throw ConfigError(where + ": provider needs the config-key pattern a provider claims");
    } else if (rule.rfind("only ", 0) == 0) {
      r.kind = SupportRule::Kind::only;
      for (const auto& v : split(rule.substr(5), '|')) r.accepted.push_back(support_value(v));
    } else {
      throw ConfigError(where + ": unknown rule '" + rule + "'");
    }
    if (r.detail.empty()) throw ConfigError(where + ": the detail column is empty");
    rules_.push_back(std::move(r));
  }
}

bool NemoRlTables::known(const std::string& key) const {
  if (index_.count(key)) return true;
  // Under a tree (a free-form mapping)?
  for (size_t dot = key.rfind('.'); dot != std::string::npos && dot > 0; dot = key.rfind('.', dot - 1)) {
    auto it = index_.find(key.substr(0, dot));
    if (it != index_.end() && keys_[it->second].kind == "tree") return true;
    if (dot == 0) break;
  }
  return false;
}

const SupportRule* NemoRlTables::rule_for(const std::string& key) const {
  std::vector<std::string> parts;
  try {
    parts = split_path(key);
  } catch (const ConfigError&) {
    return nullptr;
  }
  // The most specific rule: more literal segments, then a rule for the key itself over a
  // subtree, then a longer pattern; among equals, the later line.
  const SupportRule* best = nullptr;
  std::tuple<size_t, int, size_t> best_score{};
  for (const auto& r : rules_) {
    if (!r.matches(parts)) continue;
    size_t literal = 0;
    for (const auto& p : r.parts) literal += p != "*";
    const std::tuple<size_t, int, size_t> score{literal, r.subtree ? 0 : 1, r.parts.size()};
    if (best == nullptr || score >= best_score) {
      best = &r;
      best_score = score;
    }
  }
  return best;
}

}  // namespace rlh::host
