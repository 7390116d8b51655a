// The engine's context-parallel group over the backend's communicator (context_parallel.hpp).
#include "rlhost/backend_common/context_parallel.hpp"

#include <chrono>

#include "rlhost/backend_common/data_parallel.hpp"  // FloatView

namespace rlh::backend {

void CommCpGroup::all_gather(const float* in, int64_t n, float* out) {
  const auto t0 = std::chrono::steady_clock::now();
  const int S = c_.size();
  FloatView mine(const_cast<float*>(in), n), all(out, n * S);
  c_.all_gather(*mine, *all);
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  bytes_ += n * S * int64_t(sizeof(float)) * (S - 1) / S;
}

void CommCpGroup::reduce_scatter_sum(const float* in, int64_t n, float* out) {
  const auto t0 = std::chrono::steady_clock::now();
  const int S = c_.size();
  FloatView all(const_cast<float*>(in), n * S), mine(out, n);
  c_.reduce_scatter(*all, *mine, RLH_REDUCE_SUM);
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  bytes_ += n * S * int64_t(sizeof(float)) * (S - 1) / S;
}

}  // namespace rlh::backend

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
  // The CUDA engine has no context parallelism: an explicit device is refused, auto stays on the
  // CPU engine.
  const std::string& d = m.config.device;
  if (d != "cpu" && d != "auto")
    throw sdk::Error(RLH_E_UNIMPLEMENTED, std::string(b.flavor->name) + ": " + key + " with policy.device = " + d +
                                              ": context parallelism runs on the CPU engine only (set policy.device = cpu)");
  if (d == "auto") m.config.device = "cpu";
  m.cp_comm = std::make_unique<CommCpGroup>(b.dp->cp);
}

}  // namespace rlh::backend
