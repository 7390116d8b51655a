// Hostile chat templates and messages (issue 18): integer arithmetic that would trap or wrap,
// string and list builders that would take gigabytes, recursion and nesting that would overflow
// the stack, loops that would never end. Each must be a one-line "chat template: ..." error (or
// Python's value where Python has one), and the template must render normally afterwards:
// nothing is left half-done.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>

#include "rlhost/tokenizer/chat_template.hpp"

namespace {

using nlohmann::json;
using rlh::tok::ChatTemplate;
using rlh::tok::TemplateLimits;

const json kMessages = json::array({{{"role", "user"}, {"content", "hi"}}});

// The rendered text, or "ERROR: <message>".
std::string render(const std::string& tpl, const TemplateLimits* lim = nullptr, const json& messages = kMessages) {
  try {
    ChatTemplate t(tpl);
    if (lim) t.set_limits(*lim);
    return t.render(messages, false);
  } catch (const std::exception& e) {
    return std::string("ERROR: ") + e.what();
  }
}

// `tpl` fails with one line containing `part`, and the same engine then renders a good template.
void expect_error(const std::string& tpl, const std::string& part, const TemplateLimits* lim = nullptr) {
  SCOPED_TRACE(tpl.substr(0, 200));
  const std::string r = render(tpl, lim);
  ASSERT_EQ(r.rfind("ERROR: chat template: ", 0), 0u) << r.substr(0, 300);
  EXPECT_NE(r.find(part), std::string::npos) << r;
  EXPECT_EQ(r.find('\n'), std::string::npos) << "not one line: " << r;
  EXPECT_EQ(render("{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}", lim), "user:hi");
}

// Small limits so that tests reaching them stay fast.
TemplateLimits small() {
  TemplateLimits l;
  l.max_steps = 200'000;
  l.max_output = 1u << 20;
  l.max_string = 1u << 20;
  l.max_items = 100'000;
  l.max_bytes = 64u << 20;
  return l;
}

TEST(TemplateLimits, IntegerDivisionOverflowIsAnErrorNotSigfpe) {
  // Python: (-2**63) // -1 is 2**63 (no 64-bit value); (-2**63) % -1 is 0.
  expect_error("{{ (-9223372036854775807 - 1) // -1 }}", "integer overflow");
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) % -1 }}"), "0");
  EXPECT_EQ(render("{{ 7 // -1 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ -7 // 2 }}"), "-7 2 -2 -4");
  expect_error("{{ 5 // 0 }}", "integer division or modulo by zero");
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) is divisibleby(-1) }}"), "True");
}

TEST(TemplateLimits, IntegerOverflowIsAnErrorNotAWrap) {
  expect_error("{{ 2**64 }}", "integer overflow");  // was 0
  EXPECT_EQ(render("{{ 2**62 }} {{ (-2)**63 }} {{ 1**100000000000 }} {{ (-1)**100000000001 }} {{ 0**5 }}"),
            "4611686018427387904 -9223372036854775808 1 -1 0");
  expect_error("{{ 3**40 }}", "integer overflow");
  expect_error("{{ 9223372036854775807 + 1 }}", "integer overflow");
  expect_error("{{ -9223372036854775807 - 2 }}", "integer overflow");
  expect_error("{{ 4294967296 * 4294967296 }}", "integer overflow");
  expect_error("{{ -(-9223372036854775807 - 1) }}", "integer overflow");
  expect_error("{{ (-9223372036854775807 - 1)|abs }}", "integer overflow");
  expect_error("{{ [9223372036854775807, 1]|sum }}", "integer overflow");
  expect_error("{{ 0 ** -1 }}", "negative power");
  expect_error("{{ 10.0 ** 400 }}", "out of range");
  EXPECT_EQ(render("{{ 2 ** -1 }}"), "0.5");
}

