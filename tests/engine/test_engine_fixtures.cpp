// The engine against Hugging Face float64 references: every model folder under the fixtures root
// ($RLHOST_FIXTURES, default tests/fixtures in the source tree) and under
// tests/engine/fixtures (more MoE configurations made with the same tools: Qwen2-MoE with its
// gated shared expert and dense layers, Qwen3-MoE without renormalisation, Mixtral with a window
// and MQA) runs in fp32 on CPU and is checked per tensor with error = max|got - ref| / max|ref|:
//   logits <= 1e-5, token logprobs and loss <= 1e-5, gradient of every parameter <= 1e-4
// (router and shared-expert weights included). The loss is the mean of -token_logprobs over the
// batch's predicted tokens (2 x 39).
// A folder is skipped, with the reason printed, only when no architecture table lists its
// architecture. Adding a folder needs no code.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <span>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fixture_util.hpp"
#include "kernels_cpu_abi.hpp"
#include "rlhost/engine/engine.hpp"
#include "rlhost/model/llama_family.hpp"
#include "rlhost/sdk/safetensors.hpp"

namespace fs = std::filesystem;
using namespace rlh;

namespace {

using test::fixtures_root;
using test::rel_error;

std::vector<std::string> model_folders() {
  std::vector<std::string> out = test::model_folders_under(fixtures_root());
  for (const std::string& f : test::model_folders_under(RLH_ENGINE_FIXTURES_DIR)) out.push_back(f);
  return out;
}

class Fixture : public ::testing::TestWithParam<std::string> {};

TEST_P(Fixture, MatchesHuggingFaceReference) {
  const std::string dir = GetParam();
  const std::string folder = fs::path(dir).filename().string();
  std::ifstream cfg_in(dir + "/config.json");
  const nlohmann::json cfg = nlohmann::json::parse(cfg_in);
  const std::string arch = cfg.value("architectures", nlohmann::json::array({""}))[0];
  if (!model::is_supported_architecture(arch))
    GTEST_SKIP() << folder << ": no architecture table lists " << arch;
  sdk::TransformerDesc desc = model::describe_model_dir(dir);

  const auto ckpt = sdk::st::Checkpoint::open(dir + "/model.safetensors");
  sdk::LoadResult w = sdk::load_weights_f32(desc, ckpt);
  engine::Engine eng(desc, test::engine_options());
  eng.load_parameters(w.tensors);

  const auto ref = sdk::st::File::open(dir + "/reference.safetensors");
  const sdk::st::TensorInfo& ids_info = ref.at("input_ids");
  const int64_t B = ids_info.shape[0], T = ids_info.shape[1];
  const std::vector<double> ids64 = ref.read_f64("input_ids");
  std::vector<int32_t> ids(ids64.begin(), ids64.end());
  std::vector<int32_t> cu;
  for (int64_t b = 0; b <= B; ++b) cu.push_back(int32_t(b * T));
  engine::MicroBatch mb;
  mb.input_ids = ids;
  mb.cu_seqlens = cu;

  // Forward: logits and token logprobs.
  engine::OutputRequest req;
  req.logprob = true;
  req.logits = true;
  const engine::Outputs out = eng.forward(mb, req);
  const double e_logits = rel_error(out.logits, ref.read_f64("logits"));
  const std::vector<double> ref_lp = ref.read_f64("token_logprobs");  // [B, T-1]
  std::vector<float> lp;  // the same positions from the engine's output alignment
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 1; t < T; ++t) lp.push_back(out.logprob[size_t(b * T + t)]);
  const double e_lp = rel_error(lp, ref_lp);

  // Train step without the optimizer: loss = mean(-logprob) over the predicted tokens.
  const int64_t predicted = B * (T - 1);
  engine::StepOptions so;
  so.global_tokens = predicted;
  so.apply_optimizer = false;
  auto loss_fn = [&](const engine::LossContext& ctx, const engine::OutputViews& o,
                     engine::OutputGrads& g) {
    engine::LossResult r;
    const auto& c = ctx.microbatch->cu_seqlens;
    for (size_t s = 0; s + 1 < c.size(); ++s)
      for (int32_t t = c[s] + 1; t < c[s + 1]; ++t) {  // position c[s] predicts nothing
        r.loss -= o.logprob[size_t(t)] / double(ctx.global_tokens);
        g.logprob[size_t(t)] = float(-1.0 / double(ctx.global_tokens));
      }
    return r;
  };
  const engine::StepResult sr = eng.train_step({&mb, 1}, so, loss_fn);
  const double ref_loss = ref.read_f64("loss")[0];
  const double e_loss = std::fabs(sr.loss - ref_loss) / std::fabs(ref_loss);

  // Gradients, by HF name: an engine tensor, or one expert's slice of a stacked one.
  std::map<std::string, std::pair<size_t, size_t>> by_hf;  // (parameter, slice)
  size_t hf_tensors = 0;
  for (size_t i = 0; i < desc.params.size(); ++i)
    for (size_t j = 0; j < desc.params[i].hf_names.size(); ++j, ++hf_tensors)
      by_hf[desc.params[i].hf_names[j]] = {i, j};
  double e_grad = 0;
  std::string worst;
  int checked = 0;
  for (const auto& t : ref.tensors()) {
    if (t.name.rfind("grad.", 0) != 0) continue;
    const std::string name = t.name.substr(5);
    auto it = by_hf.find(name);
    if (it == by_hf.end() && name == "lm_head.weight" && desc.tie_word_embeddings)
      it = by_hf.find(desc.params[0].hf_names[0]);
    ASSERT_NE(it, by_hf.end()) << "reference gradient " << name << " has no engine parameter";
    const auto [pi, slice] = it->second;
    const sdk::ParamDesc& p = desc.params[pi];
    std::span<float> grad = eng.grad(pi);
    if (p.transform == sdk::ParamTransform::stack) {  // expert `slice` of [E, ...]
      const size_t per = grad.size() / p.hf_names.size();
      grad = grad.subspan(slice * per, per);
    } else {
      ASSERT_EQ(p.transform, sdk::ParamTransform::none) << name;
    }
    const double e = rel_error(grad, ref.read_f64(t.name));
    EXPECT_LE(e, 1e-4) << "gradient of " << name;
    if (e > e_grad) {
      e_grad = e;
      worst = name;
    }
    ++checked;
  }
  EXPECT_EQ(checked, int(hf_tensors)) << "every parameter has a reference gradient";

  std::printf("%-26s %-22s logits %.2e  token_logprobs %.2e  loss %.2e  grads(max of %d) %.2e (%s)\n",
              folder.c_str(), arch.c_str(), e_logits, e_lp, e_loss, checked, e_grad,
              worst.c_str());
  EXPECT_LE(e_logits, 1e-5);
  EXPECT_LE(e_lp, 1e-5);
  EXPECT_LE(e_loss, 1e-5);
}

std::string folder_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string s;
  for (char c : fs::path(info.param).filename().string())
    s += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return s;
}

// An empty or missing fixtures root must fail, not pass vacuously.
TEST(Fixtures, RootHasModelFolders) {
  EXPECT_FALSE(model_folders().empty()) << "no model folder under " << fixtures_root();
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Fixture, ::testing::ValuesIn(model_folders()), folder_name);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Fixture);

}  // namespace
