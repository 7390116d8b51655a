// A host with the kernels_cpu plugin loaded from the build tree and a kernel registry over its
// component, for the tests that run the engine through the C ABI (make_registry_ops). The
// registry (its provider instance) is released before the host unloads the plugin.
#pragma once

#include <optional>

#include "rlhost/host.h"
#include "rlhost/kernels.h"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::test {

class KernelsCpuThroughAbi {
 public:
  KernelsCpuThroughAbi() {
    sdk::check(rlhost_create(&host_));
    try {
      rlhost_set_log_level(host_, RLH_LOG_WARN);
      sdk::check(rlhost_add_plugin_dir(host_, RLH_PLUGIN_DIR));
      sdk::check(rlhost_load_plugin(host_, "kernels_cpu"));
      const rlh_host_api* svc = rlhost_services(host_);
      const rlh_component_desc* d = nullptr;
      sdk::check(svc->find_component(svc->ctx, RLH_KIND_KERNELS, "kernels_cpu", &d));
      reg_.emplace();
      reg_->add("kernels_cpu", static_cast<const rlh_kernels_api*>(d->api), svc, sdk::kCPU);
    } catch (...) {
      reg_.reset();
      rlhost_destroy(host_);
      throw;
    }
  }
  ~KernelsCpuThroughAbi() {
    reg_.reset();
    rlhost_destroy(host_);
  }
  KernelsCpuThroughAbi(const KernelsCpuThroughAbi&) = delete;
  KernelsCpuThroughAbi& operator=(const KernelsCpuThroughAbi&) = delete;
  sdk::KernelRegistry& registry() { return *reg_; }

 private:
  rlhost_t* host_ = nullptr;
  std::optional<sdk::KernelRegistry> reg_;
};

}  // namespace rlh::test
