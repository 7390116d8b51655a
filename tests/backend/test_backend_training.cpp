// Training through the backend plugins' ABI tables (llama-tiny fixture): a step does not depend on
// micro-batch size or packing, fields reach the loss callback sliced with their tokens, save_state
// -> load_state continues bit for bit, the schedules and weight-decay rules of each backend, the
// outputs, weights in HF naming, and every refusal as one line naming its cause.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "backend_harness.hpp"
#include "rlhost/sdk/safetensors.hpp"

namespace fs = std::filesystem;
using namespace rlh;
using namespace rlh::test;
using json = nlohmann::json;

namespace {

const Host& host() {
  static Host h({"model_llama", "kernels_cpu", "dtensor", "megatron"});
  return h;
}

std::string llama_tiny() { return fixtures_root() + "/llama-tiny"; }
constexpr int32_t kVocab = 512;

// A scratch folder removed at the end of a test.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("rlh_backend_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

// Adam with a plain config, per backend.
json adam_config(const std::string& backend, double lr) {
  if (backend == "dtensor")
    return {{"optimizer", {{"name", "torch.optim.AdamW"}, {"kwargs", {{"lr", lr}, {"weight_decay", 0.01}}}}}};
  return {{"megatron_cfg", {{"optimizer", {{"lr", lr}, {"weight_decay", 0.01}}}}}};
}

// ---------------------------------------------------------------------------------------------
// The batch of the invariance tests: ragged sequences with per-token and per-sequence fields
// whose values say where they came from, so the callback can check the slicing exactly.

const std::vector<int64_t> kLengths = {7, 12, 3, 9, 15, 5, 1, 10};

std::unique_ptr<Batch> field_batch() {
  auto b = random_batch(kLengths, kVocab, 11);
  std::vector<double> tok_index(size_t(b->num_tokens()));
  std::iota(tok_index.begin(), tok_index.end(), 0.0);
  std::vector<float> weight;
  for (int64_t t = 0; t < b->num_tokens(); ++t) weight.push_back(0.5f + float((t * 7) % 5) / 4.0f);
  std::vector<int64_t> seq_index(size_t(b->num_seqs()));
  std::iota(seq_index.begin(), seq_index.end(), 0);
  std::vector<float> seq_scale;
  for (int64_t s = 0; s < b->num_seqs(); ++s) seq_scale.push_back(1.0f + 0.25f * float(s % 3));
  b->add("tok_index", tok_index, {RLH_DTYPE_FLOAT, 64, 1});
  b->add_f32("weight", weight);
  b->add("seq_index", seq_index, {RLH_DTYPE_INT, 64, 1});
  b->add_f32("seq_scale", seq_scale);
  return b;
}

template <class T>
const T* field(const rlh_microbatch& mb, const char* name) {
  for (size_t i = 0; i < mb.batch->num_fields; ++i)
    if (std::strcmp(mb.batch->fields[i].name, name) == 0) return static_cast<const T*>(mb.batch->fields[i].tensor.data);
  throw std::runtime_error(std::string("no field ") + name);
}

// Weighted NLL that also checks each field row belongs to its token / sequence.
Backend::LossBody checked_loss(const Batch& whole, bool pairs = false) {
  return [&whole, pairs](const rlh_microbatch& mb) {
    const rlh_batch& b = *mb.batch;
    const auto* tok_index = field<double>(mb, "tok_index");
    const auto* weight = field<float>(mb, "weight");
    const auto* seq_index = field<int64_t>(mb, "seq_index");
    const auto* seq_scale = field<float>(mb, "seq_scale");
    if (pairs) {
      EXPECT_EQ(b.num_seqs % 2, 0);
      for (int64_t j = 0; j + 1 < b.num_seqs; j += 2) {
        EXPECT_EQ(seq_index[j] % 2, 0);
        EXPECT_EQ(seq_index[j + 1], seq_index[j] + 1);
      }
    }
    float* g = nullptr;
    const float* lp = output(mb, "lp", &g);
    double loss = 0;
    for (int64_t j = 0; j < b.num_seqs; ++j) {
      const int64_t s = seq_index[j];
      EXPECT_EQ(b.seq_offsets[j + 1] - b.seq_offsets[j], whole.offsets()[size_t(s) + 1] - whole.offsets()[size_t(s)]);
      EXPECT_EQ(seq_scale[j], 1.0f + 0.25f * float(s % 3));
      for (int64_t t = b.seq_offsets[j]; t < b.seq_offsets[j + 1]; ++t) {
        const int64_t src = int64_t(tok_index[t]);
        EXPECT_EQ(src, whole.offsets()[size_t(s)] + (t - b.seq_offsets[j])) << "token field row";
        EXPECT_EQ(b.token_ids[t], whole.ids()[size_t(src)]);
        EXPECT_EQ(weight[t], 0.5f + float((src * 7) % 5) / 4.0f);
        if (t == b.seq_offsets[j]) {
          EXPECT_EQ(lp[t], 0.0f) << "position 0 of a sequence";
          continue;
        }
        const double c = double(weight[t]) * double(seq_scale[j]) / double(mb.global_num_tokens);
        loss -= c * lp[t];
        g[t] = float(-c);
      }
    }
    mb.metric(mb.metric_ctx, "tokens", double(b.num_tokens));
    mb.metric(mb.metric_ctx, "micro_batches", 1.0);
    return loss;
  };
}

int64_t predicted(const Batch& b) { return b.num_tokens() - b.num_seqs(); }

class PerBackend : public ::testing::TestWithParam<std::string> {};

// Plain SGD (lr 1) with global-norm clipping: the update is the clipped gradient itself, so weight
// differences are gradient differences (AdamW's first step, lr * g / (|g| + eps), would amplify
// float rounding of gradients near zero into differences of lr), and the clip coefficient depends
// on the norm over every micro-batch.
json sgd_clip_config(const std::string& backend) {
  if (backend == "dtensor")
    return {{"optimizer", {{"name", "torch.optim.SGD"}, {"kwargs", {{"lr", 1.0}}}}}, {"max_grad_norm", 0.05}};
  return {{"megatron_cfg",
           {{"optimizer", {{"optimizer", "sgd"}, {"lr", 1.0}, {"sgd_momentum", 0.0}, {"weight_decay", 0.0}, {"clip_grad", 0.05}}}}}};
}

TEST_P(PerBackend, StepDoesNotDependOnMicroBatchingOrPacking) {
  const std::string name = GetParam();
  auto batch = field_batch();
  struct Variant {
    std::string label;
    Backend::TrainOptions opts;
    json config;
    int64_t micro_batches;
  };
  Backend::TrainOptions one, mb1, mb2, packed, pairs;
  one.micro_batch_tokens = 100000;
  mb1.micro_batch_seqs = 1;
  mb2.micro_batch_seqs = 2;
  // First-fit-decreasing bins of <= 20 tokens over lengths {7,12,3,9,15,5,1,10}:
  // {15,5} {12,7,1} {10,9} {3}.
  packed.micro_batch_tokens = 20;
  pairs = mb1;
  pairs.constraints = RLH_BATCH_KEEP_PAIRS;
  const json base = sgd_clip_config(name);
  json cfg_packing = base;  // bins of <= 24: {15,9} {12,10,1} {7,5,3}
  cfg_packing["sequence_packing"] = {{"enabled", true}, {"train_mb_tokens", 24}, {"logprob_mb_tokens", 24}};
  json cfg_mbs = base;
  cfg_mbs["train_micro_batch_size"] = 3;
  const std::vector<Variant> variants = {
      {"one micro-batch", one, base, 1},
      {"micro_batch_seqs 1", mb1, base, 8},
      {"micro_batch_seqs 2", mb2, base, 4},
      {"micro_batch_tokens 20 (packed)", packed, base, 4},
      {"keep pairs", pairs, base, 4},
      {"config sequence_packing 24", Backend::TrainOptions{}, cfg_packing, 3},
      {"config train_micro_batch_size 3", Backend::TrainOptions{}, cfg_mbs, 3},
  };
  double base_loss = 0, base_norm = 0;
  std::map<std::string, std::vector<float>> w0, base_w;
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.label);
    Backend be(host(), name.c_str(), v.config);
    rlh_model* m = be.load(llama_tiny(), true);
    if (w0.empty()) w0 = be.weights(m);
    const auto r = be.train(m, *batch, predicted(*batch), batch->num_seqs(), checked_loss(*batch, v.label == "keep pairs"), v.opts);
    EXPECT_EQ(r.r.num_micro_batches, v.micro_batches);
    EXPECT_EQ(r.metrics["metrics"]["tokens"].get<double>(), double(batch->num_tokens()));
    EXPECT_EQ(r.metrics["metrics"]["micro_batches"].get<double>(), double(r.r.num_micro_batches));
    EXPECT_LT(r.metrics["clip_coef"].get<double>(), 1.0) << "clipping is active";
    const auto w = be.weights(m);
    if (base_w.empty()) {
      base_loss = r.r.loss;
      base_norm = r.r.grad_norm;
      base_w = w;
      EXPECT_FALSE(w == w0) << "the step moved the weights";
      continue;
    }
    EXPECT_NEAR(r.r.loss, base_loss, 1e-6 * std::fabs(base_loss));
    EXPECT_NEAR(r.r.grad_norm, base_norm, 1e-6 * base_norm);
    double worst = 0, moved = 0;
    for (const auto& [n, values] : w)
      for (size_t i = 0; i < values.size(); ++i) {
        worst = std::max(worst, double(std::fabs(values[i] - base_w[n][i])));
        moved = std::max(moved, double(std::fabs(base_w[n][i] - w0[n][i])));
      }
    // float32 weights near 0.2 are stored to ~1.5e-8: the bound allows that rounding, not a
    // changed update (a lost or doubled micro-batch moves weights by a sizeable share of `moved`).
    EXPECT_LE(worst, 1e-4 * moved) << "largest weight difference after the step (largest update " << moved << ")";
  }
}

