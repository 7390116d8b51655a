// Tensor parallelism for the megatron backend on CPU ranks, under `mpirun -np N` (ctest: N = 2
// and 4, one BLAS thread per rank). Every rank also computes the one-rank reference in-process
// (a backend that loads its model with the launcher's variables hidden, so it sees one rank).
//
//   - TP = N (N = 2: q/k/v and kv heads split; N = 4: the two kv heads replicated on two ranks
//     each) and TP 2 x DP 2 give the reference's logprobs, entropy, loss, gradient norm and every
//     gradient (one SGD step at lr 1 without clipping: w - w' = g) within fp32 tolerance, on a
//     Llama (untied head, GQA) and a Qwen3 (tied embedding, q/k norms), with a loss that reads
//     logprobs and entropy at temperature 0.7, with packing on and off; and at TP = 2 on models
//     with q/k/v, o and MLP biases, sliding windows, MoE (experts split over the group: etp =
//     tp; the auxiliary losses as the reference's), MLA, one kv head, Gemma-3's norms (see cases());
//   - the engine's routing record and replay under TP are one rank's;
//   - log p at given ids (K per token) equals the reference's;
//   - the tp group's bytes per step equal the analytic count;
//   - two AdamW steps with clipping follow the reference (DDP and the distributed optimizer);
//   - a state saved under TP is the one-rank HF layout (full tensors), loads on one rank into the
//     same weights, continues there within fp32 tolerance, and a state saved on one rank loads
//     back under TP bitwise;
//   - refusals name the setting: expert_tensor_parallel_size other than tp, a TP size that does
//     not divide the ranks, TP on one rank, top-k processed logprobs, a tp group given different
//     batches (MoE and MLA under sequence parallelism: test_backend_cp.cpp).
#include <unistd.h>

#include <cstdlib>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>

#include "backend_harness.hpp"
#include "engine_under_mpi.hpp"
#include "model_parallel_checks.hpp"
#include "mpi_harness.hpp"
#include "rlhost/backend_common/data_parallel.hpp"
#include "rlhost/sdk/comm.hpp"
#include "rlhost/sdk/parallel_groups.hpp"
#include "rlhost/sdk/safetensors.hpp"
#include "rlhost/sdk/tensor_parallel.hpp"

namespace fs = std::filesystem;
using namespace rlh;
using namespace rlh::test;
using json = nlohmann::json;

namespace {

// llama-tiny with every bias (attention_bias and mlp_bias: q/k/v/o and gate/up/down), random,
// written once per process into a scratch folder (no fixture has o or MLP biases): the
// row-parallel biases must be added once, after the sum.
class BiasedLlama {
 public:
  BiasedLlama() : dir_(fs::temp_directory_path() / ("rlh-tp-biased-llama-" + std::to_string(getpid()))) {
    const fs::path src = model_path("llama-tiny");
    fs::create_directories(dir_);
    json cfg = json::parse(std::ifstream(src / "config.json"));
    cfg["attention_bias"] = true;
    cfg["mlp_bias"] = true;
    std::ofstream(dir_ / "config.json") << cfg.dump(2);
    const sdk::st::File f = sdk::st::File::open((src / "model.safetensors").string());
    std::vector<std::pair<std::string, std::vector<int64_t>>> names;
    for (const auto& t : f.tensors()) names.emplace_back(t.name, t.shape);
    const int64_t inter = cfg["intermediate_size"].get<int64_t>(), C = cfg["hidden_size"].get<int64_t>();
    const int64_t D = cfg["head_dim"].get<int64_t>(), H = cfg["num_attention_heads"].get<int64_t>(),
                  kv = cfg["num_key_value_heads"].get<int64_t>();
    for (int64_t l = 0; l < cfg["num_hidden_layers"].get<int64_t>(); ++l) {
      const std::string at = "model.layers." + std::to_string(l) + ".";
      for (const auto& [n, rows] : std::vector<std::pair<std::string, int64_t>>{
               {"self_attn.q_proj", H * D}, {"self_attn.k_proj", kv * D}, {"self_attn.v_proj", kv * D},
               {"self_attn.o_proj", C}, {"mlp.gate_proj", inter}, {"mlp.up_proj", inter}, {"mlp.down_proj", C}})
        names.emplace_back(at + n + ".bias", std::vector<int64_t>{rows});
    }
    std::vector<std::vector<float>> data;
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.f, 0.1f);
    for (const auto& [n, shape] : names) {
      if (f.find(n) != nullptr) {
        data.push_back(f.read_f32(n));
      } else {
        data.emplace_back(size_t(shape[0]));
        for (float& x : data.back()) x = normal(rng);
      }
    }
    std::vector<sdk::st::WriteTensor> ts;
    for (size_t i = 0; i < names.size(); ++i)
      ts.push_back({names[i].first, sdk::st::DType::F32, names[i].second, std::as_bytes(std::span(data[i]))});
    sdk::st::write_file((dir_ / "model.safetensors").string(), ts);
  }
  ~BiasedLlama() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path() const { return dir_.string(); }

