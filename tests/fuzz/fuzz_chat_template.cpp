// Fuzzes the Jinja engine: the input is a template (up to the first NUL) and, after it, JSON for
// the messages. Parsing and rendering must end in output or a one-line std::runtime_error under
// the render budget (small limits here, so a runaway input ends in milliseconds: the defaults are
// the same code with larger numbers). A crash, sanitizer report, leak, hang or OOM is a finding.
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "rlhost/tokenizer/chat_template.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in(reinterpret_cast<const char*>(data), size);
  const size_t nul = in.find('\0');
  const std::string tpl = in.substr(0, nul);
  nlohmann::json messages = nlohmann::json::array({{{"role", "user"}, {"content", "hi"}}});
  if (nul != std::string::npos) {
    auto parsed = nlohmann::json::parse(in.substr(nul + 1), nullptr, false);
    if (parsed.is_array() && parsed.dump().size() < 4096) messages = parsed;
  }
  rlh::tok::TemplateLimits lim;
  lim.max_steps = 200'000;
  lim.max_output = 1u << 20;
  lim.max_string = 1u << 20;
  lim.max_items = 100'000;
  // 4 MiB: a loop that rebuilds a list each pass stops here within ~0.5 s under ASan (32 MiB
  // took 3.4 s, and 14 s on a loaded machine: a libFuzzer timeout, though the render was bounded).
  lim.max_bytes = 4u << 20;
  try {
    rlh::tok::ChatTemplate t(tpl, {{"bos_token", "<s>"}, {"eos_token", "</s>"}});
    t.set_limits(lim);
    (void)t.render(messages, true, {{"tools", nlohmann::json::array({{{"name", "f"}}})}});
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    if (m.empty() || m.find('\n') != std::string::npos) __builtin_trap();  // messages are one line
  }
  return 0;
}
