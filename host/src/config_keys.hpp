// Checks every key of a resolved configuration against the keys loaded components own and the
// keys NeMo-RL defines. See config_keys.cpp.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "config.hpp"

namespace rlh::host {

struct KeyCheck {
  static constexpr size_t kMaxReported = 20;
  std::vector<std::string> errors;        // unknown keys: one message each, the first kMaxReported
  size_t unreported = 0;                  // unknown keys past those
  std::vector<std::string> unused_known;  // NeMo-RL subtrees nothing loaded uses: one warning each
};

// `owned_patterns`: dotted keys, "x.*" for subtrees. `origin_of` names the file that set a key.
KeyCheck check_keys(const Json& resolved, const std::vector<std::string>& owned_patterns,
                    const std::function<std::string(const std::string&)>& origin_of);

}  // namespace rlh::host
