// megatron's device path (megatron_cuda.cpp): the CUDA engine behind backend_common's
// DeviceEngine seam; nullptr where this build has no CUDA engine.
#pragma once

#include "rlhost/backend_common/device_engine.hpp"

namespace rlh::megatron {

const backend::DeviceEngineFactory* cuda_device_engines();

}  // namespace rlh::megatron
