// Every tokenizer-* fixture folder: ids and decoded text must equal HF's for every case.
// Folders are discovered at run time, so a new fixture needs no code. The same check runs over
// the tokenizers in tests/tokenizer/data/hf/ (made with HF tokenizers by tools/make_hf_cases.py),
// which cover the other families and components; their cases also vary add_special_tokens and
// skip_special_tokens.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>

#include "fixtures_util.hpp"
#include "rlhost/tokenizer/tokenizer.hpp"

namespace {

std::string name_of(const testing::TestParamInfo<std::filesystem::path>& info) {
  std::string n = info.param.filename().string();
  for (char& c : n) if (!isalnum(static_cast<unsigned char>(c))) c = '_';
  return n;
}

class TokenizerFixture : public testing::TestWithParam<std::filesystem::path> {};

TEST_P(TokenizerFixture, IdsAndDecodedMatchHF) {
  const auto dir = GetParam();
  auto tok = rlh::tok::Tokenizer::from_file(dir / "tokenizer.json");
  std::ifstream in(dir / "cases.jsonl");
  ASSERT_TRUE(in) << dir;
  std::string line;
  size_t n = 0, ids_ok = 0, dec_ok = 0, reported = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto c = nlohmann::json::parse(line);
    const std::string text = c.at("text");
    const auto want = c.at("ids").get<std::vector<int32_t>>();
    const bool add_special = c.value("add_special_tokens", true);
    const auto got = tok.encode(text, add_special);
    ++n;
    if (got == want) ++ids_ok;
    else if (++reported <= 20) ADD_FAILURE() << dir.filename() << " case " << n << " ids differ for " << nlohmann::json(text).dump()
                       << "\n  want " << nlohmann::json(want).dump() << "\n  got  " << nlohmann::json(got).dump();
    const bool skip = c.value("skip_special_tokens", false);
    const std::string dec = tok.decode(want, skip);
    if (dec == c.at("decoded").get<std::string>()) ++dec_ok;
    else if (++reported <= 20) ADD_FAILURE() << dir.filename() << " case " << n << " decoded differs: want "
                       << c.at("decoded").dump() << " got " << nlohmann::json(dec).dump();
  }
  EXPECT_GT(n, 0u);
  EXPECT_EQ(ids_ok, n);
  EXPECT_EQ(dec_ok, n);
  std::printf("[ fixture  ] %s: ids %zu/%zu, decoded %zu/%zu\n", dir.filename().c_str(), ids_ok, n, dec_ok, n);
}

INSTANTIATE_TEST_SUITE_P(All, TokenizerFixture, testing::ValuesIn(rlh::test::tokenizer_fixtures()), name_of);
INSTANTIATE_TEST_SUITE_P(Generated, TokenizerFixture, testing::ValuesIn(rlh::test::generated_fixtures()), name_of);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(TokenizerFixture);

TEST(TokenizerFixtures, AtLeastOneFolderFound) {
  EXPECT_FALSE(rlh::test::tokenizer_fixtures().empty()) << "no tokenizer-* folders under " << rlh::test::fixtures_dir();
}

}  // namespace
