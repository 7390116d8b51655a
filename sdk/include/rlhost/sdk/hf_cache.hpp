// Finding a model's files: a local directory, or a hub id ("Qwen/Qwen2.5-1.5B") resolved in the
// local Hugging Face cache. Never touches the network.
//
// Cache root, first that is set: $HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub.
// A hub id maps to <root>/models--<org>--<name>/snapshots/<rev>/, where <rev> is the commit in
// refs/main when present, else the only snapshot, else the most recently modified one.
// An optional "@<revision>" suffix picks a ref name (refs/<revision>) or a snapshot folder.
#pragma once

#include <filesystem>
#include <string_view>
#include <vector>

namespace rlh::sdk {

// Returns the directory for `dir_or_hub_id`: an existing directory is returned as is.
// Throws std::runtime_error with a one-line message naming the id and the folders searched.
std::filesystem::path resolve_model_path(std::string_view dir_or_hub_id);

// The cache roots consulted, in order (for messages and tests).
std::vector<std::filesystem::path> hf_cache_roots();

}  // namespace rlh::sdk
