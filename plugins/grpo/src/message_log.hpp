// Training rows from chat messages as NeMo-RL's data processors build them
// (nemo_rl/data/llm_message_utils.py get_formatted_message_log, which sft_processor and the
// preference processor of DPO and RM call): the SFT and preference loops' tokens and masks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "components.hpp"
#include "loop_config.hpp"

namespace rlh::grpo {

struct MessageLogOptions {
  PromptFormat format = PromptFormat::kChatTemplate;
  // data.add_bos / data.add_eos / data.add_generation_prompt (NeMo-RL's sft_processor passes
  // them; its preference processor takes the defaults: true, true, false).
  bool add_bos = true, add_eos = true, add_generation_prompt = false;
  // > 0: stop after the message that brings the tokens to this many (a row that long is not
  // trained on anyway), so a hostile row's rendering stays bounded.
  int64_t max_tokens = 0;
};

// The most messages one training conversation may have: each message renders the conversation
// up to it, so the work grows with the square of the count.
constexpr size_t kMaxConversationMessages = 1024;

// Message i's tokens: the text that rendering messages [0, i] adds to the rendering of [0, i)
// (from where the two first differ), tokenized on its own without special tokens. A rendering is
// the chat template's, with the generation prompt after a user (or tool) turn when
// add_generation_prompt, or for kRaw NeMo-RL's passthrough template (the contents in order).
// add_bos puts the BOS token's text before the first message unless it starts with it; add_eos
// the tokenizer's own EOS token's (not generation_config's stop ids) after the last unless it
// ends with it, trailing newlines aside. Messages are objects with string "role" and "content"; at most
// kMaxConversationMessages of them (INVALID_ARGUMENT beyond).
std::vector<std::vector<int32_t>> formatted_message_log(const Tokenizer& tok, const nlohmann::json& messages,
                                                        const MessageLogOptions& o);

// The messages' tokens in order (`log` may stop short of `messages`: max_tokens), and the mask
// that trains on the assistant's (NeMo-RL's
// add_loss_mask_to_message_log with roles_to_train_on ["assistant"]; only_final: only the last
// message, and only when it is the assistant's).
void message_log_row(const std::vector<std::vector<int32_t>>& log, const nlohmann::json& messages, bool only_final,
                     std::vector<int32_t>& ids, std::vector<float>& mask);

}  // namespace rlh::grpo
