// The dense Llama family (and the MoE relatives that share its naming) as data: HF config.json ->
// rlh::sdk::TransformerDesc, and HF checkpoints <-> engine-layout float32 host buffers.
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

// ---------------------------------------------------------------------------------------------
// Weights

// What to do when a checkpoint tensor's dtype differs from the description's.
enum class DtypePolicy {
  adopt,   // accept any float dtype, record it in the ParamDesc so a save writes it back as found
  strict,  // refuse: one-line error naming file and tensor
};

struct LoadOptions {
  DtypePolicy dtype_policy = DtypePolicy::adopt;
  // Checkpoint tensors no parameter uses (multi-token-prediction layers, a stored copy of a tied
  // lm_head, rotary buffers): listed in LoadResult::unused when true, an error when false.
  bool allow_unused = true;
};

struct LoadResult {
  // One float32 buffer per desc.params entry, same order, engine layout (row-major desc shape).
  std::vector<std::vector<float>> tensors;
  std::vector<std::string> unused;  // checkpoint tensors not in the parameter table
};

// Loads every parameter of `desc` from `ckpt`, checking each HF source tensor's presence, shape
// and dtype against the description (errors name the file and tensor). With DtypePolicy::adopt,
// desc.params[*].dtype is updated to the checkpoint's dtype.
LoadResult load_weights_f32(sdk::TransformerDesc& desc, const sdk::st::Checkpoint& ckpt,
                            const LoadOptions& options = {});

// Everything needed to run a model: its folder, description, open checkpoint and weights.
struct LoadedModel {
  std::string dir;  // resolved model folder
  sdk::TransformerDesc desc;
  sdk::st::Checkpoint checkpoint;  // kept open (mmapped) for passthrough on save
  LoadResult weights;
};

// resolve_model_dir + describe_model_dir + Checkpoint::open (single file or sharded) +
// load_weights_f32.
LoadedModel load_model(const std::string& dir_or_hub_id, const LoadOptions& options = {});

struct SaveOptions {
  sdk::st::ShardedWriteOptions files;  // shard size, file prefix, metadata
  // Checkpoint whose `unused` tensors (see LoadResult) are copied through verbatim, so a load ->
  // save round trip keeps them. nullptr: none.
  const sdk::st::Checkpoint* passthrough = nullptr;
  std::vector<std::string> passthrough_names;
};

// Writes engine-layout float32 tensors (parallel to desc.params) as HF safetensors under the HF
// names, dtypes and shapes of the parameter table (converting float32 -> bf16/f16 with
// round-to-nearest-even). Unchanged weights of an HF checkpoint round-trip bit for bit.
// Returns the files written.
std::vector<std::string> save_weights_hf(const sdk::TransformerDesc& desc,
                                         const std::vector<std::vector<float>>& tensors,
                                         const std::string& dir, const SaveOptions& options = {});

}  // namespace rlh::model
