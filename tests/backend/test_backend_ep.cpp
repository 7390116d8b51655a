// Expert parallelism for the megatron backend on CPU ranks, under `mpirun -np N` (ctest: N = 2
// and 4, one BLAS thread per rank). Megatron's layout: every rank is a data-parallel rank with
// its own batch shard, and the ep ranks of a group (adjacent) split each MoE layer's experts.
// Every rank also computes the one-rank reference in-process (a backend or engine that sees one
// rank).
//
//   - EP 2 (np 2: expert dp 1), DP 2 x EP 2 (np 4: ep 2, expert dp 2) and EP 4 (np 4) give the
//     reference's logprobs, loss, gradient norm, every gradient (one SGD step at lr 1 without
//     clipping: w - w' = g) and the MoE metrics (aux_loss, z_loss, max_expert_load) within fp32
//     tolerance, on qwen3-moe-tiny (softmax top-2 of 8; the load-balancing and z losses on) and
//     deepseek-v3-tiny (MLA, a dense first layer, sigmoid group-limited top-2 of 8, a shared
//     expert, the float64 router), with packing on and off, DDP and the distributed optimizer;
//   - two AdamW steps with clipping follow the reference, and each rank keeps 1/ep of the experts;
//   - a state saved under EP is the one-rank HF layout, loads on one rank into the same weights
//     bitwise and continues there; one rank's state loads back under EP bitwise and continues
//     bitwise;
//   - on the engine: the routing record under EP is the reference's, replaying a routing (the
//     record, or another one) gives the reference's outputs under that routing, and the ep
//     group's bytes per step equal the count from the routing (rows sent to and received from
//     other ranks, the counts' exchange);
//   - on the engine under TP 2 x EP 2 (np 2, expert_tensor_parallel_size 1 with sequence
//     parallelism): the forward, the routing record and a replayed routing's outputs are the
//     reference's (the backend's EP x TP layouts are test_backend_cp.cpp's);
//   - refusals name the setting (with TP: etp not dividing tp, no sequence parallelism).
//     Expert parallelism with pipeline stages is test_backend_cp.cpp's, with interleaved virtual
//     stages test_backend_ep_vpp.cpp's, with etp between 1 and tp test_backend_ep_etp.cpp's.
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "backend_harness.hpp"
#include "engine_under_mpi.hpp"
#include "model_parallel_checks.hpp"
#include "mpi_harness.hpp"
#include "rlhost/backend_common/data_parallel.hpp"
#include "rlhost/engine/engine.hpp"
#include "rlhost/model/llama_family.hpp"
#include "rlhost/sdk/comm.hpp"
#include "rlhost/sdk/expert_parallel.hpp"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/parallel_groups.hpp"
#include "rlhost/sdk/safetensors.hpp"
#include "rlhost/sdk/tensor_parallel.hpp"

namespace fs = std::filesystem;
using namespace rlh;
using namespace rlh::test;
using json = nlohmann::json;

