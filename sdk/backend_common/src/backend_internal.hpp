// What lives behind the opaque rlh_backend / rlh_model handles, shared by the files that
// implement the table's slots (backend_api.cpp, model_loading.cpp, training_state.cpp).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/backend_common/backend.hpp"
#include "rlhost/backend_common/backend_config.hpp"
#include "rlhost/backend_common/optimizer.hpp"
#include "rlhost/engine/engine.hpp"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/model_desc.hpp"
#include "rlhost/sdk/plugin.hpp"
#include "rlhost/sdk/safetensors.hpp"

namespace rlh::backend {

struct Backend;

struct Model {
  Backend* owner = nullptr;
  std::string role;
  std::string dir;  // resolved HF folder it was loaded from
  bool trainable = false;
  BackendConfig config;  // the backend's section with this model's overrides
  sdk::TransformerDesc desc;
  // The checkpoint the weights came from, kept open so tensors that are no parameter (a stored
  // tied lm_head, rotary buffers) pass through into saved states unchanged.
  sdk::st::Checkpoint checkpoint;
  std::vector<std::string> passthrough;
  // Declaration order is destruction order reversed: the optimizer goes before the engine, the
  // engine before its ops, the ops before the registry and the allocator they draw from.
  engine::CountingAllocator alloc;
  std::unique_ptr<sdk::KernelRegistry> registry;
  std::unique_ptr<engine::Ops> ops;
  std::string kernels;  // which kernels run it, for logs
  std::unique_ptr<engine::Engine> engine;
  std::unique_ptr<Optimizer> optimizer;  // trainable models only
  // A model on the flavor's device path (policy.device) has this instead of engine/ops/optimizer:
  // the device engine keeps weights, gradients and optimizer state itself.
  std::unique_ptr<DeviceEngine> device;
  int64_t loaded_version = 0;  // weights version of a non-trainable model's state

  int64_t version() const {
    if (optimizer) return optimizer->steps();
    return device && trainable ? device->steps() : loaded_version;
  }
  // The schedule's learning rate and weight decay for the next update (lr_override >= 0 wins).
  Optimizer::StepInfo next_update(double lr_override) const;
};

struct Backend {
  const BackendFlavor* flavor = nullptr;
  sdk::Host host;
  nlohmann::json policy;  // the config section as given to create
  BackendConfig config;
  std::vector<std::unique_ptr<Model>> models;
};

inline Backend* as_backend(rlh_backend* b) { return reinterpret_cast<Backend*>(b); }
inline Model* as_model(rlh_model* m) { return reinterpret_cast<Model*>(m); }

// model_loading.cpp
// The description of the HF folder `dir` (config.json text `config_text`), from the caller's
// JSON or the host's MODEL component that lists the config's architecture.
sdk::TransformerDesc describe_model(const sdk::Host& host, const std::string& dir, const std::string& config_text,
                                    const rlh_model_args& args);
// Kernels for one model: a KERNELS component through the registry (flavor preference first,
// then the best-scoring one), else kernels_cpu called directly.
void select_kernels(const sdk::Host& host, const BackendFlavor& flavor, Model& m);
std::unique_ptr<Model> load_model(Backend& b, const rlh_model_args& args);

// The optimizer a trainable model gets (its frozen parameters follow the model's config).
std::unique_ptr<Optimizer> make_optimizer(Model& m);
// Whether the optimizer leaves `p` alone: untrainable, or a router frozen by the config. Such
// parameters have no optimizer state, on either path.
bool without_update(const Model& m, const sdk::ParamDesc& p);

// training_state.cpp
void save_state(Model& m, const std::string& dir);
void load_state(Model& m, const std::string& dir);

}  // namespace rlh::backend
