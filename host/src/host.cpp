// The host: plugin path and loading, the registry, the services table plugins receive, and the
// job runner.
#include "host.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <optional>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <set>

#include "config_keys.hpp"
#include "rlhost/rlhost.h"
#include "rlhost/sdk/status.hpp"

namespace fs = std::filesystem;

namespace rlh::host {
namespace {

using sdk::Error;

Host& host_of(rlh_host_ctx* ctx) { return *reinterpret_cast<PluginContext*>(ctx)->host; }
PluginContext& context_of(rlh_host_ctx* ctx) { return *reinterpret_cast<PluginContext*>(ctx); }

// ------------------------------------------------------------------------------------------
// Services: each is a C function that never lets an exception out.

rlh_status* host_make_status(rlh_code code, const char* msg, size_t len) {
  if (code == RLH_OK) return nullptr;
  // Allocated by librlhost, freed by librlhost (destroy slot), whoever holds it.
  struct Owned : rlh_status { std::string text; };
  auto* s = new (std::nothrow) Owned();
  if (s == nullptr) return nullptr;
  s->text.assign(msg != nullptr ? msg : "", msg != nullptr ? len : 0);
  s->struct_size = RLH_STRUCT_SIZE(rlh_status, destroy);
  s->code = code;
  s->reserved0 = 0;
  s->message = s->text.c_str();
  s->message_len = s->text.size();
  s->destroy = [](rlh_status* self) { delete static_cast<Owned*>(self); };
  return s;
}

void host_log(rlh_host_ctx* ctx, int32_t level, const char* msg, size_t len) {
  try {
    PluginContext& c = context_of(ctx);
    c.host->log(level, c.plugin, std::string(msg != nullptr ? msg : "", msg != nullptr ? len : 0));
  } catch (...) {
  }
}

rlh_status* host_alloc(rlh_host_ctx* ctx, rlh_device device, size_t bytes, size_t alignment, void** out) {
  if (out == nullptr) return host_make_status(RLH_E_INVALID_ARGUMENT, "alloc: out is NULL", 18);
  *out = nullptr;
  if (device.device_type != RLH_DEVICE_CPU) {
    std::string m = "alloc: device type " + std::to_string(device.device_type) +
                    " has no allocator in this host (CPU only; device memory is the backend's)";
    return host_make_status(RLH_E_UNIMPLEMENTED, m.data(), m.size());
  }
  if (alignment == 0) alignment = 64;
  if ((alignment & (alignment - 1)) != 0) return host_make_status(RLH_E_INVALID_ARGUMENT, "alloc: alignment is not a power of two", 39);
  alignment = std::max<size_t>(alignment, sizeof(void*));
  // Two size_t in front of the block record its size and the header length, so free can count
  // bytes and find the start; the header is a multiple of the alignment.
  const size_t header = std::max<size_t>(alignment, 2 * sizeof(size_t));
  void* raw = nullptr;
  if (posix_memalign(&raw, alignment, header + std::max<size_t>(bytes, 1)) != 0 || raw == nullptr) {
    std::string m = "alloc: out of memory allocating " + std::to_string(bytes) + " bytes";
    return host_make_status(RLH_E_RESOURCE_EXHAUSTED, m.data(), m.size());
  }
  char* block = static_cast<char*>(raw) + header;
  reinterpret_cast<size_t*>(block)[-2] = bytes;
  reinterpret_cast<size_t*>(block)[-1] = header;
  Host& h = host_of(ctx);
  h.cpu_allocations++;
  h.cpu_bytes_live += static_cast<int64_t>(bytes);
  *out = block;
  return nullptr;
}

void host_free(rlh_host_ctx* ctx, rlh_device device, void* ptr) {
  if (ptr == nullptr || device.device_type != RLH_DEVICE_CPU) return;
  char* block = static_cast<char*>(ptr);
  const size_t bytes = reinterpret_cast<size_t*>(block)[-2];
  const size_t header = reinterpret_cast<size_t*>(block)[-1];
  host_of(ctx).cpu_bytes_live -= static_cast<int64_t>(bytes);
  std::free(block - header);
}

rlh_status* host_config_get(rlh_host_ctx* ctx, const char* path, rlh_write_fn write, void* user) {
  return sdk::guard(host_make_status, [&] {
    Host& h = host_of(ctx);
    if (write == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "config_get: write is NULL");
    // Before the host has checked the configuration (a plugin's init, an embedder driving
    // components directly) plugins see it with interpolations resolved but keys unchecked.
    Json unchecked;
    if (!h.config_resolved()) {
      try {
        unchecked = h.config().resolved();
      } catch (const ConfigError& e) {
        throw Error(RLH_E_INVALID_ARGUMENT, e.what());
      }
    }
    const Json* node = h.config_resolved() ? &h.resolved_config() : &unchecked;
    std::string p = path != nullptr ? path : "";
    if (!p.empty()) {
      for (const auto& part : split_path(p)) {
        if (!node->is_object() || !node->contains(part))
          throw Error(RLH_E_NOT_FOUND, "config key '" + p + "' is not set");
        node = &(*node)[part];
      }
    }
    std::string text = node->dump();
    write(user, text.data(), text.size());
  });
}

void host_metric(rlh_host_ctx* ctx, const char* name, double value, int64_t step) {
  try {
    if (name != nullptr) host_of(ctx).record_metric(name, value, step);
  } catch (...) {
  }
}

rlh_status* host_find_component(rlh_host_ctx* ctx, int32_t kind, const char* name, const rlh_component_desc** out) {
  return sdk::guard(host_make_status, [&] {
    if (out == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "find_component: out is NULL");
    *out = host_of(ctx).find_component(kind, name != nullptr ? name : "").desc;
  });
}

rlh_status* host_get_comm(rlh_host_ctx* ctx, const rlh_comm_api** api, rlh_comm** comm) {
  return sdk::guard(host_make_status, [&] {
    if (api == nullptr || comm == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "get_comm: NULL out pointer");
    host_of(ctx).world_comm(api, comm);
  });
}

uint8_t host_is_cancelled(rlh_host_ctx* ctx) { return host_of(ctx).cancelled() ? 1 : 0; }

rlh_status* host_list_components(rlh_host_ctx* ctx, int32_t kind, rlh_write_fn write, void* user) {
  return sdk::guard(host_make_status, [&] {
    if (write == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "list_components: write is NULL");
    if (kind == RLH_KIND_KERNELS) host_of(ctx).autoload_kernel_providers();
    nlohmann::json out = nlohmann::json::array();
    for (const auto& [c, score] : host_of(ctx).ranked_components(kind))
      out.push_back({{"name", c->desc->name}, {"plugin", c->plugin}, {"score", score}});
    const std::string text = out.dump();
    write(user, text.data(), text.size());
  });
}

const char* level_name(int32_t level) {
  switch (level) {
    case RLH_LOG_TRACE: return "trace";
    case RLH_LOG_DEBUG: return "debug";
    case RLH_LOG_INFO: return "info";
    case RLH_LOG_WARN: return "warning";
    case RLH_LOG_ERROR: return "error";
    default: return "log";
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------

Host::Host() {
  try {
    launch_ = sdk::detect_launch();
  } catch (const Error& e) {
    launch_error_ = e.what();
  }
  if (const char* env = std::getenv("RLHOST_PLUGIN_PATH")) {
    std::string s = env, cur;
    for (char c : s + ":") {
      if (c == ':') { if (!cur.empty()) plugin_dirs_.push_back(cur); cur.clear(); } else cur += c;
    }
  }
  // The install's plugin folder: <libdir>/rlhost/plugins next to librlhost.
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&host_make_status), &info) != 0 && info.dli_fname != nullptr) {
    fs::path lib = fs::path(info.dli_fname).parent_path();
    plugin_dirs_.push_back((lib / "rlhost" / "plugins").string());
    plugin_dirs_.push_back((lib / "plugins").string());  // build tree: build/plugins
  }
#ifdef RLH_BUILD_PLUGIN_DIR
  plugin_dirs_.push_back(RLH_BUILD_PLUGIN_DIR);
#endif
  root_context_.host = this;
  root_context_.plugin = "host";
  root_services_ = rlh_host_api{};
  root_services_.struct_size = RLH_STRUCT_SIZE(rlh_host_api, list_components);
  root_services_.abi_major = RLH_ABI_VERSION_MAJOR;
  root_services_.abi_minor = RLH_ABI_VERSION_MINOR;
  root_services_.ctx = reinterpret_cast<rlh_host_ctx*>(&root_context_);
  root_services_.log = host_log;
  root_services_.make_status = host_make_status;
  root_services_.alloc = host_alloc;
  root_services_.free_memory = host_free;
  root_services_.config_get = host_config_get;
  root_services_.metric = host_metric;
  root_services_.find_component = host_find_component;
  root_services_.get_comm = host_get_comm;
  root_services_.is_cancelled = host_is_cancelled;
  root_services_.list_components = host_list_components;
}

Host::~Host() {
  if (world_ != nullptr && comm_api_ != nullptr) comm_api_->destroy(world_);
  // Shut plugins down in reverse load order; libraries stay mapped (see plugins.hpp).
  for (auto it = plugins_.rbegin(); it != plugins_.rend(); ++it) {
    Plugin& p = **it;
    if (p.initialized && RLH_HAS_FIELD(p.desc, rlh_plugin_desc, shutdown) && p.desc->shutdown != nullptr) {
      try { p.desc->shutdown(); } catch (...) {}
    }
  }
  // Keep the libraries loaded until process exit: move them somewhere that is never freed.
  static auto* keep = new std::vector<boost::dll::shared_library>();
  for (auto& p : plugins_) keep->push_back(p->lib);
}

rlh_host_api* Host::make_services(const std::string& plugin_name, std::unique_ptr<PluginContext>& ctx_out) {
  ctx_out = std::make_unique<PluginContext>();
  ctx_out->host = this;
  ctx_out->plugin = plugin_name;
  auto* api = new rlh_host_api(root_services_);
  api->ctx = reinterpret_cast<rlh_host_ctx*>(ctx_out.get());
  return api;
}

void Host::log(int32_t level, const std::string& who, const std::string& msg) const {
  if (level < log_level_) return;
  std::string line = "[rlhost";
  if (launch_.size > 1) line += " rank " + std::to_string(launch_.rank);
  line += "] ";
  if (!who.empty() && who != "host") line += who + ": ";
  line += std::string(level_name(level)) + ": " + msg + "\n";
  // One write per line: the ranks of a job share the terminal.
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

void Host::record_metric(const std::string& name, double value, int64_t step) {
  std::lock_guard<std::mutex> lock(metrics_mu_);
  // "rlhost/..." names are control values for the loggers, not metrics (see plugin.h).
  if (name == "rlhost/step_finished") {
    if (logger_) logger_->step_finished(step);
    return;
  }
  if (name == "rlhost/total_steps") {
    total_steps_ = static_cast<int64_t>(value);
    return;
  }
  metrics_.push_back(Metric{name, value, step});
  if (!logger_ && logger_cfg_) {
    logger_cfg_->total_steps = total_steps_;
    logger_ = std::make_unique<sdk::MetricsLogger>(*logger_cfg_);
  }
  if (logger_) logger_->log(name, value, step);
  // The embedder's callback, under the lock (documented: it may only call rlhost_cancel).
  if (metric_fn_ != nullptr) metric_fn_(metric_user_, name.c_str(), value, step);
}

std::vector<Metric> Host::metrics() const {
  std::lock_guard<std::mutex> lock(metrics_mu_);
  return metrics_;
}

void Host::add_plugin_dir(const std::string& dir) { plugin_dirs_.push_back(dir); }

std::string Host::find_on_path(const std::string& name) const {
  for (const auto& dir : plugin_dirs_) {
    for (const std::string& file : {"lib" + name + ".so", name + ".so"}) {
      std::error_code ec;
      fs::path p = fs::path(dir) / file;
      if (fs::is_regular_file(p, ec)) return p.string();
    }
  }
  return {};
}

void Host::load_plugin(const std::string& name_or_path) {
  if (name_or_path.empty()) throw Error(RLH_E_INVALID_ARGUMENT, "--plugin needs a name or a path");
  std::string path;
  if (name_or_path.find('/') != std::string::npos || name_or_path.ends_with(".so")) {
    path = name_or_path;
  } else {
    path = find_on_path(name_or_path);
    if (path.empty()) {
      std::string dirs;
      for (const auto& d : plugin_dirs_) dirs += (dirs.empty() ? "" : ", ") + d;
      throw Error(RLH_E_NOT_FOUND, "plugin '" + name_or_path + "' not found on the plugin path (" + dirs +
                                       "; set RLHOST_PLUGIN_PATH or pass a path)");
    }
  }
  std::error_code ec;
  std::string canon = fs::weakly_canonical(path, ec).string();
  if (ec) canon = path;
  for (const auto& p : plugins_)
    if (p->path == canon) return;  // already loaded

  Inspection ins = inspect_plugin(canon, *this);
  if (!ins.plugin) {
    failed_[canon] = ins.error;
    throw Error(ins.code, ins.error);
  }
  Plugin& np = *ins.plugin;
  for (const auto& p : plugins_)
    if (p->name == np.name)
      throw Error(RLH_E_ALREADY_EXISTS, "plugin '" + canon + "': a plugin named '" + np.name + "' is already loaded from " + p->path);
  for (const auto& c : np.components) {
    for (const auto& p : plugins_)
      for (const auto& oc : p->components)
        if (oc.desc->kind == c.desc->kind && std::strcmp(oc.desc->name, c.desc->name) == 0)
          throw Error(RLH_E_ALREADY_EXISTS, "plugin '" + canon + "': " + kind_name(c.desc->kind) + " '" + c.desc->name +
                                                "' is already provided by plugin '" + p->name + "'");
  }
  for (const auto& c : np.components)
    if (!c.usable_error.empty()) log(RLH_LOG_WARN, np.name, "component not usable: " + c.usable_error);
  np.services.reset(make_services(np.name, np.context));
  plugins_.push_back(std::move(ins.plugin));
}

// Kernel providers dropped on the plugin path take part without --plugin: the first time a
// registry lists them, every library there whose components are all KERNELS is registered
// (others are inspected and left alone). rlhost.autoload_kernels = false turns this off.
void Host::autoload_kernel_providers() {
  if (resolved_valid_ && resolved_.is_object() && resolved_.contains("rlhost") && resolved_["rlhost"].is_object()) {
    const Json& r = resolved_["rlhost"];
    if (r.contains("autoload_kernels") && r["autoload_kernels"].is_boolean() && !r["autoload_kernels"].get<bool>())
      return;
  }
  autoload_components(RLH_KIND_KERNELS);
}

void Host::autoload_components(int32_t kind) {
  if (std::find(autoloaded_kinds_.begin(), autoloaded_kinds_.end(), kind) != autoloaded_kinds_.end()) return;
  autoloaded_kinds_.push_back(kind);
  std::set<std::string> seen;
  for (const auto& p : plugins_) seen.insert(p->path);
  for (const auto& [path, err] : failed_) seen.insert(path);
  std::string added;
  for (const auto& dir : plugin_dirs_) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) continue;
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(dir, ec))
      if (e.path().extension() == ".so") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      const std::string canon = fs::weakly_canonical(f, ec).string();
      if (!seen.insert(canon).second) continue;
      Inspection ins = inspect_plugin(canon, *this);
      if (!ins.plugin) continue;  // --list-plugins shows why
      bool only_kind = !ins.plugin->components.empty();
      for (const auto& c : ins.plugin->components) only_kind = only_kind && c.desc->kind == kind;
      bool clash = false;
      for (const auto& p : plugins_) {
        clash = clash || p->name == ins.plugin->name;
        for (const auto& oc : p->components)
          for (const auto& c : ins.plugin->components)
            clash = clash || (oc.desc->kind == c.desc->kind && std::strcmp(oc.desc->name, c.desc->name) == 0);
      }
      if (!only_kind || clash) {
        static auto* keep = new std::vector<std::unique_ptr<Plugin>>();  // descriptor strings stay valid
        keep->push_back(std::move(ins.plugin));
        continue;
      }
      ins.plugin->services.reset(make_services(ins.plugin->name, ins.plugin->context));
      added += (added.empty() ? "" : ", ") + ins.plugin->name;
      plugins_.push_back(std::move(ins.plugin));
    }
  }
  if (!added.empty()) log(RLH_LOG_DEBUG, "host", std::string(kind_name(kind)) + " plugins from the plugin path: " + added);
}

