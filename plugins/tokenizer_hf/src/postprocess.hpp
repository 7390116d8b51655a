// Post-processors: the `post_processor` section of tokenizer.json (HF tokenizers/src/processors),
// for single sequences: TemplateProcessing, BertProcessing, RobertaProcessing, ByteLevel (ids are
// unchanged; it only trims offsets) and Sequence.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "json_util.hpp"

namespace rlh::tok {

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  // Wraps the ids of one encoded sequence; called only when add_special_tokens is true.
  virtual void process(std::vector<int32_t>& ids) const = 0;
};

std::unique_ptr<PostProcessor> make_post_processor(const json& j, const JPath& p, int depth = 0);

// Builds the template transformers sets up for add_bos_token / add_eos_token
// (`bos $A eos` with either part optional).
std::unique_ptr<PostProcessor> make_bos_eos_processor(std::vector<int32_t> prefix, std::vector<int32_t> suffix);

}  // namespace rlh::tok
