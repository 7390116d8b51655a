// Context and sequence parallelism for the megatron backend on CPU ranks, under `mpirun -np N`
// (ctest: N = 2 and 4, one BLAS thread per rank). Every rank also computes the one-rank reference
// in-process (a backend that loads its model with the launcher's variables hidden, so it sees one
// rank).
//
//   - CP 2 (np 2), CP 2 x TP 2, CP 2 x DP 2 and CP 4 (np 4) give the reference's logprobs,
//     entropy, loss, gradient norm and every gradient (one SGD step at lr 1 without clipping:
//     w - w' = g) within fp32 tolerance, on a Llama (untied head, GQA), a Qwen3 (tied embedding,
//     q/k norms) and a Qwen2 with sliding windows on two of its three layers, q/k/v biases and
//     YaRN RoPE, with a loss that reads logprobs and entropy at temperature 0.7, packing on and
//     off, DDP and the distributed optimizer;
//   - sequence parallelism (TP 2 + SP at np 2; TP 2 x DP 2 + SP, TP 2 x CP 2 + SP and TP 4 + SP at
//     np 4) gives the same, so the same as tensor parallelism without it;
//   - the cp group's and the tp group's bytes per step equal the analytic counts;
//   - two AdamW steps with clipping follow the reference;
//   - refusals name the setting: a CP size that does not divide the ranks, CP on one rank, an
//     MoE model, CP with policy.device = cuda, logits and logprob_at_ids under CP, a cp group
//     given different batches.
#include <cstdlib>
#include <iostream>

#include "backend_harness.hpp"
#include "model_parallel_checks.hpp"
#include "mpi_harness.hpp"

using namespace rlh;
using namespace rlh::test;
using json = nlohmann::json;

