// Checks every key of a resolved configuration against the keys loaded components own, NeMo-RL's
// keys (every version listed in host/data/nemo_rl_keys.tsv) and rlhost's rule for each of them
// (host/data/nemo_rl_support.tsv). See config_keys.cpp.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "config.hpp"
#include "nemo_rl_keys.hpp"

namespace rlh::host {

struct KeyCheck {
  static constexpr size_t kMaxReported = 20;
  std::vector<std::string> errors;    // unknown keys: one message each, the first kMaxReported
  size_t unreported = 0;              // unknown keys past those
  std::vector<std::string> unused;    // NeMo-RL keys rlhost reads, but no loaded plugin does (subtrees)
  std::vector<std::string> accepted;  // NeMo-RL keys rlhost does not implement, accepted ("key=value")
  std::vector<std::string> refused;   // values asking for what rlhost lacks: one message per rule
};

// `owned_patterns`: dotted keys, "x.*" for subtrees. `plugins`: names of the loaded plugins
// ("host" is always there). `origin_of` names the file that set a key.
KeyCheck check_keys(const Json& resolved, const std::vector<std::string>& owned_patterns,
                    const std::vector<std::string>& plugins,
                    const std::function<std::string(const std::string&)>& origin_of,
                    const NemoRlTables& tables = NemoRlTables::embedded());

}  // namespace rlh::host
