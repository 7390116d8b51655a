// rlh_metrics and rlh_crc32c: CRC32C against published vectors, per-step grouping, the console
// line, JSONL rows, and TensorBoard event files read back by python3-protobuf (read_tfevents.py).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/sdk/crc32c.hpp"
#include "rlhost/sdk/metrics.hpp"
#include "rlhost/sdk/status.hpp"

namespace fs = std::filesystem;
using rlh::sdk::MetricsRow;

namespace {

fs::path make_temp_dir(const char* tag) {
  std::string tmpl = (fs::temp_directory_path() / (std::string("rlh_") + tag + "_XXXXXX")).string();
  if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  return tmpl;
}

struct TempDir {
  fs::path path;
  explicit TempDir(const char* tag) : path(make_temp_dir(tag)) {}
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::vector<nlohmann::json> read_jsonl(const fs::path& p) {
  std::ifstream in(p);
  std::vector<nlohmann::json> rows;
  for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

// Runs a command, returning (exit status, stdout).
std::pair<int, std::string> run(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return {-1, out};
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  int st = ::pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

// Collects rows instead of writing them.
struct MemorySink : rlh::sdk::MetricsSink {
  std::vector<MetricsRow>* rows;
  explicit MemorySink(std::vector<MetricsRow>* r) : rows(r) {}
  void write(const MetricsRow& row) override { rows->push_back(row); }
};

}  // namespace

TEST(Crc32c, PublishedVectors) {
  // RFC 3720 (iSCSI) appendix B.4 and the classic check value.
  EXPECT_EQ(rlh::sdk::crc32c("123456789"), 0xE3069283u);
  std::vector<unsigned char> zeros(32, 0x00), ones(32, 0xFF), inc(32), dec(32);
  for (int i = 0; i < 32; ++i) {
    inc[i] = static_cast<unsigned char>(i);
    dec[i] = static_cast<unsigned char>(31 - i);
  }
  EXPECT_EQ(rlh::sdk::crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(rlh::sdk::crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(rlh::sdk::crc32c(inc.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(rlh::sdk::crc32c(dec.data(), 32), 0x113FDB5Cu);
  EXPECT_EQ(rlh::sdk::crc32c("", 0), 0u);
}

TEST(Crc32c, HardwareAndTablesAgreeAndExtendComposes) {
  std::mt19937_64 rng(7);
  std::vector<unsigned char> buf(70000);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  for (int trial = 0; trial < 200; ++trial) {
    const size_t off = rng() % 64, len = rng() % (buf.size() - off);
    const size_t cut = len == 0 ? 0 : rng() % len;
    const uint32_t whole = rlh::sdk::crc32c(buf.data() + off, len);
    EXPECT_EQ(whole, rlh::sdk::crc32c_extend_portable(0, buf.data() + off, len));
    const uint32_t first = rlh::sdk::crc32c(buf.data() + off, cut);
    EXPECT_EQ(whole, rlh::sdk::crc32c_extend(first, buf.data() + off + cut, len - cut));
  }
}

TEST(Crc32c, MaskRoundTrips) {
  for (uint32_t c : {0u, 1u, 0xE3069283u, 0xFFFFFFFFu, 0x12345678u})
    EXPECT_EQ(rlh::sdk::crc32c_unmask(rlh::sdk::crc32c_mask(c)), c);
  EXPECT_NE(rlh::sdk::crc32c_mask(0x12345678u), 0x12345678u);
}

TEST(TfEvents, RecordFramingLayout) {
  const std::string rec = rlh::sdk::tfevents::frame_record("abc");
  ASSERT_EQ(rec.size(), 8u + 4 + 3 + 4);
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(static_cast<unsigned char>(rec[i])) << (8 * i);
  EXPECT_EQ(len, 3u);
  auto u32 = [&](size_t at) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<unsigned char>(rec[at + i])) << (8 * i);
    return v;
  };
  EXPECT_EQ(u32(8), rlh::sdk::crc32c_mask(rlh::sdk::crc32c(rec.data(), 8)));
  EXPECT_EQ(rec.substr(12, 3), "abc");
  EXPECT_EQ(u32(15), rlh::sdk::crc32c_mask(rlh::sdk::crc32c("abc")));
}

TEST(MetricsLogger, GroupsScalarsPerStep) {
  std::vector<MetricsRow> rows;
  rlh::sdk::MetricsLogger log;
  log.add_sink(std::make_unique<MemorySink>(&rows));
  log.log("train/loss", 1.5, 1);
  log.log("train/reward", 0.25, 1);
  log.log("train/loss", 1.25, 1);  // same name again: last value wins
  EXPECT_TRUE(rows.empty());       // nothing emitted until the step is done
  log.log({{"generation", 2.0}, {"policy_training", 3.0}}, 1, "timing/train");
  log.step_finished(1);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].step, 1);
  ASSERT_EQ(rows[0].values.size(), 4u);
  EXPECT_EQ(rows[0].values[0].first, "train/loss");
  EXPECT_DOUBLE_EQ(rows[0].values[0].second, 1.25);
  EXPECT_NE(rows[0].find("timing/train/generation"), nullptr);
  EXPECT_DOUBLE_EQ(*rows[0].find("timing/train/policy_training"), 3.0);
  EXPECT_GT(rows[0].wall_time, 1.6e9);

  // A new step emits the previous one; step_finished of another step does nothing.
  log.log("train/loss", 2.0, 2);
  log.step_finished(7);
  EXPECT_EQ(rows.size(), 1u);
  log.log("train/loss", 3.0, 3);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[1].step, 2);
  log.flush();
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[2].step, 3);
}

TEST(MetricsLogger, ConsoleLineShowsProgressEtaAndSelectedMetrics) {
  rlh::sdk::ConsoleSink sink({/*total_steps=*/100, {"train/loss", "timing/train/generation", "absent"}, stdout});
  MetricsRow r1{10, 0, {{"train/loss", 0.123456}, {"train/other", 9}, {"timing/train/generation", 1.5}}};
  const std::string l1 = sink.format_line(r1, 1000.0);
  EXPECT_NE(l1.find("step 10/100 (10.0%)"), std::string::npos) << l1;
  EXPECT_NE(l1.find("eta --"), std::string::npos) << l1;  // one row: no rate yet
  EXPECT_NE(l1.find("train/loss 0.1235"), std::string::npos) << l1;
  EXPECT_NE(l1.find("timing/train/generation 1.50s"), std::string::npos) << l1;
  EXPECT_EQ(l1.find("train/other"), std::string::npos) << l1;
  EXPECT_EQ(l1.find("absent"), std::string::npos) << l1;
  // 10 more steps in 20 s: 2 s/step, 80 steps left -> 160 s.
  MetricsRow r2{20, 0, {{"train/loss", 0.5}}};
  const std::string l2 = sink.format_line(r2, 1020.0);
  EXPECT_NE(l2.find("step 20/100 (20.0%) | eta 2m40s"), std::string::npos) << l2;

  // Before two rows, the step's own total_step_time gives the rate.
  rlh::sdk::ConsoleSink fresh({4, {}, stdout});
  MetricsRow r{1, 0, {{"timing/train/total_step_time", 30.0}}};
  EXPECT_NE(fresh.format_line(r, 0).find("eta 1m30s"), std::string::npos);
}

TEST(MetricsLogger, JsonlOneObjectPerStep) {
  TempDir tmp("metrics_jsonl");
  rlh::sdk::MetricsConfig cfg;
  cfg.log_dir = tmp.path / "logs";
  cfg.console = false;
  {
    rlh::sdk::MetricsLogger log(cfg);
    log.log("train/loss", 0.5, 1);
    log.log("train/reward", 0.75, 1);
    log.step_finished(1);
    log.log("train/loss", 0.25, 2);
    log.log("validation/accuracy", std::nan(""), 2);
  }  // destructor emits step 2
  auto rows = read_jsonl(tmp.path / "logs" / "metrics.jsonl");
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].dump(), R"({"step":1,"train/loss":0.5,"train/reward":0.75})");
  EXPECT_EQ(rows[1]["step"], 2);
  EXPECT_DOUBLE_EQ(rows[1]["train/loss"].get<double>(), 0.25);
  EXPECT_TRUE(rows[1]["validation/accuracy"].is_null());
}

