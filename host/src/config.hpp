// The configuration tree: NeMo-RL's YAML conventions, natively.
//
//  - `defaults: parent.yaml` (or a list) inherits, relative to the file, chained; the child's
//    keys win, maps merge deeply.
//  - Overrides: `a.b=v` sets an existing key (type-checked against the old value), `++a.b=v`
//    adds or sets, `+a.b=v` adds (error if present), `~a.b` deletes.
//  - `${a.b}` interpolation (absolute, or `${.x}` relative to the containing map) and the
//    `mul/add/div/max/min` resolvers: `${mul:${a.b},2}`.
//  - Every key remembers the file (or command line) that set it, so errors can name it.
//
// The tree is nlohmann::ordered_json so printing keeps the file's key order. Errors are thrown
// as ConfigError with a one-line message.
#pragma once

#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace rlh::host {

using Json = nlohmann::ordered_json;

struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Config {
 public:
  // Loads `path` and its defaults chain, replacing the current tree.
  void load_file(const std::filesystem::path& path);
  // Loads YAML text (no defaults relative paths other than the current directory).
  void load_text(const std::string& yaml, const std::string& origin);
  // Applies one override ("a.b=v", "++a.b=v", "+a.b=v", "~a.b").
  void apply_override(const std::string& text);
  // Returns the tree with every interpolation resolved.
  Json resolved() const;

  const Json& raw() const { return tree_; }
  bool empty() const { return tree_.is_null() || tree_.empty(); }
  // Where a key (dotted path) was last set: a file path or "command line"; walks up to the
  // nearest ancestor that has a record.
  std::string origin_of(const std::string& dotted) const;

 private:
  Json tree_ = Json::object();
  std::map<std::string, std::string> origins_;
};

// Parses YAML text into Json (scalars typed as YAML 1.2 core: null, bool, int, float, string;
// quoted scalars stay strings). `origin` names the text in errors.
Json parse_yaml(const std::string& text, const std::string& origin);
// Emits Json as block-style YAML.
std::string to_yaml(const Json& j);

// Splits "a.b.c" into {"a","b","c"}; rejects empty segments.
std::vector<std::string> split_path(const std::string& dotted);

// Every leaf path of a tree (maps recurse; lists and scalars are leaves).
void collect_keys(const Json& j, const std::string& prefix, std::vector<std::string>& out);

// Levenshtein distance, for "did you mean" suggestions.
size_t edit_distance(const std::string& a, const std::string& b);

}  // namespace rlh::host
