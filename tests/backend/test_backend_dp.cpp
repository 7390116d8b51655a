// Data parallelism with sharded states, under `mpirun -np N` on CPU ranks (ctest: N = 2 and 4,
// one BLAS thread per rank). Every rank holds the same global batch and trains on its shard;
// each rank also computes the data-parallel-size-1 reference in-process (a backend that loads
// its model with the launcher's variables hidden, so it sees one rank).
//
//   - dtensor FSDP (and HSDP at N = 4), megatron's distributed optimizer and plain DDP give the
//     reference's logprobs, loss, gradient norm and every gradient, within fp32 tolerance, for a
//     dense and an MoE model, with packing on and off. Gradients are read through one SGD step
//     with lr 1 and no clipping (w - w' = g), through the sharded update itself;
//   - AdamW steps follow the reference;
//   - a rank whose shard of the batch is empty takes part (FSDP keeps its peers' gathers);
//   - per-rank training state (memory/state_bytes, counted by the backend's allocator) is 1/N
//     of the reference's for FSDP, and the optimizer's part 1/N for the distributed optimizer;
//   - a state saved at DP = N resumes bitwise at DP = N, loads at DP = 1 into the same
//     tensors (saved again: the same files) and continues within fp32 tolerance; with
//     RLH_DP_CHECKPOINT set, the state and its continuation are left there for another run at
//     another size to load (ctest comm.backend_dp_np2_resume loads what np4 saved).
//   - with save_dtype bfloat16, rank 0's export is the bf16 rounding of the gathered float32
//     masters (kept in master_weights/), which load_state restores bitwise;
//   - refusals: an HSDP replica count that does not divide the world, pipeline parallelism
//     (tensor parallelism: test_backend_tp.cpp).
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "backend_harness.hpp"
#include "mpi_harness.hpp"
#include "rlhost/comm.h"
#include "rlhost/sdk/safetensors.hpp"

namespace fs = std::filesystem;
using namespace rlh;
using namespace rlh::test;
using json = nlohmann::json;

