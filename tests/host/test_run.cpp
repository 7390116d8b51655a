// rlhost_run end to end with a test algorithm: algorithm-owned keys pass the key check, metrics
// reach rlhost_read_metrics and the loggers (JSONL, TensorBoard files), failures and
// cancellation come back as statuses, and the CLI exits non-zero on them.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "rlhost/host.h"
#include "rlhost/sdk/status.hpp"

namespace fs = std::filesystem;

namespace {

struct HostFixture : ::testing::Test {
  void SetUp() override {
    ASSERT_EQ(rlhost_create(&h), nullptr);
    rlhost_set_log_level(h, RLH_LOG_ERROR);
    dir = fs::temp_directory_path() / ("rlh_run_" + std::to_string(::getpid()) + "_" +
                                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
  }
  void TearDown() override {
    rlhost_destroy(h);
    fs::remove_all(dir);
  }
  rlh_code code_of(rlh_status* s, std::string* msg = nullptr) {
    rlh::sdk::StatusPtr p(s);
    if (msg != nullptr) *msg = rlh::sdk::status_message(s);
    return s != nullptr ? s->code : RLH_OK;
  }
  void load(const std::string& yaml) {
    ASSERT_EQ(code_of(rlhost_load_plugin(h, COUNT_ALGO_PLUGIN)), RLH_OK);
    ASSERT_EQ(code_of(rlhost_load_config_text(h, yaml.data(), yaml.size(), "test")), RLH_OK);
  }
  rlhost_t* h = nullptr;
  fs::path dir;
};

TEST_F(HostFixture, RunRecordsMetricsAndWritesLoggers) {
  load("count_algo:\n  steps: 4\nlogger:\n  log_dir: " + dir.string() +
       "\n  tensorboard_enabled: true\n  console_enabled: false\n");
  std::string msg;
  ASSERT_EQ(code_of(rlhost_run(h), &msg), RLH_OK) << msg;
  std::string lines;
  ASSERT_EQ(code_of(rlhost_read_metrics(h, rlh::sdk::write_to_string, &lines)), RLH_OK);
  EXPECT_NE(lines.find("\"name\":\"train/loss\""), std::string::npos);
  EXPECT_EQ(lines.find("rlhost/"), std::string::npos) << "control values are not metrics";
  // JSONL: one row per step with both metrics.
  std::ifstream in(dir / "metrics.jsonl");
  ASSERT_TRUE(in.good()) << "no metrics.jsonl in " << dir;
  std::string line;
  int rows = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    ++rows;
    EXPECT_EQ(j["step"], rows);
    EXPECT_DOUBLE_EQ(j["train/loss"].get<double>(), 1.0 / rows);
    EXPECT_DOUBLE_EQ(j["train/reward"].get<double>(), rows);
  }
  EXPECT_EQ(rows, 4);
  bool tb = false;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0 && fs::file_size(e.path()) > 0) tb = true;
  EXPECT_TRUE(tb) << "no TensorBoard event file under " << dir;
}

TEST_F(HostFixture, AlgorithmFailureIsAStatus) {
  load("count_algo:\n  steps: 1\n  fail: true\nlogger:\n  log_dir: " + dir.string() + "\n  console_enabled: false\n");
  std::string msg;
  EXPECT_EQ(code_of(rlhost_run(h), &msg), RLH_E_ABORTED);
  EXPECT_NE(msg.find("count_algo was told to fail"), std::string::npos) << msg;
}

TEST_F(HostFixture, CancelledRunStops) {
  load("count_algo:\n  steps: 1000000\nlogger:\n  log_dir: " + dir.string() + "\n  console_enabled: false\n  jsonl_enabled: false\n");
  rlhost_cancel(h);
  std::string msg;
  EXPECT_EQ(code_of(rlhost_run(h), &msg), RLH_E_CANCELLED) << msg;
}

TEST_F(HostFixture, UnknownKeyNextToOwnedOnesIsRefused) {
  load("count_algo:\n  steps: 1\ncount_algox: 1\n");
  std::string msg;
  EXPECT_EQ(code_of(rlhost_run(h), &msg), RLH_E_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("unknown config key 'count_algox'"), std::string::npos) << msg;
}

TEST(Cli, RunExitCodes) {
  fs::path d = fs::temp_directory_path() / ("rlh_run_cli_" + std::to_string(::getpid()));
  fs::create_directories(d);
  std::ofstream(d / "ok.yaml") << "count_algo:\n  steps: 2\nlogger:\n  log_dir: " << (d / "logs").string() << "\n";
  std::ofstream(d / "fail.yaml") << "count_algo:\n  fail: true\nlogger:\n  log_dir: " << (d / "logs").string() << "\n";
  auto run = [&](const std::string& cfg) {
    std::string cmd = std::string(RLHOST_EXE) + " --plugin " + COUNT_ALGO_PLUGIN + " --config " + (d / cfg).string() + " >/dev/null 2>&1";
    int st = std::system(cmd.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  };
  EXPECT_EQ(run("ok.yaml"), 0);
  EXPECT_NE(run("fail.yaml"), 0);
  fs::remove_all(d);
}

}  // namespace
