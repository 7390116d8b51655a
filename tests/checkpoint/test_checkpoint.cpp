// rlh_checkpoint: the commit protocol, verification, NeMo-RL retention semantics, leftovers, and
// a crash test: a forked writer SIGKILLed at random points, after which every step_N left must be
// complete and resume must find the newest.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "rlhost/sdk/checkpoint.hpp"
#include "rlhost/sdk/status.hpp"

namespace fs = std::filesystem;
using rlh::sdk::CheckpointConfig;
using rlh::sdk::CheckpointManager;
using rlh::sdk::VerifyLevel;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string t = (fs::temp_directory_path() / "rlh_ckpt_XXXXXX").string();
    if (::mkdtemp(t.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = t;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

CheckpointConfig config_in(const fs::path& dir) {
  CheckpointConfig c;
  c.checkpoint_dir = dir;
  c.save_period = 1;
  return c;
}

// Commits step `step` with training_info {"step": step, metric: value} (metric omitted when
// metric is empty).
fs::path save(CheckpointManager& m, int64_t step, const std::string& metric = "", double value = 0) {
  auto p = m.begin(step);
  nlohmann::json info = {{"step", step}};
  if (!metric.empty()) info[metric] = value;
  p.write_training_info(info);
  p.write_config_yaml("grpo:\n  seed: 1\n");
  p.write_file("policy/weights/model.bin", "weights-" + std::to_string(step));
  return p.commit();
}

std::set<int64_t> steps_of(const CheckpointManager& m) {
  std::set<int64_t> s;
  for (const auto& c : m.list()) s.insert(c.step);
  return s;
}

}  // namespace

TEST(Checkpoint, CommitWritesManifestLastAndRenames) {
  TempDir tmp;
  CheckpointManager m(config_in(tmp.path / "ckpt"));
  auto p = m.begin(7);
  EXPECT_EQ(p.dir(), tmp.path / "ckpt" / "tmp_step_7");
  p.write_training_info({{"step", 7}, {"val:accuracy", 0.5}});
  p.write_config_yaml("a: 1\n");
  p.write_file("policy/optimizer/state.bin", std::string(100000, 'x'));
  // A file written by other code through path_for, not fsynced by it.
  {
    std::ofstream out(p.path_for("policy/tokenizer/tokenizer.json"));
    out << "{\"model\": {}}";
  }
  const fs::path dir = p.commit();
  EXPECT_EQ(dir, tmp.path / "ckpt" / "step_7");
  EXPECT_FALSE(fs::exists(tmp.path / "ckpt" / "tmp_step_7"));

  auto manifest = nlohmann::json::parse(read_all(dir / rlh::sdk::kCheckpointManifest));
  EXPECT_EQ(manifest["step"], 7);
  std::vector<std::string> paths;
  for (const auto& f : manifest["files"]) paths.push_back(f["path"]);
  EXPECT_EQ(paths, (std::vector<std::string>{"config.yaml", "policy/optimizer/state.bin",
                                             "policy/tokenizer/tokenizer.json", "training_info.json"}));
  EXPECT_EQ(manifest["files"][1]["size"], 100000);

  auto v = rlh::sdk::verify_checkpoint(dir);
  EXPECT_TRUE(v.ok) << v.error;
  EXPECT_EQ(v.files, 4u);
  auto latest = m.latest();
  ASSERT_TRUE(latest);
  EXPECT_EQ(latest->step, 7);
  EXPECT_DOUBLE_EQ(latest->training_info["val:accuracy"].get<double>(), 0.5);
}

TEST(Checkpoint, AFileRewrittenThroughPathForIsChecksummedAgain) {
  TempDir tmp;
  CheckpointManager m(config_in(tmp.path));
  auto p = m.begin(1);
  p.write_training_info({{"step", 1}});
  p.write_file("w.bin", "aaaa");
  std::ofstream(p.path_for("w.bin"), std::ios::binary | std::ios::trunc) << "bbbb";  // same size
  const fs::path dir = p.commit();
  auto v = rlh::sdk::verify_checkpoint(dir, VerifyLevel::kChecksums);
  EXPECT_TRUE(v.ok) << v.error;
}

TEST(Checkpoint, VerifyFindsEveryKindOfDamage) {
  TempDir tmp;
  CheckpointManager m(config_in(tmp.path));
  const fs::path dir = save(m, 3);
  const fs::path w = dir / "policy/weights/model.bin";
  ASSERT_TRUE(rlh::sdk::verify_checkpoint(dir).ok);

  // Same size, one byte flipped: only the checksum level sees it.
  std::string data = read_all(w);
  data[2] ^= 1;
  std::ofstream(w, std::ios::binary | std::ios::trunc) << data;
  EXPECT_TRUE(rlh::sdk::verify_checkpoint(dir, VerifyLevel::kSizes).ok);
  auto v = rlh::sdk::verify_checkpoint(dir, VerifyLevel::kChecksums);
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.error.find(w.string() + ": CRC32C"), std::string::npos) << v.error;

  std::ofstream(w, std::ios::binary | std::ios::trunc) << "short";
  v = rlh::sdk::verify_checkpoint(dir, VerifyLevel::kSizes);
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.error.find("size 5, manifest says"), std::string::npos) << v.error;

  fs::remove(w);
  v = rlh::sdk::verify_checkpoint(dir, VerifyLevel::kSizes);
  EXPECT_NE(v.error.find("missing (listed in the manifest)"), std::string::npos) << v.error;

  // A damaged step_N is skipped by resume (reported), never deleted.
  std::vector<std::string> skipped;
  EXPECT_TRUE(m.list(VerifyLevel::kSizes, &skipped).empty());
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_TRUE(fs::exists(dir));
  EXPECT_FALSE(m.latest());

  fs::rename(dir, tmp.path / "step_4");
  v = rlh::sdk::verify_checkpoint(tmp.path / "step_4");
  EXPECT_NE(v.error.find("says step 3 but the folder is step_4"), std::string::npos) << v.error;

  fs::create_directories(tmp.path / "step_9");
  v = rlh::sdk::verify_checkpoint(tmp.path / "step_9");
  EXPECT_NE(v.error.find("missing (not a complete checkpoint)"), std::string::npos) << v.error;
}