namespace {

constexpr int32_t kVocab = 512;
const std::vector<int64_t> kLengths = {9, 14, 3, 11, 17, 6, 2, 12};
std::unique_ptr<Batch> global_batch() { return random_batch(kLengths, kVocab, 31); }

struct Case {
  std::string model;
  int64_t tp, cp;
  bool packing;
  bool distributed_optimizer;
  bool sp = false;  // sequence_parallel
  std::string label() const {
    return model + " cp" + std::to_string(cp) + " tp" + std::to_string(tp) + (sp ? " sp" : "") +
           (distributed_optimizer ? " distopt" : " ddp") + (packing ? " packed" : "");
  }
};

json base_config(const Case& c, bool one_rank) {
  json cfg = {{"megatron_cfg",
               {{"tensor_model_parallel_size", one_rank ? 1 : c.tp},
                {"context_parallel_size", one_rank ? 1 : c.cp},
                {"sequence_parallel", !one_rank && c.sp}}}};
  set_batching(cfg, c.packing);
  return cfg;
}
json sgd_config(const Case& c, bool one_rank) { return with_sgd(base_config(c, one_rank), c.distributed_optimizer); }
json adam_config(const Case& c, bool one_rank, double lr) {
  return with_adam(base_config(c, one_rank), lr, c.distributed_optimizer);
}

// The cp group's traffic of one train step, as a ring moves it ((S-1)/S of each all-gather's
// output and each reduce-scatter's input), for a rank whose sequences have lengths n_s. Each
// sequence is padded to a multiple of 2 cp, so a rank holds R = sum_s 2 ceil(n_s / 2cp) rows,
// however the sequences are cut into micro-batches. Per layer its k and v ([R, kv D] each, kv
// the rank's kv heads) are all-gathered in the forward and again in the backward, and their
// gradients reduce-scattered; the head's outputs (logprob and entropy: one float per row each)
// are all-gathered once: 4 (cp-1) R [3 L 2 kv D + 2] bytes.
//
// Rows: without context parallelism a sequence is one chunk (cp = 1 below); under sequence
// parallelism every chunk is a multiple of tp rows (NeMo-RL pads each sequence to a multiple of
// 2 cp tp, of tp without cp).
int64_t rows_of(const Case& c, const Batch& mine) {
  const int64_t pieces = c.cp > 1 ? 2 * c.cp : 1, q = c.sp ? c.tp : 1;
  int64_t R = 0;
  for (int64_t s = 0; s < mine.num_seqs(); ++s) {
    const int64_t n = mine.offsets()[size_t(s) + 1] - mine.offsets()[size_t(s)];
    R += pieces / c.cp * ((n + pieces * q - 1) / (pieces * q) * q);
  }
  return R;
}
int64_t fixture_layers(const Case& c) { return c.model == "qwen2-swa-yarn-tiny" ? 3 : 2; }
int64_t fixture_head_dim(const Case& c) { return c.model == "qwen3-tiny" ? 32 : 16; }
int64_t analytic_cp_bytes(const Case& c, const Batch& mine) {
  const int64_t L = fixture_layers(c), D = fixture_head_dim(c), kv = std::max<int64_t>(2 / c.tp, 1);
  return 4 * (c.cp - 1) * rows_of(c, mine) * (3 * L * 2 * kv * D + 2);
}

// The tp group's traffic of one train step (test_backend_tp.cpp's count, over this rank's R
// rows): 2 (T-1)/T x 4 bytes x [(2 + 4 L) R C + 4 R + shared gradients] + the two gradient-norm
// sums. Under sequence parallelism each all-reduce of [R, C] is a reduce-scatter or an
// all-gather of (T-1)/T of it, two of them for each all-reduce they replace (the embedding and
// the row-parallel outputs scattered, the column-parallel inputs and the head's gathered,
// and back in the backward): the same bytes; and the norms' gradients ((2 L + 1) C) are
// shared.
int64_t analytic_tp_bytes(const Case& c, const Batch& mine) {
  const int64_t C = 64, L = fixture_layers(c), T = c.tp, D = fixture_head_dim(c), kv = 2, R = rows_of(c, mine);
  if (T == 1) return 0;
  int64_t floats = (2 + 4 * L) * R * C + 4 * R;
  if (c.model == "qwen3-tiny") floats += L * 2 * D;
  if (T > kv) floats += L * 2 * kv * D * C;
  if (c.sp) floats += (2 * L + 1) * C;
  return 2 * floats * 4 * (T - 1) / T + 2 * (2 * 8 * (T - 1) / T);
}

// This rank's place: world rank = tp rank + tp (cp rank + cp dp rank) (Megatron's order); every
// rank of a data-parallel rank's tp x cp block takes that rank's share of the global batch.
struct Place {
  int dp = 1, dp_rank = 0;
  std::unique_ptr<Batch> global, mine;
  int64_t tokens = 0, seqs = 0, first = 0;
  explicit Place(const Case& c) {
    const int block = int(c.tp * c.cp);
    dp = world().size() / block;
    dp_rank = world().rank() / block;
    global = global_batch();
    tokens = global->num_tokens();
    seqs = global->num_seqs();
    mine = shard_of(*global, dp_rank, dp, &first);
  }
};

bool runs_here(const Case& c) { return world().size() % (c.tp * c.cp) == 0; }

class ContextParallel : public ::testing::TestWithParam<Case> {};

TEST_P(ContextParallel, MatchesOneRank) {
  const Case c = GetParam();
  if (!runs_here(c)) GTEST_SKIP() << c.label() << " on " << world().size() << " ranks";
  Place p(c);
  Outcome ref;
  {
    Alone alone;
    Backend be(host(), "megatron", sgd_config(c, true));
    rlh_model* m = be.load(model_path(c.model), true);
    ref = run_sgd_step(be, m, *p.global, p.tokens, p.seqs);
  }
  Backend be(host(), "megatron", sgd_config(c, false));
  rlh_model* m = be.load(model_path(c.model), true);
  const Outcome cp = run_sgd_step(be, m, *p.mine, p.tokens, p.seqs);
  if (c.cp > 1) EXPECT_EQ(cp.metrics["cp_size"].get<int>(), c.cp);
  ASSERT_EQ(int64_t(cp.logprobs.size()), p.mine->num_tokens());
  double lp_err = 0, ent_err = 0;
  for (size_t t = 0; t < cp.logprobs.size(); ++t) {
    lp_err = std::max(lp_err, std::fabs(double(cp.logprobs[t]) - double(ref.logprobs[size_t(p.first) + t])));
    ent_err = std::max(ent_err, std::fabs(double(cp.entropy[t]) - double(ref.entropy[size_t(p.first) + t])));
  }
  EXPECT_LE(lp_err, 2e-5) << c.label();
  EXPECT_LE(ent_err, 2e-5) << c.label();
  EXPECT_NEAR(cp.loss, ref.loss, 1e-5 * std::fabs(ref.loss)) << c.label();
  EXPECT_NEAR(cp.grad_norm, ref.grad_norm, 1e-4 * ref.grad_norm) << c.label();
  ASSERT_EQ(cp.grads.size(), ref.grads.size()) << c.label();
  const double gerr = max_rel_diff(cp.grads, ref.grads);
  EXPECT_LE(gerr, 1e-4) << c.label();
  const int64_t bytes = cp.metrics.value("cp/comm_bytes", int64_t(0)), analytic = analytic_cp_bytes(c, *p.mine);
  EXPECT_EQ(bytes, analytic) << c.label();
  const int64_t tp_bytes = cp.metrics["tp/comm_bytes"].get<int64_t>(), tp_analytic = analytic_tp_bytes(c, *p.mine);
  EXPECT_EQ(tp_bytes, tp_analytic) << c.label();
  if (world().rank() == 0)
    std::cout << "[np " << world().size() << "] " << c.label() << ": loss " << cp.loss << " vs " << ref.loss
              << ", grad norm " << cp.grad_norm << " vs " << ref.grad_norm << ", gradients within " << gerr
              << " (relative to the largest), logprobs within " << lp_err << ", entropy within " << ent_err
              << ", cp bytes/step " << bytes << " (analytic " << analytic << "), tp bytes/step " << tp_bytes
              << " (analytic " << tp_analytic << ")\n";
}

TEST_P(ContextParallel, AdamWStepsFollowOneRank) {
  const Case c = GetParam();
  if (!runs_here(c)) GTEST_SKIP() << c.label() << " on " << world().size() << " ranks";
  Place p(c);
  std::vector<double> ref_loss;
  Weights ref_w;
  {
    Alone alone;
    Backend be(host(), "megatron", adam_config(c, true, 2e-3));
    rlh_model* m = be.load(model_path(c.model), true);
    for (int s = 0; s < 2; ++s) ref_loss.push_back(be.train(m, *p.global, p.tokens, p.seqs, nll_loss(), {}).r.loss);
    ref_w = be.weights(m);
  }
  Backend be(host(), "megatron", adam_config(c, false, 2e-3));
  rlh_model* m = be.load(model_path(c.model), true);
  for (int s = 0; s < 2; ++s) {
    const auto r = be.train(m, *p.mine, p.tokens, p.seqs, nll_loss(), {});
    EXPECT_NEAR(r.r.loss, ref_loss[size_t(s)], 2e-5 * std::fabs(ref_loss[size_t(s)])) << c.label() << " step " << s;
  }
  // AdamW divides by sqrt(v): where a gradient is ~0 its rounding decides the step's sign, so
  // weights agree to a few lr, not to fp32 (as for data and tensor parallelism).
  const Weights w = be.weights(m);
  double worst = 0;
  for (const auto& [k, v] : ref_w)
    for (size_t i = 0; i < v.size(); ++i) worst = std::max(worst, std::fabs(double(w.at(k)[i]) - double(v[i])));
  EXPECT_LE(worst, 2 * 2 * 2e-3) << c.label();
  if (world().rank() == 0)
    std::cout << "[np " << world().size() << "] " << c.label() << ": 2 AdamW steps, weights within " << worst << "\n";
}

std::vector<Case> cases() {
  return {
      {"llama-tiny", 1, 2, true, true},            // np 2: CP 2; np 4: CP 2 x DP 2
      {"llama-tiny", 1, 2, false, false},
      {"qwen3-tiny", 1, 2, true, false},
      {"qwen3-tiny", 1, 2, false, true},
      {"qwen2-swa-yarn-tiny", 1, 2, true, false},  // sliding windows, biases, YaRN
      {"llama-tiny", 2, 2, true, true},            // np 4: CP 2 x TP 2
      {"qwen3-tiny", 2, 2, false, false},
      {"llama-tiny", 1, 4, false, true},           // np 4: CP 4
      {"llama-tiny", 2, 1, true, true, true},      // np 2: TP 2 + SP; np 4: TP 2 x DP 2 + SP
      {"qwen3-tiny", 2, 1, false, false, true},
      {"llama-tiny", 2, 2, true, false, true},     // np 4: TP 2 x CP 2 + SP
      {"qwen3-tiny", 2, 2, false, true, true},
      {"llama-tiny", 4, 1, false, true, true},     // np 4: TP 4 + SP (kv heads replicated)
  };
}

INSTANTIATE_TEST_SUITE_P(Cp, ContextParallel, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return test_name(info.param.label()); });

