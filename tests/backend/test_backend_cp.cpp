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
//   - the same on an MoE model (qwen3-moe-tiny: softmax top-2 of 8 with the load-balancing loss,
//     per micro-batch without packing or per sequence with it, and the z-loss) and on an MLA one
//     (deepseek-v3-tiny: MLA attention, a dense first layer, the float64 sigmoid router with
//     grouped top-k and a selection bias, a shared expert), at CP 2,
//     CP 2 x DP 2, CP 2 x TP 2 and CP 4 (and at CP 2 with activation checkpointing), with the
//     auxiliary losses (and, without packing, the busiest expert's load) as the reference's;
//   - expert parallelism over the cp x dp ranks (CP 2 x EP 2 at np 2; CP 2 x DP 2 x EP 2 and
//     CP 2 x EP 4 at np 4; an ep group with an idle cp group), pipeline stages over cp groups
//     (CP 2 x PP 2 at np 4, with the pp bytes; TP 2 x CP 2 x PP 2 at np 8, run by hand) on
//     dense, tied and MoE models give the same;
//   - sequence parallelism (TP 2 + SP at np 2; TP 2 x DP 2 + SP, TP 2 x CP 2 + SP and TP 4 + SP at
//     np 4) gives the same, so the same as tensor parallelism without it; over pipeline stages too
//     (TP 2 x PP 2 + SP at np 4: each boundary carries the rank's block of rows);
//   - expert parallelism with tensor parallelism (expert_tensor_parallel_size 1 under SP: TP 2 x
//     EP 2 at np 2; TP 2 x DP 2 x EP 2 / 4, TP 2 x CP 2 x EP 2 and TP 2 x EP 2 x PP 2 at np 4) and
//     within pipeline stages (PP 2 x DP 2 x EP 2 at np 4, also with one replica idle) gives the
//     same, with the tp bytes of the MoE blocks that route their own rows;
//   - the cp group's and the tp group's bytes per step equal the analytic counts;
//   - two AdamW steps with clipping follow the reference;
//   - on the engine under CP: the routing record is the one-rank engine's in the caller's token
//     order, replaying another routing gives the one-rank engine's outputs under it;
//   - refusals name the setting: a CP size that does not divide the ranks, CP on one rank, CP with
//     policy.device = cuda, logits and logprob_at_ids under CP, a cp group given different
//     batches.
#include <cstdlib>
#include <iostream>

#include "backend_harness.hpp"
#include "engine_under_mpi.hpp"
#include "model_parallel_checks.hpp"
#include "mpi_harness.hpp"
#include "rlhost/backend_common/context_parallel.hpp"

using namespace rlh;
using namespace rlh::test;
using json = nlohmann::json;

