// The config tree: NeMo-RL YAML conventions and their errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "config.hpp"

namespace fs = std::filesystem;
using rlh::host::Config;
using rlh::host::ConfigError;
using rlh::host::Json;

namespace {

class ConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("rlh_config_test_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path write(const std::string& name, const std::string& text) {
    fs::path p = dir_ / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
    return p;
  }
  // Expects `fn` to throw ConfigError whose message contains `needle`.
  template <typename Fn>
  void expect_error(Fn fn, const std::string& needle) {
    try {
      fn();
      FAIL() << "expected an error containing '" << needle << "'";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "not one line: " << e.what();
    }
  }
  fs::path dir_;
};

TEST_F(ConfigTest, ScalarsAreTypedLikeYaml) {
  Config c;
  c.load_text("a: 1\nb: 1.5\nc: 5.0e-6\nd: true\ne: null\nf: \"1\"\ng: text\nh: [1, 2]\ni: 1e-8\n", "t");
  Json r = c.resolved();
  EXPECT_TRUE(r["a"].is_number_integer());
  EXPECT_DOUBLE_EQ(r["b"].get<double>(), 1.5);
  EXPECT_DOUBLE_EQ(r["c"].get<double>(), 5.0e-6);
  EXPECT_DOUBLE_EQ(r["i"].get<double>(), 1e-8);
  EXPECT_EQ(r["d"], true);
  EXPECT_TRUE(r["e"].is_null());
  EXPECT_TRUE(r["f"].is_string());
  EXPECT_EQ(r["g"], "text");
  EXPECT_EQ(r["h"].size(), 2u);
}

TEST_F(ConfigTest, DefaultsChainMergesDeeplyRelativeToFile) {
  write("base/root.yaml", "a: {x: 1, y: 2}\nlist: [1, 2, 3]\nkeep: k\n");
  write("base/mid.yaml", "defaults: root.yaml\na: {y: 20, z: 30}\nlist: [9]\n");
  fs::path top = write("top.yaml", "defaults: base/mid.yaml\na: {x: 100}\n");
  Config c;
  c.load_file(top);
  Json r = c.resolved();
  EXPECT_EQ(r["a"]["x"], 100);
  EXPECT_EQ(r["a"]["y"], 20);
  EXPECT_EQ(r["a"]["z"], 30);
  EXPECT_EQ(r["list"], Json::array({9}));  // lists are replaced, not merged
  EXPECT_EQ(r["keep"], "k");
  EXPECT_FALSE(r.contains("defaults"));
  EXPECT_NE(c.origin_of("a.y").find("mid.yaml"), std::string::npos);
  EXPECT_NE(c.origin_of("keep").find("root.yaml"), std::string::npos);
  EXPECT_NE(c.origin_of("a.x").find("top.yaml"), std::string::npos);
}

TEST_F(ConfigTest, DefaultsListAppliesInOrder) {
  write("p1.yaml", "a: 1\nb: 1\n");
  write("p2.yaml", "b: 2\n");
  fs::path top = write("top.yaml", "defaults: [p1.yaml, p2.yaml]\nc: 3\n");
  Config c;
  c.load_file(top);
  Json r = c.resolved();
  EXPECT_EQ(r["a"], 1);
  EXPECT_EQ(r["b"], 2);
  EXPECT_EQ(r["c"], 3);
}

TEST_F(ConfigTest, DefaultsCycleIsAnError) {
  write("a.yaml", "defaults: b.yaml\n");
  write("b.yaml", "defaults: a.yaml\n");
  Config c;
  expect_error([&] { c.load_file(dir_ / "a.yaml"); }, "defaults cycle");
  write("self.yaml", "defaults: self.yaml\n");
  expect_error([&] { c.load_file(dir_ / "self.yaml"); }, "defaults cycle");
}

TEST_F(ConfigTest, FileErrorsNameTheFile) {
  Config c;
  expect_error([&] { c.load_file(dir_ / "missing.yaml"); }, "missing.yaml' does not exist");
  write("bad.yaml", "a: [1, 2\n");
  expect_error([&] { c.load_file(dir_ / "bad.yaml"); }, "bad.yaml: line");
  write("dup.yaml", "a: 1\na: 2\n");
  expect_error([&] { c.load_file(dir_ / "dup.yaml"); }, "duplicate key 'a'");
  write("list.yaml", "- 1\n- 2\n");
  expect_error([&] { c.load_file(dir_ / "list.yaml"); }, "top level must be a mapping");
  write("missingparent.yaml", "defaults: nope.yaml\n");
  expect_error([&] { c.load_file(dir_ / "missingparent.yaml"); }, "nope.yaml' does not exist");
}