TEST(ContextParallelErrors, RefusedByName) {
  const int N = world().size();
  const json cp2 = {{"megatron_cfg", {{"context_parallel_size", 2}}}};
  auto load_error = [&](const json& cfg, const std::string& model, rlh_code code, const std::string& part) {
    Backend be(host(), "megatron", cfg);
    rlh_model* m = nullptr;
    expect_error(be.try_load(model_path(model), true, &m), code, part);
  };
  load_error(cp2, "qwen3-moe-tiny", RLH_E_UNIMPLEMENTED,
             "engine under context parallelism: layer 0: mixture-of-experts layers are not supported");
  load_error({{"megatron_cfg", {{"context_parallel_size", N + 1}}}}, "llama-tiny", RLH_E_INVALID_ARGUMENT,
             "context_parallel_size = " + std::to_string(N + 1) + ": megatron: parallel sizes: world size");
  {
    json cfg = cp2;
    cfg["device"] = "cuda";
    load_error(cfg, "llama-tiny", RLH_E_UNIMPLEMENTED,
               "policy.device = cuda: context parallelism (context_parallel_size = 2) runs on the CPU engine only");
  }
  {
    Alone alone;
    load_error(cp2, "llama-tiny", RLH_E_INVALID_ARGUMENT,
               "context_parallel_size = 2 needs a multiple of 2 launched ranks");
  }
  {  // with pipeline parallelism: neither splitting the rows nor the stage calls carry the other
    auto create_error = [](const json& mcfg, const std::string& part) {
      rlh_backend* b = nullptr;
      const std::string cfg = json({{"megatron_cfg", mcfg}}).dump();
      expect_error(host().backend("megatron")->create(host().services(), cfg.data(), cfg.size(), &b),
                   RLH_E_UNIMPLEMENTED, part);
    };
    create_error({{"context_parallel_size", 2}, {"pipeline_model_parallel_size", 2}},
                 "policy.megatron_cfg.context_parallel_size = 2 with policy.megatron_cfg.pipeline_model_parallel_size = 2: "
                 "context and sequence parallelism are not implemented together with pipeline parallelism");
    create_error({{"tensor_model_parallel_size", 2}, {"sequence_parallel", true}, {"pipeline_model_parallel_size", 2}},
                 "policy.megatron_cfg.sequence_parallel = true with policy.megatron_cfg.pipeline_model_parallel_size = 2");
  }
  {
    rlh_backend* b = nullptr;
    const std::string cfg = json({{"dtensor_cfg", {{"context_parallel_size", 2}}}}).dump();
    expect_error(host().backend("dtensor")->create(host().services(), cfg.data(), cfg.size(), &b), RLH_E_UNIMPLEMENTED,
                 "policy.dtensor_cfg.context_parallel_size = 2: only data parallelism");
  }
  Backend be(host(), "megatron", cp2);
  rlh_model* m = be.load(model_path("llama-tiny"), false);
  auto g = global_batch();
  std::vector<std::vector<float>> out;
  {  // the ranks of a cp group given different batches (a loop sharding over every rank)
    auto mine = shard_of(*g, world().rank(), N);
    expect_error(be.try_forward(m, *mine, {spec(RLH_OUTPUT_LOGPROB_RAW, "lp")}, out), RLH_E_INVALID_ARGUMENT,
                 "forward: the ranks of a context-parallel group were given different batches");
  }
  if (N == 2) {  // one cp group: every rank fails alike
    constexpr int64_t K = 2;
    std::vector<int32_t> ids(size_t(g->num_tokens() * K), 1);
    g->add("ids", ids, rlh_dtype{RLH_DTYPE_INT, 32, 1}, K);
    expect_error(be.try_forward(m, *g, {spec(RLH_OUTPUT_LOGPROB_AT_IDS, "at", 1.0, 0, 1.0, "ids")}, out, 0, {K}),
                 RLH_E_INVALID_ARGUMENT,
                 "logprob_at_ids and routing records are not outputs under context or sequence parallelism");
  }
}

}  // namespace

int main(int argc, char** argv) {
  return run_mpi_tests(argc, argv, {"model_llama", "kernels_cpu", "megatron", "dtensor", "comm_mpi"});
}
