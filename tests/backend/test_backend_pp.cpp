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
//   - MoE under PP 2 (np 2): Qwen3-MoE with the load-balancing and z losses (their values and
//     gradients from both stages), DeepSeek-V3 (MLA, sigmoid routing in float64) split 2 + 1:
//     outputs, gradients, two AdamW steps and the MoE metrics are one rank's;
//   - a reward model's value head (the last stage's) gives one rank's values and gradients;
//   - interleaved virtual stages (PP 2 x VPP 2 on a four-layer Llama written by the test; with
//     DP 2 at np 4) give the reference's outputs, gradients and AdamW steps, and the pipeline's
//     bytes per step equal the analytic count;
//   - refusals name the setting: PP on one rank, layers that do not split, virtual stages
//     without PP, with first/last counts, over layers or micro-batches that do not divide.
#include <cstdlib>
#include <iostream>

#include "backend_harness.hpp"
#include "model_parallel_checks.hpp"
#include "mpi_harness.hpp"

using namespace rlh;
using namespace rlh::test;
using json = nlohmann::json;

namespace {

struct Case {
  std::string model;
  int64_t tp, pp;
  bool packing;
  bool distributed_optimizer;
  int64_t first_layers = 1;  // num_layers_in_first_pipeline_stage
  int64_t vpp = 1;           // virtual_pipeline_model_parallel_size
  std::string label() const {
    return model + (tp > 1 ? " tp" + std::to_string(tp) : "") + " pp" +
           std::to_string(pp) + (vpp > 1 ? " vpp" + std::to_string(vpp) : "") +
           (first_layers != 1 ? " first" + std::to_string(first_layers) : "") +
           (distributed_optimizer ? " distopt" : " ddp") + (packing ? " packed" : "");
  }
};

json base_config(const Case& c, bool one_rank) {
  json cfg = {{"megatron_cfg",
               {{"tensor_model_parallel_size", one_rank ? 1 : c.tp},
                {"pipeline_model_parallel_size", one_rank ? 1 : c.pp},
                {"num_layers_in_first_pipeline_stage",
                 one_rank || c.pp == 1 || c.vpp > 1 ? json(nullptr) : json(c.first_layers)},
                {"virtual_pipeline_model_parallel_size", one_rank || c.vpp == 1 ? json(nullptr) : json(c.vpp)}}}};
  // MoE: the softmax router (Qwen3-MoE) trains with the load-balancing loss (per micro-batch,
  // or per sequence with packing) and the z-loss, whose gradients each stage adds to its own
  // layers and whose values the stages sum; DeepSeek-V3's sigmoid router (no such losses;
  // MLA attention) routes in float64.
  if (c.model == "qwen3-moe-tiny") {
    set_moe_aux_losses(cfg["megatron_cfg"], c.packing);
  } else if (c.model == "deepseek-v3-tiny") {
    cfg["megatron_cfg"]["moe_router_dtype"] = "fp64";
  }
  set_batching(cfg, c.packing);
  return cfg;
}

bool is_moe(const Case& c) { return c.model == "qwen3-moe-tiny" || c.model == "deepseek-v3-tiny"; }

json sgd_config(const Case& c, bool one_rank) { return with_sgd(base_config(c, one_rank), c.distributed_optimizer); }
json adam_config(const Case& c, bool one_rank, double lr) {
  return with_adam(base_config(c, one_rank), lr, c.distributed_optimizer);
}

// The pipeline's traffic of one train step on this rank (pp/comm_bytes), for these fixtures
// (hidden 64, vocabulary 512) and N tokens on the rank: a two-stage pipeline sends each
// micro-batch's activations forward (stage 0) or their gradient back (stage 1), N x C floats in
// all; a tied embedding's gradient (its V/T vocabulary rows) is all-reduced over the embedding
// group of the two stages (ring: 2 (2-1)/2 of it); the gradient norm's sum is all-reduced over
// the stages (2 (2-1)/2 x 8 bytes). With V virtual stages per rank, rank s sends the
// activations of its chunks but the very last (V, or V - 1 on the last rank) and the
// gradients of its chunks but the very first (V, or V - 1 on rank 0): 2 V - 1 of N x C floats
// on each rank of two.
int64_t analytic_pp_bytes(const Case& c, int64_t N, int64_t stage) {
  const int64_t C = 64;
  const bool tied = c.model == "qwen3-tiny";  // llama-tiny and qwen2-swa-yarn-tiny have an lm_head
  const int64_t sends = (c.vpp - (stage == c.pp - 1)) + (c.vpp - (stage == 0));
  return sends * N * C * 4 + (tied ? kLayoutVocab / c.tp * C * 4 : 0) + 8;
}

// A Llama of four layers for the virtual stages (the fixtures have at most three): llama-tiny's
// two layers, then both again scaled by 0.9.
const std::string& four_layer_llama() {
  static const std::string dir = doubled_layers_model("llama-tiny", "pp_llama4");
  return dir;
}

// The model a case loads: a fixture, or "llama-4-layers" (four_layer_llama).
std::string model_of(const Case& c) { return c.model == "llama-4-layers" ? four_layer_llama() : c.model; }

class PipelineParallel : public ::testing::TestWithParam<Case> {};

// This rank's place in Megatron's order (tp fastest, then dp, pp slowest): its data-parallel
// rank's share of the global batch.
Share share_of(const Case& c) {
  const int dp = int(world().size() / (c.tp * c.pp));
  return Share(dp, int(world().rank() / c.tp) % dp);
}

// The MoE cases run at np 2 only (CI time): under data parallelism the ranks' micro-batches are
// not the reference's, so the busiest expert's share would not compare.
bool fits(const Case& c) { return world().size() % (c.tp * c.pp) == 0 && (!is_moe(c) || world().size() == c.tp * c.pp); }

TEST_P(PipelineParallel, MatchesOneRank) {
  const Case c = GetParam();
  const int N = world().size();
  if (!fits(c)) GTEST_SKIP() << c.label() << " on " << N << " ranks";
  const Share p = share_of(c);
  const SgdComparison r = compare_sgd_step(model_of(c), sgd_config(c, true), sgd_config(c, false), *p.global, *p.mine,
                                           p.first, c.label());
  const Outcome& pp = r.got;
  EXPECT_EQ(pp.metrics["dp_size"].get<int>(), p.dp);
  // The loss callback's metrics reach every stage (the loss itself is checked above).
  EXPECT_TRUE(pp.metrics.contains("metrics")) << c.label();
  const int64_t bytes = pp.metrics["pp/comm_bytes"].get<int64_t>();
  const int64_t stage = world().rank() / (c.tp * p.dp);  // Megatron's order: pp slowest
  EXPECT_EQ(bytes, analytic_pp_bytes(c, p.mine->num_tokens(), stage)) << c.label();
  // MoE: the auxiliary losses and the busiest expert's share, from the stages' layers together,
  // are one rank's (the same micro-batches: summed in another order).
  std::string moe_line;
  if (is_moe(c)) {
    std::vector<std::string> keys = {"moe/max_expert_load"};
    if (c.model == "qwen3-moe-tiny") keys.insert(keys.end(), {"moe/aux_loss", "moe/z_loss"});
    moe_line = expect_moe_metrics(pp.metrics, r.ref.metrics, keys, 1e-6, c.label());
  }
  if (world().rank() == 0)
    std::cout << "[np " << N << "] " << c.label() << ": " << sgd_summary(r) << ", pp bytes/step " << bytes << " (analytic "
              << analytic_pp_bytes(c, p.mine->num_tokens(), stage) << ")" << moe_line << "\n";
}

TEST_P(PipelineParallel, AdamWStepsFollowOneRank) {
  const Case c = GetParam();
  const int N = world().size();
  if (!fits(c)) GTEST_SKIP() << c.label() << " on " << N << " ranks";
  const Share p = share_of(c);
  const AdamComparison r =
      compare_adamw_steps(model_of(c), adam_config(c, true, 2e-3), adam_config(c, false, 2e-3), *p.global, *p.mine, c.label());
  // Each stage holds its layers and its global tensors only: less than one rank's model.
  EXPECT_LT(r.state, r.ref_state) << c.label();
  if (world().rank() == 0) std::cout << "[np " << N << "] " << c.label() << ": " << adam_summary(r) << "\n";
}

// Log p at given ids (K per token, some -1) and top-k processed logprobs, forward only on the
// whole batch: the last stage's outputs reach every rank.
TEST_P(PipelineParallel, LogprobAtIdsAndTopKMatchOneRank) {
  const Case c = GetParam();
  if (!fits(c)) GTEST_SKIP() << c.label() << " on " << world().size() << " ranks";
  auto g = layout_batch();
  std::vector<rlh_output_spec> more;
  if (c.tp == 1) more.push_back(spec(RLH_OUTPUT_LOGPROB, "topk", 1.3, 5));  // needs the whole vocabulary: not with TP
  for (const double err : at_ids_differences(model_of(c), sgd_config(c, true), sgd_config(c, false), *g, kLayoutVocab, more))
    EXPECT_LE(err, 2e-5) << c.label();
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
  // MoE under PP: Qwen3-MoE's two MoE layers one per stage, with the auxiliary losses; and
  // DeepSeek-V3 (MLA attention, a dense first layer, sigmoid group-limited routing, shared
  // experts) split 2 + 1, so both stages hold an MoE layer. np 2 only (as PP 2 x DP 2 at np 4
  // is the dense cases' business).
  v.push_back({"qwen3-moe-tiny", 1, 2, false, false});
  v.push_back({"qwen3-moe-tiny", 1, 2, true, true});
  v.push_back({"deepseek-v3-tiny", 1, 2, true, false, 2});
  // Interleaved virtual stages: four layers in four chunks, two per rank (rank 0 layers 0 and 2,
  // rank 1 layers 1 and 3), four micro-batches through Megatron's interleaved order; at np 4
  // also with DP 2 (two micro-batches per replica).
  v.push_back({"llama-4-layers", 1, 2, false, true, 1, 2});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Pp, PipelineParallel, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return test_name(info.param.label()); });