namespace {

std::unique_ptr<Batch> global_batch(size_t num_seqs = kDpLengths.size()) { return dp_global_batch(num_seqs); }

struct Case {
  std::string backend;  // dtensor, megatron
  std::string model;    // fixture
  bool packing;
  bool distributed_optimizer = true;  // megatron
  int64_t dp_replicate = 1;           // dtensor
  std::string label() const {
    return backend + (backend == "megatron" ? (distributed_optimizer ? "/distopt" : "/ddp") : "/fsdp") +
           (dp_replicate > 1 ? "x" + std::to_string(dp_replicate) : "") + " " + model + (packing ? " packed" : "");
  }
};

// SGD lr 1, no momentum, decay or clipping: one step moves every weight by its gradient.
json sgd_config(const Case& c) {
  json cfg;
  if (c.backend == "dtensor") {
    cfg = {{"optimizer", {{"name", "torch.optim.SGD"}, {"kwargs", {{"lr", 1.0}}}}}, {"max_grad_norm", 0.0}};
    cfg["dtensor_cfg"] = {{"dp_replicate_size", c.dp_replicate}};
  } else {
    cfg = {{"megatron_cfg",
            {{"optimizer",
              {{"optimizer", "sgd"}, {"lr", 1.0}, {"sgd_momentum", 0.0}, {"weight_decay", 0.0}, {"clip_grad", 0.0},
               {"use_distributed_optimizer", c.distributed_optimizer}}}}}};
  }
  set_batching(cfg, c.packing);
  return cfg;
}

json adam_config(const Case& c, double lr) {
  json cfg = sgd_config(c);
  if (c.backend == "dtensor") {
    cfg["optimizer"] = {{"name", "torch.optim.AdamW"}, {"kwargs", {{"lr", lr}, {"weight_decay", 0.01}}}};
    cfg["max_grad_norm"] = 1.0;
  } else {
    cfg["megatron_cfg"]["optimizer"] = {{"optimizer", "adam"}, {"lr", lr}, {"weight_decay", 0.01}, {"clip_grad", 1.0},
                                        {"use_distributed_optimizer", c.distributed_optimizer}};
  }
  return cfg;
}


// What one side computes: logprobs of its batch, one SGD step's loss, norm, gradients.
struct Outcome {
  std::vector<float> logprobs;
  double loss = 0, grad_norm = 0;
  Weights grads;
  json metrics;
};

Outcome run_sgd_step(Backend& be, rlh_model* m, Batch& batch, int64_t g_tok, int64_t g_seq) {
  Outcome o;
  o.logprobs = be.logprobs(m, batch);
  const Weights before = be.weights(m);
  const auto r = be.train(m, batch, g_tok, g_seq, nll_loss(), Backend::TrainOptions{});
  o.loss = r.r.loss;
  o.grad_norm = r.r.grad_norm;
  o.metrics = r.metrics;
  o.grads = minus(before, be.weights(m));  // lr 1: w - w' = g
  return o;
}

class DataParallel : public ::testing::TestWithParam<Case> {};

TEST_P(DataParallel, MatchesOneRank) {
  const Case c = GetParam();
  const int R = world().rank(), N = world().size();
  auto g = global_batch();
  const int64_t g_tok = g->num_tokens(), g_seq = g->num_seqs();
  if (c.dp_replicate > 1 && N % c.dp_replicate != 0) GTEST_SKIP() << "dp_replicate " << c.dp_replicate << " on " << N;

  Outcome ref;
  {
    Alone alone;
    Case one = c;
    one.dp_replicate = 1;  // one rank holds one replica
    Backend be(host(), c.backend.c_str(), sgd_config(one));
    rlh_model* m = be.load(model_path(c.model), true);
    ref = run_sgd_step(be, m, *g, g_tok, g_seq);
  }
  int64_t first = 0;
  auto mine = shard_of(*g, R, N, &first);
  Backend be(host(), c.backend.c_str(), sgd_config(c));
  rlh_model* m = be.load(model_path(c.model), true);
  const Outcome dp = run_sgd_step(be, m, *mine, g_tok, g_seq);
  EXPECT_EQ(dp.metrics["dp_size"].get<int>(), N);
  // Logprobs of this rank's sequences: the reference's at the same tokens.
  ASSERT_EQ(int64_t(dp.logprobs.size()), mine->num_tokens());
  double lp_err = 0;
  for (size_t t = 0; t < dp.logprobs.size(); ++t)
    lp_err = std::max(lp_err, std::fabs(double(dp.logprobs[t]) - double(ref.logprobs[size_t(first) + t])));
  EXPECT_LE(lp_err, 2e-5) << c.label();
  // Loss and gradient norm of the global batch; every gradient.
  EXPECT_NEAR(dp.loss, ref.loss, 1e-5 * std::fabs(ref.loss)) << c.label();
  EXPECT_NEAR(dp.grad_norm, ref.grad_norm, 1e-4 * ref.grad_norm) << c.label();
  const double gerr = max_rel_diff(dp.grads, ref.grads);
  EXPECT_LE(gerr, 1e-4) << c.label();
  EXPECT_EQ(dp.metrics["num_tokens"].get<int64_t>(), g_tok);
  if (R == 0)
    std::cout << "[dp " << N << "] " << c.label() << ": loss " << dp.loss << " vs " << ref.loss << ", grad norm "
              << dp.grad_norm << " vs " << ref.grad_norm << ", gradients within " << gerr << " (relative to the largest), logprobs within "
              << lp_err << "\n";
}

TEST_P(DataParallel, AdamWStepsFollowOneRankAndStateIsSharded) {
  const Case c = GetParam();
  const int R = world().rank(), N = world().size();
  if (c.dp_replicate > 1 && N % c.dp_replicate != 0) GTEST_SKIP() << "dp_replicate " << c.dp_replicate << " on " << N;
  auto g = global_batch();
  const int64_t g_tok = g->num_tokens(), g_seq = g->num_seqs();
  std::vector<double> ref_loss;
  Weights ref_w;
  double ref_state = 0;
  {
    Alone alone;
    Case one = c;
    one.dp_replicate = 1;
    Backend be(host(), c.backend.c_str(), adam_config(one, 2e-3));
    rlh_model* m = be.load(model_path(c.model), true);
    for (int s = 0; s < 3; ++s) {
      const auto r = be.train(m, *g, g_tok, g_seq, nll_loss(), {});
      ref_loss.push_back(r.r.loss);
      ref_state = r.metrics["memory/state_bytes"].get<double>();
    }
    ref_w = be.weights(m);
  }
  auto mine = shard_of(*g, R, N);
  Backend be(host(), c.backend.c_str(), adam_config(c, 2e-3));
  rlh_model* m = be.load(model_path(c.model), true);
  double state = 0;
  for (int s = 0; s < 3; ++s) {
    const auto r = be.train(m, *mine, g_tok, g_seq, nll_loss(), {});
    EXPECT_NEAR(r.r.loss, ref_loss[size_t(s)], 2e-5 * std::fabs(ref_loss[size_t(s)])) << c.label() << " step " << s;
    state = r.metrics["memory/state_bytes"].get<double>();
  }
  // AdamW divides by sqrt(v): where a gradient is ~0 its rounding decides the step's sign, so
  // weights agree to a few lr, not to fp32.
  const Weights w = be.weights(m);
  double worst = 0;
  for (const auto& [k, v] : ref_w)
    for (size_t i = 0; i < v.size(); ++i) worst = std::max(worst, std::fabs(double(w.at(k)[i]) - double(v[i])));
  EXPECT_LE(worst, 3 * 2 * 2e-3) << c.label();
  // Training state per rank: parameters, gradients and both moments are 4 copies of the model
  // at one rank. FSDP shards all four over the shard group (N / dp_replicate ranks), padding
  // one block per unit at most; the distributed optimizer keeps parameters and gradients whole
  // and shards its gradient block and moments.
  const double shard_ranks = double(N) / double(c.dp_replicate);
  const double P = ref_state / 4;
  double expected = 0;
  if (c.backend == "dtensor") expected = 4 * P / shard_ranks;
  else if (c.distributed_optimizer) expected = 2 * P + 3 * P / N;
  else expected = 4 * P;
  EXPECT_NEAR(state, expected, 0.01 * expected + 64 * 1024) << c.label();
  if (R == 0)
    std::cout << "[dp " << N << "] " << c.label() << ": training state per rank " << state / 1024 << " KiB, one rank "
              << ref_state / 1024 << " KiB (ratio " << state / ref_state << "); weights after 3 AdamW steps within "
              << worst << "\n";
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (const char* model : {"llama-tiny", "qwen3-moe-tiny"})
    for (bool packing : {false, true}) {
      v.push_back({"dtensor", model, packing});
      v.push_back({"megatron", model, packing, true});
    }
  v.push_back({"megatron", "llama-tiny", false, false});  // DDP
  v.push_back({"dtensor", "llama-tiny", true, true, 2});  // HSDP: 2 replicas
  return v;
}

INSTANTIATE_TEST_SUITE_P(Dp, DataParallel, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return test_name(info.param.label()); });

