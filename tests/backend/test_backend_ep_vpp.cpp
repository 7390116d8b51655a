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
#include <cstdlib>
#include <iostream>

#include "backend_harness.hpp"
#include "model_parallel_checks.hpp"
#include "mpi_harness.hpp"

using namespace rlh;
using namespace rlh::test;
using json = nlohmann::json;

namespace {

constexpr int kP = 2, kV = 2, kEp = 2;  // the layout's sizes (dp = world / P = 2)

// qwen3-moe-tiny's two layers, then both again scaled by 0.9: four MoE layers, one in each model
// chunk.
const std::string& four_layer_qwen3_moe() {
  static const std::string dir = doubled_layers_model("qwen3-moe-tiny", "epvpp_qwen3moe4");
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
  json cfg = {{"megatron_cfg", json::object()}};
  json& mc = cfg["megatron_cfg"];
  set_moe_aux_losses(mc, c.packing);
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
  const Share p(world().size() / kP, dp_rank());
  const SgdComparison r =
      compare_sgd_step(model_of(c), sgd_config(c, true), sgd_config(c, false), *p.global, *p.mine, p.first, c.label());
  const Outcome& got = r.got;
  EXPECT_TRUE(got.metrics.contains("metrics")) << c.label() << ": the loss callback's metrics on every stage";
  EXPECT_GT(got.metrics.value("ep/comm_bytes", int64_t(0)), 0) << c.label();
  const int64_t bytes = got.metrics["pp/comm_bytes"].get<int64_t>();
  EXPECT_EQ(bytes, analytic_pp_bytes(p.mine->num_tokens())) << c.label();
  // The MoE values: every chunk's layers, summed over the stages and the replicas, are one
  // rank's (the busiest expert's share only without packing: it is a per-micro-batch maximum,
  // and the shards' micro-batches are the reference's only then).
  std::vector<std::string> keys = {"moe/aux_loss", "moe/z_loss"};
  if (!c.packing) keys.push_back("moe/max_expert_load");
  const std::string moe_line = expect_moe_metrics(got.metrics, r.ref.metrics, keys, 1e-5, c.label());
  if (world().rank() == 0)
    std::cout << "[np 4] " << c.label() << ": " << sgd_summary(r) << ", pp bytes/step " << bytes << moe_line << "\n";
}

TEST_P(ExpertParallelVirtualStages, AdamWStepsFollowOneRank) {
  const Case c = GetParam();
  if (!runs_here()) GTEST_SKIP() << "needs 4 ranks";
  const Share p(world().size() / kP, dp_rank());
  const AdamComparison r =
      compare_adamw_steps(model_of(c), adam_config(c, true, 2e-3), adam_config(c, false, 2e-3), *p.global, *p.mine, c.label());
  EXPECT_LT(r.state, r.ref_state) << c.label() << ": a stage's chunks and half their experts";
  if (world().rank() == 0) std::cout << "[np 4] " << c.label() << ": " << adam_summary(r) << "\n";
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

// Replicas with unequal micro-batch counts, one sequence a micro-batch: replica 0 (ranks 0 and
// 2) takes `busy` of the 8 sequences, replica 1 the rest; the less busy one runs the difference
// as idle micro-batches (its experts for the other replica's rows, one model chunk at a time in
// the interleaved order; idle forwards in the forward-only pass too). Loss, gradients, norm and
// the MoE values equal the reference; the idle ranks exchange.
void unequal_replicas(const Case& c, int64_t busy) {
  const int R = world().rank();
  auto g = layout_batch();
  const auto config = [&](bool one_rank) {
    json cfg = sgd_config(c, one_rank);
    cfg.erase("train_micro_batch_size");
    cfg["train_micro_batch_size"] = 1;
    cfg["logprob_batch_size"] = 1;
    return cfg;
  };
  const bool first_replica = dp_rank() == 0;
  int64_t first = 0;
  auto mine = first_replica ? sequences(*g, 0, busy, &first) : sequences(*g, busy, g->num_seqs(), &first);
  const SgdComparison r = sgd_step_both(model_of(c), config(true), config(false), *g, *mine);
  const Outcome &o = r.got, &ref = r.ref;
  const std::string label = c.label() + " replicas " + std::to_string(busy) + " + " + std::to_string(8 - busy);
  // One sequence a micro-batch: the replicas' micro-batches summed over the data-parallel group.
  EXPECT_EQ(o.metrics["num_micro_batches"].get<int64_t>(), g->num_seqs()) << label;
  ASSERT_EQ(int64_t(o.logprobs.size()), mine->num_tokens()) << label;
  const double lp_err = max_abs_diff_at(o.logprobs, ref.logprobs, size_t(first));
  EXPECT_LE(lp_err, 2e-5) << label;
  const double gerr = expect_step_matches(o, ref, label);
  expect_moe_metrics(o.metrics, ref.metrics, {"moe/aux_loss", "moe/z_loss", "moe/max_expert_load"}, 1e-5, label);
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
                        dp_rank(), "epvpp", layout_batch());
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