TEST(MetricsLogger, ConfigFromNemoRlLoggerSection) {
  auto j = nlohmann::json::parse(R"({"log_dir": "runs/x", "tensorboard_enabled": true,
      "wandb_enabled": false, "console_metrics": ["train/loss"]})");
  auto cfg = rlh::sdk::MetricsConfig::from_logger_json(j);
  EXPECT_EQ(cfg.log_dir, fs::path("runs/x"));
  EXPECT_TRUE(cfg.tensorboard);
  EXPECT_TRUE(cfg.jsonl);
  EXPECT_EQ(cfg.console_metrics, std::vector<std::string>{"train/loss"});
  try {
    rlh::sdk::MetricsConfig::from_logger_json(nlohmann::json::parse(R"({"tensorboard_enabled": "yes"})"));
    FAIL() << "a string for a boolean key must be rejected";
  } catch (const rlh::sdk::Error& e) {
    EXPECT_EQ(e.code(), RLH_E_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("logger.tensorboard_enabled: expected true or false"), std::string::npos)
        << e.what();
  }
}

TEST(MetricsLogger, TensorBoardEventFileReadBackByProtobuf) {
  if (::access("/usr/bin/python3", X_OK) != 0) GTEST_SKIP() << "/usr/bin/python3 not installed";
  if (run("/usr/bin/python3 -c 'import google.protobuf' 2>/dev/null").first != 0)
    GTEST_SKIP() << "python3-protobuf not installed";
  TempDir tmp("metrics_tb");
  rlh::sdk::MetricsConfig cfg;
  cfg.log_dir = tmp.path;
  cfg.console = false;
  cfg.jsonl = false;
  cfg.tensorboard = true;
  // Steps include 0 (omitted on the wire as proto3 does), a large step and a negative one (a
  // 10-byte varint); tags include non-ASCII text.
  const std::vector<std::pair<int64_t, std::vector<std::pair<std::string, double>>>> written = {
      {0, {{"train/loss", 1.0}}},
      {1, {{"train/loss", 0.5}, {"train/reward", -0.25}, {"timing/train/generation", 12.75}}},
      {2, {{"validation/accuracy", 0.8125}, {"train/ünïcode", 3.0}}},
      {123456789012, {{"train/loss", 1e-3}}},
      {-3, {{"train/loss", 65504.0}}},
  };
  fs::path file;
  {
    rlh::sdk::MetricsLogger log(cfg);
    for (const auto& [step, vals] : written) {
      for (const auto& [n, v] : vals) log.log(n, v, step);
      log.step_finished(step);
    }
    auto files = log.files();
    ASSERT_EQ(files.size(), 1u);
    file = files[0];
  }
  EXPECT_EQ(file.parent_path(), tmp.path / "tensorboard");
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::string name = file.filename().string();
  EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  EXPECT_NE(name.find(std::string(".") + host), std::string::npos) << name;

  auto [rc, out] = run("/usr/bin/python3 " RLH_TEST_SOURCE_DIR "/read_tfevents.py '" + file.string() + "'");
  ASSERT_EQ(rc, 0) << out;
  auto events = nlohmann::json::parse(out);
  ASSERT_EQ(events.size(), written.size() + 1);
  EXPECT_EQ(events[0]["file_version"], "brain.Event:2");
  EXPECT_GT(events[0]["wall_time"].get<double>(), 1.6e9);
  for (size_t i = 0; i < written.size(); ++i) {
    const auto& ev = events[i + 1];
    EXPECT_EQ(ev["step"].get<int64_t>(), written[i].first) << ev.dump();
    EXPECT_EQ(ev["file_version"], "");
    EXPECT_GE(ev["wall_time"].get<double>(), events[i]["wall_time"].get<double>());
    ASSERT_EQ(ev["values"].size(), written[i].second.size()) << ev.dump();
    for (size_t k = 0; k < written[i].second.size(); ++k) {
      EXPECT_EQ(ev["values"][k][0].get<std::string>(), written[i].second[k].first);
      // simple_value is a float32 on the wire.
      EXPECT_EQ(ev["values"][k][1].get<double>(), static_cast<double>(static_cast<float>(written[i].second[k].second)));
    }
  }

  // A flipped byte in the payload must be caught by the reader's CRC check (the check is live).
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-6, std::ios::end);
    char c;
    f.seekg(-6, std::ios::end);
    f.get(c);
    f.seekp(-6, std::ios::end);
    f.put(static_cast<char>(c ^ 0x40));
  }
  auto [rc2, out2] = run("/usr/bin/python3 " RLH_TEST_SOURCE_DIR "/read_tfevents.py '" + file.string() + "' 2>&1");
  EXPECT_NE(rc2, 0);
  EXPECT_NE(out2.find("bad data CRC"), std::string::npos) << out2;
}

TEST(MetricsLogger, TwoTensorBoardWritersInOneSecondGetDistinctFiles) {
  TempDir tmp("metrics_tb2");
  rlh::sdk::TensorBoardSink a(tmp.path), b(tmp.path);
  EXPECT_NE(a.file(), b.file());
}

TEST(MetricsLogger, UnwritableLogDirIsAnErrorNamingThePath) {
  TempDir tmp("metrics_ro");
  const fs::path blocker = tmp.path / "file";
  std::ofstream(blocker) << "x";
  rlh::sdk::MetricsConfig cfg;
  cfg.log_dir = blocker / "sub";  // a folder under a regular file cannot exist
  cfg.console = false;
  try {
    rlh::sdk::MetricsLogger log(cfg);
    FAIL() << "expected an error";
  } catch (const rlh::sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find(blocker.string()), std::string::npos) << e.what();
  }
}