// A rank whose share of the batch is empty still takes part in the step (FSDP: the gathers and
// reductions of as many micro-batches as the busiest rank).
TEST(DataParallelEdges, EmptyShardOnSomeRanks) {
  const int R = world().rank(), N = world().size();
  for (const Case& c : {Case{"dtensor", "llama-tiny", false}, Case{"megatron", "llama-tiny", false}}) {
    auto g = global_batch(1);  // one sequence: every rank but one has none
    Outcome ref;
    {
      Alone alone;
      Backend be(host(), c.backend.c_str(), sgd_config(c));
      ref = run_sgd_step(be, be.load(model_path(c.model), true), *g, g->num_tokens(), 1);
    }
    auto mine = shard_of(*g, R, N);
    EXPECT_EQ(mine->num_seqs(), R == N - 1 ? 1 : 0);
    Backend be(host(), c.backend.c_str(), sgd_config(c));
    rlh_model* m = be.load(model_path(c.model), true);
    const Outcome dp = run_sgd_step(be, m, *mine, g->num_tokens(), 1);
    EXPECT_NEAR(dp.loss, ref.loss, 1e-5 * std::fabs(ref.loss)) << c.label();
    EXPECT_LE(max_rel_diff(dp.grads, ref.grads), 1e-4) << c.label();
  }
}