// A value head (a reward model's score.weight, initialised from the fixed seed) is the last
// stage's: its values reach every stage, and one SGD step of a squared error on them gives one
// rank's loss and gradients (4 micro-batches through the 1F1B schedule).
TEST(PipelineParallelValueHead, RewardModelMatchesOneRank) {
  if (world().size() != 2) GTEST_SKIP() << "np 2 only";
  const Case c{"llama-tiny", 1, 2, false, false};
  auto g = layout_batch();
  Backend::TrainOptions o;
  o.specs = {spec(RLH_OUTPUT_VALUE, "v")};
  o.micro_batch_seqs = 2;
  const Backend::LossBody loss = [](const rlh_microbatch& mb) {
    float* gv = nullptr;
    const float* v = output(mb, "v", &gv);
    const double n = double(mb.global_num_tokens);
    double l = 0;
    for (int64_t t = 0; t < mb.batch->seq_offsets[mb.batch->num_seqs]; ++t) {
      const double d = double(v[t]) - 0.25 * double(t % 5);
      l += d * d / n;
      gv[t] = float(2 * d / n);
    }
    return l;
  };
  const auto run = [&](const json& cfg) {
    Backend be(host(), "megatron", cfg);
    rlh_model* m = be.load(model_path(c.model), true, "reward_model");
    return step_outcome(be, m, *g, g->num_tokens(), g->num_seqs(), {spec(RLH_OUTPUT_VALUE, "v")}, loss, o);
  };
  Outcome ref;  // its logprobs: the values
  {
    Alone alone;
    ref = run(sgd_config(c, true));
  }
  const Outcome got = run(sgd_config(c, false));
  ASSERT_EQ(got.logprobs.size(), ref.logprobs.size());
  const double v_err = max_abs_diff(got.logprobs, ref.logprobs);
  EXPECT_LE(v_err, 2e-5);
  EXPECT_GT(ref.loss, 0);
  ASSERT_TRUE(ref.grads.count("score.weight") && got.grads.count("score.weight"));
  const double g_err = expect_step_matches(got, ref, "reward model pp2");
  if (world().rank() == 0)
    std::cout << "[np 2] reward model pp2: values within " << v_err << ", loss " << got.loss << " vs " << ref.loss
              << ", gradients within " << g_err << " (relative to the largest)\n";
}

