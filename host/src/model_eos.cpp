#include "model_eos.hpp"

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "rlhost/sdk/hf_cache.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::host {
namespace {

using json = nlohmann::json;

// The eos_token_id of a JSON file (an id or a list), if the file and key are there.
void add_eos_ids(const std::filesystem::path& path, std::set<int32_t>& out) {
  std::ifstream in(path);
  if (!in) return;
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    throw sdk::Error(RLH_E_INVALID_ARGUMENT, path.string() + ": invalid JSON: " + e.what());
  }
  if (!j.is_object() || !j.contains("eos_token_id")) return;
  const json& e = j["eos_token_id"];
  if (e.is_number_integer()) out.insert(e.get<int32_t>());
  if (e.is_array())
    for (const json& x : e)
      if (x.is_number_integer()) out.insert(x.get<int32_t>());
}

}  // namespace

std::set<int32_t> model_eos_ids(const std::string& model, const rlh_tokenizer_api* api, const rlh_tokenizer* tok) {
  std::filesystem::path dir = model;
  try {
    dir = sdk::resolve_model_path(model);  // a hub id's snapshot folder
  } catch (const std::exception&) {
    // Not found: the component that loads the model names the problem.
  }
  std::set<int32_t> eos;
  add_eos_ids(dir / "generation_config.json", eos);
  if (eos.empty()) add_eos_ids(dir / "config.json", eos);
  if (api != nullptr && tok != nullptr) {
    std::string info;
    sdk::check(api->info(tok, sdk::write_to_string, &info));
    const json j = json::parse(info);
    if (j.contains("eos_token_ids") && j["eos_token_ids"].is_array())
      for (const json& x : j["eos_token_ids"])
        if (x.is_number_integer()) eos.insert(x.get<int32_t>());
  }
  return eos;
}

}  // namespace rlh::host