// Saved at DP = N: resumes bitwise at N; loads at 1 into the same tensors (saving again writes
// the same files) and continues within fp32 tolerance of the DP = N run.
TEST(DataParallelCheckpoints, SavedShardedLoadsAtAnySize) {
  const int R = world().rank(), N = world().size();
  for (const Case& c : {Case{"dtensor", "qwen3-moe-tiny", true}, Case{"megatron", "llama-tiny", true}}) {
    const json cfg = adam_config(c, 5e-3);
    auto g = global_batch();
    const int64_t g_tok = g->num_tokens(), g_seq = g->num_seqs();
    auto mine = shard_of(*g, R, N);
    const std::string tag = c.backend + "_" + std::to_string(N);
    const char* keep = std::getenv("RLH_DP_CHECKPOINT");
    const fs::path root = world().broadcast(
        keep != nullptr ? std::string(keep) : (fs::temp_directory_path() / ("rlh_dp_" + std::to_string(::getpid()))).string());
    const fs::path dir = root / tag, again = root / (tag + "_resaved");
    if (R == 0) {
      fs::remove_all(dir);
      fs::remove_all(again);
      fs::create_directories(dir);
      fs::create_directories(again);
    }
    world().barrier();
    Weights cont;
    std::vector<double> cont_loss;
    {
      Backend be(host(), c.backend.c_str(), cfg);
      rlh_model* m = be.load(model_path(c.model), true);
      for (int s = 0; s < 2; ++s) be.train(m, *mine, g_tok, g_seq, nll_loss(), {});
      sdk::check(be.api()->save_state(be.raw(), m, dir.c_str()), "save_state");
      for (int s = 0; s < 2; ++s) cont_loss.push_back(be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss);
      cont = be.weights(m);
    }
    {  // the same size: bitwise
      Backend be(host(), c.backend.c_str(), cfg);
      rlh_model* m = be.load(model_path(c.model), true);
      sdk::check(be.api()->load_state(be.raw(), m, dir.c_str()), "load_state");
      int64_t v = 0;
      be.weights(m, &v);
      EXPECT_EQ(v, 2);
      for (int s = 0; s < 2; ++s)
        EXPECT_EQ(be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss, cont_loss[size_t(s)]) << c.label();
      EXPECT_TRUE(be.weights(m) == cont) << c.label() << ": resumed at the same size, not bitwise";
    }
    {  // one rank
      Alone alone;
      Backend be(host(), c.backend.c_str(), cfg);
      rlh_model* m = be.load(model_path(c.model), true);
      sdk::check(be.api()->load_state(be.raw(), m, dir.c_str()), "load_state at one rank");
      if (R == 0) {
        sdk::check(be.api()->save_state(be.raw(), m, again.c_str()), "save_state at one rank");
        for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
          const auto a = sdk::st::File::open((dir / file).string()), b = sdk::st::File::open((again / file).string());
          ASSERT_EQ(a.tensors().size(), b.tensors().size()) << file;
          for (const auto& t : a.tensors())
            EXPECT_TRUE(a.read_f32(t.name) == b.read_f32(t.name)) << c.label() << ": " << file << " " << t.name;
        }
      }
      for (int s = 0; s < 2; ++s) {
        const double loss = be.train(m, *g, g_tok, g_seq, nll_loss(), {}).r.loss;
        EXPECT_NEAR(loss, cont_loss[size_t(s)], 2e-5 * std::fabs(cont_loss[size_t(s)])) << c.label();
      }
      const Weights w = be.weights(m);
      double worst = 0;
      for (const auto& [k, v] : cont)
        for (size_t i = 0; i < v.size(); ++i) worst = std::max(worst, std::fabs(double(w.at(k)[i]) - double(v[i])));
      EXPECT_LE(worst, 2 * 2 * 5e-3) << c.label();
    }
    world().barrier();
    if (keep != nullptr && R == 0) {
      // For a run at another size: the continuation's losses and weights.
      std::ofstream(root / (tag + ".json")) << json({{"losses", cont_loss}}).dump();
      std::vector<sdk::st::WriteTensor> tensors;
      for (const auto& [k, v] : cont)
        tensors.push_back({k, sdk::st::DType::F32, {int64_t(v.size())}, std::as_bytes(std::span<const float>(v))});
      sdk::st::write_file((root / (tag + "_continued.safetensors")).string(), tensors, {});
    }
    if (keep == nullptr && R == 0) fs::remove_all(root);
  }
}

