// The host's kernel providers as one executor's registry (kernel_registry.hpp).
#include "rlhost/sdk/kernel_registry.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace rlh::sdk {

KernelPins kernel_pins_from_json(const std::string& section_json) {
  KernelPins pins;
  nlohmann::json j = nlohmann::json::parse(section_json, nullptr, false);
  if (j.is_discarded() || j.is_null()) return pins;
  if (!j.is_object()) throw Error(RLH_E_INVALID_ARGUMENT, "policy.kernels must be a mapping of op -> provider");
  for (const auto& [key, v] : j.items()) {
    if (key == "verify") continue;
    if (v.is_null()) continue;
    if (!v.is_string())
      throw Error(RLH_E_INVALID_ARGUMENT, "policy.kernels." + key + " must name a kernel provider (a string), not " + v.dump());
    const std::string name = v.get<std::string>();
    if (name.empty() || name == "auto") continue;
    pins.emplace_back(key, name);
  }
  return pins;
}

bool kernel_verify_from_json(const std::string& section_json) {
  const nlohmann::json j = nlohmann::json::parse(section_json, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("verify") || j["verify"].is_null()) return true;
  if (!j["verify"].is_boolean())
    throw Error(RLH_E_INVALID_ARGUMENT, "policy.kernels.verify must be true or false, not " + j["verify"].dump());
  return j["verify"].get<bool>();
}

