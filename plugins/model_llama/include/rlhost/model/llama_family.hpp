// The dense Llama family (and the MoE relatives that share its naming) as data: HF config.json ->
// rlh::sdk::TransformerDesc. Weights I/O over the description's parameter table is the SDK's
// (rlhost/sdk/model_weights.hpp, rlh_model_io); load_model() below combines the two.
//
// Static library rlh_model_llama_core. The model_llama plugin wraps describe() behind the C ABI;
// backends and tests may link the library directly.
//
// Architectures are rows of a table (architecture_tables.cpp): config keys with their defaults,
// weight-name patterns per parameter role, and a few rules (which layers slide, which are MoE).
// describe() is one generic function over those rows; an architecture no row lists is refused
// with an error that names it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "rlhost/sdk/model_desc.hpp"
#include "rlhost/sdk/model_weights.hpp"
#include "rlhost/sdk/safetensors.hpp"

namespace rlh::model {

// HF architecture names the tables list ("LlamaForCausalLM", ...), in table order.
std::vector<std::string> supported_architectures();
bool is_supported_architecture(std::string_view architecture);

// HF config (parsed config.json) -> description. Uses config["architectures"][0]. Throws
// std::runtime_error with one line naming the architecture or the offending key.
sdk::TransformerDesc describe(const nlohmann::json& hf_config);
// Same from config.json text (strict parse: bounded nesting, duplicate keys refused).
sdk::TransformerDesc describe_json_text(std::string_view config_json, const std::string& label);
// Reads <model_dir>/config.json.
sdk::TransformerDesc describe_model_dir(const std::string& model_dir);

// A model folder, or a hub id ("Qwen/Qwen2.5-1.5B", optional "@revision") in the local HF cache.
std::string resolve_model_dir(const std::string& dir_or_hub_id);

// Everything needed to run a model: its folder, description, open checkpoint and weights.
struct LoadedModel {
  std::string dir;  // resolved model folder
  sdk::TransformerDesc desc;
  sdk::st::Checkpoint checkpoint;  // kept open (mmapped) for passthrough on save
  sdk::LoadResult weights;
};

// resolve_model_dir + describe_model_dir + Checkpoint::open (single file or sharded) +
// load_weights_f32.
LoadedModel load_model(const std::string& dir_or_hub_id, const sdk::LoadOptions& options = {});

}  // namespace rlh::model
