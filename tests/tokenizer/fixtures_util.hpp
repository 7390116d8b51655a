// Locating the shared fixtures: $RLHOST_FIXTURES, else the path CMake passes in.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace rlh::test {

inline std::filesystem::path fixtures_dir() {
  if (const char* e = std::getenv("RLHOST_FIXTURES"); e && *e) return e;
  return RLH_DEFAULT_FIXTURES;
}

// Every fixtures/tokenizer-* folder that has tokenizer.json and cases.jsonl, sorted.
inline std::vector<std::filesystem::path> tokenizer_fixtures() {
  std::vector<std::filesystem::path> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(fixtures_dir(), ec)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && name.rfind("tokenizer-", 0) == 0 &&
        std::filesystem::exists(e.path() / "tokenizer.json") && std::filesystem::exists(e.path() / "cases.jsonl")) {
      out.push_back(e.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Tokenizers built with HF tokenizers by tools/make_hf_cases.py (tests/tokenizer/data/hf/*).
inline std::vector<std::filesystem::path> generated_fixtures() {
  std::vector<std::filesystem::path> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(RLH_TOK_TEST_DATA) / "hf", ec)) {
    if (e.is_directory() && std::filesystem::exists(e.path() / "cases.jsonl")) out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace rlh::test