TEST_F(ConfigTest, InterpolationAndResolvers) {
  Config c;
  c.load_text(
      "policy:\n  seq: 512\n  mb: 4\n  tokens: ${mul:${policy.seq}, ${policy.mb}}\n  rel: ${.seq}\n"
      "  name: m\n  msg: \"model ${policy.name} with ${policy.seq}\"\n"
      "  up: ${..top}\ntop: 7\nmath:\n  a: ${add:1,2}\n  d: ${div:10,4}\n  di: ${div:8,4}\n  mx: ${max:3,9}\n  mn: ${min:3,9}\n"
      "  f: ${mul:0.5,4}\n",
      "t");
  Json r = c.resolved();
  EXPECT_EQ(r["policy"]["tokens"], 2048);
  EXPECT_TRUE(r["policy"]["tokens"].is_number_integer());
  EXPECT_EQ(r["policy"]["rel"], 512);
  EXPECT_EQ(r["policy"]["msg"], "model m with 512");
  EXPECT_EQ(r["policy"]["up"], 7);
  EXPECT_EQ(r["math"]["a"], 3);
  EXPECT_DOUBLE_EQ(r["math"]["d"].get<double>(), 2.5);
  // NeMo-RL's div is Python's true division: a float even when it divides evenly.
  EXPECT_TRUE(r["math"]["di"].is_number_float());
  EXPECT_DOUBLE_EQ(r["math"]["di"].get<double>(), 2.0);
  EXPECT_EQ(r["math"]["mx"], 9);
  EXPECT_EQ(r["math"]["mn"], 3);
  EXPECT_DOUBLE_EQ(r["math"]["f"].get<double>(), 2.0);
}

// OmegaConf's oc.env, as NeMo-RL's configs use it ("${oc.env:HF_HOME}/data.jsonl").
TEST_F(ConfigTest, OcEnvResolver) {
  ::setenv("RLH_CONFIG_TEST_VAR", "/hf", 1);
  ::unsetenv("RLH_CONFIG_TEST_UNSET");
  Config c;
  c.load_text(
      "path: ${oc.env:RLH_CONFIG_TEST_VAR}/data.jsonl\nwhole: ${oc.env:RLH_CONFIG_TEST_VAR}\n"
      "dflt: ${oc.env:RLH_CONFIG_TEST_UNSET,/tmp/x}\nquoted: ${oc.env:RLH_CONFIG_TEST_UNSET,'10'}\n"
      "none: ${oc.env:RLH_CONFIG_TEST_UNSET,null}\nset_wins: ${oc.env:RLH_CONFIG_TEST_VAR,other}\n"
      "num: ${oc.env:RLH_CONFIG_TEST_UNSET,12}\n",
      "t");
  Json r = c.resolved();
  EXPECT_EQ(r["path"], "/hf/data.jsonl");
  EXPECT_EQ(r["whole"], "/hf");
  EXPECT_EQ(r["dflt"], "/tmp/x");
  EXPECT_EQ(r["quoted"], "10");  // a string, as OmegaConf returns
  EXPECT_TRUE(r["none"].is_null());
  EXPECT_EQ(r["set_wins"], "/hf");
  EXPECT_EQ(r["num"], "12");  // env values and defaults are strings
  c.load_text("p: ${oc.env:RLH_CONFIG_TEST_UNSET}\n", "t");
  expect_error([&] { c.resolved(); }, "environment variable 'RLH_CONFIG_TEST_UNSET' is not set");
  c.load_text("p: ${oc.env:}\n", "t");
  expect_error([&] { c.resolved(); }, "takes a variable name");
  ::unsetenv("RLH_CONFIG_TEST_VAR");
}

