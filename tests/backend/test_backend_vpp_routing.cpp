// The MoE routing record and replay under interleaved virtual pipeline stages on CPU ranks, the
// engines driven directly as the backend's schedule drives them (engine.hpp's *_stage calls,
// activations sent between the stages of a pipeline): PP 2 x VPP 2 under `mpirun -np 2` (ctest
// comm.backend_vpp_routing_np2) and PP 2 x VPP 2 x EP 2 under `-np 4` (comm.backend_vpp_routing_np4;
// Megatron's order tp-cp-ep-dp-pp: stage 0 is ranks {0, 1}, its ep group, and each replica takes
// its shard of the batch). The model is a four-layer Qwen3-MoE (qwen3-moe-tiny's two layers,
// then both again scaled by 0.9), one MoE layer in each of the four model chunks, so a rank's two
// chunks are runs of columns apart (rank 0: layers 0 and 2, columns [0, 2) and [4, 6)).
//
//   - each chunk's record (PpLayout::Chunk::route_begin, route_count), put in place and summed
//     over the pipeline, is the one-rank engine's record of the replica's micro-batch;
//   - replaying another routing of the whole model gives the one-rank engine's logprobs under it
//     within fp32 tolerance, and the record is that routing;
//   - a train step under replay: its forwards record that routing, the loss is the one-rank
//     engine's, and so is every gradient that is not an expert's (an expert's gradient under EP
//     holds the tokens of both replicas routed to it; without EP every gradient is compared) and
//     the summed auxiliary losses.
#include <algorithm>
#include <cmath>
#include <iostream>

#include "engine_under_mpi.hpp"
#include "model_parallel_checks.hpp"
#include "rlhost/backend_common/data_parallel.hpp"
#include "rlhost/sdk/expert_parallel.hpp"
#include "rlhost/sdk/parallel_groups.hpp"
#include "rlhost/sdk/pipeline_parallel.hpp"

using namespace rlh;
using namespace rlh::test;

