// Expert tensor parallelism between 1 and the tensor-parallel size for the megatron backend on
// CPU ranks, under `mpirun -np 4` (ctest comm.backend_ep_etp_np4, one BLAS thread per rank):
// tensor_model_parallel_size 4, expert_model_parallel_size 2, expert_tensor_parallel_size 2 and
// sequence parallelism (Megatron-Core's general expert layout: the four ranks of a stage
// regrouped etp x ep x edp, etp fastest: etp groups {0,1}, {2,3}, ep groups {0,2}, {1,3}; each
// expert cut in two blocks over an etp group; every tp rank routes its own rows). Every rank also
// computes the one-rank reference in-process.
//
//   - one SGD step (lr 1, no clipping: w - w' = g) gives the reference's logprobs, entropy, loss,
//     gradient norm, every gradient and the MoE metrics (aux_loss, z_loss, max_expert_load)
//     within fp32 tolerance, on qwen3-moe-tiny (softmax top-2 of 8, load-balancing and z losses)
//     and deepseek-v3-tiny (MLA, a dense first layer, the float64 sigmoid router, a shared expert
//     cut over all four ranks), packing on and off, DDP and the distributed optimizer, with
//     activation checkpointing;
//   - two AdamW steps with clipping follow the reference, on less training state per rank;
//   - a state saved under the layout is the one-rank HF layout, loads on one rank and continues
//     there; one rank's state loads back under it bitwise and continues bitwise;
//   - on the engine: the forward, the routing record, a replayed routing's outputs and a train
//     step's gradients under that routing (each rank's pieces) are the one-rank engine's;
//   - refusals name the keys: etp not dividing tp, etp below tp without expert parallelism,
//     etp x ep not dividing the ranks, no sequence parallelism.
// (The weight pieces of this layout tile every weight once: test_backend_pieces.cpp, np 4.)
#include <cstdlib>
#include <iostream>

#include "backend_harness.hpp"
#include "engine_under_mpi.hpp"
#include "model_parallel_checks.hpp"
#include "mpi_harness.hpp"
#include "rlhost/backend_common/data_parallel.hpp"
#include "rlhost/engine/engine.hpp"
#include "rlhost/sdk/comm.hpp"
#include "rlhost/sdk/expert_parallel.hpp"
#include "rlhost/sdk/parallel_groups.hpp"
#include "rlhost/sdk/tensor_parallel.hpp"

using namespace rlh;
using namespace rlh::test;
using json = nlohmann::json;

