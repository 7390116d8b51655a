// Normalizers: the `normalizer` section of tokenizer.json (HF tokenizers/src/normalizers).
//
// HF tracks an alignment for every byte; rlhost does not expose offsets, so a normalizer here is
// a plain string rewrite. The only alignment fact the pipeline needs is whether the piece still
// starts at original offset 0 (Metaspace's prepend_scheme "first" asks), so a normalizer that
// drops leading characters clears `at_origin`.
#pragma once

#include <memory>
#include <string>

#include "json_util.hpp"

namespace rlh::tok {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void normalize(std::string& s, bool& at_origin) const = 0;
};

// Builds a normalizer from its JSON object (nullptr for JSON null). Throws on unknown types.
std::unique_ptr<Normalizer> make_normalizer(const json& j, const JPath& p, int depth = 0);

}  // namespace rlh::tok
