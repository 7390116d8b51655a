// megatron's device path under data parallelism, under `mpirun -np N` (labels gpu, comm). Every
// rank runs its model on the CUDA engine; the gradients are summed over a device communicator
// (comm_nccl with one GPU a rank, comm_mpi staging through the host where ranks share a GPU,
// as ctest's np2 on one H200 does). Each rank holds the same global batch and trains on its
// shard; the one-rank reference is computed in-process (the launcher's variables hidden).
// Checked:
//   - DDP and the distributed optimizer follow the one-rank device run over three AdamW steps
//     (bf16 compute: the micro-batches differ, so within bf16 tolerance, not bitwise);
//   - without clipping the distributed optimizer (reduce-scatter, AdamW on a block, all-gather)
//     gives bitwise DDP's weights, and every rank holds bitwise the same weights;
//   - a rank whose shard of the batch is empty takes part;
//   - a distributed-optimizer state saved at DP = N (moments gathered) resumes bitwise at
//     DP = N (each rank keeps its block), and loads on one rank;
//   - megatron's tensor parallelism on the device (TP 2 at np 2, TP 2 x DP 2 at np 4; dense
//     models) follows the one-rank device run over three AdamW steps (DDP and the distributed
//     optimizer), every rank reports the same loss and holds the same gathered weights; a state
//     saved under TP resumes bitwise and loads at one rank into bitwise the gathered masters;
//     visit_weights_on gives the gathered masters as host views and visit_weight_pieces this
//     rank's pieces (exactly the gathered values, the senders' covering each element once); an MoE model under TP is
//     refused on the device by name and runs on the CPU engine with policy.device = auto.
// dtensor's FSDP on the device (ZeRO-3: of every unit, a layer or the root, this rank keeps its
// 1/N block of the fp32 masters, both moments, the summed gradients and the bf16 weights; a
// unit's weights are gathered before it runs, its gradients reduce-scattered after):
//   - it follows the one-rank device run over three AdamW steps (dense and MoE), as the
//     distributed optimizer does, and HSDP too (dp_replicate_size = N: shards of one rank; and
//     2 replicas of N/2-rank shards where N is a multiple of 4, skipped at np 2);
//   - memory/state_bytes per rank is 1/N of the one-rank run's masters and moments (16/N bytes
//     a parameter against 12: the gradient block is state too), memory/weight_bytes 1/N of its
//     bf16 weights, and no whole gradient buffer is kept (memory/grad_bytes 0; the staging of
//     two layers and the root is memory/stage_bytes);
//   - without clipping or weight decay it follows megatron's distributed optimizer on the same
//     blocks' math: the first loss bitwise, the updates within fp32 summation order (the layers'
//     gradients are reduced per micro-batch, the distributed optimizer's once per step), also
//     after a visit_weights_on of the gathered masters between steps, and on DeepSeek-V3 (whose
//     router reads its selection bias from the masters: under FSDP from a refreshed side copy);
//   - an empty shard takes part; a sharded state resumes bitwise at N and loads at one rank
//     with bitwise the weights it saved, and a one-rank state loads at N likewise.
// Without a usable Hopper GPU every test skips with the reason.
#include <unistd.h>

#include <cmath>
#include <limits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <utility>

#include <cuda_runtime.h>

#include "backend_harness.hpp"
#include "mpi_harness.hpp"
#include "gpu_skip.hpp"

namespace fs = std::filesystem;
using namespace rlh;
using namespace rlh::test;
using json = nlohmann::json;

