// Tokenizer components and error handling on small hand-written tokenizer.json files.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <fstream>
#include <atomic>
#include <random>
#include <thread>

#include "../../plugins/tokenizer_hf/src/bpe.hpp"
#include "fixtures_util.hpp"
#include "rlhost/tokenizer/tokenizer.hpp"

namespace {

using nlohmann::json;
using rlh::tok::Tokenizer;

// A character-level BPE over a..e plus a few merges; `patch` is merged into the JSON.
json base_tokenizer() {
  json vocab = json::object();
  int id = 0;
  for (const char* t : {"<unk>", "<s>", "</s>", "a", "b", "c", "d", "e", " ", "ab", "abc", "cd", "de", "cde", "abcde"}) vocab[t] = id++;
  return json{{"version", "1.0"},
              {"added_tokens", json::array()},
              {"normalizer", nullptr},
              {"pre_tokenizer", nullptr},
              {"post_processor", nullptr},
              {"decoder", nullptr},
              {"model", {{"type", "BPE"}, {"unk_token", "<unk>"}, {"vocab", vocab},
                         {"merges", json::array({"a b", json::array({"ab", "c"}), "c d", "d e", "c de", "abc de"})}}}};
}

std::string error_of(const json& j) {
  try {
    Tokenizer::from_json_string(j.dump());
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "(loaded)";
}

TEST(TokenizerErrors, OneLineMessagesNameFileAndField) {
  json j = base_tokenizer();
  j["model"]["merges"][1] = json::array({"ab"});
  EXPECT_EQ(error_of(j), "tokenizer.json: model.merges[1]: expected \"a b\" or [a, b]");
  j = base_tokenizer();
  j["model"]["merges"][2] = "c d e";
  EXPECT_EQ(error_of(j), "tokenizer.json: model.merges[2]: expected \"a b\" or [a, b]");
  j = base_tokenizer();
  j["model"]["merges"].push_back("x y");
  EXPECT_EQ(error_of(j), "tokenizer.json: model.merges[6]: token \"x\" is not in the vocabulary");
  j = base_tokenizer();
  j["model"]["vocab"]["zz"] = -3;
  EXPECT_EQ(error_of(j), "tokenizer.json: model.vocab.zz: expected a non-negative integer, got an integer");
  j = base_tokenizer();
  j["model"]["type"] = "Unigram";
  EXPECT_EQ(error_of(j), "tokenizer.json: model.type: model type \"Unigram\" is not supported (only BPE)");
  j = base_tokenizer();
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}, {"invert", false}};
  EXPECT_NE(error_of(j).find("tokenizer.json: pre_tokenizer.pattern.Regex: bad regex /(unclosed/"), std::string::npos);
  j = base_tokenizer();
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Sideways"}};
  EXPECT_EQ(error_of(j), "tokenizer.json: pre_tokenizer.behavior: unknown split behavior \"Sideways\"");
  j = base_tokenizer();
  j["decoder"] = {{"type", "Sequence"}, {"decoders", json::array({{{"type", "Nope"}}})}};
  EXPECT_EQ(error_of(j), "tokenizer.json: decoder.decoders[0].type: unknown or unsupported decoder type \"Nope\"");
  j = base_tokenizer();
  j["normalizer"] = {{"type", "Replace"}, {"pattern", {{"String", "a"}}}};
  EXPECT_EQ(error_of(j), "tokenizer.json: normalizer.content: missing");
  j = base_tokenizer();
  j["post_processor"] = {{"type", "TemplateProcessing"}, {"single", json::array({{{"SpecialToken", {{"id", "<x>"}}}}, {{"Sequence", {{"id", "A"}}}}})},
                         {"special_tokens", json::object()}};
  EXPECT_EQ(error_of(j), "tokenizer.json: post_processor.single: special token \"<x>\" is not in special_tokens");
  j = base_tokenizer();
  j["added_tokens"] = json::array({{{"id", 1}, {"content", 5}}});
  EXPECT_EQ(error_of(j), "tokenizer.json: added_tokens[0].content: expected a string, got an integer");
  EXPECT_EQ(error_of(json::array()), "tokenizer.json: (root): expected an object, got an array");
  try {
    Tokenizer::from_json_string("{\"model\": ");
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("tokenizer.json: invalid JSON: ", 0), 0u) << e.what();
  }
  std::string deep = std::string(1000, '[') + std::string(1000, ']');
  EXPECT_THROW(Tokenizer::from_json_string(deep), std::runtime_error);
  EXPECT_THROW(Tokenizer::from_file("/nonexistent/tokenizer.json"), std::runtime_error);
}

