// The EOS token ids a model stops at, shared by `rlhost generate` and rlhost_generate (compiled
// into both, since librlhost exports only its C API).
#pragma once

#include <cstdint>
#include <set>
#include <string>

#include "rlhost/tokenizer.h"

namespace rlh::host {

// generation_config.json's eos_token_id (an id or a list), else config.json's, of the model folder
// or hub id `model`, plus the tokenizer's eos_token_ids when `tok` is not null. Invalid JSON in
// those files is an error naming the file.
std::set<int32_t> model_eos_ids(const std::string& model, const rlh_tokenizer_api* api, const rlh_tokenizer* tok);

}  // namespace rlh::host