namespace {

struct Case {
  std::string model;
  int64_t tp, cp;
  bool packing;
  bool distributed_optimizer;
  bool sp = false;         // sequence_parallel
  bool recompute = false;  // activation_checkpointing (reference and layout)
  int64_t ep = 1;          // expert_model_parallel_size (carved from the cp x dp ranks)
  int64_t pp = 1;          // pipeline_model_parallel_size (stages of the layers split evenly)
  int64_t etp = 1;         // expert_tensor_parallel_size with ep and tp: 1 or tp
  std::string label() const {
    return model + " cp" + std::to_string(cp) + " tp" + std::to_string(tp) + (ep > 1 ? " ep" + std::to_string(ep) : "") +
           (etp > 1 ? " etp" + std::to_string(etp) : "") +
           (pp > 1 ? " pp" + std::to_string(pp) : "") +
           (sp ? " sp" : "") +
           (distributed_optimizer ? " distopt" : " ddp") + (packing ? " packed" : "") + (recompute ? " recompute" : "");
  }
};

// A fixture's folder: tests/fixtures, or tests/engine/fixtures for gemma2-tiny (Gemma-2's
// soft-capping of the attention scores and of the logits, windows, tied).
std::string fixture(const std::string& model) {
  return model == "gemma2-tiny" ? std::string(RLH_ENGINE_FIXTURES_DIR) + "/" + model : model_path(model);
}

bool is_moe(const Case& c) { return c.model == "qwen3-moe-tiny" || c.model == "deepseek-v3-tiny"; }
int64_t fixture_layers(const Case& c) {
  if (c.model == "gemma2-tiny") return 4;
  return c.model == "qwen2-swa-yarn-tiny" || c.model == "deepseek-v3-tiny" ? 3 : 2;
}

// The softmax router (qwen3-moe) trains with the load-balancing loss (per micro-batch without
// packing, per sequence with it) and the z-loss, as the tensor- and expert-parallel tests do; the
// sigmoid router (deepseek-v3, which the engine's auxiliary losses do not take) in float64.
bool has_aux_losses(const Case& c) { return c.model == "qwen3-moe-tiny"; }
json base_config(const Case& c, bool one_rank) {
  json cfg = {{"megatron_cfg",
               {{"tensor_model_parallel_size", one_rank ? 1 : c.tp},
                {"context_parallel_size", one_rank ? 1 : c.cp},
                {"sequence_parallel", !one_rank && c.sp}}}};
  json& mc = cfg["megatron_cfg"];
  if (!one_rank && c.ep > 1) mc["expert_model_parallel_size"] = c.ep;
  if (!one_rank && c.ep > 1 && c.tp > 1) mc["expert_tensor_parallel_size"] = c.etp;
  if (!one_rank && c.pp > 1) mc["pipeline_model_parallel_size"] = c.pp;
  if (!one_rank && c.pp == 2 && fixture_layers(c) == 3) mc["num_layers_in_first_pipeline_stage"] = 2;  // 2 + 1
  if (has_aux_losses(c)) {
    set_moe_aux_losses(mc, c.packing);
  } else if (c.model == "deepseek-v3-tiny") {
    mc["moe_router_dtype"] = "fp64";
  }
  if (c.recompute) mc["activation_checkpointing"] = true;
  set_batching(cfg, c.packing);
  return cfg;
}
json sgd_config(const Case& c, bool one_rank) { return with_sgd(base_config(c, one_rank), c.distributed_optimizer); }
json adam_config(const Case& c, bool one_rank, double lr) {
  return with_adam(base_config(c, one_rank), lr, c.distributed_optimizer);
}

// The cp group's traffic of one train step, as a ring moves it ((S-1)/S of each all-gather's
// output and each reduce-scatter's input, 2 (S-1)/S of each all-reduce), for a rank whose
// sequences have lengths n_s. Each sequence is padded to a multiple of 2 cp, so a rank holds
// R = sum_s 2 ceil(n_s / 2cp) rows, however the sequences are cut into micro-batches. Per layer
// its k and v ([R, wk] and [R, wv]: the rank's kv heads times their dims; MLA's per head after
// kv_b) are all-gathered in the forward and again in the backward, and their gradients
// reduce-scattered; the head's outputs (logprob and entropy: one float per row each) are
// all-gathered once: 4 (cp-1) R [3 L (wk + wv) + 2] bytes. An MoE model adds, per MoE layer and
// micro-batch, its routing counts (E doubles, or E per sequence with seq_aux_loss) and, once a
// step, the two auxiliary losses' values (2 doubles), all-reduced. Activation checkpointing
// gathers k and v once more in each recomputed forward (4 L instead of 3 L); the recomputed MoE
// blocks reuse the forward's counts.
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
int64_t fixture_head_dim(const Case& c) { return c.model == "qwen3-tiny" || c.model == "qwen3-moe-tiny" ? 32 : 16; }
// k and v floats per row and layer on a rank: 2 kv heads (whole on each rank at tp 2), or
// deepseek-v3's 4 MLA heads of k (16 + 8) and v (16) split over tp.
int64_t kv_width(const Case& c) {
  if (c.model == "deepseek-v3-tiny") return 4 / c.tp * (24 + 16);
  return 2 * std::max<int64_t>(2 / c.tp, 1) * fixture_head_dim(c);
}
// `microbatches`: this rank's in the step.
// Under pipeline parallelism (layers split evenly over the stages) a stage gathers its own
// layers' k and v, the last stage the head's outputs, and the MoE counts of its MoE layers; a
// stage before the last runs each micro-batch's forward twice (forward_stage, whose output goes
// to the next stage, and backward_stage's, whose activations its backward reads): one more
// gather of k and v.
int64_t analytic_cp_bytes(const Case& c, const Batch& mine, int64_t microbatches) {
  const int64_t stage = world().rank() / (world().size() / c.pp), last = stage == c.pp - 1 ? 1 : 0;
  const int64_t passes = (c.recompute ? 4 : 3) + (c.pp > 1 && !last ? 1 : 0), layers = fixture_layers(c) / c.pp;
  int64_t bytes = 4 * (c.cp - 1) * rows_of(c, mine) * (passes * layers * kv_width(c) + 2 * last);
  if (is_moe(c)) {
    const int64_t moe_layers = 2 / c.pp, E = 8;
    const bool per_sequence = has_aux_losses(c) && c.packing;  // seq_aux_loss
    const int64_t doubles = moe_layers * E * (per_sequence ? mine.num_seqs() : microbatches) + 2;
    bytes += 2 * doubles * 8 * (c.cp - 1) / c.cp;
  }
  return bytes;
}

// The pipeline's bytes of one train step on a rank of a two-stage pipeline
// (test_backend_pp.cpp's count over this rank's rows of the cp split): each micro-batch's rows
// x C floats sent once (stage 0 its activations, stage 1 their gradients), a tied embedding's
// gradient all-reduced over the two stages' embedding group (ring: 2 (2-1)/2 of its V/T rows),
// and the gradient norm's sum over the stages (8 bytes).
// Under sequence parallelism a boundary carries this rank's block of the rows: 1/T of them.
int64_t analytic_pp_bytes(const Case& c, const Batch& mine) {
  const int64_t C = 64;
  const bool tied = c.model == "qwen3-tiny";
  return rows_of(c, mine) / (c.sp ? c.tp : 1) * C * 4 + (tied ? kLayoutVocab / c.tp * C * 4 : 0) + 8;
}

// How many micro-batches a rank cuts its share into: one rank's plan of the same share and
// batching settings (one SGD step on it, alone).
int64_t microbatches_of(const Case& c, Batch& mine) {
  Alone alone;
  Backend be(host(), "megatron", sgd_config(c, true));
  rlh_model* m = be.load(fixture(c.model), true);
  return be.train(m, mine, mine.num_tokens(), mine.num_seqs(), lp_ent_loss(), lp_ent_options())
      .metrics["num_micro_batches"]
      .get<int64_t>();
}

// The tp group's traffic of one train step (test_backend_tp.cpp's count, over this rank's R
// rows): 2 (T-1)/T x 4 bytes x [(2 + 4 L) R C + 4 R + shared gradients] + the two gradient-norm
// sums. Under sequence parallelism each all-reduce of [R, C] is a reduce-scatter or an
// all-gather of (T-1)/T of it, two of them for each all-reduce they replace (the embedding and
// the row-parallel outputs scattered, the column-parallel inputs and the head's gathered,
// and back in the backward): the same bytes; and the norms' gradients ((2 L + 1) C) are
// shared.
// MoE and MLA models add test_backend_tp.cpp's terms: per MoE layer the routing weights'
// gradient (top_k floats a row), and deepseek-v3's shared latent projections and their norms.
//
// Expert parallelism with tensor parallelism (etp 1, under SP): each MoE block routes this
// rank's rows only, so an MoE layer without a shared expert (qwen3-moe) neither gathers its
// input nor scatters its output (one all-reduce's worth less in the forward and the backward),
// a shared expert (deepseek-v3) keeps both; the routing weights' gradient is whole (not summed),
// the router's gradient (E x C per MoE layer) is; and the routing counts (as the cp count's
// doubles) and the two loss values are summed over the group. Activation checkpointing adds the
// recomputed forward's reductions: an attention block's gather and scatter (its output is
// rebuilt), a dense MLP's or an MoE block's gather only (the layer's last output is not rebuilt;
// the recomputed MoE block stops before its combine).
int64_t analytic_tp_bytes(const Case& c, const Batch& mine, int64_t microbatches) {
  const int64_t C = 64, L = fixture_layers(c), T = c.tp, D = fixture_head_dim(c), kv = 2, R = rows_of(c, mine);
  if (T == 1) return 0;
  const bool own = c.ep > 1 && c.etp == 1, shared = c.model == "deepseek-v3-tiny";
  const int64_t moe_layers = is_moe(c) ? 2 : 0, E = 8;
  const int64_t own_moe = own && !shared ? moe_layers : 0;  // MoE layers that neither gather nor scatter
  int64_t floats = (2 + 4 * L - 2 * own_moe) * R * C + 4 * R;
  if (c.recompute) {  // an attention's gather and scatter; a dense MLP's or an MoE block's gather
    const int64_t gathering_moe = moe_layers - own_moe;
    floats += (2 * L + (L - moe_layers) + gathering_moe) * R * C / 2;
  }
  if (is_moe(c) && !own) floats += 2 * 2 * R;  // 2 MoE layers, top 2
  if (own) floats += moe_layers * E * C;
  if (c.model == "qwen3-tiny" || c.model == "qwen3-moe-tiny") floats += L * 2 * D;
  if (c.model == "deepseek-v3-tiny") {
    const int64_t rq = 48, rkv = 32, dr = 8;
    floats += L * (rq * C + rq + (rkv + dr) * C + rkv);
  } else if (T > kv) {
    floats += L * 2 * kv * D * C;
  }
  if (c.sp) floats += (2 * L + 1) * C;
  int64_t doubles = 0;
  if (own) {
    const bool per_sequence = has_aux_losses(c) && c.packing;  // seq_aux_loss
    doubles = moe_layers * E * (per_sequence ? mine.num_seqs() : microbatches) + 2;
  }
  return 2 * floats * 4 * (T - 1) / T + 2 * (2 * 8 * (T - 1) / T) + 2 * doubles * 8 * (T - 1) / T;
}

// This rank's place: world rank = tp rank + tp (cp rank + cp dp rank) (Megatron's order); every
// rank of a data-parallel rank's tp x cp block takes that rank's share of the global batch.
Share share_of(const Case& c) {
  const int block = int(c.tp * c.cp), dp = world().size() / block / int(c.pp);
  return Share(dp, world().rank() / block % dp);
}

// Megatron's expert layout: etp x ep x edp x pp (etp: the case's with expert parallelism, else tp).
bool runs_here(const Case& c) {
  const int64_t etp = c.ep > 1 ? c.etp : c.tp;
  return world().size() % (c.tp * c.cp * c.pp) == 0 && world().size() / (etp * c.pp) % c.ep == 0;
}

class ContextParallel : public ::testing::TestWithParam<Case> {};

TEST_P(ContextParallel, MatchesOneRank) {
  const Case c = GetParam();
  if (!runs_here(c)) GTEST_SKIP() << c.label() << " on " << world().size() << " ranks";
  const Share p = share_of(c);
  const SgdComparison r =
      compare_sgd_step(fixture(c.model), sgd_config(c, true), sgd_config(c, false), *p.global, *p.mine, p.first, c.label());
  const Outcome& cp = r.got;
  if (c.cp > 1) {
    EXPECT_EQ(cp.metrics["cp_size"].get<int>(), c.cp);
  }
  // Under expert parallelism every row (padding included) of this rank crosses to its experts'
  // ranks: some bytes, whose count depends on the padding rows' routing (not counted here).
  if (c.ep > 1) {
    EXPECT_GT(cp.metrics.value("ep/comm_bytes", int64_t(0)), 0) << c.label();
  }
  const int64_t bytes = cp.metrics.value("cp/comm_bytes", int64_t(0));
  const int64_t microbatches = is_moe(c) ? microbatches_of(c, *p.mine) : 0;
  const int64_t analytic = analytic_cp_bytes(c, *p.mine, microbatches);
  EXPECT_EQ(bytes, analytic) << c.label();
  // (The tp count above is one model's, not a stage's: not compared under pipeline parallelism,
  // as test_backend_pp.cpp does not.)
  const int64_t tp_bytes = cp.metrics["tp/comm_bytes"].get<int64_t>(), tp_analytic = analytic_tp_bytes(c, *p.mine, microbatches);
  if (c.pp == 1) EXPECT_EQ(tp_bytes, tp_analytic) << c.label();
  if (c.pp > 1) {
    const int64_t pp_bytes = cp.metrics["pp/comm_bytes"].get<int64_t>();
    EXPECT_EQ(pp_bytes, analytic_pp_bytes(c, *p.mine)) << c.label();
  }
  if (is_moe(c)) {  // every rank's tokens' share, summed over the group: one rank's values
    std::vector<std::string> keys;
    if (has_aux_losses(c)) keys = {"moe/aux_loss", "moe/z_loss"};
    if (!c.packing) keys.push_back("moe/max_expert_load");  // a per-micro-batch maximum: packing cuts them otherwise
    expect_moe_metrics(cp.metrics, r.ref.metrics, keys, 1e-5, c.label());
  }
  if (world().rank() == 0)
    std::cout << "[np " << world().size() << "] " << c.label() << ": " << sgd_summary(r) << ", cp bytes/step " << bytes << " (analytic " << analytic << "), tp bytes/step " << tp_bytes
              << " (analytic " << tp_analytic << ")"
              << (c.pp > 1 ? ", pp bytes/step " + std::to_string(cp.metrics["pp/comm_bytes"].get<int64_t>()) : "")
              << "\n";
}

TEST_P(ContextParallel, AdamWStepsFollowOneRank) {
  const Case c = GetParam();
  if (!runs_here(c)) GTEST_SKIP() << c.label() << " on " << world().size() << " ranks";
  const Share p = share_of(c);
  // AdamW divides by sqrt(v): where a gradient is ~0 its rounding decides the step's sign, so
  // weights agree to a few lr, not to fp32 (as for data and tensor parallelism).
  const AdamComparison r = compare_adamw_steps(fixture(c.model), adam_config(c, true, 2e-3), adam_config(c, false, 2e-3),
                                               *p.global, *p.mine, c.label());
  if (world().rank() == 0) std::cout << "[np " << world().size() << "] " << c.label() << ": " << adam_summary(r) << "\n";
}

std::vector<Case> cases() {
  return {
      {"llama-tiny", 1, 2, true, true},            // np 2: CP 2; np 4: CP 2 x DP 2
      {"llama-tiny", 1, 2, false, false},
      {"qwen3-tiny", 1, 2, true, false},
      {"qwen3-tiny", 1, 2, false, true},
      {"qwen2-swa-yarn-tiny", 1, 2, true, false},  // sliding windows, biases, YaRN
      {"gemma2-tiny", 1, 2, true, false},          // soft-capped scores and logits, windows
      {"gemma2-tiny", 2, 2, false, true},          // np 4: CP 2 x TP 2
      {"llama-tiny", 2, 2, true, true},            // np 4: CP 2 x TP 2
      {"qwen3-tiny", 2, 2, false, false},
      {"llama-tiny", 1, 4, false, true},           // np 4: CP 4
      {"llama-tiny", 2, 1, true, true, true},      // np 2: TP 2 + SP; np 4: TP 2 x DP 2 + SP
      {"qwen3-tiny", 2, 1, false, false, true},
      {"llama-tiny", 2, 2, true, false, true},     // np 4: TP 2 x CP 2 + SP
      {"qwen3-tiny", 2, 2, false, true, true},
      {"llama-tiny", 4, 1, false, true, true},     // np 4: TP 4 + SP (kv heads replicated)
      {"qwen3-moe-tiny", 1, 2, true, false},       // MoE: np 2: CP 2; np 4: CP 2 x DP 2
      {"qwen3-moe-tiny", 1, 2, false, true},
      {"deepseek-v3-tiny", 1, 2, true, true},      // MLA, float64 router, shared expert
      {"deepseek-v3-tiny", 1, 2, false, false},
      {"qwen3-moe-tiny", 2, 2, false, false},      // np 4: CP 2 x TP 2
      {"deepseek-v3-tiny", 2, 2, true, true},
      {"qwen3-moe-tiny", 1, 4, true, true},        // np 4: CP 4
      {"deepseek-v3-tiny", 1, 4, false, false},
      {"qwen3-moe-tiny", 2, 1, true, false, true},     // np 2: TP 2 + SP; np 4: TP 2 x DP 2 + SP
      {"deepseek-v3-tiny", 2, 1, false, true, true},
      {"qwen3-moe-tiny", 2, 2, false, true, true},     // np 4: TP 2 x CP 2 + SP
      {"deepseek-v3-tiny", 2, 2, true, false, true},
      {"qwen3-moe-tiny", 1, 2, false, false, false, true},  // activation checkpointing
      {"deepseek-v3-tiny", 1, 2, true, true, false, true},
      // Expert parallelism over the cp x dp ranks (Megatron's expert layout: ep fastest over the
      // non-tp ranks): np 2: CP 2 x EP 2 (the ep group is the cp group); np 4: CP 2 x DP 2 x EP 2,
      // and EP 4 spanning both cp and dp ranks.
      {"qwen3-moe-tiny", 1, 2, false, false, false, false, 2},
      {"qwen3-moe-tiny", 1, 2, true, true, false, false, 2},
      {"deepseek-v3-tiny", 1, 2, true, false, false, false, 2},
      {"deepseek-v3-tiny", 1, 2, false, true, false, false, 4},
      {"qwen3-moe-tiny", 1, 2, true, false, false, false, 4},
      {"qwen3-moe-tiny", 1, 2, false, true, false, true, 2},  // with activation checkpointing
      // Expert parallelism with tensor parallelism (expert_tensor_parallel_size 1, sequence
      // parallelism: each tp rank dispatches its own rows; the ep group carved from the tp x cp x
      // dp ranks): np 2: TP 2 x EP 2 (the ep group is the tp group); np 4: TP 2 x DP 2 x EP 2
      // (expert dp 2), TP 2 x DP 2 x EP 4 and TP 2 x CP 2 x EP 2.
      {"qwen3-moe-tiny", 2, 1, false, false, true, false, 2},
      {"deepseek-v3-tiny", 2, 1, true, true, true, false, 2},
      {"qwen3-moe-tiny", 2, 1, true, true, true, true, 4},
      {"deepseek-v3-tiny", 2, 1, false, false, true, true, 4},
      {"qwen3-moe-tiny", 2, 2, false, true, true, false, 2},
      // ... and with expert_tensor_parallel_size = tp (np 4: TP 2 x DP 2 x EP 2, the experts cut over
      // the tp group, the ep group the ranks of one tp rank).
      {"qwen3-moe-tiny", 2, 1, false, true, true, false, 2, 1, 2},
      {"deepseek-v3-tiny", 2, 1, true, false, true, true, 2, 1, 2},
      // Pipeline stages over cp groups (np 4: CP 2 x PP 2): each boundary carries the rank's rows.
      {"llama-tiny", 1, 2, false, true, false, false, 1, 2},
      {"qwen3-tiny", 1, 2, true, false, false, false, 1, 2},   // tied embedding over the stages
      {"qwen3-moe-tiny", 1, 2, true, true, false, false, 1, 2},
      {"qwen3-moe-tiny", 1, 2, false, false, false, false, 1, 2},
      {"llama-tiny", 1, 2, false, false, false, true, 1, 2},  // with activation checkpointing
      // Expert parallelism within each stage (np 4: PP 2 x DP 2 x EP 2, the ep group a stage's two
      // replicas; deepseek-v3's three layers split 2 + 1).
      {"qwen3-moe-tiny", 1, 1, false, false, false, false, 2, 2},
      {"qwen3-moe-tiny", 1, 1, true, true, false, true, 2, 2},
      {"deepseek-v3-tiny", 1, 1, true, false, false, false, 2, 2},
      // Sequence parallelism over the stages (np 4: TP 2 x PP 2 + SP): each boundary carries the
      // rank's block of the rows; with MoE layers, and with expert parallelism (the ep group a
      // stage's tp group).
      {"llama-tiny", 2, 1, true, true, true, false, 1, 2},
      {"qwen3-tiny", 2, 1, false, false, true, false, 1, 2},  // tied embedding over the stages
      {"qwen3-moe-tiny", 2, 1, true, false, true, true, 1, 2},
      {"qwen3-moe-tiny", 2, 1, false, true, true, false, 2, 2},
      {"qwen3-moe-tiny", 2, 2, true, true, true, false, 2, 2},  // np 8 (by hand): TP 2 x CP 2 x EP 2 x PP 2 + SP
      {"llama-tiny", 2, 2, true, true, false, false, 1, 2},   // np 8 (by hand): TP 2 x CP 2 x PP 2
      {"qwen3-moe-tiny", 2, 2, false, false, false, false, 1, 2},
  };
}

INSTANTIATE_TEST_SUITE_P(Cp, ContextParallel, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return test_name(info.param.label()); });

