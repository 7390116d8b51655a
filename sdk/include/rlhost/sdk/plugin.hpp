// rlhost C++ SDK: writing a plugin.
//
//   #include "rlhost/sdk/plugin.hpp"
//   static const rlh_component_desc* kComponents[] = {&kMyBackend};
//   RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("myplugin", "0.1.0", "Me", kComponents));
//
// The SDK is header-only and private to each plugin: nothing here is exported except the entry
// that RLH_DEFINE_PLUGIN emits. A plugin keeps the host table it receives in init() (or in a
// component's create) in a Host object for logging, config and registry lookups.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "rlhost/plugin.h"
#include "rlhost/sdk/status.hpp"

#if defined(_WIN32)
#define RLH_EXPORT __declspec(dllexport)
#else
#define RLH_EXPORT __attribute__((visibility("default")))
#endif

// Emits the plugin's one exported symbol returning the descriptor `desc_expr` (evaluated once).
#define RLH_DEFINE_PLUGIN(desc_expr)                                                    \
  extern "C" RLH_EXPORT const rlh_plugin_desc* rlh_plugin_entry(uint32_t host_major,   \
                                                                uint32_t host_minor) { \
    (void)host_major;                                                                  \
    (void)host_minor;                                                                  \
    static const rlh_plugin_desc desc = (desc_expr);                                   \
    return &desc;                                                                      \
  }

namespace rlh::sdk {

// A component descriptor for an interface table `api` of kind `kind`.
template <typename Api>
constexpr rlh_component_desc component_desc(int32_t kind, const char* name, const char* version,
                                            uint32_t iface_major, uint32_t iface_minor,
                                            const Api* api, const char* description = nullptr,
                                            const char* const* config_keys = nullptr) {
  rlh_component_desc d{};
  d.struct_size = RLH_STRUCT_SIZE(rlh_component_desc, config_keys);
  d.kind = kind;
  d.name = name;
  d.version = version;
  d.iface_major = iface_major;
  d.iface_minor = iface_minor;
  d.api = api;
  d.description = description;
  d.config_keys = config_keys;
  return d;
}

// A plugin descriptor compiled against this header's ABI version.
template <size_t N>
constexpr rlh_plugin_desc plugin_desc(const char* name, const char* version, const char* vendor,
                                      const rlh_component_desc* const (&components)[N],
                                      const char* description = nullptr,
                                      const char* license = "Apache-2.0") {
  rlh_plugin_desc d{};
  d.struct_size = RLH_STRUCT_SIZE(rlh_plugin_desc, shutdown);
  d.abi_major = RLH_ABI_VERSION_MAJOR;
  d.abi_minor = RLH_ABI_VERSION_MINOR;
  d.name = name;
  d.version = version;
  d.vendor = vendor;
  d.license = license;
  d.description = description;
  d.components = components;
  d.num_components = N;
  return d;
}

// The services the host handed to this plugin, with C++ conveniences. Copyable (a view).
class Host {
 public:
  Host() = default;
  explicit Host(const rlh_host_api* api) : api_(api) {}
  const rlh_host_api* api() const { return api_; }
  explicit operator bool() const { return api_ != nullptr; }

  MakeStatusFn make_status() const { return api_ != nullptr ? api_->make_status : nullptr; }

  void log(int32_t level, std::string_view msg) const {
    if (api_ != nullptr && api_->log != nullptr) api_->log(api_->ctx, level, msg.data(), msg.size());
  }
  void info(std::string_view m) const { log(RLH_LOG_INFO, m); }
  void warn(std::string_view m) const { log(RLH_LOG_WARN, m); }
  void error(std::string_view m) const { log(RLH_LOG_ERROR, m); }

  // The configuration subtree at `path` as JSON text; throws Error(NOT_FOUND) when absent.
  std::string config_json(const char* path) const {
    std::string out;
    require(api_ != nullptr && api_->config_get != nullptr, "host has no config service");
    check(api_->config_get(api_->ctx, path, write_to_string, &out), path);
    return out;
  }

  void metric(const char* name, double value, int64_t step) const {
    if (api_ != nullptr && api_->metric != nullptr) api_->metric(api_->ctx, name, value, step);
  }

  bool cancelled() const {
    return api_ != nullptr && api_->is_cancelled != nullptr && api_->is_cancelled(api_->ctx) != 0;
  }

  // Finds a component of `kind` (name nullptr = best of that kind) and returns its table cast
  // to Api, checking the table is at least `min_size` bytes (the fields this caller uses).
  template <typename Api>
  const Api* find(int32_t kind, const char* name, size_t min_size,
                  const rlh_component_desc** desc_out = nullptr) const {
    require(api_ != nullptr && api_->find_component != nullptr, "host has no registry service");
    const rlh_component_desc* d = nullptr;
    check(api_->find_component(api_->ctx, kind, name, &d));
    const auto* table = static_cast<const Api*>(d->api);
    if (table == nullptr || table->struct_size < min_size)
      throw Error(RLH_E_ABI_MISMATCH, std::string("component '") + d->name +
                                          "' has an interface table older than this caller needs");
    if (desc_out != nullptr) *desc_out = d;
    return table;
  }

 private:
  static void require(bool ok, const char* what) {
    if (!ok) throw Error(RLH_E_FAILED_PRECONDITION, what);
  }
  const rlh_host_api* api_ = nullptr;
};

}  // namespace rlh::sdk
