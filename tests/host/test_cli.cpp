// The rlhost command line: every bad input is one line on stderr naming it, and a non-zero exit.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

namespace fs = std::filesystem;

namespace {

struct Result {
  int code = -1;
  std::string out, err;
};

// Runs rlhost with `args` (shell words), capturing stdout and stderr separately.
Result run(const std::string& args) {
  static int n = 0;
  fs::path err_file = fs::temp_directory_path() / ("rlh_cli_err_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
  std::string cmd = std::string(RLHOST_EXE) + " " + args + " 2>" + err_file.string();
  Result r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf{};
  size_t got;
  while ((got = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), got);
  int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(err_file);
  r.err.assign(std::istreambuf_iterator<char>(in), {});
  fs::remove(err_file);
  return r;
}

// The last stderr line (warnings may precede the error).
std::string last_line(const std::string& s) {
  std::string t = s;
  while (!t.empty() && t.back() == '\n') t.pop_back();
  size_t nl = t.rfind('\n');
  return nl == std::string::npos ? t : t.substr(nl + 1);
}

void expect_one_line_error(const Result& r, const std::string& needle) {
  EXPECT_NE(r.code, 0) << r.err;
  std::string line = last_line(r.err);
  EXPECT_NE(line.find("error"), std::string::npos) << r.err;
  EXPECT_NE(line.find(needle), std::string::npos) << "wanted '" << needle << "' in: " << r.err;
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("rlh_cli_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    std::ofstream(dir_ / "good.yaml") << "grpo:\n  num_prompts_per_step: 4\npolicy:\n  max_total_sequence_length: 64\n"
                                         "  train_global_batch_size: ${mul:${grpo.num_prompts_per_step},2}\n";
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const char* name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

TEST_F(CliTest, HelpAndVersion) {
  Result r = run("--help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("usage: rlhost"), std::string::npos);
  r = run("--version");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("plugin ABI 0."), std::string::npos);
}

TEST_F(CliTest, PrintConfigResolves) {
  Result r = run("--print-config --config " + path("good.yaml") +
                 " grpo.num_prompts_per_step=8 ++logger.wandb.project=xyz ++logger.mlflow_enabled=true");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("train_global_batch_size: 16"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("project: xyz"), std::string::npos) << r.out;
  // NeMo-RL keys rlhost accepts without acting on them give one warning line, not an error;
  // one a run would refuse is said too, and printing the config still works.
  EXPECT_NE(r.err.find("NeMo-RL setting(s) that rlhost does not implement are accepted"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("a run refuses this: config key 'logger.mlflow_enabled' = true"), std::string::npos) << r.err;
  // A run, and --check-config, stop on it at start: one line naming the key, value and what is missing.
  Result c = run("--check-config --config " + path("good.yaml") + " ++logger.mlflow_enabled=true");
  expect_one_line_error(c, "config key 'logger.mlflow_enabled' = true (from command line) needs MLflow");
  EXPECT_NE(c.out.find("\"refused\""), std::string::npos) << c.out;
  // The cluster's size is checked against the launcher's world (here none: one process).
  expect_one_line_error(run("--check-config --config " + path("good.yaml") + " ++cluster.num_nodes=4"),
                        "cluster.num_nodes = 4 (from command line), but no launcher (one rank) spans 1 node");
  Result ok = run("--check-config --config " + path("good.yaml") + " ++logger.wandb_enabled=false");
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_NE(ok.out.find("logger.wandb_enabled=false"), std::string::npos) << ok.out;
  expect_one_line_error(run("--check-config --config " + path("good.yaml") + " ++logger.wandb_enabled=true"),
                        "config key 'logger.wandb_enabled' = true (from command line) needs Weights & Biases logging");
  // FP8 training without an FP8 provider loaded: refused at start, naming what provides it.
  expect_one_line_error(run("--check-config --config " + path("good.yaml") + " ++policy.megatron_cfg.fp8_cfg.enabled=true"),
                        "config key 'policy.megatron_cfg.fp8_cfg.enabled' = true (from command line) needs FP8 training");
  Result fp8 = run("--check-config --config " + path("good.yaml") + " ++policy.megatron_cfg.fp8_cfg.enabled=true");
  EXPECT_NE(fp8.err.find("no loaded plugin claims policy.megatron_cfg.fp8_cfg.*"), std::string::npos) << fp8.err;
  Result fp8_off = run("--check-config --config " + path("good.yaml") + " ++policy.megatron_cfg.fp8_cfg.enabled=false");
  EXPECT_EQ(fp8_off.code, 0) << fp8_off.err;
}

TEST_F(CliTest, BadInputsAreOneLineErrors) {
  expect_one_line_error(run("--bogus-flag"), "--bogus-flag");
  expect_one_line_error(run("--config"), "config");
  expect_one_line_error(run("--config " + path("missing.yaml")), "missing.yaml' does not exist");
  std::ofstream(path("bad.yaml")) << "a: [1,\n";
  expect_one_line_error(run("--print-config --config " + path("bad.yaml")), "bad.yaml: line");
  expect_one_line_error(run("--print-config --config " + path("good.yaml") + " grpo.nope=1"), "'grpo.nope' is not in the config");
  expect_one_line_error(run("--print-config --config " + path("good.yaml") + " grpo.num_prompts_per_step=x"), "expects an integer");
  expect_one_line_error(run("--print-config --config " + path("good.yaml") + " notanoverride"), "unexpected argument 'notanoverride'");
  expect_one_line_error(run("--print-config --config " + path("good.yaml") + " ++polcy.x=1"), "unknown config key 'polcy.x'");
  std::ofstream(path("typo.yaml")) << "policy:\n  train_global_batch_sise: 4\n";
  Result typo = run("--print-config --config " + path("typo.yaml"));
  expect_one_line_error(typo, "did you mean 'policy.train_global_batch_size'");
  EXPECT_NE(last_line(typo.err).find("typo.yaml"), std::string::npos) << typo.err;
  expect_one_line_error(run("--plugin no_such_plugin --config " + path("good.yaml")), "plugin 'no_such_plugin' not found");
  expect_one_line_error(run("--plugin /nonexistent/libx.so --config " + path("good.yaml")), "no such file");
  expect_one_line_error(run("--log-level loud --config " + path("good.yaml")), "--log-level 'loud'");
  expect_one_line_error(run("--config " + path("good.yaml")), "no algorithm component is loaded");
  expect_one_line_error(run("tokenize --text hi"), "--tokenizer is required");
}

// Listing still shows a plugin that failed to load, and the exit code says so (scripts notice).
TEST_F(CliTest, ListingWithAMissingPluginExitsNonZeroAfterListing) {
  Result r = run("--plugin missing.so --list-plugins");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("missing.so"), std::string::npos) << r.out;  // listed, with its reason
  expect_one_line_error(r, "missing.so");
  Result j = run("--plugin /nonexistent/libx.so --list-plugins --json");
  EXPECT_NE(j.code, 0);
  EXPECT_NE(j.out.find("\"loaded\": false"), std::string::npos) << j.out;
  EXPECT_EQ(run("--list-plugins").code, 0);
}

TEST_F(CliTest, NonPluginLibraryIsRefused) {
  // A shared library that is not a plugin (no entry symbol).
  Result r = run("--plugin /lib/x86_64-linux-gnu/libz.so.1 --config " + path("good.yaml"));
  expect_one_line_error(r, "no entry symbol");
}

}  // namespace
