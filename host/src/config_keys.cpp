// Checking every key of a resolved configuration against who owns it.
//
// A key is fine when a loaded component owns it (its config_keys), or the host owns it
// (`rlhost.*`). A key NeMo-RL defines (any version of host/data/nemo_rl_keys.tsv) gets rlhost's
// rule for it (host/data/nemo_rl_support.tsv):
//   impl    read by the plugins the rule names; when none of them is loaded, it is unused
//   noop    accepted: it does not change what rlhost computes
//   off     accepted when off (false, null, 0, empty), else refused
//   only    accepted for the values listed, else refused
//   refuse  refused (a section of an algorithm rlhost does not have)
//   provider as off, unless a loaded component claims the rule's pattern in its config_keys
//           (a vendor's FP8 kernels): then the plugins that read the key judge its value
// Accepted and unused keys are reported in one warning by the host; refusals stop a run at
// start. Any other key is an error naming the key, the file that set it and the closest known key.
#include "config_keys.hpp"

#include <algorithm>
#include <climits>
#include <set>
#include <string_view>

namespace rlh::host {
namespace {

// key is `base` or lies under it (a map under an owned key). Without building strings: it runs
// for every key against every owned pattern (most of a config check's time).
bool under(const std::string& key, std::string_view base) {
  return key.size() >= base.size() && key.compare(0, base.size(), base) == 0 &&
         (key.size() == base.size() || key[base.size()] == '.');
}

bool matches(const std::string& key, const std::string& pattern) {
  std::string_view p(pattern);
  if (p.size() >= 2 && p.substr(p.size() - 2) == ".*") p.remove_suffix(2);
  return under(key, p);
}

// Every leaf key (as collect_keys) with its value. (Looking each key up again from the root was
// a linear scan of an ordered_json per key: 80,000 keys in one mapping took 18 s.)
void collect_leaves(const Json& j, const std::string& prefix, std::vector<std::pair<std::string, const Json*>>& out) {
  if (j.is_object() && !j.empty()) {
    for (auto it = j.begin(); it != j.end(); ++it)
      collect_leaves(it.value(), prefix.empty() ? it.key() : prefix + "." + it.key(), out);
  } else if (!prefix.empty()) {
    out.emplace_back(prefix, &j);
  }
}

std::string show(const Json& v) {
  std::string s = v.is_string() ? v.get<std::string>() : v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

// The subtree an unused key is reported under: the rule's pattern without "*", cut to at most
// three segments ("policy.megatron_cfg.optimizer"), so the list stays short.
std::string report_root(const std::string& key) {
  size_t dots = 0, i = 0;
  for (; i < key.size(); ++i)
    if (key[i] == '.' && ++dots == 3) break;
  return key.substr(0, i);
}

}  // namespace

KeyCheck check_keys(const Json& resolved, const std::vector<std::string>& owned_patterns,
                    const std::vector<std::string>& plugins,
                    const std::function<std::string(const std::string&)>& origin_of,
                    const NemoRlTables& tables) {
  KeyCheck result;
  std::vector<std::pair<std::string, const Json*>> keys;
  collect_leaves(resolved, "", keys);
  std::set<std::string> unused_roots;
  std::set<const SupportRule*> refused_rules;
  auto loaded = [&](const std::string& p) { return std::find(plugins.begin(), plugins.end(), p) != plugins.end(); };
  for (const auto& leaf : keys) {
    const std::string& key = leaf.first;  // (not a structured binding: clang 14 cannot capture one)
    const Json* v = leaf.second;
    if (matches(key, "rlhost.*")) continue;
    const bool owned =
        std::any_of(owned_patterns.begin(), owned_patterns.end(), [&](const std::string& p) { return matches(key, p); });
    if (tables.known(key)) {
      // A NeMo-RL key is judged by rlhost's rule even when a plugin claims a subtree around it
      // (megatron owns policy.megatron_cfg.*, which holds fp8_cfg.enabled): the rule table is
      // the one place that says what rlhost honours.
      const SupportRule* rule = tables.rule_for(key);
      const Json& value = *v;
      if (rule == nullptr) {  // the test keeps every NeMo-RL key covered; be safe anyway
        if (!owned) result.accepted.push_back(key + "=" + show(value));
        continue;
      }
      if (rule->kind == SupportRule::Kind::impl) {
        if (!owned && !std::any_of(rule->plugins.begin(), rule->plugins.end(), loaded) &&
            unused_roots.insert(report_root(key)).second)
          result.unused.push_back(report_root(key));
        continue;
      }
      // A provider rule's feature comes from a plugin: a loaded component that claims the rule's
      // pattern among its config keys (a vendor's FP8 kernels claim
      // policy.megatron_cfg.fp8_cfg.*) honours the key, and the backend reading it decides.
      if (rule->kind == SupportRule::Kind::provider &&
          std::find(owned_patterns.begin(), owned_patterns.end(), rule->claim) != owned_patterns.end())
        continue;
      if (rule->accepts(value)) {
        result.accepted.push_back(key + "=" + show(value));
        continue;
      }
      if (!refused_rules.insert(rule).second) continue;  // one message per rule
      std::string msg = "config key '" + key + "' = " + show(value) + " (from " + origin_of(key) + ") needs " +
                        rule->detail + ", which rlhost does not have";
      if (rule->kind == SupportRule::Kind::only) msg += " (it accepts " + rule->accepted_text() + ")";
      else if (rule->kind == SupportRule::Kind::off) msg += " (it accepts false or null)";
      else if (rule->kind == SupportRule::Kind::provider)
        msg += " without a provider: no loaded plugin claims " + rule->claim +
               " (load one with --plugin: kernel providers found on the plugin path are loaded after this check; it accepts " +
               (rule->accepted.empty() ? std::string("false or null") : rule->accepted_text()) + " without one)";
      result.refused.push_back(msg);
      continue;
    }
    if (owned) continue;  // an rlhost key of a loaded plugin (policy.device, ...native_cfg)
    // Unknown. Past the first kMaxReported, only counted: a file of 100,000 stray keys would
    // otherwise cost 100,000 suggestion searches and as many error lines.
    if (result.errors.size() >= KeyCheck::kMaxReported) {
      ++result.unreported;
      continue;
    }
    // Suggest the closest key among owned patterns and NeMo-RL's keys.
    std::string best;
    size_t best_d = SIZE_MAX;
    auto consider = [&](std::string c) {
      if (c.size() >= 2 && c.compare(c.size() - 2, 2, ".*") == 0) c.resize(c.size() - 2);
      size_t d = edit_distance(key, c);
      if (d < best_d) { best_d = d; best = c; }
    };
    for (const auto& p : owned_patterns) consider(p);
    for (const auto& k : tables.keys()) consider(k.name);
    std::string msg = "unknown config key '" + key + "' (from " + origin_of(key) + ")";
    if (!best.empty() && best_d <= std::max<size_t>(3, key.size() / 4)) msg += "; did you mean '" + best + "'?";
    msg += " No loaded plugin owns it and NeMo-RL (" + tables.refs() + ") does not define it.";
    result.errors.push_back(msg);
  }
  return result;
}

}  // namespace rlh::host