TEST_P(PerBackend, SaveLoadStateContinuesBitwise) {
  const std::string name = GetParam();
  // A schedule that depends on the step, and an optimizer with state, per backend.
  json cfg;
  if (name == "dtensor") {
    cfg = adam_config(name, 1e-2);
    cfg["scheduler"] = json::array({{{"name", "torch.optim.lr_scheduler.LinearLR"},
                                     {"kwargs", {{"start_factor", 0.1}, {"end_factor", 1.0}, {"total_iters", 5}}}}});
  } else {
    cfg = {{"megatron_cfg",
            {{"optimizer", {{"optimizer", "sgd"}, {"lr", 0.05}, {"sgd_momentum", 0.9}, {"weight_decay", 0.02}}},
             {"scheduler", {{"lr_warmup_iters", 2}, {"lr_warmup_init", 0.0}, {"lr_decay_style", "cosine"},
                            {"lr_decay_iters", 6}}}}}};
  }
  auto batch = field_batch();
  Backend::TrainOptions o;
  o.micro_batch_seqs = 3;
  TempDir tmp("state_" + name);
  std::vector<double> losses_a, lrs_a;
  std::map<std::string, std::vector<float>> w_a, w_saved;
  {
    Backend be(host(), name.c_str(), cfg);
    rlh_model* m = be.load(llama_tiny(), true);
    for (int s = 0; s < 2; ++s) be.train(m, *batch, predicted(*batch), batch->num_seqs(), checked_loss(*batch), o);
    w_saved = be.weights(m);
    sdk::check(be.api()->save_state(be.raw(), m, tmp.path.c_str()));
    for (int s = 0; s < 3; ++s) {
      const auto r = be.train(m, *batch, predicted(*batch), batch->num_seqs(), checked_loss(*batch), o);
      losses_a.push_back(r.r.loss);
      lrs_a.push_back(r.metrics["lr"].get<double>());
    }
    int64_t v = 0;
    w_a = be.weights(m, &v);
    EXPECT_EQ(v, 5);
  }
  EXPECT_TRUE(fs::exists(tmp.path / "model.safetensors"));
  EXPECT_TRUE(fs::exists(tmp.path / "config.json"));
  EXPECT_TRUE(fs::exists(tmp.path / "optimizer.safetensors"));
  {
    Backend be(host(), name.c_str(), cfg);
    rlh_model* m = be.load(llama_tiny(), true);
    be.train(m, *batch, predicted(*batch), batch->num_seqs(), checked_loss(*batch), o);  // state to be replaced
    sdk::check(be.api()->load_state(be.raw(), m, tmp.path.c_str()));
    int64_t v = 0;
    EXPECT_TRUE(be.weights(m, &v) == w_saved);
    EXPECT_EQ(v, 2);
    for (int s = 0; s < 3; ++s) {
      const auto r = be.train(m, *batch, predicted(*batch), batch->num_seqs(), checked_loss(*batch), o);
      EXPECT_EQ(r.r.loss, losses_a[size_t(s)]) << "step " << s + 2;
      EXPECT_EQ(r.metrics["lr"].get<double>(), lrs_a[size_t(s)]) << "step " << s + 2;
    }
    EXPECT_TRUE(be.weights(m) == w_a) << "weights after the restored run differ";
    // The saved folder is an HF checkpoint too: a frozen model loads it as its weights.
    rlh_model* frozen = be.load(tmp.path.string(), false, "reference");
    EXPECT_TRUE(be.weights(frozen) == w_saved);
  }
}