// YAML merge keys (`<<: *anchor`, NeMo-RL's distillation configs): own keys win, then the
// merged mappings in order; nested merges work.
TEST_F(ConfigTest, YamlMergeKeys) {
  Config c;
  c.load_text(
      "base: &B {a: 1, b: 2, inner: &I {x: 1, y: 2}}\nother: &O {b: 20, c: 30}\n"
      "one:\n  <<: *B\n  a: 10\n  inner:\n    <<: *I\n    y: 5\n"
      "two:\n  <<: [*O, *B]\n",
      "t");
  Json r = c.resolved();
  EXPECT_EQ(r["one"]["a"], 10);
  EXPECT_EQ(r["one"]["b"], 2);
  EXPECT_EQ(r["one"]["inner"]["x"], 1);
  EXPECT_EQ(r["one"]["inner"]["y"], 5);
  EXPECT_FALSE(r["one"].contains("<<"));
  EXPECT_EQ(r["two"]["b"], 20);  // the first merged mapping wins
  EXPECT_EQ(r["two"]["a"], 1);
  EXPECT_EQ(r["two"]["c"], 30);
  expect_error([&] { c.load_text("a:\n  <<: 3\n", "t"); }, "'<<' merges mappings only");
  c.load_text("a:\n  \"<<\": 3\n", "t");  // quoted: an ordinary key
  EXPECT_EQ(c.resolved()["a"]["<<"], 3);
}

// NeMo-RL's `_override_: true` replaces the parent's mapping instead of merging into it.
TEST_F(ConfigTest, OverrideMarkerReplacesTheParentsMapping) {
  write("parent.yaml", "data: {train: {path: a}, validation: {path: b}}\npolicy: {cfg: {x: 1, y: 2}}\n");
  fs::path top = write("top.yaml",
                       "defaults: parent.yaml\ndata:\n  _override_: true\n  train: {path: c}\n"
                       "policy:\n  cfg:\n    _override_: true\n    x: 3\n");
  Config c;
  c.load_file(top);
  Json r = c.resolved();
  EXPECT_EQ(r["data"], Json::parse(R"({"train": {"path": "c"}})"));
  EXPECT_EQ(r["policy"]["cfg"], Json::parse(R"({"x": 3})"));
  // A false marker merges as usual; a marker without a parent is just dropped.
  write("top2.yaml", "defaults: parent.yaml\ndata:\n  _override_: false\n  train: {path: c}\n");
  c.load_file(dir_ / "top2.yaml");
  r = c.resolved();
  EXPECT_EQ(r["data"]["validation"]["path"], "b");
  EXPECT_FALSE(r["data"].contains("_override_"));
  c.load_text("s:\n  _override_: true\n  k: 1\n", "t");
  EXPECT_EQ(c.resolved()["s"], Json::parse(R"({"k": 1})"));
}

TEST_F(ConfigTest, InterpolationErrors) {
  Config c;
  c.load_text("a: ${b}\nb: ${a}\n", "t");
  expect_error([&] { c.resolved(); }, "interpolation cycle");
  c.load_text("a: ${a}\n", "t");
  expect_error([&] { c.resolved(); }, "interpolation cycle");
  c.load_text("a: ${nope.x}\n", "t");
  expect_error([&] { c.resolved(); }, "missing key 'nope.x'");
  c.load_text("a: ${pow:1,2}\n", "t");
  expect_error([&] { c.resolved(); }, "unknown resolver 'pow'");
  c.load_text("a: ${mul:x,2}\n", "t");
  expect_error([&] { c.resolved(); }, "needs numbers");
  c.load_text("a: ${div:1,0}\n", "t");
  expect_error([&] { c.resolved(); }, "division by zero");
  c.load_text("a: ${b\nb: 1\n", "t");
  expect_error([&] { c.resolved(); }, "unterminated");
}

TEST_F(ConfigTest, OverridesFollowHydraRules) {
  Config c;
  c.load_text("grpo: {n: 32, lr: 1.0e-6, on: true, name: x, l: [1]}\n", "t");
  c.apply_override("grpo.n=64");
  c.apply_override("grpo.lr=2");  // an int where a float was: accepted as float
  c.apply_override("grpo.name=5");  // a number where a string was: kept as text
  c.apply_override("++grpo.new=3");
  c.apply_override("++deep.new.key=[1, 2]");
  c.apply_override("+added=hi");
  c.apply_override("~grpo.l");
  Json r = c.resolved();
  EXPECT_EQ(r["grpo"]["n"], 64);
  EXPECT_TRUE(r["grpo"]["lr"].is_number_float());
  EXPECT_EQ(r["grpo"]["name"], "5");
  EXPECT_EQ(r["grpo"]["new"], 3);
  EXPECT_EQ(r["deep"]["new"]["key"], Json::array({1, 2}));
  EXPECT_EQ(r["added"], "hi");
  EXPECT_FALSE(r["grpo"].contains("l"));
  EXPECT_EQ(c.origin_of("grpo.n"), "command line");
  // Overriding an interpolated key keeps the override's type.
  Config d;
  d.load_text("a: 2\nb: ${mul:${a},4}\n", "t");
  d.apply_override("b=128");
  EXPECT_TRUE(d.resolved()["b"].is_number_integer());
}