nlohmann::ordered_json Host::list_plugins() {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  std::set<std::string> seen;
  for (const auto& p : plugins_) {
    auto j = describe_plugin(*p, *this);
    j["loaded"] = true;
    out.push_back(j);
    seen.insert(p->path);
  }
  for (const auto& [path, err] : failed_) {
    if (!seen.insert(path).second) continue;
    out.push_back({{"path", path}, {"loaded", false}, {"can_run", false}, {"error", err}});
  }
  for (const auto& dir : plugin_dirs_) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) continue;
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(dir, ec))
      if (e.path().extension() == ".so") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      std::string canon = fs::weakly_canonical(f, ec).string();
      if (!seen.insert(canon).second) continue;
      Inspection ins = inspect_plugin(canon, *this);
      if (!ins.plugin) {
        out.push_back({{"path", canon}, {"loaded", false}, {"can_run", false}, {"error", ins.error}});
        continue;
      }
      ins.plugin->services.reset(make_services(ins.plugin->name, ins.plugin->context));
      auto j = describe_plugin(*ins.plugin, *this);
      j["loaded"] = false;
      out.push_back(j);
      // Keep the library mapped: descriptor strings were read from it (never unloaded).
      static auto* keep = new std::vector<std::unique_ptr<Plugin>>();
      keep->push_back(std::move(ins.plugin));
    }
  }
  return out;
}