// Issue 18: resume verifies checksums and step numbers, falls back past a damaged checkpoint,
// and from then on never writes over or removes the newer folders it skipped.
TEST(CheckpointResume, FallsBackPastDamageAndKeepsTheNewerFolders) {
  TempDir tmp;
  CheckpointConfig cfg = config_in(tmp.path);
  cfg.keep_top_k = 1;
  {
    CheckpointManager m(config_in(tmp.path));  // no retention while they are made
    for (int64_t s = 1; s <= 3; ++s) save(m, s);
  }
  // step_3: a weight file changed without changing its size.
  const fs::path w3 = tmp.path / "step_3/policy/weights/model.bin";
  std::string bytes = read_all(w3);
  bytes[0] ^= 1;
  std::ofstream(w3, std::ios::binary | std::ios::trunc) << bytes;
  // step_2: training_info.json edited to another step (same size).
  const fs::path i2 = tmp.path / "step_2/training_info.json";
  std::string info = read_all(i2);
  info[info.find("2")] = '7';
  std::ofstream(i2, std::ios::binary | std::ios::trunc) << info;

  CheckpointManager m(cfg);
  std::vector<std::string> skipped;
  std::vector<int64_t> tried;
  auto loaded = m.resume([&](const rlh::sdk::CheckpointInfo& c) { tried.push_back(c.step); }, &skipped);
  ASSERT_TRUE(loaded);
  EXPECT_EQ(loaded->step, 1);
  EXPECT_EQ(tried, std::vector<int64_t>{1});  // damaged ones are never handed to load
  ASSERT_EQ(skipped.size(), 2u);
  std::string all;
  for (const auto& x : skipped) all += x + "\n";
  EXPECT_NE(all.find(w3.string() + ": CRC32C"), std::string::npos) << all;
  EXPECT_NE(all.find(i2.string() + ": says step 7 but the checkpoint is step 2"), std::string::npos) << all;

  std::string why;
  EXPECT_FALSE(m.may_write(3, &why));
  EXPECT_NE(why.find("newer than the checkpoint this run resumed from (step_1)"), std::string::npos) << why;
  EXPECT_FALSE(m.may_write(2));
  EXPECT_TRUE(m.may_write(4));
  try {
    m.begin(2);
    ADD_FAILURE() << "began a checkpoint over a newer one";
  } catch (const rlh::sdk::Error& e) {
    EXPECT_EQ(e.code(), RLH_E_ALREADY_EXISTS);
  }
  // New checkpoints and retention (keep_top_k=1) leave the skipped folders alone.
  save(m, 4);
  save(m, 5);
  EXPECT_TRUE(read_all(w3) == bytes);
  EXPECT_TRUE(read_all(i2) == info);
  EXPECT_TRUE(fs::exists(tmp.path / "step_2") && fs::exists(tmp.path / "step_3"));
  EXPECT_FALSE(fs::exists(tmp.path / "step_1"));  // superseded by 4 and 5, removed as before
}

