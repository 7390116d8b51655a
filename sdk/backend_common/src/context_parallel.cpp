// Context parallelism's load-time checks (context_parallel.hpp: the engine's group).
#include "rlhost/backend_common/context_parallel.hpp"

#include "backend_internal.hpp"

namespace rlh::backend {

void check_context_parallel(Backend& b, Model& m) {
  const int64_t cp = m.config.parallel.cp;
  if (cp <= 1) return;
  const std::string key = "policy.megatron_cfg.context_parallel_size = " + std::to_string(cp);
  if (!b.dp || b.dp->cp_size() != cp)
    throw sdk::Error(RLH_E_INVALID_ARGUMENT,
                     std::string(b.flavor->name) + ": " + key + " needs a multiple of " +
                         std::to_string(cp * m.config.parallel.tp) + " launched ranks (tensor x context parallel), but " +
                         (b.dp ? "this backend's groups have context-parallel size " + std::to_string(b.dp->cp_size())
                               : std::string("one rank was started")));
  // The device path has none: place_on_device refuses an explicit device; auto stays on the CPU engine.
  m.cp_comm = std::make_unique<CommCpGroup>(b.dp->cp);
}

}  // namespace rlh::backend
