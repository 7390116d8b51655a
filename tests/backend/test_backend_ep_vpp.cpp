// Expert parallelism with interleaved virtual pipeline stages for the megatron backend on CPU
// ranks, under `mpirun -np 4` (ctest comm.backend_ep_vpp_np4, one BLAS thread per rank): PP 2 x
// VPP 2 x DP 2 x EP 2, Megatron's order tp-cp-ep-dp-pp (stage 0 is ranks {0, 1}, its ep group;
// stage 1 {2, 3}; the replicas are the even and the odd ranks). Four layers in four model chunks,
// two per rank (rank 0 of a replica layers 0 and 2, rank 1 layers 1 and 3), so each chunk's MoE
// layers exchange over the stage's ep group inside Megatron's interleaved order. Every rank also
// computes the one-rank reference in-process (a backend that sees one rank).
//
//   - a four-layer Qwen3-MoE the test writes (every chunk holds an MoE layer; the load-balancing
//     loss per micro-batch or per sequence with packing, and the z-loss) and qwen2-moe-tiny (a
//     dense layer 2 among MoE ones, so rank 0's second chunk has no exchange; a shared expert
//     with its gate, q/k/v biases), packing on and off, DDP and the distributed optimizer, with
//     and without activation checkpointing: logprobs and entropy (forward only), loss, gradient
//     norm, every gradient (SGD at lr 1: w - w' = g) and the MoE metrics as the reference's
//     within fp32 tolerance; the pipeline's bytes per step the analytic count;
//   - two AdamW steps with clipping follow the reference;
//   - replicas with unequal micro-batch counts (6 and 2 sequences a micro-batch each; and every
//     sequence on one replica, none on the other, with recompute): the less busy replica runs
//     idle micro-batches, one model chunk at a time, inside the interleaved order (and idle
//     forwards in the forward-only pass), and the step equals the reference;
//   - a state saved under the layout is one rank's files, loads on one rank and back;
//   - what stays refused with EP and virtual stages is named: layers that do not split into
//     P x V chunks (a two-layer MoE model).
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "backend_harness.hpp"
#include "model_parallel_checks.hpp"
#include "mpi_harness.hpp"
#include "rlhost/sdk/safetensors.hpp"

namespace fs = std::filesystem;
using namespace rlh;
using namespace rlh::test;
using json = nlohmann::json;

