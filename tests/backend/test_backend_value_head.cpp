// The value head through the backend plugins' ABI tables (llama-tiny fixture): RLH_OUTPUT_VALUE
// on a model loaded as a value model (the role reward_model, policy.reward_model_cfg.enabled, or
// a checkpoint with score.weight), its gradient through the loss callback, the HF
// *ForSequenceClassification layout of what save_state writes and its round trip, an HF value
// model without lm_head, and every refusal as one line naming its cause.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "backend_harness.hpp"
#include "rlhost/sdk/safetensors.hpp"

namespace fs = std::filesystem;
using namespace rlh;
using namespace rlh::test;
using json = nlohmann::json;

namespace {

const Host& host() {
  static Host h({"model_llama", "kernels_cpu", "dtensor", "megatron"});
  return h;
}

std::string llama_tiny() { return fixtures_root() + "/llama-tiny"; }
constexpr int32_t kVocab = 512;
constexpr int64_t kHidden = 64;

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("rlh_value_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

json adam_config(const std::string& backend, double lr) {
  if (backend == "dtensor")
    return {{"optimizer", {{"name", "torch.optim.AdamW"}, {"kwargs", {{"lr", lr}, {"weight_decay", 0.0}}}}}};
  return {{"megatron_cfg", {{"optimizer", {{"lr", lr}, {"weight_decay", 0.0}}}}}};
}

std::vector<float> values(Backend& be, rlh_model* m, Batch& b) {
  std::vector<std::vector<float>> out;
  sdk::check(be.try_forward(m, b, {spec(RLH_OUTPUT_VALUE, "v")}, out), "forward values");
  return out[0];
}

// Bradley-Terry on sequences (0, 1), (2, 3), ...: the reward is the value at the last token.
Backend::LossBody bt_loss() {
  return [](const rlh_microbatch& mb) {
    float* g = nullptr;
    const float* v = output(mb, "v", &g);
    const rlh_batch& b = *mb.batch;
    double loss = 0;
    for (int64_t k = 0; k + 1 < b.num_seqs; k += 2) {
      const int64_t c = b.seq_offsets[k + 1] - 1, r = b.seq_offsets[k + 2] - 1;
      const double d = double(v[c]) - double(v[r]), pairs = double(mb.global_num_seqs) / 2;
      loss += std::log1p(std::exp(-d)) / pairs;
      const double dd = -1.0 / (1.0 + std::exp(d)) / pairs;
      g[c] += float(dd);
      g[r] -= float(dd);
    }
    return loss;
  };
}

class ValueHead : public ::testing::TestWithParam<std::string> {};

TEST_P(ValueHead, RewardModelTrainsSavesAsSequenceClassificationAndLoadsBack) {
  const std::string name = GetParam();
  auto batch = random_batch({7, 12, 5, 9}, kVocab, 3);
  Backend::TrainOptions o;
  o.specs = {spec(RLH_OUTPUT_VALUE, "v")};
  o.micro_batch_seqs = 2;
  o.constraints = RLH_BATCH_KEEP_PAIRS;
  TempDir tmp("rm_" + name);
  std::vector<float> v_saved;
  std::map<std::string, std::vector<float>> w_saved;
  {
    Backend be(host(), name.c_str(), adam_config(name, 1e-2));
    rlh_model* m = be.load(llama_tiny(), true, "reward_model");
    const auto w0 = be.weights(m);
    ASSERT_TRUE(w0.count("score.weight")) << "a reward model has a value head";
    const std::vector<float>& s = w0.at("score.weight");
    ASSERT_EQ(s.size(), size_t(kHidden));
    double ss = 0;
    for (float x : s) ss += double(x) * x;
    const double sd = std::sqrt(ss / double(s.size()));
    EXPECT_GT(sd, 0.04) << "normal(0, initializer_range 0.08)";
    EXPECT_LT(sd, 0.12);
    const std::vector<float> v0 = values(be, m, *batch);
    const double margin0 = (v0[6] - v0[18]) + (v0[23] - v0[32]);
    for (int s = 0; s < 5; ++s) be.train(m, *batch, batch->num_tokens(), batch->num_seqs(), bt_loss(), o);
    const std::vector<float> v1 = values(be, m, *batch);
    EXPECT_GT((v1[6] - v1[18]) + (v1[23] - v1[32]), margin0 + 0.5) << "the step raises chosen over rejected";
    sdk::check(be.api()->save_state(be.raw(), m, tmp.path.c_str()), "save_state");
    v_saved = v1;
    w_saved = be.weights(m);
  }
  // HF's layout: AutoModelForSequenceClassification reads the architecture, num_labels and score.weight.
  const json cfg = json::parse(std::ifstream(tmp.path / "config.json"));
  EXPECT_EQ(cfg["architectures"], json::array({"LlamaForSequenceClassification"}));
  EXPECT_EQ(cfg["num_labels"], 1);
  EXPECT_EQ(cfg["id2label"], json({{"0", "LABEL_0"}}));
  const auto ckpt = sdk::st::Checkpoint::open(tmp.path.string());
  const auto ref = ckpt.at("score.weight");
  EXPECT_EQ(ref.info->shape, (std::vector<int64_t>{1, kHidden}));
  EXPECT_EQ(ckpt.read_f32("score.weight"), w_saved.at("score.weight"));
  {
    // Loaded back in any role, the checkpoint's score.weight is the head: the same values, bitwise.
    Backend be(host(), name.c_str(), adam_config(name, 1e-2));
    rlh_model* m = be.load(tmp.path.string(), false, "policy");
    EXPECT_TRUE(be.weights(m) == w_saved);
    EXPECT_EQ(values(be, m, *batch), v_saved);
    // It kept its lm_head: logprobs are still served.
    EXPECT_EQ(be.logprobs(m, *batch).size(), size_t(batch->num_tokens()));
  }
}

TEST_P(ValueHead, ValueOutputsDoNotDependOnMicroBatching) {
  const std::string name = GetParam();
  auto batch = random_batch({7, 12, 5, 9, 3, 10}, kVocab, 8);
  Backend be(host(), name.c_str(), adam_config(name, 1e-2));
  rlh_model* m = be.load(llama_tiny(), false, "critic");
  std::vector<std::vector<float>> a, b;
  sdk::check(be.try_forward(m, *batch, {spec(RLH_OUTPUT_VALUE, "v")}, a, 100000), "one micro-batch");
  sdk::check(be.try_forward(m, *batch, {spec(RLH_OUTPUT_VALUE, "v"), spec(RLH_OUTPUT_LOGPROB_RAW, "lp")}, b, 12),
             "micro-batches of <= 12 tokens");
  ASSERT_EQ(a[0].size(), b[0].size());
  for (size_t t = 0; t < a[0].size(); ++t) EXPECT_NEAR(a[0][t], b[0][t], 1e-5f) << t;
}

INSTANTIATE_TEST_SUITE_P(Backends, ValueHead, ::testing::Values("dtensor", "megatron"));

TEST(ValueHeadLoading, RewardModelCfgInTheSectionAddsTheHead) {
  json cfg = adam_config("dtensor", 1e-3);
  cfg["reward_model_cfg"] = {{"enabled", true}, {"reward_model_type", "bradley_terry"}};
  Backend be(host(), "dtensor", cfg);
  rlh_model* m = be.load(llama_tiny(), true);
  EXPECT_TRUE(be.weights(m).count("score.weight"));
  cfg["reward_model_cfg"]["reward_model_type"] = "pairwise";
  Backend be2(host(), "dtensor", cfg);
  expect_error(be2.try_load(llama_tiny(), true, &m), RLH_E_UNIMPLEMENTED, "reward_model_type: \"pairwise\"");
}

// An HF reward model as transformers saves it: *ForSequenceClassification, score.weight, no
// lm_head. It serves values; logprob outputs are refused, since it has no language-model head.
TEST(ValueHeadLoading, HfValueModelWithoutLmHead) {
  TempDir tmp("hf_rm");
  {
    Backend be(host(), "dtensor", adam_config("dtensor", 1e-3));
    rlh_model* m = be.load(llama_tiny(), true, "reward_model");
    sdk::check(be.api()->save_state(be.raw(), m, tmp.path.c_str()), "save_state");
  }
  const auto full = sdk::st::Checkpoint::open(tmp.path.string());
  std::vector<std::vector<float>> keep;
  std::vector<sdk::st::WriteTensor> tensors;
  for (const std::string& n : full.names()) {
    if (n == "lm_head.weight") continue;
    keep.push_back(full.read_f32(n));
    const auto r = full.at(n);
    tensors.push_back({n, sdk::st::DType::F32, r.info->shape,
                       std::as_bytes(std::span<const float>(keep.back().data(), keep.back().size()))});
  }
  TempDir hf("hf_rm_nolm");
  sdk::st::write_checkpoint(hf.path.string(), tensors);
  fs::copy_file(tmp.path / "config.json", hf.path / "config.json");
  auto batch = random_batch({6, 9}, kVocab, 4);
  Backend be(host(), "dtensor", adam_config("dtensor", 1e-3));
  rlh_model* ref = be.load(tmp.path.string(), false, "reference");
  rlh_model* m = be.load(hf.path.string(), false, "reward_model");
  EXPECT_EQ(values(be, m, *batch), values(be, ref, *batch));
  EXPECT_FALSE(be.weights(m).count("lm_head.weight"));
  std::vector<std::vector<float>> out;
  expect_error(be.try_forward(m, *batch, {spec(RLH_OUTPUT_LOGPROB_RAW, "lp")}, out), RLH_E_FAILED_PRECONDITION,
               "without a language-model head");
  // config.json naming a value model whose checkpoint lacks score.weight.
  TempDir bad("hf_rm_noscore");
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(),
                               [](const sdk::st::WriteTensor& t) { return t.name == "score.weight"; }),
                tensors.end());
  sdk::st::write_checkpoint(bad.path.string(), tensors);
  fs::copy_file(tmp.path / "config.json", bad.path / "config.json");
  expect_error(be.try_load(bad.path.string(), false, &m), RLH_E_INVALID_ARGUMENT,
               "LlamaForSequenceClassification but the checkpoint has no score.weight");
}

TEST(ValueHeadLoading, PlainPolicyRefusesTheValueOutput) {
  Backend be(host(), "dtensor", adam_config("dtensor", 1e-3));
  rlh_model* m = be.load(llama_tiny(), false);
  EXPECT_FALSE(be.weights(m).count("score.weight"));
  auto batch = random_batch({4, 3}, kVocab, 2);
  std::vector<std::vector<float>> out;
  expect_error(be.try_forward(m, *batch, {spec(RLH_OUTPUT_VALUE, "v")}, out), RLH_E_FAILED_PRECONDITION,
               "RLH_OUTPUT_VALUE needs a value head");
}

}  // namespace