namespace {

std::unique_ptr<Batch> global_batch(size_t num_seqs = kDpLengths.size()) { return dp_global_batch(num_seqs); }

// bf16 on the GPU with Adam. eps = 1 makes an update proportional to the gradient (with 1e-8
// the first steps are lr * sign(g), which turns bf16 rounding of tiny gradients into whole
// lr-sized differences), so runs over different micro-batches can be compared.
json config(bool distributed_optimizer, double clip = 1.0) {
  json cfg = {{"precision", "bfloat16"},
              {"device", "cuda"},
              {"max_grad_norm", clip},
              {"megatron_cfg",
               {{"optimizer",
                 {{"lr", 1e-3}, {"weight_decay", 0.1}, {"adam_eps", 1.0}, {"clip_grad", clip},
                  {"use_distributed_optimizer", distributed_optimizer}}}}}};
  set_batching(cfg, true);
  return cfg;
}

// dtensor (FSDP over the data-parallel ranks; HSDP with `replicate` replicas) with the same
// AdamW, clipping and batching as config(): torch's kwargs, every tensor decaying.
json fsdp_config(double clip = 1.0, double weight_decay = 0.1, int64_t replicate = 1) {
  json cfg = {{"precision", "bfloat16"},
              {"device", "cuda"},
              {"max_grad_norm", clip},
              {"optimizer",
               {{"name", "torch.optim.AdamW"}, {"kwargs", {{"lr", 1e-3}, {"weight_decay", weight_decay}, {"eps", 1.0}}}}},
              {"dtensor_cfg", {{"dp_replicate_size", replicate}}}};
  set_batching(cfg, true);
  return cfg;
}

// Every rank's weights equal rank 0's, bit for bit (a hash, min and max over the world).
bool same_on_every_rank(const Weights& w) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& [k, v] : w) {
    const auto* b = reinterpret_cast<const unsigned char*>(v.data());
    for (size_t i = 0; i < v.size() * sizeof(float); ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  const std::string mine = std::to_string(h);
  const std::string first = world().broadcast(mine);
  const int64_t differs = world().max(first != mine ? 1 : 0);  // every rank learns whether any differs
  return differs == 0;
}

// Worst over tensors of the update's relative error: |(a - base) - (b - base)| / max |b - base|;
// `where` (when given) names that tensor. The denominator is at least 64 float32 ulps of the
// tensor's largest weight: an update that small (a norm weight near 1 whose gradients are tiny;
// qwen3-tiny's under TP measured 19 ulps) is resolved by the fp32 weights only to an ulp or two,
// which alone read as a 10% error.
double update_error(const Weights& a, const Weights& b, const Weights& base, std::string* where = nullptr) {
  double worst = 0;
  for (const auto& [name, w0] : base) {
    double num = 0, den = 0, mag = 0;
    for (size_t i = 0; i < w0.size(); ++i) {
      num = std::max(num, std::fabs(double(a.at(name)[i]) - double(b.at(name)[i])));
      den = std::max(den, std::fabs(double(b.at(name)[i]) - double(w0[i])));
      mag = std::max(mag, std::fabs(double(w0[i])));
    }
    den = std::max(den, 64 * double(std::numeric_limits<float>::epsilon()) * mag);
    if (den > 0 && num / den > worst) {
      worst = num / den;
      if (where) *where = name;
    }
  }
  return worst;
}

struct RunResult {
  std::vector<double> loss;
  Weights before, after;
  json metrics;
};

RunResult train_steps(const json& cfg, const std::string& model, Batch& batch, int64_t g_tok, int64_t g_seq, int steps,
                      const char* backend = "megatron") {
  RunResult out;
  Backend be(host(), backend, cfg);
  rlh_model* m = be.load(model_path(model), true);
  out.before = be.weights(m);
  for (int s = 0; s < steps; ++s) {
    const auto r = be.train(m, batch, g_tok, g_seq, nll_loss(), {});
    out.loss.push_back(r.r.loss);
    out.metrics = r.metrics;
  }
  out.after = be.weights(m);
  return out;
}

// train_steps on this rank alone (the launcher's variables hidden): the one-rank reference.
template <class... Args>
RunResult alone_steps(Args&&... args) {
  Alone alone;
  return train_steps(std::forward<Args>(args)...);
}

// The largest relative difference of a run's losses from the reference run's, step by step.
double loss_error(const RunResult& run, const RunResult& ref) {
  double worst = 0;
  for (size_t s = 0; s < ref.loss.size(); ++s)
    worst = std::max(worst, std::fabs(run.loss[s] - ref.loss[s]) / std::fabs(ref.loss[s]));
  return worst;
}

struct Case {
  std::string model;
  bool distributed_optimizer;
  std::string label() const { return model + (distributed_optimizer ? " distopt" : " ddp"); }
};

class DeviceDataParallel : public ::testing::TestWithParam<Case> {};

TEST_P(DeviceDataParallel, FollowsOneRank) {
  REQUIRE_GPU();
  const Case c = GetParam();
  const int R = world().rank(), N = world().size();
  auto g = global_batch();
  const int64_t g_tok = g->num_tokens(), g_seq = g->num_seqs();
  const RunResult ref = alone_steps(config(c.distributed_optimizer), c.model, *g, g_tok, g_seq, 3);
  auto mine = shard_of(*g, R, N);
  const RunResult dp = train_steps(config(c.distributed_optimizer), c.model, *mine, g_tok, g_seq, 3);
  EXPECT_EQ(dp.metrics["dp_size"].get<int>(), N);
  EXPECT_EQ(dp.metrics["num_tokens"].get<int64_t>(), g_tok);
  EXPECT_GT(dp.metrics["dp/comm_bytes"].get<int64_t>(), 0);
  const double loss_err = loss_error(dp, ref);
  EXPECT_LE(loss_err, 2e-3) << c.label();
  const double uerr = update_error(dp.after, ref.after, ref.before);
  EXPECT_LE(uerr, 5e-2) << c.label();
  EXPECT_TRUE(same_on_every_rank(dp.after)) << c.label() << ": the ranks' weights differ";
  if (R == 0)
    std::cout << "[device dp " << N << "] " << c.label() << ": losses within " << loss_err
              << " (relative), 3 AdamW updates within " << uerr << " of one rank's, dp/comm_bytes "
              << dp.metrics["dp/comm_bytes"] << "\n";
}

INSTANTIATE_TEST_SUITE_P(Gpu, DeviceDataParallel,
                         ::testing::Values(Case{"llama-tiny", false}, Case{"llama-tiny", true},
                                           Case{"qwen3-moe-tiny", false}, Case{"qwen3-moe-tiny", true}),
                         [](const auto& info) { return test_name(info.param.label()); });

TEST(DeviceDataParallelExact, DistributedOptimizerIsDdpBitwise) {
  REQUIRE_GPU();
  const int R = world().rank(), N = world().size();
  auto g = global_batch();
  auto mine = shard_of(*g, R, N);
  for (const char* model : {"llama-tiny", "qwen3-moe-tiny"}) {
    // No clipping: the norm (summed over blocks or over the whole) then plays no part.
    const RunResult ddp = train_steps(config(false, 0.0), model, *mine, g->num_tokens(), g->num_seqs(), 3);
    const RunResult dist = train_steps(config(true, 0.0), model, *mine, g->num_tokens(), g->num_seqs(), 3);
    EXPECT_TRUE(dist.after == ddp.after) << model << ": the distributed optimizer's weights are not DDP's";
    EXPECT_EQ(dist.loss, ddp.loss) << model;
    EXPECT_TRUE(same_on_every_rank(dist.after)) << model;
  }
}

TEST(DeviceDataParallelEdges, EmptyShardTakesPart) {
  REQUIRE_GPU();
  const int R = world().rank(), N = world().size();
  auto g = global_batch(size_t(N - 1));  // one rank gets no sequence
  const int64_t g_tok = g->num_tokens(), g_seq = g->num_seqs();
  const RunResult ref = alone_steps(config(true), "llama-tiny", *g, g_tok, g_seq, 2);
  auto mine = shard_of(*g, R, N);
  const RunResult dp = train_steps(config(true), "llama-tiny", *mine, g_tok, g_seq, 2);
  for (size_t s = 0; s < ref.loss.size(); ++s) EXPECT_NEAR(dp.loss[s], ref.loss[s], 2e-3 * std::fabs(ref.loss[s]));
  EXPECT_LE(update_error(dp.after, ref.after, ref.before), 5e-2);
}

TEST(DeviceDataParallelCheckpoints, ShardedStateResumesBitwise) {
  REQUIRE_GPU();
  const int R = world().rank(), N = world().size();
  auto g = global_batch();
  const int64_t g_tok = g->num_tokens(), g_seq = g->num_seqs();
  auto mine = shard_of(*g, R, N);
  const fs::path dir = world().broadcast((fs::temp_directory_path() / ("rlh_cuda_dp_" + std::to_string(::getpid()))).string());
  if (R == 0) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  world().barrier();
  const json cfg = config(true);
  Weights cont;
  std::vector<double> cont_loss;
  {
    Backend be(host(), "megatron", cfg);
    rlh_model* m = be.load(model_path("qwen3-moe-tiny"), true);
    for (int s = 0; s < 2; ++s) be.train(m, *mine, g_tok, g_seq, nll_loss(), {});
    sdk::check(be.api()->save_state(be.raw(), m, dir.c_str()), "save_state");
    for (int s = 0; s < 2; ++s) cont_loss.push_back(be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss);
    cont = be.weights(m);
  }
  {  // the same size: every rank takes its block of the gathered moments back
    Backend be(host(), "megatron", cfg);
    rlh_model* m = be.load(model_path("qwen3-moe-tiny"), true);
    sdk::check(be.api()->load_state(be.raw(), m, dir.c_str()), "load_state");
    for (int s = 0; s < 2; ++s) EXPECT_EQ(be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss, cont_loss[size_t(s)]);
    EXPECT_TRUE(be.weights(m) == cont) << "resumed at the same size, not bitwise";
  }
  {  // one rank continues from it on the whole batch
    Alone alone;
    Backend be(host(), "megatron", cfg);
    rlh_model* m = be.load(model_path("qwen3-moe-tiny"), true);
    sdk::check(be.api()->load_state(be.raw(), m, dir.c_str()), "load_state at one rank");
    int64_t v = 0;
    be.weights(m, &v);
    EXPECT_EQ(v, 2);
    const double loss = be.train(m, *g, g_tok, g_seq, nll_loss(), {}).r.loss;
    EXPECT_NEAR(loss, cont_loss[0], 2e-3 * std::fabs(cont_loss[0]));
  }
  world().barrier();
  if (R == 0) fs::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// dtensor FSDP on the device

struct FsdpCase {
  std::string model;
  int replicate;  // dp_replicate_size: 1 FSDP, 0 N (replicas of one-rank shards), 2 (from 4 ranks)
  std::string label() const {
    return model + (replicate == 1 ? " fsdp" : replicate == 0 ? " hsdp" : " hsdp" + std::to_string(replicate));
  }
};

class DeviceFsdp : public ::testing::TestWithParam<FsdpCase> {};

TEST_P(DeviceFsdp, FollowsOneRankWithItsBlockOfTheState) {
  REQUIRE_GPU();
  const FsdpCase c = GetParam();
  const int R = world().rank(), N = world().size();
  const int replicas = c.replicate == 0 ? N : c.replicate;
  if (N % replicas != 0 || (c.replicate > 1 && N / replicas < 2))
    GTEST_SKIP() << c.label() << " needs a multiple of " << 2 * replicas << " ranks (mpirun -np 4)";
  auto g = global_batch();
  const int64_t g_tok = g->num_tokens(), g_seq = g->num_seqs();
  const RunResult ref = alone_steps(fsdp_config(), c.model, *g, g_tok, g_seq, 3, "dtensor");
  auto mine = shard_of(*g, R, N);
  const RunResult dp = train_steps(fsdp_config(1.0, 0.1, replicas), c.model, *mine, g_tok, g_seq, 3, "dtensor");
  EXPECT_EQ(dp.metrics["dp_size"].get<int>(), N);
  EXPECT_EQ(dp.metrics["num_tokens"].get<int64_t>(), g_tok);
  EXPECT_GT(dp.metrics["dp/comm_bytes"].get<int64_t>(), 0);
  const double loss_err = loss_error(dp, ref);
  EXPECT_LE(loss_err, 2e-3) << c.label();
  const double uerr = update_error(dp.after, ref.after, ref.before);
  EXPECT_LE(uerr, 5e-2) << c.label();
  EXPECT_TRUE(same_on_every_rank(dp.after)) << c.label() << ": the ranks' weights differ";
  // State per rank: one rank holds masters and two moments (12 bytes a parameter); a shard of
  // S ranks its block of those and of the summed gradients (16 / S), padding aside.
  const double one = ref.metrics["memory/state_bytes"].get<double>();
  const double mine_bytes = dp.metrics["memory/state_bytes"].get<double>();
  const int S = N / replicas;
  EXPECT_GT(one, 0);
  EXPECT_NEAR(mine_bytes, one * 16.0 / 12.0 / S, 0.01 * one) << c.label();
  // The bf16 weights: this rank's blocks of each unit (each padded to S 64-element blocks); no
  // whole fp32 gradient buffer; the gathered units' staging beside them.
  const double w_one = ref.metrics["memory/weight_bytes"].get<double>();
  const double w_mine = dp.metrics["memory/weight_bytes"].get<double>();
  EXPECT_GT(w_one, 0);
  EXPECT_NEAR(w_mine, w_one / S, 0.02 * w_one) << c.label();
  EXPECT_GT(ref.metrics["memory/grad_bytes"].get<double>(), 0);
  EXPECT_EQ(dp.metrics["memory/grad_bytes"].get<double>(), 0) << c.label();
  EXPECT_GT(dp.metrics["memory/stage_bytes"].get<double>(), 0) << c.label();
  if (R == 0)
    std::cout << "[device fsdp " << N << "] " << c.label() << ": losses within " << loss_err
              << " (relative), 3 AdamW updates within " << uerr << " of one rank's; memory/state_bytes "
              << mine_bytes << " per rank against " << one << " on one rank (masters + moments + gradient block over "
              << S << "); memory/weight_bytes " << w_mine << " against " << w_one << ", memory/stage_bytes "
              << dp.metrics["memory/stage_bytes"] << "; dp/comm_bytes " << dp.metrics["dp/comm_bytes"] << "\n";
}

INSTANTIATE_TEST_SUITE_P(Gpu, DeviceFsdp,
                         ::testing::Values(FsdpCase{"llama-tiny", 1}, FsdpCase{"qwen3-moe-tiny", 1},
                                           FsdpCase{"llama-tiny", 0}, FsdpCase{"qwen3-moe-tiny", 2}),
                         [](const auto& info) { return test_name(info.param.label()); });

// Weights of a visit_weights_on with the model's own device, copied to the host. A view may be a
// strided block of a fused engine tensor (rows `strides[ndim - 2]` apart): copied row by row.
Weights visit_on_device(Backend& be, rlh_model* m) {
  Weights got;
  be.visit_on(m, rlh_device{RLH_DEVICE_CUDA, 0}, [&](const std::string& n, const rlh_tensor& t) {
    ASSERT_EQ(t.device.device_type, RLH_DEVICE_CUDA) << n;
    ASSERT_EQ(t.dtype.bits, 32) << n;
    ASSERT_GE(t.ndim, 1) << n;
    const int64_t cols = t.shape[t.ndim - 1];
    int64_t rows = 1;
    for (int i = 0; i + 1 < t.ndim; ++i) rows *= t.shape[i];
    ASSERT_TRUE(t.strides[t.ndim - 1] == 1 || cols == 1) << n;
    // The outer dimensions nest contiguously over the row pitch (a block along one axis).
    for (int i = 0; i + 2 < t.ndim; ++i) ASSERT_EQ(t.strides[i], t.strides[i + 1] * t.shape[i + 1]) << n;
    const int64_t pitch = t.ndim >= 2 ? t.strides[t.ndim - 2] : cols;
    std::vector<float>& h = got[n];
    h.resize(size_t(rows * cols));
    ASSERT_EQ(cudaMemcpy2D(h.data(), size_t(cols) * 4, static_cast<const char*>(t.data) + t.byte_offset,
                           size_t(pitch) * 4, size_t(cols) * 4, size_t(rows), cudaMemcpyDeviceToHost),
              cudaSuccess) << n;
  });
  return got;
}

TEST(DeviceFsdpExact, FollowsTheDistributedOptimizer) {
  REQUIRE_GPU();
  const int R = world().rank(), N = world().size();
  auto g = global_batch();
  auto mine = shard_of(*g, R, N);
  const int64_t g_tok = g->num_tokens(), g_seq = g->num_seqs();
  // DeepSeek-V3's router reads its selection bias from the fp32 masters: under FSDP from the
  // side copy refreshed after each update, which must hold the same bits.
  for (const char* model : {"llama-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny"}) {
    SCOPED_TRACE(model);
    // No clipping and no weight decay: megatron's decay lists (1-D tensors apart) and torch's
    // (every tensor) then update alike; the lr is constant in both.
    json dist_cfg = config(true, 0.0);
    dist_cfg["megatron_cfg"]["optimizer"]["weight_decay"] = 0.0;
    const RunResult dist = train_steps(dist_cfg, model, *mine, g_tok, g_seq, 3);
    Backend be(host(), "dtensor", fsdp_config(0.0, 0.0));
    rlh_model* m = be.load(model_path(model), true);
    std::vector<double> loss;
    for (int s = 0; s < 3; ++s) {
      loss.push_back(be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss);
      if (s == 1 && std::string(model) != "deepseek-v3-tiny") {
        // The masters gathered where they live (collective), the same as visit_weights copies
        // out; the next step must clear the gradient buffer they were gathered into. (The
        // device views are tested on these two models at one rank too: test_backend_cuda.)
        const Weights viewed = visit_on_device(be, m);
        EXPECT_TRUE(viewed == be.weights(m)) << "visit_weights_on's device views are not the masters";
      }
    }
    const Weights fsdp = be.weights(m);
    // The first loss comes before any update: the same weights, the same bits. Then only the
    // gradients' fp32 summation order differs (per micro-batch, then over ranks; or the
    // reverse), a relative 1e-7 per sum that the AdamW updates carry (eps 1: no sign flips).
    EXPECT_EQ(loss[0], dist.loss[0]);
    double loss_err = 0;
    for (size_t s = 0; s < loss.size(); ++s) loss_err = std::max(loss_err, std::fabs(loss[s] - dist.loss[s]) / std::fabs(dist.loss[s]));
    const double uerr = update_error(fsdp, dist.after, dist.before);
    EXPECT_LE(loss_err, 1e-5);
    EXPECT_LE(uerr, 1e-3) << "FSDP's updates are not the distributed optimizer's";
    EXPECT_TRUE(same_on_every_rank(fsdp));
    if (R == 0)
      std::cout << "[device fsdp exact] " << model << ": losses within " << loss_err << ", updates within " << uerr
                << " of the distributed optimizer's\n";
  }
}

// dtensor's cpu_offload on the device: this rank's block of the masters and moments in host
// memory, streamed through the device by the update, gives FSDP's steps bit for bit, and the
// device views of the masters (a colocated refit's source) are staged from the host copy.
TEST(DeviceFsdpOffload, IsFsdpBitwiseWithTheStateOnTheHost) {
  REQUIRE_GPU();
  const int R = world().rank(), N = world().size();
  auto g = global_batch();
  auto mine = shard_of(*g, R, N);
  const int64_t g_tok = g->num_tokens(), g_seq = g->num_seqs();
  for (const char* model : {"llama-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny"}) {
    SCOPED_TRACE(model);
    const RunResult ref = train_steps(fsdp_config(), model, *mine, g_tok, g_seq, 3, "dtensor");
    json cfg = fsdp_config();
    cfg["dtensor_cfg"]["cpu_offload"] = true;
    Backend be(host(), "dtensor", cfg);
    rlh_model* m = be.load(model_path(model), true);
    std::vector<double> loss;
    json metrics;
    for (int s = 0; s < 3; ++s) {
      const auto step = be.train(m, *mine, g_tok, g_seq, nll_loss(), {});
      loss.push_back(step.r.loss);
      metrics = step.metrics;
      if (s == 1) {
        EXPECT_TRUE(visit_on_device(be, m) == be.weights(m)) << "the staged device views";
      }
    }
    EXPECT_EQ(loss, ref.loss);
    EXPECT_TRUE(be.weights(m) == ref.after) << "offloaded FSDP's weights are not FSDP's";
    EXPECT_GT(metrics["memory/host_state_bytes"].get<double>(), 0);
    EXPECT_EQ(ref.metrics["memory/host_state_bytes"].get<double>(), 0);
  }
}

TEST(DeviceFsdpEdges, EmptyShardTakesPart) {
  REQUIRE_GPU();
  const int R = world().rank(), N = world().size();
  auto g = global_batch(size_t(N - 1));  // one rank gets no sequence
  const int64_t g_tok = g->num_tokens(), g_seq = g->num_seqs();
  const RunResult ref = alone_steps(fsdp_config(), "qwen3-moe-tiny", *g, g_tok, g_seq, 2, "dtensor");
  auto mine = shard_of(*g, R, N);
  const RunResult dp = train_steps(fsdp_config(), "qwen3-moe-tiny", *mine, g_tok, g_seq, 2, "dtensor");
  for (size_t s = 0; s < ref.loss.size(); ++s) EXPECT_NEAR(dp.loss[s], ref.loss[s], 2e-3 * std::fabs(ref.loss[s]));
  EXPECT_LE(update_error(dp.after, ref.after, ref.before), 5e-2);
  EXPECT_TRUE(same_on_every_rank(dp.after));
}

TEST(DeviceFsdpCheckpoints, ShardedStateResumesBitwiseAndMovesBetweenSizes) {
  REQUIRE_GPU();
  const int R = world().rank(), N = world().size();
  auto g = global_batch();
  const int64_t g_tok = g->num_tokens(), g_seq = g->num_seqs();
  auto mine = shard_of(*g, R, N);
  const fs::path dir =
      world().broadcast((fs::temp_directory_path() / ("rlh_cuda_fsdp_" + std::to_string(::getpid()))).string());
  if (R == 0) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  world().barrier();
  const json cfg = fsdp_config();
  Weights saved, cont;
  std::vector<double> cont_loss;
  {
    Backend be(host(), "dtensor", cfg);
    rlh_model* m = be.load(model_path("qwen3-moe-tiny"), true);
    for (int s = 0; s < 2; ++s) be.train(m, *mine, g_tok, g_seq, nll_loss(), {});
    saved = be.weights(m);
    sdk::check(be.api()->save_state(be.raw(), m, dir.c_str()), "save_state");
    for (int s = 0; s < 2; ++s) cont_loss.push_back(be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss);
    cont = be.weights(m);
  }
  {  // the same size: every rank keeps its block of the masters and moments
    Backend be(host(), "dtensor", cfg);
    rlh_model* m = be.load(model_path("qwen3-moe-tiny"), true);
    sdk::check(be.api()->load_state(be.raw(), m, dir.c_str()), "load_state");
    EXPECT_TRUE(be.weights(m) == saved) << "loaded at the same size, not bitwise";
    for (int s = 0; s < 2; ++s) EXPECT_EQ(be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss, cont_loss[size_t(s)]);
    EXPECT_TRUE(be.weights(m) == cont) << "resumed at the same size, not bitwise";
  }
  {  // one rank (DP = 1) loads it whole and continues on the whole batch
    Alone alone;
    Backend be(host(), "dtensor", cfg);
    rlh_model* m = be.load(model_path("qwen3-moe-tiny"), true);
    sdk::check(be.api()->load_state(be.raw(), m, dir.c_str()), "load_state at one rank");
    int64_t v = 0;
    EXPECT_TRUE(be.weights(m, &v) == saved) << "loaded at one rank, not the saved weights";
    EXPECT_EQ(v, 2);
    const double loss = be.train(m, *g, g_tok, g_seq, nll_loss(), {}).r.loss;
    EXPECT_NEAR(loss, cont_loss[0], 2e-3 * std::fabs(cont_loss[0]));
  }
  // The other way: one rank (each rank alone, into a folder of its own) saves after two steps on
  // the whole batch; the DP = N model loads rank 0's, holds bitwise its weights and follows its
  // next step.
  const fs::path one_dir = dir / ("one_" + std::to_string(R));
  Weights one_saved;
  double one_next = 0;
  {
    Alone alone;
    fs::create_directories(one_dir);
    Backend be(host(), "dtensor", cfg);
    rlh_model* m = be.load(model_path("qwen3-moe-tiny"), true);
    for (int s = 0; s < 2; ++s) be.train(m, *g, g_tok, g_seq, nll_loss(), {});
    one_saved = be.weights(m);
    sdk::check(be.api()->save_state(be.raw(), m, one_dir.c_str()), "save_state at one rank");
    one_next = be.train(m, *g, g_tok, g_seq, nll_loss(), {}).r.loss;
  }
  world().barrier();
  {
    Backend be(host(), "dtensor", cfg);
    rlh_model* m = be.load(model_path("qwen3-moe-tiny"), true);
    const fs::path from = dir / "one_0";
    sdk::check(be.api()->load_state(be.raw(), m, from.c_str()), "load_state of a one-rank state at DP = N");
    EXPECT_TRUE(be.weights(m) == one_saved) << "a one-rank state loaded at DP = " << N << ", not bitwise";
    const double loss = be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss;
    EXPECT_NEAR(loss, one_next, 2e-3 * std::fabs(one_next));
  }
  world().barrier();
  if (R == 0) fs::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// megatron's tensor parallelism on the device (dense models): TP 2 at np 2, TP 2 x DP 2 at np 4.
// Each rank's engine holds its pieces; the backend slices full tensors on the way in and gathers
// them over the host tp group on the way out (weights, moments, checkpoints).

constexpr int kTp = 2;

json tp_config(bool distributed_optimizer) {
  json cfg = config(distributed_optimizer);
  cfg["megatron_cfg"]["tensor_model_parallel_size"] = kTp;
  return cfg;
}

// Every rank's values equal rank 0's, bit for bit.
bool same_values_on_every_rank(const std::vector<double>& v) {
  std::string mine(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(double));
  const std::string first = world().broadcast(mine);
  return world().max(first != mine ? 1 : 0) == 0;
}

struct TpCase {
  std::string model;
  bool distributed_optimizer;
  std::string label() const { return model + " tp2" + (distributed_optimizer ? " distopt" : " ddp"); }
};

class DeviceTensorParallel : public ::testing::TestWithParam<TpCase> {};

// Three AdamW steps under TP 2 (x DP N/2) follow the one-rank device run within the bounds DDP
// has above: the row-parallel outputs and column-parallel input gradients are summed in fp32
// before one bf16 rounding (the one-rank run rounds the whole GEMM's fp32 accumulator once too),
// so TP adds only fp32 summation order; the micro-batches differ where DP 2 splits the batch.
TEST_P(DeviceTensorParallel, FollowsOneRank) {
  REQUIRE_GPU();
  const TpCase c = GetParam();
  const int R = world().rank(), N = world().size();
  if (N % kTp != 0) GTEST_SKIP() << "tp " << kTp << " on " << N << " ranks";
  const int D = N / kTp, dp_rank = R / kTp;  // Megatron's order: the ranks of a tp group adjacent
  auto g = global_batch();
  const int64_t g_tok = g->num_tokens(), g_seq = g->num_seqs();
  const RunResult ref = alone_steps(config(c.distributed_optimizer), c.model, *g, g_tok, g_seq, 3);
  auto mine = shard_of(*g, dp_rank, D);
  const RunResult tp = train_steps(tp_config(c.distributed_optimizer), c.model, *mine, g_tok, g_seq, 3);
  EXPECT_EQ(tp.metrics["dp_size"].get<int>(), D);
  EXPECT_EQ(tp.metrics["num_tokens"].get<int64_t>(), g_tok);
  EXPECT_GT(tp.metrics["tp/comm_bytes"].get<int64_t>(), 0) << "the engine's tp traffic is not counted";
  if (D > 1) {
    EXPECT_GT(tp.metrics["dp/comm_bytes"].get<int64_t>(), 0);
  }
  const double loss_err = loss_error(tp, ref);
  EXPECT_LE(loss_err, 2e-3) << c.label();
  std::string worst;
  const double uerr = update_error(tp.after, ref.after, ref.before, &worst);
  EXPECT_LE(uerr, 5e-2) << c.label() << " (worst: " << worst << ")";
  // Every rank of a tp group computes the whole loss (summed over the data-parallel ranks, so
  // every rank of the world reports the same); the gathered masters (each rank's copy of the
  // replicated tensors among them) are the same everywhere.
  EXPECT_TRUE(same_values_on_every_rank(tp.loss)) << c.label() << ": the ranks report different losses";
  EXPECT_TRUE(same_on_every_rank(tp.after)) << c.label() << ": the ranks' gathered weights differ";
  // This rank's state is its half of the cut tensors and the (small) replicated ones whole.
  const double one = ref.metrics["memory/state_bytes"].get<double>();
  const double state = tp.metrics["memory/state_bytes"].get<double>();
  EXPECT_GT(state, 0);
  EXPECT_LT(state, 0.6 * one) << c.label();
  if (R == 0)
    std::cout << "[device tp " << kTp << " x dp " << D << "] " << c.label() << ": losses within " << loss_err
              << " (relative), 3 AdamW updates within " << uerr << " of one rank's; memory/state_bytes " << state
              << " against " << one << " on one rank\n";
}

INSTANTIATE_TEST_SUITE_P(Gpu, DeviceTensorParallel,
                         ::testing::Values(TpCase{"llama-tiny", false}, TpCase{"llama-tiny", true},
                                           TpCase{"qwen3-tiny", false}),
                         [](const auto& info) { return test_name(info.param.label()); });

// Host copies of what visit_weights_on gives (row-major host views expected).
Weights visit_on_host_views(Backend& be, rlh_model* m, bool* all_on_host) {
  Weights got;
  *all_on_host = true;
  be.visit_on(m, rlh_device{RLH_DEVICE_CUDA, 0}, [&](const std::string& n, const rlh_tensor& t) {
    if (t.device.device_type != RLH_DEVICE_CPU) {
      *all_on_host = false;
      return;
    }
    int64_t numel = 1;
    for (int i = 0; i < t.ndim; ++i) numel *= t.shape[i];
    const float* p = reinterpret_cast<const float*>(static_cast<const char*>(t.data) + t.byte_offset);
    got[n].assign(p, p + numel);
  });
  return got;
}

// visit_weight_pieces of a device model under TP: every piece holds the gathered weight's values
// at its placement, bit for bit, and over the world the senders' pieces cover every element
// exactly once. Returns the elements this rank's pieces hold.
int64_t check_weight_pieces(Backend& be, rlh_model* m, const Weights& whole) {
  struct Visit {
    const Weights* whole;
    Weights cover;
    int64_t held = 0, bad = 0;
    std::vector<std::string> errors;
  } v{&whole, {}, 0, 0, {}};
  for (const auto& [name, w] : whole) v.cover[name].assign(w.size(), 0.f);
  const auto on_piece = [](void* user, const rlh_weight_piece* p) -> rlh_status* {
    Visit& v = *static_cast<Visit*>(user);
    const rlh_tensor& t = *p->data;
    const auto w = v.whole->find(p->hf_name);
    if (w == v.whole->end() || t.device.device_type != RLH_DEVICE_CPU) {
      v.errors.push_back(std::string(p->hf_name) + ": not a weight visit_weights names, or not a host view");
      return nullptr;
    }
    int64_t n = 1;
    for (int d = 0; d < t.ndim; ++d) n *= t.shape[d];
    v.held += n;
    v.bad += compare_piece(*p, w->second, v.cover[p->hf_name]);
    return nullptr;
  };
  sdk::check(be.api()->visit_weight_pieces(be.raw(), m, on_piece, &v, nullptr), "visit_weight_pieces");
  for (const std::string& e : v.errors) ADD_FAILURE() << "rank " << world().rank() << ": " << e;
  EXPECT_EQ(v.bad, 0) << "rank " << world().rank() << ": piece elements differ from the gathered weights";
  for (auto& [name, cv] : v.cover) {
    sum_over_world(cv);
    int64_t off = 0;
    for (float x : cv) off += x != 1.f;
    EXPECT_EQ(off, 0) << name << ": elements not covered exactly once by the senders' pieces";
  }
  return v.held;
}

// A state saved under TP 2 (the distributed optimizer's moments gathered over dp, every
// tensor's pieces over tp) resumes bitwise at the same layout and loads at one rank into
// bitwise the gathered masters it saved. Between steps, visit_weights_on with the model's
// device gives the gathered masters as host views (the device holds only this rank's pieces),
// and visit_weight_pieces this rank's pieces.
TEST(DeviceTensorParallelCheckpoints, SavedUnderTpLoadsAtOneRank) {
  REQUIRE_GPU();
  const int R = world().rank(), N = world().size();
  if (N % kTp != 0) GTEST_SKIP() << "tp " << kTp << " on " << N << " ranks";
  const int D = N / kTp;
  auto g = global_batch();
  const int64_t g_tok = g->num_tokens(), g_seq = g->num_seqs();
  auto mine = shard_of(*g, R / kTp, D);
  const fs::path dir = shared_scratch_dir("rlh_cuda_tp");
  Weights saved, cont;
  std::vector<double> cont_loss;
  {
    Backend be(host(), "megatron", tp_config(true));
    rlh_model* m = be.load(model_path("llama-tiny"), true);
    for (int s = 0; s < 2; ++s) be.train(m, *mine, g_tok, g_seq, nll_loss(), {});
    saved = be.weights(m);
    bool on_host = false;
    EXPECT_TRUE(visit_on_host_views(be, m, &on_host) == saved) << "visit_weights_on under TP: not the gathered masters";
    EXPECT_TRUE(on_host) << "visit_weights_on under TP gave device views of this rank's pieces";
    int64_t all = 0;
    for (const auto& [name, w] : saved) all += int64_t(w.size());
    EXPECT_LT(check_weight_pieces(be, m, saved), all) << "visit_weight_pieces under TP: not this rank's pieces";
    sdk::check(be.api()->save_state(be.raw(), m, dir.c_str()), "save_state");
    for (int s = 0; s < 2; ++s) cont_loss.push_back(be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss);
    cont = be.weights(m);
  }
  {  // the same layout: every rank takes its pieces (and its block of the moments) back
    Backend be(host(), "megatron", tp_config(true));
    rlh_model* m = be.load(model_path("llama-tiny"), true);
    sdk::check(be.api()->load_state(be.raw(), m, dir.c_str()), "load_state");
    EXPECT_TRUE(be.weights(m) == saved) << "loaded under TP, not bitwise the saved weights";
    for (int s = 0; s < 2; ++s) EXPECT_EQ(be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss, cont_loss[size_t(s)]);
    EXPECT_TRUE(be.weights(m) == cont) << "resumed under TP, not bitwise";
  }
  {  // one rank loads it whole and continues on the whole batch
    Alone alone;
    Backend be(host(), "megatron", config(true));
    rlh_model* m = be.load(model_path("llama-tiny"), true);
    sdk::check(be.api()->load_state(be.raw(), m, dir.c_str()), "load_state at one rank");
    int64_t v = 0;
    EXPECT_TRUE(be.weights(m, &v) == saved) << "loaded at one rank, not the masters saved under TP";
    EXPECT_EQ(v, 2);
    const double loss = be.train(m, *g, g_tok, g_seq, nll_loss(), {}).r.loss;
    EXPECT_NEAR(loss, cont_loss[0], 2e-3 * std::fabs(cont_loss[0]));
  }
  world().barrier();
  if (R == 0) fs::remove_all(dir);
}

// The engine's tensor parallelism runs dense models: an MoE model under TP with policy.device =
// cuda is refused naming why; with auto it trains on the CPU engine (no device weights).
TEST(DeviceTensorParallelErrors, MoeIsRefusedOnTheDeviceAndRunsOnTheCpuEngineWithAuto) {
  REQUIRE_GPU();
  const int R = world().rank(), N = world().size();
  if (N % kTp != 0) GTEST_SKIP() << "tp " << kTp << " on " << N << " ranks";
  json cfg = tp_config(false);
  {
    Backend be(host(), "megatron", cfg);
    rlh_model* m = nullptr;
    expect_error(be.try_load(model_path("qwen3-moe-tiny"), true, &m), RLH_E_UNIMPLEMENTED,
                 "tensor parallelism with MoE experts");
  }
  cfg["device"] = "auto";
  Backend be(host(), "megatron", cfg);
  rlh_model* m = be.load(model_path("qwen3-moe-tiny"), true);
  auto g = global_batch();
  auto mine = shard_of(*g, R / kTp, N / kTp);
  const auto r = be.train(m, *mine, g->num_tokens(), g->num_seqs(), nll_loss(), {});
  EXPECT_TRUE(std::isfinite(r.r.loss));
  EXPECT_EQ(r.metrics["memory/weight_bytes"].get<double>(), 0) << "the MoE model is on the device";
  EXPECT_GT(r.metrics["tp/comm_bytes"].get<int64_t>(), 0) << "the CPU engine's tensor parallelism did not run";
}

}  // namespace

// comm_nccl where it was built (it serves ranks with a GPU each; comm_mpi the rest).
std::vector<std::string> plugins() {
  std::vector<std::string> p = {"model_llama", "kernels_cpu", "megatron", "dtensor", "comm_mpi"};
#ifdef RLH_HAVE_COMM_NCCL
  p.push_back("comm_nccl");
#endif
  return p;
}

int main(int argc, char** argv) {
  return run_mpi_tests(argc, argv, plugins());
}
