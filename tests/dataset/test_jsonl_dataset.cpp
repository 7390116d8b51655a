// The jsonl dataset: rows, keys, prompt files, the seeded split, streaming over chunk
// boundaries, one-line errors naming file:line or the key, and the plugin through librlhost.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "rlhost/dataset.h"
#include "rlhost/dataset_jsonl/jsonl_dataset.hpp"
#include "rlhost/host.h"
#include "rlhost/sdk/status.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using rlh::dataset_jsonl::JsonlDataset;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string t = (fs::temp_directory_path() / "rlh_jsonl_XXXXXX").string();
    if (::mkdtemp(t.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = t;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(path / name, std::ios::binary) << text;
    return (path / name).string();
  }
};

// The error message of constructing a dataset from `cfg`, or "no error".
std::string error_of(const json& cfg) {
  try {
    JsonlDataset d(cfg);
  } catch (const rlh::sdk::Error& e) {
    return e.what();
  }
  return "no error";
}

std::vector<json> all_rows(const JsonlDataset& d) {
  std::vector<json> rows;
  for (int64_t i = 0; i < d.size(); ++i) rows.push_back(json::parse(d.row_json(i)));
  return rows;
}

}  // namespace

TEST(JsonlDataset, RowsKeepTheirFieldsAndGainPromptAndAnswer) {
  TempDir t;
  const std::string f = t.write("data.jsonl",
                                "{\"input\": \"2+2?\", \"output\": \"4\", \"id\": 7}\n"
                                "\n"
                                "{\"input\": \"half?\", \"output\": 0.5, \"tags\": [\"a\"]}\n");
  JsonlDataset d(json{{"data_path", f}});
  ASSERT_EQ(d.size(), 2);
  auto rows = all_rows(d);
  EXPECT_EQ(rows[0]["id"], 7);
  EXPECT_EQ(rows[0]["prompt"], "2+2?");
  EXPECT_EQ(rows[0]["answer"], "4");
  EXPECT_EQ(rows[1]["answer"], "0.5");  // numbers become strings, as NeMo-RL's str(...)
  EXPECT_EQ(rows[1]["tags"], json::array({"a"}));
  EXPECT_FALSE(rows[0].contains("system_prompt"));
  // The line's own key order is kept, resolved fields come last.
  EXPECT_EQ(d.row_json(0), R"({"input":"2+2?","output":"4","id":7,"prompt":"2+2?","answer":"4"})");
}

TEST(JsonlDataset, NemoRlDataSectionWithPromptFiles) {
  TempDir t;
  const std::string f = t.write("math.jsonl",
                                "{\"problem\": \"1+1\", \"expected_answer\": \"2\"}\n"
                                "{\"problem\": \"x{y}\", \"expected_answer\": 3}\n");
  // NeMo-RL's examples/prompts/cot.txt style: {{}} is a literal brace pair, {} the problem.
  const std::string prompt = t.write("cot.txt", "Think step-by-step. Put your answer inside \\boxed{{}}:\n{}\n");
  const std::string sys = t.write("sys.txt", "You are a careful solver.");
  json data = {{"train", {{"data_path", f}, {"input_key", "problem"}, {"output_key", "expected_answer"}}},
               {"default", {{"prompt_file", prompt}, {"system_prompt_file", sys}}},
               {"validation", nullptr},
               {"split", "train"}};
  JsonlDataset d(data);
  auto rows = all_rows(d);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0]["prompt"], "Think step-by-step. Put your answer inside \\boxed{}:\n1+1\n");
  EXPECT_EQ(rows[1]["prompt"], "Think step-by-step. Put your answer inside \\boxed{}:\nx{y}\n");
  EXPECT_EQ(rows[1]["answer"], "3");
  EXPECT_EQ(rows[0]["system_prompt"], "You are a careful solver.");
  EXPECT_EQ(rows[0]["problem"], "1+1");

  // A dataset's own null drops the default's file.
  data["train"]["system_prompt_file"] = nullptr;
  EXPECT_FALSE(json::parse(JsonlDataset(data).row_json(0)).contains("system_prompt"));
  // The older top-level data.prompt_file works too.
  json legacy = {{"train", data["train"]}, {"prompt_file", prompt}};
  EXPECT_EQ(json::parse(JsonlDataset(legacy).row_json(0))["prompt"], rows[0]["prompt"]);
}

