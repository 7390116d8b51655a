// A host with the kernels_cpu plugin loaded from the build tree and a kernel registry over it,
// for tests that run executors (the engines, the generator) on the reference kernels through the
// C ABI, as a backend does. The registry (its provider instance) is released before the host
// unloads the plugin. A test target gets RLH_PLUGIN_DIR from rlh_test_uses_cpu_kernels()
// (tests/CMakeLists.txt).
#pragma once

#include <cstdlib>
#include <memory>
#include <optional>

#include "rlhost/engine/engine.hpp"
#include "rlhost/engine/ops.hpp"
#include "rlhost/host.h"
#include "rlhost/kernels.h"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::test {

class KernelsCpuThroughAbi {
 public:
  // `extra_plugins`: further plugin names or paths to load before the registry is built, so
  // their providers take part (in the host's score order; kernels_cpu, the reference, last).
  // `config`: kernels_cpu's instance config ({"num_threads": N}).
  explicit KernelsCpuThroughAbi(std::initializer_list<const char*> extra_plugins = {},
                                const char* config = "{}") {
    sdk::check(rlhost_create(&host_));
    try {
      rlhost_set_log_level(host_, RLH_LOG_WARN);
      const char* dir = std::getenv("RLH_TEST_PLUGIN_DIR");  // binaries carried elsewhere (device)
      sdk::check(rlhost_add_plugin_dir(host_, dir && *dir ? dir : RLH_PLUGIN_DIR));
      sdk::check(rlhost_load_plugin(host_, "kernels_cpu"));
      for (const char* p : extra_plugins) sdk::check(rlhost_load_plugin(host_, p));
      const rlh_host_api* svc = rlhost_services(host_);
      const rlh_component_desc* d = nullptr;
      sdk::check(svc->find_component(svc->ctx, RLH_KIND_KERNELS, "kernels_cpu", &d));
      reg_.emplace();
      reg_->add("kernels_cpu", static_cast<const rlh_kernels_api*>(d->api), svc, sdk::kCPU, config);
    } catch (...) {
      reg_.reset();
      rlhost_destroy(host_);
      throw;
    }
  }
  ~KernelsCpuThroughAbi() {
    ops_.reset();
    reg_.reset();
    rlhost_destroy(host_);
  }
  KernelsCpuThroughAbi(const KernelsCpuThroughAbi&) = delete;
  KernelsCpuThroughAbi& operator=(const KernelsCpuThroughAbi&) = delete;
  sdk::KernelRegistry& registry() { return *reg_; }
  rlhost_t* host() { return host_; }
  // The engine's ops over the registry (made on first use).
  engine::Ops& ops() {
    if (!ops_) ops_ = engine::make_registry_ops(*reg_);
    return *ops_;
  }

 private:
  rlhost_t* host_ = nullptr;
  std::optional<sdk::KernelRegistry> reg_;
  std::unique_ptr<engine::Ops> ops_;
};

// The process's reference kernels (one host, kept for the whole process: executors built in
// any test may use them).
inline engine::Ops& cpu_ops() {
  static KernelsCpuThroughAbi* k = new KernelsCpuThroughAbi();
  return k->ops();
}

// Engine options on those kernels (the rest default).
inline engine::EngineOptions engine_options() {
  engine::EngineOptions o;
  o.ops = &cpu_ops();
  return o;
}

}  // namespace rlh::test
