// What the model-parallel backend tests under `mpirun` share (tensor and pipeline parallelism,
// tests/backend/test_backend_tp.cpp and test_backend_pp.cpp): a loss on logprobs and entropy,
// one SGD step's outcome (outputs, loss, norm, gradients read back through the HF weights), and
// the checkpoint round trip between a layout and one rank.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend_harness.hpp"
#include "mpi_harness.hpp"
#include "rlhost/sdk/safetensors.hpp"

namespace rlh::test {

constexpr double kTemperature = 0.7;

// The processed logprob (no filter: the raw one) and the entropy at temperature 0.7: NLL minus
// 0.1 x mean entropy, so both the logprob and the entropy head's gradients are exercised.
inline Backend::TrainOptions lp_ent_options() {
  Backend::TrainOptions o;
  o.specs = {spec(RLH_OUTPUT_LOGPROB, "lp", kTemperature), spec(RLH_OUTPUT_ENTROPY, "ent", kTemperature)};
  return o;
}
inline Backend::LossBody lp_ent_loss() {
  return [](const rlh_microbatch& mb) {
    float *g = nullptr, *ge = nullptr;
    const float* lp = output(mb, "lp", &g);
    const float* ent = output(mb, "ent", &ge);
    const rlh_batch& b = *mb.batch;
    const double n = double(mb.global_num_tokens);
    double loss = 0;
    for (int64_t s = 0; s < b.num_seqs; ++s)
      for (int64_t t = b.seq_offsets[s] + 1; t < b.seq_offsets[s + 1]; ++t) {
        loss += (-lp[t] - 0.1 * ent[t]) / n;
        g[t] = float(-1.0 / n);
        ge[t] = float(-0.1 / n);
      }
    return loss;
  };
}

struct Outcome {
  std::vector<float> logprobs, entropy;
  double loss = 0, grad_norm = 0;
  Weights grads;
  nlohmann::json metrics;
};

inline Outcome run_sgd_step(Backend& be, rlh_model* m, Batch& batch, int64_t g_tok, int64_t g_seq) {
  Outcome o;
  std::vector<std::vector<float>> out;
  sdk::check(be.try_forward(m, batch,
                            {spec(RLH_OUTPUT_LOGPROB_RAW, "lp", kTemperature), spec(RLH_OUTPUT_ENTROPY, "ent", kTemperature)},
                            out),
             "forward");
  o.logprobs = out[0];
  o.entropy = out[1];
  const Weights before = be.weights(m);
  const auto r = be.train(m, batch, g_tok, g_seq, lp_ent_loss(), lp_ent_options());
  o.loss = r.r.loss;
  o.grad_norm = r.r.grad_norm;
  o.metrics = r.metrics;
  o.grads = minus(before, be.weights(m));
  return o;
}

// The optimizer both tests train with, on a config: SGD at lr 1 without momentum, decay or
// clipping (one step: w - w' = g), or AdamW with decay and clipping.
inline nlohmann::json with_sgd(nlohmann::json cfg, bool distributed_optimizer) {
  cfg["megatron_cfg"]["optimizer"] = {{"optimizer", "sgd"}, {"lr", 1.0}, {"sgd_momentum", 0.0}, {"weight_decay", 0.0},
                                      {"clip_grad", 0.0}, {"use_distributed_optimizer", distributed_optimizer}};
  return cfg;
}
inline nlohmann::json with_adam(nlohmann::json cfg, double lr, bool distributed_optimizer) {
  cfg["megatron_cfg"]["optimizer"] = {{"optimizer", "adam"}, {"lr", lr}, {"weight_decay", 0.01}, {"clip_grad", 1.0},
                                      {"use_distributed_optimizer", distributed_optimizer}};
  return cfg;
}

// One SGD step on one rank (config `one`, the whole batch `g`) and under the layout (`cfg`, this
// rank's share `mine` of g, starting at token `first`): logprobs and entropy within 2e-5, loss
// and gradient norm to 1e-5 / 1e-4 relative, every gradient within 1e-4 of the largest.
struct SgdComparison {
  Outcome ref, got;
  double lp_err = 0, ent_err = 0, grad_err = 0;
};
inline SgdComparison compare_sgd_step(const std::string& model, const nlohmann::json& one, const nlohmann::json& cfg,
                                      Batch& g, Batch& mine, int64_t first, const std::string& label) {
  SgdComparison c;
  {
    Alone alone;
    Backend be(host(), "megatron", one);
    rlh_model* m = be.load(model_path(model), true);
    c.ref = run_sgd_step(be, m, g, g.num_tokens(), g.num_seqs());
  }
  Backend be(host(), "megatron", cfg);
  rlh_model* m = be.load(model_path(model), true);
  c.got = run_sgd_step(be, m, mine, g.num_tokens(), g.num_seqs());
  EXPECT_EQ(int64_t(c.got.logprobs.size()), mine.num_tokens()) << label;
  for (size_t t = 0; t < c.got.logprobs.size() && t < size_t(mine.num_tokens()); ++t) {
    c.lp_err = std::max(c.lp_err, std::fabs(double(c.got.logprobs[t]) - double(c.ref.logprobs[size_t(first) + t])));
    c.ent_err = std::max(c.ent_err, std::fabs(double(c.got.entropy[t]) - double(c.ref.entropy[size_t(first) + t])));
  }
  EXPECT_LE(c.lp_err, 2e-5) << label;
  EXPECT_LE(c.ent_err, 2e-5) << label;
  EXPECT_NEAR(c.got.loss, c.ref.loss, 1e-5 * std::fabs(c.ref.loss)) << label;
  EXPECT_NEAR(c.got.grad_norm, c.ref.grad_norm, 1e-4 * c.ref.grad_norm) << label;
  EXPECT_EQ(c.got.grads.size(), c.ref.grads.size()) << label << ": the same HF tensors";
  if (c.got.grads.size() == c.ref.grads.size()) c.grad_err = max_rel_diff(c.got.grads, c.ref.grads);
  EXPECT_LE(c.grad_err, 1e-4) << label;
  return c;
}

// Two AdamW steps (lr 2e-3) on one rank and under the layout, as compare_sgd_step: losses within
// 2e-5 relative, weights within a few lr (AdamW divides by sqrt(v): where a gradient is ~0 its
// rounding decides the step's sign, as for data parallelism). The training state per rank after
// them (memory/state_bytes) of both.
struct AdamComparison {
  double worst = 0, state = 0, ref_state = 0;
};
inline AdamComparison compare_adamw_steps(const std::string& model, const nlohmann::json& one,
                                          const nlohmann::json& cfg, Batch& g, Batch& mine, const std::string& label) {
  AdamComparison c;
  std::vector<double> ref_loss;
  Weights ref_w;
  {
    Alone alone;
    Backend be(host(), "megatron", one);
    rlh_model* m = be.load(model_path(model), true);
    for (int s = 0; s < 2; ++s) {
      const auto r = be.train(m, g, g.num_tokens(), g.num_seqs(), nll_loss(), {});
      ref_loss.push_back(r.r.loss);
      c.ref_state = r.metrics["memory/state_bytes"].get<double>();
    }
    ref_w = be.weights(m);
  }
  Backend be(host(), "megatron", cfg);
  rlh_model* m = be.load(model_path(model), true);
  for (int s = 0; s < 2; ++s) {
    const auto r = be.train(m, mine, g.num_tokens(), g.num_seqs(), nll_loss(), {});
    EXPECT_NEAR(r.r.loss, ref_loss[size_t(s)], 2e-5 * std::fabs(ref_loss[size_t(s)])) << label << " step " << s;
    c.state = r.metrics["memory/state_bytes"].get<double>();
  }
  const Weights w = be.weights(m);
  for (const auto& [k, v] : ref_w)
    for (size_t i = 0; i < v.size(); ++i) c.worst = std::max(c.worst, std::fabs(double(w.at(k)[i]) - double(v[i])));
  EXPECT_LE(c.worst, 2 * 2 * 2e-3) << label;
  return c;
}

// Forward only on the whole batch `g` with log p at K = 3 given ids per token (some -1; added to
// g as the field "ids") and the `more` outputs (width 1): the largest difference of each output
// between one rank (`one`) and the layout (`cfg`), on every rank.
inline std::vector<double> at_ids_differences(const std::string& model, const nlohmann::json& one,
                                              const nlohmann::json& cfg, Batch& g, int32_t vocab,
                                              const std::vector<rlh_output_spec>& more = {}) {
  constexpr int64_t K = 3;
  std::vector<int32_t> ids(size_t(g.num_tokens() * K));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = i % 7 == 3 ? -1 : int32_t((i * 131 + 17) % vocab);
  g.add("ids", ids, rlh_dtype{RLH_DTYPE_INT, 32, 1}, K);
  std::vector<rlh_output_spec> specs = {spec(RLH_OUTPUT_LOGPROB_AT_IDS, "at", 1.3, 0, 1.0, "ids")};
  specs.insert(specs.end(), more.begin(), more.end());
  std::vector<int64_t> widths(specs.size(), 1);
  widths[0] = K;
  std::vector<std::vector<float>> ref, got;
  {
    Alone alone;
    Backend be(host(), "megatron", one);
    rlh_model* m = be.load(model_path(model), false);
    sdk::check(be.try_forward(m, g, specs, ref, 0, widths), "forward at one rank");
  }
  Backend be(host(), "megatron", cfg);
  rlh_model* m = be.load(model_path(model), false);
  sdk::check(be.try_forward(m, g, specs, got, 0, widths), "forward under the layout");
  std::vector<double> err(specs.size(), 0);
  for (size_t k = 0; k < specs.size(); ++k) {
    EXPECT_EQ(got[k].size(), ref[k].size());
    for (size_t i = 0; i < ref[k].size() && i < got[k].size(); ++i)
      err[k] = std::max(err[k], std::fabs(double(got[k][i]) - double(ref[k][i])));
  }
  return err;
}

// A state saved under a layout (`cfg`, on this rank's share `dp_rank` of `dp` of the global
// batch) is one rank's files (HF layout, full tensors); it loads on one rank (`one`) into the
// same weights and continues there within fp32 tolerance; one rank's state loads back under the
// layout bitwise and continues bitwise. `tag` names the layout in paths and messages.
inline void checkpoint_round_trip(const std::string& model, const nlohmann::json& cfg, const nlohmann::json& one,
                                  int dp, int dp_rank, const std::string& tag, std::unique_ptr<Batch> g) {
  namespace fs = std::filesystem;
  const int R = world().rank();
  const int64_t g_tok = g->num_tokens(), g_seq = g->num_seqs();
  auto mine = shard_of(*g, dp_rank, dp);
  const fs::path root = world().broadcast((fs::temp_directory_path() / ("rlh_" + tag + "_" + std::to_string(::getpid()))).string());
  const fs::path dir = root / tag, again = root / "one";
  if (R == 0) {
    fs::remove_all(root);
    fs::create_directories(dir);
    fs::create_directories(again);
  }
  world().barrier();
  Weights saved, cont;
  std::vector<double> cont_loss;
  {
    Backend be(host(), "megatron", cfg);
    rlh_model* m = be.load(model_path(model), true);
    be.train(m, *mine, g_tok, g_seq, nll_loss(), {});
    sdk::check(be.api()->save_state(be.raw(), m, dir.c_str()), "save_state under " + tag);
    saved = be.weights(m);
    for (int s = 0; s < 2; ++s) cont_loss.push_back(be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss);
    cont = be.weights(m);
  }
  {  // the files: the fixture's tensors, full shapes
    const auto f = sdk::st::File::open((dir / "model.safetensors").string());
    const auto fx = sdk::st::File::open(model_path(model) + "/model.safetensors");
    ASSERT_EQ(f.tensors().size(), fx.tensors().size());
    for (const auto& t : fx.tensors()) EXPECT_EQ(f.at(t.name).shape, t.shape) << t.name;
  }
  {
    Alone alone;
    Backend be(host(), "megatron", one);
    rlh_model* m = be.load(model_path(model), true);
    sdk::check(be.api()->load_state(be.raw(), m, dir.c_str()), "load_state at one rank");
    EXPECT_TRUE(be.weights(m) == saved) << "loaded on one rank: not the weights saved under " << tag;
    if (R == 0) sdk::check(be.api()->save_state(be.raw(), m, again.c_str()), "save_state at one rank");
    for (int s = 0; s < 2; ++s) {
      const double loss = be.train(m, *g, g_tok, g_seq, nll_loss(), {}).r.loss;
      EXPECT_NEAR(loss, cont_loss[size_t(s)], 2e-5 * std::fabs(cont_loss[size_t(s)])) << "step " << s;
    }
    const Weights w = be.weights(m);
    double worst = 0;
    for (const auto& [k, v] : cont)
      for (size_t i = 0; i < v.size(); ++i) worst = std::max(worst, std::fabs(double(w.at(k)[i]) - double(v[i])));
    EXPECT_LE(worst, 2 * 2 * 5e-3);
  }
  world().barrier();
  {  // one rank's files back under the layout: bitwise the same weights, and the same continuation
    Backend be(host(), "megatron", cfg);
    rlh_model* m = be.load(model_path(model), true);
    sdk::check(be.api()->load_state(be.raw(), m, again.c_str()), "load_state under " + tag);
    EXPECT_TRUE(be.weights(m) == saved) << "one rank's state loaded under " << tag << ": not bitwise";
    for (int s = 0; s < 2; ++s)
      EXPECT_EQ(be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss, cont_loss[size_t(s)]) << "step " << s;
    EXPECT_TRUE(be.weights(m) == cont) << "resumed under " << tag << ": not bitwise";
  }
  world().barrier();
  if (R == 0) fs::remove_all(root);
}

}  // namespace rlh::test