namespace {

constexpr int64_t kP = 2, kV = 2, kS = kP * kV;

// qwen3-moe-tiny's layers 0, 1, then both again scaled by 0.9 (as layers 2, 3).
const EngineModel& four_layer_qwen3_moe() {
  static const EngineModel& m4 = engine_model(doubled_layers_model("qwen3-moe-tiny", "vpproute_qwen3moe4"));
  return m4;
}

// One rank of the pipeline: its stage engine (of the ep layout's description under EP) and groups.
struct StageRank {
  sdk::ParallelComms pc;
  sdk::EpLayout ep_layout;
  sdk::PpLayout layout;
  std::unique_ptr<backend::CommEpGroup> ep_comm;
  std::unique_ptr<engine::Engine> e;
  int64_t stage = 0, ep = 1;
  StageRank(const EngineModel& m, int64_t ep_size, const engine::EngineOptions& base) : ep(ep_size) {
    sdk::ParallelSizes sizes;
    sizes.pp = kP;
    sizes.ep = ep;
    pc = world_groups(sizes, {sdk::GroupKind::pp, sdk::GroupKind::dp, sdk::GroupKind::ep});
    stage = pc.of(sdk::GroupKind::pp).rank();
    engine::EngineOptions o = base;
    std::vector<std::vector<float>> w = m.weights;  // this rank's experts' part under EP
    const sdk::TransformerDesc* desc = &m.desc;
    if (ep > 1) {
      ep_layout = sdk::make_ep_layout(m.desc, ep, pc.of(sdk::GroupKind::ep).rank());
      for (size_t i = 0; i < w.size(); ++i) w[i] = sdk::ep_slice(ep_layout, i, m.weights[i]);
      desc = &ep_layout.local;
      ep_comm = std::make_unique<backend::CommEpGroup>(pc.of(sdk::GroupKind::ep));
      o.ep = &ep_layout;
      o.ep_comm = ep_comm.get();
    }
    sdk::PpSplit split;
    split.virtual_size = kV;
    layout = sdk::make_pp_layout(*desc, kP, stage, split);
    o.pp = &layout;
    e = std::make_unique<engine::Engine>(m.desc, o);
    std::vector<std::vector<float>> local;
    for (int64_t i : layout.full_index) local.push_back(w[size_t(i)]);
    e->load_parameters(local);
  }
  const sdk::Comm& pp() const { return pc.of(sdk::GroupKind::pp); }
  void send(std::vector<float>& x, int to) const {
    const int64_t n = int64_t(x.size());
    pp().send(sdk::host_tensor(x.data(), sdk::dtype_of<float>(), std::span<const int64_t>(&n, 1)), to);
  }
  void recv(std::vector<float>& x, int from) const {
    const int64_t n = int64_t(x.size());
    pp().recv(sdk::host_tensor(x.data(), sdk::dtype_of<float>(), std::span<const int64_t>(&n, 1)), from);
  }
  // A chunk's record put at its columns of the whole [n, R] (zeros elsewhere).
  void place(std::vector<int32_t>& rec, const engine::Outputs& got, int64_t chunk, int64_t n, int64_t R) const {
    const sdk::PpLayout::Chunk& c = layout.chunks[size_t(chunk)];
    EXPECT_EQ(got.routing_width, c.route_count) << "stage " << stage << " chunk " << chunk;
    ASSERT_EQ(int64_t(got.routed_experts.size()), n * c.route_count) << "stage " << stage << " chunk " << chunk;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t k = 0; k < c.route_count; ++k)
        rec[size_t(t * R + c.route_begin + k)] = got.routed_experts[size_t(t * c.route_count + k)];
  }
  // The micro-batch through the virtual stages in turn (v = chunk x P + stage); the record of
  // every chunk, summed over the pipeline, on every stage; the logprobs on the last stage.
  engine::Outputs forward(const engine::MicroBatch& mb, const engine::OutputRequest& req, int64_t R) {
    const int64_t n = mb.num_tokens(), C = e->desc().hidden_size;
    std::vector<float> x_in(size_t(n * C)), x_out(size_t(n * C));
    std::vector<int32_t> rec(size_t(n * R), 0);
    engine::Outputs last;
    for (int64_t v = stage; v < kS; v += kP) {
      if (v > 0) recv(x_in, int((v - 1) % kP));
      engine::Outputs got = e->forward_stage(mb, req, v > 0 ? std::span<const float>(x_in) : std::span<const float>(),
                                             v < kS - 1 ? std::span<float>(x_out) : std::span<float>(), v / kP);
      if (req.routed_experts) place(rec, got, v / kP, n, R);
      if (v < kS - 1) send(x_out, int((v + 1) % kP));
      if (v == kS - 1) last = std::move(got);
    }
    if (req.routed_experts) pp().all_reduce(std::span<int32_t>(rec), RLH_REDUCE_SUM);
    last.routed_experts = std::move(rec);
    return last;
  }
};