namespace {

// The (token, choice) rows of rank R's ep group (adjacent ranks of N, each with its shard of the
// global batch g) that cross ranks, from the routing `routed` [tokens, W] of g: those R sends to
// other ranks' experts, and those the others send to R's experts (El experts per rank).
std::pair<int64_t, int64_t> crossing_rows(const std::vector<int32_t>& routed, int64_t W, int64_t El, const Batch& g,
                                          int N, int R, int64_t ep) {
  const int64_t group0 = R / ep * ep, q = R % ep;
  int64_t out_rows = 0, in_rows = 0;
  for (int64_t s = 0; s < ep; ++s) {
    int64_t f = 0;
    auto sh = shard_of(g, int(group0 + s), N, &f);
    for (int64_t t = 0; t < sh->num_tokens(); ++t)
      for (int64_t k = 0; k < W; ++k) {
        const int64_t owner = routed[size_t((f + t) * W + k)] / El;
        if (s == q && owner != q) ++out_rows;
        if (s != q && owner == q) ++in_rows;
      }
  }
  return {out_rows, in_rows};
}

struct Case {
  std::string model;
  int64_t ep;
  bool packing;
  bool distributed_optimizer;
  bool recompute = false;
  std::string label() const {
    return model + " ep" + std::to_string(ep) + (distributed_optimizer ? " distopt" : " ddp") + (packing ? " packed" : "") +
           (recompute ? " recompute" : "");
  }
  bool softmax() const { return model == "qwen3-moe-tiny"; }
};

// The MoE settings: softmax routers train with the load-balancing loss (per micro-batch without
// packing, where every rank's micro-batches are the reference's; per sequence with packing,
// where they are not) and the z-loss; the sigmoid router (no such losses) routes in float64.
json base_config(const Case& c, int64_t ep) {
  return moe_layout_config({{"expert_model_parallel_size", ep}}, c.softmax(), c.packing, c.recompute);
}

// The ep group's bytes of one train step on rank R of N, counted from the routing of the global
// batch (the reference engine's, before the step), without packing (every rank's micro-batches
// are pairs of its sequences): per MoE layer and micro-batch the counts' exchange (E / ep int64
// to each other rank of the group); per MoE layer the rows this rank dispatches to other ranks'
// experts and the rows its experts return to the others (C floats each), once in the forward
// and once in the backward (and once more in the recomputed forward).
int64_t analytic_ep_bytes(const Case& c, int N, int R) {
  const EngineModel& md = engine_model(c.model);
  auto g = layout_batch();
  engine::EngineOptions ro;
  ro.moe.router_fp64 = !c.softmax();
  const EngineReference ref(md, *g, ro);
  const engine::Outputs& full = ref.full;
  const int64_t W = full.routing_width, C = md.desc.hidden_size, ep = c.ep;
  int64_t L = 0, E = 0;
  for (const auto& l : md.desc.layers)
    if (l.mlp.kind == sdk::MlpKind::moe) ++L, E = l.mlp.moe.num_experts;
  const int64_t El = E / ep;
  const auto [out_rows, in_rows] = crossing_rows(full.routed_experts, W, El, *g, N, R, ep);
  const int64_t microbatches = (int64_t(kLayoutLengths.size()) / N + 1) / 2;  // the busiest rank's (all alike here)
  const int64_t passes = c.recompute ? 2 : 1;  // forwards per micro-batch
  return microbatches * passes * L * (ep - 1) * El * 8 + (passes + 1) * (out_rows + in_rows) * C * 4;
}
json sgd_config(const Case& c, int64_t ep) { return with_sgd(base_config(c, ep), c.distributed_optimizer); }
json adam_config(const Case& c, int64_t ep, double lr) { return with_adam(base_config(c, ep), lr, c.distributed_optimizer); }

class ExpertParallel : public ::testing::TestWithParam<Case> {};

// Every rank is data-parallel (Megatron carves ep from the dp ranks): each its share of the batch.
TEST_P(ExpertParallel, MatchesOneRank) {
  const Case c = GetParam();
  const int N = world().size();
  if (N % c.ep != 0) GTEST_SKIP() << "ep " << c.ep << " on " << N << " ranks";
  const Share p(N, world().rank());
  const SgdComparison r = compare_sgd_step(c.model, sgd_config(c, 1), sgd_config(c, c.ep), *p.global, *p.mine, p.first,
                                           c.label(), run_nll_sgd_step);
  const Outcome &ep = r.got, &ref = r.ref;
  EXPECT_EQ(ep.metrics["dp_size"].get<int>(), N);
  // The MoE metrics: summed (max for the load) over the data-parallel ranks; the load is per
  // micro-batch, which packing cuts otherwise.
  std::vector<std::string> moe = {"moe/max_expert_load"};
  if (c.softmax()) moe.insert(moe.end(), {"moe/aux_loss", "moe/z_loss"});
  expect_moe_metrics(ep.metrics, ref.metrics, moe, 1e-5, c.label(),
                     c.packing ? std::vector<std::string>{"moe/max_expert_load"} : std::vector<std::string>{}, 1e-9);
  const int64_t bytes = ep.metrics["ep/comm_bytes"].get<int64_t>();
  if (!c.packing) EXPECT_EQ(bytes, analytic_ep_bytes(c, N, world().rank())) << c.label();
  EXPECT_GT(bytes, 0) << c.label();
  if (world().rank() == 0)
    std::cout << "[np " << N << "] " << c.label() << ": " << sgd_summary(r) << ", ep bytes/step " << bytes
              << (c.softmax() ? ", aux " + std::to_string(ep.metrics["moe/aux_loss"].get<double>()) + " vs " +
                                    std::to_string(ref.metrics["moe/aux_loss"].get<double>())
                              : std::string())
              << "\n";
}

TEST_P(ExpertParallel, AdamWStepsFollowOneRank) {
  const Case c = GetParam();
  const int N = world().size();
  if (N % c.ep != 0) GTEST_SKIP() << "ep " << c.ep << " on " << N << " ranks";
  const Share p(N, world().rank());
  const AdamComparison r =
      compare_adamw_steps(c.model, adam_config(c, 1, 2e-3), adam_config(c, c.ep, 2e-3), *p.global, *p.mine, c.label());
  // Each rank holds 1/ep of the experts (most of these models) and the rest whole: less than
  // one rank's, by the experts' share.
  EXPECT_LT(r.state, r.ref_state) << c.label();
  if (world().rank() == 0) std::cout << "[np " << N << "] " << c.label() << ": " << adam_summary(r) << "\n";
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (const char* model : {"qwen3-moe-tiny", "deepseek-v3-tiny"}) {
    v.push_back({model, 2, false, false});
    v.push_back({model, 2, true, true});
    v.push_back({model, 4, false, true});  // np 4 only
    v.push_back({model, 4, true, false});
  }
  v.push_back({"qwen3-moe-tiny", 2, false, true, true});  // every layer recomputed in the backward
  v.push_back({"deepseek-v3-tiny", 4, true, false, true});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Ep, ExpertParallel, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return test_name(info.param.label()); });

