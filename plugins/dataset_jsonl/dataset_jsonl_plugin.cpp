// The dataset_jsonl plugin: the `jsonl` DATASET component over rlh_dataset_jsonl_core.
#include <memory>
#include <string>

#include "rlhost/dataset.h"
#include "rlhost/dataset_jsonl/jsonl_dataset.hpp"
#include "rlhost/sdk/plugin.hpp"

namespace {

using rlh::dataset_jsonl::JsonlDataset;

// The instance behind rlh_dataset*: the dataset and the host's status factory (statuses made by
// the host outlive this plugin).
struct Instance {
  rlh::sdk::MakeStatusFn make_status;
  std::unique_ptr<JsonlDataset> data;
};

rlh_status* create(const rlh_host_api* host, const char* config_json, size_t config_len, rlh_dataset** out) {
  rlh::sdk::MakeStatusFn make = host != nullptr ? host->make_status : nullptr;
  return rlh::sdk::guard(make, [&] {
    if (out == nullptr) throw rlh::sdk::Error(RLH_E_INVALID_ARGUMENT, "jsonl: create: out is NULL");
    nlohmann::json cfg;
    try {
      cfg = nlohmann::json::parse(config_json != nullptr ? std::string(config_json, config_len) : std::string("{}"));
    } catch (const std::exception& e) {
      throw rlh::sdk::Error(RLH_E_INVALID_ARGUMENT, std::string("jsonl: config is not valid JSON: ") + e.what());
    }
    auto inst = std::make_unique<Instance>();
    inst->make_status = make;
    inst->data = std::make_unique<JsonlDataset>(cfg);
    *out = reinterpret_cast<rlh_dataset*>(inst.release());
  });
}

void destroy(rlh_dataset* self) { delete reinterpret_cast<Instance*>(self); }

int64_t size(const rlh_dataset* self) { return reinterpret_cast<const Instance*>(self)->data->size(); }

rlh_status* get(const rlh_dataset* self, int64_t index, rlh_write_fn write, void* user) {
  const auto* inst = reinterpret_cast<const Instance*>(self);
  return rlh::sdk::guard(inst->make_status, [&] {
    const std::string row = inst->data->row_json(index);
    write(user, row.data(), row.size());
  });
}

const rlh_dataset_api kApi = {RLH_STRUCT_SIZE(rlh_dataset_api, get), create, destroy, size, get};

// NeMo-RL's data keys this component reads (data.train / data.validation / data.default, and
// the older data.prompt_file / data.system_prompt_file).
const char* const kKeys[] = {
    "data.train.data_path", "data.train.input_key", "data.train.output_key", "data.train.split_validation_size",
    "data.train.seed", "data.train.prompt_file", "data.train.system_prompt_file", "data.train.dataset_name",
    "data.validation.data_path", "data.validation.input_key", "data.validation.output_key",
    "data.validation.prompt_file", "data.validation.system_prompt_file", "data.validation.dataset_name",
    "data.default.input_key", "data.default.output_key", "data.default.prompt_file",
    "data.default.system_prompt_file", "data.default.seed", "data.prompt_file", "data.system_prompt_file",
    "data.default.dataset_name", "data.train.prompt_key", "data.train.chosen_key", "data.train.rejected_key",
    "data.validation.prompt_key", "data.validation.chosen_key", "data.validation.rejected_key",
    "data.default.prompt_key", "data.default.chosen_key", "data.default.rejected_key", nullptr};

const rlh_component_desc kJsonl = rlh::sdk::component_desc(
    RLH_KIND_DATASET, "jsonl", "0.1.0", RLH_DATASET_API_VERSION_MAJOR, RLH_DATASET_API_VERSION_MINOR, &kApi,
    "NeMo-RL ResponseDataset and preference rows from a local JSONL file (keys, prompt files, seeded split)", kKeys);
const rlh_component_desc* const kComponents[] = {&kJsonl};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("dataset_jsonl", "0.1.0", "rlhost", kComponents,
                                        "JSONL datasets in NeMo-RL's data layout"))