TEST(VirtualStageRouting, RecordReplayAndTrainStep) {
  const int W = world().size();
  ASSERT_TRUE(W == 2 || W == 4) << "run under mpirun -np 2 or -np 4";
  const int64_t ep = W / kP;
  const EngineModel& m = four_layer_qwen3_moe();
  engine::EngineOptions o;
  o.ops = &host_ops();
  o.moe.load_balancing = engine::MoeOptions::LoadBalancing::seq_aux_loss;
  o.moe.aux_loss_coef = 0.01;
  o.moe.z_loss_coef = 0.001;
  StageRank r(m, ep, o);
  const int64_t dp = r.pc.of(sdk::GroupKind::dp).size(), dp_rank = r.pc.of(sdk::GroupKind::dp).rank();
  ASSERT_EQ(dp, ep);
  const bool last = r.stage == kP - 1;

  // This replica's shard; the reference is one engine with the whole model over it.
  auto g = random_batch({9, 14, 3, 11, 17, 6}, 512, 41);
  auto mine = shard_of(*g, int(dp_rank), int(dp));
  std::vector<int32_t> cu;
  const engine::MicroBatch mb = engine_view(*mine, cu);
  const int64_t n = mine->num_tokens();
  const auto ref_engine = reference_engine(m, o);
  engine::Engine& ref = *ref_engine;
  const int64_t R = ref.routing_width(), E = 8;
  ASSERT_EQ(r.layout.route_total, R);
  engine::OutputRequest req;
  req.routed_experts = true;
  const engine::Outputs full = ref.forward(mb, req);

  const engine::Outputs got = r.forward(mb, req, R);
  EXPECT_EQ(got.routed_experts, full.routed_experts) << "the chunks' records in place are one engine's";
  double lp_err = 0;
  if (last) {
    lp_err = max_abs_diff(got.logprob, full.logprob);
    EXPECT_LE(lp_err, 1e-5);
  }

  // Another routing of the whole model (each choice moved to the next expert), replayed.
  RoutingField other = RoutingField::moved(full.routed_experts, 1, E);
  const engine::MicroBatch rmb = other.replaying(mb, n, R);
  const engine::OutputRequest rreq = replay_request(req);
  const engine::Outputs ref_other = ref.forward(rmb, rreq);
  const engine::Outputs got_other = r.forward(rmb, rreq, R);
  EXPECT_EQ(got_other.routed_experts, other.data) << "the record under replay is the replayed routing";
  double other_err = 0;
  if (last) {
    EXPECT_GT(max_abs_diff(ref_other.logprob, full.logprob), 1e-4) << "the other routing changes the outputs";
    other_err = max_abs_diff(got_other.logprob, ref_other.logprob);
    EXPECT_LE(other_err, 1e-5) << "replaying another routing";
  }

  // A train step under the replayed routing: the forwards of the virtual stages before the
  // last (asking for the record) and the backwards from the last virtual stage down, as the
  // backend's schedule runs one micro-batch.
  engine::StepOptions so;
  so.global_tokens = mine->num_tokens() - mine->num_seqs();
  so.global_sequences = mine->num_seqs();
  so.apply_optimizer = false;
  so.outputs.replay_routing_field = "routed";
  const engine::LossFn nll = sequence_nll();
  const engine::StepResult sr = ref.train_step(std::span<const engine::MicroBatch>(&rmb, 1), so, nll);
  r.e->begin_stage_step(std::span<const engine::MicroBatch>(&rmb, 1), so);
  const int64_t C = m.desc.hidden_size;
  std::vector<std::vector<float>> xs(size_t(kS), std::vector<float>(size_t(n * C)));  // inputs of each virtual stage
  std::vector<int32_t> rec(size_t(n * R), 0);
  engine::OutputRequest fwd = so.outputs;
  fwd.routed_experts = true;
  for (int64_t v = r.stage; v < kS - 1; v += kP) {
    if (v > 0) r.recv(xs[size_t(v)], int((v - 1) % kP));
    const engine::Outputs f = r.e->forward_stage(
        rmb, fwd, v > 0 ? std::span<const float>(xs[size_t(v)]) : std::span<const float>(), xs[size_t(v + 1)], v / kP);
    r.place(rec, f, v / kP, n, R);
    r.send(xs[size_t(v + 1)], int((v + 1) % kP));
  }
  if (last) r.recv(xs[size_t(kS - 1)], int((kS - 2) % kP));
  std::vector<float> dy(size_t(n * C)), dx(size_t(n * C));
  engine::LossResult lr;
  for (int64_t v = kS - 1; v >= 0; --v) {
    if (v % kP != r.stage) continue;
    if (v < kS - 1) r.recv(dy, int((v + 1) % kP));
    const engine::LossResult got_lr = r.e->backward_stage(
        rmb, 0, 1, so, nll, v > 0 ? std::span<const float>(xs[size_t(v)]) : std::span<const float>(),
        v < kS - 1 ? std::span<const float>(dy) : std::span<const float>(),
        v > 0 ? std::span<float>(dx) : std::span<float>(), v / kP);
    if (v == kS - 1) lr = got_lr;
    if (v > 0) r.send(dx, int((v - 1) % kP));
  }
  r.e->end_stage_step();
  // The records of the step's forwards (every chunk but the last virtual stage's, whose forward
  // is part of its backward call) are the replayed routing's columns.
  int64_t head_cols[2] = {0, 0};  // the last virtual stage's columns: first, count
  if (last) head_cols[0] = r.layout.chunks.back().route_begin, head_cols[1] = r.layout.chunks.back().route_count;
  r.pp().all_reduce(std::span<int64_t>(head_cols, 2), RLH_REDUCE_SUM);
  r.pp().all_reduce(std::span<int32_t>(rec), RLH_REDUCE_SUM);
  std::vector<int32_t> expect = other.data;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t k = head_cols[0]; k < head_cols[0] + head_cols[1]; ++k) expect[size_t(t * R + k)] = 0;
  EXPECT_EQ(rec, expect) << "a train step's forwards record the replayed routing";
  if (last) {
    EXPECT_NEAR(lr.loss, sr.loss, 1e-6 * std::fabs(sr.loss));
  }

  // Gradients: each of this stage's parameters against the reference's (under EP an expert's
  // holds the other replica's tokens routed to it too: not compared). A tied embedding's two
  // copies (stage 0's lookup, stage 1's head) are summed over the pipeline first.
  double worst = 0;
  for (size_t j = 0; j < r.e->num_params(); ++j) {
    const size_t i = size_t(r.layout.full_index[j]);
    const sdk::ParamDesc& p = m.desc.params[i];
    std::vector<float> gj(r.e->grad(j).begin(), r.e->grad(j).end());
    if (r.layout.shares_embedding && int64_t(j) == r.layout.embed_local)
      r.pp().all_reduce(std::span<float>(gj), RLH_REDUCE_SUM);
    if (ep > 1 && gj.size() != ref.grad(i).size()) continue;  // an expert's slice
    const std::vector<float> gr(ref.grad(i).begin(), ref.grad(i).end());
    double mx = 0;
    for (float x : gr) mx = std::max(mx, double(std::fabs(x)));
    const double e = max_abs_diff(gj, gr) / std::max(mx, 1e-30);
    worst = std::max(worst, e);
    EXPECT_LE(e, 1e-5) << p.name;
  }
  // The auxiliary losses' values, summed over the stages; the busiest expert's share, the largest.
  const engine::Engine::MoeValues mv = r.e->stage_moe_values();
  double v[3] = {mv.aux, mv.z, mv.max_load};
  r.pp().all_reduce(std::span<double>(v, 2), RLH_REDUCE_SUM);
  r.pp().all_reduce(std::span<double>(v + 2, 1), RLH_REDUCE_MAX);
  // Without EP the stages run one engine's arithmetic; under EP the experts' outputs come back
  // summed in another order, so the activations (and the router's logits) differ in fp32's last
  // bits.
  const double tol = ep > 1 ? 1e-6 : 1e-9;
  int64_t compared = 0;
  for (const auto& [k, x] : engine::moe_step_metrics(o.moe, v[0], v[1], v[2]))
    for (const auto& [rk, rx] : sr.metrics)
      if (rk == k) {
        EXPECT_NEAR(x, rx, tol * std::fabs(rx) + 1e-12) << k;
        ++compared;
      }
  EXPECT_EQ(compared, 3) << "moe/aux_loss, moe/z_loss and moe/max_expert_load";
  if (world().rank() == W - 1)
    std::cout << "[np " << W << "] PP 2 x VPP 2" << (ep > 1 ? " x EP 2" : "") << ": routing record equal, logprobs within "
              << lp_err << ", replay of another routing within " << other_err << ", gradients within " << worst
              << " of the largest (last stage)\n";
}

}  // namespace

int main(int argc, char** argv) {
  release_kernels_before_the_host();  // the engine tests'
  return run_mpi_tests(argc, argv, {"model_llama", "kernels_cpu", "megatron", "comm_mpi"});
}