// One SGD step with every sequence on the `busy` ranks and none on the others: it equals the
// reference (loss, norm, gradients, the load-balancing loss), and the idle ranks exchange rows
// with the busy ones (`idle` says why).
void expect_step_with_idle_ranks(const Case& c, bool busy, const std::string& idle) {
  auto g = layout_batch();
  auto mine = all_or_none(*g, busy);
  const SgdComparison r = sgd_step_both(fixture(c.model), sgd_config(c, true), sgd_config(c, false), *g, *mine);
  expect_step_matches(r.got, r.ref, c.label());
  expect_moe_metrics(r.got.metrics, r.ref.metrics, {"moe/aux_loss"}, 1e-5, c.label());
  if (!busy) EXPECT_GT(r.got.metrics["ep/comm_bytes"].get<int64_t>(), 0) << c.label() << ": " << idle;
}

// CP 2 x DP 2 x EP 4 (np 4): one cp group takes every sequence, the other none; the idle
// group's ranks still run their experts for the busy ranks' rows (forward and backward, with and
// without recompute), and the step equals the reference.
TEST(ContextParallelExperts, EmptyShardOfAnEpGroup) {
  const int N = world().size(), R = world().rank();
  if (N != 4) GTEST_SKIP() << "CP 2 x DP 2 x EP 4 needs 4 ranks, got " << N;
  for (const bool recompute : {false, true}) {
    Case c{"qwen3-moe-tiny", 1, 2, false, false};
    c.ep = 4;
    c.recompute = recompute;
    expect_step_with_idle_ranks(c, R < 2, "an idle rank exchanges for its peers");  // ranks 0, 1: one cp group
  }
}

