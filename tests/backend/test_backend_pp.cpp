// Pipeline parallelism for the megatron backend on CPU ranks, under `mpirun -np N` (ctest: N = 2
// and 4, one BLAS thread per rank). Every rank also computes the one-rank reference in-process
// (a backend that loads its model with the launcher's variables hidden, so it sees one rank).
//
//   - PP 2 (np 2), PP 2 x DP 2 and TP 2 x PP 2 (np 4) give the reference's logprobs, entropy
//     (forward only: the last stage's outputs on every rank), loss, gradient norm and every
//     gradient (one SGD step at lr 1 without clipping: w - w' = g, read back through the
//     gathered HF weights) within fp32 tolerance, on a Llama (untied head) and a Qwen3 (tied
//     embedding: the embedding group's gradient sum), with packing on and off, DDP and the
//     distributed optimizer, the 1F1B schedule over 2 to 5 micro-batches; and a Qwen2 of three
//     layers (biases, sliding window, YaRN) split 2 + 1 by num_layers_in_first_pipeline_stage;
//   - the pipeline's bytes per step equal the analytic count;
//   - two AdamW steps with clipping follow the reference;
//   - a state saved under PP is the one-rank HF layout, loads on one rank into the same weights
//     and continues there; one rank's state loads back under PP bitwise;
//   - refusals name the setting: virtual stages, PP on one rank, layers that do not split,
//     an MoE model.
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "backend_harness.hpp"
#include "mpi_harness.hpp"
#include "rlhost/sdk/safetensors.hpp"

namespace fs = std::filesystem;
using namespace rlh;
using namespace rlh::test;
using json = nlohmann::json;