namespace {

constexpr int64_t kTp = 4, kEp = 2, kEtp = 2;

struct Case {
  std::string model;
  bool packing;
  bool distributed_optimizer;
  bool recompute = false;
  std::string label() const {
    return model + " tp4 ep2 etp2 sp" + (distributed_optimizer ? " distopt" : " ddp") + (packing ? " packed" : "") +
           (recompute ? " recompute" : "");
  }
  bool softmax() const { return model == "qwen3-moe-tiny"; }
};

// The layout's config (one_rank: the reference's, with the same MoE and batching settings). The
// softmax router trains with the load-balancing loss (per micro-batch without packing, per
// sequence with it) and the z-loss; the sigmoid router in float64.
json base_config(const Case& c, bool one_rank) {
  json mc = json::object();
  if (!one_rank) {
    mc["tensor_model_parallel_size"] = kTp;
    mc["expert_model_parallel_size"] = kEp;
    mc["expert_tensor_parallel_size"] = kEtp;
    mc["sequence_parallel"] = true;
  }
  return moe_layout_config(mc, c.softmax(), c.packing, c.recompute);
}

// This rank's share: the tp group (4 adjacent ranks) is one data-parallel rank.
Share share() { return Share(world().size() / int(kTp), world().rank() / int(kTp)); }

bool runs_here() { return world().size() % kTp == 0; }

class ExpertTensorParallel : public ::testing::TestWithParam<Case> {};

TEST_P(ExpertTensorParallel, MatchesOneRank) {
  const Case c = GetParam();
  if (!runs_here()) GTEST_SKIP() << c.label() << " on " << world().size() << " ranks";
  const Share p = share();
  const SgdComparison r = compare_sgd_step(c.model, with_sgd(base_config(c, true), c.distributed_optimizer),
                                           with_sgd(base_config(c, false), c.distributed_optimizer), *p.global, *p.mine,
                                           p.first, c.label());
  // The MoE metrics: every rank's rows' share, summed over the tp group: one rank's values.
  // The busiest expert's share is a per-micro-batch maximum: packing cuts them otherwise.
  std::vector<std::string> keys = {"moe/max_expert_load"};
  if (c.softmax()) keys.insert(keys.end(), {"moe/aux_loss", "moe/z_loss"});
  expect_moe_metrics(r.got.metrics, r.ref.metrics, keys, 1e-5, c.label(),
                     c.packing ? std::vector<std::string>{"moe/max_expert_load"} : std::vector<std::string>{});
  // Rows cross to the experts' ranks and over the etp group.
  EXPECT_GT(r.got.metrics.value("ep/comm_bytes", int64_t(0)), 0) << c.label();
  if (world().rank() == 0)
    std::cout << "[np " << world().size() << "] " << c.label() << ": " << sgd_summary(r) << ", ep bytes/step " << r.got.metrics.value("ep/comm_bytes", int64_t(0))
              << (c.softmax() ? ", aux " + std::to_string(r.got.metrics["moe/aux_loss"].get<double>()) + " vs " +
                                    std::to_string(r.ref.metrics["moe/aux_loss"].get<double>())
                              : std::string())
              << "\n";
}

TEST_P(ExpertTensorParallel, AdamWStepsFollowOneRank) {
  const Case c = GetParam();
  if (!runs_here()) GTEST_SKIP() << c.label() << " on " << world().size() << " ranks";
  const Share p = share();
  const AdamComparison a = compare_adamw_steps(c.model, with_adam(base_config(c, true), 2e-3, c.distributed_optimizer),
                                               with_adam(base_config(c, false), 2e-3, c.distributed_optimizer),
                                               *p.global, *p.mine, c.label());
  EXPECT_LT(a.state, a.ref_state) << c.label() << ": each rank holds a quarter of the experts";
  if (world().rank() == 0) std::cout << "[np " << world().size() << "] " << c.label() << ": " << adam_summary(a) << "\n";
}

std::vector<Case> cases() {
  return {
      {"qwen3-moe-tiny", false, false},
      {"qwen3-moe-tiny", true, true},
      {"deepseek-v3-tiny", false, true},
      {"deepseek-v3-tiny", true, false},
      {"qwen3-moe-tiny", false, true, true},  // every layer recomputed in the backward
  };
}

INSTANTIATE_TEST_SUITE_P(Etp, ExpertTensorParallel, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return test_name(info.param.label()); });

// A state saved under TP 4 x EP 2 x ETP 2 is one rank's files (HF layout, every expert whole);
// it loads on one rank into the same weights and continues; one rank's state loads back under
// the layout bitwise and continues bitwise.
TEST(ExpertTensorParallelCheckpoints, LoadOnOneRankAndBack) {
  if (!runs_here()) GTEST_SKIP() << "TP 4 on " << world().size() << " ranks";
  const Case c{"qwen3-moe-tiny", false, true};
  checkpoint_round_trip(c.model, with_adam(base_config(c, false), 5e-3, true), with_adam(base_config(c, true), 5e-3, true),
                        world().size() / int(kTp), world().rank() / int(kTp), "etp", layout_batch());
}