// A state saved under EP is one rank's files (HF layout, every expert); it loads on one rank
// into the same weights and continues; one rank's state loads back under EP bitwise.
TEST(ExpertParallelCheckpoints, SavedUnderEpLoadsOnOneRankAndBack) {
  const Case c{"qwen3-moe-tiny", 2, false, true};
  checkpoint_round_trip(c.model, adam_config(c, 2, 5e-3), adam_config(c, 1, 5e-3), world().size(), world().rank(), "ep",
                        layout_batch());
}

// A rank with an empty shard (and ranks with different numbers of micro-batches) still runs its
// experts for the others: the step equals the reference.
TEST(ExpertParallelShards, UnevenAndEmptyShards) {
  const int N = world().size(), R = world().rank();
  for (const bool recompute : {false, true}) {
    const Case c{"qwen3-moe-tiny", 2, false, false, recompute};
    auto g = layout_batch();
    // Rank 0 takes every sequence, the others none.
    auto mine = all_or_none(*g, R == 0);
    const SgdComparison r = sgd_step_both(c.model, sgd_config(c, 1), sgd_config(c, 2), *g, *mine, run_nll_sgd_step);
    expect_step_matches(r.got, r.ref, "np " + std::to_string(N) + " " + c.label());
  }
}

TEST(ExpertParallelErrors, RefusedByName) {
  const int N = world().size();
  expect_load_error({{"megatron_cfg", {{"expert_model_parallel_size", 2}}}}, "llama-tiny", RLH_E_UNIMPLEMENTED,
             "expert_model_parallel_size = 2: LlamaForCausalLM has no mixture-of-experts layer to split");
  expect_load_error({{"megatron_cfg", {{"expert_model_parallel_size", N + 1}}}}, "qwen3-moe-tiny",
                    RLH_E_INVALID_ARGUMENT,
             "expert_model_parallel_size = " + std::to_string(N + 1) + ": megatron: parallel sizes:");
  {
    Alone alone;
    expect_load_error({{"megatron_cfg", {{"expert_model_parallel_size", 2}}}}, "qwen3-moe-tiny", RLH_E_INVALID_ARGUMENT,
               "expert_model_parallel_size = 2 needs a multiple of 2 launched ranks");
  }
  expect_create_error({{"megatron_cfg", {{"expert_model_parallel_size", 2}, {"expert_tensor_parallel_size", 2}}}},
                      RLH_E_UNIMPLEMENTED,
                      "expert_tensor_parallel_size = 2 with policy.megatron_cfg.tensor_model_parallel_size = 1: expert "
                      "tensor parallelism over a number of ranks that does not divide the tensor-parallel size is not "
                      "implemented");
  // With tensor parallelism expert_tensor_parallel_size 1, a divisor of tp or the tp size (null),
  // under sequence parallelism, which Megatron-Core requires there (test_backend_cp.cpp and
  // test_backend_ep_etp.cpp run them); one that does not divide tp is refused.
  expect_create_error({{"megatron_cfg",
                 {{"expert_model_parallel_size", 2},
                  {"tensor_model_parallel_size", 4},
                  {"expert_tensor_parallel_size", 3},
                  {"sequence_parallel", true}}}},
                      RLH_E_UNIMPLEMENTED,
                      "expert_tensor_parallel_size = 3 with policy.megatron_cfg.tensor_model_parallel_size = 4: expert "
                      "tensor parallelism over a number of ranks that does not divide the tensor-parallel size is not "
                      "implemented");
  expect_create_error({{"megatron_cfg", {{"expert_model_parallel_size", 2}, {"tensor_model_parallel_size", 2}}}},
                      RLH_E_INVALID_ARGUMENT,
                      "expert_model_parallel_size = 2 with policy.megatron_cfg.tensor_model_parallel_size = 2 needs "
                      "policy.megatron_cfg.sequence_parallel = true");
  expect_create_error({{"megatron_cfg",
                 {{"expert_model_parallel_size", 2}, {"tensor_model_parallel_size", 2}, {"expert_tensor_parallel_size", 1}}}},
                      RLH_E_INVALID_ARGUMENT,
                      "expert_model_parallel_size = 2 with policy.megatron_cfg.tensor_model_parallel_size = 2 needs "
                      "policy.megatron_cfg.sequence_parallel = true");
  // The device path has no expert parallelism: refused by name (whatever the build).
  if (N % 2 == 0) {
    json cfg = {{"megatron_cfg", {{"expert_model_parallel_size", 2}}}, {"device", "cuda"}};
    expect_load_error(cfg, "qwen3-moe-tiny", RLH_E_UNIMPLEMENTED,
                      "policy.device = cuda: expert parallelism (expert_model_parallel_size = 2) runs on the CPU engine only");
  }
}

