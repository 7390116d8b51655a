// rlh_backend_common's pure parts, without plugins: learning-rate schedules against their closed
// forms (torch's and Megatron's), grouping sequences into micro-batches, slicing fields (strided
// sources too), batch validation, and reading config sections with errors naming keys.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "rlhost/backend_common/backend_config.hpp"
#include "rlhost/backend_common/batch_plan.hpp"
#include "rlhost/sdk/status.hpp"

using namespace rlh;
using namespace rlh::backend;
using json = nlohmann::json;

namespace {

TEST(Schedules, TorchClosedForms) {
  OptimizerConfig opt;
  opt.lr = 2.0;
  TorchScheduler lin;
  lin.kind = TorchScheduler::Kind::linear;
  lin.start_factor = 0.25;
  lin.end_factor = 1.0;
  lin.total_iters = 3;
  TorchScheduler cst;
  cst.kind = TorchScheduler::Kind::constant;
  cst.factor = 0.5;
  cst.total_iters = 2;
  TorchScheduler cos;
  cos.kind = TorchScheduler::Kind::cosine;
  cos.t_max = 4;
  cos.eta_min = 0.2;
  Schedule s{TorchSchedule{{lin, cst, cos}, {3, 5}}};
  const double want[] = {0.5, 1.0, 1.5, 1.0, 1.0, 2.0, 0.2 + 1.8 * (1 + std::cos(M_PI / 4)) / 2, 1.1, 0.2 + 1.8 * (1 + std::cos(3 * M_PI / 4)) / 2};
  for (int t = 0; t < 9; ++t) EXPECT_NEAR(s.at(t, opt).lr, want[t], 1e-15) << "step " << t;
  EXPECT_EQ(s.at(3, opt).weight_decay, opt.weight_decay);
  EXPECT_EQ(Schedule{TorchSchedule{}}.at(7, opt).lr, 2.0);  // no scheduler: constant
  TorchScheduler step;
  step.kind = TorchScheduler::Kind::step;
  step.step_size = 2;
  step.gamma = 0.5;
  EXPECT_EQ(step.lr(1.0, 5), 0.25);
  TorchScheduler multi;
  multi.kind = TorchScheduler::Kind::multi_step;
  multi.milestones = {1, 4};
  multi.gamma = 0.1;
  EXPECT_DOUBLE_EQ(multi.lr(1.0, 4), 0.01);
  TorchScheduler poly;
  poly.kind = TorchScheduler::Kind::polynomial;
  poly.total_iters = 4;
  poly.power = 2;
  EXPECT_EQ(poly.lr(1.0, 2), 0.25);
  EXPECT_EQ(poly.lr(1.0, 9), 0.0);
}

TEST(Schedules, MegatronOptimizerParamScheduler) {
  OptimizerConfig opt;
  opt.lr = 1.0;
  MegatronSchedule m;
  m.warmup_init_lr = 0.1;
  m.warmup_iters = 3;
  m.decay = MegatronSchedule::Decay::cosine;
  m.decay_iters = 7;
  m.min_lr = 0.01;
  m.start_weight_decay = 0.0;
  m.end_weight_decay = 0.2;
  m.wd_increment = MegatronSchedule::WdIncrement::cosine;
  m.wd_incr_iters = 4;
  const Schedule s{m};
  EXPECT_NEAR(s.at(0, opt).lr, 0.1, 1e-15);
  EXPECT_NEAR(s.at(2, opt).lr, 0.1 + 0.9 * 2 / 3, 1e-15);
  EXPECT_NEAR(s.at(3, opt).lr, 1.0, 1e-15);  // the warmup's end: Megatron's "<=" keeps it in warmup
  EXPECT_NEAR(s.at(5, opt).lr, 0.01 + 0.99 * 0.5 * (std::cos(M_PI * 0.5) + 1), 1e-15);
  EXPECT_NEAR(s.at(8, opt).lr, 0.01, 1e-15);
  EXPECT_NEAR(s.at(2, opt).weight_decay, 0.2 * 0.5 * (std::cos(M_PI * 0.5) + 1), 1e-15);
  EXPECT_NEAR(s.at(9, opt).weight_decay, 0.2, 1e-15);
  m.decay = MegatronSchedule::Decay::inverse_square_root;
  m.warmup_iters = 4;
  EXPECT_NEAR(Schedule{m}.at(16, opt).lr, 0.5, 1e-15);
}

// A batch over borrowed arrays.
rlh_batch make_batch(const std::vector<int32_t>& ids, const std::vector<int64_t>& off,
                     const std::vector<rlh_named_tensor>& fields = {}) {
  rlh_batch b{};
  b.struct_size = RLH_STRUCT_SIZE(rlh_batch, constraints);
  b.num_tokens = int64_t(ids.size());
  b.num_seqs = int64_t(off.size()) - 1;
  b.token_ids = ids.data();
  b.seq_offsets = off.data();
  b.fields = fields.data();
  b.num_fields = fields.size();
  return b;
}

std::vector<std::vector<int64_t>> groups(const std::vector<MicroBatchPlan>& p) {
  std::vector<std::vector<int64_t>> g;
  for (const auto& m : p) g.push_back(m.seqs);
  return g;
}

TEST(BatchPlan, GroupsByCountTokensAndBins) {
  // lengths 5, 2, 7, 0, 3, 4
  const std::vector<int64_t> off = {0, 5, 7, 14, 14, 17, 21};
  const std::vector<int32_t> ids(21, 1);
  rlh_batch b = make_batch(ids, off);
  using G = std::vector<std::vector<int64_t>>;
  EXPECT_EQ(groups(plan_microbatches(b, {.max_seqs = 4})), (G{{0, 1, 2, 3}, {4, 5}}));
  EXPECT_EQ(groups(plan_microbatches(b, {.max_tokens = 8})), (G{{0, 1}, {2, 3}, {4, 5}}));
  // First-fit decreasing, budget 8: 7 | 5+3 | 4+2 (+0), members in batch order.
  EXPECT_EQ(groups(plan_microbatches(b, {.max_tokens = 8, .first_fit_decreasing = true})), (G{{2, 3}, {0, 4}, {1, 5}}));
  // A sequence longer than the budget gets its own micro-batch (the empty one joins the next).
  EXPECT_EQ(groups(plan_microbatches(b, {.max_tokens = 3})), (G{{0}, {1}, {2}, {3, 4}, {5}}));
  EXPECT_EQ(groups(plan_microbatches(b, {})), (G{{0, 1, 2, 3, 4, 5}}));
  b.constraints = RLH_BATCH_KEEP_PAIRS;
  EXPECT_EQ(groups(plan_microbatches(b, {.max_seqs = 3})), (G{{0, 1}, {2, 3}, {4, 5}}));
  EXPECT_EQ(groups(plan_microbatches(b, {.max_tokens = 8, .first_fit_decreasing = true})), (G{{0, 1}, {2, 3}, {4, 5}}));
  // Micro-batches without tokens are dropped.
  const std::vector<int64_t> off2 = {0, 0, 3};
  const std::vector<int32_t> ids2(3, 1);
  EXPECT_EQ(groups(plan_microbatches(make_batch(ids2, off2), {.max_seqs = 1})), (G{{1}}));
}

TEST(BatchPlan, SlicesPerTokenAndPerSequenceFieldsFromStridedSources) {
  const std::vector<int64_t> off = {0, 2, 5, 6};  // lengths 2, 3, 1
  const std::vector<int32_t> ids = {10, 11, 20, 21, 22, 30};
  // Per-token [6, 2] viewed transposed out of a [2, 6] buffer (strides {1, 6}); per-sequence [3].
  std::vector<float> buf(12);
  for (int t = 0; t < 6; ++t) {
    buf[size_t(t)] = float(100 + t);
    buf[size_t(6 + t)] = float(200 + t);
  }
  int64_t shape_tok[2] = {6, 2}, stride_tok[2] = {1, 6};
  std::vector<int64_t> seq = {7, 8, 9};
  int64_t shape_seq[1] = {3}, stride_seq[1] = {1};
  rlh_tensor tok{buf.data(), {RLH_DEVICE_CPU, 0}, 2, {RLH_DTYPE_FLOAT, 32, 1}, shape_tok, stride_tok, 0};
  rlh_tensor sq{seq.data(), {RLH_DEVICE_CPU, 0}, 1, {RLH_DTYPE_INT, 64, 1}, shape_seq, stride_seq, 0};
  const std::vector<rlh_named_tensor> fields = {{"tok", tok}, {"seq", sq}};
  const rlh_batch b = make_batch(ids, off, fields);
  validate_batch(&b, 64);
  MicroBatchData d(b, MicroBatchPlan{{2, 0}, 3});  // sequences out of order
  const rlh_batch& mb = d.abi_batch();
  EXPECT_EQ(mb.num_tokens, 3);
  EXPECT_EQ(std::vector<int32_t>(mb.token_ids, mb.token_ids + 3), (std::vector<int32_t>{30, 10, 11}));
  EXPECT_EQ(std::vector<int64_t>(mb.seq_offsets, mb.seq_offsets + 3), (std::vector<int64_t>{0, 1, 3}));
  const float* t = static_cast<const float*>(mb.fields[0].tensor.data);
  EXPECT_EQ(std::vector<float>(t, t + 6), (std::vector<float>{105, 205, 100, 200, 101, 201}));
  EXPECT_EQ(mb.fields[0].tensor.shape[0], 3);
  EXPECT_EQ(mb.fields[0].tensor.strides[0], 2);
  const int64_t* s = static_cast<const int64_t*>(mb.fields[1].tensor.data);
  EXPECT_EQ(std::vector<int64_t>(s, s + 2), (std::vector<int64_t>{9, 7}));
  EXPECT_EQ(d.batch_begin(0), 5);
  EXPECT_EQ(d.batch_begin(1), 0);
  const engine::MicroBatch em = d.engine_view();
  EXPECT_EQ(std::vector<int32_t>(em.cu_seqlens.begin(), em.cu_seqlens.end()), (std::vector<int32_t>{0, 1, 3}));
}

void expect_error(const std::function<void()>& fn, rlh_code code, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "no error; wanted '" << part << "'";
  } catch (const sdk::Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(BatchPlan, ValidationNamesTheProblem) {
  const std::vector<int32_t> ids = {1, 2, 3};
  const std::vector<int64_t> off = {0, 1, 3};
  rlh_batch b = make_batch(ids, off);
  expect_error([&] { validate_batch(&b, 3); }, RLH_E_OUT_OF_RANGE, "token id 3 at position 1 of sequence 1");
  const std::vector<int64_t> bad = {0, 2, 1};
  rlh_batch b2 = make_batch(ids, bad);
  b2.num_tokens = 1;
  expect_error([&] { validate_batch(&b2, 8); }, RLH_E_INVALID_ARGUMENT, "seq_offsets decrease at sequence 1");
  // Two sequences of lengths 0 and 2 and a field of length 2: per token or per sequence?
  const std::vector<int64_t> off3 = {0, 0, 2};
  const std::vector<int32_t> ids3 = {1, 2};
  std::vector<float> f = {1, 2};
  int64_t shape[1] = {2}, stride[1] = {1};
  const std::vector<rlh_named_tensor> fields = {{"f", {f.data(), {RLH_DEVICE_CPU, 0}, 1, {RLH_DTYPE_FLOAT, 32, 1}, shape, stride, 0}}};
  rlh_batch b3 = make_batch(ids3, off3, fields);
  expect_error([&] { validate_batch(&b3, 8); }, RLH_E_INVALID_ARGUMENT, "cannot be told per-token from per-sequence");
  std::vector<rlh_named_tensor> dev = fields;
  dev[0].tensor.device = {RLH_DEVICE_CUDA, 0};
  rlh_batch b4 = make_batch(ids, off, dev);
  expect_error([&] { validate_batch(&b4, 8); }, RLH_E_UNIMPLEMENTED, "batch field 'f': this backend reads host memory");
}

TEST(ConfigReading, TypedKeysListsAndUnreadKeys) {
  const json j = json::parse(R"({"a": {"x": 1, "y": "1e-3", "z": "big", "n": null},
                                 "list": [{"name": "A"}, {"milestones": [2]}], "other": {"k": 1, "k2": 2}})");
  ConfigReader r(j, "policy");
  EXPECT_EQ(r.integer("a.x", 0), 1);
  EXPECT_EQ(r.number("a.y", 0), 1e-3);  // YAML 1.2 leaves 1e-3 a string
  EXPECT_EQ(r.number("a.missing", 4.5), 4.5);
  EXPECT_EQ(r.number("a.n", 4.5), 4.5);
  EXPECT_TRUE(r.is_null("a.n"));
  EXPECT_FALSE(r.is_null("a.x"));
  EXPECT_EQ(r.string("list.0.name", ""), "A");
  expect_error([&] { r.number("a.z", 0); }, RLH_E_INVALID_ARGUMENT, "policy.a.z: expected a number, got string \"big\"");
  expect_error([&] { r.boolean("a.x", false); }, RLH_E_INVALID_ARGUMENT, "policy.a.x: expected true or false");
  EXPECT_EQ(r.unread("a"), std::vector<std::string>{});
  EXPECT_EQ(r.unread("other"), (std::vector<std::string>{"policy.other.k", "policy.other.k2"}));
  EXPECT_EQ(r.unread("list"), std::vector<std::string>{});
  EXPECT_NO_THROW(require_single_rank(r, "a.x"));  // 1
  EXPECT_NO_THROW(require_single_rank(r, "a.absent"));
  expect_error([&] { require_single_rank(r, "other.k2"); }, RLH_E_UNIMPLEMENTED, "policy.other.k2 = 2");
}

TEST(ConfigReading, SharedPolicyKeysAndMergePatch) {
  BackendConfig cfg;
  cfg.optimizer = OptimizerConfig{};
  json j = {{"max_grad_norm", nullptr}, {"precision", "bfloat16"},
            {"sequence_packing", {{"enabled", true}, {"train_mb_tokens", 64}, {"logprob_mb_tokens", 128},
                                  {"algorithm", "concatenative"}}}};
  ConfigReader r(j, "policy");
  read_shared_policy_keys(r, cfg);
  EXPECT_EQ(cfg.optimizer->max_grad_norm, 0.0);  // null: no clipping
  EXPECT_TRUE(cfg.batching.by_tokens);
  EXPECT_EQ(cfg.batching.train_mb_tokens, 64);
  EXPECT_EQ(cfg.batching.logprob_mb_tokens, 128);
  EXPECT_FALSE(cfg.batching.first_fit_decreasing);
  // bfloat16 is the device path's precision; where a model runs on the CPU engine instead,
  // load_model says so (it computes in float32).
  EXPECT_TRUE(cfg.bf16());
  EXPECT_EQ(cfg.device, "auto");
  EXPECT_TRUE(cfg.notes.empty());
  EXPECT_TRUE(cfg.kernel_verify);  // providers are verified unless policy.kernels.verify says not
  EXPECT_FALSE(cfg.batch_invariant);
  // The generator's deterministic mode also puts the device engine's logprob passes in it.
  BackendConfig det;
  json g = {{"generation", {{"native_cfg", {{"batch_invariant", true}}}}}};
  ConfigReader rg(g, "policy");
  read_shared_policy_keys(rg, det);
  EXPECT_TRUE(det.batch_invariant);
  json gb = {{"generation", {{"native_cfg", {{"batch_invariant", "yes"}}}}}};
  ConfigReader rgb(gb, "policy");
  expect_error([&] { read_shared_policy_keys(rgb, det); }, RLH_E_INVALID_ARGUMENT, "policy.generation.native_cfg.batch_invariant");
  const json patched = merge_patch({{"a", {{"b", 1}, {"c", 2}}}, {"d", 3}}, {{"a", {{"b", 5}, {"c", nullptr}}}});
  EXPECT_EQ(patched, (json{{"a", {{"b", 5}}}, {"d", 3}}));
}

// policy.kernels: pins per op (or family) and verify (default true; a boolean or an error).
TEST(ConfigReading, KernelPinsAndVerify) {
  BackendConfig cfg;
  json j = {{"kernels", {{"gemm", "vendor_x"}, {"attention", "auto"}, {"verify", false}}}};
  ConfigReader r(j, "policy");
  read_shared_policy_keys(r, cfg);
  ASSERT_EQ(cfg.kernel_pins.size(), 1u);
  EXPECT_EQ(cfg.kernel_pins[0], (std::pair<std::string, std::string>{"gemm", "vendor_x"}));
  EXPECT_FALSE(cfg.kernel_verify);
  BackendConfig bad;
  json k = {{"kernels", {{"verify", "yes"}}}};
  ConfigReader rb(k, "policy");
  expect_error([&] { read_shared_policy_keys(rb, bad); }, RLH_E_INVALID_ARGUMENT, "policy.kernels.verify must be true or false");
}

}  // namespace
