// The host's side of parallel runs (world.hpp): the cluster check, the world communicator (which
// COMM component, created once, in score order with fall-through), and the start barrier.
#include "world.hpp"

#include <thread>

#include "host.hpp"
#include "rlhost/comm.h"
#include "rlhost/sdk/status.hpp"

namespace rlh::host {
namespace {

using sdk::Error;

// An integer config value at `path` (absent: returns false).
bool read_count(const Json& cfg, const char* section, const char* key, int64_t min, int64_t& out,
                const std::function<std::string(const std::string&)>& origin_of) {
  if (!cfg.is_object() || !cfg.contains(section) || !cfg[section].is_object() || !cfg[section].contains(key)) return false;
  const Json& v = cfg[section][key];
  const std::string path = std::string(section) + "." + key;
  if (v.is_null()) return false;
  if (!v.is_number_integer() || v.get<int64_t>() < min)
    throw Error(RLH_E_INVALID_ARGUMENT, "config key '" + path + "' must be an integer >= " + std::to_string(min) + ", got " +
                                            v.dump() + " (from " + origin_of(path) + ")");
  out = v.get<int64_t>();
  return true;
}

}  // namespace

void check_cluster(const Json& cfg, const sdk::LaunchEnv& launch, const std::function<std::string(const std::string&)>& origin_of) {
  int64_t nodes = 1, gpus = 0;
  const bool has_nodes = read_count(cfg, "cluster", "num_nodes", 1, nodes, origin_of);
  const bool has_gpus = read_count(cfg, "cluster", "gpus_per_node", 0, gpus, origin_of);
  const std::string ranks = std::to_string(launch.size) + (launch.size == 1 ? " rank" : " ranks");
  if (has_gpus && gpus > 0) {
    // One rank per GPU slot, as NeMo-RL runs one worker per GPU.
    if (nodes * gpus != launch.size)
      throw Error(RLH_E_INVALID_ARGUMENT, "cluster.num_nodes x cluster.gpus_per_node = " + std::to_string(nodes) + " x " +
                                              std::to_string(gpus) + " = " + std::to_string(nodes * gpus) + " (from " +
                                              origin_of("cluster") + "), but " + launch.describe() + " started " + ranks +
                                              " (rlhost runs one rank per GPU: launch that many, or set the cluster keys)");
    if (launch.local_size > 0 && launch.local_size != gpus)
      throw Error(RLH_E_INVALID_ARGUMENT, "cluster.gpus_per_node = " + std::to_string(gpus) + " (from " +
                                              origin_of("cluster.gpus_per_node") + "), but " + launch.describe() + " started " +
                                              std::to_string(launch.local_size) + " ranks on this node");
  }
  if (has_nodes && launch.num_nodes > 0 && nodes != launch.num_nodes)
    throw Error(RLH_E_INVALID_ARGUMENT, "cluster.num_nodes = " + std::to_string(nodes) + " (from " + origin_of("cluster.num_nodes") +
                                            "), but " + launch.describe() + " spans " + std::to_string(launch.num_nodes) +
                                            (launch.num_nodes == 1 ? " node" : " nodes"));
}

int64_t comm_timeout_ms(const Json& cfg) {
  if (!cfg.is_object() || !cfg.contains("rlhost") || !cfg["rlhost"].is_object() || !cfg["rlhost"].contains("comm_timeout_s"))
    return 0;
  const Json& v = cfg["rlhost"]["comm_timeout_s"];
  if (!v.is_number() || !(v.get<double>() > 0) || v.get<double>() > 1e7)
    throw Error(RLH_E_INVALID_ARGUMENT, "config key 'rlhost.comm_timeout_s' must be a positive number of seconds, got " + v.dump());
  return static_cast<int64_t>(v.get<double>() * 1000.0);
}

// ---------------------------------------------------------------------------------------------

void Host::check_world(const Json& cfg) const {
  if (!launch_error_.empty()) throw Error(RLH_E_INVALID_ARGUMENT, launch_error_);
  check_cluster(cfg, launch_, [this](const std::string& k) { return config_.origin_of(k); });
  comm_timeout_ms(cfg);  // a bad value is reported here, before any plugin reads it
}

void Host::start_world(const Json& cfg) {
  for (const auto& note : launch_.notes) log(RLH_LOG_WARN, "host", note);
  check_world(cfg);
  if (launch_.size <= 1) return;  // alone: the world is created when a plugin asks for it
  const rlh_comm_api* api = nullptr;
  rlh_comm* world = nullptr;
  world_comm(&api, &world);
  if (api->size(world) != launch_.size || api->rank(world) != launch_.rank)
    throw Error(RLH_E_FAILED_PRECONDITION, "communicator '" + comm_name_ + "' says this is rank " + std::to_string(api->rank(world)) +
                                               " of " + std::to_string(api->size(world)) + ", but " + launch_.describe() +
                                               " started it as rank " + std::to_string(launch_.rank) + " of " +
                                               std::to_string(launch_.size));
  // Every rank meets once before any work: a rank that did not start, or stopped early, fails
  // the others here within the communicator's timeout, naming it.
  sdk::check(api->barrier(world), "checking that every rank of the world started");
  if (launch_.rank == 0)
    log(RLH_LOG_INFO, "host", "world: " + std::to_string(launch_.size) + " ranks started by " + launch_.describe() +
                                  ", communicator '" + comm_name_ + "'");
}

void Host::world_comm(const rlh_comm_api** api, rlh_comm** comm) {
  // A COMM component that asks the host for the world while creating it (to bootstrap over
  // it) would wait on itself: refuse instead.
  if (creating_world_.load() == std::this_thread::get_id())
    throw Error(RLH_E_FAILED_PRECONDITION, "communicator '" + comm_name_ +
                                               "' asked the host for the world communicator while creating it; choose another "
                                               "rlhost.comm");
  std::lock_guard<std::mutex> lock(comm_mu_);
  if (world_ == nullptr) {
    creating_world_.store(std::this_thread::get_id());
    struct Clear {
      std::atomic<std::thread::id>& id;
      ~Clear() { id.store(std::thread::id()); }
    } clear{creating_world_};
    std::string name;
    Json cfg = resolved_;
    if (!resolved_valid_) {
      try {
        cfg = config_.resolved();
      } catch (const ConfigError&) {
        cfg = Json::object();
      }
    }
    if (cfg.is_object() && cfg.contains("rlhost") && cfg["rlhost"].is_object() && cfg["rlhost"].contains("comm")) {
      if (!cfg["rlhost"]["comm"].is_string()) throw Error(RLH_E_INVALID_ARGUMENT, "config key 'rlhost.comm' must name a communicator");
      name = cfg["rlhost"]["comm"].get<std::string>();
    }
    // Communicator plugins on the plugin path take part without --plugin, as kernel providers do.
    if (components(RLH_KIND_COMM).empty()) autoload_components(RLH_KIND_COMM);
    std::vector<const Component*> candidates;
    if (!name.empty()) {
      candidates.push_back(&find_component(RLH_KIND_COMM, name));
    } else {
      for (const auto& [c, score] : ranked_components(RLH_KIND_COMM)) candidates.push_back(c);
    }
    if (candidates.empty()) {
      std::string why;
      for (const Component* c : components(RLH_KIND_COMM)) {
        const std::string reason = probe_reason(c->plugin);
        why += (why.empty() ? "" : "; ") + std::string(c->desc->name) + ": " + (reason.empty() ? "cannot run here" : reason);
      }
      throw Error(RLH_E_NOT_FOUND, "no communicator can run here" +
                                       (why.empty() ? std::string(" (none is loaded; comm_mpi and comm_nccl are the in-tree ones)")
                                                    : " (" + why + ")"));
    }
    // In score order; one that answers UNAVAILABLE (no MPI runtime, no GPU) makes way for the
    // next, unless it was named. Every rank sees the same launch, so every rank chooses alike.
    std::string refusals;
    for (const Component* c : candidates) {
      const Component& comp = find_component(RLH_KIND_COMM, c->desc->name);  // initialises its plugin
      const auto* capi = static_cast<const rlh_comm_api*>(comp.desc->api);
      Plugin* owner = nullptr;
      for (auto& p : plugins_)
        if (p->name == comp.plugin) owner = p.get();
      comm_name_ = comp.desc->name;
      rlh_status* s = capi->create_world(owner->services.get(), "{}", 2, &world_);
      if (s == nullptr) {
        comm_api_ = capi;
        break;
      }
      world_ = nullptr;
      const rlh_code code = s->code;
      if (!name.empty() || (code != RLH_E_UNAVAILABLE && code != RLH_E_UNIMPLEMENTED))
        sdk::check(s, "communicator '" + comm_name_ + "'");
      refusals += (refusals.empty() ? "" : "; ") + comm_name_ + ": " + sdk::status_message(s);
      rlh_status_destroy(s);
    }
    if (world_ == nullptr) throw Error(RLH_E_UNAVAILABLE, "no communicator could create the world (" + refusals + ")");
    log(RLH_LOG_DEBUG, "host", "world communicator: " + comm_name_);
  }
  *api = comm_api_;
  *comm = world_;
}

std::string Host::probe_reason(const std::string& plugin_name) const {
  for (const auto& p : plugins_) {
    if (p->name != plugin_name) continue;
    if (!RLH_HAS_FIELD(p->desc, rlh_plugin_desc, probe) || p->desc->probe == nullptr) return "";
    std::string reason;
    int32_t score = 0;
    rlh_status* s = p->desc->probe(p->services.get(), &score, sdk::write_to_string, &reason);
    if (s != nullptr) {
      reason = sdk::status_message(s);
      rlh_status_destroy(s);
    }
    return reason;
  }
  return "";
}

}  // namespace rlh::host