namespace {

constexpr int32_t kVocab = 512;
constexpr int kP = 2, kV = 2, kEp = 2;  // the layout's sizes (dp = world / P = 2)

const std::vector<int64_t> kLengths = {9, 14, 3, 11, 17, 6, 2, 12};
std::unique_ptr<Batch> global_batch() { return random_batch(kLengths, kVocab, 31); }

// qwen3-moe-tiny's two layers, then both again scaled by 0.9 (no two layers alike): four MoE
// layers, one in each model chunk. Written by rank 0 into a temporary directory, removed at exit.
const std::string& four_layer_qwen3_moe() {
  static const std::string dir = [] {
    const fs::path d = world().broadcast((fs::temp_directory_path() / ("rlh_epvpp_qwen3moe4_" + std::to_string(::getpid()))).string());
    if (world().rank() == 0) {
      fs::remove_all(d);
      fs::create_directories(d);
      const auto src = sdk::st::Checkpoint::open(model_path("qwen3-moe-tiny"));
      std::vector<std::vector<float>> keep;
      std::vector<std::pair<std::string, std::vector<int64_t>>> named;
      for (const std::string& n : src.names()) {
        const std::vector<int64_t> shape = src.at(n).info->shape;
        keep.push_back(src.read_f32(n));
        named.emplace_back(n, shape);
        const std::string pre = "model.layers.";
        if (n.rfind(pre, 0) == 0) {
          const size_t dot = n.find('.', pre.size());
          const int layer = std::stoi(n.substr(pre.size(), dot - pre.size()));
          std::vector<float> again = keep.back();
          for (float& x : again) x *= 0.9f;
          keep.push_back(std::move(again));
          named.emplace_back(pre + std::to_string(layer + 2) + n.substr(dot), shape);
        }
      }
      std::vector<sdk::st::WriteTensor> tensors;
      for (size_t i = 0; i < keep.size(); ++i)
        tensors.push_back({named[i].first, sdk::st::DType::F32, named[i].second,
                           std::as_bytes(std::span<const float>(keep[i].data(), keep[i].size()))});
      sdk::st::write_checkpoint(d.string(), tensors);
      json cfg = json::parse(std::ifstream(model_path("qwen3-moe-tiny") + "/config.json"));
      cfg["num_hidden_layers"] = 4;
      std::ofstream(d / "config.json") << cfg.dump(2);
      static struct Cleanup {
        std::string dir;
        ~Cleanup() { fs::remove_all(dir); }
      } cleanup;
      cleanup.dir = d.string();
    }
    world().barrier();
    return d.string();
  }();
  return dir;
}

struct Case {
  std::string model;  // "qwen3-moe-4-layers" (four_layer_qwen3_moe) or "qwen2-moe-tiny"
  bool packing;
  bool distributed_optimizer;
  bool recompute = false;
  std::string label() const {
    return model + " pp2 vpp2 ep2" + (distributed_optimizer ? " distopt" : " ddp") + (packing ? " packed" : "") +
           (recompute ? " recompute" : "");
  }
};

std::string model_of(const Case& c) {
  return c.model == "qwen3-moe-4-layers" ? four_layer_qwen3_moe() : std::string(RLH_ENGINE_FIXTURES_DIR) + "/" + c.model;
}

// Both models train with the load-balancing loss (per micro-batch, or per sequence with
// packing) and the z-loss, whose values the stages sum and whose gradients each stage adds to
// its chunks' layers.
json base_config(const Case& c, bool one_rank) {
  json cfg = {{"megatron_cfg",
               {{"moe_router_load_balancing_type", c.packing ? "seq_aux_loss" : "aux_loss"},
                {"moe_aux_loss_coeff", 0.01},
                {"moe_z_loss_coeff", 0.001}}}};
  json& mc = cfg["megatron_cfg"];
  if (!one_rank) {
    mc["pipeline_model_parallel_size"] = kP;
    mc["virtual_pipeline_model_parallel_size"] = kV;
    mc["expert_model_parallel_size"] = kEp;
  }
  if (c.recompute) mc["activation_checkpointing"] = true;
  set_batching(cfg, c.packing);
  return cfg;
}
json sgd_config(const Case& c, bool one_rank) { return with_sgd(base_config(c, one_rank), c.distributed_optimizer); }
json adam_config(const Case& c, bool one_rank, double lr) {
  return with_adam(base_config(c, one_rank), lr, c.distributed_optimizer);
}

// The pipeline's bytes of one train step on a rank (test_backend_pp.cpp's count): with V
// virtual stages on each of two ranks, a rank sends 2 V - 1 of its N x C floats (the
// activations of its chunks but the very last virtual stage's, the gradients of its chunks but
// the very first's), plus the gradient norm's sum over the stages (8 bytes). Neither model ties
// its embedding.
int64_t analytic_pp_bytes(int64_t N) { return (2 * kV - 1) * N * 64 * 4 + 8; }

// Megatron's order: the data-parallel rank varies faster than the stage.
int dp_rank() { return world().rank() % (world().size() / kP); }

bool runs_here() { return world().size() == 4; }

class ExpertParallelVirtualStages : public ::testing::TestWithParam<Case> {};

TEST_P(ExpertParallelVirtualStages, MatchesOneRank) {
  const Case c = GetParam();
  if (!runs_here()) GTEST_SKIP() << "PP 2 x VPP 2 x DP 2 x EP 2 needs 4 ranks, got " << world().size();
  auto g = global_batch();
  int64_t first = 0;
  auto mine = shard_of(*g, dp_rank(), world().size() / kP, &first);
  const SgdComparison r = compare_sgd_step(model_of(c), sgd_config(c, true), sgd_config(c, false), *g, *mine, first, c.label());
  const Outcome& got = r.got;
  EXPECT_TRUE(got.metrics.contains("metrics")) << c.label() << ": the loss callback's metrics on every stage";
  EXPECT_GT(got.metrics.value("ep/comm_bytes", int64_t(0)), 0) << c.label();
  const int64_t bytes = got.metrics["pp/comm_bytes"].get<int64_t>();
  EXPECT_EQ(bytes, analytic_pp_bytes(mine->num_tokens())) << c.label();
  // The MoE values: every chunk's layers, summed over the stages and the replicas, are one
  // rank's (the busiest expert's share only without packing: it is a per-micro-batch maximum,
  // and the shards' micro-batches are the reference's only then).
  std::vector<std::string> keys = {"moe/aux_loss", "moe/z_loss"};
  if (!c.packing) keys.push_back("moe/max_expert_load");
  std::string moe_line;
  for (const std::string& k : keys) {
    ASSERT_TRUE(got.metrics.contains(k) && r.ref.metrics.contains(k)) << c.label() << ": " << k;
    const double a = got.metrics[k].get<double>(), b = r.ref.metrics[k].get<double>();
    EXPECT_GT(b, 0) << c.label() << ": " << k;
    EXPECT_NEAR(a, b, 1e-5 * std::fabs(b)) << c.label() << ": " << k;
    moe_line += ", " + k + " " + std::to_string(a) + " vs " + std::to_string(b);
  }
  if (world().rank() == 0)
    std::cout << "[np 4] " << c.label() << ": loss " << got.loss << " vs " << r.ref.loss << ", grad norm "
              << got.grad_norm << " vs " << r.ref.grad_norm << ", gradients within " << r.grad_err
              << " (relative to the largest), logprobs within " << r.lp_err << ", entropy within " << r.ent_err
              << ", pp bytes/step " << bytes << moe_line << "\n";
}

TEST_P(ExpertParallelVirtualStages, AdamWStepsFollowOneRank) {
  const Case c = GetParam();
  if (!runs_here()) GTEST_SKIP() << "needs 4 ranks";
  auto g = global_batch();
  auto mine = shard_of(*g, dp_rank(), world().size() / kP);
  const AdamComparison r =
      compare_adamw_steps(model_of(c), adam_config(c, true, 2e-3), adam_config(c, false, 2e-3), *g, *mine, c.label());
  EXPECT_LT(r.state, r.ref_state) << c.label() << ": a stage's chunks and half their experts";
  if (world().rank() == 0)
    std::cout << "[np 4] " << c.label() << ": 2 AdamW steps, weights within " << r.worst << "; training state on rank 0 "
              << r.state / 1024 << " KiB, one rank " << r.ref_state / 1024 << " KiB\n";
}

std::vector<Case> cases() {
  return {
      {"qwen3-moe-4-layers", false, false},
      {"qwen3-moe-4-layers", true, true, true},  // packed, seq_aux_loss, distributed optimizer, recompute
      {"qwen2-moe-tiny", true, false},           // packed; rank 0's second chunk (layer 2) is dense
      {"qwen2-moe-tiny", false, true, true},
  };
}

INSTANTIATE_TEST_SUITE_P(EpVpp, ExpertParallelVirtualStages, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return test_name(info.param.label()); });

