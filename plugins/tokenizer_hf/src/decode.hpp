// Decoders: the `decoder` section of tokenizer.json (HF tokenizers/src/decoders). A decoder
// rewrites the list of token strings; the results are concatenated at the end.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "json_util.hpp"

namespace rlh::tok {

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};

std::unique_ptr<Decoder> make_decoder(const json& j, const JPath& p, int depth = 0);

}  // namespace rlh::tok
