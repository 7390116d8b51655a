// The dtensor backend's config keys -> rlh::backend::BackendConfig (docs/backends.md).
#pragma once

#include <nlohmann/json.hpp>

#include "rlhost/backend_common/backend_config.hpp"

namespace rlh::dtensor {

// `policy` is the backend's config section (the job's policy subtree). Throws rlh::sdk::Error
// naming the offending key.
backend::BackendConfig read_config(const nlohmann::json& policy);

}  // namespace rlh::dtensor