// Sequences [s0, s1) of g, as a batch of their own.
std::unique_ptr<Batch> sequences(const Batch& g, int64_t s0, int64_t s1) {
  const auto& off = g.offsets();
  std::vector<int32_t> ids(g.ids().begin() + off[size_t(s0)], g.ids().begin() + off[size_t(s1)]);
  std::vector<int64_t> o;
  for (int64_t s = s0; s <= s1; ++s) o.push_back(off[size_t(s)] - off[size_t(s0)]);
  return std::make_unique<Batch>(std::move(ids), std::move(o));
}

// Replicas with unequal micro-batch counts, one sequence a micro-batch: replica 0 (ranks 0 and
// 2) takes `busy` of the 8 sequences, replica 1 the rest; the less busy one runs the difference
// as idle micro-batches (its experts for the other replica's rows, one model chunk at a time in
// the interleaved order; idle forwards in the forward-only pass too). Loss, gradients, norm and
// the MoE values equal the reference; the idle ranks exchange.
void unequal_replicas(const Case& c, int64_t busy) {
  const int R = world().rank();
  auto g = global_batch();
  const auto config = [&](bool one_rank) {
    json cfg = sgd_config(c, one_rank);
    cfg.erase("train_micro_batch_size");
    cfg["train_micro_batch_size"] = 1;
    cfg["logprob_batch_size"] = 1;
    return cfg;
  };
  Outcome ref;
  {
    Alone alone;
    Backend be(host(), "megatron", config(true));
    rlh_model* m = be.load(model_of(c), true);
    ref = run_sgd_step(be, m, *g, g->num_tokens(), g->num_seqs());
  }
  const bool first_replica = dp_rank() == 0;
  auto mine = first_replica ? sequences(*g, 0, busy) : sequences(*g, busy, g->num_seqs());
  const int64_t first = first_replica ? 0 : g->offsets()[size_t(busy)];
  Backend be(host(), "megatron", config(false));
  rlh_model* m = be.load(model_of(c), true);
  const Outcome o = run_sgd_step(be, m, *mine, g->num_tokens(), g->num_seqs());
  const std::string label = c.label() + " replicas " + std::to_string(busy) + " + " + std::to_string(8 - busy);
  // One sequence a micro-batch: the replicas' micro-batches summed over the data-parallel group.
  EXPECT_EQ(o.metrics["num_micro_batches"].get<int64_t>(), g->num_seqs()) << label;
  ASSERT_EQ(int64_t(o.logprobs.size()), mine->num_tokens()) << label;
  double lp_err = 0;
  for (size_t t = 0; t < o.logprobs.size(); ++t)
    lp_err = std::max(lp_err, std::fabs(double(o.logprobs[t]) - double(ref.logprobs[size_t(first) + t])));
  EXPECT_LE(lp_err, 2e-5) << label;
  EXPECT_NEAR(o.loss, ref.loss, 1e-5 * std::fabs(ref.loss)) << label;
  EXPECT_NEAR(o.grad_norm, ref.grad_norm, 1e-4 * ref.grad_norm) << label;
  const double gerr = max_rel_diff(o.grads, ref.grads);
  EXPECT_LE(gerr, 1e-4) << label;
  for (const char* k : {"moe/aux_loss", "moe/z_loss", "moe/max_expert_load"}) {
    const double a = o.metrics[k].get<double>(), b = ref.metrics[k].get<double>();
    EXPECT_NEAR(a, b, 1e-5 * std::fabs(b)) << label << ": " << k;
  }
  if (mine->num_seqs() < busy) {
    EXPECT_GT(o.metrics["ep/comm_bytes"].get<int64_t>(), 0) << label << ": idle micro-batches exchange";
  }
  if (R == 0)
    std::cout << "[np 4] " << label << ": loss " << o.loss << " vs " << ref.loss << ", grad norm " << o.grad_norm
              << " vs " << ref.grad_norm << ", gradients within " << gerr << ", logprobs within " << lp_err << "\n";
}