TEST_F(ConfigTest, OverrideErrors) {
  Config c;
  c.load_text("grpo: {n: 32, on: true, sub: {a: 1}}\n", "t");
  expect_error([&] { c.apply_override("grpo.m=1"); }, "use ++grpo.m=1 to add it");
  expect_error([&] { c.apply_override("grpo.n=abc"); }, "expects an integer");
  expect_error([&] { c.apply_override("grpo.on=3"); }, "expects a boolean");
  expect_error([&] { c.apply_override("grpo.sub=3"); }, "expects a mapping");
  expect_error([&] { c.apply_override("+grpo.n=1"); }, "already exists");
  expect_error([&] { c.apply_override("grpo.n"); }, "expected key=value");
  expect_error([&] { c.apply_override("grpo..n=1"); }, "empty segment");
  expect_error([&] { c.apply_override("=1"); }, "empty key");
  expect_error([&] { c.apply_override("~grpo.zz"); }, "not in the config");
  expect_error([&] { c.apply_override("grpo.n=[1, 2"); }, "invalid YAML");
}

TEST_F(ConfigTest, HostileDocumentsAreBounded) {
  Config c;
  std::string deep(5000, '[');
  expect_error([&] { c.load_text("a: " + deep, "deep"); }, "");
  // Nested maps deeper than the bound.
  std::string nested;
  for (int i = 0; i < 300; ++i) nested += std::string(i * 1, ' ') + "k:\n";
  EXPECT_THROW(c.load_text(nested, "nested"), ConfigError);
  // Billion laughs.
  std::string bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n";
  char prev = 'a';
  for (char n = 'b'; n <= 'j'; ++n) {
    bomb += std::string(1, n) + ": &" + n + " [";
    for (int i = 0; i < 10; ++i) bomb += std::string(i ? ", " : "") + "*" + prev;
    bomb += "]\n";
    prev = n;
  }
  expect_error([&] { c.load_text(bomb, "bomb"); }, "alias bomb");
}

// Configs are UTF-8: a bad byte in a value, a key, an escape or an override is an error at
// load time naming where (the fuzzer found one surfacing as an uncaught JSON serialisation
// error inside an interpolation; its input is in tests/fuzz/corpus/config).
TEST_F(ConfigTest, TextThatIsNotUtf8IsAnError) {
  Config c;
  expect_error([&] { c.load_text("a: 1\nb: x\xff\xffy\n", "bad.yaml"); }, "bad.yaml: line 2: a value is not valid UTF-8");
  expect_error([&] { c.load_text("a:\n  n\xc0\xaf: 32\n", "key.yaml"); }, "key.yaml: line 2: a key is not valid UTF-8");
  expect_error([&] { c.load_text("a: \"\\uD800\"\n", "esc.yaml"); }, "esc.yaml: line 1, column 11: invalid YAML: invalid unicode");
  expect_error([&] { c.load_text("g:\n  n\xff\xff\xff\xff: 32\npolicy:\n  x: ul:${g}\n", "interp.yaml"); },
               "a key is not valid UTF-8");
  c.load_text("a: {s: \"caf\xc3\xa9 \xf0\x9f\x99\x82\"}\n", "ok.yaml");  // valid multi-byte text
  EXPECT_EQ(c.resolved()["a"]["s"], "caf\xc3\xa9 \xf0\x9f\x99\x82");
  expect_error([&] { c.apply_override("a.s=\xe2\x82"); }, "override: byte 5 is not valid UTF-8");
}

TEST_F(ConfigTest, YamlRoundTrip) {
  Config c;
  c.load_text("a: {b: \"1\", c: 2, d: [x, 'true'], e: null, f: 1.5}\n", "t");
  Json r = c.resolved();
  Json back = rlh::host::parse_yaml(rlh::host::to_yaml(r), "printed");
  EXPECT_EQ(back, r);
}

TEST(EditDistance, Basics) {
  EXPECT_EQ(rlh::host::edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(rlh::host::edit_distance("", "abc"), 3u);
  EXPECT_EQ(rlh::host::edit_distance("same", "same"), 0u);
}

}  // namespace
