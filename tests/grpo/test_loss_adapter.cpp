// The rlh_loss_fn adapter on CPU tensors: named fields and outputs of an rlh_microbatch, the loss
// and gradients it writes, metrics through mb->metric, extrema, dtypes, and its errors. Outputs and
// gradients cross token-aligned, as backends hand them over (backend.h); the core functions the
// results are compared with take the output frame (packing.hpp).
#include <gtest/gtest.h>

#include <cstring>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "reference.hpp"
#include "rlhost/grpo/config.hpp"
#include "rlhost/grpo/loss_adapter.hpp"
#include "rlhost/grpo/nll_loss.hpp"
#include "rlhost/sdk/kernels.hpp"
#include "test_util.hpp"

namespace rlh::grpo::test {
namespace {

using sdk::Tensor;

float to_f32(double v) { return static_cast<float>(v); }

uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  b += 0x7FFF + ((b >> 16) & 1);
  return static_cast<uint16_t>(b >> 16);
}
double from_bf16(uint16_t h) {
  uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// An rlh_microbatch over a packed case, built the way a CPU backend would hand it over.
class AbiMicroBatch {
 public:
  struct Options {
    bool with_unfiltered = false;
    bool mixed_dtypes = false;  // bool token_mask, int32 sample_mask, f64 [n,1] advantages
    bool bf16_grads = false;
  };

  AbiMicroBatch(const Packed& p, const RefBatch& B, Options o) : opt_(o) {
    n_ = p.num_tokens();
    s_ = static_cast<int64_t>(p.order.size());
    offsets_ = p.offsets;
    ids_.assign(n_, 1);
    if (o.mixed_dtypes) {
      adv64_ = p.adv;
      add_field("advantages", adv64_.data(), {n_, 1}, sdk::kF64);
    } else {
      add_f32("advantages", p.adv, n_);
    }
    add_f32("prev_logprobs", p.prev, n_);
    add_f32("generation_logprobs", p.gen, n_);
    add_f32("reference_policy_logprobs", p.ref, n_);
    if (o.mixed_dtypes) {
      for (double v : p.tm) tm8_.push_back(v != 0 ? 1 : 0);
      for (double v : p.sm) sm32_.push_back(static_cast<int32_t>(v));
      add_field("token_mask", tm8_.data(), {n_}, rlh_dtype{RLH_DTYPE_BOOL, 8, 1});
      add_field("sample_mask", sm32_.data(), {s_}, sdk::kI32);
    } else {
      add_f32("token_mask", p.tm, n_);
      add_f32("sample_mask", p.sm, s_);
    }
    add_f32("rewards", p.rewards, s_);
    // The case's current logprobs are in the output frame; a backend hands them over token-aligned.
    add_output("logprobs", to_token_frame(p.packing(), p.lp));
    if (o.with_unfiltered) add_output("logprobs_unfiltered", to_token_frame(p.packing(), p.lpu));
    views_.emplace_back(&loss_, std::initializer_list<int64_t>{});
    loss_view_ = &views_.back();
    global_tok_ = static_cast<int64_t>(B.g_tok);
    global_seq_ = static_cast<int64_t>(B.g_seq);
  }

  // Removes a field by name (to test errors), or replaces its tensor.
  void drop_field(const std::string& name) {
    for (size_t i = 0; i < fields_.size(); ++i)
      if (names_[i] == name) {
        fields_.erase(fields_.begin() + static_cast<long>(i));
        names_.erase(names_.begin() + static_cast<long>(i));
        return;
      }
  }
  rlh_named_tensor* field(const std::string& name) {
    for (size_t i = 0; i < fields_.size(); ++i)
      if (names_[i] == name) return &fields_[i];
    return nullptr;
  }
  rlh_named_tensor& output(size_t k) { return outputs_[k]; }

  rlh_status* run(LossAdapter& a) {
    for (size_t i = 0; i < fields_.size(); ++i) fields_[i].name = names_[i].c_str();
    for (size_t i = 0; i < outputs_.size(); ++i) outputs_[i].name = out_names_[i].c_str();
    batch_ = rlh_batch{};
    batch_.struct_size = sizeof(rlh_batch);
    batch_.num_tokens = n_;
    batch_.num_seqs = s_;
    batch_.token_ids = ids_.data();
    batch_.seq_offsets = offsets_.data();
    batch_.fields = fields_.data();
    batch_.num_fields = fields_.size();
    mb_ = rlh_microbatch{};
    mb_.struct_size = sizeof(rlh_microbatch);
    mb_.batch = &batch_;
    mb_.outputs = outputs_.data();
    mb_.num_outputs = outputs_.size();
    mb_.grads = grads_.data();
    mb_.loss = &loss_view_->raw();
    mb_.global_num_tokens = global_tok_;
    mb_.global_num_seqs = global_seq_;
    mb_.metric = [](void* ctx, const char* name, double v) {
      (*static_cast<std::map<std::string, double>*>(ctx))[name] += v;
    };
    mb_.metric_ctx = &metrics;
    return a.fn()(a.user(), &mb_);
  }

  double grad(size_t k, int64_t t) const {
    if (opt_.bf16_grads) return from_bf16(grads16_[k][t]);
    return grads32_[k][t];
  }
  float loss() const { return loss_; }
  void set_global(int64_t tok, int64_t seq) {
    global_tok_ = tok;
    global_seq_ = seq;
  }

  std::map<std::string, double> metrics;

 private:
  void add_field(const std::string& name, void* data, std::initializer_list<int64_t> shape,
                 rlh_dtype dt) {
    views_.emplace_back(data, shape, dt);
    names_.push_back(name);
    fields_.push_back(rlh_named_tensor{nullptr, views_.back().raw()});
  }
  void add_f32(const std::string& name, const std::vector<double>& v, int64_t n) {
    store_.emplace_back();
    for (double x : v) store_.back().push_back(to_f32(x));
    add_field(name, store_.back().data(), {n}, sdk::kF32);
  }
  void add_output(const std::string& name, const std::vector<double>& v) {
    store_.emplace_back();
    for (double x : v) store_.back().push_back(to_f32(x));
    views_.emplace_back(store_.back().data(), std::initializer_list<int64_t>{n_}, sdk::kF32);
    out_names_.push_back(name);
    outputs_.push_back(rlh_named_tensor{nullptr, views_.back().raw()});
    if (opt_.bf16_grads) {
      grads16_.emplace_back(n_, 0);
      views_.emplace_back(grads16_.back().data(), std::initializer_list<int64_t>{n_}, sdk::kBF16);
    } else {
      grads32_.emplace_back(n_, 0.0f);
      views_.emplace_back(grads32_.back().data(), std::initializer_list<int64_t>{n_}, sdk::kF32);
    }
    grads_.push_back(views_.back().raw());
  }

  Options opt_;
  int64_t n_ = 0, s_ = 0, global_tok_ = 0, global_seq_ = 0;
  std::vector<int64_t> offsets_;
  std::vector<int32_t> ids_;
  std::deque<std::vector<float>> store_;
  std::vector<double> adv64_;
  std::vector<uint8_t> tm8_;
  std::vector<int32_t> sm32_;
  std::deque<Tensor> views_;  // stable addresses: rlh_tensor copies point into them
  std::vector<std::string> names_, out_names_;
  std::vector<rlh_named_tensor> fields_, outputs_;
  std::deque<std::vector<float>> grads32_;
  std::deque<std::vector<uint16_t>> grads16_;
  std::vector<rlh_tensor> grads_;
  float loss_ = -1;
  const Tensor* loss_view_ = nullptr;
  rlh_batch batch_{};
  rlh_microbatch mb_{};
};

// The packed case with every value rounded through float32, as the tensors hold them.
Packed rounded(Packed p) {
  for (auto* v : {&p.lp, &p.lpu, &p.adv, &p.prev, &p.gen, &p.ref, &p.tm, &p.sm, &p.rewards})
    for (double& x : *v) x = to_f32(x);
  return p;
}

struct Fixture {
  Case c;
  Packed p;
};
Fixture setup(uint64_t seed, const Rows* lpu_shift = nullptr) {
  GenOptions o;
  o.seed = seed;
  Fixture s{make_case(o), {}};
  Rows lpu = s.c.lp;
  for (auto& r : lpu)
    for (double& x : r) x -= 0.02;
  s.p = pack(s.c.batch, s.c.lp, iota_order(s.c.batch.seqs.size()), lpu_shift ? lpu_shift : &lpu);
  return s;
}

ClippedPGConfig busy_config() {
  ClippedPGConfig cfg;
  cfg.use_importance_sampling_correction = true;
  cfg.truncated_importance_sampling_type = TruncatedIsType::kTis;
  cfg.truncated_importance_sampling_ratio = 1.2;
  cfg.use_on_policy_kl_approximation = true;
  cfg.reference_policy_kl_penalty = 0.05;
  cfg.positive_example_nll_weight = 0.1;
  return cfg;
}

TEST(LossAdapter, WritesTheCoreLossGradientsAndMetrics) {
  const Fixture s = setup(31);
  const ClippedPGConfig cfg = busy_config();
  LossAdapter adapter(cfg);
  AbiMicroBatch mb(s.p, s.c.batch, {.with_unfiltered = true});
  rlh_status* st = mb.run(adapter);
  ASSERT_EQ(st, nullptr) << sdk::status_message(st);

  const Packed r = rounded(s.p);
  std::vector<double> g(r.num_tokens()), gu(r.num_tokens());
  const LossResult want = clipped_pg_loss(cfg, r.pg_inputs(s.c.batch, true), g.data(), gu.data());
  EXPECT_EQ(mb.loss(), to_f32(want.loss));
  const std::vector<double> gt = to_token_frame(r.packing(), g), gut = to_token_frame(r.packing(), gu);
  for (int64_t t = 0; t < r.num_tokens(); ++t) {
    EXPECT_EQ(mb.grad(0, t), to_f32(gt[t])) << t;
    EXPECT_EQ(mb.grad(1, t), to_f32(gut[t])) << t;
  }
  size_t summed = 0;
  for (const Metric& m : want.metrics.items()) {
    if (m.reduce == Reduce::kSum) {
      ASSERT_TRUE(mb.metrics.count(m.name)) << m.name;
      EXPECT_EQ(mb.metrics[m.name], m.value) << m.name;
      ++summed;
    } else {
      EXPECT_FALSE(mb.metrics.count(m.name)) << m.name << " is not summable";
      EXPECT_EQ(*adapter.step_extrema().get(m.name), m.value) << m.name;
    }
  }
  EXPECT_EQ(mb.metrics.size(), summed);
  EXPECT_TRUE(mb.metrics.count("is_oob_ratio"));
  adapter.reset_step();
  EXPECT_TRUE(adapter.step_extrema().items().empty());
}

TEST(LossAdapter, TwoMicroBatchesSumToTheWholeBatch) {
  const Fixture s = setup(32);
  const ClippedPGConfig cfg = busy_config();
  const RefBatch& B = s.c.batch;
  LossAdapter whole_adapter(cfg);
  AbiMicroBatch whole(s.p, B, {});
  ASSERT_EQ(whole.run(whole_adapter), nullptr);

  LossAdapter split_adapter(cfg);
  // Global positive-token count makes the positive-example NLL micro-batch invariant too.
  double pos = 0;
  for (const RefSeq& q : B.seqs)
    for (size_t t = 1; t < q.length(); ++t) pos += q.token_mask[t] * q.sample_mask * (q.reward > 0);
  whole_adapter.set_global_positive_tokens(pos);
  split_adapter.set_global_positive_tokens(pos);
  AbiMicroBatch whole2(s.p, B, {});
  ASSERT_EQ(whole2.run(whole_adapter), nullptr);

  std::map<std::string, double> sum;
  double loss = 0;
  for (const std::vector<int>& chunk : {std::vector<int>{4, 0, 2}, {6, 1, 5, 3}}) {
    const Packed p = pack(B, s.c.lp, chunk);
    AbiMicroBatch mb(p, B, {});
    ASSERT_EQ(mb.run(split_adapter), nullptr);
    loss += mb.loss();
    for (const auto& [k, v] : mb.metrics) sum[k] += v;
  }
  EXPECT_NEAR(loss, whole2.loss(), 1e-6 * std::abs(whole2.loss()) + 1e-7);
  ASSERT_EQ(sum.size(), whole2.metrics.size());
  for (const auto& [k, v] : whole2.metrics) EXPECT_NEAR(sum[k], v, 1e-12 * std::max(1.0, std::abs(v))) << k;
  const Metrics a = whole_adapter.step_extrema(), b = split_adapter.step_extrema();
  for (const Metric& m : b.items()) EXPECT_EQ(*a.get(m.name), m.value) << m.name;
}

TEST(LossAdapter, AcceptsMixedFieldDtypesAndWritesBf16Gradients) {
  const Fixture s = setup(33);
  ClippedPGConfig cfg;
  LossAdapter adapter(cfg);
  AbiMicroBatch mb(s.p, s.c.batch, {.mixed_dtypes = true, .bf16_grads = true});
  ASSERT_EQ(mb.run(adapter), nullptr);
  Packed r = rounded(s.p);
  r.adv = s.p.adv;  // f64 field: not rounded
  std::vector<double> g(r.num_tokens());
  const LossResult want = clipped_pg_loss(cfg, r.pg_inputs(s.c.batch), g.data());
  EXPECT_EQ(mb.loss(), to_f32(want.loss));
  const std::vector<double> gt = to_token_frame(r.packing(), g);
  for (int64_t t = 0; t < r.num_tokens(); ++t)
    EXPECT_EQ(mb.grad(0, t), from_bf16(to_bf16(to_f32(gt[t])))) << t;
}

TEST(LossAdapter, ReportsMissingAndMalformedInputs) {
  const Fixture s = setup(34);
  auto expect_error = [&](AbiMicroBatch& mb, LossAdapter& a, rlh_code code, const std::string& part) {
    rlh_status* st = mb.run(a);
    ASSERT_NE(st, nullptr) << part;
    EXPECT_EQ(st->code, code) << sdk::status_message(st);
    EXPECT_NE(sdk::status_message(st).find(part), std::string::npos) << sdk::status_message(st);
    rlh_status_destroy(st);
  };
  LossAdapter pg(ClippedPGConfig{});
  {
    AbiMicroBatch mb(s.p, s.c.batch, {});
    mb.drop_field("advantages");
    expect_error(mb, pg, RLH_E_INVALID_ARGUMENT, "batch field 'advantages' (token) is missing");
  }
  {
    AbiMicroBatch mb(s.p, s.c.batch, {});
    mb.field("sample_mask")->tensor.shape[0] = 3;
    expect_error(mb, pg, RLH_E_INVALID_ARGUMENT, "batch field 'sample_mask': expected shape [7], got [3]");
  }
  {
    AbiMicroBatch mb(s.p, s.c.batch, {});
    mb.output(0).tensor.device = sdk::cuda_device(0);
    expect_error(mb, pg, RLH_E_UNIMPLEMENTED, "host (CPU) tensors");
  }
  {
    LossAdapter other(ClippedPGConfig{}, LossAdapterOptions{.logprobs_output = "lp"});
    AbiMicroBatch mb(s.p, s.c.batch, {});
    expect_error(mb, other, RLH_E_INVALID_ARGUMENT, "the loss needs the output 'lp'");
  }
  {
    ClippedPGConfig cfg;
    cfg.positive_example_nll_weight = 0.5;
    LossAdapter nll(cfg);
    AbiMicroBatch mb(s.p, s.c.batch, {});
    mb.drop_field("rewards");
    expect_error(mb, nll, RLH_E_INVALID_ARGUMENT, "batch field 'rewards' (per-sequence) is missing");
  }
  {
    // force_on_policy_ratio and a zero KL coefficient need neither prev nor reference logprobs.
    ClippedPGConfig cfg;
    cfg.force_on_policy_ratio = true;
    cfg.reference_policy_kl_penalty = 0;
    LossAdapter lean(cfg);
    AbiMicroBatch mb(s.p, s.c.batch, {});
    mb.drop_field("prev_logprobs");
    mb.drop_field("reference_policy_logprobs");
    rlh_status* st = mb.run(lean);
    EXPECT_EQ(st, nullptr) << sdk::status_message(st);
    rlh_status_destroy(st);
  }
  ClippedPGConfig gspo_token_level;
  gspo_token_level.sequence_level_importance_ratios = true;
  EXPECT_THROW(LossAdapter{gspo_token_level}, ConfigError);
}

TEST(LossAdapter, SftAndDpo) {
  GenOptions o;
  o.seed = 35;
  o.lengths = {5, 7, 6, 4, 8, 9};
  o.zero_sample_mask_seq = -1;
  const Case c = make_case(o);
  const Packed p = pack(c.batch, c.lp, iota_order(c.batch.seqs.size()));
  const Packed r = rounded(p);

  LossAdapter sft{NllConfig{}};
  AbiMicroBatch mb(p, c.batch, {});
  ASSERT_EQ(mb.run(sft), nullptr);
  std::vector<double> g(r.num_tokens());
  NllInputs in{r.packing(), r.lp.data(), r.tm.data(), r.sm.data(), c.batch.g_tok};
  const LossResult nll = nll_loss(in, g.data());
  EXPECT_EQ(mb.loss(), to_f32(nll.loss));
  std::vector<double> gt = to_token_frame(r.packing(), g);
  for (int64_t t = 0; t < r.num_tokens(); ++t) EXPECT_EQ(mb.grad(0, t), to_f32(gt[t]));
  EXPECT_EQ(mb.metrics["num_unmasked_tokens"], *nll.metrics.get("num_unmasked_tokens"));

  DpoConfig dc;
  dc.sft_loss_weight = 0.3;
  LossAdapter dpo{dc};
  AbiMicroBatch mb2(p, c.batch, {});
  ASSERT_EQ(mb2.run(dpo), nullptr);
  DpoInputs di{r.packing(), r.lp.data(), r.ref.data(), r.tm.data(), r.sm.data(), c.batch.g_seq};
  const LossResult d = dpo_loss(dc, di, g.data());
  EXPECT_EQ(mb2.loss(), to_f32(d.loss));
  gt = to_token_frame(r.packing(), g);
  for (int64_t t = 0; t < r.num_tokens(); ++t) EXPECT_EQ(mb2.grad(0, t), to_f32(gt[t]));
  EXPECT_EQ(mb2.metrics["accuracy"], *d.metrics.get("accuracy"));
}

// Token alignment spelled out on SFT's NLL, whose gradient is -token_mask[t] * sample_mask / G at
// exactly the positions whose token is predicted: never at position 0 of a sequence, whose output
// (a backend writes 0 there) must not enter the loss whatever it holds.
TEST(LossAdapter, OutputsAndGradientsAreTokenAligned) {
  GenOptions o;
  o.seed = 36;
  o.lengths = {4, 1, 6, 3};
  o.zero_sample_mask_seq = 2;
  const Case c = make_case(o);
  Packed p = pack(c.batch, c.lp, iota_order(c.batch.seqs.size()));
  LossAdapter sft{NllConfig{}};
  AbiMicroBatch mb(p, c.batch, {});
  // Garbage where a token-aligned output holds no prediction.
  float* lp = static_cast<float*>(mb.output(0).tensor.data);
  for (size_t k = 0; k < p.order.size(); ++k) lp[p.offsets[k]] = 1e30f;
  ASSERT_EQ(mb.run(sft), nullptr);
  double want_loss = 0;
  for (size_t k = 0; k < p.order.size(); ++k) {
    const RefSeq& q = c.batch.seqs[static_cast<size_t>(p.order[k])];
    for (int64_t j = 0; j < p.offsets[k + 1] - p.offsets[k]; ++j) {
      const int64_t t = p.offsets[k] + j;
      const double w = j == 0 ? 0.0 : q.token_mask[static_cast<size_t>(j)] * q.sample_mask / c.batch.g_tok;
      EXPECT_EQ(mb.grad(0, t), to_f32(-w)) << "sequence " << k << " position " << j;
      if (j > 0) want_loss -= w * static_cast<double>(lp[t]);
      // The output at token-aligned position j is the case's output-frame entry j-1.
      if (j > 0) {
        EXPECT_EQ(lp[t], to_f32(c.lp[static_cast<size_t>(p.order[k])][static_cast<size_t>(j - 1)]));
      }
    }
  }
  EXPECT_NEAR(mb.loss(), want_loss, 1e-6 * std::abs(want_loss));
}

TEST(LossAdapter, EmptyMicroBatchWritesZeroLoss) {
  Packed p;
  p.offsets = {0};
  RefBatch B;
  LossAdapter a(ClippedPGConfig{});
  AbiMicroBatch mb(p, B, {});
  ASSERT_EQ(mb.run(a), nullptr);
  EXPECT_EQ(mb.loss(), 0.0f);
}

}  // namespace
}  // namespace rlh::grpo::test