 private:
  fs::path dir_;
};

// A case's model folder: a fixture, one of tests/engine/fixtures (qwen2-moe-tiny: a shared expert
// with its sigmoid gate, q/k/v biases, a dense layer among MoE ones; gemma3-tiny: tied, scaled
// embedding, sandwich norms, (1 + w) q/k norms, GeGLU, sliding windows with their own RoPE;
// mixtral-window-mqa-tiny: one kv head (on every rank), windows, top-3 of 4 experts) or the
// biased llama; gemma2-tiny: attention and final logit soft-capping, windows, tied.
std::string where(const std::string& model) {
  if (model == "llama-biased") {
    static BiasedLlama biased;
    return biased.path();
  }
  if (model == "qwen2-moe-tiny" || model == "gemma3-tiny" || model == "gemma2-tiny" || model == "mixtral-window-mqa-tiny")
    return std::string(RLH_ENGINE_FIXTURES_DIR) + "/" + model;
  return model;
}

struct Case {
  std::string model;
  int64_t tp;
  bool packing;
  bool distributed_optimizer;
  bool with_dp = true;  // also run as TP x DP where the world is larger (np 4); false: only at world = tp
  std::string label() const {
    return model + " tp" + std::to_string(tp) + (distributed_optimizer ? " distopt" : " ddp") + (packing ? " packed" : "");
  }
};

// MoE models train with the expert tensor parallelism the key defaults to (etp = tp) and, as the
// expert-parallel test does, the softmax router (qwen3-moe) with the load-balancing loss (per
// micro-batch without packing, per sequence with it) and the z-loss; the sigmoid router
// (deepseek-v3) in float64.
json base_config(const Case& c, int64_t tp) {
  json mc = {{"tensor_model_parallel_size", tp}};
  if (c.model == "qwen3-moe-tiny" || c.model == "qwen2-moe-tiny" || c.model == "mixtral-window-mqa-tiny") {
    set_moe_aux_losses(mc, c.packing);
  } else if (c.model == "deepseek-v3-tiny") {
    mc["moe_router_dtype"] = "fp64";
  }
  json cfg = {{"megatron_cfg", mc}};
  set_batching(cfg, c.packing);
  return cfg;
}

json sgd_config(const Case& c, int64_t tp) { return with_sgd(base_config(c, tp), c.distributed_optimizer); }
json adam_config(const Case& c, int64_t tp, double lr) {
  return with_adam(base_config(c, tp), lr, c.distributed_optimizer);
}

// The tensor-parallel group's traffic of one train step, as a ring moves it (2 (T-1)/T of each
// all-reduced tensor), for these fixtures (hidden 64) and N tokens on this rank, one target per
// token: per token the embedding, two layer outputs per layer forward (o; down or the MoE block
// after its combine) and two input gradients per layer backward (q|k|v or the MLA block; gate|up
// or the MoE block), d xn of the head ((2 + 4 L) C floats), the head's max and (l, s, z_t) (4
// floats), and per MoE layer the routing weights' gradient (top_k floats; one more for the shared
// expert's gate: qwen2-moe); per step the
// gradients the group shares: the q/k norms (qwen3, qwen3-moe), kv heads replicated at T above
// the kv heads (k and v of all kv heads, and their biases: qwen2), the MLA latent projections
// and their norms (deepseek-v3: q_a, q_a_norm, kv_a, kv_a_norm); and the two gradient-norm sums
// (doubles: the engine's and the optimizer's).
int64_t analytic_tp_bytes(const Case& c, int64_t N) {
  const int64_t C = 64, T = c.tp;
  const std::string& m = c.model;
  const bool mixtral = m == "mixtral-window-mqa-tiny";
  const int64_t kv = mixtral ? 1 : 2;
  const int64_t L = m == "qwen2-swa-yarn-tiny" || m == "deepseek-v3-tiny" ? 3
                    : m == "qwen2-moe-tiny" || m == "gemma3-tiny" || m == "gemma2-tiny" ? 4
                                                                          : 2;
  const int64_t moe_layers = m == "qwen3-moe-tiny" || m == "deepseek-v3-tiny" || mixtral ? 2
                             : m == "qwen2-moe-tiny"                                    ? 3
                                                                                        : 0;
  const int64_t top_k = mixtral ? 3 : 2, shared_gate = m == "qwen2-moe-tiny" ? 1 : 0;
  const bool qk_norm = m == "qwen3-tiny" || m == "qwen3-moe-tiny" || m == "gemma3-tiny";
  const bool kv_bias = m == "qwen2-swa-yarn-tiny" || m == "qwen2-moe-tiny" || m == "llama-biased";
  const int64_t D = m == "qwen3-tiny" || m == "qwen3-moe-tiny" ? 32 : 16;
  int64_t floats = (2 + 4 * L) * N * C + 4 * N + moe_layers * (top_k + shared_gate) * N;
  if (qk_norm) floats += L * 2 * D;
  if (m == "deepseek-v3-tiny") {
    const int64_t rq = 48, rkv = 32, dr = 8;
    floats += L * (rq * C + rq + (rkv + dr) * C + rkv);
  } else if (T > kv) {
    floats += L * 2 * kv * D * (C + (kv_bias ? 1 : 0));
  }
  return 2 * floats * 4 * (T - 1) / T + 2 * (2 * 8 * (T - 1) / T);
}

