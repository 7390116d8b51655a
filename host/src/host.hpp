// The host object behind librlhost's C API: plugin path, loaded plugins, registry, configuration,
// services handed to plugins, metrics.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "config.hpp"
#include "config_keys.hpp"
#include "plugins.hpp"
#include "rlhost/sdk/launch_env.hpp"
#include "rlhost/sdk/metrics.hpp"
#include "rlhost/comm.h"
#include "rlhost/host.h"

namespace rlh::host {

struct Metric {
  std::string name;
  double value;
  int64_t step;
};

// What a plugin's rlh_host_ctx points to.
struct PluginContext {
  Host* host = nullptr;
  std::string plugin;  // name, for log prefixes
};

class Host {
 public:
  Host();
  ~Host();

  void add_plugin_dir(const std::string& dir);
  const std::vector<std::string>& plugin_dirs() const { return plugin_dirs_; }

  // Loads a plugin by name (searched on the plugin path) or path. Throws sdk::Error.
  void load_plugin(const std::string& name_or_path);
  nlohmann::ordered_json list_plugins();

  Config& config() { return config_; }
  // Resolves interpolations and checks keys; throws on unknown keys; logs warnings (settings a
  // run would refuse too).
  Json resolve_config();
  // resolve_config(), then throws UNIMPLEMENTED naming the first setting that asks for what
  // rlhost lacks (the check run() makes at start). Returns what was accepted and unused.
  KeyCheck check_config();
  const KeyCheck& last_check() const { return last_check_; }

  // Runs the algorithm named by rlhost.algorithm (or the only loaded one).
  void run();
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }

  // Registry: finds a component (initialising its plugin). name empty = best of the kind.
  const Component& find_component(int32_t kind, const std::string& name);
  std::vector<const Component*> components(int32_t kind) const;
  // Usable components of `kind` with their plugin's probe score, best first (0-score plugins
  // left out; ties keep load order): the list_components service.
  std::vector<std::pair<const Component*, int32_t>> ranked_components(int32_t kind) const;
  // Registers every kernel-provider-only plugin on the plugin path (once; list_components of
  // KERNELS calls it), unless rlhost.autoload_kernels is false.
  void autoload_kernel_providers();
  // Registers every plugin on the plugin path whose components are all of `kind` (once per kind).
  void autoload_components(int32_t kind);

  // Services.
  const rlh_host_api* services() const { return &root_services_; }
  rlh_host_api* make_services(const std::string& plugin_name, std::unique_ptr<PluginContext>& ctx_out);
  void log(int32_t level, const std::string& who, const std::string& msg) const;
  void set_log_level(int32_t level) { log_level_ = level; }
  void record_metric(const std::string& name, double value, int64_t step);
  void set_metric_callback(rlhost_metric_fn fn, void* user) {
    std::lock_guard<std::mutex> lock(metrics_mu_);
    metric_fn_ = fn;
    metric_user_ = user;
  }
  std::vector<Metric> metrics() const;
  const Json& resolved_config() const { return resolved_; }
  bool config_resolved() const { return resolved_valid_; }
  // The world communicator, created on first use from the comm component (rlhost.comm, else
  // the best that can create it); world.cpp.
  void world_comm(const rlh_comm_api** api, rlh_comm** comm);
  // At the start of a run: the launch and the cluster keys agree, and with more than one rank,
  // every rank has created the world and met at a barrier (world.cpp).
  // The launch and the cluster keys agree, rlhost.comm_timeout_s is valid (check_config, run).
  void check_world(const Json& resolved) const;
  void start_world(const Json& resolved);
  // Which launcher started this process, as which rank (sdk/launch_env.hpp).
  const sdk::LaunchEnv& launch() const { return launch_; }

  // Allocation counters (bytes and count per device type), for tests and benchmarks.
  std::atomic<int64_t> cpu_allocations{0};
  std::atomic<int64_t> cpu_bytes_live{0};

 private:
  std::string find_on_path(const std::string& name) const;
  std::string probe_reason(const std::string& plugin_name) const;
  void ensure_initialized(Plugin& p);
  int32_t probe_score(const Plugin& p) const;

  std::vector<std::string> plugin_dirs_;
  std::vector<std::unique_ptr<Plugin>> plugins_;  // load order
  std::map<std::string, std::string> failed_;     // path -> error, from load attempts
  Config config_;
  Json resolved_;
  KeyCheck last_check_;
  bool resolved_valid_ = false;
  std::vector<int32_t> autoloaded_kinds_;
  std::atomic<bool> cancelled_{false};
  int32_t log_level_ = RLH_LOG_INFO;
  sdk::LaunchEnv launch_;
  std::string launch_error_;  // a malformed launcher variable, reported when a run starts
  mutable std::mutex metrics_mu_;
  std::vector<Metric> metrics_;
  rlhost_metric_fn metric_fn_ = nullptr;
  void* metric_user_ = nullptr;
  // Console/JSONL/TensorBoard loggers during run(): configured when the run starts, built at the
  // first metric, so an algorithm's "rlhost/total_steps" (sent first) reaches the progress line.
  std::optional<sdk::MetricsConfig> logger_cfg_;
  std::unique_ptr<sdk::MetricsLogger> logger_;
  int64_t total_steps_ = 0;
  std::mutex comm_mu_;
  const rlh_comm_api* comm_api_ = nullptr;
  rlh_comm* world_ = nullptr;
  std::string comm_name_;
  std::atomic<std::thread::id> creating_world_{};
  PluginContext root_context_;
  rlh_host_api root_services_{};
};

}  // namespace rlh::host