TEST(CheckpointResume, ALoadFailureFallsBackOnlyForDamage) {
  TempDir tmp;
  CheckpointManager m(config_in(tmp.path));
  for (int64_t s = 1; s <= 3; ++s) save(m, s);
  std::vector<std::string> skipped;
  bool load_failed = false;
  auto loaded = m.resume(
      [&](const rlh::sdk::CheckpointInfo& c) {
        if (c.step == 3) throw rlh::sdk::Error(RLH_E_DATA_LOSS, "optimizer state of step 9");
      },
      &skipped, &load_failed);
  ASSERT_TRUE(loaded);
  EXPECT_EQ(loaded->step, 2);
  EXPECT_TRUE(load_failed);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].find("step_3: optimizer state of step 9"), std::string::npos) << skipped[0];
  // Another kind of error (a checkpoint of another model) fails every checkpoint the same way:
  // it stops the resume.
  CheckpointManager m2(config_in(tmp.path));
  EXPECT_THROW(m2.resume([](const rlh::sdk::CheckpointInfo&) {
    throw rlh::sdk::Error(RLH_E_FAILED_PRECONDITION, "holds a Qwen2 state");
  }, nullptr), rlh::sdk::Error);
  // None verifies: nothing loaded, and every folder is protected.
  for (int64_t s = 1; s <= 3; ++s) fs::remove(tmp.path / ("step_" + std::to_string(s)) / "training_info.json");
  CheckpointManager m3(config_in(tmp.path));
  skipped.clear();
  EXPECT_FALSE(m3.resume([](const rlh::sdk::CheckpointInfo&) {}, &skipped));
  EXPECT_EQ(skipped.size(), 3u);
  EXPECT_FALSE(m3.may_write(1));
  EXPECT_TRUE(m3.may_write(4));
}

TEST(CheckpointResume, ManifestsAreUntrustedInput) {
  const std::string ok = R"({"format": "rlhost-checkpoint-manifest", "version": 1, "step": 3, "files": [
      {"path": "a/b.bin", "size": 5, "crc32c": "0000abcd"}]})";
  int64_t step = -1;
  std::vector<rlh::sdk::ManifestFile> files;
  EXPECT_EQ(rlh::sdk::parse_manifest(ok, "m", &step, &files), "");
  EXPECT_EQ(step, 3);
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0].crc32c, 0xabcdu);
  auto err = [](const std::string& text) { return rlh::sdk::parse_manifest(text, "m"); };
  EXPECT_NE(err(std::string(100000, '[') + std::string(100000, ']')).find("nesting deeper than 256"), std::string::npos);
  EXPECT_NE(err(R"({"format": "rlhost-checkpoint-manifest", "version": 1, "step": 3, "files": [
      {"path": "../x", "size": 5, "crc32c": "0000abcd"}]})").find("unsafe path"), std::string::npos);
  EXPECT_NE(err(R"({"format": "rlhost-checkpoint-manifest", "version": 1, "step": 3, "files": [
      {"path": "x", "size": 5, "crc32c": "zz"}]})").find("8 hex digits"), std::string::npos);
  EXPECT_NE(err(R"({"format": "rlhost-checkpoint-manifest", "version": 1, "step": -3, "files": []})").find("negative"),
            std::string::npos);
  EXPECT_NE(err(R"({"format": "rlhost-checkpoint-manifest", "version": 2, "step": 3, "files": []})").find("version 2"),
            std::string::npos);
  // Found by fuzz_checkpoint_manifest: a field of another type threw json's type_error (a duplicate
  // key's last value wins) instead of returning the error.
  EXPECT_NE(err(R"({"format": "rlhost-checkpoint-manifest", "version": 1, "step": 3, "format": [], "files": []})")
                .find("not an rlhost checkpoint manifest"),
            std::string::npos);
  // A FIFO in place of the manifest is refused, not waited on.
  TempDir tmp;
  fs::create_directories(tmp.path / "step_1");
  ASSERT_EQ(::mkfifo((tmp.path / "step_1" / rlh::sdk::kCheckpointManifest).c_str(), 0600), 0);
  const auto v = rlh::sdk::verify_checkpoint(tmp.path / "step_1");
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.error.find("is a FIFO, not a regular file"), std::string::npos) << v.error;
}