class TensorParallel : public ::testing::TestWithParam<Case> {};

// This rank's share: the ranks of a tp group (adjacent) are one data-parallel rank.
Share share_of(const Case& c) { return Share(int(world().size() / c.tp), int(world().rank() / c.tp)); }

TEST_P(TensorParallel, MatchesOneRank) {
  const Case c = GetParam();
  const int N = world().size();
  if (N % c.tp != 0 || (N != c.tp && !c.with_dp)) GTEST_SKIP() << "tp " << c.tp << " on " << N << " ranks";
  const Share p = share_of(c);
  const int dp = p.dp;
  const auto& mine = p.mine;
  const SgdComparison r = compare_sgd_step(where(c.model), sgd_config(c, 1), sgd_config(c, c.tp), *p.global, *mine, p.first,
                                           c.label());
  const Outcome& tp = r.got;
  EXPECT_EQ(tp.metrics["dp_size"].get<int>(), dp);
  EXPECT_EQ(tp.metrics["tp/comm_bytes"].get<int64_t>(), analytic_tp_bytes(c, mine->num_tokens())) << c.label();
  if (c.model == "qwen3-moe-tiny" || c.model == "qwen2-moe-tiny")  // the auxiliary losses: every rank of a tp group routes alike
    expect_moe_metrics(tp.metrics, r.ref.metrics, {"moe/aux_loss", "moe/z_loss"}, 1e-5, c.label());
  if (world().rank() == 0)
    std::cout << "[np " << N << "] " << c.label() << ": " << sgd_summary(r) << ", tp bytes/step " << tp.metrics["tp/comm_bytes"].get<int64_t>() << " (analytic "
              << analytic_tp_bytes(c, mine->num_tokens()) << ")\n";
}

TEST_P(TensorParallel, AdamWStepsFollowOneRank) {
  const Case c = GetParam();
  const int N = world().size();
  if (N % c.tp != 0 || (N != c.tp && !c.with_dp)) GTEST_SKIP() << "tp " << c.tp << " on " << N << " ranks";
  const Share p = share_of(c);
  const int dp = p.dp;
  const AdamComparison r =
      compare_adamw_steps(where(c.model), adam_config(c, 1, 2e-3), adam_config(c, c.tp, 2e-3), *p.global, *p.mine, c.label());
  const double state = r.state, ref_state = r.ref_state;
  // Each rank holds its part of the model: 1/tp, plus the norms whole and, at tp 4, each of the
  // two kv heads on two ranks (under 4% of these models more). Copies of it as data parallelism
  // keeps them (4 with DDP; 2 + 3/dp with the distributed optimizer: weights, gradients, the
  // gradient block and the moments of it) against one rank's 4.
  const double copies = c.distributed_optimizer ? 2.0 + 3.0 / dp : 4.0;
  EXPECT_LE(state, ref_state / 4 * copies * (1.0 / double(c.tp) + 0.04)) << c.label();
  EXPECT_GE(state, ref_state / 4 * copies / double(c.tp)) << c.label();
  if (world().rank() == 0) std::cout << "[np " << N << "] " << c.label() << ": " << adam_summary(r) << "\n";
}