TEST(JsonlDataset, SeededSplitIsDeterministicDisjointAndComplete) {
  TempDir t;
  std::string text;
  for (int i = 0; i < 100; ++i) text += "{\"input\": \"q" + std::to_string(i) + "\", \"output\": \"" + std::to_string(i) + "\"}\n";
  const std::string f = t.write("d.jsonl", text);
  auto answers = [&](const json& cfg) {
    std::vector<std::string> out;
    for (const auto& r : all_rows(JsonlDataset(cfg))) out.push_back(r["answer"]);
    return out;
  };
  json train = {{"train", {{"data_path", f}, {"split_validation_size", 0.05}, {"seed", 42}}}, {"split", "train"}};
  json val = train;
  val["split"] = "validation";
  const auto tr = answers(train), va = answers(val);
  EXPECT_EQ(va.size(), 5u);  // ceil(0.05 * 100)
  EXPECT_EQ(tr.size(), 95u);
  std::set<std::string> all(tr.begin(), tr.end());
  for (const auto& a : va) EXPECT_TRUE(all.insert(a).second) << a << " is in both splits";
  EXPECT_EQ(all.size(), 100u);
  EXPECT_EQ(answers(val), va);  // same seed, same rows
  json other = val;
  other["train"]["seed"] = 7;
  EXPECT_NE(answers(other), va);
  // Each side keeps file order.
  EXPECT_TRUE(std::is_sorted(tr.begin(), tr.end(), [](const std::string& a, const std::string& b) { return std::stoi(a) < std::stoi(b); }));
  // A count instead of a fraction; 0.0 < size < 1 rounds up.
  json count = val;
  count["train"]["split_validation_size"] = 12;
  EXPECT_EQ(answers(count).size(), 12u);
  count["train"]["split_validation_size"] = 0.001;
  EXPECT_EQ(answers(count).size(), 1u);
  // A separate validation file wins over the held-out rows.
  const std::string vf = t.write("v.jsonl", "{\"q\": \"only\", \"a\": \"1\"}\n");
  json sep = val;
  sep["validation"] = {{"data_path", vf}, {"input_key", "q"}, {"output_key", "a"}};
  EXPECT_EQ(answers(sep), std::vector<std::string>{"1"});
}

TEST(JsonlDataset, StreamsLongLinesAcrossChunksCrlfBomAndNoFinalNewline) {
  TempDir t;
  std::string text = "\xEF\xBB\xBF";  // UTF-8 BOM
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    std::string input = "row " + std::to_string(i);
    if (i == 777) input = std::string(5 << 20, 'z');  // a 5 MiB line spans the 4 MiB read chunks
    text += "{\"input\": \"" + input + "\", \"output\": \"" + std::to_string(i) + "\"}";
    text += (i % 3 == 0) ? "\r\n" : "\n";
    if (i % 1000 == 0) text += "   \n";  // blank lines are skipped but still counted
  }
  text += "{\"input\": \"last\", \"output\": \"end\"}";  // no final newline
  const std::string f = t.write("big.jsonl", text);
  JsonlDataset d(json{{"data_path", f}});
  ASSERT_EQ(d.size(), n + 1);
  EXPECT_EQ(json::parse(d.row_json(0))["prompt"], "row 0");
  EXPECT_EQ(json::parse(d.row_json(777))["prompt"].get<std::string>().size(), size_t{5 << 20});
  EXPECT_EQ(json::parse(d.row_json(778))["answer"], "778");
  EXPECT_EQ(json::parse(d.row_json(12345))["prompt"], "row 12345");
  EXPECT_EQ(json::parse(d.row_json(n))["answer"], "end");

  // Concurrent reads agree with sequential ones.
  std::vector<std::string> a(200), b(200);
  std::thread t1([&] { for (int i = 0; i < 200; ++i) a[i] = d.row_json(i * 97); });
  std::thread t2([&] { for (int i = 0; i < 200; ++i) b[i] = d.row_json(i * 97); });
  t1.join();
  t2.join();
  EXPECT_EQ(a, b);
  EXPECT_EQ(a[3], d.row_json(3 * 97));
}