TEST(ExpertParallelVirtualStagesIdle, UnequalMicroBatchCounts) {
  if (!runs_here()) GTEST_SKIP() << "needs 4 ranks";
  unequal_replicas({"qwen3-moe-4-layers", false, false}, 6);  // 6 and 2 micro-batches
  unequal_replicas({"qwen2-moe-tiny", false, true}, 6);
}

TEST(ExpertParallelVirtualStagesIdle, EmptyReplica) {
  if (!runs_here()) GTEST_SKIP() << "needs 4 ranks";
  unequal_replicas({"qwen3-moe-4-layers", false, true, true}, 8);  // 8 and 0, with recompute
}

// A state saved under PP 2 x VPP 2 x DP 2 x EP 2 is one rank's files (HF layout, every expert
// whole); it loads on one rank into the same weights and continues there, and one rank's state
// loads back under the layout bitwise and continues bitwise.
TEST(ExpertParallelVirtualStagesCheckpoints, LoadOnOneRankAndBack) {
  if (!runs_here()) GTEST_SKIP() << "needs 4 ranks";
  const Case c{"qwen3-moe-4-layers", false, true};
  checkpoint_round_trip(model_of(c), adam_config(c, false, 5e-3), adam_config(c, true, 5e-3), world().size() / kP,
                        dp_rank(), "epvpp", global_batch());
}

// Megatron's rule stays: the layers split evenly into P x V chunks; a two-layer MoE model under
// PP 2 x VPP 2 with EP is refused at load naming the keys.
TEST(ExpertParallelVirtualStagesErrors, RefusedByName) {
  if (!runs_here()) GTEST_SKIP() << "needs 4 ranks";
  Backend be(host(), "megatron", base_config({"qwen3-moe-tiny", false, false}, false));
  rlh_model* m = nullptr;
  expect_error(be.try_load(model_path("qwen3-moe-tiny"), true, &m), RLH_E_UNIMPLEMENTED,
               "policy.megatron_cfg.virtual_pipeline_model_parallel_size = 2: the 2 layers do not split into "
               "policy.megatron_cfg.pipeline_model_parallel_size x "
               "policy.megatron_cfg.virtual_pipeline_model_parallel_size = 4 model chunks");
}

}  // namespace

int main(int argc, char** argv) { return run_mpi_tests(argc, argv, {"model_llama", "kernels_cpu", "megatron", "comm_mpi"}); }