// Log p at given ids (top-k distillation's output: K ids per token, some -1) through the
// vocabulary-parallel head, forward only, on the whole batch.
TEST_P(TensorParallel, LogprobAtIdsMatchOneRank) {
  const Case c = GetParam();
  const int N = world().size();
  if (N % c.tp != 0 || (N != c.tp && !c.with_dp)) GTEST_SKIP() << "tp " << c.tp << " on " << N << " ranks";
  auto g = layout_batch();
  EXPECT_LE(at_ids_differences(where(c.model), sgd_config(c, 1), sgd_config(c, c.tp), *g, kLayoutVocab)[0], 2e-5)
      << c.label();
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (const char* model : {"llama-tiny", "qwen3-tiny"}) {
    v.push_back({model, 2, false, true});
    v.push_back({model, 2, true, false});
    v.push_back({model, 4, true, true});  // np 4 only: kv heads replicated
  }
  // q/k/v biases, sliding windows and YaRN; MoE with q/k norms (also TP 2 x DP 2 at np 4); MLA
  // with MoE (sigmoid router, shared expert) after a dense layer; one TP 4 case (kv heads and
  // their biases replicated). The others at np 2 only (CI time).
  v.push_back({"qwen2-swa-yarn-tiny", 2, true, false, false});
  v.push_back({"qwen3-moe-tiny", 2, false, true});
  v.push_back({"deepseek-v3-tiny", 2, true, false, false});
  v.push_back({"qwen2-swa-yarn-tiny", 4, false, true});
  // Every bias, o and down's added once after the sum; a shared expert with its sigmoid gate.
  v.push_back({"llama-biased", 2, false, false, false});
  v.push_back({"qwen2-moe-tiny", 2, true, true, false});
  v.push_back({"gemma3-tiny", 2, false, true, false});
  v.push_back({"mixtral-window-mqa-tiny", 2, true, false, false});
  // Gemma-2's soft-capping of the attention scores and of the logits (the vocabulary-parallel
  // head caps each rank's tile), with its windows, packed.
  v.push_back({"gemma2-tiny", 2, true, false, false});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Tp, TensorParallel, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return test_name(info.param.label()); });

// A state saved under TP is one rank's files (HF layout, full tensors); it loads on one rank
// into the same weights and continues; one rank's state loads back under TP bitwise.
TEST(TensorParallelCheckpoints, SavedUnderTpLoadsOnOneRankAndBack) {
  const int N = world().size(), R = world().rank();
  const int64_t tp = 2;
  const Case c{"llama-tiny", tp, false, true};
  checkpoint_round_trip(c.model, adam_config(c, tp, 5e-3), adam_config(c, 1, 5e-3), int(N / tp), int(R / tp), "tp",
                        layout_batch());
}

// The same for a model with experts (split along their rows and columns) and MLA (latents
// replicated): deepseek-v3-tiny at TP 2 (np 2 only).
TEST(TensorParallelCheckpoints, ExpertsAndLatentsSavedUnderTpLoadOnOneRankAndBack) {
  const int N = world().size(), R = world().rank();
  const int64_t tp = 2;
  if (N != tp) GTEST_SKIP() << "np 2 only";
  const Case c{"deepseek-v3-tiny", tp, false, false};
  checkpoint_round_trip(c.model, adam_config(c, tp, 5e-3), adam_config(c, 1, 5e-3), int(N / tp), int(R / tp), "tp",
                        layout_batch());
}

