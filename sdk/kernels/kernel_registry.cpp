// The host's kernel providers as one executor's registry (kernel_registry.hpp).
#include "rlhost/sdk/kernel_registry.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>

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

std::unique_ptr<KernelRegistry> make_kernel_registry(const Host& host, rlh_device device,
                                                     const KernelPins& pins,
                                                     const std::string& who,
                                                     const std::string& instance_config) {
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
    KernelRegistry::Provider p{name, k, inst, true, false, false};
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
  return reg;
}

}  // namespace rlh::sdk