// PP 2 x DP 2 x EP 2 (np 4): one replica (ranks 0 and 2, data-parallel rank 0) takes every
// sequence, the other none; the idle replica's stages run idle micro-batches inside the 1F1B
// schedule (their experts for the busy replica's rows), and the step equals the reference.
TEST(PipelineExperts, EmptyShardOfAReplica) {
  const int N = world().size(), R = world().rank();
  if (N != 4) GTEST_SKIP() << "PP 2 x DP 2 x EP 2 needs 4 ranks, got " << N;
  for (const bool recompute : {false, true}) {
    Case c{"qwen3-moe-tiny", 1, 1, false, false};
    c.ep = 2;
    c.pp = 2;
    c.recompute = recompute;
    expect_step_with_idle_ranks(c, R % 2 == 0, "an idle replica exchanges for its peers");
  }
}

// A state saved under TP 2 x EP 2 (np 2; x DP 2 at np 4) and under PP 2 x DP 2 x EP 2 (np 4) is
// one rank's files (HF layout, every expert whole); it loads on one rank into the same weights and
// continues there, and one rank's state loads back under the layout bitwise and continues bitwise.
TEST(ExpertParallelMixedCheckpoints, LoadOnOneRankAndBack) {
  Case tpep{"qwen3-moe-tiny", 2, 1, false, true, true};
  tpep.ep = 2;
  Case ppep{"qwen3-moe-tiny", 1, 1, false, true};
  ppep.ep = 2;
  ppep.pp = 2;
  int ran = 0;
  for (const Case& c : {tpep, ppep}) {
    if (!runs_here(c)) continue;
    const Share p = share_of(c);
    checkpoint_round_trip(c.model, adam_config(c, false, 5e-3), adam_config(c, true, 5e-3), p.dp, p.dp_rank,
                          c.tp > 1 ? "tpep" : "ppep", layout_batch());
    ++ran;
  }
  if (ran == 0) GTEST_SKIP() << "no mixed EP layout on " << world().size() << " ranks";
}