// Found by fuzz_tokenizer_load / fuzz_tokenizer_pipeline: a number past double's range was
// nlohmann's out_of_range (not a parse_error) and escaped as std::terminate; a type name or key
// holding a newline made a two-line error. Both are the file's fault, named on one line.
TEST(TokenizerErrors, FuzzFindingsAreOneLineErrors) {
  try {
    Tokenizer::from_json_string("{\"version\": \"1.0\", \"model\": 5e3333}");
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("tokenizer.json: invalid JSON: ", 0), 0u) << e.what();
  }
  json j = base_tokenizer();
  j["normalizer"] = {{"type", "Bert\nNormalizer\t\x01"}};
  EXPECT_EQ(error_of(j), "tokenizer.json: normalizer.type: unknown normalizer type \"Bert\\nNormalizer\\t\\x01\"");
  j = base_tokenizer();
  j["pre_tokenizer"] = {{"type", std::string(5000, 'x')}};
  const std::string long_type = error_of(j);
  EXPECT_LE(long_type.size(), 1100u);
  EXPECT_EQ(long_type.substr(long_type.size() - 3), "...");
  j = base_tokenizer();
  j["model"]["vocab"]["a\nb"] = -1;
  EXPECT_EQ(error_of(j).find('\n'), std::string::npos);
}

TEST(TokenizerErrors, InvalidUtf8InputIsRejected) {
  auto tok = Tokenizer::from_json_string(base_tokenizer().dump());
  EXPECT_THROW(tok.encode(std::string("ab\xff"), false), std::invalid_argument);
  EXPECT_THROW(tok.encode(std::string("\xe4\xb8"), false), std::invalid_argument);
}

TEST(Bpe, MergesByRankAndUnknowns) {
  auto tok = Tokenizer::from_json_string(base_tokenizer().dump());
  using V = std::vector<int32_t>;
  EXPECT_EQ(tok.encode("abcde", false), V{14});
  EXPECT_EQ(tok.encode("abcd", false), (V{10, 6}));  // "ab c d": (ab,c) ranks before (c,d)
  EXPECT_EQ(tok.encode("xxa", false), (V{0, 0, 3}));  // unknowns, not fused
  json j = base_tokenizer();
  j["model"]["fuse_unk"] = true;
  EXPECT_EQ(Tokenizer::from_json_string(j.dump()).encode("xxa", false), (V{0, 3}));
  j["model"]["unk_token"] = nullptr;
  EXPECT_EQ(Tokenizer::from_json_string(j.dump()).encode("xxa", false), (V{3}));  // dropped
  EXPECT_EQ(tok.decode(V{14, 9}), "abcde ab");  // no decoder: tokens joined by spaces
  EXPECT_EQ(tok.vocab_size(), 15u);
}

TEST(Bpe, IgnoreMergesTakesWholeWords) {
  json j = base_tokenizer();
  j["model"]["vocab"]["bcd"] = 15;  // reachable only as a whole word
  EXPECT_EQ(Tokenizer::from_json_string(j.dump()).encode("bcd", false), (std::vector<int32_t>{4, 11}));
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(Tokenizer::from_json_string(j.dump()).encode("bcd", false), (std::vector<int32_t>{15}));
}

TEST(Bpe, HeapAndScanMergeLoopsAgree) {
  // The long-word heap loop must give the short-word scan's result on every word.
  const auto fx = rlh::test::fixtures_dir() / "tokenizer-llama3" / "tokenizer.json";
  if (!std::filesystem::exists(fx)) GTEST_SKIP() << "fixture missing: " << fx;
  auto tok = Tokenizer::from_file(fx);
  std::mt19937 rng(7);
  const std::string alphabet = "aeinrst ,.'the";
  std::vector<std::string> words;
  for (int i = 0; i < 400; ++i) {
    std::string w;
    const int n = 2 + static_cast<int>(rng() % 40);
    for (int k = 0; k < n; ++k) w += alphabet[rng() % alphabet.size()];
    words.push_back(w + std::to_string(i));  // unique, so the word cache never answers
  }
  std::vector<std::vector<int32_t>> scan;
  for (const auto& w : words) scan.push_back(tok.encode(w, false));
  rlh::tok::BpeModel::set_heap_threshold_for_tests(1);
  auto tok2 = Tokenizer::from_file(fx);  // fresh instance: its own (empty) cache
  for (size_t i = 0; i < words.size(); ++i) EXPECT_EQ(tok2.encode(words[i], false), scan[i]) << words[i];
  rlh::tok::BpeModel::set_heap_threshold_for_tests(0);
}

