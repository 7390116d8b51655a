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

constexpr int32_t kVocab = 512;
const std::vector<int64_t> kLengths = {9, 14, 3, 11, 17, 6, 2, 12};
std::unique_ptr<Batch> global_batch() { return random_batch(kLengths, kVocab, 31); }

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
  json mc = {{"expert_model_parallel_size", ep}};
  if (c.softmax()) {
    mc["moe_router_load_balancing_type"] = c.packing ? "seq_aux_loss" : "aux_loss";
    mc["moe_aux_loss_coeff"] = 0.01;
    mc["moe_z_loss_coeff"] = 0.001;
  } else {
    mc["moe_router_dtype"] = "fp64";
  }
  if (c.recompute) mc["activation_checkpointing"] = true;
  json cfg = {{"megatron_cfg", mc}};
  set_batching(cfg, c.packing);
  return cfg;
}

// The ep group's bytes of one train step on rank R of N, counted from the routing of the global
// batch (the reference engine's, before the step), without packing (every rank's micro-batches
// are pairs of its sequences): per MoE layer and micro-batch the counts' exchange (E / ep int64
// to each other rank of the group); per MoE layer the rows this rank dispatches to other ranks'
// experts and the rows its experts return to the others (C floats each), once in the forward
// and once in the backward (and once more in the recomputed forward).
int64_t analytic_ep_bytes(const Case& c, int N, int R) {
  const EngineModel& md = engine_model(c.model);
  auto g = global_batch();
  std::vector<int32_t> cu;
  const engine::MicroBatch mb = engine_view(*g, cu);
  engine::EngineOptions ro;
  ro.ops = &host_ops();
  ro.moe.router_fp64 = !c.softmax();
  engine::Engine ref(md.desc, ro);
  ref.load_parameters(md.weights);
  engine::OutputRequest req;
  req.routed_experts = true;
  const engine::Outputs full = ref.forward(mb, req);
  const int64_t W = full.routing_width, C = md.desc.hidden_size, ep = c.ep;
  int64_t L = 0, E = 0;
  for (const auto& l : md.desc.layers)
    if (l.mlp.kind == sdk::MlpKind::moe) ++L, E = l.mlp.moe.num_experts;
  const int64_t El = E / ep;
  const auto [out_rows, in_rows] = crossing_rows(full.routed_experts, W, El, *g, N, R, ep);
  const int64_t microbatches = (int64_t(kLengths.size()) / N + 1) / 2;  // the busiest rank's (all alike here)
  const int64_t passes = c.recompute ? 2 : 1;  // forwards per micro-batch
  return microbatches * passes * L * (ep - 1) * El * 8 + (passes + 1) * (out_rows + in_rows) * C * 4;
}
json sgd_config(const Case& c, int64_t ep) {
  json cfg = base_config(c, ep);
  cfg["megatron_cfg"]["optimizer"] = {{"optimizer", "sgd"}, {"lr", 1.0}, {"sgd_momentum", 0.0}, {"weight_decay", 0.0},
                                      {"clip_grad", 0.0}, {"use_distributed_optimizer", c.distributed_optimizer}};
  return cfg;
}
json adam_config(const Case& c, int64_t ep, double lr) {
  json cfg = base_config(c, ep);
  cfg["megatron_cfg"]["optimizer"] = {{"optimizer", "adam"}, {"lr", lr}, {"weight_decay", 0.01}, {"clip_grad", 1.0},
                                      {"use_distributed_optimizer", c.distributed_optimizer}};
  return cfg;
}

// Loading `model` (a fixture's name) on a megatron backend with `cfg` fails with `code` and one
// line containing `part`.
void expect_load_error(const json& cfg, const std::string& model, rlh_code code, const std::string& part) {
  Backend be(host(), "megatron", cfg);
  rlh_model* m = nullptr;
  expect_error(be.try_load(model_path(model), true, &m), code, part);
}

struct EpOutcome {
  std::vector<float> logprobs;
  double loss = 0, grad_norm = 0;
  Weights grads;
  json metrics;
};