// The bfloat16 of a float32 by round-to-nearest-even, written here from the definition (not the
// SDK's converter), for finite values.
uint16_t bf16_rne(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// save_dtype bfloat16 (the per-model override the loops pass from checkpointing.model_save_dtype):
// model.safetensors holds the bf16 rounding of the float32 masters bit for bit, config.json says
// bfloat16, the masters sit in master_weights/, and load_state restores them (not the export), so
// the run continues exactly as the uninterrupted one. A bad value is one line naming the key.
TEST_P(PerBackend, Bf16ExportKeepsTheMastersForResume) {
  const std::string name = GetParam();
  const json cfg = name == "dtensor" ? adam_config(name, 1e-2)
                                     : json{{"megatron_cfg", {{"optimizer", {{"optimizer", "sgd"}, {"lr", 0.05},
                                                                             {"sgd_momentum", 0.9}}}}}};
  const std::string bf16 = R"({"save_dtype": "bfloat16"})";
  auto batch = field_batch();
  Backend::TrainOptions o;
  o.micro_batch_seqs = 3;
  TempDir tmp("bf16_state_" + name);
  std::vector<double> losses_a;
  std::map<std::string, std::vector<float>> w_a, w_saved;
  {
    Backend be(host(), name.c_str(), cfg);
    rlh_model* m = be.load(llama_tiny(), true, "policy", bf16);
    for (int s = 0; s < 2; ++s) be.train(m, *batch, predicted(*batch), batch->num_seqs(), checked_loss(*batch), o);
    w_saved = be.weights(m);
    sdk::check(be.api()->save_state(be.raw(), m, tmp.path.c_str()));
    for (int s = 0; s < 2; ++s)
      losses_a.push_back(be.train(m, *batch, predicted(*batch), batch->num_seqs(), checked_loss(*batch), o).r.loss);
    w_a = be.weights(m);
  }
  // The export: every parameter bf16 and the rounding of its master, bit for bit.
  const auto exported = sdk::st::Checkpoint::open(tmp.path.string());
  const auto masters = sdk::st::Checkpoint::open((tmp.path / "master_weights").string());
  size_t params = 0;
  for (const std::string& t : exported.names()) {
    const auto e = exported.at(t), f = masters.at(t);
    if (!w_saved.count(t)) {  // a passthrough tensor: unchanged in both
      EXPECT_EQ(e.info->dtype, f.info->dtype) << t;
      continue;
    }
    ++params;
    ASSERT_EQ(e.info->dtype, sdk::st::DType::BF16) << t;
    ASSERT_EQ(f.info->dtype, sdk::st::DType::F32) << t;
    const auto eb = e.file->data(*e.info);
    const std::vector<float> fv = masters.read_f32(t);
    ASSERT_EQ(eb.size(), fv.size() * 2) << t;
    size_t differ = 0;
    for (size_t i = 0; i < fv.size(); ++i) {
      uint16_t got;
      std::memcpy(&got, eb.data() + 2 * i, 2);
      differ += got != bf16_rne(fv[i]);
    }
    EXPECT_EQ(differ, 0u) << t << ": elements not the bf16 rounding of the master";
  }
  EXPECT_EQ(params, w_saved.size());
  const json hf = json::parse(std::ifstream(tmp.path / "config.json"));
  EXPECT_EQ(hf["torch_dtype"], "bfloat16");
  const json state = json::parse(std::ifstream(tmp.path / "rlhost_state.json"));
  EXPECT_EQ(state["master_weights"], "master_weights");
  EXPECT_EQ(state["weights_dtype"], "bfloat16");
  {
    Backend be(host(), name.c_str(), cfg);
    rlh_model* m = be.load(llama_tiny(), true, "policy", bf16);
    sdk::check(be.api()->load_state(be.raw(), m, tmp.path.c_str()));
    EXPECT_TRUE(be.weights(m) == w_saved) << "load_state did not restore the float32 masters";
    for (int s = 0; s < 2; ++s)
      EXPECT_EQ(be.train(m, *batch, predicted(*batch), batch->num_seqs(), checked_loss(*batch), o).r.loss,
                losses_a[size_t(s)]) << "step " << s + 3;
    EXPECT_TRUE(be.weights(m) == w_a) << "weights after the restored run differ";
    // The export loads as a model of its own: its weights are the bf16-rounded masters.
    rlh_model* frozen = be.load(tmp.path.string(), false, "reference");
    size_t differ = 0;
    for (const auto& [t, v] : be.weights(frozen))
      for (size_t i = 0; i < v.size(); ++i) {
        const uint32_t bits = uint32_t(bf16_rne(w_saved.at(t)[i])) << 16;
        float want;
        std::memcpy(&want, &bits, 4);
        differ += std::memcmp(&want, &v[i], 4) != 0;
      }
    EXPECT_EQ(differ, 0u);
  }
  // Masters that are not float32 are refused by name instead of resuming from rounded weights.
  fs::remove_all(tmp.path / "master_weights");
  fs::create_directories(tmp.path / "master_weights");
  fs::copy_file(tmp.path / "model.safetensors", tmp.path / "master_weights/model.safetensors");
  {
    Backend be(host(), name.c_str(), cfg);
    rlh_model* m = be.load(llama_tiny(), true, "policy", bf16);
    expect_error(be.api()->load_state(be.raw(), m, tmp.path.c_str()), RLH_E_DATA_LOSS, "master_weights");
    rlh_model* bad = nullptr;
    expect_error(be.try_load(llama_tiny(), true, &bad, "policy", R"({"save_dtype": "float16"})"),
                 RLH_E_INVALID_ARGUMENT, "policy.save_dtype");
  }
}

// visit_weights_on (BACKEND 0.2): a model in host memory is visited as visit_weights visits it,
// whatever device the caller can also read; bad arguments are one-line errors.
TEST_P(PerBackend, VisitWeightsOnGivesHostViewsOfAHostModel) {
  Backend be(host(), GetParam().c_str());
  rlh_model* m = be.load(llama_tiny(), true);
  int64_t v0 = -1;
  const auto want = be.weights(m, &v0);
  for (const rlh_device d : {rlh_device{RLH_DEVICE_CPU, 0}, rlh_device{RLH_DEVICE_CUDA, 0}}) {
    std::map<std::string, std::vector<float>> got;
    int64_t v = -2;
    be.visit_on(m, d, [&](const std::string& name, const rlh_tensor& t) {
      EXPECT_EQ(t.device.device_type, RLH_DEVICE_CPU) << name;
      int64_t n = 1;
      for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
      const float* p = static_cast<const float*>(t.data);
      got[name].assign(p, p + n);
    }, &v);
    EXPECT_EQ(v, v0);
    EXPECT_TRUE(got == want) << "device type " << d.device_type;
  }
  auto fn = [](void*, const char*, const rlh_tensor*) -> rlh_status* { return nullptr; };
  rlh_visit_args small{};
  small.struct_size = sizeof(size_t);
  for (const rlh_visit_args* a : {static_cast<const rlh_visit_args*>(nullptr), static_cast<const rlh_visit_args*>(&small)}) {
    rlh_status* s = be.api()->visit_weights_on(be.raw(), m, a, fn, nullptr, nullptr);
    ASSERT_NE(s, nullptr);
    const std::string msg = sdk::status_message(s);
    sdk::StatusPtr owned(s);
    EXPECT_NE(msg.find("rlh_visit_args"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

// data_parallel (BACKEND 0.3): one rank is data-parallel rank 0 of 1; NULL outputs and another
// instance's model are one-line errors. (The layouts under TP/PP/CP are grpo.mp.*'s.)
TEST_P(PerBackend, DataParallelOnOneRankIsRankZeroOfOne) {
  Backend be(host(), GetParam().c_str());
  ASSERT_TRUE(RLH_HAS_FIELD(be.api(), rlh_backend_api, data_parallel) && be.api()->data_parallel != nullptr);
  rlh_model* m = be.load(llama_tiny(), false);
  int32_t rank = -1, size = -1;
  sdk::check(be.api()->data_parallel(be.raw(), m, &rank, &size), "data_parallel");
  EXPECT_EQ(rank, 0);
  EXPECT_EQ(size, 1);
  Backend other(host(), GetParam().c_str());
  rlh_model* theirs = other.load(llama_tiny(), false);
  for (int k = 0; k < 2; ++k) {
    rlh_status* s = k == 0 ? be.api()->data_parallel(be.raw(), m, nullptr, &size)
                           : be.api()->data_parallel(be.raw(), theirs, &rank, &size);
    ASSERT_NE(s, nullptr) << k;
    const std::string msg = sdk::status_message(s);
    sdk::StatusPtr owned(s);
    EXPECT_NE(msg.find(k == 0 ? "data_parallel" : "does not belong"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

TEST_P(PerBackend, RecomputeGivesTheSameStep) {
  const std::string name = GetParam();
  auto batch = field_batch();
  Backend::TrainOptions o;
  o.micro_batch_seqs = 4;
  std::vector<std::map<std::string, std::vector<float>>> w;
  std::vector<double> loss;
  for (bool recompute : {false, true}) {
    json cfg = adam_config(name, 1e-2);
    cfg[name == "dtensor" ? "dtensor_cfg" : "megatron_cfg"]["activation_checkpointing"] = recompute;
    Backend be(host(), name.c_str(), cfg);
    rlh_model* m = be.load(llama_tiny(), true);
    loss.push_back(be.train(m, *batch, predicted(*batch), batch->num_seqs(), checked_loss(*batch), o).r.loss);
    w.push_back(be.weights(m));
  }
  EXPECT_EQ(loss[0], loss[1]);
  EXPECT_TRUE(w[0] == w[1]);
}

INSTANTIATE_TEST_SUITE_P(Backends, PerBackend, ::testing::Values("dtensor", "megatron"));

// ---------------------------------------------------------------------------------------------
// What differs between the backends today: optimizer/schedule keys and weight-decay rules.

// A loss with zero gradients: an update is then weight decay alone (AdamW's moment term is 0).
Backend::LossBody zero_loss() {
  return [](const rlh_microbatch&) { return 0.0; };
}

TEST(BackendConfig, TorchSchedulerListThroughDtensor) {
  json cfg = adam_config("dtensor", 1e-3);
  cfg["scheduler"] = json::array({{{"name", "torch.optim.lr_scheduler.LinearLR"},
                                   {"kwargs", {{"start_factor", 0.1}, {"end_factor", 1.0}, {"total_iters", 3}}}},
                                  {{"name", "torch.optim.lr_scheduler.CosineAnnealingLR"},
                                   {"kwargs", {{"T_max", 4}, {"eta_min", 1e-4}}}},
                                  {{"milestones", {3}}}});
  Backend be(host(), "dtensor", cfg);
  rlh_model* m = be.load(llama_tiny(), true);
  auto batch = random_batch({6, 4}, kVocab, 3);
  const double want[] = {1e-4, 4e-4, 7e-4, 1e-3, 1e-4 + 0.9e-3 * (1 + std::cos(M_PI / 4)) / 2, 1e-4 + 0.9e-3 * 0.5};
  for (int s = 0; s < 6; ++s) {
    const auto r = be.train(m, *batch, 8, 2, zero_loss(), {});
    EXPECT_NEAR(r.metrics["lr"].get<double>(), want[s], 1e-15) << "step " << s;
    EXPECT_EQ(r.metrics["step"].get<int64_t>(), s + 1);
  }
  Backend::TrainOptions o;
  o.learning_rate = 0.25;  // the algorithm's own schedule wins
  EXPECT_EQ(be.train(m, *batch, 8, 2, zero_loss(), o).metrics["lr"].get<double>(), 0.25);
}

TEST(BackendConfig, MegatronWarmupAndDecayThroughMegatron) {
  json cfg = {{"megatron_cfg",
               {{"optimizer", {{"lr", 1e-3}, {"min_lr", 1e-5}, {"weight_decay", 0.1}}},
                {"scheduler", {{"lr_warmup_iters", 2}, {"lr_warmup_init", 1e-4}, {"lr_decay_style", "linear"},
                               {"lr_decay_iters", 6}, {"start_weight_decay", 0.0}, {"end_weight_decay", 0.1},
                               {"weight_decay_incr_style", "linear"}}}}}};
  Backend be(host(), "megatron", cfg);
  rlh_model* m = be.load(llama_tiny(), true);
  auto batch = random_batch({6, 4}, kVocab, 3);
  // Warmup 1e-4 -> 1e-3 over steps 0..2, linear decay to 1e-5 at step 6, then min_lr.
  const double lr[] = {1e-4, 5.5e-4, 1e-3, 1e-3 - 0.99e-3 / 4, 1e-3 - 0.99e-3 / 2, 1e-3 - 0.99e-3 * 3 / 4, 1e-5, 1e-5};
  for (int s = 0; s < 8; ++s) {
    const auto r = be.train(m, *batch, 8, 2, zero_loss(), {});
    EXPECT_NEAR(r.metrics["lr"].get<double>(), lr[s], 1e-15) << "step " << s;
    EXPECT_NEAR(r.metrics["weight_decay"].get<double>(), std::min(1.0, s / 6.0) * 0.1, 1e-15) << "step " << s;
  }
}

TEST(BackendConfig, MegatronLeavesNormsAndBiasesOutOfWeightDecay) {
  const double lr = 0.1, wd = 0.5;
  std::map<std::string, std::map<std::string, std::vector<float>>> before, after;
  for (const char* name : {"dtensor", "megatron"}) {
    json cfg = name == std::string("dtensor")
                   ? json{{"optimizer", {{"name", "torch.optim.AdamW"}, {"kwargs", {{"lr", lr}, {"weight_decay", wd}}}}}}
                   : json{{"megatron_cfg", {{"optimizer", {{"lr", lr}, {"weight_decay", wd}}}}}};
    Backend be(host(), name, cfg);
    rlh_model* m = be.load(llama_tiny(), true);
    auto batch = random_batch({5}, kVocab, 4);
    before[name] = be.weights(m);
    be.train(m, *batch, 4, 1, zero_loss(), {});
    after[name] = be.weights(m);
  }
  for (const char* name : {"dtensor", "megatron"}) {
    for (const auto& [w, values] : before[name]) {
      const bool one_d = w.find("norm") != std::string::npos;
      const bool decays = !one_d || std::string(name) == "dtensor";
      const std::vector<float>& got = after[name][w];
      for (size_t i = 0; i < values.size(); i += 97) {
        const float want = decays ? float(double(values[i]) * (1 - lr * wd)) : values[i];
        EXPECT_NEAR(got[i], want, 1e-6 * std::fabs(want)) << name << " " << w;
      }
    }
  }
}

// megatron_cfg's MoE keys reach the engine: a frozen router neither learns nor decays while the
// experts do, and the load-balancing loss is reported with the step's metrics.
TEST(BackendConfig, MegatronMoeRouterKeys) {
  const std::string mixtral = fixtures_root() + "/mixtral-tiny";
  auto batch = random_batch({9, 14, 6}, 256, 13);
  for (bool freeze : {false, true}) {
    SCOPED_TRACE(freeze ? "frozen router" : "trained router");
    json cfg = {{"megatron_cfg",
                 {{"optimizer", {{"optimizer", "sgd"}, {"lr", 0.1}, {"sgd_momentum", 0.0}, {"weight_decay", 0.1}}},
                  {"freeze_moe_router", freeze},
                  {"moe_router_dtype", "fp64"},
                  {"moe_router_load_balancing_type", "aux_loss"},
                  {"moe_aux_loss_coeff", 0.01}}}};
    Backend be(host(), "megatron", cfg);
    rlh_model* m = be.load(mixtral, true);
    const auto before = be.weights(m);
    const auto r = be.train(m, *batch, predicted(*batch), batch->num_seqs(), nll_loss(), {});
    ASSERT_TRUE(r.metrics.contains("moe/aux_loss")) << r.metrics.dump();
    EXPECT_GT(r.metrics["moe/aux_loss"].get<double>(), 0.0);
    EXPECT_TRUE(r.metrics.contains("moe/max_expert_load"));
    const auto after = be.weights(m);
    int routers = 0;
    for (const auto& [name, w] : before) {
      const bool router = name.find("block_sparse_moe.gate.weight") != std::string::npos;
      routers += router ? 1 : 0;
      if (router && freeze) EXPECT_TRUE(after.at(name) == w) << name << " moved although frozen";
      else EXPECT_FALSE(after.at(name) == w) << name << " did not move";
    }
    EXPECT_GT(routers, 0);
  }
}

// Megatron's aux-loss-free balancing (moe_router_bias_update_rate) would move DeepSeek-V3's
// e_score_correction_bias each step; rlhost keeps the bias as the checkpoint has it, so a positive
// rate is refused for a model with one, and changes nothing (accepted) for a model without
// (NeMo-RL's sft.yaml sets 1e-3 for every model).
TEST(BackendConfig, MegatronExpertBiasUpdateRate) {
  const json rate = {{"megatron_cfg", {{"moe_router_bias_update_rate", 1e-3}}}};
  {
    Backend be(host(), "megatron", rate);
    rlh_model* m = nullptr;
    expect_error(be.try_load(fixtures_root() + "/deepseek-v3-tiny", true, &m), RLH_E_UNIMPLEMENTED,
                 "policy.megatron_cfg.moe_router_bias_update_rate = 0.001");
  }
  for (const char* model : {"mixtral-tiny", "llama-tiny"}) {
    Backend be(host(), "megatron", rate);
    rlh_model* m = nullptr;
    rlh_status* s = be.try_load(fixtures_root() + "/" + model, true, &m);
    EXPECT_EQ(s, nullptr) << model << ": " << rlh::sdk::status_message(s);
    rlh_status_destroy(s);
  }
  {
    Backend be(host(), "megatron", {{"megatron_cfg", {{"moe_router_bias_update_rate", 0.0}}}});
    rlh_model* m = nullptr;
    rlh_status* s = be.try_load(fixtures_root() + "/deepseek-v3-tiny", true, &m);
    EXPECT_EQ(s, nullptr) << rlh::sdk::status_message(s);
    rlh_status_destroy(s);
  }
  const std::string text = json{{"megatron_cfg", {{"moe_router_bias_update_rate", -1}}}}.dump();
  rlh_backend* b = nullptr;
  expect_error(host().backend("megatron")->create(host().services(), text.data(), text.size(), &b),
               RLH_E_INVALID_ARGUMENT, "policy.megatron_cfg.moe_router_bias_update_rate");
  if (b != nullptr) host().backend("megatron")->destroy(b);
}

// Automodel's gate_precision: float64 is the engine's fp64 router, the same as megatron's
// moe_router_dtype: fp64 (bitwise: one engine), and not the fp32 router; other dtypes refused.
TEST(BackendConfig, DtensorGatePrecisionIsTheRouterDtype) {
  const std::string mixtral = fixtures_root() + "/mixtral-tiny";
  auto batch = random_batch({9, 14, 6}, 256, 13);
  auto logprobs = [&](const char* backend, const json& cfg) {
    Backend be(host(), backend, cfg);
    return be.logprobs(be.load(mixtral, false), *batch);
  };
  auto gate = [](const char* dtype) {
    return json{{"dtensor_cfg", {{"automodel_kwargs", {{"backend", {{"gate_precision", dtype}}}}}}}};
  };
  const std::vector<float> fp64 = logprobs("dtensor", gate("float64"));
  EXPECT_EQ(fp64, logprobs("megatron", {{"megatron_cfg", {{"moe_router_dtype", "fp64"}}}}));
  EXPECT_EQ(logprobs("dtensor", gate("torch.float64")), fp64);
  const std::vector<float> fp32 = logprobs("dtensor", gate("float32"));
  EXPECT_EQ(fp32, logprobs("megatron", {{"megatron_cfg", {{"moe_router_dtype", "fp32"}}}}));
  EXPECT_EQ(logprobs("dtensor", json::object()), fp32);
  EXPECT_NE(fp64, fp32) << "the fp64 router gave the fp32 router's bits: the test cannot tell them apart";
  const std::string text = gate("bfloat16").dump();
  rlh_backend* b = nullptr;
  expect_error(host().backend("dtensor")->create(host().services(), text.data(), text.size(), &b), RLH_E_UNIMPLEMENTED,
               "policy.dtensor_cfg.automodel_kwargs.backend.gate_precision = bfloat16");
  if (b != nullptr) host().backend("dtensor")->destroy(b);
}

// Automodel's lm_head_precision (MoE models): float32 is the CPU engine's head already (the same
// bits as without it), bfloat16 and null are the model's precision, other dtypes are refused; on
// the device path, whose head multiplies bf16 operands, float32 is refused for an MoE model
// rather than dropped, and a dense model (which the setting does not touch) is not refused for it.
TEST(BackendConfig, DtensorLmHeadPrecision) {
  const std::string mixtral = fixtures_root() + "/mixtral-tiny";
  auto batch = random_batch({9, 14, 6}, 256, 13);
  auto head = [](const json& dtype, json extra = json::object()) {
    extra["dtensor_cfg"] = {{"moe_parallelizer", {{"lm_head_precision", dtype}}}};
    return extra;
  };
  auto logprobs = [&](const json& cfg) {
    Backend be(host(), "dtensor", cfg);
    return be.logprobs(be.load(mixtral, false), *batch);
  };
  const std::vector<float> plain = logprobs(json::object());
  EXPECT_EQ(logprobs(head("float32")), plain);
  EXPECT_EQ(logprobs(head("torch.float32")), plain);
  EXPECT_EQ(logprobs(head("bfloat16")), plain);
  EXPECT_EQ(logprobs(head(nullptr)), plain);
  const std::string text = head("float16").dump();
  rlh_backend* b = nullptr;
  expect_error(host().backend("dtensor")->create(host().services(), text.data(), text.size(), &b), RLH_E_UNIMPLEMENTED,
               "policy.dtensor_cfg.moe_parallelizer.lm_head_precision = float16");
  if (b != nullptr) host().backend("dtensor")->destroy(b);
  const json on_device = head("float32", {{"precision", "bfloat16"}, {"device", "cuda"}});
  {
    Backend be(host(), "dtensor", on_device);
    rlh_model* m = nullptr;
    expect_error(be.try_load(mixtral, false, &m), RLH_E_UNIMPLEMENTED,
                 "policy.dtensor_cfg.moe_parallelizer.lm_head_precision = float32");
  }
  {
    Backend be(host(), "dtensor", on_device);
    rlh_model* m = nullptr;
    if (rlh_status* s = be.try_load(llama_tiny(), false, &m)) {  // (no usable GPU: refused for that, not the head)
      const std::string msg = status_text(s);
      EXPECT_EQ(msg.find("lm_head_precision"), std::string::npos) << msg;
    }
  }
}

TEST(BackendConfig, PerModelOverridesPatchTheSection) {
  Backend be(host(), "dtensor", adam_config("dtensor", 1e-3));
  rlh_model* a = be.load(llama_tiny(), true, "policy");
  rlh_model* b = be.load(llama_tiny(), true, "critic", R"({"optimizer": {"kwargs": {"lr": 0.5}}})");
  auto batch = random_batch({5}, kVocab, 4);
  EXPECT_EQ(be.train(a, *batch, 4, 1, zero_loss(), {}).metrics["lr"].get<double>(), 1e-3);
  EXPECT_EQ(be.train(b, *batch, 4, 1, zero_loss(), {}).metrics["lr"].get<double>(), 0.5);
}

// ---------------------------------------------------------------------------------------------
// Outputs and weights

TEST(BackendOutputs, KindsAlignmentAndMicroBatching) {
  Backend be(host(), "megatron");
  rlh_model* m = be.load(llama_tiny(), false);
  auto batch = random_batch({9, 4, 13, 2}, kVocab, 5);
  // logprob_at_ids: column 0 = the token itself (so it equals the logprob), column 1 = id 7.
  std::vector<int32_t> at_ids;
  for (int32_t id : batch->ids()) {
    at_ids.push_back(id);
    at_ids.push_back(7);
  }
  batch->add("ids", at_ids, {RLH_DTYPE_INT, 32, 1}, 2);
  const std::vector<rlh_output_spec> specs = {spec(RLH_OUTPUT_LOGPROB_RAW, "raw", 0.7),
                                              spec(RLH_OUTPUT_LOGPROB, "processed", 0.7, 20, 0.9),
                                              spec(RLH_OUTPUT_ENTROPY, "entropy", 0.7),
                                              spec(RLH_OUTPUT_LOGPROB_AT_IDS, "at_ids", 0.7, 0, 1.0, "ids")};
  std::vector<std::vector<float>> out, out_small;
  sdk::check(be.try_forward(m, *batch, specs, out, 0, {1, 1, 1, 2}));
  // Bins of <= 15 tokens, first-fit decreasing: {13, 2} {9, 4}: two sequences each, reordered.
  sdk::check(be.try_forward(m, *batch, specs, out_small, 15, {1, 1, 1, 2}));
  for (int64_t s = 0; s < batch->num_seqs(); ++s)
    for (int64_t t = batch->offsets()[size_t(s)]; t < batch->offsets()[size_t(s) + 1]; ++t) {
      const bool first = t == batch->offsets()[size_t(s)];
      for (size_t k = 0; k < 3; ++k)
        if (first) {
          EXPECT_EQ(out[k][size_t(t)], 0.0f) << "output " << k << " at a sequence start";
        }
      if (first) continue;
      EXPECT_LT(out[0][size_t(t)], 0.0f);
      EXPECT_GT(out[2][size_t(t)], 0.0f);
      // Filtering renormalises over the kept tokens (upward), or drops the token (-inf).
      if (std::isfinite(out[1][size_t(t)])) EXPECT_GE(out[1][size_t(t)], out[0][size_t(t)]);
      else EXPECT_EQ(out[1][size_t(t)], -INFINITY);
      EXPECT_NEAR(out[3][size_t(2 * t)], out[0][size_t(t)], 1e-6);
      EXPECT_LT(out[3][size_t(2 * t + 1)], 0.0f);
      for (size_t k = 0; k < 3; ++k) {
        if (!std::isfinite(out[k][size_t(t)])) EXPECT_EQ(out[k][size_t(t)], out_small[k][size_t(t)]);
        else EXPECT_NEAR(out[k][size_t(t)], out_small[k][size_t(t)], 1e-5 * (1 + std::fabs(out[k][size_t(t)])));
      }
    }
  // A temperature changes the logprobs; an unfiltered LOGPROB is the raw one.
  const std::vector<float> t1 = be.logprobs(m, *batch, 1.0), t07 = be.logprobs(m, *batch, 0.7);
  EXPECT_NE(t1, t07);
  EXPECT_EQ(t07, out[0]);
  std::vector<std::vector<float>> unfiltered;
  sdk::check(be.try_forward(m, *batch, {spec(RLH_OUTPUT_LOGPROB, "lp", 0.7)}, unfiltered));
  EXPECT_EQ(unfiltered[0], out[0]);
}

// Without a KERNELS component the backend runs kernels_cpu linked into the plugin; through the
// registry (the kernels_cpu plugin) the results are bitwise the same.
TEST(BackendOutputs, LinkedKernelsWithoutAKernelsComponent) {
  auto batch = random_batch({9, 4, 13}, kVocab, 6);
  Backend with(host(), "dtensor");
  const std::vector<float> via_registry = with.logprobs(with.load(llama_tiny(), false), *batch);
  Host bare({"model_llama", "dtensor"});
  Backend without(bare, "dtensor");
  EXPECT_EQ(without.logprobs(without.load(llama_tiny(), false), *batch), via_registry);
}

TEST(BackendOutputs, WeightsInHfNamingEqualTheCheckpoint) {
  Backend be(host(), "dtensor");
  rlh_model* m = be.load(llama_tiny(), false);
  int64_t version = -1;
  const auto w = be.weights(m, &version);
  EXPECT_EQ(version, 0);
  const auto ckpt = sdk::st::File::open(llama_tiny() + "/model.safetensors");
  ASSERT_EQ(w.size(), ckpt.tensors().size());
  for (const auto& t : ckpt.tensors()) {
    ASSERT_TRUE(w.count(t.name)) << t.name;
    EXPECT_TRUE(w.at(t.name) == ckpt.read_f32(t.name)) << t.name;
  }
}

TEST(BackendOutputs, SecondSpecOfTheSameOutputGetsItsOwnGradient) {
  // LOGPROB without filtering and LOGPROB_RAW read the same engine output; their gradients add.
  auto batch = random_batch({8, 6}, kVocab, 9);
  std::vector<std::map<std::string, std::vector<float>>> w;
  for (int variant = 0; variant < 2; ++variant) {
    Backend be(host(), "dtensor", adam_config("dtensor", 1e-2));
    rlh_model* m = be.load(llama_tiny(), true);
    Backend::TrainOptions o;
    if (variant == 0) o.specs = {spec(RLH_OUTPUT_LOGPROB_RAW, "lp")};
    else o.specs = {spec(RLH_OUTPUT_LOGPROB, "a"), spec(RLH_OUTPUT_LOGPROB_RAW, "b")};
    auto loss = [variant](const rlh_microbatch& mb) {
      double l = 0;
      for (size_t k = 0; k < mb.num_outputs; ++k) {
        const float* lp = static_cast<const float*>(mb.outputs[k].tensor.data);
        float* g = static_cast<float*>(mb.grads[k].data);
        const double c = variant == 0 ? 1.0 : (k == 0 ? 0.25 : 0.75);  // 0.25 + 0.75 = 1
        for (int64_t t = 0; t < mb.batch->num_tokens; ++t) {
          l -= c * lp[t] / 12.0;
          g[t] = float(-c / 12.0);
        }
      }
      return l;
    };
    be.train(m, *batch, 12, 2, loss, o);
    w.push_back(be.weights(m));
  }
  double worst = 0;
  for (const auto& [n, v] : w[0])
    for (size_t i = 0; i < v.size(); ++i) worst = std::max(worst, double(std::fabs(v[i] - w[1][n][i])));
  EXPECT_LE(worst, 1e-7);
}

// ---------------------------------------------------------------------------------------------
// Refusals: one line naming the cause.

TEST(BackendErrors, ConfigKeys) {
  auto create = [](const char* name, const json& cfg) {
    rlh_backend* b = nullptr;
    const std::string text = cfg.dump();
    rlh_status* s = host().backend(name)->create(host().services(), text.data(), text.size(), &b);
    if (b != nullptr) host().backend(name)->destroy(b);
    return s;
  };
  expect_error(create("dtensor", {{"max_grad_norm", "big"}}), RLH_E_INVALID_ARGUMENT, "policy.max_grad_norm");
  expect_error(create("dtensor", {{"dtensor_cfg", {{"tensor_parallel_size", 2}}}}), RLH_E_UNIMPLEMENTED,
               "policy.dtensor_cfg.tensor_parallel_size = 2");
  expect_error(create("dtensor", {{"optimizer", {{"name", "torch.optim.Adagrad"}}}}), RLH_E_UNIMPLEMENTED,
               "torch.optim.Adagrad");
  expect_error(create("dtensor", {{"dtensor_cfg", {{"enabled", false}}}}), RLH_E_INVALID_ARGUMENT,
               "policy.dtensor_cfg.enabled is false");
  expect_error(create("dtensor", {{"scheduler", {{"name", "torch.optim.lr_scheduler.OneCycleLR"}}}}),
               RLH_E_INVALID_ARGUMENT, "OneCycleLR");
  expect_error(create("dtensor", {{"sequence_packing", {{"enabled", true}}}}), RLH_E_INVALID_ARGUMENT,
               "policy.sequence_packing.train_mb_tokens");
  expect_error(create("megatron", {{"megatron_cfg", {{"virtual_pipeline_model_parallel_size", 4}}}}), RLH_E_INVALID_ARGUMENT,
               "policy.megatron_cfg.virtual_pipeline_model_parallel_size: set to 4 needs "
               "megatron_cfg.pipeline_model_parallel_size > 1");
  expect_error(create("megatron", {{"megatron_cfg", {{"num_layers_in_first_pipeline_stage", 0}}}}), RLH_E_INVALID_ARGUMENT,
               "policy.megatron_cfg.num_layers_in_first_pipeline_stage");
  expect_error(create("megatron", {{"megatron_cfg", {{"optimizer", {{"optimizer", "lion"}}}}}}), RLH_E_INVALID_ARGUMENT,
               "policy.megatron_cfg.optimizer.optimizer");
  // Megatron-Core's precision-aware optimizer states: fp32 is what rlhost keeps, anything else
  // is refused by name (a bf16 moment silently kept in fp32 would train another optimizer).
  expect_error(create("megatron", {{"megatron_cfg", {{"optimizer", {{"use_precision_aware_optimizer", true},
                                                                    {"exp_avg_dtype", "torch.bfloat16"}}}}}}),
               RLH_E_UNIMPLEMENTED, "policy.megatron_cfg.optimizer.exp_avg_dtype = torch.bfloat16");
  expect_error(create("megatron", {{"megatron_cfg", {{"optimizer", {{"main_grads_dtype", "bf16"}}}}}}),
               RLH_E_UNIMPLEMENTED, "policy.megatron_cfg.optimizer.main_grads_dtype = bf16");
  expect_error(create("megatron", {{"megatron_cfg", {{"optimizer", {{"exp_avg_sq_dtype", 8}}}}}}),
               RLH_E_INVALID_ARGUMENT, "policy.megatron_cfg.optimizer.exp_avg_sq_dtype");
  for (const json& fp32 : {json{{"main_params_dtype", "torch.float32"}, {"exp_avg_dtype", "fp32"},
                                {"exp_avg_sq_dtype", "float32"}, {"main_grads_dtype", nullptr}},
                           json{{"use_precision_aware_optimizer", true}}}) {
    rlh_status* s = create("megatron", {{"megatron_cfg", {{"optimizer", fp32}}}});
    EXPECT_EQ(s, nullptr) << fp32.dump() << ": " << rlh::sdk::status_message(s);
    rlh_status_destroy(s);
  }
  expect_error(create("megatron", {{"megatron_cfg", {{"scheduler", {{"lr_decay_style", "cosine"}}}}}}),
               RLH_E_INVALID_ARGUMENT, "policy.megatron_cfg.scheduler.lr_decay_iters");
  expect_error(create("megatron", {{"sequence_packing", {{"enabled", true}, {"train_mb_tokens", 8}, {"logprob_mb_tokens", 8}}},
                                   {"dynamic_batching", {{"enabled", true}}}}),
               RLH_E_INVALID_ARGUMENT, "both true");
  expect_error(create("megatron", {{"device", "tpu"}}), RLH_E_INVALID_ARGUMENT, "policy.device");
  expect_error(create("dtensor", {{"device", "cuda:x"}}), RLH_E_INVALID_ARGUMENT, "policy.device");
  expect_error(create("megatron", {{"megatron_cfg", {{"recompute_granularity", "layer"}}}}), RLH_E_INVALID_ARGUMENT,
               "policy.megatron_cfg.recompute_granularity");
  // FP8: the host lets enabled = true through only with an FP8 provider loaded; the backend
  // reads the recipe (the CUDA engine runs it, the CPU engine refuses it at load: below) and
  // refuses what it cannot honour by name. Off (NeMo-RL's default, with its recipe keys) is
  // accepted.
  for (const json& on : {json{{"enabled", true}, {"fp8", "e4m3"}, {"fp8_recipe", "blockwise"}, {"fp8_param", false}},
                         json{{"enabled", true}, {"fp8", "hybrid"}, {"fp8_recipe", "tensorwise"}},
                         json{{"enabled", true}, {"num_layers_at_start_in_bf16", 0}, {"num_layers_at_end_in_bf16", 2}},
                         json{{"enabled", true}, {"fp8", "hybrid"}, {"fp8_recipe", "delayed"}},
                         json{{"enabled", true}, {"fp8_recipe", "delayed"}, {"fp8_amax_history_len", 16},
                              {"fp8_amax_compute_algo", "max"}, {"fp8_margin", 1}},
                         json{{"enabled", true}, {"fp8_recipe", "delayed"}, {"fp8_amax_history_len", nullptr},
                              {"fp8_amax_compute_algo", "most_recent"}, {"fp8_margin", 0}}}) {
    rlh_status* s = create("megatron", {{"megatron_cfg", {{"fp8_cfg", on}}}});
    EXPECT_EQ(s, nullptr) << on.dump() << ": " << rlh::sdk::status_message(s);
    rlh_status_destroy(s);
  }
  auto fp8 = [](json keys) {
    keys["enabled"] = true;
    return json{{"megatron_cfg", {{"fp8_cfg", keys}}}};
  };
  expect_error(create("megatron", fp8({{"fp8", "hybrid"}, {"fp8_recipe", "blockwise"}})), RLH_E_INVALID_ARGUMENT,
               "policy.megatron_cfg.fp8_cfg.fp8");
  expect_error(create("megatron", fp8({{"fp8", "e5m2"}})), RLH_E_INVALID_ARGUMENT, "policy.megatron_cfg.fp8_cfg.fp8");
  expect_error(create("megatron", fp8({{"fp8_recipe", "current"}})), RLH_E_INVALID_ARGUMENT,
               "policy.megatron_cfg.fp8_cfg.fp8_recipe");
  // Delayed scaling's settings: bad values by name, and set with another recipe (where they
  // would change nothing) refused by name too.
  for (const json& bad : {json(0), json(65537), json("long")})
    expect_error(create("megatron", fp8({{"fp8_recipe", "delayed"}, {"fp8_amax_history_len", bad}})),
                 RLH_E_INVALID_ARGUMENT, "policy.megatron_cfg.fp8_cfg.fp8_amax_history_len");
  {
    json k = {{"fp8_recipe", "delayed"}, {"fp8_amax_history_len", 0}};
    expect_error(create("megatron", fp8(k)), RLH_E_INVALID_ARGUMENT, "must be in [1, 65536], got 0");
  }
  expect_error(create("megatron", fp8({{"fp8_recipe", "delayed"}, {"fp8_amax_compute_algo", "mean"}})),
               RLH_E_INVALID_ARGUMENT, "policy.megatron_cfg.fp8_cfg.fp8_amax_compute_algo");
  expect_error(create("megatron", fp8({{"fp8_recipe", "delayed"}, {"fp8_margin", -1}})), RLH_E_INVALID_ARGUMENT,
               "policy.megatron_cfg.fp8_cfg.fp8_margin");
  expect_error(create("megatron", fp8({{"fp8_recipe", "delayed"}, {"fp8_margin", 1.5}})), RLH_E_INVALID_ARGUMENT,
               "policy.megatron_cfg.fp8_cfg.fp8_margin");
  expect_error(create("megatron", fp8({{"fp8_recipe", "blockwise"}, {"fp8_amax_history_len", 4}})),
               RLH_E_INVALID_ARGUMENT, "policy.megatron_cfg.fp8_cfg.fp8_amax_history_len");
  expect_error(create("megatron", fp8({{"fp8_amax_compute_algo", "max"}})), RLH_E_INVALID_ARGUMENT,
               "applies to fp8_recipe = delayed only");
  expect_error(create("megatron", fp8({{"fp8_recipe", "delayed"}, {"fp8_param", true}})), RLH_E_INVALID_ARGUMENT,
               "policy.megatron_cfg.fp8_cfg.fp8_param");
  expect_error(create("megatron", fp8({{"fp8_recipe", "delayed"}, {"fp8_amax_history", 4}})), RLH_E_INVALID_ARGUMENT,
               "policy.megatron_cfg.fp8_cfg.fp8_amax_history");
  // Full recompute would advance the histories twice: refused; selective reruns no linear.
  expect_error(create("megatron", {{"megatron_cfg", {{"activation_checkpointing", true},
                                                     {"fp8_cfg", {{"enabled", true}, {"fp8_recipe", "delayed"}}}}}}),
               RLH_E_INVALID_ARGUMENT, "delayed with full activation recompute");
  {
    rlh_status* s = create("megatron", {{"megatron_cfg", {{"recompute_granularity", "selective"},
                                                          {"fp8_cfg", {{"enabled", true}, {"fp8_recipe", "delayed"}}}}}});
    EXPECT_EQ(s, nullptr) << rlh::sdk::status_message(s);
    rlh_status_destroy(s);
  }
  expect_error(create("megatron", fp8({{"fp8_param", true}})), RLH_E_INVALID_ARGUMENT,
               "policy.megatron_cfg.fp8_cfg.fp8_param");
  expect_error(create("megatron", fp8({{"num_layers_at_end_in_bf16", -1}})), RLH_E_INVALID_ARGUMENT,
               "policy.megatron_cfg.fp8_cfg.num_layers_at_end_in_bf16");
  expect_error(create("megatron", fp8({{"fp8_margin", 0}})), RLH_E_INVALID_ARGUMENT,
               "policy.megatron_cfg.fp8_cfg.fp8_margin");
  for (const json& off : {json(false), json(nullptr)}) {
    rlh_status* s = create("megatron", {{"megatron_cfg", {{"fp8_cfg", {{"enabled", off}, {"fp8", "e4m3"},
                                                                     {"fp8_recipe", "tensorwise"}, {"fp8_param", false}}}}}});
    EXPECT_EQ(s, nullptr) << rlh::sdk::status_message(s);
    rlh_status_destroy(s);
  }
}

// policy.device at load_model: an explicit device the model cannot go to is an error naming why;
// cpu and auto load on any machine (auto takes the GPU only where one is usable, with bfloat16).
TEST(BackendDevice, ChoiceAndRefusals) {
  rlh_model* m = nullptr;
  {
    // FP8 linears are the CUDA engine's: a model on the CPU engine is refused, naming the key.
    Backend be(host(), "megatron", {{"device", "cpu"}, {"megatron_cfg", {{"fp8_cfg", {{"enabled", true}}}}}});
    expect_error(be.try_load(llama_tiny(), true, &m), RLH_E_UNIMPLEMENTED,
                 "fp8_cfg.enabled = true: FP8 linears run on the CUDA engine only");
  }
  {  // dtensor's device path is the CUDA engine too (FSDP on the device under several ranks)
#if RLH_HAVE_CUDA_ENGINE
    Backend be(host(), "dtensor", {{"precision", "bfloat16"}, {"device", "cuda:99"}});
    expect_error(be.try_load(llama_tiny(), true, &m), RLH_E_UNAVAILABLE, "dtensor: policy.device = cuda:99");
#else
    Backend be(host(), "dtensor", {{"precision", "bfloat16"}, {"device", "cuda"}});
    expect_error(be.try_load(llama_tiny(), true, &m), RLH_E_UNIMPLEMENTED, "has no device path");
#endif
  }
  {  // FSDP's CPU offload on a device that is not there: the device's error, not the key's
    Backend be(host(), "dtensor", {{"precision", "bfloat16"}, {"device", "cuda:99"},
                                   {"dtensor_cfg", {{"cpu_offload", true}}}});
#if RLH_HAVE_CUDA_ENGINE
    expect_error(be.try_load(llama_tiny(), true, &m), RLH_E_UNAVAILABLE, "dtensor: policy.device = cuda:99");
#else
    expect_error(be.try_load(llama_tiny(), true, &m), RLH_E_UNIMPLEMENTED, "has no device path");
#endif
  }
  {  // with policy.device = auto it runs on the CPU engine, where the state is in host memory
    json cfg = adam_config("dtensor", 1e-3);
    cfg["precision"] = "bfloat16";
    cfg["dtensor_cfg"] = {{"cpu_offload", true}};
    Backend be(host(), "dtensor", cfg);
    rlh_model* p = be.load(llama_tiny(), true);
    auto batch = field_batch();
    const auto r = be.train(p, *batch, predicted(*batch), batch->num_seqs(), checked_loss(*batch), {});
    EXPECT_TRUE(r.metrics["updated"].get<bool>());
  }
  {
    Backend be(host(), "megatron", {{"device", "cuda"}});  // float32
    expect_error(be.try_load(llama_tiny(), true, &m), RLH_E_INVALID_ARGUMENT, "set policy.precision = bfloat16");
  }
  {
    Backend be(host(), "megatron", {{"precision", "bfloat16"}, {"device", "cuda:99"}});
#if RLH_HAVE_CUDA_ENGINE
    expect_error(be.try_load(llama_tiny(), true, &m), RLH_E_UNAVAILABLE, "policy.device = cuda:99");
#else  // a build without the CUDA engine
    expect_error(be.try_load(llama_tiny(), true, &m), RLH_E_UNIMPLEMENTED, "has no device path");
#endif
  }
  auto batch = field_batch();
  for (const char* device : {"cpu", "auto"}) {
    json cfg = adam_config("megatron", 1e-3);
    cfg["precision"] = "bfloat16";
    cfg["device"] = device;
    Backend be(host(), "megatron", cfg);
    rlh_model* p = be.load(llama_tiny(), true);
    const auto r = be.train(p, *batch, predicted(*batch), batch->num_seqs(), checked_loss(*batch), {});
    EXPECT_TRUE(r.metrics["updated"].get<bool>()) << device;
  }
}

TEST(BackendErrors, ModelsBatchesAndCallbacks) {
  Backend be(host(), "dtensor", {{"optimizer", nullptr}});
  rlh_model* m = nullptr;
  expect_error(be.try_load(llama_tiny(), true, &m), RLH_E_FAILED_PRECONDITION, "policy.optimizer is null");
  expect_error(be.try_load("/nonexistent/model/dir", false, &m), RLH_E_NOT_FOUND, "/nonexistent/model/dir");
  TempDir gpt2("gpt2");
  std::ofstream(gpt2.path / "config.json") << R"({"architectures": ["GPT2LMHeadModel"], "vocab_size": 8})";
  expect_error(be.try_load(gpt2.path.string(), false, &m), RLH_E_UNIMPLEMENTED, "'GPT2LMHeadModel'");

  m = be.load(llama_tiny(), false);
  Batch bad({5, 600, 7}, {0, 3});
  std::vector<std::vector<float>> out;
  expect_error(be.try_forward(m, bad, {spec(RLH_OUTPUT_LOGPROB_RAW, "lp")}, out), RLH_E_OUT_OF_RANGE,
               "token id 600 at position 1 of sequence 0");
  auto batch = random_batch({4, 3}, kVocab, 2);
  expect_error(be.try_forward(m, *batch, {spec(RLH_OUTPUT_VALUE, "v")}, out), RLH_E_FAILED_PRECONDITION,
               "RLH_OUTPUT_VALUE needs a value head");
  expect_error(be.try_forward(m, *batch, {spec(RLH_OUTPUT_LOGPROB_RAW, "a", 1.0), spec(RLH_OUTPUT_ENTROPY, "b", 2.0)}, out),
               RLH_E_UNIMPLEMENTED, "share a temperature");
  Batch odd({1, 2, 3}, {0, 1, 2, 3});
  odd.add_f32("f", {1, 2});
  expect_error(be.try_forward(m, odd, {spec(RLH_OUTPUT_LOGPROB_RAW, "lp")}, out), RLH_E_INVALID_ARGUMENT,
               "batch field 'f': leading dimension 2");
  Backend::TrainResult r;
  expect_error(be.try_train(m, *batch, 5, 2, nll_loss(), {}, r), RLH_E_FAILED_PRECONDITION, "without RLH_MODEL_TRAINABLE");
  Backend::TrainOptions eval;
  eval.eval_only = true;
  auto failing = [](const rlh_microbatch&) -> double { throw std::runtime_error("advantages are missing"); };
  expect_error(be.try_train(m, *batch, 5, 2, failing, eval, r), RLH_E_INVALID_ARGUMENT,
               "loss callback (micro-batch 0): advantages are missing");
  // The instance stays usable after a failed step.
  EXPECT_EQ(be.try_train(m, *batch, 5, 2, nll_loss(), eval, r), nullptr);
  TempDir empty("empty");
  expect_error(be.api()->load_state(be.raw(), m, empty.path.c_str()), RLH_E_NOT_FOUND, "rlhost_state.json");
  // The state file is input: fields of another type are errors, not json's type_error.
  std::ofstream(empty.path / "rlhost_state.json") << R"({"format": ["rlhost-backend-state"], "step": 1})";
  expect_error(be.api()->load_state(be.raw(), m, empty.path.c_str()), RLH_E_DATA_LOSS, "not an rlhost backend state");
  std::ofstream(empty.path / "rlhost_state.json", std::ios::trunc)
      << R"({"format": "rlhost-backend-state", "step": 1, "architecture": 7})";
  expect_error(be.api()->load_state(be.raw(), m, empty.path.c_str()), RLH_E_FAILED_PRECONDITION,
               "holds a (no architecture) state");
}

}  // namespace
