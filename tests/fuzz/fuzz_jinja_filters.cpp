// Fuzzes Jinja expressions, filters, tests and methods over awkward values: the input is one
// expression, evaluated with variables that sit on every edge (64-bit extremes, NaN and inf,
// empty, deep and shared lists, a namespace, Unicode) and then printed, serialised and compared.
// `m` holds the input's raw bytes (a caller's JSON string need not be UTF-8; the template must
// be). Overflow must be an error (never a wrap or a SIGFPE), builders must stop at the limits,
// and every failure must be a one-line std::runtime_error. (fuzz_chat_template covers statements.)
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "rlhost/tokenizer/chat_template.hpp"

namespace {
const char* const kPreamble =
    "{%- set big = 9223372036854775807 -%}{%- set small = -9223372036854775807 - 1 -%}"
    "{%- set nan = (1e308 * 10) - (1e308 * 10) -%}{%- set inf = 1e308 * 10 -%}"
    "{%- set s = 'aé中🙂\\n\\t x' -%}{%- set l = [1, 'a', [2, [3]], none, true, 2.5] -%}"
    "{%- set d = {'a': 1, 'b': [1, 2], 'c': {'d': 'e'}} -%}{%- set ns = namespace(x=1, l=[1]) -%}"
    "{%- set e = [] -%}{%- set m = messages[0].content -%}";
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string expr(reinterpret_cast<const char*>(data), size);
  if (expr.find('\0') != std::string::npos || size > 4096) return 0;
  rlh::tok::TemplateLimits lim;
  lim.max_steps = 100'000;
  lim.max_output = 1u << 20;
  lim.max_string = 256u << 10;
  lim.max_items = 50'000;
  lim.max_bytes = 16u << 20;
  const std::string tpl = std::string(kPreamble) + "{%- set v = (" + expr + ") -%}{{ v }}|{{ v|tojson }}|{{ v|string|length }}|" +
                          "{{ v == v }}|{{ v is number }}|{{ [v, v]|unique|list|length }}|{{ v|default('d') }}";
  try {
    rlh::tok::ChatTemplate t(tpl);
    t.set_limits(lim);
    (void)t.render(nlohmann::json::array({{{"role", "user"}, {"content", expr}}}), false);
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    if (m.empty() || m.find('\n') != std::string::npos) __builtin_trap();
  }
  return 0;
}