void Host::ensure_initialized(Plugin& p) {
  if (p.initialized) return;
  if (p.init_failed) throw Error(RLH_E_FAILED_PRECONDITION, "plugin '" + p.name + "' failed to initialise: " + p.init_error);
  if (RLH_HAS_FIELD(p.desc, rlh_plugin_desc, init) && p.desc->init != nullptr) {
    rlh_status* s = p.desc->init(p.services.get());
    if (s != nullptr) {
      p.init_failed = true;
      p.init_error = sdk::status_message(s);
      rlh_code code = s->code;
      rlh_status_destroy(s);
      throw Error(code, "plugin '" + p.name + "' failed to initialise: " + p.init_error);
    }
  }
  p.initialized = true;
}

int32_t Host::probe_score(const Plugin& p) const {
  int32_t score = 1;
  if (RLH_HAS_FIELD(p.desc, rlh_plugin_desc, probe) && p.desc->probe != nullptr) {
    std::string reason;
    rlh_status* s = p.desc->probe(p.services.get(), &score, sdk::write_to_string, &reason);
    if (s != nullptr) { score = 0; rlh_status_destroy(s); }
  }
  return score;
}

std::vector<std::pair<const Component*, int32_t>> Host::ranked_components(int32_t kind) const {
  std::vector<std::pair<const Component*, int32_t>> out;
  for (const auto& p : plugins_) {
    bool any = false;
    for (const auto& c : p->components) any = any || (c.desc->kind == kind && c.usable_error.empty());
    if (!any) continue;
    const int32_t score = probe_score(*p);
    if (score <= 0) continue;
    for (const auto& c : p->components)
      if (c.desc->kind == kind && c.usable_error.empty()) out.emplace_back(&c, score);
  }
  std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  return out;
}