TEST(ExpertTensorParallelErrors, RefusedByName) {
  const int N = world().size();
  auto create_error = [&](const json& mc, rlh_code code, const std::string& part) {
    expect_create_error({{"megatron_cfg", mc}}, code, part);
  };
  auto load_error = [&](const json& mc, rlh_code code, const std::string& part) {
    expect_load_error({{"megatron_cfg", mc}}, "qwen3-moe-tiny", code, part);
  };
  // An etp that does not divide tp.
  create_error({{"tensor_model_parallel_size", 4}, {"expert_model_parallel_size", 2}, {"expert_tensor_parallel_size", 3},
                {"sequence_parallel", true}},
               RLH_E_UNIMPLEMENTED,
               "policy.megatron_cfg.expert_tensor_parallel_size = 3 with policy.megatron_cfg.tensor_model_parallel_size = "
               "4: expert tensor parallelism over a number of ranks that does not divide the tensor-parallel size is "
               "not implemented");
  // Every tp rank dispatches its own rows: sequence parallelism, as Megatron-Core requires.
  create_error({{"tensor_model_parallel_size", 4}, {"expert_model_parallel_size", 2}, {"expert_tensor_parallel_size", 2}},
               RLH_E_INVALID_ARGUMENT,
               "expert_model_parallel_size = 2 with policy.megatron_cfg.tensor_model_parallel_size = 4 needs "
               "policy.megatron_cfg.sequence_parallel = true");
  if (N != 4) return;
  // Without expert parallelism the experts are cut over the tp group only (at load of an MoE model).
  load_error({{"tensor_model_parallel_size", 4}, {"expert_tensor_parallel_size", 2}, {"sequence_parallel", true}},
             RLH_E_UNIMPLEMENTED,
             "expert_tensor_parallel_size = 2 with tensor_model_parallel_size = 4: the experts are split over the "
             "tensor-parallel group only without expert parallelism");
  // etp x ep must divide the ranks of a stage (4 here): 2 x 4 does not.
  load_error({{"tensor_model_parallel_size", 4}, {"expert_model_parallel_size", 4}, {"expert_tensor_parallel_size", 2},
              {"sequence_parallel", true}},
             RLH_E_INVALID_ARGUMENT,
             "policy.megatron_cfg.tensor_model_parallel_size = 4, expert_model_parallel_size = 4, "
             "expert_tensor_parallel_size = 2: megatron: parallel sizes: world size 4 is not divisible by etp x ep x pp "
             "= 2 x 4 x 1 = 8");
}

// ---------------------------------------------------------------------------------------------
// The engine under TP 4 x EP 2 x ETP 2 with sequence parallelism: forward, routing record and
// replay, and a replayed train step's gradients, against the one-rank engine.