namespace {

bool pin_covers(const std::string& key, const std::string& op) {
  return op == key || (op.size() > key.size() && op.compare(0, key.size(), key) == 0 && op[key.size()] == '_');
}

// Runs the conformance runner on every non-reference provider of `reg` and limits each to the
// ops it lists that pass: one warning line per (provider, op) left out, naming the dtype and the
// worst error. Ops it lists that no case covers (or that it refused every case of) stay, with a
// warning that they are unverified. A pin to a provider for an op it fails is an error.
void verify_providers(const Host& host, KernelRegistry& reg, rlh_device device, const KernelPins& pins,
                      const std::string& who) {
  std::vector<const KernelRegistry::Provider*> todo;
  for (const KernelRegistry::Provider& p : reg.providers())
    if (!p.reference) todo.push_back(&p);
  if (todo.empty()) return;
  const std::unique_ptr<ReferenceKernels> ref = ReferenceKernels::find(host);
  if (!ref) {
    std::string names;
    for (const auto* p : todo) names += (names.empty() ? "" : ", ") + p->name;
    throw Error(RLH_E_FAILED_PRECONDITION,
                who + ": kernel provider(s) " + names +
                    " cannot be verified before use: no reference kernel provider is loaded (put kernels_cpu on the "
                    "plugin path), or set policy.kernels.verify: false to use them unverified");
  }
  const auto& variants = kernel_variants();
  for (const KernelRegistry::Provider* p : todo) {
    const std::string name = p->name;
    const auto t0 = std::chrono::steady_clock::now();
    KernelCheckReport rep;
    try {
      rep = check_kernels(*ref, name, p->api, p->instance, device);
    } catch (const Error& e) {  // it cannot even be checked (its op list, its provider_info)
      for (const auto& [key, prov] : pins)
        if (prov == name)
          throw Error(e.code(), who + ": pinned kernel provider '" + name + "' cannot be verified: " + e.what());
      host.warn(who + ": kernel provider '" + name + "' left out: it cannot be verified: " + e.what());
      reg.restrict_ops(name, {});
      continue;
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::vector<std::string> keep;
    int left_out = 0;
    for (const KernelCheckRow& row : rep.rows) {
      if (!row.listed) continue;
      std::string fails, unverified;
      for (size_t i = 0; i < row.cells.size() && i < variants.size(); ++i) {
        const KernelCheckCell& c = row.cells[i];
        char err[64];
        std::snprintf(err, sizeof(err), "%.1e > %.0e", c.worst, c.tolerance);
        if (c.state == KernelCheckCell::fail)
          fails += std::string(fails.empty() ? "" : "; ") + variants[i].name +
                   (c.tolerance > 0 ? std::string(": worst error ") + err + " in " : ": ") + c.where;
        else if (c.state == KernelCheckCell::no_case || c.state == KernelCheckCell::refused ||
                 c.state == KernelCheckCell::no_reference)
          unverified += std::string(unverified.empty() ? "" : ", ") + variants[i].name +
                        (c.state == KernelCheckCell::no_case ? " (no conformance case)"
                         : c.state == KernelCheckCell::refused ? " (every case refused)"
                                                               : " (the reference cannot run it)");
      }
      if (!fails.empty()) {
        ++left_out;
        host.warn(who + ": kernel provider '" + name + "' left out for op '" + row.op + "' on " + rep.device +
                  ": fails conformance (" + fails + ")");
        for (const auto& [key, prov] : pins)
          if (prov == name && pin_covers(key, row.op))
            throw Error(RLH_E_FAILED_PRECONDITION,
                        "policy.kernels." + key + " pins kernel provider '" + name + "', which fails conformance for op '" +
                            row.op + "' (" + fails + "); set policy.kernels.verify: false to use it anyway");
        continue;
      }
      if (!unverified.empty())
        host.warn(who + ": kernel provider '" + name + "' op '" + row.op + "' is used unverified in " + unverified);
      keep.push_back(row.op);
    }
    char t[32];
    std::snprintf(t, sizeof(t), "%.2f s", secs);
    host.info(who + ": kernel provider '" + name + "' verified on " + rep.device + " against '" + ref->name() + "' in " +
              t + ": " + std::to_string(keep.size()) + " op(s) kept, " + std::to_string(left_out) + " left out");
    reg.restrict_ops(name, std::move(keep));
  }
}

}  // namespace

std::unique_ptr<KernelRegistry> make_kernel_registry(const Host& host, rlh_device device,
                                                     const KernelPins& pins,
                                                     const std::string& who,
                                                     const std::string& instance_config, bool verify) {
  const rlh_host_api* api = host.api();
  if (api == nullptr || !RLH_HAS_FIELD(api, rlh_host_api, list_components) || api->list_components == nullptr)
    throw Error(RLH_E_ABI_MISMATCH, who + ": the host cannot list kernel providers (it predates ABI 0.2)");
  std::string listing;
  check(api->list_components(api->ctx, RLH_KIND_KERNELS, write_to_string, &listing), "listing kernel providers");
  const nlohmann::json list = nlohmann::json::parse(listing, nullptr, false);
  if (!list.is_array()) throw Error(RLH_E_INTERNAL, "list_components did not write a JSON array");

  auto is_pinned = [&](const std::string& name) {
    return std::any_of(pins.begin(), pins.end(), [&](const auto& p) { return p.second == name; });
  };
  std::vector<KernelRegistry::Provider> firsts, references;
  auto reg = std::make_unique<KernelRegistry>();
  for (const nlohmann::json& c : list) {
    const std::string name = c.value("name", std::string());
    const rlh_kernels_api* k = nullptr;
    try {
      k = host.find<rlh_kernels_api>(RLH_KIND_KERNELS, name.c_str(), RLH_STRUCT_SIZE(rlh_kernels_api, release_op));
    } catch (const Error& e) {
      if (is_pinned(name)) throw;
      host.warn(who + ": kernel provider '" + name + "' left out: " + e.what());
      continue;
    }
    rlh_kernels* inst = nullptr;
    rlh_status* s = k->create(api, device, instance_config.data(), instance_config.size(), &inst);
    if (s != nullptr) {
      StatusPtr owned(s);
      const std::string why = status_message(s);
      if (is_pinned(name))
        throw Error(s->code, who + ": pinned kernel provider '" + name + "' cannot run here: " + why);
      if (s->code != RLH_E_UNIMPLEMENTED && s->code != RLH_E_UNAVAILABLE)
        host.warn(who + ": kernel provider '" + name + "' left out: " + why);
      continue;
    }
    KernelRegistry::Provider p = KernelRegistry::make(name, k, inst, true);
    try {
      const ProviderFacts f = provider_facts(k, inst);
      p.reference = f.reference;
      p.device_memory = f.device_memory;
    } catch (const Error& e) {
      k->destroy(inst);
      if (is_pinned(name)) throw;
      host.warn(who + ": kernel provider '" + name + "' left out: " + e.what());
      continue;
    }
    (p.reference ? references : firsts).push_back(std::move(p));
  }
  for (auto& p : firsts) reg->add_provider(std::move(p));
  for (auto& p : references) reg->add_provider(std::move(p));
  for (const auto& [op, prov] : pins) reg->pin(op, prov);
  if (verify) verify_providers(host, *reg, device, pins, who);
  return reg;
}

}  // namespace rlh::sdk
