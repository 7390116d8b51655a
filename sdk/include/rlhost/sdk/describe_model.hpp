// A model folder's description (TransformerDesc) through the host's MODEL component, for the
// components that read a model without loading it through a backend (the generator, the
// resharding refit's plan): config.json's first architecture must be one the component lists.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "rlhost/model.h"
#include "rlhost/sdk/input_file.hpp"
#include "rlhost/sdk/model_desc.hpp"
#include "rlhost/sdk/plugin.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::sdk {

// `component`: the MODEL component's name ("" for the best-scoring one); `who` begins every
// error ("generator", "refit").
inline TransformerDesc describe_model_folder(const Host& host, const std::string& dir, const std::string& component,
                                             const std::string& who) {
  std::string text;
  try {
    text = read_input_file(dir + "/config.json", 64u << 20, who + ": model file");  // regular files only
  } catch (const InputError& e) {
    throw Error(RLH_E_NOT_FOUND, e.what());
  }
  std::string arch;
  try {
    const nlohmann::json cfg = nlohmann::json::parse(text);
    if (cfg.contains("architectures") && cfg["architectures"].is_array() && !cfg["architectures"].empty() &&
        cfg["architectures"][0].is_string())
      arch = cfg["architectures"][0].get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    throw Error(RLH_E_INVALID_ARGUMENT, who + ": " + dir + "/config.json: " + e.what());
  }
  if (arch.empty()) throw Error(RLH_E_INVALID_ARGUMENT, who + ": " + dir + "/config.json names no architecture");
  const rlh_component_desc* d = nullptr;
  const auto* api = host.find<rlh_model_api>(RLH_KIND_MODEL, component.empty() ? nullptr : component.c_str(),
                                             RLH_STRUCT_SIZE(rlh_model_api, describe), &d);
  std::string listed;
  bool found = false;
  for (size_t i = 0; api->architectures && api->architectures[i] && i < 4096; ++i) {
    listed += std::string(listed.empty() ? "" : ", ") + api->architectures[i];
    found = found || arch == api->architectures[i];
  }
  if (!found)
    throw Error(RLH_E_UNIMPLEMENTED, who + ": model component '" + std::string(d->name) + "' does not describe " + arch +
                                         " (it lists: " + listed + ")");
  std::string doc;
  check(api->describe(host.api(), text.data(), text.size(), write_to_string, &doc), who + ": describing " + dir);
  try {
    return nlohmann::json::parse(doc).get<TransformerDesc>();
  } catch (const std::exception& e) {
    throw Error(RLH_E_INVALID_ARGUMENT, who + ": the model component's description: " + e.what());
  }
}

}  // namespace rlh::sdk
