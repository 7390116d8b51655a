// Chat templates: the Jinja templates HF ships in tokenizer_config.json, rendered natively.
//
// A small Jinja engine (lexer, parser to an AST, evaluator over a dynamic Value) covering what
// chat templates use: for/if/elif/else/set (with namespace() and ns.attr), macros, filters,
// tests, string methods, slicing, loop.*, whitespace control, raise_exception(). The environment
// matches transformers' apply_chat_template: trim_blocks and lstrip_blocks on, loop controls
// (break/continue), tojson without ASCII escaping, {% generation %} blocks rendered as plain text.
#pragma once

#include <nlohmann/json.hpp>  // nlohmann::json

#include <memory>
#include <string>

namespace rlh::tok {

namespace jinja {
struct Program;
}

class ChatTemplate {
 public:
  // Parses the template; throws std::runtime_error ("chat template: line 3: ...") on bad syntax.
  explicit ChatTemplate(std::string source, nlohmann::json defaults = nlohmann::json::object());

  // Renders `messages` (a JSON array of {"role", "content", ...}). `extra` holds more variables
  // (tools, documents, custom kwargs); they override the defaults (bos_token, eos_token, ...).
  // A template's raise_exception(msg) or an evaluation error throws std::runtime_error.
  std::string render(const nlohmann::json& messages, bool add_generation_prompt,
                     const nlohmann::json& extra = nlohmann::json::object()) const;

  const std::string& source() const { return source_; }
  const nlohmann::json& defaults() const { return defaults_; }

 private:
  std::string source_;
  nlohmann::json defaults_;
  std::shared_ptr<const jinja::Program> program_;
};

}  // namespace rlh::tok