// NeMo-RL's ResponseDataset takes a file with "messages" as conversations (SFT on chat data):
// the first row decides, every row must be one, the prompt file formats the first user message.
TEST(JsonlDataset, MessagesFilesAreConversations) {
  TempDir t;
  const std::string conv =
      "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \"2+2?\"}, "
      "{\"role\": \"assistant\", \"content\": \"4\"}], \"id\": 1}\n";
  const std::string two =
      "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"hello\"}, "
      "{\"role\": \"user\", \"content\": \"x{y}\"}, {\"role\": \"assistant\", \"content\": \"z\"}]}\n";
  const std::string f = t.write("chat.jsonl", conv + two);
  JsonlDataset d(json{{"data_path", f}});
  auto rows = all_rows(d);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0]["messages"].size(), 3u);
  EXPECT_EQ(rows[0]["messages"][1]["content"], "2+2?");
  EXPECT_EQ(rows[0]["id"], 1);
  EXPECT_FALSE(rows[0].contains("prompt"));
  const std::string prompt = t.write("p.txt", "Q: {}");
  rows = all_rows(JsonlDataset(json{{"data_path", f}, {"prompt_file", prompt}}));
  EXPECT_EQ(rows[0]["messages"][1]["content"], "Q: 2+2?");
  EXPECT_EQ(rows[1]["messages"][0]["content"], "Q: hi");    // the first user message only
  EXPECT_EQ(rows[1]["messages"][2]["content"], "x{y}");
  // Bad rows: one line naming file and line.
  auto err = [&](const std::string& text, json extra = json::object()) {
    json cfg = {{"data_path", t.write("bad.jsonl", text)}};
    for (auto& [k, v] : extra.items()) cfg[k] = v;
    const std::string e = error_of(cfg);
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
    return e.substr(e.find("bad.jsonl"));
  };
  EXPECT_EQ(err(conv + "{\"input\": \"a\", \"output\": \"b\"}\n"),
            "bad.jsonl:2: missing key 'messages' (the file's first row has it: every row of a conversation file must)");
  EXPECT_EQ(err("{\"messages\": []}\n"), "bad.jsonl:1: 'messages' must be a non-empty list of {role, content} objects");
  EXPECT_EQ(err("{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"a\"}]}]}\n"),
            "bad.jsonl:1: messages[0].content must be a string (multimodal content lists are not supported)");
  EXPECT_EQ(err("{\"messages\": [{\"content\": \"a\"}]}\n"), "bad.jsonl:1: messages[0].role must be a string");
  EXPECT_EQ(err("{\"messages\": [{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{}]}]}\n"),
            "bad.jsonl:1: messages[0]: tool calls are not supported in training conversations");
  const std::string sys = error_of({{"data_path", f}, {"system_prompt_file", t.write("s.txt", "sys")}});
  EXPECT_NE(sys.find("system_prompt_file: not used with a file of 'messages' conversations"), std::string::npos) << sys;
  std::string huge = "{\"messages\": [";
  for (int i = 0; i < 1025; ++i) huge += std::string(i ? ", " : "") + "{\"role\": \"user\", \"content\": \"a\"}";
  EXPECT_EQ(err(huge + "]}\n"), "bad.jsonl:1: 'messages' has 1025 messages, more than the 1024 a conversation row takes");
  // A file of input/output rows whose later row has "messages" stays an input/output file.
  EXPECT_EQ(err("{\"input\": \"a\", \"output\": \"b\"}\n" + conv), "bad.jsonl:2: missing key 'input' (dataset.input_key)");
}

