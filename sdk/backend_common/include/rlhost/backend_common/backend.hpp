// The backend C table (rlh_backend_api, abi/include/rlhost/backend.h) over rlh_engine, shared by
// the dtensor and megatron plugins. A plugin supplies a BackendFlavor (its name, how it reads its
// config section, its kernel preference) and a create function that binds it:
//
//   rlh_status* create(const rlh_host_api* h, const char* j, size_t n, rlh_backend** out) {
//     return rlh::backend::create_backend(h, j, n, kFlavor, out);
//   }
//   const rlh_backend_api kApi = rlh::backend::backend_api(create);
//
// Everything else (model loading through the host's MODEL component, kernels through the
// registry, batches to micro-batches, the loss-callback trampoline, the optimizer, weights in HF
// naming, save/load of the training state) is here. docs/backends.md describes the behaviour.
#pragma once

#include <cstddef>

#include <nlohmann/json.hpp>

#include "rlhost/backend.h"
#include "rlhost/backend_common/backend_config.hpp"
#include "rlhost/backend_common/device_engine.hpp"

namespace rlh::backend {

struct BackendFlavor {
  const char* name;  // "dtensor", "megatron"
  // The config section (the `policy` subtree, merged with a model's overrides) -> settings.
  // Throws rlh::sdk::Error naming the offending key.
  BackendConfig (*read_config)(const nlohmann::json& policy);
  // The flavor's device path (device_engine.hpp), chosen by policy.device; NULL: CPU only.
  const DeviceEngineFactory* device_engines = nullptr;
};

rlh_status* create_backend(const rlh_host_api* host, const char* config_json, size_t config_len,
                           const BackendFlavor& flavor, rlh_backend** out);

// The table with `create` in its first slot and the shared implementations in the others.
rlh_backend_api backend_api(rlh_status* (*create)(const rlh_host_api*, const char*, size_t,
                                                  rlh_backend**));

}  // namespace rlh::backend
