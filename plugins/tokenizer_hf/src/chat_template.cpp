// ChatTemplate: parses once, renders messages with transformers' variables (see chat_template.hpp).
#include "rlhost/tokenizer/chat_template.hpp"

#include <cstdio>
#include <string_view>

#include "jinja_eval.hpp"
#include "unicode.hpp"

namespace rlh::tok {
namespace {

// Errors are one line (the CLI's last stderr line names the problem), but they quote the
// template: a token or a raise_exception text may hold newlines and control characters, and a
// string literal may be megabytes long. Escape the one, cut the other (on a UTF-8 boundary).
std::runtime_error error(std::string_view m) {
  constexpr size_t kMaxBytes = 1024;
  std::string out = "chat template: ";
  for (const char c : m) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (u < 0x20 || u == 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "\\x%02x", u);
      out += hex;
    } else {
      out += c;
    }
    if (out.size() > kMaxBytes) {
      size_t cut = kMaxBytes;
      while (cut > 0 && (static_cast<unsigned char>(out[cut]) & 0xC0) == 0x80) --cut;
      out.resize(cut);
      out += "...";
      break;
    }
  }
  return std::runtime_error(out);
}

}  // namespace

ChatTemplate::ChatTemplate(std::string source, nlohmann::json defaults)
    : source_(std::move(source)), defaults_(std::move(defaults)) {
  // A template is Python text: transformers could not have decoded one that is not UTF-8, and
  // the engine's string functions walk code points.
  if (const size_t bad = uni::find_invalid(source_); bad != std::string::npos)
    throw error("not valid UTF-8 (byte " + std::to_string(bad) + ")");
  try {
    program_ = jinja::parse(jinja::lex(source_));
  } catch (const jinja::Error& e) {
    throw error(e.what());
  } catch (const std::logic_error& e) {  // e.g. a numeric conversion out of range
    throw error(e.what());
  }
}

std::string ChatTemplate::render(const nlohmann::json& messages, bool add_generation_prompt,
                                 const nlohmann::json& extra) const {
  if (!messages.is_array()) throw std::runtime_error("chat template: messages must be a JSON array");
  if (!extra.is_null() && !extra.is_object()) throw std::runtime_error("chat template: extra variables must be a JSON object");
  jinja::Budget budget;
  budget.lim = limits_;
  jinja::BudgetScope scope(budget);
  std::unordered_map<std::string, jinja::Value> g;
  // transformers passes tools=None and documents=None when not given.
  g["tools"] = jinja::Value::none();
  g["documents"] = jinja::Value::none();
  try {
    if (defaults_.is_object())
      for (auto it = defaults_.begin(); it != defaults_.end(); ++it) g[it.key()] = jinja::from_json(it.value());
    if (extra.is_object())
      for (auto it = extra.begin(); it != extra.end(); ++it) g[it.key()] = jinja::from_json(it.value());
    g["messages"] = jinja::from_json(messages);
    g["add_generation_prompt"] = jinja::Value::boolean(add_generation_prompt);
    return jinja::render_program(*program_, std::move(g));
  } catch (const jinja::Error& e) {
    std::string m = e.what();
    const std::string tag = "raise_exception: ";
    if (m.rfind(tag, 0) == 0) m = m.substr(tag.size());
    throw error(m);
  } catch (const std::logic_error& e) {
    throw error(e.what());
  }
}

}  // namespace rlh::tok
