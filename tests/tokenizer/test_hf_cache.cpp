// rlh_hfcache: hub ids resolve in the local Hugging Face cache, directories pass through, and a
// missing model is a one-line error naming the id and the folders searched.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "rlhost/sdk/hf_cache.hpp"

namespace {

namespace fs = std::filesystem;
using rlh::sdk::resolve_model_path;

struct TempCache {
  fs::path root = fs::temp_directory_path() / ("rlh_hfcache_" + std::to_string(::getpid()));
  TempCache() {
    fs::create_directories(root);
    ::setenv("HF_HUB_CACHE", root.c_str(), 1);
  }
  ~TempCache() {
    ::unsetenv("HF_HUB_CACHE");
    fs::remove_all(root);
  }
  fs::path snapshot(const std::string& repo, const std::string& rev) {
    const fs::path p = root / repo / "snapshots" / rev;
    fs::create_directories(p);
    return p;
  }
};

TEST(HfCache, RefsMainPicksTheSnapshot) {
  TempCache c;
  c.snapshot("models--Qwen--Qwen2.5-1.5B", "aaa111");
  const fs::path want = c.snapshot("models--Qwen--Qwen2.5-1.5B", "bbb222");
  fs::create_directories(c.root / "models--Qwen--Qwen2.5-1.5B" / "refs");
  std::ofstream(c.root / "models--Qwen--Qwen2.5-1.5B" / "refs" / "main") << "bbb222";
  EXPECT_EQ(resolve_model_path("Qwen/Qwen2.5-1.5B"), want);
  EXPECT_EQ(resolve_model_path("Qwen/Qwen2.5-1.5B@aaa111"), c.root / "models--Qwen--Qwen2.5-1.5B" / "snapshots" / "aaa111");
}

TEST(HfCache, WithoutRefsTheNewestSnapshot) {
  TempCache c;
  const fs::path old = c.snapshot("models--org--m", "old");
  const fs::path neu = c.snapshot("models--org--m", "new");
  fs::last_write_time(old, fs::file_time_type::clock::now() - std::chrono::hours(1));
  fs::last_write_time(neu, fs::file_time_type::clock::now());
  EXPECT_EQ(resolve_model_path("org/m"), neu);
}

TEST(HfCache, HfHomeAndDirectories) {
  const fs::path home = fs::temp_directory_path() / ("rlh_hfhome_" + std::to_string(::getpid()));
  fs::create_directories(home / "hub" / "models--a--b" / "snapshots" / "r1");
  ::unsetenv("HF_HUB_CACHE");
  ::setenv("HF_HOME", home.c_str(), 1);
  EXPECT_EQ(resolve_model_path("a/b"), home / "hub" / "models--a--b" / "snapshots" / "r1");
  EXPECT_EQ(rlh::sdk::hf_cache_roots().front(), home / "hub");
  EXPECT_EQ(resolve_model_path(home.string()), home);  // an existing directory is returned as is
  ::unsetenv("HF_HOME");
  fs::remove_all(home);
}

TEST(HfCache, MissingModelIsAClearError) {
  TempCache c;
  try {
    resolve_model_path("nobody/nothing");
    FAIL();
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("\"nobody/nothing\""), std::string::npos) << m;
    EXPECT_NE(m.find((c.root / "models--nobody--nothing" / "snapshots").string()), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos);
  }
  EXPECT_THROW(resolve_model_path("../etc/passwd"), std::runtime_error);
  EXPECT_THROW(resolve_model_path(""), std::runtime_error);
}

}  // namespace
