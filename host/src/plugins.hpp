// Plugin loading and the component registry.
//
// Loading is two steps: inspect (dlopen with RTLD_NOW|RTLD_LOCAL through Boost.DLL, find the one
// entry symbol, call it, validate the descriptor against this host's ABI) and register (add its
// components to the registry). Listing inspects without registering. Libraries are never
// unloaded during the process: objects, statuses and callbacks of a plugin may outlive its last
// use, and dlclose of C++ code is a known source of crashes (Boost.DLL FAQ, ggml's registry).
// A plugin's init() runs on first use of one of its components; shutdown() at host destruction.
#pragma once

#include <boost/dll/shared_library.hpp>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/plugin.h"

namespace rlh::host {

class Host;

struct Component {
  const rlh_component_desc* desc = nullptr;
  std::string plugin;           // owning plugin's name
  std::string usable_error;     // non-empty: listed, but not usable (e.g. interface major)
  std::vector<std::string> config_keys;
};

struct PluginContext;  // the rlh_host_ctx a plugin receives

struct Plugin {
  std::string path;
  std::string name;
  boost::dll::shared_library lib;
  const rlh_plugin_desc* desc = nullptr;
  std::vector<Component> components;
  bool initialized = false;
  bool init_failed = false;
  std::string init_error;
  std::unique_ptr<PluginContext> context;
  std::unique_ptr<rlh_host_api> services;
};

// The result of inspecting one library file.
struct Inspection {
  std::unique_ptr<Plugin> plugin;  // set on success
  std::string error;               // one line naming the file and the problem
  rlh_code code = RLH_OK;
};

// Loads and validates one library. Never throws.
Inspection inspect_plugin(const std::string& path, Host& host);

// Minimum table sizes (the fields of interface version x.0) per component kind; 0 = unknown kind.
size_t minimum_api_size(int32_t kind);
// The interface major this host implements for a kind; -1 = unknown kind.
int64_t host_iface_major(int32_t kind);
const char* kind_name(int32_t kind);
int32_t kind_from_name(const std::string& name);  // 0 when unknown

// JSON description of a plugin (for --list-plugins), including probe results.
nlohmann::ordered_json describe_plugin(const Plugin& p, Host& host);

}  // namespace rlh::host