EpOutcome ep_sgd_step(Backend& be, rlh_model* m, Batch& batch, int64_t g_tok, int64_t g_seq) {
  EpOutcome o;
  std::vector<std::vector<float>> out;
  sdk::check(be.try_forward(m, batch, {spec(RLH_OUTPUT_LOGPROB_RAW, "lp")}, out), "forward");
  o.logprobs = out[0];
  const Weights before = be.weights(m);
  const auto r = be.train(m, batch, g_tok, g_seq, nll_loss(), {});
  o.loss = r.r.loss;
  o.grad_norm = r.r.grad_norm;
  o.metrics = r.metrics;
  o.grads = minus(before, be.weights(m));
  return o;
}

// This rank's share: every rank is data-parallel (Megatron carves ep from the dp ranks).
struct Place {
  std::unique_ptr<Batch> global, mine;
  int64_t tokens = 0, seqs = 0, first = 0;
  Place() {
    global = global_batch();
    tokens = global->num_tokens();
    seqs = global->num_seqs();
    mine = shard_of(*global, world().rank(), world().size(), &first);
  }
};

class ExpertParallel : public ::testing::TestWithParam<Case> {};

TEST_P(ExpertParallel, MatchesOneRank) {
  const Case c = GetParam();
  const int N = world().size();
  if (N % c.ep != 0) GTEST_SKIP() << "ep " << c.ep << " on " << N << " ranks";
  Place p;
  EpOutcome ref;
  {
    Alone alone;
    Backend be(host(), "megatron", sgd_config(c, 1));
    rlh_model* m = be.load(model_path(c.model), true);
    ref = ep_sgd_step(be, m, *p.global, p.tokens, p.seqs);
  }
  Backend be(host(), "megatron", sgd_config(c, c.ep));
  rlh_model* m = be.load(model_path(c.model), true);
  const EpOutcome ep = ep_sgd_step(be, m, *p.mine, p.tokens, p.seqs);
  EXPECT_EQ(ep.metrics["dp_size"].get<int>(), N);
  ASSERT_EQ(int64_t(ep.logprobs.size()), p.mine->num_tokens());
  double lp_err = 0;
  for (size_t t = 0; t < ep.logprobs.size(); ++t)
    lp_err = std::max(lp_err, std::fabs(double(ep.logprobs[t]) - double(ref.logprobs[size_t(p.first) + t])));
  EXPECT_LE(lp_err, 2e-5) << c.label();
  EXPECT_NEAR(ep.loss, ref.loss, 1e-5 * std::fabs(ref.loss)) << c.label();
  EXPECT_NEAR(ep.grad_norm, ref.grad_norm, 1e-4 * ref.grad_norm) << c.label();
  ASSERT_EQ(ep.grads.size(), ref.grads.size()) << c.label() << ": the same HF tensors";
  const double gerr = max_rel_diff(ep.grads, ref.grads);
  EXPECT_LE(gerr, 1e-4) << c.label();
  // The MoE metrics: summed (max for the load) over the data-parallel ranks.
  std::vector<std::string> moe = {"moe/max_expert_load"};
  if (c.softmax()) moe.insert(moe.end(), {"moe/aux_loss", "moe/z_loss"});
  for (const std::string& k : moe) {
    ASSERT_TRUE(ep.metrics.contains(k) && ref.metrics.contains(k)) << k;
    const double a = ep.metrics[k].get<double>(), b = ref.metrics[k].get<double>();
    if (k == "moe/max_expert_load" && c.packing) {  // per micro-batch: packing cuts them otherwise
      EXPECT_GT(a, 0) << k;
      continue;
    }
    EXPECT_NEAR(a, b, 1e-5 * std::fabs(b) + 1e-9) << c.label() << " " << k;
  }
  const int64_t bytes = ep.metrics["ep/comm_bytes"].get<int64_t>();
  if (!c.packing) EXPECT_EQ(bytes, analytic_ep_bytes(c, N, world().rank())) << c.label();
  EXPECT_GT(bytes, 0) << c.label();
  if (world().rank() == 0)
    std::cout << "[np " << N << "] " << c.label() << ": loss " << ep.loss << " vs " << ref.loss << ", grad norm "
              << ep.grad_norm << " vs " << ref.grad_norm << ", gradients within " << gerr
              << " (relative to the largest), logprobs within " << lp_err << ", ep bytes/step "
              << ep.metrics["ep/comm_bytes"].get<int64_t>()
              << (c.softmax() ? ", aux " + std::to_string(ep.metrics["moe/aux_loss"].get<double>()) + " vs " +
                                    std::to_string(ref.metrics["moe/aux_loss"].get<double>())
                              : std::string())
              << "\n";
}

