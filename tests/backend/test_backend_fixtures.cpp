// The HF reference fixtures through the plugins: librlhost loads model_llama, kernels_cpu, dtensor
// and megatron; for every fixture folder ($RLHOST_FIXTURES, default tests/fixtures) whose
// architecture the loaded model component lists, each backend must give, through its ABI table:
//   forward logprobs (token-aligned, shifted to the reference's layout)  <= 1e-5
//   the loss of an eval_only train step (NLL over the predicted tokens)  <= 1e-5
//   every parameter's gradient                                           <= 1e-4
// (error = max|got - ref| / max|ref|, as tests/engine/test_engine_fixtures.cpp).
//
// The ABI has no slot that reads gradients. They are read through it anyway: one plain SGD step
// (lr = 2^20, no momentum, decay or clipping) changes each weight by exactly -lr * g up to one
// float32 rounding, so g = (w_before - w_after) / lr with a relative error near 2^-24, and
// visit_weights reads both weight sets.
//
// A folder is skipped, with the reason printed, only when no loaded model component lists its
// architecture, or when its description has MoE/MLA layers (the dense engine's refusal is then
// checked: load_model must fail with UNIMPLEMENTED naming the feature).
#include <algorithm>
#include <cstdio>

#include "backend_harness.hpp"
#include "rlhost/sdk/safetensors.hpp"

namespace fs = std::filesystem;
using namespace rlh;
using namespace rlh::test;