// save_dtype bfloat16 at DP = N: rank 0 writes the gathered state as one rank would: the HF
// export is the bf16 rounding of the float32 masters bit for bit, the masters (master_weights/)
// are the full weights, and load_state at N restores them and continues bitwise.
TEST(DataParallelCheckpoints, Bf16ExportKeepsTheGatheredMasters) {
  const int R = world().rank(), N = world().size();
  auto bf16_rne = [](float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  };
  const std::string bf16 = R"({"save_dtype": "bfloat16"})";
  for (const Case& c : {Case{"dtensor", "llama-tiny", true}, Case{"megatron", "llama-tiny", true}}) {
    const json cfg = adam_config(c, 5e-3);
    auto g = global_batch();
    const int64_t g_tok = g->num_tokens(), g_seq = g->num_seqs();
    auto mine = shard_of(*g, R, N);
    const fs::path dir = world().broadcast(
        (fs::temp_directory_path() / ("rlh_dp_bf16_" + std::to_string(::getpid()) + "_" + c.backend)).string());
    if (R == 0) {
      fs::remove_all(dir);
      fs::create_directories(dir);
    }
    world().barrier();
    Weights saved, cont;
    std::vector<double> cont_loss;
    {
      Backend be(host(), c.backend.c_str(), cfg);
      rlh_model* m = be.load(model_path(c.model), true, "policy", bf16);
      for (int s = 0; s < 2; ++s) be.train(m, *mine, g_tok, g_seq, nll_loss(), {});
      saved = be.weights(m);
      sdk::check(be.api()->save_state(be.raw(), m, dir.c_str()), "save_state");
      for (int s = 0; s < 2; ++s) cont_loss.push_back(be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss);
      cont = be.weights(m);
    }
    if (R == 0) {
      const auto exported = sdk::st::Checkpoint::open(dir.string());
      const auto masters = sdk::st::Checkpoint::open((dir / "master_weights").string());
      size_t params = 0, differ = 0;
      for (const auto& [name, w] : saved) {
        ++params;
        const auto e = exported.at(name);
        ASSERT_EQ(e.info->dtype, sdk::st::DType::BF16) << c.label() << " " << name;
        EXPECT_TRUE(masters.read_f32(name) == w) << c.label() << ": master " << name << " is not the gathered weight";
        const auto eb = e.file->data(*e.info);
        ASSERT_EQ(eb.size(), w.size() * 2) << name;
        for (size_t i = 0; i < w.size(); ++i) {
          uint16_t got;
          std::memcpy(&got, eb.data() + 2 * i, 2);
          differ += got != bf16_rne(w[i]);
        }
      }
      EXPECT_GT(params, 0u);
      EXPECT_EQ(differ, 0u) << c.label() << ": exported elements not the bf16 rounding of the masters";
      const json state = json::parse(std::ifstream(dir / "rlhost_state.json"));
      EXPECT_EQ(state["weights_dtype"], "bfloat16") << c.label();
      EXPECT_EQ(state["master_weights"], "master_weights") << c.label();
      EXPECT_EQ(state["saved_by"]["data_parallel_size"], N) << c.label();
      EXPECT_EQ(json::parse(std::ifstream(dir / "config.json"))["torch_dtype"], "bfloat16") << c.label();
    }
    {
      Backend be(host(), c.backend.c_str(), cfg);
      rlh_model* m = be.load(model_path(c.model), true, "policy", bf16);
      sdk::check(be.api()->load_state(be.raw(), m, dir.c_str()), "load_state");
      EXPECT_TRUE(be.weights(m) == saved) << c.label() << ": load_state did not restore the float32 masters";
      for (int s = 0; s < 2; ++s)
        EXPECT_EQ(be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss, cont_loss[size_t(s)]) << c.label();
      EXPECT_TRUE(be.weights(m) == cont) << c.label() << ": resumed from a bf16 export, not bitwise";
    }
    world().barrier();
    if (R == 0) fs::remove_all(dir);
  }
}