TEST_P(ExpertParallel, AdamWStepsFollowOneRank) {
  const Case c = GetParam();
  const int N = world().size();
  if (N % c.ep != 0) GTEST_SKIP() << "ep " << c.ep << " on " << N << " ranks";
  Place p;
  std::vector<double> ref_loss;
  Weights ref_w;
  double ref_state = 0, state = 0;
  {
    Alone alone;
    Backend be(host(), "megatron", adam_config(c, 1, 2e-3));
    rlh_model* m = be.load(model_path(c.model), true);
    for (int s = 0; s < 2; ++s) {
      const auto r = be.train(m, *p.global, p.tokens, p.seqs, nll_loss(), {});
      ref_loss.push_back(r.r.loss);
      ref_state = r.metrics["memory/state_bytes"].get<double>();
    }
    ref_w = be.weights(m);
  }
  Backend be(host(), "megatron", adam_config(c, c.ep, 2e-3));
  rlh_model* m = be.load(model_path(c.model), true);
  for (int s = 0; s < 2; ++s) {
    const auto r = be.train(m, *p.mine, p.tokens, p.seqs, nll_loss(), {});
    EXPECT_NEAR(r.r.loss, ref_loss[size_t(s)], 2e-5 * std::fabs(ref_loss[size_t(s)])) << c.label() << " step " << s;
    state = r.metrics["memory/state_bytes"].get<double>();
  }
  // Each rank holds 1/ep of the experts (most of these models) and the rest whole: less than
  // one rank's, by the experts' share.
  EXPECT_LT(state, ref_state) << c.label();
  const Weights w = be.weights(m);
  double worst = 0;
  for (const auto& [k, v] : ref_w)
    for (size_t i = 0; i < v.size(); ++i) worst = std::max(worst, std::fabs(double(w.at(k)[i]) - double(v[i])));
  EXPECT_LE(worst, 2 * 2 * 2e-3) << c.label();
  if (world().rank() == 0)
    std::cout << "[np " << N << "] " << c.label() << ": 2 AdamW steps, weights within " << worst
              << "; training state per rank " << state / 1024 << " KiB, one rank " << ref_state / 1024 << " KiB (ratio "
              << state / ref_state << ")\n";
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
                        global_batch());
}