TEST(JsonlDataset, BadLinesAreOneLineErrorsNamingFileAndLine) {
  TempDir t;
  auto err_for = [&](const std::string& text, json extra = json::object()) {
    const std::string f = t.write("data.jsonl", text);
    json cfg = {{"train", {{"data_path", f}, {"input_key", "problem"}, {"output_key", "expected_answer"}}}};
    for (auto& [k, v] : extra.items()) cfg["train"][k] = v;
    std::string e = error_of(cfg);
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
    return e.substr(e.find("data.jsonl"));
  };
  const std::string ok = "{\"problem\": \"p\", \"expected_answer\": \"a\"}\n";
  // nlohmann's own wording sits between our prefix and the column.
  auto shaped = [](const std::string& e, const std::string& prefix, const std::string& suffix) {
    return e.rfind(prefix, 0) == 0 && e.size() >= suffix.size() && e.compare(e.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  std::string e = err_for(ok + ok + "{\"problem\": \"p\", \"expected_answer\": }\n");
  EXPECT_TRUE(shaped(e, "data.jsonl:3: invalid JSON: syntax error while parsing value", "(column 37)")) << e;
  EXPECT_EQ(err_for(ok + "{\"expected_answer\": \"a\"}\n"), "data.jsonl:2: missing key 'problem' (data.train.input_key)");
  EXPECT_EQ(err_for(ok + "\n\n{\"problem\": \"p\"}\n"),
            "data.jsonl:4: missing key 'expected_answer' (data.train.output_key)");
  EXPECT_EQ(err_for("{\"problem\": 3, \"expected_answer\": \"a\"}\n"),
            "data.jsonl:1: key 'problem' (data.train.input_key) must be a string, got a number");
  EXPECT_EQ(err_for("{\"problem\": \"p\", \"expected_answer\": [1]}\n"),
            "data.jsonl:1: key 'expected_answer' (data.train.output_key) must be a string or number, got an object, "
            "array, boolean or null");
  EXPECT_EQ(err_for("[{\"problem\": \"p\", \"expected_answer\": \"a\"}]\n"),
            "data.jsonl:1: the line is an array, not a JSON object (JSONL holds one object per line)");
  EXPECT_EQ(err_for(ok + "\"just a string\"\n"),
            "data.jsonl:2: the line is a string, not a JSON object (JSONL holds one object per line)");
  e = err_for(ok + "{\"problem\": \"p\", \"expected_answer\": \"a\"} trailing\n");
  EXPECT_TRUE(shaped(e, "data.jsonl:2: invalid JSON: ", "expected end of input (column 44)")) << e;
  e = err_for("{\"problem\": \"p\xff\", \"expected_answer\": \"a\"}\n");
  EXPECT_TRUE(shaped(e, "data.jsonl:1: invalid JSON: ", ")")) << e;  // ill-formed UTF-8
  // Keys nested deeper than the top level do not count.
  EXPECT_EQ(err_for("{\"x\": {\"problem\": \"p\"}, \"expected_answer\": \"a\"}\n"),
            "data.jsonl:1: missing key 'problem' (data.train.input_key)");
  EXPECT_EQ(err_for("\n\n"), "data.jsonl: no rows (data.train.data_path)");
}

// NeMo-RL's preference datasets (DPO, RM): both layouts come out as context + completions with the
// preferred completion first.
TEST(JsonlDataset, PreferenceRowsInBothLayouts) {
  TempDir t;
  const std::string bin = t.write("pairs.jsonl",
                                  "{\"q\": \"2+2?\", \"good\": \"4\", \"bad\": \"5\", \"id\": 1}\n"
                                  "{\"q\": [{\"role\": \"system\", \"content\": \"s\"}, {\"role\": \"user\", \"content\": \"u\"}],"
                                  " \"good\": \"a\", \"bad\": [{\"role\": \"assistant\", \"content\": \"b\"}]}\n");
  JsonlDataset d(json{{"train", {{"data_path", bin}, {"prompt_key", "q"}}},
                      {"default", {{"dataset_name", "BinaryPreferenceDataset"}, {"chosen_key", "good"}, {"rejected_key", "bad"}}}});
  ASSERT_EQ(d.size(), 2);
  auto rows = all_rows(d);
  EXPECT_EQ(rows[0]["id"], 1);
  EXPECT_EQ(rows[0]["context"], json::parse(R"([{"role":"user","content":"2+2?"}])"));
  EXPECT_EQ(rows[0]["completions"], json::parse(R"([{"rank":0,"completion":[{"role":"assistant","content":"4"}]},
                                                    {"rank":1,"completion":[{"role":"assistant","content":"5"}]}])"));
  EXPECT_EQ(rows[1]["context"].size(), 2u);
  EXPECT_EQ(rows[1]["completions"][1]["completion"][0]["content"], "b");
  // PreferenceDataset: the lower rank is chosen, whatever the order in the line.
  const std::string ranked = t.write("ranked.jsonl",
                                     "{\"context\": [{\"role\": \"user\", \"content\": \"q\"}], \"completions\": ["
                                     "{\"rank\": 3, \"completion\": [{\"role\": \"assistant\", \"content\": \"worse\"}]},"
                                     "{\"rank\": 1, \"completion\": [{\"role\": \"assistant\", \"content\": \"better\"}]}]}\n");
  JsonlDataset r(json{{"data_path", ranked}, {"dataset_name", "PreferenceDataset"}});
  const json row = json::parse(r.row_json(0));
  EXPECT_EQ(row["completions"][0]["completion"][0]["content"], "better");
  EXPECT_EQ(row["completions"][1]["completion"][0]["content"], "worse");
}

TEST(JsonlDataset, BadPreferenceRowsAreOneLineErrorsNamingFileAndLine) {
  TempDir t;
  auto err_for = [&](const std::string& text, const char* name = "BinaryPreferenceDataset") {
    const std::string f = t.write("prefs.jsonl", text);
    std::string e = error_of(json{{"train", {{"data_path", f}, {"dataset_name", name}}}});
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
    return e.substr(e.find("prefs.jsonl"));
  };
  const std::string ok = "{\"prompt\": \"p\", \"chosen\": \"a\", \"rejected\": \"b\"}\n";
  EXPECT_EQ(err_for(ok + "{\"prompt\": \"p\", \"chosen\": \"a\"}\n"),
            "prefs.jsonl:2: missing key 'rejected' (data.train.rejected_key)");
  EXPECT_EQ(err_for(ok + ok + "{\"prompt\": \"p\", \"chosen\": 4, \"rejected\": \"b\"}\n"),
            "prefs.jsonl:3: 'chosen' must be a string or a list of messages, got a number");
  EXPECT_EQ(err_for("{\"prompt\": [{\"role\": \"user\"}], \"chosen\": \"a\", \"rejected\": \"b\"}\n"),
            "prefs.jsonl:1: 'prompt'[0].content must be a string");
  EXPECT_EQ(err_for("{\"prompt\": [], \"chosen\": \"a\", \"rejected\": \"b\"}\n"),
            "prefs.jsonl:1: 'prompt' is an empty list of messages");
  EXPECT_EQ(err_for("[1]\n"), "prefs.jsonl:1: the line is an array, not a JSON object (JSONL holds one object per line)");
  const std::string msg = "[{\"role\": \"assistant\", \"content\": \"x\"}]";
  EXPECT_EQ(err_for("{\"context\": " + msg + ", \"completions\": [{\"rank\": 0, \"completion\": " + msg +
                        "}, {\"rank\": 0, \"completion\": " + msg + "}]}\n", "PreferenceDataset"),
            "prefs.jsonl:1: 'completions' ranks tie (0); a pair needs a preferred completion");
  EXPECT_EQ(err_for("{\"context\": " + msg + ", \"completions\": [{\"rank\": 0, \"completion\": " + msg + "}]}\n",
                    "PreferenceDataset"),
            "prefs.jsonl:1: 'completions' has 1 entries; DPO and RM rows have exactly 2");
  EXPECT_EQ(err_for("{\"context\": " + msg + ", \"completions\": [{\"rank\": 0}, {\"rank\": 1}]}\n", "PreferenceDataset"),
            "prefs.jsonl:1: 'completions'[0].completion is missing");
  EXPECT_EQ(err_for("{\"completions\": []}\n", "PreferenceDataset"),
            "prefs.jsonl:1: missing key 'context' (a PreferenceDataset row)");
  const std::string f = t.write("ok.jsonl", ok);
  EXPECT_EQ(error_of(json{{"data_path", f}, {"dataset_name", "BinaryPreferenceDataset"}, {"prompt_file", f}}),
            "dataset.prompt_file: not used by preference datasets (put the text in the rows; set null)");
}

TEST(JsonlDataset, BadConfigIsAnErrorNamingTheKey) {
  TempDir t;
  const std::string f = t.write("d.jsonl", "{\"input\": \"p\", \"output\": \"a\"}\n{\"input\": \"q\", \"output\": \"b\"}\n");
  EXPECT_EQ(error_of({{"train", {{"data_path", t.path / "missing.jsonl"}}}}),
            "data.train.data_path: '" + (t.path / "missing.jsonl").string() + "' does not exist");
  EXPECT_EQ(error_of({{"train", {{"input_key", "q"}}}}), "data.train.data_path: missing (the JSONL file to read)");
  EXPECT_EQ(error_of({{"train", {{"data_path", f}, {"input_key", 3}}}}),
            "data.train.input_key: expected a non-empty string, got 3");
  EXPECT_EQ(error_of({{"train", {{"data_path", f}, {"split_validation_size", -1}}}}),
            "data.train.split_validation_size: expected a fraction in [0, 1) or a row count, got -1");
  EXPECT_EQ(error_of({{"train", {{"data_path", f}, {"split_validation_size", 2.5}}}}),
            "data.train.split_validation_size: a value >= 1 is a row count and must be whole, got 2.5");
  EXPECT_EQ(error_of({{"train", {{"data_path", f}, {"split_validation_size", 2}}}}),
            "data.train.split_validation_size: 2 rows held out for validation leaves none of the 2 rows for training");
  EXPECT_EQ(error_of({{"train", {{"data_path", f}}}, {"split", "validation"}}),
            "data.validation: no validation data (set data.validation.data_path or data.train.split_validation_size)");
  EXPECT_EQ(error_of({{"train", {{"data_path", f}, {"dataset_name", "OpenMathInstruct-2"}}}}),
            "data.train.dataset_name: the jsonl dataset reads 'ResponseDataset' (or 'jsonl'), "
            "'BinaryPreferenceDataset' or 'PreferenceDataset' with a data_path, got \"OpenMathInstruct-2\"");
  EXPECT_EQ(error_of({{"data_path", f}, {"split", "test"}}), "split: expected 'train', 'validation' or 'all', got \"test\"");
  EXPECT_EQ(error_of({{"train", {{"data_path", f}, {"prompt_file", (t.path / "nope.txt").string()}}}}),
            "data.train.prompt_file: '" + (t.path / "nope.txt").string() + "' does not exist");

  const std::string named = t.write("named.txt", "Solve {problem}");
  EXPECT_EQ(error_of({{"data_path", f}, {"prompt_file", named}}),
            named + ": unsupported placeholder '{problem}' at byte 6 (the input is {}, braces are written {{ and }})");
  const std::string none = t.write("none.txt", "No input here {{}}");
  EXPECT_EQ(error_of({{"data_path", f}, {"prompt_file", none}}), none + ": no {} placeholder for the input");
  const std::string single = t.write("single.txt", "{} }");
  EXPECT_EQ(error_of({{"data_path", f}, {"prompt_file", single}}), single + ": single '}' at byte 3 (write }} for a brace)");
}

TEST(JsonlDataset, PromptTemplateMatchesPythonFormat) {
  EXPECT_EQ(rlh::dataset_jsonl::apply_prompt_template("a {{b}} {} {0} c", "X"), "a {b} X X c");
  EXPECT_NO_THROW(rlh::dataset_jsonl::check_prompt_template("\\boxed{{}} {}", "p"));
}

// ---- through the plugin and librlhost --------------------------------------------------------

namespace {
struct Host {
  rlhost_t* h = nullptr;
  Host() { rlh::sdk::check(rlhost_create(&h)); }
  ~Host() { rlhost_destroy(h); }
};
}  // namespace

TEST(JsonlDatasetPlugin, LoadedThroughTheHostServesRowsAndErrors) {
  TempDir t;
  const std::string f = t.write("data.jsonl", "{\"input\": \"p0\", \"output\": \"a0\"}\n{\"input\": \"p1\", \"output\": 1}\n");
  Host host;
  rlh::sdk::check(rlhost_load_plugin(host.h, RLH_DATASET_JSONL_PLUGIN));
  const rlh_host_api* services = rlhost_services(host.h);
  const rlh_component_desc* desc = nullptr;
  rlh::sdk::check(services->find_component(services->ctx, RLH_KIND_DATASET, "jsonl", &desc));
  ASSERT_NE(desc, nullptr);
  EXPECT_STREQ(desc->name, "jsonl");
  EXPECT_EQ(desc->iface_major, static_cast<uint32_t>(RLH_DATASET_API_VERSION_MAJOR));
  const auto* api = static_cast<const rlh_dataset_api*>(desc->api);
  ASSERT_GE(api->struct_size, RLH_STRUCT_SIZE(rlh_dataset_api, get));

  const std::string cfg = json{{"data_path", f}}.dump();
  rlh_dataset* ds = nullptr;
  rlh::sdk::check(api->create(services, cfg.data(), cfg.size(), &ds));
  ASSERT_EQ(api->size(ds), 2);
  std::string row;
  rlh::sdk::check(api->get(ds, 1, rlh::sdk::write_to_string, &row));
  EXPECT_EQ(json::parse(row)["answer"], "1");
  rlh_status* s = api->get(ds, 5, rlh::sdk::write_to_string, &row);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->code, RLH_E_OUT_OF_RANGE);
  EXPECT_EQ(rlh::sdk::status_message(s), "jsonl dataset: row 5 out of range [0, 2)");
  rlh_status_destroy(s);
  api->destroy(ds);

  const std::string bad = t.write("bad.jsonl", "{\"input\": \"p0\", \"output\": \"a0\"}\n{oops}\n");
  const std::string bad_cfg = json{{"data_path", bad}}.dump();
  s = api->create(services, bad_cfg.data(), bad_cfg.size(), &ds);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->code, RLH_E_INVALID_ARGUMENT);
  EXPECT_EQ(rlh::sdk::status_message(s).rfind(bad + ":2: invalid JSON: ", 0), 0u) << rlh::sdk::status_message(s);
  rlh_status_destroy(s);
  s = api->create(services, "{not json", 9, &ds);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(rlh::sdk::status_message(s).rfind("jsonl: config is not valid JSON: ", 0), 0u);
  rlh_status_destroy(s);
}