TEST(ContextParallelErrors, RefusedByName) {
  const int N = world().size();
  const json cp2 = {{"megatron_cfg", {{"context_parallel_size", 2}}}};
  expect_load_error({{"megatron_cfg", {{"context_parallel_size", N + 1}}}}, "llama-tiny", RLH_E_INVALID_ARGUMENT,
                    "context_parallel_size = " + std::to_string(N + 1) + ": megatron: parallel sizes: world size");
  {
    json cfg = cp2;
    cfg["device"] = "cuda";
    expect_load_error(cfg, "llama-tiny", RLH_E_UNIMPLEMENTED,
                      "policy.device = cuda: context parallelism (context_parallel_size = 2) runs on the CPU engine only");
  }
  {
    Alone alone;
    expect_load_error(cp2, "llama-tiny", RLH_E_INVALID_ARGUMENT,
                      "context_parallel_size = 2 needs a multiple of 2 launched ranks");
  }
  expect_create_error({{"dtensor_cfg", {{"context_parallel_size", 2}}}}, RLH_E_UNIMPLEMENTED,
                      "policy.dtensor_cfg.context_parallel_size = 2: only data parallelism", "dtensor");
  Backend be(host(), "megatron", cp2);
  rlh_model* m = be.load(model_path("llama-tiny"), false);
  auto g = layout_batch();
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
                 "logits and logprob_at_ids are not outputs under context or sequence parallelism");
  }
}