TEST(TemplateLimits, FloatToIntConversionsAreChecked) {
  expect_error("{{ 1e300|int }}", "too large for a 64-bit integer");
  expect_error("{{ (1e308 * 10)|int }}", "infinity");
  expect_error("{{ '1e300'|int }}", "too large");
  expect_error("{{ '1e999'|int }}", "infinity");
  EXPECT_EQ(render("{{ 'nan'|int }} {{ (1e308 * 10 - 1e308 * 10)|int(7) }} {{ 'x'|int(5) }}"), "0 7 5");
  expect_error("{{ '%d' % 1e300 }}", "too large");
  EXPECT_EQ(render("{{ 3.9|int }} {{ -3.9|int }} {{ '12'|int }}"), "3 -3 12");
  // Python accepts any precision; huge ones are the value itself.
  EXPECT_EQ(render("{{ 2.5|round(9223372036854775807) }}"), "2.5");
}

TEST(TemplateLimits, StringBuildersStopAtTheLimitBeforeAllocating) {
  // Each of these would take gigabytes or more before the output cap; all fail at once.
  expect_error("{{ 'x'|center(1000000000000) }}", "longer than the limit");
  expect_error("{{ 'x'|center(9223372036854775807) }}", "longer than the limit");
  expect_error("{{ 'a\nb'|indent(1000000000000) }}", "longer than the limit");
  expect_error("{{ 'x' * 1000000000000 }}", "longer than the limit");
  expect_error("{{ 'x' * 9223372036854775807 }}", "longer than the limit");
  expect_error("{{ 'xyz' * 9223372036854775807 }}", "too large");
  expect_error("{{ [1] * 1000000000000 }}", "items is longer than the limit");
  expect_error("{{ '%99999999999d' % 1 }}", "longer than the limit");
  expect_error("{{ '%.99999999999f' % 1.0 }}", "longer than the limit");
  expect_error("{{ {'a': 1}|tojson(indent=1000000000000) }}", "longer than the limit");
  const TemplateLimits lim = small();
  // Repeated doubling: 2^64 characters after 64 rounds.
  expect_error("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
               "{{ ns.s|length }}",
               "longer than the limit", &lim);
  expect_error("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
               "longer than the limit", &lim);
  expect_error("{{ ('a' * 1000)|replace('a', 'b' * 100000) }}", "longer than the limit", &lim);
  expect_error("{{ range(1000)|join('x' * 100000) }}", "longer than the limit", &lim);
  expect_error("{{ '{0}{0}{0}{0}{0}{0}{0}{0}{0}{0}{0}{0}'.format('y' * 100000) }}", "longer than the limit", &lim);
  // Lists double too.
  expect_error("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
               "items is longer than the limit", &lim);
}

TEST(TemplateLimits, DefaultLimitsStopDoublingWithinTheStringLimit) {
  // Without a smaller limit the default (64 MiB per string) applies: the loop ends in an error
  // after a few dozen MB, not after exhausting memory.
  expect_error("{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
               "longer than the limit of 64 MiB");
}

TEST(TemplateLimits, RunawayLoopsAndRecursionEnd) {
  const TemplateLimits lim = small();
  expect_error("{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}", "runs too long", &lim);
  expect_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "call depth exceeded");
  expect_error("{{ range(100000)|unique|list|length }}", "runs too long", &lim);
  expect_error("{{ range(100000000000) }}", "items is longer than the limit", &lim);
  EXPECT_EQ(render("{{ range(9223372036854775800, 9223372036854775807, 5)|list }}"),
            "[9223372036854775800, 9223372036854775805]");
  EXPECT_EQ(render("{{ 'abcdef'[5::9223372036854775807] }}|{{ 'abcdef'[::-9223372036854775807] }}"), "f|f");
}

TEST(TemplateLimits, DeepTemplatesAreParseErrors) {
  // Chains built in loops used to nest the tree without bound and overflow the stack when it was
  // evaluated or freed.
  std::string chain = "{{ 1";
  for (int i = 0; i < 100000; ++i) chain += " ~ 1";
  expect_error(chain + " }}", "nested too deeply");
  std::string attrs = "{{ x";
  for (int i = 0; i < 100000; ++i) attrs += ".a";
  expect_error(attrs + " }}", "nested too deeply");
  std::string filters = "{{ 'x'";
  for (int i = 0; i < 100000; ++i) filters += "|upper";
  expect_error(filters + " }}", "nested too deeply");
  expect_error("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}", "nested too deeply");
  std::string conds = "{{ 1";
  for (int i = 0; i < 100000; ++i) conds += " if 1 else 2";
  expect_error(conds + " }}", "nested too deeply");
}

