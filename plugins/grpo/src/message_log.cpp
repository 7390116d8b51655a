#include "message_log.hpp"

#include <algorithm>

#include "rlhost/sdk/message_special_tokens.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::grpo {

using json = nlohmann::json;

namespace {

// NeMo-RL's get_first_index_that_differs.
size_t first_difference(const std::string& a, const std::string& b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

}  // namespace

std::vector<std::vector<int32_t>> formatted_message_log(const Tokenizer& tok, const json& messages,
                                                        const MessageLogOptions& o) {
  // A tokenizer without the token skips it (NeMo-RL warns and goes on).
  const std::string_view bos = o.add_bos ? std::string_view(tok.bos_token_text()) : std::string_view();
  const std::string_view eos = o.add_eos ? std::string_view(tok.eos_token_text()) : std::string_view();
  if (messages.size() > kMaxConversationMessages)
    throw sdk::Error(RLH_E_INVALID_ARGUMENT, "a conversation of " + std::to_string(messages.size()) +
                                                 " messages, more than the " + std::to_string(kMaxConversationMessages) +
                                                 " a training row takes");
  std::vector<std::vector<int32_t>> out;
  std::string prev;
  int64_t tokens = 0;
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i]["role"].get_ref<const std::string&>();
    std::string rendered;
    if (o.format == PromptFormat::kChatTemplate) {
      const json upto(messages.begin(), messages.begin() + static_cast<std::ptrdiff_t>(i + 1));
      rendered = tok.apply_chat_template(upto, o.add_generation_prompt && (role == "user" || role == "tool"));
    } else {
      rendered = prev + messages[i]["content"].get<std::string>();
    }
    std::string chunk = rendered.substr(first_difference(prev, rendered));
    if (i == 0) sdk::add_bos_text(chunk, bos);
    if (i + 1 == messages.size()) sdk::add_eos_text(chunk, eos);
    out.push_back(tok.encode(chunk, false));
    prev = std::move(rendered);
    tokens += static_cast<int64_t>(out.back().size());
    if (o.max_tokens > 0 && tokens >= o.max_tokens) break;
  }
  return out;
}

void message_log_row(const std::vector<std::vector<int32_t>>& log, const json& messages, bool only_final,
                     std::vector<int32_t>& ids, std::vector<float>& mask) {
  ids.clear();
  mask.clear();
  for (size_t i = 0; i < log.size(); ++i) {
    const bool trained = messages[i]["role"] == "assistant" && (!only_final || i + 1 == messages.size());
    ids.insert(ids.end(), log[i].begin(), log[i].end());
    mask.insert(mask.end(), log[i].size(), trained ? 1.0f : 0.0f);
  }
}

}  // namespace rlh::grpo