// ---------------------------------------------------------------------------------------------
// The engine under expert parallelism: routing record and replay, and the bytes of a step.

struct EpEngine {
  sdk::ParallelComms pc;
  sdk::EpLayout layout;
  std::unique_ptr<backend::CommEpGroup> comm;
  std::unique_ptr<engine::Engine> e;
  EpEngine(const EngineModel& m, int64_t ep) {
    sdk::ParallelSizes sizes;
    sizes.ep = ep;
    pc = world_groups(sizes, {sdk::GroupKind::ep});
    const sdk::Comm& g = pc.of(sdk::GroupKind::ep);
    layout = sdk::make_ep_layout(m.desc, ep, g.rank());
    comm = std::make_unique<backend::CommEpGroup>(g);
    engine::EngineOptions o;
    o.ops = &host_ops();
    o.ep = &layout;
    o.ep_comm = comm.get();
    e = std::make_unique<engine::Engine>(m.desc, o);
    std::vector<std::vector<float>> local;
    for (size_t i = 0; i < m.weights.size(); ++i) local.push_back(sdk::ep_slice(layout, i, m.weights[i]));
    e->load_parameters(local);
  }
};

TEST(ExpertParallelEngine, RoutingRecordReplayAndBytes) {
  const int N = world().size(), R = world().rank();
  for (const int64_t ep : {int64_t(2), int64_t(4)}) {
    if (N % ep != 0) continue;
    const EngineModel& md = engine_model("qwen3-moe-tiny");
    auto g = layout_batch();
    // The reference: one engine with every expert, over the whole batch.
    const EngineReference ref(md, *g);
    const engine::MicroBatch& gmb = ref.mb;
    const engine::OutputRequest& req = ref.req;
    const engine::Outputs& full = ref.full;
    const int64_t W = full.routing_width;
    // This rank's shard (its first token in the global batch) under EP.
    int64_t first = 0;
    auto mine = shard_of(*g, R, N, &first);
    std::vector<int32_t> cu;
    const engine::MicroBatch mb = engine_view(*mine, cu);
    const int64_t n = mine->num_tokens();
    EpEngine epe(md, ep);
    const int64_t b0 = epe.comm->bytes();
    const engine::Outputs o = epe.e->forward(mb, req);
    const int64_t fwd_bytes = epe.comm->bytes() - b0;
    ASSERT_EQ(o.routing_width, W);
    int mismatched = 0;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t k = 0; k < W; ++k)
        mismatched += o.routed_experts[size_t(t * W + k)] != full.routed_experts[size_t((first + t) * W + k)];
    ASSERT_EQ(int64_t(o.logprob.size()), n);
    const double lp_err = max_abs_diff_at(o.logprob, full.logprob, size_t(first));
    EXPECT_EQ(mismatched, 0) << "ep " << ep << ": the routing record is the reference's";
    EXPECT_LE(lp_err, 2e-5) << "ep " << ep;

    // Bytes of this forward from the routing: per MoE layer, the counts (E / ep int64 to each
    // other rank of the group), the rows this rank sends to other ranks' experts and the rows
    // it gets back from its experts for the others (C floats each).
    const int64_t C = md.desc.hidden_size, E = 8, K = 2, El = E / ep, L = W / K;
    const auto [out_rows, in_rows] = crossing_rows(full.routed_experts, W, El, *g, N, R, ep);
    const int64_t counts = L * (ep - 1) * El * 8, rows = (out_rows + in_rows) * C * 4;
    EXPECT_EQ(fwd_bytes, counts + rows) << "ep " << ep;

    // Replay: the record reproduces the forward; another routing (each choice moved to the next
    // expert) gives the reference's outputs under that routing.
    RoutingField rec{std::vector<int32_t>(o.routed_experts.begin(), o.routed_experts.end())};
    const engine::MicroBatch rmb = rec.replaying(mb, n, W);
    const engine::OutputRequest rreq = replay_request(req);
    const engine::Outputs o2 = epe.e->forward(rmb, rreq);
    EXPECT_EQ(o2.logprob, o.logprob) << "ep " << ep << ": replaying the record";
    RoutingField other_g = RoutingField::moved(full.routed_experts, 1, E);
    RoutingField other_mine{std::vector<int32_t>(other_g.data.begin() + first * W, other_g.data.begin() + (first + n) * W)};
    const engine::Outputs ref_other = ref.engine->forward(other_g.replaying(gmb, g->num_tokens(), W), rreq);
    const engine::Outputs o3 = epe.e->forward(other_mine.replaying(mb, n, W), rreq);
    ASSERT_EQ(int64_t(o3.logprob.size()), n);
    const double other_err = max_abs_diff_at(o3.logprob, ref_other.logprob, size_t(first));
    EXPECT_LE(other_err, 2e-5) << "ep " << ep << ": replaying another routing";
    EXPECT_EQ(o3.routed_experts, other_mine.data);

    // A train step under replay: the forward's exchanges plus the backward's two (no counts).
    engine::StepOptions so;
    so.global_tokens = g->num_tokens();
    so.global_sequences = g->num_seqs();
    so.outputs = rreq;
    so.outputs.routed_experts = false;
    so.apply_optimizer = false;
    const int64_t b1 = epe.comm->bytes();
    epe.e->train_step(std::span<const engine::MicroBatch>(&rmb, 1), so, every_row_nll);
    EXPECT_EQ(epe.comm->bytes() - b1, counts + 2 * rows) << "ep " << ep << ": a train step's bytes";
    if (R == 0)
      std::cout << "[np " << N << "] engine ep " << ep << ": routing record equal, logprobs within " << lp_err
                << ", replay of another routing within " << other_err << ", ep bytes forward " << fwd_bytes
                << " / train step " << counts + 2 * rows << " (analytic, rank 0)\n";
  }
}

}  // namespace

