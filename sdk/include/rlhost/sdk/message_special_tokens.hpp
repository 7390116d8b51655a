// NeMo-RL's special-token rule for a training conversation (nemo_rl/data/llm_message_utils.py,
// get_formatted_message_log), shared by the SFT/DPO/RM rows (plugins/grpo) and the reward_model
// environment (plugins/environments), so a reward model scores the shape it was trained on.
#pragma once

#include <string>
#include <string_view>

namespace rlh::sdk {

// The first message's text gains BOS's text in front unless it starts with it ("" = none).
inline void add_bos_text(std::string& first, std::string_view bos) {
  if (!bos.empty() && !first.starts_with(bos)) first.insert(0, bos);
}

// The last message's text gains EOS's text unless it ends with it, trailing newlines aside (a
// Qwen template's "<|im_end|>\n" already ends with its EOS); "" = none.
inline void add_eos_text(std::string& last, std::string_view eos) {
  const size_t end = last.find_last_not_of('\n');
  const std::string_view kept(last.data(), end == std::string::npos ? 0 : end + 1);
  if (!eos.empty() && !kept.ends_with(eos)) last += eos;
}

}  // namespace rlh::sdk
