// librlhost's exported C API (rlhost/host.h): thin, exception-free wrappers over Host.
#include <string>

#include "capi_internal.hpp"

using rlh::capi::call;
using rlh::host::Host;

namespace {

std::string report_json(const rlh::host::KeyCheck& kc) {
  nlohmann::json j{{"accepted", kc.accepted}, {"unused", kc.unused}, {"refused", kc.refused}};
  return j.dump();
}

rlh_status* null_host() { return rlh::sdk::make_local_status(RLH_E_INVALID_ARGUMENT, "host is NULL"); }

}  // namespace

extern "C" {

void rlhost_abi_version(uint32_t* major, uint32_t* minor) {
  if (major != nullptr) *major = RLH_ABI_VERSION_MAJOR;
  if (minor != nullptr) *minor = RLH_ABI_VERSION_MINOR;
}

rlh_status* rlhost_create(rlhost_t** out) {
  if (out == nullptr) return rlh::sdk::make_local_status(RLH_E_INVALID_ARGUMENT, "out is NULL");
  *out = nullptr;
  return call([&] { *out = new rlhost_t(); });
}

void rlhost_destroy(rlhost_t* host) { delete host; }

rlh_status* rlhost_add_plugin_dir(rlhost_t* host, const char* dir) {
  if (host == nullptr) return null_host();
  return call([&] { host->host.add_plugin_dir(dir != nullptr ? dir : ""); });
}

rlh_status* rlhost_load_plugin(rlhost_t* host, const char* name_or_path) {
  if (host == nullptr) return null_host();
  return call([&] { host->host.load_plugin(name_or_path != nullptr ? name_or_path : ""); });
}

rlh_status* rlhost_list_plugins(rlhost_t* host, rlh_write_fn write, void* user) {
  if (host == nullptr) return null_host();
  return call([&] {
    std::string text = host->host.list_plugins().dump(2);
    if (write != nullptr) write(user, text.data(), text.size());
  });
}

rlh_status* rlhost_load_config(rlhost_t* host, const char* path) {
  if (host == nullptr) return null_host();
  return call([&] { host->host.config().load_file(path != nullptr ? path : ""); });
}

rlh_status* rlhost_load_config_text(rlhost_t* host, const char* yaml, size_t len, const char* origin) {
  if (host == nullptr) return null_host();
  return call([&] {
    host->host.config().load_text(std::string(yaml != nullptr ? yaml : "", yaml != nullptr ? len : 0),
                                  origin != nullptr ? origin : "config text");
  });
}

rlh_status* rlhost_apply_override(rlhost_t* host, const char* text) {
  if (host == nullptr) return null_host();
  return call([&] { host->host.config().apply_override(text != nullptr ? text : ""); });
}

rlh_status* rlhost_resolve_config(rlhost_t* host, rlh_write_fn write, void* user) {
  if (host == nullptr) return null_host();
  return call([&] {
    auto j = host->host.resolve_config();
    if (write != nullptr) {
      std::string text = rlh::host::to_yaml(j);
      write(user, text.data(), text.size());
    }
  });
}

rlh_status* rlhost_check_config(rlhost_t* host, rlh_write_fn write, void* user) {
  if (host == nullptr) return null_host();
  return call([&] {
    try {
      host->host.check_config();
    } catch (...) {
      // Refusals are reported with the report written, so callers see all of them.
      if (write != nullptr && host->host.config_resolved()) {
        std::string text = report_json(host->host.last_check());
        write(user, text.data(), text.size());
      }
      throw;
    }
    if (write != nullptr) {
      std::string text = report_json(host->host.last_check());
      write(user, text.data(), text.size());
    }
  });
}

rlh_status* rlhost_run(rlhost_t* host) {
  if (host == nullptr) return null_host();
  return call([&] { host->host.run(); });
}

void rlhost_cancel(rlhost_t* host) {
  if (host != nullptr) host->host.cancel();
}

rlh_status* rlhost_read_metrics(rlhost_t* host, rlh_write_fn write, void* user) {
  if (host == nullptr) return null_host();
  return call([&] {
    for (const auto& m : host->host.metrics()) {
      nlohmann::json j{{"name", m.name}, {"value", m.value}, {"step", m.step}};
      std::string line = j.dump() + "\n";
      if (write != nullptr) write(user, line.data(), line.size());
    }
  });
}

rlh_status* rlhost_set_metric_callback(rlhost_t* host, rlhost_metric_fn fn, void* user) {
  if (host == nullptr) return null_host();
  return call([&] { host->host.set_metric_callback(fn, user); });
}

const rlh_host_api* rlhost_services(rlhost_t* host) { return host != nullptr ? host->host.services() : nullptr; }

void rlhost_set_log_level(rlhost_t* host, int32_t level) {
  if (host != nullptr) host->host.set_log_level(level);
}

}  // extern "C"
