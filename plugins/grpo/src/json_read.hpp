// Typed reads of NeMo-RL config keys with one-line errors (internal to rlh_grpo_core).
#pragma once

#include <cmath>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "rlhost/grpo/config.hpp"

namespace rlh::grpo::detail {

using json = nlohmann::json;

inline std::string describe(const json& v) {
  if (v.is_null()) return "null";
  std::string s = v.dump();
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return std::string(v.type_name()) + " " + s;
}

// A config section: the JSON object and its dotted name for messages ("loss_fn").
class Section {
 public:
  Section(const json& j, std::string name) : j_(j), name_(std::move(name)) {
    if (!j_.is_null() && !j_.is_object())
      throw ConfigError(name_ + ": expected a mapping, got " + describe(j_));
  }

  std::string key(std::string_view k) const { return name_ + "." + std::string(k); }
  const std::string& name() const { return name_; }
  [[noreturn]] void fail(const std::string& what) const { throw ConfigError(name_ + ": " + what); }

  const json* find(std::string_view k) const {
    if (!j_.is_object()) return nullptr;
    auto it = j_.find(std::string(k));
    return it == j_.end() ? nullptr : &*it;
  }
  bool has(std::string_view k) const { return find(k) != nullptr; }

  // A section nested under `k` (null when absent).
  Section sub(std::string_view k) const {
    const json* v = find(k);
    static const json kNull;
    return Section(v ? *v : kNull, key(k));
  }

  void read(std::string_view k, bool& out) const {
    const json* v = find(k);
    if (v == nullptr) return;
    if (!v->is_boolean()) throw ConfigError(key(k) + ": expected true or false, got " + describe(*v));
    out = v->get<bool>();
  }
  void read(std::string_view k, double& out) const {
    const json* v = find(k);
    if (v == nullptr) return;
    out = number(k, *v);
  }
  // A number or null.
  void read(std::string_view k, std::optional<double>& out) const {
    const json* v = find(k);
    if (v == nullptr) return;
    if (v->is_null()) {
      out.reset();
      return;
    }
    out = number(k, *v);
  }
  void read(std::string_view k, int64_t& out) const {
    const json* v = find(k);
    if (v == nullptr) return;
    if (!v->is_number_integer())
      throw ConfigError(key(k) + ": expected an integer, got " + describe(*v));
    out = v->get<int64_t>();
  }
  // An integer or null.
  void read(std::string_view k, std::optional<int64_t>& out) const {
    const json* v = find(k);
    if (v == nullptr) return;
    if (v->is_null()) {
      out.reset();
      return;
    }
    if (!v->is_number_integer())
      throw ConfigError(key(k) + ": expected an integer or null, got " + describe(*v));
    out = v->get<int64_t>();
  }
  // A string or null.
  void read(std::string_view k, std::optional<std::string>& out) const {
    const json* v = find(k);
    if (v == nullptr) return;
    if (v->is_null()) {
      out.reset();
      return;
    }
    if (!v->is_string()) throw ConfigError(key(k) + ": expected a string or null, got " + describe(*v));
    out = v->get<std::string>();
  }
  void read(std::string_view k, std::string& out) const {
    const json* v = find(k);
    if (v == nullptr) return;
    if (!v->is_string()) throw ConfigError(key(k) + ": expected a string, got " + describe(*v));
    out = v->get<std::string>();
  }

 private:
  double number(std::string_view k, const json& v) const {
    if (!v.is_number()) throw ConfigError(key(k) + ": expected a number, got " + describe(v));
    double d = v.get<double>();
    if (!std::isfinite(d)) throw ConfigError(key(k) + ": expected a finite number");
    return d;
  }

  const json& j_;
  std::string name_;
};

// The member `key` of an object, or null (also when `j` is not an object).
inline const nlohmann::json& child(const nlohmann::json& j, const char* key) {
  static const nlohmann::json kNull;
  if (!j.is_object()) return kNull;
  auto it = j.find(key);
  return it == j.end() ? kNull : *it;
}

// An integer key that must be positive (its default when absent).
inline int64_t positive(const Section& s, const char* key, int64_t def) {
  int64_t v = def;
  s.read(key, v);
  if (v <= 0) throw ConfigError(s.key(key) + ": expected a positive integer, got " + std::to_string(v));
  return v;
}

}  // namespace rlh::grpo::detail