// ---------------------------------------------------------------------------------------------
// The engine under context parallelism: routing records are per token, so each rank records its
// zigzag rows and forward gathers them into the caller's token order; a replay field is the
// whole micro-batch's, each rank reading its rows' tokens.

TEST(ContextParallelEngine, RoutingRecordAndReplay) {
  const int N = world().size();
  for (const int64_t cp : {int64_t(2), int64_t(4)}) {
    if (N % cp != 0) continue;
    const EngineModel& md = engine_model("qwen3-moe-tiny");
    auto g = layout_batch();
    const EngineReference ref(md, *g);
    const engine::MicroBatch& gmb = ref.mb;
    const engine::OutputRequest& req = ref.req;
    const engine::Outputs& full = ref.full;
    const int64_t W = full.routing_width, T = g->num_tokens(), E = 8;

    sdk::ParallelSizes sizes;
    sizes.cp = cp;
    const sdk::ParallelComms pc = world_groups(sizes, {sdk::GroupKind::cp});
    backend::CommCpGroup comm(pc.of(sdk::GroupKind::cp));
    engine::EngineOptions o;
    o.ops = &host_ops();
    o.cp_comm = &comm;
    engine::Engine e(md.desc, o);
    e.load_parameters(md.weights);
    const engine::Outputs got = e.forward(gmb, req);
    EXPECT_EQ(got.routing_width, W);
    EXPECT_EQ(got.routed_experts, full.routed_experts) << "cp " << cp << ": the routing record is the reference's";
    const double err = max_abs_diff(got.logprob, full.logprob);
    EXPECT_LE(err, 2e-5) << "cp " << cp;

    // Another routing (each choice moved to the next expert) replayed: the reference's outputs
    // under it, and the record of a train step is that routing.
    const OtherRouting other(*ref.engine, e, gmb, full.routed_experts, T, W, 1, E, req);
    const double other_err = max_abs_diff(other.got.logprob, other.ref.logprob);
    EXPECT_LE(other_err, 2e-5) << "cp " << cp << ": replaying another routing";
    EXPECT_GT(max_abs_diff(other.ref.logprob, full.logprob), 1e-4) << "the other routing changes the outputs";
    EXPECT_EQ(other.got.routed_experts, other.field.data) << "cp " << cp;
    engine::StepOptions so;
    so.global_tokens = T;
    so.global_sequences = g->num_seqs();
    so.outputs = other.req;
    so.apply_optimizer = false;
    const engine::StepResult r = e.train_step(std::span<const engine::MicroBatch>(&other.mb, 1), so, every_row_nll);
    ASSERT_EQ(r.routed_experts.size(), size_t(1));
    EXPECT_EQ(r.routed_experts[0], other.field.data) << "cp " << cp << ": a train step's record";
    if (world().rank() == 0)
      std::cout << "[np " << N << "] engine cp " << cp << ": routing record equal, logprobs within " << err
                << ", replay of another routing within " << other_err << "\n";
  }
}

}  // namespace

int main(int argc, char** argv) {
  release_kernels_before_the_host();  // the engine test's
  return run_mpi_tests(argc, argv, {"model_llama", "kernels_cpu", "megatron", "dtensor", "comm_mpi"});
}