std::vector<const Component*> Host::components(int32_t kind) const {
  std::vector<const Component*> out;
  for (const auto& p : plugins_)
    for (const auto& c : p->components)
      if (c.desc->kind == kind && c.usable_error.empty()) out.push_back(&c);
  return out;
}

const Component& Host::find_component(int32_t kind, const std::string& name) {
  Plugin* best_plugin = nullptr;
  const Component* best = nullptr;
  int32_t best_score = -1;
  std::string available;
  for (auto& p : plugins_) {
    for (const auto& c : p->components) {
      if (c.desc->kind != kind) continue;
      available += (available.empty() ? "" : ", ") + std::string(c.desc->name);
      if (!name.empty() && name != c.desc->name) continue;
      if (!c.usable_error.empty()) {
        if (!name.empty()) throw Error(RLH_E_FAILED_PRECONDITION, c.usable_error);
        continue;
      }
      const int32_t score = name.empty() ? probe_score(*p) : 1;
      if (score > best_score) { best_score = score; best = &c; best_plugin = p.get(); }
    }
  }
  if (best == nullptr) {
    std::string what = std::string(kind_name(kind)) + (name.empty() ? "" : " '" + name + "'");
    throw Error(RLH_E_NOT_FOUND, "no " + what + " component is loaded" +
                                     (available.empty() ? std::string(" (load a plugin that provides one with --plugin)")
                                                        : " (loaded: " + available + ")"));
  }
  ensure_initialized(*best_plugin);
  return *best;
}

