// The fixture of the preference loops' tests (test_dpo_loop, test_rm_loop), whose helpers
// (have, code_of, read_file, read_metrics) test_ppo_loop uses too: a random tiny Llama,
// synthetic preference pairs ("abc=" -> chosen: the first digit, rejected: another), and a run of
// the algorithm plugin through librlhost with the real plugins, returning its metrics.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/host.h"
#include "rlhost/sdk/status.hpp"

namespace rlh_test {

namespace fs = std::filesystem;
using json = nlohmann::json;

inline const fs::path kPlugins = RLH_PLUGIN_DIR;
using Metrics = std::map<std::string, std::map<int64_t, double>>;

inline bool have(const std::string& plugin) { return fs::exists(kPlugins / ("lib" + plugin + ".so")); }

inline std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline rlh_code code_of(rlh_status* s, std::string* msg = nullptr) {
  rlh::sdk::StatusPtr p(s);
  if (msg != nullptr) *msg = rlh::sdk::status_message(s);
  return s != nullptr ? s->code : RLH_OK;
}

// Every metric a finished run logged, as {name: {step: value}}.
inline Metrics read_metrics(rlhost_t* h) {
  std::string lines;
  EXPECT_EQ(code_of(rlhost_read_metrics(h, rlh::sdk::write_to_string, &lines)), RLH_OK);
  Metrics out;
  std::istringstream in(lines);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const json j = json::parse(line);
    out[j["name"].get<std::string>()][j["step"].get<int64_t>()] = j["value"].get<double>();
  }
  return out;
}

// `n` pairs "abc=" -> chosen: the first digit, rejected: another digit (a seeded LCG).
inline void write_pairs(const fs::path& file, int n, uint64_t seed) {
  std::ofstream out(file);
  auto next = [&] {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<int>((seed >> 33) % 10);
  };
  for (int i = 0; i < n; ++i) {
    const int a = next(), b = next(), c = next();
    int r = next();
    if (r == a) r = (r + 1 + next() % 9) % 10;
    out << json{{"prompt", std::to_string(a) + std::to_string(b) + std::to_string(c) + "="},
                {"chosen", std::to_string(a)},
                {"rejected", std::to_string(r)}}
               .dump()
        << "\n";
  }
}

// A run of one preference algorithm (dpo or rm) through librlhost on a random tiny Llama, with
// 256 training and 64 validation pairs: the fixture both loops' tests share.
class PreferenceLoopTest : public ::testing::Test {
 protected:
  PreferenceLoopTest(std::string algorithm, const char* config, int layers)
      : algorithm_(std::move(algorithm)), config_(fs::path(RLH_SOURCE_DIR) / config), layers_(layers) {}

  std::vector<std::string> plugins() const {
    return {algorithm_, "dtensor", "kernels_cpu", "dataset_jsonl", "tokenizer_hf", "model_llama"};
  }

  void SetUp() override {
    for (const std::string& p : plugins())
      if (!have(p)) GTEST_SKIP() << "plugin '" << p << "' is not built (" << kPlugins << ")";
    dir = fs::temp_directory_path() / ("rlh_" + algorithm_ + "_loop_" + std::to_string(::getpid()) + "_" +
                                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
    model = dir / "tiny_model";
    const std::string cmd = std::string(RLH_TINY_MODEL) + " " + model.string() +
                            " --alphabet '0123456789=' --seed 5 --layers " + std::to_string(layers_) +
                            " --hidden 32 --ffn 64 > /dev/null";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    write_pairs(dir / "train.jsonl", 256, 11);
    write_pairs(dir / "val.jsonl", 64, 12);
  }
  void TearDown() override {
    if (!dir.empty()) fs::remove_all(dir);
  }

  rlhost_t* make_host(const std::vector<std::string>& overrides) {
    rlhost_t* h = nullptr;
    EXPECT_EQ(rlhost_create(&h), nullptr);
    rlhost_set_log_level(h, RLH_LOG_ERROR);
    for (const std::string& p : plugins()) {
      std::string msg;
      EXPECT_EQ(code_of(rlhost_load_plugin(h, (kPlugins / ("lib" + p + ".so")).c_str()), &msg), RLH_OK) << p << ": " << msg;
    }
    std::string msg;
    EXPECT_EQ(code_of(rlhost_load_config(h, config_.c_str()), &msg), RLH_OK) << msg;
    std::vector<std::string> all = {"policy.model_name=" + model.string(),
                                    "data.train.data_path=" + (dir / "train.jsonl").string(),
                                    "data.validation.data_path=" + (dir / "val.jsonl").string(),
                                    "checkpointing.checkpoint_dir=" + (dir / "ckpt").string(),
                                    "logger.log_dir=" + (dir / "logs").string(), "++logger.console_enabled=false"};
    all.insert(all.end(), overrides.begin(), overrides.end());
    for (const auto& o : all) EXPECT_EQ(code_of(rlhost_apply_override(h, o.c_str()), &msg), RLH_OK) << o << ": " << msg;
    return h;
  }

  Metrics run(const std::vector<std::string>& overrides, rlh_code want = RLH_OK, std::string* error = nullptr) {
    rlhost_t* h = make_host(overrides);
    std::string msg;
    const rlh_code c = code_of(rlhost_run(h), &msg);
    EXPECT_EQ(c, want) << msg;
    if (error != nullptr) *error = msg;
    Metrics out = read_metrics(h);
    rlhost_destroy(h);
    return out;
  }

  // Runs 4 steps straight, then 2 and a resume to 4 in another folder (checkpoints every 2
  // steps), and checks that steps 3-4 log the same loss and accuracy and that step 4's policy
  // safetensors are bitwise equal. Returns the straight run's step-4 policy folder.
  fs::path check_resume_is_bitwise() {
    const std::vector<std::string> common = {algorithm_ + ".val_period=0", algorithm_ + ".val_at_start=false",
                                             "checkpointing.save_period=2", "checkpointing.metric_name=null",
                                             "checkpointing.keep_top_k=null"};
    auto with = [&](const std::string& ck, int steps) {
      std::vector<std::string> v = common;
      v.push_back("checkpointing.checkpoint_dir=" + (dir / ck).string());
      v.push_back(algorithm_ + ".max_num_steps=" + std::to_string(steps));
      return v;
    };
    Metrics straight = run(with("straight", 4));
    run(with("resumed", 2));
    EXPECT_TRUE(fs::exists(dir / "resumed/step_2"));
    Metrics second = run(with("resumed", 4));
    EXPECT_FALSE(second["train/loss"].count(1));
    for (int64_t s : {3, 4}) {
      EXPECT_EQ(second["train/loss"][s], straight["train/loss"][s]) << "step " << s;
      EXPECT_EQ(second["train/accuracy"][s], straight["train/accuracy"][s]) << "step " << s;
    }
    const fs::path a = dir / "straight/step_4/policy", b = dir / "resumed/step_4/policy";
    size_t compared = 0;
    for (const auto& e : fs::recursive_directory_iterator(a)) {
      if (!e.is_regular_file() || e.path().extension() != ".safetensors") continue;
      const fs::path other = b / fs::relative(e.path(), a);
      EXPECT_TRUE(fs::exists(other)) << other;
      EXPECT_TRUE(read_file(e.path()) == read_file(other)) << "differs: " << fs::relative(e.path(), a);
      ++compared;
    }
    EXPECT_GT(compared, 0u);
    return a;
  }

  fs::path dir, model;

 private:
  std::string algorithm_;
  fs::path config_;
  int layers_;
};

}  // namespace rlh_test
