// What the model-parallel backend tests under `mpirun` share (tensor, pipeline, context and expert
// parallelism and their mixes: tests/backend/test_backend_{tp,pp,cp,ep,ep_etp,ep_vpp}.cpp): the
// global batch and a data-parallel rank's share of it, a model with more layers than the fixtures
// (virtual stages), a loss on logprobs and entropy, one SGD step's outcome (outputs, loss, norm,
// gradients read back through the HF weights) on one rank and under a layout and their
// comparison, the MoE metrics' comparison, two AdamW steps', the checkpoint round trip between a
// layout and one rank, and refusals at create and at load.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "backend_harness.hpp"
#include "mpi_harness.hpp"
#include "rlhost/sdk/safetensors.hpp"

namespace rlh::test {

constexpr double kTemperature = 0.7;

// The layout tests' global batch (the same on every rank): 8 sequences of uneven lengths over a
// vocabulary of 512.
constexpr int32_t kLayoutVocab = 512;
inline const std::vector<int64_t> kLayoutLengths = {9, 14, 3, 11, 17, 6, 2, 12};
inline std::unique_ptr<Batch> layout_batch() { return random_batch(kLayoutLengths, kLayoutVocab, 31); }

// A data-parallel rank's share of the layout batch: the whole batch, and its `dp_rank`-th of `dp`
// contiguous runs of sequences, which starts at token `first` of the whole.
struct Share {
  int dp = 1, dp_rank = 0;
  std::unique_ptr<Batch> global, mine;
  int64_t first = 0;
  Share(int dp_size, int rank) : dp(dp_size), dp_rank(rank), global(layout_batch()) {
    mine = shard_of(*global, dp_rank, dp, &first);
  }
};

// A fixture with its L layers twice: layers 0..L-1, then each again scaled by 0.9 as layers
// L..2L-1 (so that no two layers are alike), for virtual pipeline stages (the fixtures have at
// most three layers). Written once per process by rank 0 into a temporary folder named for
// `tag`, removed at exit; its path, on every rank (every rank calls it alike: it broadcasts).
inline std::string doubled_layers_model(const std::string& fixture, const std::string& tag) {
  namespace fs = std::filesystem;
  static std::map<std::string, std::string> written;
  static struct Cleanup {
    std::vector<std::string> dirs;
    ~Cleanup() {
      for (const auto& d : dirs) fs::remove_all(d);
    }
  } cleanup;
  const auto it = written.find(fixture + "/" + tag);
  if (it != written.end()) return it->second;
  const fs::path d =
      world().broadcast((fs::temp_directory_path() / ("rlh_" + tag + "_" + std::to_string(::getpid()))).string());
  if (world().rank() == 0) {
    fs::remove_all(d);
    fs::create_directories(d);
    nlohmann::json cfg = nlohmann::json::parse(std::ifstream(model_path(fixture) + "/config.json"));
    const int64_t L = cfg["num_hidden_layers"].get<int64_t>();
    const auto src = sdk::st::Checkpoint::open(model_path(fixture));
    std::vector<std::vector<float>> keep;
    std::vector<std::pair<std::string, std::vector<int64_t>>> named;
    for (const std::string& n : src.names()) {
      const std::vector<int64_t> shape = src.at(n).info->shape;
      keep.push_back(src.read_f32(n));
      named.emplace_back(n, shape);
      const std::string pre = "model.layers.";
      if (n.rfind(pre, 0) == 0) {
        const size_t dot = n.find('.', pre.size());
        const int64_t layer = std::stoll(n.substr(pre.size(), dot - pre.size()));
        std::vector<float> again = keep.back();
        for (float& x : again) x *= 0.9f;
        keep.push_back(std::move(again));
        named.emplace_back(pre + std::to_string(layer + L) + n.substr(dot), shape);
      }
    }
    std::vector<sdk::st::WriteTensor> tensors;
    for (size_t i = 0; i < keep.size(); ++i)
      tensors.push_back({named[i].first, sdk::st::DType::F32, named[i].second,
                         std::as_bytes(std::span<const float>(keep[i].data(), keep[i].size()))});
    sdk::st::write_checkpoint(d.string(), tensors);
    cfg["num_hidden_layers"] = 2 * L;
    std::ofstream(d / "config.json") << cfg.dump(2);
    cleanup.dirs.push_back(d.string());
  }
  world().barrier();
  return written[fixture + "/" + tag] = d.string();
}

// The processed logprob (no filter: the raw one) and the entropy at temperature 0.7: NLL minus
// 0.1 x mean entropy, so both the logprob and the entropy head's gradients are exercised.
inline Backend::TrainOptions lp_ent_options() {
  Backend::TrainOptions o;
  o.specs = {spec(RLH_OUTPUT_LOGPROB, "lp", kTemperature), spec(RLH_OUTPUT_ENTROPY, "ent", kTemperature)};
  return o;
}
inline Backend::LossBody lp_ent_loss() {
  return [](const rlh_microbatch& mb) {
    float *g = nullptr, *ge = nullptr;
    const float* lp = output(mb, "lp", &g);
    const float* ent = output(mb, "ent", &ge);
    const rlh_batch& b = *mb.batch;
    const double n = double(mb.global_num_tokens);
    double loss = 0;
    for (int64_t s = 0; s < b.num_seqs; ++s)
      for (int64_t t = b.seq_offsets[s] + 1; t < b.seq_offsets[s + 1]; ++t) {
        loss += (-lp[t] - 0.1 * ent[t]) / n;
        g[t] = float(-1.0 / n);
        ge[t] = float(-0.1 / n);
      }
    return loss;
  };
}

struct Outcome {
  std::vector<float> logprobs, entropy;
  double loss = 0, grad_norm = 0;
  Weights grads;
  nlohmann::json metrics;
};

// The outputs `forward_specs` (the first the logprobs, a second the entropy) of a forward, then
// one train step with `loss`; the gradients as the weights' change (SGD at lr 1: w - w' = g).
inline Outcome step_outcome(Backend& be, rlh_model* m, Batch& batch, int64_t g_tok, int64_t g_seq,
                            const std::vector<rlh_output_spec>& forward_specs, const Backend::LossBody& loss,
                            const Backend::TrainOptions& options) {
  Outcome o;
  std::vector<std::vector<float>> out;
  sdk::check(be.try_forward(m, batch, forward_specs, out), "forward");
  o.logprobs = out[0];
  if (out.size() > 1) o.entropy = out[1];
  const Weights before = be.weights(m);
  const auto r = be.train(m, batch, g_tok, g_seq, loss, options);
  o.loss = r.r.loss;
  o.grad_norm = r.r.grad_norm;
  o.metrics = r.metrics;
  o.grads = minus(before, be.weights(m));
  return o;
}
// The step on logprobs and entropy at temperature 0.7 (lp_ent_loss).
inline Outcome run_sgd_step(Backend& be, rlh_model* m, Batch& batch, int64_t g_tok, int64_t g_seq) {
  return step_outcome(be, m, batch, g_tok, g_seq,
                      {spec(RLH_OUTPUT_LOGPROB_RAW, "lp", kTemperature), spec(RLH_OUTPUT_ENTROPY, "ent", kTemperature)},
                      lp_ent_loss(), lp_ent_options());
}
// The step on the NLL alone (raw logprobs at temperature 1; no entropy read).
inline Outcome run_nll_sgd_step(Backend& be, rlh_model* m, Batch& batch, int64_t g_tok, int64_t g_seq) {
  return step_outcome(be, m, batch, g_tok, g_seq, {spec(RLH_OUTPUT_LOGPROB_RAW, "lp")}, nll_loss(), {});
}
using SgdStep = std::function<Outcome(Backend&, rlh_model*, Batch&, int64_t, int64_t)>;

// The MoE losses the layout tests train a softmax router with, on a megatron_cfg: the
// load-balancing loss (per micro-batch; per sequence with packing, where a rank's micro-batches
// are not the reference's) at 0.01 and the z-loss at 0.001.
inline void set_moe_aux_losses(nlohmann::json& mc, bool packing) {
  mc["moe_router_load_balancing_type"] = packing ? "seq_aux_loss" : "aux_loss";
  mc["moe_aux_loss_coeff"] = 0.01;
  mc["moe_z_loss_coeff"] = 0.001;
}

// An MoE layout's config from its megatron_cfg parallel keys: the softmax router trains with
// set_moe_aux_losses, the sigmoid router (deepseek-v3) routes in float64; recompute and the
// batching as the case says.
inline nlohmann::json moe_layout_config(nlohmann::json mc, bool softmax, bool packing, bool recompute) {
  if (softmax) {
    set_moe_aux_losses(mc, packing);
  } else {
    mc["moe_router_dtype"] = "fp64";
  }
  if (recompute) mc["activation_checkpointing"] = true;
  nlohmann::json cfg = {{"megatron_cfg", mc}};
  set_batching(cfg, packing);
  return cfg;
}

// The optimizer both tests train with, on a config: SGD at lr 1 without momentum, decay or
// clipping (one step: w - w' = g), or AdamW with decay and clipping.
inline nlohmann::json with_sgd(nlohmann::json cfg, bool distributed_optimizer) {
  cfg["megatron_cfg"]["optimizer"] = {{"optimizer", "sgd"}, {"lr", 1.0}, {"sgd_momentum", 0.0}, {"weight_decay", 0.0},
                                      {"clip_grad", 0.0}, {"use_distributed_optimizer", distributed_optimizer}};
  return cfg;
}
inline nlohmann::json with_adam(nlohmann::json cfg, double lr, bool distributed_optimizer) {
  cfg["megatron_cfg"]["optimizer"] = {{"optimizer", "adam"}, {"lr", lr}, {"weight_decay", 0.01}, {"clip_grad", 1.0},
                                      {"use_distributed_optimizer", distributed_optimizer}};
  return cfg;
}

// One SGD step (`step`) on one rank (config `one`, the whole batch `g`) and under the layout
// (`cfg`, this rank's batch `mine`, of g's counts): the two outcomes.
struct SgdComparison {
  Outcome ref, got;
  double lp_err = 0, ent_err = 0, grad_err = 0;
};
inline SgdComparison sgd_step_both(const std::string& model, const nlohmann::json& one, const nlohmann::json& cfg,
                                   Batch& g, Batch& mine, const SgdStep& step = run_sgd_step) {
  SgdComparison c;
  {
    Alone alone;
    Backend be(host(), "megatron", one);
    rlh_model* m = be.load(model_path(model), true);
    c.ref = step(be, m, g, g.num_tokens(), g.num_seqs());
  }
  Backend be(host(), "megatron", cfg);
  rlh_model* m = be.load(model_path(model), true);
  c.got = step(be, m, mine, g.num_tokens(), g.num_seqs());
  return c;
}

// A step's loss within 1e-5 and its gradient norm within 1e-4 of the reference's (relative), the
// same HF tensors and every gradient within 1e-4 of the largest; that gradient error.
inline double expect_step_matches(const Outcome& got, const Outcome& ref, const std::string& label) {
  EXPECT_NEAR(got.loss, ref.loss, 1e-5 * std::fabs(ref.loss)) << label;
  EXPECT_NEAR(got.grad_norm, ref.grad_norm, 1e-4 * ref.grad_norm) << label;
  EXPECT_EQ(got.grads.size(), ref.grads.size()) << label << ": the same HF tensors";
  const double err = got.grads.size() == ref.grads.size() ? max_rel_diff(got.grads, ref.grads) : 0;
  EXPECT_LE(err, 1e-4) << label;
  return err;
}

// sgd_step_both, with this rank's batch starting at token `first` of g: logprobs (and the
// entropy, where the step reads it) within 2e-5 of the reference's tokens, and
// expect_step_matches.
inline SgdComparison compare_sgd_step(const std::string& model, const nlohmann::json& one, const nlohmann::json& cfg,
                                      Batch& g, Batch& mine, int64_t first, const std::string& label,
                                      const SgdStep& step = run_sgd_step) {
  SgdComparison c = sgd_step_both(model, one, cfg, g, mine, step);
  EXPECT_EQ(int64_t(c.got.logprobs.size()), mine.num_tokens()) << label;
  c.lp_err = max_abs_diff_at(c.got.logprobs, c.ref.logprobs, size_t(first));
  EXPECT_LE(c.lp_err, 2e-5) << label;
  if (!c.ref.entropy.empty()) {
    EXPECT_EQ(c.got.entropy.size(), c.got.logprobs.size()) << label;
    c.ent_err = max_abs_diff_at(c.got.entropy, c.ref.entropy, size_t(first));
    EXPECT_LE(c.ent_err, 2e-5) << label;
  }
  c.grad_err = expect_step_matches(c.got, c.ref, label);
  return c;
}

// A comparison's line for the log: loss, gradient norm, gradients, logprobs (and entropy).
inline std::string sgd_summary(const SgdComparison& c) {
  std::ostringstream s;
  s << "loss " << c.got.loss << " vs " << c.ref.loss << ", grad norm " << c.got.grad_norm << " vs " << c.ref.grad_norm
    << ", gradients within " << c.grad_err << " (relative to the largest), logprobs within " << c.lp_err;
  if (!c.ref.entropy.empty()) s << ", entropy within " << c.ent_err;
  return s.str();
}

// The MoE step metrics `keys` of a layout's step against one rank's: present in both, the
// reference's positive, within `rel` relative (plus `abs`). `positive_only`: metrics that need
// only be positive in both (a per-micro-batch maximum where the layout's micro-batches are not
// the reference's). A line of the values compared, for the log.
inline std::string expect_moe_metrics(const nlohmann::json& got, const nlohmann::json& ref,
                                      const std::vector<std::string>& keys, double rel, const std::string& label,
                                      const std::vector<std::string>& positive_only = {}, double abs = 0) {
  std::string line;
  for (const std::string& k : keys) {
    const bool only_positive = std::find(positive_only.begin(), positive_only.end(), k) != positive_only.end();
    if (!got.contains(k) || !ref.contains(k)) {
      ADD_FAILURE() << label << ": " << k << " missing";
      continue;
    }
    const double a = got[k].get<double>(), b = ref[k].get<double>();
    EXPECT_GT(b, 0) << label << ": " << k;
    if (only_positive) {
      EXPECT_GT(a, 0) << label << ": " << k;
      continue;
    }
    EXPECT_NEAR(a, b, rel * std::fabs(b) + abs) << label << ": " << k;
    line += ", " + k + " " + std::to_string(a) + " vs " + std::to_string(b);
  }
  return line;
}

// Two AdamW steps (lr 2e-3) on one rank and under the layout, as compare_sgd_step: losses within
// 2e-5 relative, weights within a few lr (AdamW divides by sqrt(v): where a gradient is ~0 its
// rounding decides the step's sign, as for data parallelism). The training state per rank after
// them (memory/state_bytes) of both.
struct AdamComparison {
  double worst = 0, state = 0, ref_state = 0;
};
inline AdamComparison compare_adamw_steps(const std::string& model, const nlohmann::json& one,
                                          const nlohmann::json& cfg, Batch& g, Batch& mine, const std::string& label) {
  AdamComparison c;
  std::vector<double> ref_loss;
  Weights ref_w;
  {
    Alone alone;
    Backend be(host(), "megatron", one);
    rlh_model* m = be.load(model_path(model), true);
    for (int s = 0; s < 2; ++s) {
      const auto r = be.train(m, g, g.num_tokens(), g.num_seqs(), nll_loss(), {});
      ref_loss.push_back(r.r.loss);
      c.ref_state = r.metrics["memory/state_bytes"].get<double>();
    }
    ref_w = be.weights(m);
  }
  Backend be(host(), "megatron", cfg);
  rlh_model* m = be.load(model_path(model), true);
  for (int s = 0; s < 2; ++s) {
    const auto r = be.train(m, mine, g.num_tokens(), g.num_seqs(), nll_loss(), {});
    EXPECT_NEAR(r.r.loss, ref_loss[size_t(s)], 2e-5 * std::fabs(ref_loss[size_t(s)])) << label << " step " << s;
    c.state = r.metrics["memory/state_bytes"].get<double>();
  }
  const Weights w = be.weights(m);
  for (const auto& [k, v] : ref_w)
    for (size_t i = 0; i < v.size(); ++i) c.worst = std::max(c.worst, std::fabs(double(w.at(k)[i]) - double(v[i])));
  EXPECT_LE(c.worst, 2 * 2 * 2e-3) << label;
  return c;
}
inline std::string adam_summary(const AdamComparison& c) {
  std::ostringstream s;
  s << "2 AdamW steps, weights within " << c.worst << "; training state per rank " << c.state / 1024 << " KiB, one rank "
    << c.ref_state / 1024 << " KiB (ratio " << c.state / c.ref_state << ")";
  return s.str();
}

// Forward only on the whole batch `g` with log p at K = 3 given ids per token (some -1; added to
// g as the field "ids") and the `more` outputs (width 1): the largest difference of each output
// between one rank (`one`) and the layout (`cfg`), on every rank.
inline std::vector<double> at_ids_differences(const std::string& model, const nlohmann::json& one,
                                              const nlohmann::json& cfg, Batch& g, int32_t vocab,
                                              const std::vector<rlh_output_spec>& more = {}) {
  constexpr int64_t K = 3;
  std::vector<int32_t> ids(size_t(g.num_tokens() * K));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = i % 7 == 3 ? -1 : int32_t((i * 131 + 17) % vocab);
  g.add("ids", ids, rlh_dtype{RLH_DTYPE_INT, 32, 1}, K);
  std::vector<rlh_output_spec> specs = {spec(RLH_OUTPUT_LOGPROB_AT_IDS, "at", 1.3, 0, 1.0, "ids")};
  specs.insert(specs.end(), more.begin(), more.end());
  std::vector<int64_t> widths(specs.size(), 1);
  widths[0] = K;
  std::vector<std::vector<float>> ref, got;
  {
    Alone alone;
    Backend be(host(), "megatron", one);
    rlh_model* m = be.load(model_path(model), false);
    sdk::check(be.try_forward(m, g, specs, ref, 0, widths), "forward at one rank");
  }
  Backend be(host(), "megatron", cfg);
  rlh_model* m = be.load(model_path(model), false);
  sdk::check(be.try_forward(m, g, specs, got, 0, widths), "forward under the layout");
  std::vector<double> err(specs.size(), 0);
  for (size_t k = 0; k < specs.size(); ++k) {
    EXPECT_EQ(got[k].size(), ref[k].size());
    for (size_t i = 0; i < ref[k].size() && i < got[k].size(); ++i)
      err[k] = std::max(err[k], std::fabs(double(got[k][i]) - double(ref[k][i])));
  }
  return err;
}

// A state saved under a layout (`cfg`, on this rank's share `dp_rank` of `dp` of the global
// batch) is one rank's files (HF layout, full tensors); it loads on one rank (`one`) into the
// same weights and continues there within fp32 tolerance; one rank's state loads back under the
// layout bitwise and continues bitwise. `tag` names the layout in paths and messages.
inline void checkpoint_round_trip(const std::string& model, const nlohmann::json& cfg, const nlohmann::json& one,
                                  int dp, int dp_rank, const std::string& tag, std::unique_ptr<Batch> g) {
  namespace fs = std::filesystem;
  const int R = world().rank();
  const int64_t g_tok = g->num_tokens(), g_seq = g->num_seqs();
  auto mine = shard_of(*g, dp_rank, dp);
  const fs::path root = world().broadcast((fs::temp_directory_path() / ("rlh_" + tag + "_" + std::to_string(::getpid()))).string());
  const fs::path dir = root / tag, again = root / "one";
  if (R == 0) {
    fs::remove_all(root);
    fs::create_directories(dir);
    fs::create_directories(again);
  }
  world().barrier();
  Weights saved, cont;
  std::vector<double> cont_loss;
  {
    Backend be(host(), "megatron", cfg);
    rlh_model* m = be.load(model_path(model), true);
    be.train(m, *mine, g_tok, g_seq, nll_loss(), {});
    sdk::check(be.api()->save_state(be.raw(), m, dir.c_str()), "save_state under " + tag);
    saved = be.weights(m);
    for (int s = 0; s < 2; ++s) cont_loss.push_back(be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss);
    cont = be.weights(m);
  }
  {  // the files: the fixture's tensors, full shapes
    const auto f = sdk::st::File::open((dir / "model.safetensors").string());
    const auto fx = sdk::st::File::open(model_path(model) + "/model.safetensors");
    ASSERT_EQ(f.tensors().size(), fx.tensors().size());
    for (const auto& t : fx.tensors()) EXPECT_EQ(f.at(t.name).shape, t.shape) << t.name;
  }
  {
    Alone alone;
    Backend be(host(), "megatron", one);
    rlh_model* m = be.load(model_path(model), true);
    sdk::check(be.api()->load_state(be.raw(), m, dir.c_str()), "load_state at one rank");
    EXPECT_TRUE(be.weights(m) == saved) << "loaded on one rank: not the weights saved under " << tag;
    if (R == 0) sdk::check(be.api()->save_state(be.raw(), m, again.c_str()), "save_state at one rank");
    for (int s = 0; s < 2; ++s) {
      const double loss = be.train(m, *g, g_tok, g_seq, nll_loss(), {}).r.loss;
      EXPECT_NEAR(loss, cont_loss[size_t(s)], 2e-5 * std::fabs(cont_loss[size_t(s)])) << "step " << s;
    }
    const Weights w = be.weights(m);
    double worst = 0;
    for (const auto& [k, v] : cont)
      for (size_t i = 0; i < v.size(); ++i) worst = std::max(worst, std::fabs(double(w.at(k)[i]) - double(v[i])));
    EXPECT_LE(worst, 2 * 2 * 5e-3);
  }
  world().barrier();
  {  // one rank's files back under the layout: bitwise the same weights, and the same continuation
    Backend be(host(), "megatron", cfg);
    rlh_model* m = be.load(model_path(model), true);
    sdk::check(be.api()->load_state(be.raw(), m, again.c_str()), "load_state under " + tag);
    EXPECT_TRUE(be.weights(m) == saved) << "one rank's state loaded under " << tag << ": not bitwise";
    for (int s = 0; s < 2; ++s)
      EXPECT_EQ(be.train(m, *mine, g_tok, g_seq, nll_loss(), {}).r.loss, cont_loss[size_t(s)]) << "step " << s;
    EXPECT_TRUE(be.weights(m) == cont) << "resumed under " << tag << ": not bitwise";
  }
  world().barrier();
  if (R == 0) fs::remove_all(root);
}

// A backend created with `cfg` fails with `code` and one line containing `part`; likewise
// loading `model` (a fixture's name or a folder) on a megatron backend created with `cfg`.
inline void expect_create_error(const nlohmann::json& cfg, rlh_code code, const std::string& part,
                                const char* backend = "megatron") {
  rlh_backend* b = nullptr;
  const std::string text = cfg.dump();
  expect_error(host().backend(backend)->create(host().services(), text.data(), text.size(), &b), code, part);
}
inline void expect_load_error(const nlohmann::json& cfg, const std::string& model, rlh_code code,
                              const std::string& part) {
  Backend be(host(), "megatron", cfg);
  rlh_model* m = nullptr;
  expect_error(be.try_load(model_path(model), true, &m), code, part);
}

}  // namespace rlh::test