namespace {

// The first NaN or infinity in the tree, as "key: .nan". Plugins receive the config as JSON,
// which has neither (nlohmann writes null), so such a value would silently become null.
std::optional<std::pair<std::string, std::string>> non_finite(const Json& j, const std::string& path) {
  if (j.is_number_float() && !std::isfinite(j.get<double>())) {
    const double d = j.get<double>();
    return std::make_pair(path, std::string(std::isnan(d) ? ".nan" : d > 0 ? ".inf" : "-.inf"));
  }
  if (j.is_object())
    for (auto it = j.begin(); it != j.end(); ++it)
      if (auto r = non_finite(it.value(), path.empty() ? it.key() : path + "." + it.key())) return r;
  if (j.is_array())
    for (size_t i = 0; i < j.size(); ++i)
      if (auto r = non_finite(j[i], path + "." + std::to_string(i))) return r;
  return std::nullopt;
}

}  // namespace

Json Host::resolve_config() {
  Json r = config_.resolved();
  if (auto bad = non_finite(r, ""))
    throw Error(RLH_E_INVALID_ARGUMENT, "config key '" + bad->first + "' (from " + config_.origin_of(bad->first) + "): " +
                                            bad->second + " is not a finite number (the configuration reaches plugins "
                                            "as JSON, which has no NaN or infinity)");
  // The host's own keys: the loggers it runs (the rest of `logger` stays NeMo-RL's).
  std::vector<std::string> owned = {"logger.log_dir", "logger.console_enabled", "logger.jsonl_enabled",
                                    "logger.tensorboard_enabled", "logger.console_metrics", "logger.tensorboard.*"};
  std::vector<std::string> names = {"host"};
  for (const auto& p : plugins_) {
    names.push_back(p->name);
    for (const auto& c : p->components) owned.insert(owned.end(), c.config_keys.begin(), c.config_keys.end());
  }
  KeyCheck kc = check_keys(r, owned, names, [this](const std::string& k) { return config_.origin_of(k); });
  if (!kc.accepted.empty() || !kc.unused.empty()) {
    // One warning for all of them (real NeMo-RL configs carry many settings for vLLM, Ray,
    // Megatron-Core); the full list at debug level.
    std::string msg;
    if (!kc.accepted.empty())
      msg = std::to_string(kc.accepted.size()) +
            " NeMo-RL setting(s) that rlhost does not implement are accepted: their values leave what it "
            "computes unchanged";
    if (!kc.unused.empty())
      msg += std::string(msg.empty() ? "" : "; ") + std::to_string(kc.unused.size()) +
             " NeMo-RL section(s) are read by plugins that are not loaded";
    log(RLH_LOG_WARN, "host", msg + " (--log-level debug lists them)");
    std::string list;
    for (const auto& a : kc.accepted) list += (list.empty() ? "" : ", ") + a;
    if (!list.empty()) log(RLH_LOG_DEBUG, "host", "accepted without effect: " + list);
    list.clear();
    for (const auto& u : kc.unused) list += (list.empty() ? "" : ", ") + u;
    if (!list.empty()) log(RLH_LOG_DEBUG, "host", "not read by a loaded plugin: " + list);
  }
  if (!kc.errors.empty()) {
    for (size_t i = 1; i < kc.errors.size(); ++i) log(RLH_LOG_ERROR, "host", kc.errors[i]);
    if (kc.unreported > 0)
      log(RLH_LOG_ERROR, "host", "... and " + std::to_string(kc.unreported) + " more unknown config keys");
    throw Error(RLH_E_INVALID_ARGUMENT, kc.errors.front());
  }
  // Settings asking for what rlhost lacks stop a run at start (run(), check_config()); resolving
  // alone (--print-config) only says so.
  for (const auto& m : kc.refused) log(RLH_LOG_WARN, "host", "a run refuses this: " + m);
  last_check_ = kc;
  resolved_ = r;
  resolved_valid_ = true;
  return r;
}

