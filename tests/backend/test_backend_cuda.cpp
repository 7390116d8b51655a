// megatron's device path through the plugins' ABI tables (label gpu): policy.device = cuda with
// policy.precision = bfloat16 puts a model on the CUDA engine (bf16 compute, fp32 master weights
// and AdamW on the device). Checked here:
//   - the HF fixtures: forward logprobs and the eval loss in bf16 (<= 1e-2 of the float64
//     references for dense models; MoE models route in bf16 here, where near-tied router scores
//     pick other experts for a few tokens, so only their loss is bounded, at 5e-2: the engine's
//     own test replays the reference routing and holds them to the dense bounds); MLA models are
//     refused by name, and policy.device = auto runs them on the CPU engine instead;
//   - AdamW steps track the fp32 CPU engine (the backend's schedule, weight decay and clipping);
//   - save_state -> load_state continues bit for bit on the device, and a state saved on either
//     path loads on the other (the same files);
//   - selective and full recompute give bitwise the same steps as none;
//   - a frozen model on the device: forward only, train_step refused by name;
//   - FP8 delayed scaling's amax histories saved and restored with the state (bit for bit).
// Without a usable Hopper GPU every test skips with the reason.
#include <filesystem>

#include <cuda_runtime_api.h>

#include "backend_harness.hpp"
#include "gpu_skip.hpp"
#include "rlhost/sdk/safetensors.hpp"

namespace fs = std::filesystem;
using namespace rlh;
using namespace rlh::test;
using json = nlohmann::json;

