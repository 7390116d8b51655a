// The CUDA engine's kernels in tests and benchmarks: a host with the plugin folder of the build
// (or RLH_TEST_PLUGIN_DIR, where binaries were carried to a device machine), its kernel
// providers registered as a backend's are (autoload), and one registry for cuda:0 over them,
// kept for the whole process. cuda_options() hands it to CudaEngineOptions; where no provider
// runs on cuda:0 (no GPU) the registry is absent and the engine refuses with its own message
// after validating the model, so refusal tests still run without a device.
#pragma once

#include <cstdlib>
#include <memory>
#include <string>

#include "rlhost/engine_cuda/cuda_engine.hpp"
#include "rlhost/host.h"
#include "rlhost/sdk/kernel_registry.hpp"
#include "rlhost/sdk/plugin.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::test {

class CudaKernelsThroughAbi {
 public:
  CudaKernelsThroughAbi() {
    sdk::check(rlhost_create(&host_));
    rlhost_set_log_level(host_, RLH_LOG_WARN);
    const char* dir = std::getenv("RLH_TEST_PLUGIN_DIR");
    sdk::check(rlhost_add_plugin_dir(host_, dir && *dir ? dir : RLH_PLUGIN_DIR));
    try {
      reg_ = sdk::make_kernel_registry(sdk::Host(rlhost_services(host_)), sdk::cuda_device(0), {}, "test");
      if (reg_->providers().empty()) reg_.reset();
    } catch (const std::exception& e) {
      why_ = e.what();
      reg_.reset();
    }
  }
  ~CudaKernelsThroughAbi() {
    reg_.reset();
    rlhost_destroy(host_);
  }
  // Null where no provider runs on cuda:0.
  const sdk::KernelRegistry* registry() const { return reg_.get(); }

 private:
  rlhost_t* host_ = nullptr;
  std::unique_ptr<sdk::KernelRegistry> reg_;
  std::string why_;
};

inline const sdk::KernelRegistry* cuda_registry() {
  static CudaKernelsThroughAbi* k = new CudaKernelsThroughAbi();  // for the whole process
  return k->registry();
}

// CudaEngineOptions on the registry's kernels (the rest default).
inline engine::CudaEngineOptions cuda_options() {
  engine::CudaEngineOptions o;
  o.kernels = cuda_registry();
  return o;
}

}  // namespace rlh::test