KeyCheck Host::check_config() {
  resolve_config();
  if (!last_check_.refused.empty()) {
    for (size_t i = 1; i < last_check_.refused.size(); ++i) log(RLH_LOG_ERROR, "host", last_check_.refused[i]);
    throw Error(RLH_E_UNIMPLEMENTED, last_check_.refused.front());
  }
  check_world(resolved_);  // cluster.num_nodes / gpus_per_node against the launcher
  return last_check_;
}

void Host::run() {
  check_config();
  Json cfg = resolved_;
  start_world(cfg);
  std::string algo_name;
  if (cfg.contains("rlhost") && cfg["rlhost"].is_object() && cfg["rlhost"].contains("algorithm")) {
    if (!cfg["rlhost"]["algorithm"].is_string()) throw Error(RLH_E_INVALID_ARGUMENT, "config key 'rlhost.algorithm' must be a string");
    algo_name = cfg["rlhost"]["algorithm"].get<std::string>();
  } else {
    auto algos = components(RLH_KIND_ALGORITHM);
    if (algos.size() > 1) {
      std::string names;
      for (auto* a : algos) names += (names.empty() ? "" : ", ") + std::string(a->desc->name);
      throw Error(RLH_E_INVALID_ARGUMENT, "several algorithms are loaded (" + names + "); choose one with rlhost.algorithm=NAME");
    }
  }
  const Component& c = find_component(RLH_KIND_ALGORITHM, algo_name);
  const auto* api = static_cast<const rlh_algorithm_api*>(c.desc->api);
  Plugin* owner = nullptr;
  for (auto& p : plugins_) if (p->name == c.plugin) owner = p.get();
  // Loggers (NeMo-RL's `logger` section): console progress, JSONL, TensorBoard.
  {
    sdk::MetricsConfig mc = sdk::MetricsConfig::from_logger_json(
        cfg.contains("logger") && cfg["logger"].is_object() ? nlohmann::json::parse(cfg["logger"].dump())
                                                            : nlohmann::json::object());
    // Rank 0 writes the job's metrics (every rank keeps them in memory: rlhost_read_metrics).
    if (launch_.rank != 0) mc.console = mc.jsonl = mc.tensorboard = false;
    std::lock_guard<std::mutex> lock(metrics_mu_);
    logger_cfg_ = mc;
    logger_.reset();
    total_steps_ = 0;
  }
  std::string text = cfg.dump();
  rlh_algorithm* algo = nullptr;
  sdk::check(api->create(owner->services.get(), text.data(), text.size(), &algo), std::string("algorithm '") + c.desc->name + "'");
  rlh_status* s = api->run(algo);
  api->destroy(algo);
  {
    std::lock_guard<std::mutex> lock(metrics_mu_);
    if (logger_) logger_->flush();
    logger_.reset();
    logger_cfg_.reset();
  }
  sdk::check(s, std::string("algorithm '") + c.desc->name + "'");
}

}  // namespace rlh::host
