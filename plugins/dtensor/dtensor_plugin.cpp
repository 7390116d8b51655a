// The dtensor plugin: a BACKEND component over rlh_engine (through rlh_backend_common), read
// from NeMo-RL's DTensor policy keys: FSDP / HSDP over the launched ranks, on the CPU engine or
// (policy.device = cuda, bf16) on one Hopper GPU a rank through the CUDA engine.
#include "dtensor_config.hpp"
#include "rlhost/backend.h"
#include "rlhost/backend_common/backend.hpp"
#include "rlhost/sdk/plugin.hpp"
#if RLH_DTENSOR_CUDA
#include "rlhost/backend_cuda/cuda_device_engine.hpp"
#endif

namespace {

// The device path (policy.device = cuda: the CUDA engine, FSDP sharding its fp32 masters and
// moments over the ranks); nullptr where this build has no CUDA engine.
#if RLH_DTENSOR_CUDA
const rlh::backend::DeviceEngineFactory* const kDevice = rlh::backend::cuda_device_engines();
#else
const rlh::backend::DeviceEngineFactory* const kDevice = nullptr;
#endif

const rlh::backend::BackendFlavor kFlavor = {"dtensor", &rlh::dtensor::read_config, kDevice};

rlh_status* create(const rlh_host_api* host, const char* config_json, size_t config_len, rlh_backend** out) {
  return rlh::backend::create_backend(host, config_json, config_len, kFlavor, out);
}

const rlh_backend_api kApi = rlh::backend::backend_api(create);

// Owned here; the shared policy keys are owned by megatron too (the host allows two owners).
const char* const kKeys[] = {"policy.dtensor_cfg.*",
                             "policy.optimizer.*",
                             "policy.scheduler.*",
                             "policy.max_grad_norm",
                             "policy.precision",
                             "policy.device",
                             "policy.kernels.*",
                             "policy.train_micro_batch_size",
                             "policy.logprob_batch_size",
                             "policy.sequence_packing.*",
                             "policy.dynamic_batching.*",
                             nullptr};

const rlh_component_desc kBackend = rlh::sdk::component_desc(
    RLH_KIND_BACKEND, "dtensor", "0.1.0", RLH_BACKEND_API_VERSION_MAJOR, RLH_BACKEND_API_VERSION_MINOR, &kApi,
    "training backend configured like NeMo-RL's DTensor worker (torch optimizer/scheduler): the fp32 CPU "
    "engine, or bf16 on one Hopper GPU (policy.device)",
    kKeys);

const rlh_component_desc* const kComponents[] = {&kBackend};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("dtensor", "0.1.0", "rlhost", kComponents,
                                        "DTensor-style training backend (CPU fp32; bf16 on one Hopper GPU, FSDP over ranks)"))