TEST(Bpe, ConcurrentEncodeMatchesSingleThread) {
  // encode() is const and its word cache is per thread: many threads on one instance agree.
  const auto fx = rlh::test::fixtures_dir() / "tokenizer-llama3" / "tokenizer.json";
  if (!std::filesystem::exists(fx)) GTEST_SKIP() << "fixture missing: " << fx;
  const auto tok = Tokenizer::from_file(fx);
  std::vector<std::string> texts;
  for (int i = 0; i < 200; ++i) texts.push_back("doc " + std::to_string(i * 7919) + " naïve 中文 🙂 don't  stop\n" + std::string(i % 13, 'x'));
  std::vector<std::vector<int32_t>> want;
  for (const auto& t : texts) want.push_back(tok.encode(t, true));
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 5; ++rep) {
        for (size_t i = 0; i < texts.size(); ++i) {
          const size_t k = (i + static_cast<size_t>(t) * 37) % texts.size();
          if (tok.encode(texts[k], true) != want[k]) ++mismatches;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST(AddedTokens, FlagsLstripRstripSingleWord) {
  json j = base_tokenizer();
  j["added_tokens"] = json::array({
      {{"id", 1}, {"content", "<s>"}, {"special", true}, {"normalized", false}, {"lstrip", true}, {"rstrip", true}},
      {{"id", 15}, {"content", "cab"}, {"special", false}, {"normalized", false}, {"single_word", true}},
  });
  auto tok = Tokenizer::from_json_string(j.dump());
  using V = std::vector<int32_t>;
  EXPECT_EQ(tok.encode("a  <s>  b", false), (V{3, 1, 4}));        // surrounding spaces swallowed
  EXPECT_EQ(tok.encode("a cab b", false), (V{3, 8, 15, 8, 4}));   // a word on its own
  EXPECT_EQ(tok.encode("acab", false), (V{3, 5, 9}));             // inside a word: not matched
  EXPECT_EQ(tok.token_to_id("cab"), 15);
  EXPECT_EQ(tok.vocab_size(), 16u);
  EXPECT_EQ(tok.decode(V{3, 1, 4}, true), "a b");
  EXPECT_TRUE(tok.is_special(1));
  EXPECT_FALSE(tok.is_special(15));
}

TEST(PostProcessor, TemplateAndConfigFlags) {
  json j = base_tokenizer();
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                                 {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                                 {{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}})},
                         {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}},
                                             {"</s>", {{"id", "</s>"}, {"ids", {2}}, {"tokens", {"</s>"}}}}}}};
  auto tok = Tokenizer::from_json_string(j.dump());
  using V = std::vector<int32_t>;
  EXPECT_EQ(tok.encode("ab"), (V{1, 9, 2}));
  EXPECT_EQ(tok.encode("ab", false), (V{9}));
  // tokenizer_config.json add_bos_token/add_eos_token replace the template, as transformers does.
  tok.apply_config_json(R"({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true, "add_eos_token": false})");
  EXPECT_EQ(tok.encode("ab"), (V{1, 9}));
  EXPECT_THROW(tok.apply_config_json(R"({"bos_token": "<nope>", "add_bos_token": true})"), std::runtime_error);
}

TEST(Decoders, ByteFallbackInvalidBytesAndStrip) {
  json j = base_tokenizer();
  j["model"]["vocab"]["<0xE4>"] = 15;
  j["model"]["vocab"]["<0xB8>"] = 16;
  j["model"]["vocab"]["<0xAD>"] = 17;
  j["model"]["byte_fallback"] = true;
  j["decoder"] = {{"type", "Sequence"}, {"decoders", json::array({{{"type", "ByteFallback"}}, {{"type", "Fuse"}},
                                                                  {{"type", "Strip"}, {"content", "a"}, {"start", 1}, {"stop", 1}}})}};
  auto tok = Tokenizer::from_json_string(j.dump());
  using V = std::vector<int32_t>;
  EXPECT_EQ(tok.encode("a中b", false), (V{3, 15, 16, 17, 4}));
  EXPECT_EQ(tok.decode(V{3, 15, 16, 17, 4, 3}), "中b");
  EXPECT_EQ(tok.decode(V{15, 16, 4}), "\xEF\xBF\xBD\xEF\xBF\xBD" "b");  // one U+FFFD per byte
  EXPECT_EQ(tok.decode(V{3}), "");
}

TEST(FromDir, ReadsConfigTemplateFileAndGenerationConfig) {
  namespace fs = std::filesystem;
  const fs::path d = fs::temp_directory_path() / ("rlh_tokdir_" + std::to_string(::getpid()));
  fs::create_directories(d);
  std::ofstream(d / "tokenizer.json") << base_tokenizer().dump();
  std::ofstream(d / "tokenizer_config.json") << R"({"eos_token": "</s>", "chat_template": "old"})";
  std::ofstream(d / "chat_template.jinja") << "new {{ messages | length }}";
  std::ofstream(d / "generation_config.json") << R"({"eos_token_id": [2, 1]})";
  auto tok = Tokenizer::from_dir(d);
  EXPECT_EQ(tok.chat_template()->render(json::array({1}), false), "new 1");
  EXPECT_EQ(tok.eos_ids(), (std::vector<int32_t>{2, 1}));
  std::ofstream(d / "tokenizer_config.json") << R"({"chat_template": [{"name": "x"}]})";
  try {
    Tokenizer::from_dir(d);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "tokenizer_config.json: chat_template[0].template: missing");
  }
  fs::remove_all(d);
  EXPECT_THROW(Tokenizer::from_dir(d), std::runtime_error);
}

}  // namespace