// The engine under expert parallelism with tensor parallelism (np 2: the tp group is the ep
// group, expert_tensor_parallel_size 1): with sequence parallelism and the experts whole on each
// rank its forward is the one-rank engine's, and so are its routing record (each tp rank records
// its rows, gathered over the group) and a replayed routing's outputs; without sequence
// parallelism it is refused by name.
TEST(ExpertParallelEngine, WithTensorParallelism) {
  if (world().size() != 2) GTEST_SKIP() << "TP 2 x EP 2 on 2 ranks, got " << world().size();
  const EngineModel& md = engine_model("qwen3-moe-tiny");
  auto g = layout_batch();
  const EngineReference ref(md, *g);
  const engine::MicroBatch& mb = ref.mb;
  const engine::OutputRequest req;  // no record
  const engine::Outputs& full = ref.full;

  sdk::ParallelSizes sizes;
  sizes.tp = 2;
  sizes.ep = 2;
  sizes.etp = 1;
  sdk::ParallelComms pc = world_groups(sizes, {sdk::GroupKind::tp, sdk::GroupKind::ep});
  const sdk::Comm& tpg = pc.of(sdk::GroupKind::tp);
  const sdk::Comm& epg = pc.of(sdk::GroupKind::ep);
  backend::CommTpGroup tp_comm(tpg);
  backend::CommEpGroup ep_comm(epg);
  const sdk::TpLayout whole = sdk::make_tp_layout(md.desc, 2, tpg.rank(), "tp", 1);
  const sdk::EpLayout ep = sdk::make_ep_layout(whole.local, 2, epg.rank());
  auto options = [&](const sdk::TpLayout& tp, bool sp) {
    engine::EngineOptions o;
    o.ops = &host_ops();
    o.tp = &tp;
    o.tp_comm = &tp_comm;
    o.ep = &ep;
    o.ep_comm = &ep_comm;
    o.sequence_parallel = sp;
    return o;
  };
  try {
    engine::Engine e(md.desc, options(whole, false));
    ADD_FAILURE() << "built without sequence parallelism";
  } catch (const std::invalid_argument& x) {
    EXPECT_NE(std::string(x.what()).find("needs sequence parallelism (each tensor-parallel rank dispatches its own rows)"),
              std::string::npos)
        << x.what();
  }
  engine::Engine e(md.desc, options(whole, true));
  std::vector<std::vector<float>> local;
  for (size_t i = 0; i < md.weights.size(); ++i) local.push_back(sdk::ep_slice(ep, i, sdk::tp_slice(whole, i, md.weights[i])));
  e.load_parameters(local);
  const engine::Outputs o = e.forward(mb, req);
  ASSERT_EQ(o.logprob.size(), full.logprob.size());
  EXPECT_LE(max_abs_diff(o.logprob, full.logprob), 2e-5);
  EXPECT_GT(ep_comm.bytes(), 0);
  // The routing record (each rank records its rows, gathered over the group) is the reference's;
  // replaying another routing gives the reference's outputs under that routing.
  const engine::Outputs got = e.forward(mb, ref.req);
  ASSERT_EQ(got.routing_width, full.routing_width);
  EXPECT_EQ(got.routed_experts, full.routed_experts) << "the routing record under TP 2 x EP 2";
  const OtherRouting other(*ref.engine, e, mb, full.routed_experts, g->num_tokens(), full.routing_width, 3, 8, req);
  EXPECT_LE(max_abs_diff(other.got.logprob, other.ref.logprob), 2e-5) << "replaying another routing under TP 2 x EP 2";
  EXPECT_GT(max_abs_diff(other.ref.logprob, full.logprob), 1e-3) << "the other routing changes the outputs";
}

int main(int argc, char** argv) {
  release_kernels_before_the_host();  // the engine tests'
  return run_mpi_tests(argc, argv, {"model_llama", "kernels_cpu", "megatron", "comm_mpi"});
}
