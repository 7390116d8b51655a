// The megatron plugin: a BACKEND component over rlh_engine (through rlh_backend_common), read
// from NeMo-RL's Megatron policy keys, with a device path on one Hopper GPU (rlh_backend_cuda:
// the CUDA engine and the kernels its registry resolves) where this build has it. Its TP/SP/PP/CP/EP
// and DP layouts over the launched ranks are read in megatron_config.cpp (docs/parallelism.md).
#include "megatron_config.hpp"
#include "rlhost/backend.h"
#include "rlhost/backend_common/backend.hpp"
#include "rlhost/sdk/plugin.hpp"
#if RLH_MEGATRON_CUDA
#include "rlhost/backend_cuda/cuda_device_engine.hpp"
#endif

namespace {

#if RLH_MEGATRON_CUDA
const rlh::backend::DeviceEngineFactory* const kDevice = rlh::backend::cuda_device_engines();
#else
const rlh::backend::DeviceEngineFactory* const kDevice = nullptr;
#endif

const rlh::backend::BackendFlavor kFlavor = {"megatron", &rlh::megatron::read_config, kDevice};

rlh_status* create(const rlh_host_api* host, const char* config_json, size_t config_len, rlh_backend** out) {
  return rlh::backend::create_backend(host, config_json, config_len, kFlavor, out);
}

const rlh_backend_api kApi = rlh::backend::backend_api(create);

// Owned here; the shared policy keys are owned by dtensor too (the host allows two owners).
const char* const kKeys[] = {"policy.megatron_cfg.*",
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
    RLH_KIND_BACKEND, "megatron", "0.1.0", RLH_BACKEND_API_VERSION_MAJOR, RLH_BACKEND_API_VERSION_MINOR, &kApi,
    "training backend configured like NeMo-RL's Megatron worker (Megatron optimizer/scheduler): the fp32 CPU "
    "engine, or bf16 on one Hopper GPU (policy.device)",
    kKeys);

const rlh_component_desc* const kComponents[] = {&kBackend};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("megatron", "0.1.0", "rlhost", kComponents,
                                        "Megatron-style training backend (CPU fp32; bf16 on one Hopper GPU: dense Llama, MoE, DeepSeek-V3)"))
