// `rlhost logprobs` end to end: the rlhost binary on the llama-tiny fixture, compared with the HF
// reference's token_logprobs (<= 1e-5), through both backends; --text through the tokenizer next
// to the model; --temperature against the backend's own forward at that temperature; and every
// bad input as one line on stderr naming it, with a non-zero exit.
#include <sys/wait.h>

#include <array>
#include <cstdio>

#include "backend_harness.hpp"
#include "rlhost/sdk/safetensors.hpp"

namespace fs = std::filesystem;
using namespace rlh;
using namespace rlh::test;
using json = nlohmann::json;

namespace {

struct Result {
  int code = -1;
  std::string out, err;
};

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Runs rlhost with `args` (already quoted shell words), capturing stdout and stderr.
Result run_prefixed(const std::string& prefix, const std::string& args) {
  static int n = 0;
  const fs::path err_file = fs::temp_directory_path() / ("rlh_lp_err_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
  const std::string cmd = prefix + std::string(RLHOST_EXE) + " " + args + " 2>" + err_file.string();
  Result r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf{};
  size_t got;
  while ((got = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), got);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(err_file);
  r.err.assign(std::istreambuf_iterator<char>(in), {});
  fs::remove(err_file);
  return r;
}

Result run(const std::string& args) { return run_prefixed("", args); }

// As run(), with environment assignments ("A=b ") in front of the command.
Result run_env(const std::string& env, const std::string& args) { return run_prefixed("env " + env, args); }

void expect_one_line_error(const Result& r, const std::string& needle) {
  EXPECT_NE(r.code, 0) << r.out;
  std::string e = r.err;
  while (!e.empty() && e.back() == '\n') e.pop_back();
  EXPECT_EQ(e.find('\n'), std::string::npos) << "one line: " << r.err;
  EXPECT_NE(e.find("error"), std::string::npos) << r.err;
  EXPECT_NE(e.find(needle), std::string::npos) << "wanted '" << needle << "' in: " << r.err;
}

std::string llama_tiny() { return fixtures_root() + "/llama-tiny"; }

std::string id_list(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

class TempDir {
 public:
  explicit TempDir(const std::string& tag)
      : path(fs::temp_directory_path() / ("rlh_lp_" + tag + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  fs::path path;
};

class LogprobsCli : public ::testing::TestWithParam<std::string> {};

TEST_P(LogprobsCli, IdsMatchTheHuggingFaceReference) {
  const auto ref = sdk::st::File::open(llama_tiny() + "/reference.safetensors");
  const int64_t T = ref.at("input_ids").shape[1];
  const std::vector<double> ids64 = ref.read_f64("input_ids"), lp64 = ref.read_f64("token_logprobs");
  for (int64_t row = 0; row < 2; ++row) {
    const std::vector<int32_t> ids(ids64.begin() + row * T, ids64.begin() + (row + 1) * T);
    const std::vector<double> want(lp64.begin() + row * (T - 1), lp64.begin() + (row + 1) * (T - 1));
    const Result r = run("logprobs --model " + quote(llama_tiny()) + " --backend " + GetParam() + " --json --ids " + id_list(ids));
    ASSERT_EQ(r.code, 0) << r.err;
    const json j = json::parse(r.out);
    EXPECT_EQ(j["ids"].get<std::vector<int32_t>>(), ids);
    const std::vector<double> got = j["token_logprobs"].get<std::vector<double>>();
    ASSERT_EQ(got.size(), want.size());
    double maxerr = 0, maxref = 0, loss = 0;
    for (size_t t = 0; t < want.size(); ++t) {
      maxerr = std::max(maxerr, std::fabs(got[t] - want[t]));
      maxref = std::max(maxref, std::fabs(want[t]));
      loss -= want[t] / double(want.size());
    }
    EXPECT_LE(maxerr / maxref, 1e-5) << "row " << row;
    EXPECT_LE(std::fabs(j["loss"].get<double>() - loss) / loss, 1e-5) << "row " << row;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, LogprobsCli, ::testing::Values("dtensor", "megatron"));

TEST(LogprobsCliText, TokenizesWithTheModelsTokenizerAndPrintsATable) {
  // llama-tiny with the llama3-style fixture tokenizer beside it; this text encodes to ids < 512.
  TempDir dir("text");
  for (const char* f : {"config.json", "model.safetensors"}) fs::create_symlink(fs::path(llama_tiny()) / f, dir.path / f);
  fs::create_symlink(fs::path(fixtures_root()) / "tokenizer-llama3/tokenizer.json", dir.path / "tokenizer.json");
  const std::string text = "中文字符测试，还有标点。";
  const Result tok = run("tokenize --tokenizer " + quote(dir.path.string()) + " --json --text " + quote(text));
  ASSERT_EQ(tok.code, 0) << tok.err;
  const std::vector<int32_t> ids = json::parse(tok.out)["ids"].get<std::vector<int32_t>>();
  ASSERT_GE(ids.size(), 10u);
  const Result by_text = run("logprobs --model " + quote(dir.path.string()) + " --json --text " + quote(text));
  ASSERT_EQ(by_text.code, 0) << by_text.err;
  const Result by_ids = run("logprobs --model " + quote(dir.path.string()) + " --json --ids " + id_list(ids));
  ASSERT_EQ(by_ids.code, 0) << by_ids.err;
  EXPECT_EQ(json::parse(by_text.out), json::parse(by_ids.out));
  EXPECT_EQ(json::parse(by_text.out)["ids"].get<std::vector<int32_t>>(), ids);

  const Result table = run("logprobs --model " + quote(dir.path.string()) + " --text " + quote(text));
  ASSERT_EQ(table.code, 0) << table.err;
  EXPECT_NE(table.out.find("mean loss over " + std::to_string(ids.size() - 1) + " predicted tokens"), std::string::npos)
      << table.out;
  EXPECT_NE(table.out.find("position"), std::string::npos);
  // One row per predicted token, after the header, before the loss line.
  EXPECT_EQ(size_t(std::count(table.out.begin(), table.out.end(), '\n')), ids.size() + 1) << table.out;
}

TEST(LogprobsCliText, TemperatureMatchesTheBackendsForward) {
  const std::vector<int32_t> ids = {5, 17, 42, 7, 300, 11, 96, 2};
  const Result r1 = run("logprobs --model " + quote(llama_tiny()) + " --json --ids " + id_list(ids));
  const Result r2 = run("logprobs --model " + quote(llama_tiny()) + " --json --temperature 2.5 --ids " + id_list(ids));
  ASSERT_EQ(r1.code, 0) << r1.err;
  ASSERT_EQ(r2.code, 0) << r2.err;
  const auto lp1 = json::parse(r1.out)["token_logprobs"].get<std::vector<double>>();
  const auto lp2 = json::parse(r2.out)["token_logprobs"].get<std::vector<double>>();
  EXPECT_NE(lp1, lp2);
  Host host({"model_llama", "kernels_cpu", "dtensor"});
  Backend be(host, "dtensor");
  rlh_model* m = be.load(llama_tiny(), false);
  Batch batch(ids, {0, int64_t(ids.size())});
  const std::vector<float> want = be.logprobs(m, batch, 2.5);
  ASSERT_EQ(lp2.size(), ids.size() - 1);
  for (size_t t = 0; t + 1 < ids.size(); ++t) EXPECT_EQ(float(lp2[t]), want[t + 1]) << t;
}

// --device and --precision are the backend's policy.device and policy.precision: on the CPU the
// same scores; a GPU that is not there is a one-line error naming the device.
TEST(LogprobsCliDevice, DeviceAndPrecisionReachTheBackend) {
  const std::vector<int32_t> ids = {5, 17, 42, 7, 300, 11};
  const std::string base = "logprobs --model " + quote(llama_tiny()) + " --json --ids " + id_list(ids);
  const Result plain = run(base);
  ASSERT_EQ(plain.code, 0) << plain.err;
  for (const char* b : {"dtensor", "megatron"}) {
    const Result cpu = run(base + " --backend " + b + " --device cpu --precision float32");
    ASSERT_EQ(cpu.code, 0) << cpu.err;
    EXPECT_EQ(json::parse(cpu.out)["token_logprobs"], json::parse(plain.out)["token_logprobs"]) << b;
  }
  expect_one_line_error(run(base + " --device tpu"), "tpu");
  expect_one_line_error(run(base + " --precision int3"), "int3");
  // Both backends' device path (megatron is the default with --device cuda) needs a usable GPU.
  if (!std::getenv("RLH_TEST_HAS_GPU")) {
    expect_one_line_error(run(base + " --backend dtensor --device cuda"), "cuda");
    expect_one_line_error(run(base + " --device cuda"), "cuda");
  }
}

// A hub id resolves in the local HF cache ($HF_HUB_CACHE/models--org--name/snapshots/<rev>).
TEST(LogprobsCliDevice, HubIdFromTheLocalCache) {
  TempDir cache("hub");
  const fs::path snap = cache.path / "models--rlhost-test--llama-tiny" / "snapshots" / "0123abcd";
  fs::create_directories(snap);
  fs::create_directories(cache.path / "models--rlhost-test--llama-tiny" / "refs");
  std::ofstream(cache.path / "models--rlhost-test--llama-tiny" / "refs" / "main") << "0123abcd";
  for (const char* f : {"config.json", "model.safetensors"}) fs::create_symlink(fs::path(llama_tiny()) / f, snap / f);
  const std::string ids = " --json --ids 5,17,42,7";
  const std::string env = "HF_HUB_CACHE=" + quote(cache.path.string()) + " ";
  const Result by_dir = run("logprobs --model " + quote(llama_tiny()) + ids);
  ASSERT_EQ(by_dir.code, 0) << by_dir.err;
  // run() prefixes the binary; an environment assignment goes before it through env(1).
  const Result by_id = run_env(env, "logprobs --model rlhost-test/llama-tiny" + ids);
  ASSERT_EQ(by_id.code, 0) << by_id.err;
  EXPECT_EQ(json::parse(by_id.out), json::parse(by_dir.out));
  const Result gen = run_env(env, "generate --model rlhost-test/llama-tiny --prompt-ids 5,17,42 --temperature 0 "
                                  "--max-new-tokens 4 --ignore-eos --json");
  ASSERT_EQ(gen.code, 0) << gen.err;
  EXPECT_EQ(json::parse(gen.out)["ids"].size(), 7u) << gen.out;
  expect_one_line_error(run_env(env, "logprobs --model rlhost-test/not-cached" + ids), "rlhost-test/not-cached");
}

// generate --device cuda needs a usable GPU (and a build with the CUDA path): without one it is a
// one-line error naming the device; precisions the device does not sample in are refused by name.
TEST(GenerateCliDevice, RefusesWhatTheGeneratorLacks) {
  const std::string base = "generate --model " + quote(llama_tiny()) + " --prompt-ids 5,17 --max-new-tokens 2";
  if (!std::getenv("RLH_TEST_HAS_GPU")) expect_one_line_error(run(base + " --device cuda"), "cuda");
  expect_one_line_error(run(base + " --device cuda:7"), "cuda:7");
  expect_one_line_error(run(base + " --precision bfloat16"), "samples in float32 on the CPU");
  expect_one_line_error(run(base + " --device cuda --precision float32"), "samples in bfloat16");
  expect_one_line_error(run(base + " --device tpu"), "--device 'tpu'");
  const Result ok = run(base + " --device cpu --precision float32 --temperature 0 --ignore-eos --json");
  EXPECT_EQ(ok.code, 0) << ok.err;
}

TEST(LogprobsCliErrors, BadInputsAreOneLineNamingThem) {
  const std::string model = " --model " + quote(llama_tiny());
  expect_one_line_error(run("logprobs --model /no/such/model_dir --ids 1,2"), "/no/such/model_dir");
  expect_one_line_error(run("logprobs" + model + " --ids 5,x7,9"), "'x7' is not a token id");
  expect_one_line_error(run("logprobs" + model + " --ids 5,-3"), "'-3' is not a token id");
  expect_one_line_error(run("logprobs" + model + " --ids 5,512,7"), "token id 512");
  expect_one_line_error(run("logprobs" + model + " --ids 5"), "at least two tokens");
  expect_one_line_error(run("logprobs" + model), "exactly one of --text and --ids");
  expect_one_line_error(run("logprobs --ids 1,2"), "--model is required");
  expect_one_line_error(run("logprobs" + model + " --ids 1,2 --temperature 0"), "--temperature");
  expect_one_line_error(run("logprobs" + model + " --ids 1,2 --backend nosuchbackend"), "nosuchbackend");
  TempDir gpt2("gpt2");
  std::ofstream(gpt2.path / "config.json") << R"({"architectures": ["GPT2LMHeadModel"], "vocab_size": 50257})";
  expect_one_line_error(run("logprobs --model " + quote(gpt2.path.string()) + " --ids 1,2"), "GPT2LMHeadModel");
  // Text whose tokens fall outside the model's 512-token vocabulary.
  TempDir text("big_vocab");
  for (const char* f : {"config.json", "model.safetensors"}) fs::create_symlink(fs::path(llama_tiny()) / f, text.path / f);
  fs::create_symlink(fs::path(fixtures_root()) / "tokenizer-llama3/tokenizer.json", text.path / "tokenizer.json");
  expect_one_line_error(run("logprobs --model " + quote(text.path.string()) + " --text 'Hello, world!'"), "token id 645");
  // --text needs a tokenizer next to the model.
  expect_one_line_error(run("logprobs" + model + " --text hi"), "tokenizer");
}

}  // namespace