// A state saved under PP is one rank's files (HF layout, every tensor); it loads on one rank into
// the same weights and continues; one rank's state loads back under PP bitwise.
TEST(PipelineParallelCheckpoints, SavedUnderPpLoadsOnOneRankAndBack) {
  const int N = world().size(), R = world().rank();
  const Case c{"qwen3-tiny", 1, 2, false, true};
  const int dp = int(N / c.pp);
  checkpoint_round_trip(c.model, adam_config(c, false, 5e-3), adam_config(c, true, 5e-3), dp, R % dp, "pp",
                        layout_batch());
}

TEST(PipelineParallelErrors, RefusedByName) {
  const int N = world().size();
  expect_load_error({{"megatron_cfg", {{"pipeline_model_parallel_size", 2}, {"num_layers_in_first_pipeline_stage", 2}}}},
                    "llama-tiny", RLH_E_UNIMPLEMENTED,
                    "pipeline_model_parallel_size = 2: the layers do not split over the stages (2 layers, "
                    "num_layers_in_first_pipeline_stage = 2: 0 left for 1 stages)");
  if (N == 4)
    expect_load_error({{"megatron_cfg", {{"pipeline_model_parallel_size", 4}}}}, "llama-tiny", RLH_E_UNIMPLEMENTED,
                      "pipeline_model_parallel_size = 4: the layers do not split over the stages (2 layers: 2 left for 4 stages)");
  expect_load_error({{"megatron_cfg", {{"pipeline_model_parallel_size", N + 1}}}}, "llama-tiny", RLH_E_INVALID_ARGUMENT,
                    "pipeline_model_parallel_size = " + std::to_string(N + 1) + ": megatron: parallel sizes: world size");
  {
    Alone alone;
    expect_load_error({{"megatron_cfg", {{"pipeline_model_parallel_size", 2}}}}, "llama-tiny", RLH_E_INVALID_ARGUMENT,
                      "pipeline_model_parallel_size = 2 needs a multiple of 2 launched ranks");
  }
  expect_create_error({{"megatron_cfg", {{"virtual_pipeline_model_parallel_size", 2}}}}, RLH_E_INVALID_ARGUMENT,
                      "virtual_pipeline_model_parallel_size: set to 2 needs megatron_cfg.pipeline_model_parallel_size > 1, got 1");
  // Megatron's rules for virtual stages: the layers split evenly into P x V chunks (no
  // first/last counts), the micro-batches a multiple of P.
  const json vpp = {{"pipeline_model_parallel_size", 2}, {"virtual_pipeline_model_parallel_size", 2}};
  expect_load_error({{"megatron_cfg", vpp}}, "llama-tiny", RLH_E_UNIMPLEMENTED,
                    "policy.megatron_cfg.virtual_pipeline_model_parallel_size = 2: the 2 layers do not split into "
                    "policy.megatron_cfg.pipeline_model_parallel_size x policy.megatron_cfg.virtual_pipeline_model_parallel_size "
                    "= 4 model chunks");
  {
    json mc = vpp;
    mc["num_layers_in_first_pipeline_stage"] = 2;
    expect_load_error({{"megatron_cfg", mc}}, four_layer_llama(), RLH_E_UNIMPLEMENTED,
                      "virtual_pipeline_model_parallel_size = 2: num_layers_in_first_pipeline_stage / "
                      "num_layers_in_last_pipeline_stage with interleaved virtual stages are not implemented");
  }
  if (N == 2) {
    json cfg = {{"megatron_cfg", vpp}, {"train_micro_batch_size", 3}};  // 8 sequences: 3 micro-batches
    Backend be(host(), "megatron", cfg);
    rlh_model* m = be.load(four_layer_llama(), true);
    auto g = layout_batch();
    Backend::TrainResult res;
    expect_error(be.try_train(m, *g, g->num_tokens(), g->num_seqs(), nll_loss(), {}, res), RLH_E_INVALID_ARGUMENT,
                 "virtual_pipeline_model_parallel_size = 2: the interleaved schedule needs a number of micro-batches "
                 "divisible by policy.megatron_cfg.pipeline_model_parallel_size = 2, got 3 micro-batches");
  }
  {  // the stages of a pipeline given different batches (a loop sharding over every rank)
    Backend be(host(), "megatron", {{"megatron_cfg", {{"pipeline_model_parallel_size", 2}}}});
    rlh_model* m = be.load(model_path("llama-tiny"), false);
    auto g = layout_batch();
    auto mine = shard_of(*g, world().rank(), N);
    std::vector<std::vector<float>> out;
    expect_error(be.try_forward(m, *mine, {spec(RLH_OUTPUT_LOGPROB_RAW, "lp")}, out), RLH_E_INVALID_ARGUMENT,
                 "forward: the ranks of a pipeline-parallel group were given different batches");
  }
}

}  // namespace

int main(int argc, char** argv) { return run_mpi_tests(argc, argv, {"model_llama", "kernels_cpu", "megatron", "comm_mpi"}); }
