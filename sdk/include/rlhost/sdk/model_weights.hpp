// HF checkpoints <-> engine-layout float32 host buffers, following a description's parameter
// table (rlh::sdk::TransformerDesc::params: HF names, shapes, dtypes and the transforms between
// HF tensors and engine tensors). Generic over descriptions, so every backend, generator and
// model plugin shares one implementation. Static library rlh_model_io.
#pragma once

#include <string>
#include <vector>

#include "rlhost/sdk/model_desc.hpp"
#include "rlhost/sdk/safetensors.hpp"

namespace rlh::sdk {

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
LoadResult load_weights_f32(TransformerDesc& desc, const st::Checkpoint& ckpt,
                            const LoadOptions& options = {});

struct SaveOptions {
  st::ShardedWriteOptions files;  // shard size, file prefix, metadata
  // Checkpoint whose `unused` tensors (see LoadResult) are copied through verbatim, so a load ->
  // save round trip keeps them. nullptr: none.
  const st::Checkpoint* passthrough = nullptr;
  std::vector<std::string> passthrough_names;
};

// Writes engine-layout float32 tensors (parallel to desc.params) as HF safetensors under the HF
// names, dtypes and shapes of the parameter table (converting float32 -> bf16/f16 with
// round-to-nearest-even). Unchanged weights of an HF checkpoint round-trip bit for bit.
// Returns the files written.
std::vector<std::string> save_weights_hf(const TransformerDesc& desc,
                                         const std::vector<std::vector<float>>& tensors,
                                         const std::string& dir, const SaveOptions& options = {});

}  // namespace rlh::sdk
