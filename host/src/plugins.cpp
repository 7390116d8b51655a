// Plugin inspection: load a library, call its entry, validate what it says against this host's
// ABI. Every failure becomes one line naming the file and the problem; nothing here throws or
// aborts, so one bad plugin never takes the host down.
#include "plugins.hpp"

#include <boost/dll/shared_library.hpp>

#include <filesystem>
#include <sstream>

#include "host.hpp"
#include "plugin_file.hpp"
#include "rlhost/rlhost.h"
#include "rlhost/sdk/status.hpp"

namespace rlh::host {

const char* kind_name(int32_t kind) {
  switch (kind) {
    case RLH_KIND_BACKEND: return "backend";
    case RLH_KIND_MODEL: return "model";
    case RLH_KIND_GENERATOR: return "generator";
    case RLH_KIND_ALGORITHM: return "algorithm";
    case RLH_KIND_ENVIRONMENT: return "environment";
    case RLH_KIND_KERNELS: return "kernels";
    case RLH_KIND_COMM: return "comm";
    case RLH_KIND_TOKENIZER: return "tokenizer";
    case RLH_KIND_DATASET: return "dataset";
    default: return "unknown";
  }
}

int32_t kind_from_name(const std::string& name) {
  for (int32_t k = RLH_KIND_BACKEND; k <= RLH_KIND_DATASET; ++k)
    if (name == kind_name(k)) return k;
  return 0;
}

// The last slot of each table's first version: a table smaller than this cannot be used.
size_t minimum_api_size(int32_t kind) {
  switch (kind) {
    case RLH_KIND_BACKEND: return RLH_STRUCT_SIZE(rlh_backend_api, load_state);
    case RLH_KIND_MODEL: return RLH_STRUCT_SIZE(rlh_model_api, describe);
    case RLH_KIND_GENERATOR: return RLH_STRUCT_SIZE(rlh_generator_api, generate);
    case RLH_KIND_ALGORITHM: return RLH_STRUCT_SIZE(rlh_algorithm_api, run);
    case RLH_KIND_ENVIRONMENT: return RLH_STRUCT_SIZE(rlh_environment_api, score);
    case RLH_KIND_KERNELS: return RLH_STRUCT_SIZE(rlh_kernels_api, release_op);
    case RLH_KIND_COMM: return RLH_STRUCT_SIZE(rlh_comm_api, set_timeout_ms);
    case RLH_KIND_TOKENIZER: return RLH_STRUCT_SIZE(rlh_tokenizer_api, token_to_id);
    case RLH_KIND_DATASET: return RLH_STRUCT_SIZE(rlh_dataset_api, get);
    default: return 0;
  }
}

int64_t host_iface_major(int32_t kind) {
  switch (kind) {
    case RLH_KIND_BACKEND: return RLH_BACKEND_API_VERSION_MAJOR;
    case RLH_KIND_MODEL: return RLH_MODEL_API_VERSION_MAJOR;
    case RLH_KIND_GENERATOR: return RLH_GENERATOR_API_VERSION_MAJOR;
    case RLH_KIND_ALGORITHM: return RLH_ALGORITHM_API_VERSION_MAJOR;
    case RLH_KIND_ENVIRONMENT: return RLH_ENVIRONMENT_API_VERSION_MAJOR;
    case RLH_KIND_KERNELS: return RLH_KERNELS_API_VERSION_MAJOR;
    case RLH_KIND_COMM: return RLH_COMM_API_VERSION_MAJOR;
    case RLH_KIND_TOKENIZER: return RLH_TOKENIZER_API_VERSION_MAJOR;
    case RLH_KIND_DATASET: return RLH_DATASET_API_VERSION_MAJOR;
    default: return -1;
  }
}

namespace {

std::string str_or(const char* s, const char* fallback = "") { return s != nullptr ? s : fallback; }

// Boost.DLL reports dlopen failures as system_error whose text embeds dlerror(); keep the
// dlerror part, which names the missing library.
std::string load_error_text(const std::exception& e) {
  std::string w = e.what();
  const std::string marker = "dlerror system message:";
  size_t pos = w.find(marker);
  if (pos != std::string::npos) {
    std::string rest = w.substr(pos + marker.size());
    size_t b = rest.find_first_not_of(' ');
    rest = b == std::string::npos ? rest : rest.substr(b);
    while (!rest.empty() && (rest.back() == ']' || rest.back() == ' ' || rest.back() == ')')) rest.pop_back();
    return rest;
  }
  return w;
}

// Slots of an interface's first version that may be NULL (marked "(optional)" in the header).
bool optional_slot(int32_t kind, size_t offset) {
  switch (kind) {
    case RLH_KIND_TOKENIZER: return offset == offsetof(rlh_tokenizer_api, apply_chat_template);
    default: return false;
  }
}

}  // namespace

Inspection inspect_plugin(const std::string& path, Host& host) {
  Inspection r;
  auto fail = [&](rlh_code code, const std::string& msg) {
    r.plugin.reset();
    r.code = code;
    r.error = "plugin '" + path + "': " + msg;
    return std::move(r);
  };
  std::error_code fec;
  if (!std::filesystem::exists(path, fec)) return fail(RLH_E_NOT_FOUND, "no such file");
  // Before anything is mapped: a truncated library would be a SIGBUS on first touch, a FIFO a
  // hang (plugin_file.hpp).
  if (std::string bad = check_plugin_file(path); !bad.empty()) return fail(RLH_E_INVALID_ARGUMENT, bad);

  auto p = std::make_unique<Plugin>();
  p->path = path;
  try {
    p->lib.load(boost::dll::fs::path(path),
                boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local);
  } catch (const std::exception& e) {
    return fail(RLH_E_FAILED_PRECONDITION, "cannot be loaded: " + load_error_text(e));
  }
  if (!p->lib.has(RLH_PLUGIN_ENTRY_SYMBOL))
    return fail(RLH_E_FAILED_PRECONDITION, "has no entry symbol '" RLH_PLUGIN_ENTRY_SYMBOL "' (not an rlhost plugin?)");
  auto entry = p->lib.get<const rlh_plugin_desc*(uint32_t, uint32_t)>(RLH_PLUGIN_ENTRY_SYMBOL);
  const rlh_plugin_desc* d = entry(RLH_ABI_VERSION_MAJOR, RLH_ABI_VERSION_MINOR);
  if (d == nullptr) return fail(RLH_E_ABI_MISMATCH, "entry returned no descriptor for host ABI " +
                                                        std::to_string(RLH_ABI_VERSION_MAJOR) + "." +
                                                        std::to_string(RLH_ABI_VERSION_MINOR));
  // The version fields come first and are the same in every major: read them before judging
  // the rest of the layout, so another major is refused as such.
  const size_t version_size = RLH_STRUCT_SIZE(rlh_plugin_desc, abi_minor);
  if (d->struct_size < version_size)
    return fail(RLH_E_ABI_MISMATCH, "descriptor struct_size " + std::to_string(d->struct_size) +
                                        " is too small to hold its ABI version");
  if (d->abi_major != RLH_ABI_VERSION_MAJOR)
    return fail(RLH_E_ABI_MISMATCH, "was built for ABI " + std::to_string(d->abi_major) + "." +
                                        std::to_string(d->abi_minor) + ", this host implements ABI " +
                                        std::to_string(RLH_ABI_VERSION_MAJOR) + "." +
                                        std::to_string(RLH_ABI_VERSION_MINOR) + " (the majors must match)");
  const size_t min_desc = RLH_STRUCT_SIZE(rlh_plugin_desc, num_components);
  if (d->struct_size < min_desc)
    return fail(RLH_E_ABI_MISMATCH, "descriptor struct_size " + std::to_string(d->struct_size) +
                                        " is smaller than the minimum " + std::to_string(min_desc));
  if (d->name == nullptr || d->name[0] == '\0') return fail(RLH_E_INVALID_ARGUMENT, "descriptor has no name");
  if (d->num_components > 0 && d->components == nullptr)
    return fail(RLH_E_INVALID_ARGUMENT, "descriptor lists " + std::to_string(d->num_components) + " components but no array");
  if (d->num_components > 1024) return fail(RLH_E_INVALID_ARGUMENT, "descriptor lists an implausible number of components");
  p->desc = d;
  p->name = d->name;

  for (size_t i = 0; i < d->num_components; ++i) {
    const rlh_component_desc* c = d->components[i];
    const std::string where = "component #" + std::to_string(i);
    if (c == nullptr) return fail(RLH_E_INVALID_ARGUMENT, where + " is NULL");
    if (c->struct_size < RLH_STRUCT_SIZE(rlh_component_desc, api))
      return fail(RLH_E_ABI_MISMATCH, where + " has struct_size " + std::to_string(c->struct_size) +
                                          ", smaller than the minimum " +
                                          std::to_string(RLH_STRUCT_SIZE(rlh_component_desc, api)));
    if (c->name == nullptr || c->name[0] == '\0') return fail(RLH_E_INVALID_ARGUMENT, where + " has no name");
    Component comp;
    comp.desc = c;
    comp.plugin = p->name;
    const std::string cname = std::string(kind_name(c->kind)) + " '" + c->name + "'";
    int64_t want = host_iface_major(c->kind);
    if (want < 0) {
      comp.usable_error = "kind " + std::to_string(c->kind) + " is unknown to this host (newer plugin?)";
    } else if (static_cast<int64_t>(c->iface_major) != want) {
      comp.usable_error = cname + " implements interface " + std::to_string(c->iface_major) + "." +
                          std::to_string(c->iface_minor) + "; this host needs major " + std::to_string(want);
    } else if (c->api == nullptr) {
      comp.usable_error = cname + " has no interface table";
    } else {
      // Every table starts with struct_size.
      size_t table_size = *static_cast<const size_t*>(c->api);
      if (table_size < minimum_api_size(c->kind)) {
        comp.usable_error = cname + " has an interface table of " + std::to_string(table_size) +
                            " bytes, smaller than the minimum " + std::to_string(minimum_api_size(c->kind));
      } else {
        // Every slot of an interface's first version is required unless its header marks it
        // (optional); they are all pointers after struct_size.
        const auto* slots = reinterpret_cast<const void* const*>(static_cast<const char*>(c->api) + sizeof(size_t));
        const size_t n = (minimum_api_size(c->kind) - sizeof(size_t)) / sizeof(void*);
        for (size_t k = 0; k < n; ++k)
          if (slots[k] == nullptr && !optional_slot(c->kind, sizeof(size_t) + k * sizeof(void*))) {
            comp.usable_error = cname + " leaves required slot #" + std::to_string(k) + " of its interface table NULL";
            break;
          }
      }
    }
    if (RLH_HAS_FIELD(c, rlh_component_desc, config_keys) && c->config_keys != nullptr)
      for (size_t k = 0; c->config_keys[k] != nullptr && k < 4096; ++k) comp.config_keys.emplace_back(c->config_keys[k]);
    p->components.push_back(std::move(comp));
  }
  (void)host;
  r.plugin = std::move(p);
  return r;
}

nlohmann::ordered_json describe_plugin(const Plugin& p, Host& host) {
  nlohmann::ordered_json j;
  const rlh_plugin_desc* d = p.desc;
  j["name"] = p.name;
  j["version"] = str_or(d->version);
  j["vendor"] = str_or(d->vendor);
  j["license"] = str_or(d->license);
  j["description"] = str_or(d->description);
  j["path"] = p.path;
  j["abi"] = std::to_string(d->abi_major) + "." + std::to_string(d->abi_minor);
  nlohmann::ordered_json comps = nlohmann::ordered_json::array();
  for (const auto& c : p.components) {
    nlohmann::ordered_json cj;
    cj["kind"] = kind_name(c.desc->kind);
    cj["name"] = c.desc->name;
    cj["version"] = str_or(c.desc->version);
    cj["interface"] = std::to_string(c.desc->iface_major) + "." + std::to_string(c.desc->iface_minor);
    if (RLH_HAS_FIELD(c.desc, rlh_component_desc, description) && c.desc->description != nullptr)
      cj["description"] = c.desc->description;
    if (c.desc->kind == RLH_KIND_MODEL && c.usable_error.empty()) {
      const auto* m = static_cast<const rlh_model_api*>(c.desc->api);
      nlohmann::ordered_json archs = nlohmann::ordered_json::array();
      for (size_t k = 0; m->architectures != nullptr && m->architectures[k] != nullptr && k < 4096; ++k)
        archs.push_back(m->architectures[k]);
      cj["architectures"] = archs;
    }
    if (!c.usable_error.empty()) cj["error"] = c.usable_error;
    comps.push_back(cj);
  }
  j["components"] = comps;
  // Probe: can it run here?
  int32_t score = 1;
  std::string reason;
  if (RLH_HAS_FIELD(d, rlh_plugin_desc, probe) && d->probe != nullptr) {
    rlh_status* s = d->probe(host.services(), &score, sdk::write_to_string, &reason);
    if (s != nullptr) {
      reason = "probe failed: " + sdk::status_message(s);
      score = 0;
      rlh_status_destroy(s);
    }
  }
  j["can_run"] = score > 0;
  j["score"] = score;
  if (!reason.empty()) j["reason"] = reason;
  return j;
}

}  // namespace rlh::host
