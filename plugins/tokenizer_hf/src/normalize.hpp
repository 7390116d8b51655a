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
  // Rewrites `s`. `cap` bounds what the text may grow to (normalized_cap of the input): a chain
  // of Replace rules can multiply the text at every step, so growth past it is an error, thrown
  // before the memory is spent.
  virtual void normalize(std::string& s, bool& at_origin, size_t cap) const = 0;
};

// Real normalizers grow text by small factors (Metaspace-like replacements, NFKD: a few x); a
// tokenizer.json whose chain multiplies it further is refused at encode time.
inline size_t normalized_cap(size_t input_bytes) { return 16 * input_bytes + 4096; }

// Builds a normalizer from its JSON object (nullptr for JSON null). Throws on unknown types.
std::unique_ptr<Normalizer> make_normalizer(const json& j, const JPath& p, int depth = 0);

}  // namespace rlh::tok