// With RLH_DP_RESUME_FROM (a folder RLH_DP_CHECKPOINT filled at another size): the state saved
// there loads at this size and continues within fp32 tolerance of that run's continuation.
TEST(DataParallelCheckpoints, ResumesAStateSavedAtAnotherSize) {
  const char* from = std::getenv("RLH_DP_RESUME_FROM");
  if (from == nullptr) GTEST_SKIP() << "RLH_DP_RESUME_FROM is not set (ctest comm.backend_dp_np2_resume sets it)";
  const int R = world().rank(), N = world().size();
  const int saved_at = std::atoi(std::getenv("RLH_DP_RESUME_SIZE") != nullptr ? std::getenv("RLH_DP_RESUME_SIZE") : "4");
  for (const Case& c : {Case{"dtensor", "qwen3-moe-tiny", true}, Case{"megatron", "llama-tiny", true}}) {
    const std::string tag = c.backend + "_" + std::to_string(saved_at);
    const fs::path root(from);
    ASSERT_TRUE(fs::exists(root / tag / "rlhost_state.json")) << root / tag;
    std::ifstream in(root / (tag + ".json"));
    const json expect = json::parse(in);
    auto g = global_batch();
    auto mine = shard_of(*g, R, N);
    Backend be(host(), c.backend.c_str(), adam_config(c, 5e-3));
    rlh_model* m = be.load(model_path(c.model), true);
    sdk::check(be.api()->load_state(be.raw(), m, (root / tag).c_str()), "load_state");
    for (int s = 0; s < 2; ++s) {
      const double loss = be.train(m, *mine, g->num_tokens(), g->num_seqs(), nll_loss(), {}).r.loss;
      const double want = expect["losses"][size_t(s)].get<double>();
      EXPECT_NEAR(loss, want, 2e-5 * std::fabs(want)) << c.label() << " saved at " << saved_at << ", resumed at " << N;
    }
    const Weights w = be.weights(m);
    const auto f = sdk::st::File::open((root / (tag + "_continued.safetensors")).string());
    double worst = 0;
    for (const auto& t : f.tensors()) {
      const std::vector<float> v = f.read_f32(t.name);
      for (size_t i = 0; i < v.size(); ++i) worst = std::max(worst, std::fabs(double(w.at(t.name)[i]) - double(v[i])));
    }
    EXPECT_LE(worst, 2 * 2 * 5e-3) << c.label();
    if (R == 0)
      std::cout << "[dp " << N << "] " << c.label() << ": state saved at DP " << saved_at << " resumed; weights after 2 steps within "
                << worst << " of that run\n";
  }
}

TEST(DataParallelErrors, RefusedByName) {
  const int N = world().size();
  {
    Backend be(host(), "dtensor", {{"dtensor_cfg", {{"dp_replicate_size", N + 1}}}});
    rlh_model* m = nullptr;
    expect_error(be.try_load(model_path("llama-tiny"), true, &m), RLH_E_INVALID_ARGUMENT, "dp_replicate");
  }
  {
    Alone alone;
    Backend be(host(), "dtensor", {{"dtensor_cfg", {{"dp_replicate_size", 2}}}});
    rlh_model* m = nullptr;
    expect_error(be.try_load(model_path("llama-tiny"), true, &m), RLH_E_INVALID_ARGUMENT,
                 "policy.dtensor_cfg.dp_replicate_size = 2 replicas need");
  }
  rlh_backend* b = nullptr;
  const std::string cfg = json({{"megatron_cfg", {{"virtual_pipeline_model_parallel_size", 2}}}}).dump();
  expect_error(host().backend("megatron")->create(host().services(), cfg.data(), cfg.size(), &b), RLH_E_INVALID_ARGUMENT,
               "virtual_pipeline_model_parallel_size: set to 2 needs megatron_cfg.pipeline_model_parallel_size > 1");
}

}  // namespace

int main(int argc, char** argv) { return run_mpi_tests(argc, argv, {"model_llama", "kernels_cpu", "dtensor", "megatron", "comm_mpi"}); }