TEST(Checkpoint, ResavingAStepReplacesItAtomically) {
  TempDir tmp;
  CheckpointManager m(config_in(tmp.path));
  save(m, 5);
  auto p = m.begin(5);
  p.write_training_info({{"step", 5}, {"again", true}});
  p.write_file("other.bin", "new");
  const fs::path dir = p.commit();
  EXPECT_TRUE(rlh::sdk::verify_checkpoint(dir).ok);
  EXPECT_FALSE(fs::exists(dir / "policy"));  // nothing of the old contents is left inside
  EXPECT_EQ(read_all(dir / "other.bin"), "new");
  for (const auto& e : fs::directory_iterator(tmp.path)) EXPECT_EQ(e.path().filename(), "step_5");
}

TEST(Checkpoint, BadUseIsAnErrorNamingTheProblem) {
  TempDir tmp;
  CheckpointManager m(config_in(tmp.path));
  auto p = m.begin(1);
  for (const char* bad : {"../escape", "/abs", "", "a/../../b", rlh::sdk::kCheckpointManifest}) {
    try {
      p.path_for(bad);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const rlh::sdk::Error& e) {
      EXPECT_EQ(e.code(), RLH_E_INVALID_ARGUMENT);
      EXPECT_NE(std::string(e.what()).find("bad file path"), std::string::npos);
    }
  }
  try {
    p.commit();
    ADD_FAILURE() << "committed without training_info.json";
  } catch (const rlh::sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("training_info.json was not written"), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, AbandonedPendingCheckpointIsRemoved) {
  TempDir tmp;
  CheckpointManager m(config_in(tmp.path));
  {
    auto p = m.begin(2);
    p.write_file("x.bin", "x");
    EXPECT_TRUE(fs::exists(tmp.path / "tmp_step_2"));
  }
  EXPECT_FALSE(fs::exists(tmp.path / "tmp_step_2"));
}

TEST(Checkpoint, ConfigFromNemoRlSection) {
  auto c = CheckpointConfig::from_json(nlohmann::json::parse(R"({"enabled": true,
      "checkpoint_dir": "results/grpo", "metric_name": "val:accuracy", "higher_is_better": true,
      "keep_top_k": 3, "save_period": 10, "model_save_format": "safetensors", "save_consolidated": true})"));
  EXPECT_EQ(c.checkpoint_dir, fs::path("results/grpo"));
  EXPECT_EQ(c.metric_name, "val:accuracy");
  EXPECT_EQ(c.keep_top_k, 3);
  EXPECT_EQ(c.save_period, 10);
  EXPECT_FALSE(c.ft_keep_latest_k);
  auto err = [](const char* text) {
    try {
      CheckpointConfig::from_json(nlohmann::json::parse(text));
    } catch (const rlh::sdk::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(err(R"({"metric_name": "accuracy"})"),
            "checkpointing.metric_name: must start with 'val:' or 'train:' (e.g. 'val:accuracy'), got \"accuracy\"");
  EXPECT_EQ(err(R"({"keep_top_k": "3"})"), "checkpointing.keep_top_k: expected an integer >= 0 or null, got \"3\"");
  EXPECT_EQ(err(R"({"save_period": 0})"), "checkpointing.save_period: expected an integer >= 1 or null, got 0");
  EXPECT_EQ(err(R"({"higher_is_better": 1})"), "checkpointing.higher_is_better: expected true or false, got 1");
  auto null_metric = CheckpointConfig::from_json(nlohmann::json::parse(R"({"metric_name": null, "keep_top_k": null})"));
  EXPECT_TRUE(null_metric.metric_name.empty());
  EXPECT_FALSE(null_metric.keep_top_k);
}

// checkpointing.ft_save_period and checkpoint_must_save_by ("DD:HH:MM:SS", NeMo-RL's
// convert_to_seconds: no field bounded to its unit's range).
TEST(Checkpoint, FaultToleranceSavesAndTheSaveDeadlineAreRead) {
  auto c = CheckpointConfig::from_json(nlohmann::json::parse(
      R"({"save_period": 10, "ft_save_period": 3, "checkpoint_must_save_by": "01:03:45:07"})"));
  EXPECT_EQ(c.ft_save_period, 3);
  EXPECT_EQ(c.must_save_by_s, 86400 + 3 * 3600 + 45 * 60 + 7);
  EXPECT_EQ(CheckpointConfig::from_json(nlohmann::json::parse(R"({"checkpoint_must_save_by": "00:00:90:00"})"))
                .must_save_by_s,
            5400);
  auto none = CheckpointConfig::from_json(nlohmann::json::parse(R"({"ft_save_period": null, "checkpoint_must_save_by": null})"));
  EXPECT_FALSE(none.ft_save_period);
  EXPECT_FALSE(none.must_save_by_s);
  CheckpointManager m(c);
  std::vector<int64_t> saved;
  for (int64_t s = 1; s <= 12; ++s)
    if (m.is_save_step(s)) saved.push_back(s);
  EXPECT_EQ(saved, (std::vector<int64_t>{3, 6, 9, 10, 12}));
  EXPECT_FALSE(m.is_periodic(3));  // retention keeps a fault-tolerance save only by ft_keep_latest_k
  for (const char* bad : {R"("03:45:00")", R"("00:03:45:00:00")", R"("00:03:4a:00")", R"("00:-3:45:00")",
                          R"("00::45:00")", R"("00:03:45:00 ")", R"("0000000000:03:45:00")", R"(13500)", R"(true)"}) {
    std::string err = "no error";
    try {
      CheckpointConfig::from_json(nlohmann::json::parse(std::string(R"({"checkpoint_must_save_by": )") + bad + "}"));
    } catch (const rlh::sdk::Error& e) {
      err = e.what();
    }
    EXPECT_EQ(err, std::string("checkpointing.checkpoint_must_save_by: expected \"DD:HH:MM:SS\" (e.g. \"00:03:45:00\") "
                               "or null, got ") + bad);
  }
  try {
    CheckpointConfig::from_json(nlohmann::json::parse(R"({"ft_save_period": 0})"));
    ADD_FAILURE() << "ft_save_period 0 accepted";
  } catch (const rlh::sdk::Error& e) {
    EXPECT_STREQ(e.what(), "checkpointing.ft_save_period: expected an integer >= 1 or null, got 0");
  }
}

// NeMo-RL's TimeoutChecker with fit_last_save_time: due once the time since the start plus the
// mean step time reaches the budget, and only once.
TEST(Checkpoint, SaveDeadlineFitsTheNextStep) {
  double now = 100.0;
  rlh::sdk::SaveDeadline d(60, [&] { return now; });
  EXPECT_TRUE(d.armed());
  EXPECT_FALSE(d.due());  // nothing elapsed, no step yet
  now += 20;              // a step of 20 s: 20 + 20 < 60
  d.mark_step();
  EXPECT_FALSE(d.due());
  now += 10;              // steps of 20 and 10 s: 30 + 15 < 60
  d.mark_step();
  EXPECT_FALSE(d.due());
  now += 16;              // 46 + mean 15.33 >= 60: the next step would pass the budget
  d.mark_step();
  EXPECT_TRUE(d.due());
  EXPECT_FALSE(d.due());  // once
  rlh::sdk::SaveDeadline late(10, [&] { return now; });
  now += 11;              // past the budget before any step: due without a step time
  EXPECT_TRUE(late.due());
  rlh::sdk::SaveDeadline off(std::nullopt, [&] { return now; });
  now += 1e9;
  off.mark_step();
  EXPECT_FALSE(off.armed());
  EXPECT_FALSE(off.due());
}

// NeMo-RL's remove_old_checkpoints: the best k periodic checkpoints by metric plus the latest.
TEST(Checkpoint, KeepTopKByMetricHigherIsBetter) {
  TempDir tmp;
  auto cfg = config_in(tmp.path);
  cfg.metric_name = "val:accuracy";
  cfg.keep_top_k = 2;
  CheckpointManager m(cfg);
  const double acc[] = {0.1, 0.5, 0.3, 0.9, 0.2};
  for (int s = 1; s <= 5; ++s) save(m, s, "val:accuracy", acc[s - 1]);
  EXPECT_EQ(steps_of(m), (std::set<int64_t>{2, 4, 5}));  // best two (4, 2) + latest (5)
  EXPECT_EQ(m.best()->step, 4);
}

TEST(Checkpoint, KeepTopKLowerIsBetterTiesPreferNewerMissingMetricIsWorst) {
  TempDir tmp;
  auto cfg = config_in(tmp.path);
  cfg.metric_name = "train:loss";
  cfg.higher_is_better = false;
  cfg.keep_top_k = 2;
  CheckpointManager m(cfg);
  save(m, 1, "train:loss", 0.5);
  save(m, 2, "train:loss", 0.2);
  save(m, 3, "train:loss", 0.2);  // ties step 2: the newer wins
  save(m, 4, "train:loss", 0.1);
  save(m, 5);                     // no metric: ranked last, kept only as the latest
  EXPECT_EQ(steps_of(m), (std::set<int64_t>{3, 4, 5}));
  EXPECT_EQ(m.best()->step, 4);
  save(m, 6, "train:loss", 0.9);  // 5 is no longer the latest and had no metric
  EXPECT_EQ(steps_of(m), (std::set<int64_t>{3, 4, 6}));
}

TEST(Checkpoint, RetentionOnlyRanksPeriodicStepsAndRecencyWithoutMetric) {
  TempDir tmp;
  auto cfg = config_in(tmp.path);
  cfg.save_period = 2;
  cfg.keep_top_k = 2;  // no metric: the two most recent periodic ones
  CheckpointManager m(cfg);
  for (int s = 1; s <= 7; ++s) save(m, s);
  EXPECT_EQ(steps_of(m), (std::set<int64_t>{4, 6, 7}));
}

TEST(Checkpoint, FtKeepLatestKAndNoRetention) {
  TempDir tmp;
  auto cfg = config_in(tmp.path / "a");
  cfg.save_period = 3;
  cfg.ft_keep_latest_k = 2;  // keep_top_k null: every periodic one stays, plus the latest two
  CheckpointManager m(cfg);
  for (int s = 1; s <= 8; ++s) save(m, s);
  EXPECT_EQ(steps_of(m), (std::set<int64_t>{3, 6, 7, 8}));

  CheckpointManager all(config_in(tmp.path / "b"));  // neither set: NeMo-RL keeps everything
  for (int s = 1; s <= 4; ++s) save(all, s);
  EXPECT_EQ(steps_of(all).size(), 4u);
}

TEST(Checkpoint, BestFallsBackToLatestWithoutMetric) {
  TempDir tmp;
  auto cfg = config_in(tmp.path);
  cfg.metric_name = "val:accuracy";
  CheckpointManager m(cfg);
  EXPECT_FALSE(m.best());
  save(m, 1);
  save(m, 2);
  EXPECT_EQ(m.best()->step, 2);
  save(m, 3, "val:accuracy", 0.1);
  EXPECT_EQ(m.best()->step, 3);  // the only one with the metric
}

TEST(Checkpoint, CleanLeftoversRemovesPartialsAndRestoresAnInterruptedSwap) {
  TempDir tmp;
  CheckpointManager m(config_in(tmp.path));
  save(m, 1);
  save(m, 7);
  fs::rename(tmp.path / "step_7", tmp.path / "old_step_7");  // died between fallback renames
  fs::create_directories(tmp.path / "tmp_step_8/policy");
  fs::create_directories(tmp.path / "removing_step_2");
  fs::create_directories(tmp.path / "old_step_1");  // step_1 exists: the old copy goes
  fs::create_directories(tmp.path / "step_x");      // not ours: untouched
  EXPECT_EQ(m.clean_leftovers(), 3u);
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(tmp.path)) names.insert(e.path().filename());
  EXPECT_EQ(names, (std::set<std::string>{"step_1", "step_7", "step_x"}));
  EXPECT_EQ(m.latest()->step, 7);
}

// ---- crash test ------------------------------------------------------------------------------

namespace {

// Deterministic contents of step s, so the parent can check every surviving file byte for byte.
std::string shard_bytes(int64_t step, int shard) {
  std::mt19937_64 rng(static_cast<uint64_t>(step) * 131 + shard);
  std::string s(rng() % 150000, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}
double accuracy_of(int64_t step) { return static_cast<double>((step * 7919) % 101) / 100.0; }

[[noreturn]] void writer_loop(const CheckpointConfig& cfg, int64_t start) {
  try {
    CheckpointManager m(cfg);
    for (int64_t step = start;; ++step) {
      // Every 5th step is saved twice, to be killed inside the replace path too.
      for (int rep = 0; rep < (step % 5 == 0 ? 2 : 1); ++rep) {
        auto p = m.begin(step);
        p.write_training_info({{"step", step}, {"val:accuracy", accuracy_of(step)}});
        p.write_config_yaml("grpo:\n  max_num_steps: 1000\n");
        for (int shard = 0; shard < 3; ++shard)
          p.write_file("policy/weights/shard_" + std::to_string(shard) + ".bin", shard_bytes(step, shard));
        // Written by "another writer" with stdio, fsynced only by commit().
        std::FILE* f = std::fopen(p.path_for("policy/optimizer/state.bin").c_str(), "wb");
        const std::string opt = shard_bytes(step, 9);
        if (f == nullptr || std::fwrite(opt.data(), 1, opt.size(), f) != opt.size() || std::fclose(f) != 0) _exit(4);
        p.commit();
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "writer: %s\n", e.what());
    _exit(3);
  }
}

// Every step_N must be complete, checksummed and hold exactly what the writer wrote.
void check_survivors(const fs::path& root, int kill_no) {
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename();
    if (name.rfind("step_", 0) != 0) continue;
    auto v = rlh::sdk::verify_checkpoint(e.path(), VerifyLevel::kChecksums);
    ASSERT_TRUE(v.ok) << "after kill " << kill_no << ": " << v.error;
    const int64_t step = std::stoll(name.substr(5));
    auto info = nlohmann::json::parse(read_all(e.path() / "training_info.json"));
    ASSERT_EQ(info["step"], step);
    for (int shard = 0; shard < 3; ++shard)
      ASSERT_EQ(read_all(e.path() / ("policy/weights/shard_" + std::to_string(shard) + ".bin")), shard_bytes(step, shard))
          << name;
    ASSERT_EQ(read_all(e.path() / "policy/optimizer/state.bin"), shard_bytes(step, 9)) << name;
  }
}

}  // namespace

TEST(CheckpointCrash, SigkillAtRandomPointsNeverLeavesAPartialCheckpoint) {
  TempDir tmp;
  CheckpointConfig cfg = config_in(tmp.path / "ckpt");
  cfg.metric_name = "val:accuracy";
  cfg.keep_top_k = 3;
  CheckpointManager m(cfg);
  std::mt19937 rng(12345);
  // Kill delays scale with how long one save takes here (fsync speed varies by machine and
  // load): uniform in [0, 3 saves], so kills land in every phase and the writer still advances.
  int save_us = 0;
  {
    auto c = cfg;
    c.checkpoint_dir = tmp.path / "calibrate";
    const auto s0 = std::chrono::steady_clock::now();
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      std::signal(SIGALRM, SIG_DFL);
      ::alarm(20);
      try {
        CheckpointManager cm(c);
        for (int64_t step = 0; step < 3; ++step) {
          auto p = cm.begin(step);
          p.write_training_info({{"step", step}});
          for (int shard = 0; shard < 4; ++shard)
            p.write_file("s" + std::to_string(shard), shard_bytes(step, shard));
          p.commit();
        }
      } catch (...) {
        _exit(3);
      }
      _exit(0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    save_us = static_cast<int>(std::chrono::duration_cast<std::chrono::microseconds>(
                                   std::chrono::steady_clock::now() - s0).count() / 3);
  }
  const auto t0 = std::chrono::steady_clock::now();
  int kills = 0, leftovers_seen = 0;
  int64_t last_resumed = -1;
  std::fflush(nullptr);  // nothing buffered gets written twice by the child
  // Up to 200 kills in 30 s, but never fewer than 50 however slow the machine is (ASan on a
  // loaded 2-core machine managed 11 in 30 s): the count below is what the test needs, not a
  // speed. 600 s is only a backstop for a writer that stopped making progress.
  auto more = [&] {
    const auto spent = std::chrono::steady_clock::now() - t0;
    if (spent > std::chrono::seconds(600)) return false;
    return kills < 50 || (kills < 200 && spent < std::chrono::seconds(30));
  };
  while (more()) {
    auto latest = m.latest(VerifyLevel::kSizes);
    const int64_t start = latest ? latest->step + 1 : 0;
    ASSERT_GE(start, last_resumed) << "resume went backwards";
    last_resumed = start;
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) writer_loop(cfg, start);
    ::usleep(std::uniform_int_distribution<int>(0, 3 * save_us)(rng));
    ::kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "writer failed, status " << status;
    ++kills;

    ASSERT_NO_FATAL_FAILURE(check_survivors(cfg.checkpoint_dir, kills));
    // Resume sees the newest complete step_N.
    auto now_latest = m.latest(VerifyLevel::kChecksums);
    std::set<int64_t> steps;
    for (const auto& e : fs::directory_iterator(cfg.checkpoint_dir)) {
      const std::string name = e.path().filename();
      if (name.rfind("step_", 0) == 0) steps.insert(std::stoll(name.substr(5)));
      if (name.rfind("tmp_step_", 0) == 0 || name.rfind("removing_step_", 0) == 0 || name.rfind("old_step_", 0) == 0)
        ++leftovers_seen;
    }
    if (!steps.empty()) {
      ASSERT_TRUE(now_latest);
      EXPECT_EQ(now_latest->step, *steps.rbegin());
      // A kill between a commit's rename and its retention leaves extra checkpoints; one
      // retention pass then keeps exactly the 3 best by val:accuracy (ties: newer) + the latest.
      std::vector<int64_t> ranked(steps.begin(), steps.end());
      std::sort(ranked.begin(), ranked.end(), [](int64_t a, int64_t b) {
        return accuracy_of(a) != accuracy_of(b) ? accuracy_of(a) > accuracy_of(b) : a > b;
      });
      std::set<int64_t> expected(ranked.begin(), ranked.begin() + std::min<size_t>(3, ranked.size()));
      expected.insert(*steps.rbegin());
      m.remove_old_checkpoints();
      std::set<int64_t> after;
      for (const auto& c : m.list()) after.insert(c.step);
      ASSERT_EQ(after, expected) << "after kill " << kills;
    }
    m.clean_leftovers();
    for (const auto& e : fs::directory_iterator(cfg.checkpoint_dir))
      EXPECT_EQ(e.path().filename().string().rfind("step_", 0), 0u) << e.path();
  }
  const auto secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("one save ~%d us; %d kills in %.1f s; resumed up to step %lld; %d kills left partial folders\n",
              save_us, kills, secs,
              static_cast<long long>(last_resumed), leftovers_seen);
  EXPECT_GE(kills, 50);
  EXPECT_GE(last_resumed, 10) << "the writer made too little progress to test anything";
  EXPECT_GT(leftovers_seen, 0) << "no kill landed inside a write";
}
