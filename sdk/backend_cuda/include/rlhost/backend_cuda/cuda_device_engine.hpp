// The training backends' device path (megatron and dtensor, policy.device = cuda): the CUDA
// engine behind backend_common's DeviceEngine seam. Built where the CUDA engine is; a plugin
// built without it passes no factory.
#pragma once

#include "rlhost/backend_common/device_engine.hpp"

namespace rlh::backend {

const DeviceEngineFactory* cuda_device_engines();

}  // namespace rlh::backend
