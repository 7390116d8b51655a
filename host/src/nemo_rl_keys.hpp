// NeMo-RL's configuration keys and what rlhost does with each: two data files embedded at build
// time. host/data/nemo_rl_keys.tsv is generated from NeMo-RL's config definitions and example
// files (scripts/gen_nemo_rl_keys.py); host/data/nemo_rl_support.tsv is rlhost's own rule per key
// (impl / noop / off / only / refuse / provider, described at its top).
#pragma once

#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "config.hpp"

namespace rlh::host {

struct SupportRule {
  enum class Kind { impl, noop, off, only, refuse, provider };
  std::string pattern;               // as written: "a.b", "a.*", "data.*.repeat"
  std::vector<std::string> parts;    // its segments, "*" for any one segment
  bool subtree = false;              // ends in ".*": the key and everything under it
  Kind kind = Kind::noop;
  std::vector<Json> accepted;        // only, and provider ... only: the values accepted (without a provider)
  std::vector<std::string> plugins;  // impl: who reads it
  std::string claim;                 // provider: the config-key pattern a provider's component claims
  std::string detail;                // impl: plugins; else what the key asks for
  size_t line = 0;                   // in nemo_rl_support.tsv

  bool matches(const std::vector<std::string>& key) const;
  // For off/only/provider: whether `v` leaves rlhost's behaviour as it is (provider: as off; a
  // loaded provider that claims `claim` makes any value acceptable, config_keys.cpp checks that).
  bool accepts(const Json& v) const;
  // "1, null", for messages.
  std::string accepted_text() const;
};

const char* to_string(SupportRule::Kind k);

class NemoRlTables {
 public:
  // Parses the data embedded in librlhost; throws ConfigError naming the line on a bad one.
  static const NemoRlTables& embedded();
  NemoRlTables(const std::string& keys_tsv, const std::string& support_tsv);

  // Whether NeMo-RL defines `key` (a leaf path) in one of the versions listed: the key itself,
  // or a key under a free-form mapping ("tree": env, policy.hf_config_overrides, ...).
  bool known(const std::string& key) const;
  // The most specific rule for a key, or null.
  const SupportRule* rule_for(const std::string& key) const;

  struct Key {
    std::string name, kind, refs, sources;  // kind: leaf | map | tree
  };
  const std::vector<Key>& keys() const { return keys_; }
  const std::vector<SupportRule>& rules() const { return rules_; }
  // The NeMo-RL refs (and commits) the key list was generated from: "v0.3.0 ... main".
  const std::string& refs() const { return refs_; }

 private:
  std::vector<Key> keys_;
  std::unordered_map<std::string, size_t> index_;  // name -> keys_
  std::vector<SupportRule> rules_;
  std::string refs_;
};

// Parses one YAML-ish scalar of the support file ("1", "null", "true", "bfloat16", "{}", "[]",
// "\"\"").
Json support_value(const std::string& text);

}  // namespace rlh::host
