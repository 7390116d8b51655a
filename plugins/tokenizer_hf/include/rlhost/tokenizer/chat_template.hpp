// Chat templates: the Jinja templates HF ships in tokenizer_config.json, rendered natively.
//
// A small Jinja engine (lexer, parser to an AST, evaluator over a dynamic Value) covering what
// chat templates use: for/if/elif/else/set (with namespace() and ns.attr), macros, filters,
// tests, string methods, slicing, loop.*, whitespace control, raise_exception(). The environment
// matches transformers' apply_chat_template: trim_blocks and lstrip_blocks on, loop controls
// (break/continue), tojson without ASCII escaping, {% generation %} blocks rendered as plain text.
#pragma once

#include <nlohmann/json.hpp>  // nlohmann::json

#include <cstddef>
#include <memory>
#include <string>

namespace rlh::tok {

namespace jinja {
struct Program;
}

// What one render may use. A template is code from a model repository: it must not be able to
// hang the process, exhaust memory or overflow the stack, whatever it does. Exceeding a limit is
// an error naming it ("chat template: a string of ... bytes is longer than the limit of 64 MiB").
// The defaults are far above any real chat template (those render in well under a million steps
// and a few MB); tests and the fuzzer set smaller ones.
struct TemplateLimits {
  size_t max_steps = 10'000'000;       // loop iterations, calls, comparisons inside filters
  size_t max_output = 256u << 20;      // bytes of rendered text
  size_t max_string = 64u << 20;       // bytes of any one string value
  size_t max_items = 4u << 20;         // items of any one list the template builds
  size_t max_bytes = size_t{2} << 30;  // bytes of values built or copied, summed over the render
  int max_nesting = 600;               // evaluation, formatting and comparison nesting, all together
  int max_call_depth = 100;            // macro and function calls
};

class ChatTemplate {
 public:
  // Parses the template; throws std::runtime_error ("chat template: line 3: ...") on bad syntax.
  explicit ChatTemplate(std::string source, nlohmann::json defaults = nlohmann::json::object());

  void set_limits(const TemplateLimits& limits) { limits_ = limits; }
  const TemplateLimits& limits() const { return limits_; }

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
  TemplateLimits limits_;
};

}  // namespace rlh::tok