// A rank with an empty shard (and ranks with different numbers of micro-batches) still runs its
// experts for the others: the step equals the reference.
TEST(ExpertParallelShards, UnevenAndEmptyShards) {
  const int N = world().size(), R = world().rank();
  for (const bool recompute : {false, true}) {
    const Case c{"qwen3-moe-tiny", 2, false, false, recompute};
    auto g = global_batch();
    EpOutcome ref;
    {
      Alone alone;
      Backend be(host(), "megatron", sgd_config(c, 1));
      rlh_model* m = be.load(model_path(c.model), true);
      ref = ep_sgd_step(be, m, *g, g->num_tokens(), g->num_seqs());
    }
    // Rank 0 takes every sequence, the others none.
    auto mine = R == 0 ? shard_of(*g, 0, 1) : shard_of(*g, 0, int(g->num_seqs()) + 1);
    ASSERT_EQ(mine->num_seqs(), R == 0 ? g->num_seqs() : 0);
    Backend be(host(), "megatron", sgd_config(c, 2));
    rlh_model* m = be.load(model_path(c.model), true);
    const EpOutcome ep = ep_sgd_step(be, m, *mine, g->num_tokens(), g->num_seqs());
    EXPECT_NEAR(ep.loss, ref.loss, 1e-5 * std::fabs(ref.loss));
    EXPECT_LE(max_rel_diff(ep.grads, ref.grads), 1e-4) << "np " << N << " " << c.label();
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
  auto create_error = [&](const json& cfg, const std::string& part, rlh_code code = RLH_E_UNIMPLEMENTED) {
    rlh_backend* b = nullptr;
    const std::string text = cfg.dump();
    expect_error(host().backend("megatron")->create(host().services(), text.data(), text.size(), &b), code, part);
  };
  create_error({{"megatron_cfg", {{"expert_model_parallel_size", 2}, {"expert_tensor_parallel_size", 2}}}},
               "expert_tensor_parallel_size = 2 with policy.megatron_cfg.tensor_model_parallel_size = 1: expert "
               "tensor parallelism over a number of ranks that does not divide the tensor-parallel size is not "
               "implemented");
  // With tensor parallelism expert_tensor_parallel_size 1, a divisor of tp or the tp size (null),
  // under sequence parallelism, which Megatron-Core requires there (test_backend_cp.cpp and
  // test_backend_ep_etp.cpp run them); one that does not divide tp is refused.
  create_error({{"megatron_cfg",
                 {{"expert_model_parallel_size", 2},
                  {"tensor_model_parallel_size", 4},
                  {"expert_tensor_parallel_size", 3},
                  {"sequence_parallel", true}}}},
               "expert_tensor_parallel_size = 3 with policy.megatron_cfg.tensor_model_parallel_size = 4: expert "
               "tensor parallelism over a number of ranks that does not divide the tensor-parallel size is not "
               "implemented");
  create_error({{"megatron_cfg", {{"expert_model_parallel_size", 2}, {"tensor_model_parallel_size", 2}}}},
               "expert_model_parallel_size = 2 with policy.megatron_cfg.tensor_model_parallel_size = 2 needs "
               "policy.megatron_cfg.sequence_parallel = true",
               RLH_E_INVALID_ARGUMENT);
  create_error({{"megatron_cfg",
                 {{"expert_model_parallel_size", 2}, {"tensor_model_parallel_size", 2}, {"expert_tensor_parallel_size", 1}}}},
               "expert_model_parallel_size = 2 with policy.megatron_cfg.tensor_model_parallel_size = 2 needs "
               "policy.megatron_cfg.sequence_parallel = true",
               RLH_E_INVALID_ARGUMENT);
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
    pc = sdk::make_parallel_comms(sdk::Comm::world(sdk::Host(host().services())), sizes, {sdk::GroupKind::ep});
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
    auto g = global_batch();
    std::vector<int32_t> gcu;
    const engine::MicroBatch gmb = engine_view(*g, gcu);
    // The reference: one engine with every expert, over the whole batch.
    engine::EngineOptions ro;
    ro.ops = &host_ops();
    engine::Engine ref(md.desc, ro);
    ref.load_parameters(md.weights);
    engine::OutputRequest req;
    req.routed_experts = true;
    const engine::Outputs full = ref.forward(gmb, req);
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
    double lp_err = 0;
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t k = 0; k < W; ++k)
        mismatched += o.routed_experts[size_t(t * W + k)] != full.routed_experts[size_t((first + t) * W + k)];
      lp_err = std::max(lp_err, std::fabs(double(o.logprob[size_t(t)]) - double(full.logprob[size_t(first + t)])));
    }
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
    engine::MicroBatch rmb = mb;
    rmb.fields.push_back(rec.field(n, W));
    engine::OutputRequest rreq = req;
    rreq.replay_routing_field = "routed";
    const engine::Outputs o2 = epe.e->forward(rmb, rreq);
    EXPECT_EQ(o2.logprob, o.logprob) << "ep " << ep << ": replaying the record";
    RoutingField other_g{full.routed_experts};
    for (int32_t& x : other_g.data) x = int32_t((x + 1) % E);
    RoutingField other_mine{std::vector<int32_t>(other_g.data.begin() + first * W, other_g.data.begin() + (first + n) * W)};
    engine::MicroBatch gomb = gmb;
    gomb.fields.push_back(other_g.field(g->num_tokens(), W));
    const engine::Outputs ref_other = ref.forward(gomb, rreq);
    engine::MicroBatch omb = mb;
    omb.fields.push_back(other_mine.field(n, W));
    const engine::Outputs o3 = epe.e->forward(omb, rreq);
    double other_err = 0;
    for (int64_t t = 0; t < n; ++t)
      other_err = std::max(other_err, std::fabs(double(o3.logprob[size_t(t)]) - double(ref_other.logprob[size_t(first + t)])));
    EXPECT_LE(other_err, 2e-5) << "ep " << ep << ": replaying another routing";
    EXPECT_EQ(o3.routed_experts, other_mine.data);

    // A train step under replay: the forward's exchanges plus the backward's two (no counts).
    engine::StepOptions so;
    so.global_tokens = g->num_tokens();
    so.global_sequences = g->num_seqs();
    so.outputs = rreq;
    so.outputs.routed_experts = false;
    so.apply_optimizer = false;
    const engine::LossFn loss = [&](const engine::LossContext& ctx, const engine::OutputViews& ov,
                                    engine::OutputGrads& og) {
      engine::LossResult lr;
      for (size_t t = 0; t < ov.logprob.size(); ++t) {
        lr.loss -= ov.logprob[t] / double(ctx.global_tokens);
        og.logprob[t] = float(-1.0 / double(ctx.global_tokens));
      }
      return lr;
    };
    const int64_t b1 = epe.comm->bytes();
    epe.e->train_step(std::span<const engine::MicroBatch>(&rmb, 1), so, loss);
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
  auto g = global_batch();
  std::vector<int32_t> cu;
  const engine::MicroBatch mb = engine_view(*g, cu);
  engine::EngineOptions ro;
  ro.ops = &host_ops();
  engine::Engine ref(md.desc, ro);
  ref.load_parameters(md.weights);
  const engine::OutputRequest req;
  const engine::Outputs full = ref.forward(mb, req);

  sdk::ParallelSizes sizes;
  sizes.tp = 2;
  sizes.ep = 2;
  sizes.etp = 1;
  sdk::ParallelComms pc = sdk::make_parallel_comms(sdk::Comm::world(sdk::Host(host().services())), sizes,
                                                   {sdk::GroupKind::tp, sdk::GroupKind::ep});
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
  double lp_err = 0;
  for (size_t t = 0; t < o.logprob.size(); ++t) lp_err = std::max(lp_err, std::fabs(double(o.logprob[t]) - double(full.logprob[t])));
  EXPECT_LE(lp_err, 2e-5);
  EXPECT_GT(ep_comm.bytes(), 0);
  // The routing record (each rank records its rows, gathered over the group) is the reference's;
  // replaying another routing gives the reference's outputs under that routing.
  engine::OutputRequest rec = req;
  rec.routed_experts = true;
  const engine::Outputs ref_rec = ref.forward(mb, rec);
  const engine::Outputs got = e.forward(mb, rec);
  ASSERT_EQ(got.routing_width, ref_rec.routing_width);
  EXPECT_EQ(got.routed_experts, ref_rec.routed_experts) << "the routing record under TP 2 x EP 2";
  RoutingField other{ref_rec.routed_experts};
  for (int32_t& x : other.data) x = int32_t((x + 3) % 8);
  engine::MicroBatch omb = mb;
  omb.fields.push_back(other.field(g->num_tokens(), ref_rec.routing_width));
  engine::OutputRequest rreq = req;
  rreq.replay_routing_field = "routed";
  const engine::Outputs ref_other = ref.forward(omb, rreq), o_other = e.forward(omb, rreq);
  double replay_err = 0, moved = 0;
  for (size_t t = 0; t < o_other.logprob.size(); ++t) {
    replay_err = std::max(replay_err, std::fabs(double(o_other.logprob[t]) - double(ref_other.logprob[t])));
    moved = std::max(moved, std::fabs(double(ref_other.logprob[t]) - double(full.logprob[t])));
  }
  EXPECT_LE(replay_err, 2e-5) << "replaying another routing under TP 2 x EP 2";
  EXPECT_GT(moved, 1e-3) << "the other routing changes the outputs";
}

int main(int argc, char** argv) {
  release_kernels_before_the_host();  // the engine tests'
  return run_mpi_tests(argc, argv, {"model_llama", "kernels_cpu", "megatron", "comm_mpi"});
}