TEST(ExpertTensorParallelEngine, RoutingReplayAndGradients) {
  if (world().size() != 4) GTEST_SKIP() << "TP 4 x EP 2 x ETP 2 on 4 ranks, got " << world().size();
  const EngineModel& md = engine_model("qwen3-moe-tiny");
  auto g = layout_batch();
  const EngineReference reference(md, *g);
  engine::Engine& ref = *reference.engine;
  const engine::MicroBatch& mb = reference.mb;
  const engine::OutputRequest& rec = reference.req;
  const engine::Outputs& full = reference.full;
  const int64_t T = g->num_tokens(), W = full.routing_width;

  sdk::ParallelSizes sizes;
  sizes.tp = kTp;
  sizes.ep = kEp;
  sizes.etp = kEtp;
  sdk::ParallelComms pc = world_groups(sizes, {sdk::GroupKind::tp, sdk::GroupKind::ep, sdk::GroupKind::expert_tp});
  const sdk::Comm& tpg = pc.of(sdk::GroupKind::tp);
  const sdk::Comm& epg = pc.of(sdk::GroupKind::ep);
  const sdk::Comm& etpg = pc.of(sdk::GroupKind::expert_tp);
  ASSERT_EQ(etpg.size(), kEtp);
  backend::CommTpGroup tp_comm(tpg);
  backend::CommEpGroup ep_comm(epg), etp_comm(etpg);
  const sdk::TpLayout tp = sdk::make_tp_layout(md.desc, kTp, tpg.rank(), "tp", kEtp);
  EXPECT_EQ(tp.expert_rank, etpg.rank()) << "the layout's block is the rank's place in its etp group";
  const sdk::EpLayout ep = sdk::make_ep_layout(tp.local, kEp, epg.rank());
  engine::EngineOptions o;
  o.ops = &host_ops();
  o.tp = &tp;
  o.tp_comm = &tp_comm;
  o.ep = &ep;
  o.ep_comm = &ep_comm;
  o.sequence_parallel = true;
  try {  // the etp group is needed
    engine::Engine e(md.desc, o);
    ADD_FAILURE() << "built without etp_comm";
  } catch (const std::invalid_argument& x) {
    EXPECT_NE(std::string(x.what()).find("need their group (etp_comm)"), std::string::npos) << x.what();
  }
  o.etp_comm = &etp_comm;
  engine::Engine e(md.desc, o);
  std::vector<std::vector<float>> local;
  auto piece = [&](size_t i, const std::vector<float>& w) { return sdk::ep_slice(ep, i, sdk::tp_slice(tp, i, w)); };
  for (size_t i = 0; i < md.weights.size(); ++i) local.push_back(piece(i, md.weights[i]));
  e.load_parameters(local);

  const engine::Outputs got = e.forward(mb, rec);
  ASSERT_EQ(got.logprob.size(), full.logprob.size());
  const double lp_err = max_abs_diff(got.logprob, full.logprob);
  EXPECT_LE(lp_err, 2e-5);
  EXPECT_EQ(got.routed_experts, full.routed_experts) << "the routing record under TP 4 x EP 2 x ETP 2";
  EXPECT_GT(etp_comm.bytes(), 0) << "rows gathered over the etp group";

  // Another routing replayed: the reference's outputs under it.
  const OtherRouting other(ref, e, mb, full.routed_experts, T, W, 3, 8);
  const double replay_err = max_abs_diff(other.got.logprob, other.ref.logprob);
  EXPECT_LE(replay_err, 2e-5) << "replaying another routing";
  EXPECT_GT(max_abs_diff(other.ref.logprob, full.logprob), 1e-3) << "the other routing changes the outputs";

  // A train step under that routing (no update): every rank's gradient pieces are the pieces of
  // the one-rank engine's gradients.
  engine::StepOptions so;
  so.global_tokens = T;
  so.global_sequences = g->num_seqs();
  so.outputs = other.req;
  so.apply_optimizer = false;
  const std::span<const engine::MicroBatch> omb(&other.mb, 1);
  const engine::StepResult rr = ref.train_step(omb, so, every_row_nll);
  const engine::StepResult rg = e.train_step(omb, so, every_row_nll);
  EXPECT_NEAR(rg.loss, rr.loss, 1e-5 * std::fabs(rr.loss));
  double largest = 0, worst = 0;
  for (size_t i = 0; i < md.weights.size(); ++i) {
    const std::span<const float> fg = ref.grad(i);
    const std::vector<float> want = piece(i, std::vector<float>(fg.begin(), fg.end()));
    const std::span<const float> have = e.grad(i);
    ASSERT_EQ(have.size(), want.size()) << md.desc.params[i].name;
    for (size_t k = 0; k < want.size(); ++k) {
      largest = std::max(largest, std::fabs(double(want[k])));
      worst = std::max(worst, std::fabs(double(have[k]) - double(want[k])));
    }
  }
  EXPECT_LE(worst, 1e-4 * largest) << "gradients under the replayed routing";
  if (world().rank() == 0)
    std::cout << "[np 4] engine tp 4 ep 2 etp 2: routing record equal, logprobs within " << lp_err
              << ", replay of another routing within " << replay_err << ", gradients within " << worst / largest
              << " of the largest\n";
}

}  // namespace

int main(int argc, char** argv) {
  release_kernels_before_the_host();  // the engine test's
  return run_mpi_tests(argc, argv, {"model_llama", "kernels_cpu", "megatron", "comm_mpi"});
}