namespace {

const Host& host() {
  static Host h({"model_llama", "kernels_cpu", "megatron"});
  return h;
}

std::string fixture(const std::string& name) { return fixtures_root() + "/" + name; }

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("rlh_backend_cuda_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

// megatron with Adam on `device`. eps = 1 makes an update proportional to the gradient (with
// 1e-8 the first steps are lr * sign(g), which turns bf16 rounding of tiny gradients into whole
// lr-sized differences), so the device and the CPU engine can be compared.
json config(const std::string& device, double lr = 1e-3) {
  return {{"precision", "bfloat16"},
          {"device", device},
          {"max_grad_norm", 1.0},
          {"megatron_cfg",
           {{"optimizer", {{"lr", lr}, {"weight_decay", 0.1}, {"adam_eps", 1.0}}},
            {"scheduler", {{"lr_warmup_iters", 2}, {"lr_warmup_init", lr / 10}}}}}};
}

std::unique_ptr<Batch> batch512() { return random_batch({7, 12, 3, 9, 15, 5, 1, 10}, 512, 11); }
int64_t predicted(const Batch& b) { return b.num_tokens() - b.num_seqs(); }

using Weights = std::map<std::string, std::vector<float>>;

// Worst over tensors of rel_error(a - base, b - base): how far two updates differ, relative to
// the update.
double update_error(const Weights& a, const Weights& b, const Weights& base, std::string* where) {
  double worst = 0;
  for (const auto& [name, w0] : base) {
    std::vector<double> da, db;
    for (size_t i = 0; i < w0.size(); ++i) {
      da.push_back(double(a.at(name)[i]) - double(w0[i]));
      db.push_back(double(b.at(name)[i]) - double(w0[i]));
    }
    const double e = rel_error(da, db);
    if (e > worst) {
      worst = e;
      *where = name;
    }
  }
  return worst;
}

// ---------------------------------------------------------------------------------------------

TEST(BackendCuda, FixturesInBf16) {
  REQUIRE_GPU();
  int checked = 0;
  for (const std::string& dir : model_folders_under(fixtures_root())) {
    const auto ref = sdk::st::File::open(dir + "/reference.safetensors");
    const int64_t B = ref.at("input_ids").shape[0], T = ref.at("input_ids").shape[1];
    const std::vector<double> ids64 = ref.read_f64("input_ids");
    std::vector<int64_t> off;
    for (int64_t b = 0; b <= B; ++b) off.push_back(b * T);
    Batch batch(std::vector<int32_t>(ids64.begin(), ids64.end()), off);

    std::ifstream cfg_in(dir + "/config.json");
    const nlohmann::json hf = nlohmann::json::parse(cfg_in);
    const bool moe = hf.contains("num_local_experts") || hf.contains("num_experts") || hf.contains("n_routed_experts");
    Backend be(host(), "megatron", config("cuda"));
    rlh_model* m = nullptr;
    rlh_status* s = be.try_load(dir, true, &m);
    if (s != nullptr) {  // beyond the device path: refused by name, and auto runs it on the CPU
      const rlh_code code = s->code;
      const std::string msg = status_text(s);
      EXPECT_EQ(code, RLH_E_UNIMPLEMENTED) << msg;
      EXPECT_NE(msg.find("policy.device = cuda"), std::string::npos) << msg;
      EXPECT_NE(msg.find("not supported on the GPU path"), std::string::npos) << msg;
      Backend cpu(host(), "megatron", config("auto"));
      rlh_model* mc = nullptr;
      EXPECT_EQ(cpu.try_load(dir, false, &mc), nullptr) << dir << " with policy.device = auto";
      std::printf("  %s: refused on the GPU (%s); auto loads it on the CPU engine\n",
                  fs::path(dir).filename().c_str(), msg.c_str());
      continue;
    }
    const std::vector<float> out = be.logprobs(m, batch);
    std::vector<float> lp;
    for (int64_t b = 0; b < B; ++b) {
      EXPECT_EQ(out[size_t(b * T)], 0.0f);
      for (int64_t t = 1; t < T; ++t) lp.push_back(out[size_t(b * T + t)]);
    }
    const double e_lp = rel_error(lp, ref.read_f64("token_logprobs"));
    Backend::TrainOptions eval;
    eval.eval_only = true;
    int64_t v = -1;
    const Weights w0 = be.weights(m);
    const auto r = be.train(m, batch, B * (T - 1), B, nll_loss(), eval);
    const double ref_loss = ref.read_f64("loss")[0];
    const double e_loss = std::fabs(r.r.loss - ref_loss) / std::fabs(ref_loss);
    EXPECT_TRUE(be.weights(m, &v) == w0) << "eval_only moved weights";
    EXPECT_EQ(v, 0);
    EXPECT_FALSE(r.metrics["updated"].get<bool>());
    if (!moe) {
      EXPECT_LE(e_lp, 1e-2) << dir;
    }
    EXPECT_LE(e_loss, moe ? 5e-2 : 1e-2) << dir;
    std::printf("  %s on the GPU through megatron: logprobs %.2e, loss %.2e (bf16 vs float64%s)\n",
                fs::path(dir).filename().c_str(), e_lp, e_loss, moe ? ", the GPU's own routing" : "");
    ++checked;
  }
  EXPECT_GE(checked, 1) << "no dense fixture under " << fixtures_root();
}

TEST(BackendCuda, AdamStepsTrackTheCpuEngine) {
  REQUIRE_GPU();
  auto batch = batch512();
  Backend::TrainOptions o;
  o.micro_batch_seqs = 3;
  std::vector<Weights> w;
  std::vector<std::vector<json>> metrics(2);
  Weights w0;
  for (const char* device : {"cuda", "cpu"}) {
    Backend be(host(), "megatron", config(device));
    rlh_model* m = be.load(fixture("llama-tiny"), true);
    if (w0.empty()) w0 = be.weights(m);
    for (int s = 0; s < 3; ++s)
      metrics[w.size()].push_back(be.train(m, *batch, predicted(*batch), batch->num_seqs(), nll_loss(), o).metrics);
    int64_t v = 0;
    w.push_back(be.weights(m, &v));
    EXPECT_EQ(v, 3) << device;
  }
  for (size_t s = 0; s < 3; ++s) {
    const json &g = metrics[0][s], &c = metrics[1][s];
    EXPECT_NEAR(g["loss"].get<double>(), c["loss"].get<double>(), 1e-2 * std::fabs(c["loss"].get<double>()));
    EXPECT_NEAR(g["grad_norm"].get<double>(), c["grad_norm"].get<double>(), 2e-2 * c["grad_norm"].get<double>());
    for (const char* k : {"lr", "weight_decay", "step", "num_micro_batches", "updated"}) EXPECT_EQ(g[k], c[k]) << k;
  }
  std::string where;
  const double e = update_error(w[0], w[1], w0, &where);
  EXPECT_LE(e, 5e-2) << where;
  std::printf("  3 AdamW steps on the GPU vs the fp32 CPU engine: worst update difference %.2e (%s)\n", e,
              where.c_str());
}

TEST(BackendCuda, SaveLoadContinuesBitwiseAndCrossesPaths) {
  REQUIRE_GPU();
  auto batch = batch512();
  Backend::TrainOptions o;
  o.micro_batch_seqs = 4;
  TempDir gpu_state("gpu"), cpu_state("cpu");
  Weights w_saved, w_a;
  std::vector<double> losses_a;
  {
    Backend be(host(), "megatron", config("cuda"));
    rlh_model* m = be.load(fixture("llama-tiny"), true);
    for (int s = 0; s < 2; ++s) be.train(m, *batch, predicted(*batch), batch->num_seqs(), nll_loss(), o);
    w_saved = be.weights(m);
    sdk::check(be.api()->save_state(be.raw(), m, gpu_state.path.c_str()));
    for (int s = 0; s < 2; ++s)
      losses_a.push_back(be.train(m, *batch, predicted(*batch), batch->num_seqs(), nll_loss(), o).r.loss);
    w_a = be.weights(m);
  }
  ASSERT_TRUE(fs::exists(gpu_state.path / "optimizer.safetensors"));
  {
    Backend be(host(), "megatron", config("cuda"));
    rlh_model* m = be.load(fixture("llama-tiny"), true);
    be.train(m, *batch, predicted(*batch), batch->num_seqs(), nll_loss(), o);  // replaced below
    sdk::check(be.api()->load_state(be.raw(), m, gpu_state.path.c_str()));
    int64_t v = 0;
    EXPECT_TRUE(be.weights(m, &v) == w_saved);
    EXPECT_EQ(v, 2);
    for (int s = 0; s < 2; ++s)
      EXPECT_EQ(be.train(m, *batch, predicted(*batch), batch->num_seqs(), nll_loss(), o).r.loss, losses_a[size_t(s)]);
    EXPECT_TRUE(be.weights(m) == w_a) << "the restored device run differs";
  }
  {  // the GPU's state on the CPU engine, then the CPU engine's state on the GPU
    Backend cpu(host(), "megatron", config("cpu"));
    rlh_model* m = cpu.load(fixture("llama-tiny"), true);
    sdk::check(cpu.api()->load_state(cpu.raw(), m, gpu_state.path.c_str()));
    int64_t v = 0;
    EXPECT_TRUE(cpu.weights(m, &v) == w_saved) << "fp32 master weights crossed to the CPU unchanged";
    EXPECT_EQ(v, 2);
    cpu.train(m, *batch, predicted(*batch), batch->num_seqs(), nll_loss(), o);
    const Weights w_cpu = cpu.weights(m);
    sdk::check(cpu.api()->save_state(cpu.raw(), m, cpu_state.path.c_str()));
    Backend gpu(host(), "megatron", config("cuda"));
    rlh_model* g = gpu.load(fixture("llama-tiny"), true);
    sdk::check(gpu.api()->load_state(gpu.raw(), g, cpu_state.path.c_str()));
    EXPECT_TRUE(gpu.weights(g, &v) == w_cpu);
    EXPECT_EQ(v, 3);
    // The next step continues from the restored moments: it tracks the CPU engine's next step.
    cpu.train(m, *batch, predicted(*batch), batch->num_seqs(), nll_loss(), o);
    gpu.train(g, *batch, predicted(*batch), batch->num_seqs(), nll_loss(), o);
    std::string where;
    const double e = update_error(gpu.weights(g), cpu.weights(m), w_cpu, &where);
    EXPECT_LE(e, 5e-2) << where;
  }
}

TEST(BackendCuda, RecomputeGivesBitwiseTheSameSteps) {
  REQUIRE_GPU();
  auto batch = batch512();
  Backend::TrainOptions o;
  o.micro_batch_seqs = 3;
  std::vector<Weights> w;
  std::vector<std::vector<double>> loss;
  for (const char* granularity : {"none", "selective", "full"}) {
    json cfg = config("cuda");
    if (std::string(granularity) != "none") cfg["megatron_cfg"]["recompute_granularity"] = granularity;
    Backend be(host(), "megatron", cfg);
    rlh_model* m = be.load(fixture("qwen3-tiny"), true);  // q/k norms: every recomputed piece
    loss.emplace_back();
    for (int s = 0; s < 2; ++s)
      loss.back().push_back(be.train(m, *batch, predicted(*batch), batch->num_seqs(), nll_loss(), o).r.loss);
    w.push_back(be.weights(m));
  }
  for (size_t k = 1; k < w.size(); ++k) {
    EXPECT_EQ(loss[k], loss[0]) << "granularity " << k;
    EXPECT_TRUE(w[k] == w[0]) << "granularity " << k;
  }
}

// An MoE model on the device through megatron's MoE keys: the auxiliary loss reaches the step's
// metrics, a frozen router stays put, and the state crosses to the CPU engine (the frozen router
// has no optimizer state on either path).
TEST(BackendCuda, MoeKeysAndStateOnTheDevice) {
  REQUIRE_GPU();
  auto batch = batch512();
  Backend::TrainOptions o;
  o.micro_batch_seqs = 4;
  json cfg = config("cuda");
  cfg["megatron_cfg"]["moe_router_load_balancing_type"] = "aux_loss";
  cfg["megatron_cfg"]["moe_aux_loss_coeff"] = 0.01;
  cfg["megatron_cfg"]["freeze_moe_router"] = true;
  TempDir state("moe");
  Weights w0, w2;
  {
    Backend be(host(), "megatron", cfg);
    rlh_model* m = be.load(fixture("qwen3-moe-tiny"), true);
    w0 = be.weights(m);
    for (int s = 0; s < 2; ++s) {
      const auto r = be.train(m, *batch, predicted(*batch), batch->num_seqs(), nll_loss(), o);
      ASSERT_TRUE(r.metrics.contains("moe/aux_loss")) << r.metrics.dump();
      EXPECT_GT(r.metrics["moe/aux_loss"].get<double>(), 0.0);
    }
    w2 = be.weights(m);
    sdk::check(be.api()->save_state(be.raw(), m, state.path.c_str()));
  }
  int routers = 0, moved = 0;
  for (const auto& [name, w] : w0) {
    if (name.find("mlp.gate.weight") != std::string::npos) {
      ++routers;
      EXPECT_TRUE(w2.at(name) == w) << name << " moved although frozen";
    } else if (w2.at(name) != w) {
      ++moved;
    }
  }
  EXPECT_GT(routers, 0);
  EXPECT_GT(moved, 0);
  json cpu_cfg = cfg;
  cpu_cfg["device"] = "cpu";
  Backend cpu(host(), "megatron", cpu_cfg);
  rlh_model* m = cpu.load(fixture("qwen3-moe-tiny"), true);
  sdk::check(cpu.api()->load_state(cpu.raw(), m, state.path.c_str()));
  int64_t v = 0;
  EXPECT_TRUE(cpu.weights(m, &v) == w2);
  EXPECT_EQ(v, 2);
}

// FP8 delayed scaling's amax histories in the state (fp8_recipe: delayed; an FP8 provider such
// as examples/vendor_fp8 on the plugin path, else the test skips naming why, or fails under
// RLH_EXPECT_FP8_PROVIDER=1): save_state writes this rank's histories and names them in
// rlhost_state.json; load_state into a fresh model continues bit for bit; another history
// length is refused by name; a state without histories (an older one) loads, starting fresh,
// and so does a run without delayed scaling (the saved histories left unused).
TEST(BackendCuda, Fp8DelayedStateContinuesBitwise) {
  REQUIRE_GPU();
  auto batch = batch512();
  Backend::TrainOptions o;
  o.micro_batch_seqs = 4;
  auto fp8_config = [](json fp8) {
    json cfg = config("cuda");
    fp8["enabled"] = true;
    fp8["fp8_recipe"] = "delayed";
    fp8["num_layers_at_start_in_bf16"] = 0;  // llama-tiny's 2 layers both in FP8
    fp8["num_layers_at_end_in_bf16"] = 0;
    cfg["megatron_cfg"]["fp8_cfg"] = fp8;
    return cfg;
  };
  const json cfg = fp8_config({{"fp8_amax_history_len", 4}, {"fp8_amax_compute_algo", "max"}});
  TempDir state("fp8");
  Weights w_a;
  std::vector<double> losses_a;
  {
    Backend be(host(), "megatron", cfg);
    rlh_model* m = nullptr;
    if (rlh_status* s = be.try_load(fixture("llama-tiny"), true, &m)) {
      const std::string why = sdk::status_message(s);
      rlh_status_destroy(s);
      const char* expect = std::getenv("RLH_EXPECT_FP8_PROVIDER");
      if (why.find("fp8_cfg.enabled") == std::string::npos || (expect && std::string(expect) == "1")) FAIL() << why;
      GTEST_SKIP() << why;
    }
    for (int s = 0; s < 3; ++s) be.train(m, *batch, predicted(*batch), batch->num_seqs(), nll_loss(), o);
    sdk::check(be.api()->save_state(be.raw(), m, state.path.c_str()));
    for (int s = 0; s < 2; ++s)
      losses_a.push_back(be.train(m, *batch, predicted(*batch), batch->num_seqs(), nll_loss(), o).r.loss);
    w_a = be.weights(m);
  }
  ASSERT_TRUE(fs::exists(state.path / "fp8_state" / "rank_0.bin"));
  json st;
  {
    std::ifstream in(state.path / "rlhost_state.json");
    st = json::parse(in);
  }
  ASSERT_TRUE(st.contains("fp8_state")) << st.dump();
  EXPECT_EQ(st["fp8_state"]["amax_history_len"], 4);
  EXPECT_EQ(st["fp8_state"]["ranks"], 1);
  auto resumed = [&](const json& c, Weights* w) {
    Backend be(host(), "megatron", c);
    rlh_model* m = be.load(fixture("llama-tiny"), true);
    sdk::check(be.api()->load_state(be.raw(), m, state.path.c_str()));
    std::vector<double> losses;
    for (int s = 0; s < 2; ++s)
      losses.push_back(be.train(m, *batch, predicted(*batch), batch->num_seqs(), nll_loss(), o).r.loss);
    *w = be.weights(m);
    return losses;
  };
  Weights w_b;
  EXPECT_EQ(resumed(cfg, &w_b), losses_a);
  EXPECT_TRUE(w_b == w_a) << "the restored FP8 run differs";
  {  // another history length: refused, naming the key
    Backend be(host(), "megatron", fp8_config({{"fp8_amax_history_len", 8}, {"fp8_amax_compute_algo", "max"}}));
    rlh_model* m = be.load(fixture("llama-tiny"), true);
    rlh_status* s = be.api()->load_state(be.raw(), m, state.path.c_str());
    ASSERT_NE(s, nullptr);
    EXPECT_EQ(s->code, RLH_E_FAILED_PRECONDITION);
    EXPECT_NE(sdk::status_message(s).find("policy.megatron_cfg.fp8_cfg.fp8_amax_history_len is 8"), std::string::npos)
        << sdk::status_message(s);
    rlh_status_destroy(s);
  }
  // A run without delayed scaling loads a state with histories (left unused).
  Weights w_bf16;
  resumed(config("cuda"), &w_bf16);
  // Without the histories (as a state from before they were kept): loads, fresh histories, so
  // the run differs from the uninterrupted one.
  st.erase("fp8_state");
  {
    std::ofstream out(state.path / "rlhost_state.json");
    out << st.dump(2) << "\n";
  }
  Weights w_fresh;
  resumed(cfg, &w_fresh);
  EXPECT_FALSE(w_fresh == w_a) << "fresh histories scale otherwise";
}

// visit_weights_on with the model's own device: views of the fp32 master weights in device
// memory (nothing copied to the host), bitwise what visit_weights copies out, after a step; the
// MoE fixture's experts (stacked pieces, gate and up interleaved on the device) included.
TEST(BackendCuda, VisitWeightsOnGivesDeviceViewsOfTheMasters) {
  REQUIRE_GPU();
  auto batch = batch512();
  Backend::TrainOptions o;
  o.micro_batch_seqs = 4;
  for (const char* name : {"llama-tiny", "qwen3-moe-tiny"}) {
    SCOPED_TRACE(name);
    Backend be(host(), "megatron", config("cuda"));
    rlh_model* m = be.load(fixture(name), true);
    be.train(m, *batch, predicted(*batch), batch->num_seqs(), nll_loss(), o);
    int64_t v0 = -1;
    const Weights want = be.weights(m, &v0);
    Weights got;
    int64_t v = -2, on_device = 0;
    be.visit_on(m, rlh_device{RLH_DEVICE_CUDA, 0}, [&](const std::string& n, const rlh_tensor& t) {
      ASSERT_EQ(t.dtype.code, RLH_DTYPE_FLOAT);
      ASSERT_EQ(t.dtype.bits, 32);
      on_device += t.device.device_type == RLH_DEVICE_CUDA;
      int64_t count = 1;
      for (int i = 0; i < t.ndim; ++i) count *= t.shape[i];
      // Row-major here (the engine's pieces are contiguous): one copy.
      int64_t stride = 1;
      for (int i = t.ndim - 1; i >= 0; --i) {
        if (t.shape[i] != 1) {
          ASSERT_EQ(t.strides[i], stride) << n;
        }
        stride *= t.shape[i];
      }
      std::vector<float>& h = got[n];
      h.resize(size_t(count));
      ASSERT_EQ(cudaMemcpy(h.data(), static_cast<const char*>(t.data) + t.byte_offset, size_t(count) * 4,
                           cudaMemcpyDeviceToHost), cudaSuccess) << n;
    }, &v);
    EXPECT_EQ(v, v0);
    EXPECT_EQ(on_device, int64_t(want.size()));
    EXPECT_TRUE(got == want);
    // Another device's reader gets host views.
    int64_t on_host = 0;
    be.visit_on(m, rlh_device{RLH_DEVICE_CUDA, 5}, [&](const std::string&, const rlh_tensor& t) {
      on_host += t.device.device_type == RLH_DEVICE_CPU;
    });
    EXPECT_EQ(on_host, int64_t(want.size()));
  }
}

TEST(BackendCuda, FrozenModelOnTheDevice) {
  REQUIRE_GPU();
  auto batch = batch512();
  Backend be(host(), "megatron", config("cuda"));
  rlh_model* policy = be.load(fixture("llama-tiny"), true);
  rlh_model* reference = be.load(fixture("llama-tiny"), false, "reference");
  EXPECT_EQ(be.logprobs(policy, *batch), be.logprobs(reference, *batch));
  Backend::TrainResult r;
  Backend::TrainOptions o;
  expect_error(be.try_train(reference, *batch, predicted(*batch), batch->num_seqs(), nll_loss(), o, r),
               RLH_E_FAILED_PRECONDITION, "without RLH_MODEL_TRAINABLE");
  o.eval_only = true;
  expect_error(be.try_train(reference, *batch, predicted(*batch), batch->num_seqs(), nll_loss(), o, r),
               RLH_E_FAILED_PRECONDITION, "frozen on cuda:0");
  rlh_model* m = nullptr;
  expect_error(be.try_load(fixture("llama-tiny"), true, &m, "policy", R"({"device": "cuda:99"})"), RLH_E_UNAVAILABLE,
               "CUDA device 99 does not exist");
}

}  // namespace