// The engine under tensor parallelism (TP = the world: 2 or 4) on an MoE model: every rank of the
// group routes alike, so its routing record is one rank's; replaying it reproduces the outputs
// bitwise, and replaying another routing gives one rank's outputs under that routing.
TEST(TensorParallelEngine, RoutingRecordAndReplay) {
  const int64_t tp = world().size();
  const EngineModel& md = engine_model("qwen3-moe-tiny");
  auto g = layout_batch();
  const EngineReference ref(md, *g);
  const engine::MicroBatch& mb = ref.mb;
  const engine::OutputRequest& req = ref.req;
  const engine::Outputs& full = ref.full;
  const int64_t W = full.routing_width, n = g->num_tokens(), E = 8;

  sdk::ParallelSizes sizes;
  sizes.tp = tp;
  const sdk::ParallelComms pc = world_groups(sizes, {sdk::GroupKind::tp});
  const sdk::Comm& group = pc.of(sdk::GroupKind::tp);
  const sdk::TpLayout layout = sdk::make_tp_layout(md.desc, tp, group.rank());
  backend::CommTpGroup comm(group);
  engine::EngineOptions o;
  o.ops = &host_ops();
  o.tp = &layout;
  o.tp_comm = &comm;
  engine::Engine e(md.desc, o);
  std::vector<std::vector<float>> local;
  for (size_t i = 0; i < md.weights.size(); ++i) local.push_back(sdk::tp_slice(layout, i, md.weights[i]));
  e.load_parameters(local);
  const engine::Outputs out = e.forward(mb, req);
  ASSERT_EQ(out.routing_width, W);
  EXPECT_EQ(out.routed_experts, full.routed_experts) << "tp " << tp << ": the routing record is one rank's";
  EXPECT_LE(max_abs_diff(out.logprob, full.logprob), 2e-5) << "tp " << tp;

  RoutingField rec{std::vector<int32_t>(out.routed_experts.begin(), out.routed_experts.end())};
  EXPECT_EQ(e.forward(rec.replaying(mb, n, W), replay_request(req)).logprob, out.logprob)
      << "tp " << tp << ": replaying the record";
  const OtherRouting other(*ref.engine, e, mb, full.routed_experts, n, W, 1, E, req);
  EXPECT_LE(max_abs_diff(other.got.logprob, other.ref.logprob), 2e-5) << "tp " << tp << ": replaying another routing";
  EXPECT_EQ(other.got.routed_experts, other.field.data);
  EXPECT_GT(max_abs_diff(other.got.logprob, out.logprob), 1e-3) << "the other routing changes the outputs";
}

TEST(TensorParallelErrors, RefusedByName) {
  const int N = world().size();
  // MoE under TP alone splits the experts over the tp group: another expert_tensor_parallel_size
  // is refused by name (at load, for an MoE model; at create when it does not divide tp).
  expect_load_error({{"megatron_cfg", {{"tensor_model_parallel_size", 2}, {"expert_tensor_parallel_size", 1}}}},
                    "qwen3-moe-tiny", RLH_E_UNIMPLEMENTED,
                    "expert_tensor_parallel_size = 1 with tensor_model_parallel_size = 2: the experts are split over the "
                    "tensor-parallel group only");
  expect_create_error({{"megatron_cfg", {{"tensor_model_parallel_size", 2}, {"expert_tensor_parallel_size", 4}}}},
                      RLH_E_UNIMPLEMENTED,
                      "expert_tensor_parallel_size = 4 with policy.megatron_cfg.tensor_model_parallel_size = 2: expert "
                      "tensor parallelism over a number of ranks that does not divide the tensor-parallel size is not "
                      "implemented");
  expect_load_error({{"megatron_cfg", {{"tensor_model_parallel_size", N + 1}}}}, "llama-tiny", RLH_E_INVALID_ARGUMENT,
                    "tensor_model_parallel_size = " + std::to_string(N + 1) + ": megatron: parallel sizes: world size");
  {
    Alone alone;
    expect_load_error({{"megatron_cfg", {{"tensor_model_parallel_size", 2}}}}, "llama-tiny", RLH_E_INVALID_ARGUMENT,
                      "tensor_model_parallel_size = 2 needs a multiple of 2 launched ranks");
  }
  {  // the ranks of a tp group given different batches (a loop sharding over every rank)
    Backend be(host(), "megatron", {{"megatron_cfg", {{"tensor_model_parallel_size", 2}}}});
    rlh_model* m = be.load(model_path("llama-tiny"), false);
    auto g = layout_batch();
    auto mine = shard_of(*g, world().rank(), N);
    std::vector<std::vector<float>> out;
    expect_error(be.try_forward(m, *mine, {spec(RLH_OUTPUT_LOGPROB_RAW, "lp")}, out), RLH_E_INVALID_ARGUMENT,
                 "forward: the ranks of a tensor-parallel group were given different batches");
  }
  {  // top-k processed logprobs need the whole vocabulary
    Backend be(host(), "megatron", {{"megatron_cfg", {{"tensor_model_parallel_size", 2}}}});
    rlh_model* m = be.load(model_path("llama-tiny"), false);
    auto g = layout_batch();
    std::vector<std::vector<float>> out;
    expect_error(be.try_forward(m, *g, {spec(RLH_OUTPUT_LOGPROB, "lp", 1.0, 5)}, out), RLH_E_INVALID_ARGUMENT,
                 "top_k/top_p are not supported under tensor parallelism");
  }
}

}  // namespace

int main(int argc, char** argv) {
  release_kernels_before_the_host();  // the engine test's
  return run_mpi_tests(argc, argv, {"model_llama", "kernels_cpu", "megatron", "comm_mpi"});
}