namespace {

constexpr int32_t kVocab = 512;

const std::vector<int64_t> kLengths = {9, 14, 3, 11, 17, 6, 2, 12};

std::unique_ptr<Batch> global_batch() { return random_batch(kLengths, kVocab, 31); }

struct Case {
  std::string model;
  int64_t tp, pp;
  bool packing;
  bool distributed_optimizer;
  int64_t first_layers = 1;  // num_layers_in_first_pipeline_stage
  std::string label() const {
    return model + (tp > 1 ? " tp" + std::to_string(tp) : "") + " pp" + std::to_string(pp) +
           (first_layers != 1 ? " first" + std::to_string(first_layers) : "") +
           (distributed_optimizer ? " distopt" : " ddp") + (packing ? " packed" : "");
  }
};

json base_config(const Case& c, bool one_rank) {
  json cfg = {{"megatron_cfg",
               {{"tensor_model_parallel_size", one_rank ? 1 : c.tp},
                {"pipeline_model_parallel_size", one_rank ? 1 : c.pp},
                {"num_layers_in_first_pipeline_stage", one_rank || c.pp == 1 ? json(nullptr) : json(c.first_layers)},
                {"virtual_pipeline_model_parallel_size", nullptr}}}};
  set_batching(cfg, c.packing);
  return cfg;
}

json sgd_config(const Case& c, bool one_rank) {
  json cfg = base_config(c, one_rank);
  cfg["megatron_cfg"]["optimizer"] = {{"optimizer", "sgd"}, {"lr", 1.0}, {"sgd_momentum", 0.0}, {"weight_decay", 0.0},
                                      {"clip_grad", 0.0}, {"use_distributed_optimizer", c.distributed_optimizer}};
  return cfg;
}

json adam_config(const Case& c, bool one_rank, double lr) {
  json cfg = base_config(c, one_rank);
  cfg["megatron_cfg"]["optimizer"] = {{"optimizer", "adam"}, {"lr", lr}, {"weight_decay", 0.01}, {"clip_grad", 1.0},
                                      {"use_distributed_optimizer", c.distributed_optimizer}};
  return cfg;
}

constexpr double kTemperature = 0.7;

// NLL minus 0.1 x mean entropy at temperature 0.7: the logprob and the entropy head's gradients.
Backend::TrainOptions lp_ent_options() {
  Backend::TrainOptions o;
  o.specs = {spec(RLH_OUTPUT_LOGPROB, "lp", kTemperature), spec(RLH_OUTPUT_ENTROPY, "ent", kTemperature)};
  return o;
}
Backend::LossBody lp_ent_loss() {
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

// The pipeline's traffic of one train step on this rank (pp/comm_bytes), for these fixtures
// (hidden 64, vocabulary 512) and N tokens on the rank: a two-stage pipeline sends each
// micro-batch's activations forward (stage 0) or their gradient back (stage 1), N x C floats in
// all; a tied embedding's gradient (its V/T vocabulary rows) is all-reduced over the embedding
// group of the two stages (ring: 2 (2-1)/2 of it); the gradient norm's sum is all-reduced over
// the stages (2 (2-1)/2 x 8 bytes).
int64_t analytic_pp_bytes(const Case& c, int64_t N) {
  const int64_t C = 64;
  const bool tied = c.model == "qwen3-tiny";  // llama-tiny and qwen2-swa-yarn-tiny have an lm_head
  return N * C * 4 + (tied ? kVocab / c.tp * C * 4 : 0) + 8;
}

struct Outcome {
  std::vector<float> logprobs, entropy;
  double loss = 0, grad_norm = 0;
  Weights grads;
  json metrics;
};

Outcome run_sgd_step(Backend& be, rlh_model* m, Batch& batch, int64_t g_tok, int64_t g_seq) {
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

class PipelineParallel : public ::testing::TestWithParam<Case> {};

// This rank's place in Megatron's order (tp fastest, then dp, pp slowest): its data-parallel
// rank's share of the global batch.
struct Place {
  int dp = 1, dp_rank = 0;
  std::unique_ptr<Batch> global, mine;
  int64_t tokens = 0, seqs = 0, first = 0;
  explicit Place(const Case& c) {
    dp = int(world().size() / (c.tp * c.pp));
    dp_rank = int(world().rank() / c.tp) % dp;
    global = global_batch();
    tokens = global->num_tokens();
    seqs = global->num_seqs();
    mine = shard_of(*global, dp_rank, dp, &first);
  }
};

bool fits(const Case& c) { return world().size() % (c.tp * c.pp) == 0; }

TEST_P(PipelineParallel, MatchesOneRank) {
  const Case c = GetParam();
  const int N = world().size();
  if (!fits(c)) GTEST_SKIP() << c.label() << " on " << N << " ranks";
  Place p(c);
  Outcome ref;
  {
    Alone alone;
    Backend be(host(), "megatron", sgd_config(c, true));
    rlh_model* m = be.load(model_path(c.model), true);
    ref = run_sgd_step(be, m, *p.global, p.tokens, p.seqs);
  }
  Backend be(host(), "megatron", sgd_config(c, false));
  rlh_model* m = be.load(model_path(c.model), true);
  const Outcome pp = run_sgd_step(be, m, *p.mine, p.tokens, p.seqs);
  EXPECT_EQ(pp.metrics["dp_size"].get<int>(), p.dp);
  ASSERT_EQ(int64_t(pp.logprobs.size()), p.mine->num_tokens());
  double lp_err = 0, ent_err = 0;
  for (size_t t = 0; t < pp.logprobs.size(); ++t) {
    lp_err = std::max(lp_err, std::fabs(double(pp.logprobs[t]) - double(ref.logprobs[size_t(p.first) + t])));
    ent_err = std::max(ent_err, std::fabs(double(pp.entropy[t]) - double(ref.entropy[size_t(p.first) + t])));
  }
  EXPECT_LE(lp_err, 2e-5) << c.label();
  EXPECT_LE(ent_err, 2e-5) << c.label();
  EXPECT_NEAR(pp.loss, ref.loss, 1e-5 * std::fabs(ref.loss)) << c.label();
  EXPECT_NEAR(pp.grad_norm, ref.grad_norm, 1e-4 * ref.grad_norm) << c.label();
  ASSERT_EQ(pp.grads.size(), ref.grads.size()) << c.label() << ": the same HF tensors";
  const double gerr = max_rel_diff(pp.grads, ref.grads);
  EXPECT_LE(gerr, 1e-4) << c.label();
  // The loss callback's metrics reach every stage (the loss itself is checked above).
  EXPECT_TRUE(pp.metrics.contains("metrics")) << c.label();
  const int64_t bytes = pp.metrics["pp/comm_bytes"].get<int64_t>();
  EXPECT_EQ(bytes, analytic_pp_bytes(c, p.mine->num_tokens())) << c.label();
  if (world().rank() == 0)
    std::cout << "[np " << N << "] " << c.label() << ": loss " << pp.loss << " vs " << ref.loss << ", grad norm "
              << pp.grad_norm << " vs " << ref.grad_norm << ", gradients within " << gerr
              << " (relative to the largest), logprobs within " << lp_err << ", entropy within " << ent_err
              << ", pp bytes/step " << bytes << " (analytic " << analytic_pp_bytes(c, p.mine->num_tokens()) << ")\n";
}

TEST_P(PipelineParallel, AdamWStepsFollowOneRank) {
  const Case c = GetParam();
  const int N = world().size();
  if (!fits(c)) GTEST_SKIP() << c.label() << " on " << N << " ranks";
  Place p(c);
  std::vector<double> ref_loss;
  Weights ref_w;
  double ref_state = 0, state = 0;
  {
    Alone alone;
    Backend be(host(), "megatron", adam_config(c, true, 2e-3));
    rlh_model* m = be.load(model_path(c.model), true);
    for (int s = 0; s < 2; ++s) {
      const auto r = be.train(m, *p.global, p.tokens, p.seqs, nll_loss(), {});
      ref_loss.push_back(r.r.loss);
      ref_state = r.metrics["memory/state_bytes"].get<double>();
    }
    ref_w = be.weights(m);
  }
  Backend be(host(), "megatron", adam_config(c, false, 2e-3));
  rlh_model* m = be.load(model_path(c.model), true);
  for (int s = 0; s < 2; ++s) {
    const auto r = be.train(m, *p.mine, p.tokens, p.seqs, nll_loss(), {});
    EXPECT_NEAR(r.r.loss, ref_loss[size_t(s)], 2e-5 * std::fabs(ref_loss[size_t(s)])) << c.label() << " step " << s;
    state = r.metrics["memory/state_bytes"].get<double>();
  }
  // Each stage holds its layers and its global tensors only: less than one rank's model.
  EXPECT_LT(state, ref_state) << c.label();
  const Weights w = be.weights(m);
  double worst = 0;
  for (const auto& [k, v] : ref_w)
    for (size_t i = 0; i < v.size(); ++i) worst = std::max(worst, std::fabs(double(w.at(k)[i]) - double(v[i])));
  EXPECT_LE(worst, 2 * 2 * 2e-3) << c.label();
  if (world().rank() == 0)
    std::cout << "[np " << N << "] " << c.label() << ": 2 AdamW steps, weights within " << worst
              << "; training state on rank 0 " << state / 1024 << " KiB, one rank " << ref_state / 1024 << " KiB\n";
}

// Log p at given ids (K per token, some -1) and top-k processed logprobs, forward only on the
// whole batch: the last stage's outputs reach every rank.
TEST_P(PipelineParallel, LogprobAtIdsAndTopKMatchOneRank) {
  const Case c = GetParam();
  if (!fits(c)) GTEST_SKIP() << c.label() << " on " << world().size() << " ranks";
  auto g = global_batch();
  constexpr int64_t K = 3;
  std::vector<int32_t> ids(size_t(g->num_tokens() * K));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = i % 7 == 3 ? -1 : int32_t((i * 131 + 17) % kVocab);
  g->add("ids", ids, rlh_dtype{RLH_DTYPE_INT, 32, 1}, K);
  std::vector<rlh_output_spec> specs = {spec(RLH_OUTPUT_LOGPROB_AT_IDS, "at", 1.3, 0, 1.0, "ids")};
  std::vector<int64_t> widths = {K};
  if (c.tp == 1) {  // top-k needs the whole vocabulary: refused under tensor parallelism
    specs.push_back(spec(RLH_OUTPUT_LOGPROB, "topk", 0.9, 5));
    widths.push_back(1);
  }
  std::vector<std::vector<float>> ref, pp;
  {
    Alone alone;
    Backend be(host(), "megatron", sgd_config(c, true));
    rlh_model* m = be.load(model_path(c.model), false);
    sdk::check(be.try_forward(m, *g, specs, ref, 0, widths), "forward at one rank");
  }
  Backend be(host(), "megatron", sgd_config(c, false));
  rlh_model* m = be.load(model_path(c.model), false);
  sdk::check(be.try_forward(m, *g, specs, pp, 0, widths), "forward under pp");
  ASSERT_EQ(pp.size(), ref.size());
  for (size_t k = 0; k < ref.size(); ++k) {
    ASSERT_EQ(pp[k].size(), ref[k].size());
    double err = 0;
    for (size_t i = 0; i < ref[k].size(); ++i) err = std::max(err, std::fabs(double(pp[k][i]) - double(ref[k][i])));
    EXPECT_LE(err, 2e-5) << c.label() << " output " << k;
  }
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (const char* model : {"llama-tiny", "qwen3-tiny"}) {
    v.push_back({model, 1, 2, false, true});
    v.push_back({model, 1, 2, true, false});
    v.push_back({model, 2, 2, true, true});  // np 4 only: TP 2 x PP 2
  }
  // Three layers split 2 + 1 (Megatron's uneven first stage), with q/k/v biases, sliding-window
  // attention and YaRN RoPE: the stages run whatever layers they hold.
  v.push_back({"qwen2-swa-yarn-tiny", 1, 2, true, false, 2});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Pp, PipelineParallel, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return test_name(info.param.label()); });

// A state saved under PP is one rank's files (HF layout, every tensor); it loads on one rank into
// the same weights and continues; one rank's state loads back under PP bitwise.
TEST(PipelineParallelCheckpoints, SavedUnderPpLoadsOnOneRankAndBack) {
  const int N = world().size(), R = world().rank();
  const Case c{"qwen3-tiny", 1, 2, false, true};
  const int dp = int(N / c.pp), dp_rank = R % dp;
  const json cfg = adam_config(c, false, 5e-3), one = adam_config(c, true, 5e-3);
  auto g = global_batch();
  const int64_t g_tok = g->num_tokens(), g_seq = g->num_seqs();
  auto mine = shard_of(*g, dp_rank, dp);
  const fs::path root = world().broadcast((fs::temp_directory_path() / ("rlh_pp_" + std::to_string(::getpid()))).string());
  const fs::path dir = root / "pp", again = root / "one";
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
    rlh_model* m = be.load(model_path(c.model), true);
    be.train(m, *mine, g_tok, g_seq, nll_loss(), {});
    sdk::check(be.api()->save_state(be.raw(), m, dir.c_str()), "save_state under pp");
    saved = be.weights(m);
    for (int s = 0; s < 2; ++s) cont_loss.push_back(be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss);
    cont = be.weights(m);
  }
  {  // the files: the fixture's tensors, full shapes
    const auto f = sdk::st::File::open((dir / "model.safetensors").string());
    const auto fx = sdk::st::File::open(model_path(c.model) + "/model.safetensors");
    ASSERT_EQ(f.tensors().size(), fx.tensors().size());
    for (const auto& t : fx.tensors()) EXPECT_EQ(f.at(t.name).shape, t.shape) << t.name;
  }
  {
    Alone alone;
    Backend be(host(), "megatron", one);
    rlh_model* m = be.load(model_path(c.model), true);
    sdk::check(be.api()->load_state(be.raw(), m, dir.c_str()), "load_state at one rank");
    EXPECT_TRUE(be.weights(m) == saved) << "loaded on one rank: not the weights saved under pp";
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
  {  // one rank's files back under pp: bitwise the same weights, and the same continuation
    Backend be(host(), "megatron", cfg);
    rlh_model* m = be.load(model_path(c.model), true);
    sdk::check(be.api()->load_state(be.raw(), m, again.c_str()), "load_state under pp");
    EXPECT_TRUE(be.weights(m) == saved) << "one rank's state loaded under pp: not bitwise";
    for (int s = 0; s < 2; ++s)
      EXPECT_EQ(be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss, cont_loss[size_t(s)]) << "step " << s;
    EXPECT_TRUE(be.weights(m) == cont) << "resumed under pp: not bitwise";
  }
  world().barrier();
  if (R == 0) fs::remove_all(root);
}

TEST(PipelineParallelErrors, RefusedByName) {
  const int N = world().size();
  auto load_error = [&](const json& cfg, const std::string& model, rlh_code code, const std::string& part) {
    Backend be(host(), "megatron", cfg);
    rlh_model* m = nullptr;
    expect_error(be.try_load(model_path(model), true, &m), code, part);
  };
  load_error({{"megatron_cfg", {{"pipeline_model_parallel_size", 2}}}}, "qwen3-moe-tiny", RLH_E_UNIMPLEMENTED,
             "pipeline_model_parallel_size = 2: mixture-of-experts layers under pipeline parallelism are not implemented");
  load_error({{"megatron_cfg", {{"pipeline_model_parallel_size", 2}, {"num_layers_in_first_pipeline_stage", 2}}}},
             "llama-tiny", RLH_E_UNIMPLEMENTED,
             "pipeline_model_parallel_size = 2: the layers do not split over the stages (2 layers, "
             "num_layers_in_first_pipeline_stage = 2: 0 left for 1 stages)");
  if (N == 4)
    load_error({{"megatron_cfg", {{"pipeline_model_parallel_size", 4}}}}, "llama-tiny", RLH_E_UNIMPLEMENTED,
               "pipeline_model_parallel_size = 4: the layers do not split over the stages (2 layers: 2 left for 4 stages)");
  load_error({{"megatron_cfg", {{"pipeline_model_parallel_size", N + 1}}}}, "llama-tiny", RLH_E_INVALID_ARGUMENT,
             "pipeline_model_parallel_size = " + std::to_string(N + 1) + ": megatron: parallel sizes: world size");
  {
    Alone alone;
    load_error({{"megatron_cfg", {{"pipeline_model_parallel_size", 2}}}}, "llama-tiny", RLH_E_INVALID_ARGUMENT,
               "pipeline_model_parallel_size = 2 needs a multiple of 2 launched ranks");
  }
  {
    rlh_backend* b = nullptr;
    const std::string cfg =
        json({{"megatron_cfg", {{"pipeline_model_parallel_size", 2}, {"virtual_pipeline_model_parallel_size", 2}}}}).dump();
    expect_error(host().backend("megatron")->create(host().services(), cfg.data(), cfg.size(), &b), RLH_E_UNIMPLEMENTED,
                 "virtual_pipeline_model_parallel_size = 2: interleaved virtual pipeline stages are not implemented");
  }
  {  // the stages of a pipeline given different batches (a loop sharding over every rank)
    Backend be(host(), "megatron", {{"megatron_cfg", {{"pipeline_model_parallel_size", 2}}}});
    rlh_model* m = be.load(model_path("llama-tiny"), false);
    auto g = global_batch();
    auto mine = shard_of(*g, world().rank(), N);
    std::vector<std::vector<float>> out;
    expect_error(be.try_forward(m, *mine, {spec(RLH_OUTPUT_LOGPROB_RAW, "lp")}, out), RLH_E_INVALID_ARGUMENT,
                 "forward: the ranks of a pipeline-parallel group were given different batches");
  }
}

}  // namespace

int main(int argc, char** argv) { return run_mpi_tests(argc, argv, {"model_llama", "kernels_cpu", "megatron", "comm_mpi"}); }
