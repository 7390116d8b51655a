// The model_llama plugin: the MODEL component (abi/include/rlhost/model.h) over
// rlh_model_llama_core. describe() returns the TransformerDesc as JSON (model_desc.hpp schema).
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/model.h"
#include "rlhost/model/llama_family.hpp"
#include "rlhost/sdk/plugin.hpp"

namespace {

// NULL-terminated architecture names, pointing into the static table rows (string literals).
const std::vector<const char*> kArchitectureNames = [] {
  std::vector<const char*> names;
  static const std::vector<std::string> owned = rlh::model::supported_architectures();
  for (const auto& s : owned) names.push_back(s.c_str());
  names.push_back(nullptr);
  return names;
}();

rlh_status* describe(const rlh_host_api* host, const char* config_json, size_t config_len, rlh_write_fn write,
                     void* user) {
  const rlh::sdk::MakeStatusFn make = host != nullptr ? host->make_status : nullptr;
  return rlh::sdk::guard(make, [&] {
    if ((config_json == nullptr && config_len != 0) || write == nullptr)
      throw rlh::sdk::Error(RLH_E_INVALID_ARGUMENT, "model_llama describe: null config or writer");
    std::string doc;
    try {
      const auto desc = rlh::model::describe_json_text({config_json, config_len}, "config.json");
      doc = nlohmann::json(desc).dump();
    } catch (const std::runtime_error& e) {
      // Config problems (unsupported architecture, bad key) are the caller's input errors.
      throw rlh::sdk::Error(RLH_E_INVALID_ARGUMENT, e.what());
    }
    write(user, doc.data(), doc.size());
  });
}

const rlh_model_api kModelApi = [] {
  rlh_model_api api{};
  api.struct_size = sizeof(rlh_model_api);
  api.architectures = kArchitectureNames.data();
  api.describe = describe;
  return api;
}();

const rlh_component_desc kModelComponent = rlh::sdk::component_desc(
    RLH_KIND_MODEL, "llama", "0.1.0", RLH_MODEL_API_VERSION_MAJOR, RLH_MODEL_API_VERSION_MINOR, &kModelApi,
    "Dense Llama family (Llama, Mistral, Qwen2, Qwen3) and MoE/MLA relatives: HF config -> transformer description");

const rlh_component_desc* const kComponents[] = {&kModelComponent};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("model_llama", "0.1.0", "rlhost", kComponents,
                                        "Model descriptions for the dense Llama family"));
