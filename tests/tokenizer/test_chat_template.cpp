// Chat templates: the native engine against Python Jinja2 (Debian's python3-jinja2, configured
// like transformers) on Llama-3.1, Qwen2.5, Qwen3, Mistral and a feature-coverage template,
// crossed with conversations (system, multi-turn, tools, thinking, invalid ones that must raise)
// and extra variables; plus engine unit tests that do not need Python.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "rlhost/tokenizer/chat_template.hpp"
#include "rlhost/tokenizer/tokenizer.hpp"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using rlh::tok::ChatTemplate;

const fs::path kData = fs::path(RLH_TOK_TEST_DATA);

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

bool python_jinja_available(std::string* why) {
  if (!fs::exists("/usr/bin/python3")) {
    *why = "/usr/bin/python3 not found (install python3 and python3-jinja2)";
    return false;
  }
  if (std::system("/usr/bin/python3 -c 'import jinja2' >/dev/null 2>&1") != 0) {
    *why = "python3-jinja2 is not installed for /usr/bin/python3 (apt-get install python3-jinja2)";
    return false;
  }
  return true;
}

std::string render_native(const std::string& tpl, const json& vars) {
  json extra = vars;
  const json messages = extra["messages"];
  const bool agp = extra["add_generation_prompt"];
  extra.erase("messages");
  extra.erase("add_generation_prompt");
  ChatTemplate t(tpl);
  return t.render(messages, agp, extra);
}

TEST(ChatTemplateVsJinja2, ModelTemplatesAndFeatures) {
  std::string why;
  if (!python_jinja_available(&why)) GTEST_SKIP() << why;
  const json messages = json::parse(slurp(kData / "chat" / "messages.json"));
  const json extras = json::parse(slurp(kData / "chat" / "extras.json"));
  json cases = json::array();
  std::vector<std::string> labels;
  for (const char* name : {"llama3", "qwen2_5", "qwen3", "mistral", "mistral_v01", "features"}) {
    const std::string tpl = slurp(kData / "chat" / (std::string(name) + ".jinja"));
    ASSERT_FALSE(tpl.empty()) << name;
    for (auto m = messages.begin(); m != messages.end(); ++m) {
      for (auto x = extras.begin(); x != extras.end(); ++x) {
        for (const bool agp : {false, true}) {
          json vars = x.value();
          vars["messages"] = m.value();
          vars["add_generation_prompt"] = agp;
          vars["bos_token"] = "<s>";
          vars["eos_token"] = "</s>";
          if (!vars.contains("tools")) vars["tools"] = nullptr;  // transformers passes tools=None
          vars["documents"] = nullptr;
          cases.push_back({{"template", tpl}, {"vars", vars}});
          labels.push_back(std::string(name) + " / " + m.key() + " / " + x.key() + (agp ? " / gen" : ""));
        }
      }
    }
  }
  const fs::path dir = fs::temp_directory_path() / ("rlh_chat_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "in.json") << cases.dump();
  const std::string cmd = "/usr/bin/python3 '" + (kData.parent_path() / "tools" / "render_jinja.py").string() + "' '" +
                          (dir / "in.json").string() + "' '" + (dir / "out.json").string() + "'";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const json ref = json::parse(slurp(dir / "out.json"));
  fs::remove_all(dir);
  ASSERT_EQ(ref.size(), cases.size());
  size_t same = 0, both_raise = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    std::string got, err;
    try {
      got = render_native(cases[i]["template"], cases[i]["vars"]);
    } catch (const std::exception& e) {
      err = e.what();
    }
    if (ref[i].contains("error")) {
      EXPECT_FALSE(err.empty()) << labels[i] << ": Jinja2 raised (" << ref[i]["error"] << ") but rlhost rendered:\n" << got;
      if (!err.empty()) ++both_raise;
      continue;
    }
    ASSERT_TRUE(err.empty()) << labels[i] << ": rlhost raised " << err;
    const std::string want = ref[i]["ok"];
    EXPECT_EQ(got, want) << labels[i];
    if (got == want) ++same;
  }
  std::printf("[ chat     ] %zu renders identical to Jinja2, %zu raise in both, of %zu\n", same, both_raise, cases.size());
  EXPECT_GT(both_raise, 0u);  // the invalid conversations must reach raise_exception paths
}

TEST(ChatTemplate, RaiseExceptionMessage) {
  ChatTemplate t("{{ raise_exception('roles must alternate') }}");
  try {
    t.render(json::array(), false);
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "chat template: roles must alternate");
  }
}

TEST(ChatTemplate, SyntaxErrorsNameTheLine) {
  auto msg = [](const std::string& src) {
    try {
      ChatTemplate t(src);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("(parsed)");
  };
  EXPECT_EQ(msg("a\n{% if x %}b"), "chat template: line 2: unexpected end of template, expected one of: elif, else, endif");
  EXPECT_EQ(msg("{{ x | nosuchfilter }}"), "chat template: line 1: no filter named 'nosuchfilter'");
  EXPECT_EQ(msg("\n\n{{ 'abc }}"), "chat template: line 3: unterminated string");
  EXPECT_EQ(msg("{% for %}"), "chat template: line 1: expected a name, got end of statement block");
}

TEST(ChatTemplate, GenerationBlockAndDefaults) {
  ChatTemplate t("{{ bos_token }}{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
                 json{{"bos_token", "<s>"}});
  EXPECT_EQ(t.render(json::array({{{"role", "assistant"}, {"content", "hi"}}}), false), "<s>hi");
  // extra variables override the defaults
  EXPECT_EQ(t.render(json::array(), false, json{{"bos_token", "B"}}), "B");
}

TEST(ChatTemplate, RunawayTemplatesStop) {
  ChatTemplate deep("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
  EXPECT_THROW(deep.render(json::array(), false), std::runtime_error);
  ChatTemplate big("{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}");
#ifdef __SANITIZE_ADDRESS__
  // The default budget of 10M steps takes a minute under AddressSanitizer (7 s without): the same
  // stop at a tenth of it.
  rlh::tok::TemplateLimits tenth = big.limits();
  tenth.max_steps /= 10;
  big.set_limits(tenth);
#endif
  EXPECT_THROW(big.render(json::array(), false), std::runtime_error);
  std::string nested(5000, '(');
  EXPECT_THROW(ChatTemplate("{{ " + nested + " }}"), std::runtime_error);
}

TEST(ChatTemplate, FromTokenizerConfig) {
  auto tok = rlh::tok::Tokenizer::from_file(fs::path(RLH_DEFAULT_FIXTURES) / "tokenizer-llama3" / "tokenizer.json");
  tok.apply_config_json(R"({"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"},
                            "chat_template": [{"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"},
                                              {"name": "tool_use", "template": "T{{ tools | length }}"}]})");
  auto t = tok.chat_template();
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->render(json::array({{{"role", "user"}, {"content", "x"}}}), false), "<|begin_of_text|>x<|eot_id|>");
  EXPECT_EQ(tok.chat_template("tool_use")->render(json::array(), false, json{{"tools", json::array({1, 2})}}), "T2");
  EXPECT_THROW(tok.chat_template("nope"), std::runtime_error);
  EXPECT_EQ(tok.bos_id(), tok.token_to_id("<|begin_of_text|>"));
  EXPECT_EQ(tok.eos_id(), tok.token_to_id("<|eot_id|>"));
  EXPECT_THROW(tok.apply_config_json(R"({"chat_template": 5})"), std::runtime_error);
}

}  // namespace
