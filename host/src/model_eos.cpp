#include "model_eos.hpp"

#include <climits>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "rlhost/sdk/hf_cache.hpp"
#include "rlhost/sdk/json_input.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::host {
namespace {

using json = nlohmann::json;

// The eos_token_id of a JSON file (an id or a list), if the file and key are there. The file is
// untrusted input: a regular file of bounded size (sdk/json_input.hpp), ids in int32's range.
void add_eos_ids(const std::filesystem::path& file, std::set<int32_t>& out) {
  const std::string path = file.string();
  if (!sdk::input_exists(path)) return;
  json j;
  try {
    j = sdk::read_json_file(path, 64u << 20, "model file");
  } catch (const sdk::InputError& e) {
    throw sdk::Error(RLH_E_INVALID_ARGUMENT, e.what());
  }
  if (!j.is_object() || !j.contains("eos_token_id")) return;
  auto add = [&](const json& x) {
    if (!x.is_number_integer()) return;
    if (x.get<int64_t>() < 0 || x.get<int64_t>() > INT32_MAX)
      throw sdk::Error(RLH_E_INVALID_ARGUMENT, path + ": eos_token_id " + x.dump() + " is not a token id");
    out.insert(static_cast<int32_t>(x.get<int64_t>()));
  };
  const json& e = j["eos_token_id"];
  add(e);
  if (e.is_array())
    for (const json& x : e) add(x);
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