TEST(TemplateLimits, DeepAndSharedValuesAreBounded) {
  const TemplateLimits lim = small();
  // A list nested 100,000 deep: building and freeing it is fine; printing it is an error.
  EXPECT_EQ(render("{% set ns = namespace(x=1) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}ok"),
            "ok");
  expect_error("{% set ns = namespace(x=1) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}",
               "nests more than");
  // A list of 2^60 leaves held in 60 shared levels: printing or comparing it would never end.
  const std::string dag = "{% set ns = namespace(x=[1], y=[1]) %}{% for i in range(60) %}"
                          "{% set ns.x = [ns.x, ns.x] %}{% set ns.y = [ns.y, ns.y] %}{% endfor %}";
  expect_error(dag + "{{ ns.x }}", "longer than the limit", &lim);
  expect_error(dag + "{{ ns.x == ns.y }}", "builds or copies more than", &lim);
  // A namespace that holds itself: printing it is an error, and the cycle is freed (ASan's leak
  // check runs on this test).
  expect_error("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}", "nests more than");
  EXPECT_EQ(render("{% set ns = namespace() %}{% set ns.me = [ns, {'a': ns}] %}{{ ns.me|length }}"), "2");
}

TEST(TemplateLimits, DeepMessagesAreAnErrorNotACrash) {
  json deep = "x";
  for (int i = 0; i < 100000; ++i) deep = json::array({std::move(deep)});
  // Moved in, not copied: json's copy recurses once per level (and overflowed this test's stack).
  json messages = json::array({json::object()});
  messages[0]["role"] = "user";
  messages[0]["content"] = std::move(deep);
  const std::string r = render("{{ messages[0].content }}", nullptr, messages);
  EXPECT_EQ(r.rfind("ERROR: chat template: ", 0), 0u) << r.substr(0, 200);
  EXPECT_NE(r.find("nests more than"), std::string::npos) << r;
}

TEST(TemplateLimits, ErrorsQuotingTheTemplateStayOneLine) {
  // Found by fuzz_jinja_filters: a parse error quoted a string token holding newlines.
  expect_error("{{ ( si' 1e999\n\n\x01'|int ) }}", "expected ')', got ' 1e999\\n\\n\\x01'");
  expect_error("{{ raise_exception('two\nlines\tand\x01') }}", "two\\nlines\\tand\\x01");
  // A megabyte token is cut, on a character boundary.
  std::string big;
  for (int i = 0; i < 300000; ++i) big += "\xc3\xa9";  // é
  const std::string r = render("{{ (x '" + big + "') }}");
  ASSERT_EQ(r.rfind("ERROR: chat template: ", 0), 0u) << r.substr(0, 300);
  EXPECT_LE(r.size(), 1100u);
  EXPECT_EQ(r.substr(r.size() - 3), "...");
  EXPECT_EQ(r.substr(r.size() - 5, 2), "\xc3\xa9");
}

// Found by fuzz_jinja_filters: repr() of a string ending in a cut UTF-8 sequence read past the
// string's buffer. A template must be UTF-8 (Python text); values from a caller's JSON may not be.
TEST(TemplateLimits, InvalidUtf8IsRefusedOrHandledWithinTheString) {
  expect_error("{{ 'ab\xe6' }}", "not valid UTF-8 (byte 6)");
  for (const std::string bad : {"ab\xe6", "\xf0\x9f", "\xc3", "x\xff\xfe"}) {
    const json messages = json::array({{{"role", "user"}, {"content", bad}}});
    const std::string r = render(
        "{{ [messages[0].content] }}|{{ messages[0].content|upper|title|trim|wordcount }}|"
        "{{ messages[0].content.split() }}|{{ messages[0].content|length }}",
        nullptr, messages);
    EXPECT_EQ(r.rfind("ERROR", 0), std::string::npos) << r;
    EXPECT_NE(r.find(bad), std::string::npos) << r;
  }
}

TEST(TemplateLimits, OutputLimit) {
  TemplateLimits lim = small();
  lim.max_output = 1000;
  expect_error("{% for i in range(2000) %}x{% endfor %}", "rendered text exceeds 1000 bytes", &lim);
}

}  // namespace