namespace {

// Folder names (the cases join them to the root).
std::vector<std::string> model_folders() {
  std::vector<std::string> out;
  for (const std::string& f : test::model_folders_under(fixtures_root()))
    out.push_back(fs::path(f).filename().string());
  return out;
}

const Host& host() {
  static Host h({"model_llama", "kernels_cpu", "dtensor", "megatron"});
  return h;
}

// The config that turns a train step into "w -= lr * g" for the given backend.
nlohmann::json sgd_config(const std::string& backend) {
  if (backend == "dtensor")
    return {{"optimizer", {{"name", "torch.optim.SGD"}, {"kwargs", {{"lr", 1.0}}}}}, {"max_grad_norm", nullptr}};
  return {{"megatron_cfg",
           {{"optimizer", {{"optimizer", "sgd"}, {"lr", 1.0}, {"sgd_momentum", 0.0}, {"weight_decay", 0.0}, {"clip_grad", 0.0}}}}}};
}

struct Case {
  std::string backend, folder;
};

class Fixture : public ::testing::TestWithParam<Case> {};

TEST_P(Fixture, MatchesHuggingFaceReferenceThroughTheAbi) {
  const Case& c = GetParam();
  const std::string dir = fixtures_root() + "/" + c.folder;
  std::ifstream cfg_in(dir + "/config.json");
  std::stringstream cfg_text;
  cfg_text << cfg_in.rdbuf();
  const nlohmann::json cfg = nlohmann::json::parse(cfg_text.str());
  const std::string arch = cfg.value("architectures", nlohmann::json::array({""}))[0];

  // The model component of the host, as the backend will find it.
  const auto* model_api = static_cast<const rlh_model_api*>(host().find(RLH_KIND_MODEL, nullptr)->api);
  bool listed = false;
  for (const char* const* a = model_api->architectures; *a != nullptr; ++a) listed = listed || arch == *a;
  if (!listed) GTEST_SKIP() << c.folder << ": no loaded model component lists " << arch;

  Backend be(host(), c.backend.c_str(), sgd_config(c.backend));
  std::string desc_text;
  sdk::check(model_api->describe(host().services(), cfg_text.str().data(), cfg_text.str().size(), sdk::write_to_string,
                                 &desc_text));
  const nlohmann::json desc = nlohmann::json::parse(desc_text);
  std::string beyond_dense;  // what the description needs beyond the dense engine
  for (const auto& l : desc["layers"]) {
    if (l["mlp"]["kind"] == "moe") beyond_dense = "MoE layers";
    if (l["attention"]["kind"] == "mla") beyond_dense = "MLA attention";
  }
  rlh_model* m = nullptr;
  rlh_status* load = be.try_load(dir, true, &m);
  if (load != nullptr && !beyond_dense.empty() && load->code == RLH_E_UNIMPLEMENTED) {
    const std::string msg = status_text(load);
    EXPECT_NE(msg.find("not supported"), std::string::npos) << msg;
    GTEST_SKIP() << c.folder << " (" << arch << "): " << beyond_dense
                 << " not executed by the engine yet; load_model refuses: " << msg;
  }
  ASSERT_EQ(load, nullptr) << status_text(load);

  const auto ref = sdk::st::File::open(dir + "/reference.safetensors");
  const int64_t B = ref.at("input_ids").shape[0], T = ref.at("input_ids").shape[1];
  const std::vector<double> ids64 = ref.read_f64("input_ids");
  std::vector<int64_t> off;
  for (int64_t b = 0; b <= B; ++b) off.push_back(b * T);
  Batch batch(std::vector<int32_t>(ids64.begin(), ids64.end()), off);

  // Forward: token-aligned outputs; the reference's entry t is output t + 1.
  const std::vector<float> out = be.logprobs(m, batch);
  std::vector<float> lp;
  for (int64_t b = 0; b < B; ++b) {
    EXPECT_EQ(out[size_t(b * T)], 0.0f) << "position 0 of sequence " << b << " holds 0";
    for (int64_t t = 1; t < T; ++t) lp.push_back(out[size_t(b * T + t)]);
  }
  const double e_lp = rel_error(lp, ref.read_f64("token_logprobs"));

  // Loss through eval_only: weights and version must not move.
  const int64_t predicted = B * (T - 1);
  int64_t v0 = -1, v1 = -1;
  const auto w0 = be.weights(m, &v0);
  Backend::TrainOptions eval;
  eval.eval_only = true;
  const auto er = be.train(m, batch, predicted, B, nll_loss(), eval);
  const auto w_eval = be.weights(m, &v1);
  EXPECT_EQ(v0, 0);
  EXPECT_EQ(v1, 0);
  EXPECT_TRUE(w_eval == w0) << "eval_only changed weights";
  EXPECT_FALSE(er.metrics["updated"].get<bool>());
  const double ref_loss = ref.read_f64("loss")[0];
  const double e_loss = std::fabs(er.r.loss - ref_loss) / std::fabs(ref_loss);

  // Gradients: one SGD step with lr = 2^20.
  const double lr = 1048576.0;
  Backend::TrainOptions sgd;
  sgd.learning_rate = lr;
  const auto sr = be.train(m, batch, predicted, B, nll_loss(), sgd);
  EXPECT_TRUE(sr.metrics["updated"].get<bool>());
  EXPECT_EQ(sr.r.loss, er.r.loss) << "the same loss with and without the update";
  const auto w1 = be.weights(m, &v1);
  EXPECT_EQ(v1, 1);
  std::map<std::string, std::vector<double>> grads;
  for (const auto& [name, before] : w0) {
    const std::vector<float>& after = w1.at(name);
    std::vector<double>& g = grads[name];
    for (size_t i = 0; i < before.size(); ++i) g.push_back((double(before[i]) - double(after[i])) / lr);
  }
  double e_grad = 0;
  std::string worst;
  int checked = 0;
  for (const auto& t : ref.tensors()) {
    if (t.name.rfind("grad.", 0) != 0) continue;
    std::string name = t.name.substr(5);
    if (!grads.count(name) && name == "lm_head.weight" && desc.value("tie_word_embeddings", false))
      name = "model.embed_tokens.weight";  // tied: one tensor, the sum of both uses
    ASSERT_TRUE(grads.count(name)) << "reference gradient " << t.name << " has no weight from visit_weights";
    const double e = rel_error(grads[name], ref.read_f64(t.name));
    EXPECT_LE(e, 1e-4) << "gradient of " << name;
    if (e > e_grad) {
      e_grad = e;
      worst = name;
    }
    ++checked;
  }
  EXPECT_EQ(size_t(checked), w0.size() + (desc.value("tie_word_embeddings", false) && ref.find("grad.lm_head.weight") ? 1 : 0))
      << "every weight has a reference gradient";

  std::printf("%-9s %-20s %-18s token_logprobs %.2e  loss %.2e  grads(max of %d) %.2e (%s)\n", c.backend.c_str(),
              c.folder.c_str(), arch.c_str(), e_lp, e_loss, checked, e_grad, worst.c_str());
  EXPECT_LE(e_lp, 1e-5);
  EXPECT_LE(e_loss, 1e-5);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const char* b : {"dtensor", "megatron"})
    for (const auto& f : model_folders()) out.push_back({b, f});
  return out;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string s = info.param.backend + "_";
  for (char ch : info.param.folder) s += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  return s;
}

// An empty or missing fixtures root must fail, not pass vacuously.
TEST(BackendFixtures, RootHasModelFolders) { EXPECT_FALSE(model_folders().empty()) << "no model folder under " << fixtures_root(); }

INSTANTIATE_TEST_SUITE_P(Fixtures, Fixture, ::testing::ValuesIn(cases()), case_name);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Fixture);

}  // namespace
