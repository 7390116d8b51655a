// The native generator against the Hugging Face fixtures (greedy decoding) and the trainer (the
// engine's processed logprobs of the generated tokens), and its invariances: the same samples
// whatever the batch, the order, the split into calls, the scheduler's limits, chunked prefill
// and preemption, the thread count. Also refit by views and copies, stops, limits and input
// errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "generator_test_util.hpp"
#include "kernels_cpu_abi.hpp"
#include "rlhost/model/llama_family.hpp"
#include "rlhost/sdk/safetensors.hpp"
#include "rlhost/sdk/status.hpp"

using namespace rlh;
using namespace rlh::gen;
using namespace rlh::gen::test;

namespace {

// Skips (with the reason printed) what the fixture test cannot run: an architecture no table
// lists, or layers this generator does not execute yet.
std::unique_ptr<Generator> fixture_generator(const std::string& dir, sdk::TransformerDesc* desc_out,
                                             std::vector<std::vector<float>>* weights_out, std::string* skip,
                                             const Options& opt = gen_options()) {
  std::ifstream in(dir + "/config.json");
  const nlohmann::json cfg = nlohmann::json::parse(in);
  const std::string arch = cfg.value("architectures", nlohmann::json::array({""}))[0];
  if (!model::is_supported_architecture(arch)) {
    *skip = "no architecture table lists " + arch;
    return nullptr;
  }
  sdk::TransformerDesc desc = model::describe_model_dir(dir);
  std::unique_ptr<Generator> g;
  try {
    g = std::make_unique<Generator>(desc, opt);
  } catch (const sdk::Error& e) {
    if (e.code() != RLH_E_UNIMPLEMENTED) throw;
    *skip = arch + ": " + e.what();
    return nullptr;
  }
  const auto ckpt = sdk::st::Checkpoint::open(dir + "/model.safetensors");
  sdk::LoadResult w = sdk::load_weights_f32(desc, ckpt);
  g->weights().load(w.tensors, 0);
  if (desc_out) *desc_out = desc;
  if (weights_out) *weights_out = std::move(w.tensors);
  return g;
}

std::vector<std::vector<int32_t>> rows_of(const std::vector<double>& v, int64_t rows, int64_t cols, int64_t from = 0) {
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = from; c < cols; ++c) out[size_t(r)].push_back(int32_t(v[size_t(r * cols + c)]));
  return out;
}

Out& get(Outs& o, int64_t prompt, int64_t sample) { return o[std::make_pair(prompt, sample)]; }

// ---------------------------------------------------------------------------------------------
// Fixtures: greedy decoding equals Hugging Face's, and logprobs equal the trainer's.

class FixtureGreedy : public ::testing::TestWithParam<std::string> {};

TEST_P(FixtureGreedy, MatchesHuggingFaceAndTrainer) {
  const std::string dir = GetParam();
  const std::string name = std::filesystem::path(dir).filename().string();
  sdk::TransformerDesc desc;
  std::vector<std::vector<float>> weights;
  std::string skip;
  std::unique_ptr<Generator> g = fixture_generator(dir, &desc, &weights, &skip);
  if (!g) GTEST_SKIP() << name << ": " << skip;

  const auto ref = sdk::st::File::open(dir + "/reference.safetensors");
  const auto& pi = ref.at("greedy_prompt");
  const auto& oi = ref.at("greedy_output");
  const int64_t B = pi.shape[0], P = pi.shape[1], T = oi.shape[1];
  const auto prompts = rows_of(ref.read_f64("greedy_prompt"), B, P);
  const auto expected = rows_of(ref.read_f64("greedy_output"), B, T, P);  // the new tokens

  Request r;
  r.sampling.temperature = 0;
  r.max_new_tokens = T - P;  // no stop ids: HF decoded without an EOS stop
  Outs together, alone;
  run(*g, prompts, r, 0, together);
  for (int64_t b = B - 1; b >= 0; --b) run(*g, {prompts[size_t(b)]}, r, b, alone);
  for (int64_t b = 0; b < B; ++b) {
    EXPECT_EQ(get(together, b, 0).ids, expected[size_t(b)]) << name << " prompt " << b;
    EXPECT_TRUE(get(together, b, 0).truncated);
  }
  expect_same(together, alone, name + ": batch of 2 vs one by one");

  engine::Engine eng(desc, rlh::test::engine_options());
  eng.load_parameters(weights);
  const Mismatch m = trainer_mismatch(eng, prompts, 0, together, r.sampling);
  std::printf("%s greedy: mean |dlp| %.3g, max %.3g, token_mult_prob_error %.9f over %lld tokens\n",
              name.c_str(), m.mean_abs, m.max_abs, m.token_mult_prob_error, (long long)m.tokens);
  EXPECT_LT(m.mean_abs, 1e-5);
  EXPECT_LT(m.max_abs, 1e-4);
  EXPECT_LT(m.token_mult_prob_error - 1.0, 1e-5);

  // Sampled with every filter on: the trainer's processed logprobs of the same tokens.
  Request s;
  s.sampling = SamplingParams{0.8, 40, 0.9, 0.0};
  s.samples_per_prompt = 4;
  s.max_new_tokens = 24;
  s.seed = 7;
  Outs sampled;
  run(*g, prompts, s, 0, sampled);
  const Mismatch ms = trainer_mismatch(eng, prompts, 0, sampled, s.sampling);
  std::printf("%s T=0.8 top_k=40 top_p=0.9: mean |dlp| %.3g, max %.3g, token_mult_prob_error %.9f over %lld tokens\n",
              name.c_str(), ms.mean_abs, ms.max_abs, ms.token_mult_prob_error, (long long)ms.tokens);
  EXPECT_LT(ms.mean_abs, 1e-5);
  EXPECT_LT(ms.max_abs, 1e-4);
  EXPECT_LT(ms.token_mult_prob_error - 1.0, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FixtureGreedy, ::testing::ValuesIn(fixture_models()),
                         [](const auto& info) { return fixture_test_name(info.param); });

// The FP8 e4m3 KV cache (vllm_cfg.kv_cache_dtype fp8, scale 1): every key and value rounded to
// 3 mantissa bits, so the logprobs leave the trainer's by FP8's rounding, not by float32's; the
// samples still do not depend on the batch, and the same budget holds four times the tokens.
class FixtureFp8Cache : public ::testing::TestWithParam<std::string> {};

TEST_P(FixtureFp8Cache, StaysNearTheTrainerAndBatchInvariant) {
  const std::string dir = GetParam();
  const std::string name = std::filesystem::path(dir).filename().string();
  sdk::TransformerDesc desc;
  std::vector<std::vector<float>> weights;
  std::string skip;
  Options o = gen_options();
  o.kv_cache_fp8 = true;
  std::unique_ptr<Generator> g = fixture_generator(dir, &desc, &weights, &skip, o);
  if (!g) GTEST_SKIP() << name << ": " << skip;
  const auto ref = sdk::st::File::open(dir + "/reference.safetensors");
  const auto& pi = ref.at("greedy_prompt");
  const int64_t B = pi.shape[0], P = pi.shape[1];
  const auto prompts = rows_of(ref.read_f64("greedy_prompt"), B, P);

  // No top-k / top-p: a token inside the generator's kept set may fall outside the trainer's
  // when the logits differ by more than float32 rounding (its processed logprob is then -inf).
  Request s;
  s.sampling = SamplingParams{0.8, 0, 1.0, 0.0};
  s.samples_per_prompt = 3;
  s.max_new_tokens = 20;
  s.seed = 5;
  Outs together, alone;
  run(*g, prompts, s, 0, together);
  for (int64_t b = B - 1; b >= 0; --b) run(*g, {prompts[size_t(b)]}, s, b, alone);
  expect_same(together, alone, name + ": FP8 cache, batch vs one by one");

  engine::Engine eng(desc, rlh::test::engine_options());
  eng.load_parameters(weights);
  const Mismatch m = trainer_mismatch(eng, prompts, 0, together, s.sampling);
  std::printf("%s FP8 KV cache: mean |dlp| %.3g, max %.3g, token_mult_prob_error %.6f over %lld tokens\n",
              name.c_str(), m.mean_abs, m.max_abs, m.token_mult_prob_error, (long long)m.tokens);
  EXPECT_GT(m.mean_abs, 1e-5) << "as close as the float32 cache: the keys and values were not rounded to FP8";
  // About e4m3's unit roundoff (2^-4): these tiny random models gave mean |dlp| 0.020-0.047
  // and token_mult_prob_error 1.020-1.062 (DeepSeek-V3's MLA the most), against ~1e-7 with
  // the float32 cache (FixtureGreedy).
  EXPECT_LT(m.mean_abs, 0.1);
  EXPECT_LT(m.token_mult_prob_error - 1.0, 0.1);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FixtureFp8Cache, ::testing::ValuesIn(fixture_models()),
                         [](const auto& info) { return fixture_test_name(info.param); });

TEST(Generator, Fp8CacheIsOneByteAnElement) {
  const std::vector<std::string> models = fixture_models();
  ASSERT_FALSE(models.empty());
  const sdk::TransformerDesc desc = model::describe_model_dir(models.front());
  Options o = gen_options();
  Generator f32(desc, o);
  o.kv_cache_fp8 = true;
  Generator f8(desc, o);
  EXPECT_EQ(f32.executor().elem_bytes(), 4);
  EXPECT_EQ(f8.executor().elem_bytes(), 1);  // a quarter of the bytes: four times the tokens of a budget
  EXPECT_NE(f8.executor().name().find("FP8 KV cache"), std::string::npos) << f8.executor().name();
  // An executor of its own (a device's) decides its cache: the option is refused there.
  o.executor = [](DecodeModel& m) { return make_host_executor(m, &rlh::test::cpu_ops()); };
  EXPECT_THROW(Generator(desc, o), sdk::Error);
}

class Invariance : public ::testing::TestWithParam<std::string> {};

TEST_P(Invariance, SamplesDoNotDependOnBatchOrderSplitOrScheduling) {
  const std::string kind = GetParam();
  const Model m = kind == "mla"      ? mla_like()
                  : kind == "moe"    ? moe_like()
                  : kind == "gemma"  ? gemma_like()
                  : kind == "gemma2" ? gemma2_like()
                                     : qwen_like();
  bool has_moe = false, has_mla = false;
  for (const auto& l : m.desc.layers) {
    has_moe = has_moe || l.mlp.kind == sdk::MlpKind::moe;
    has_mla = has_mla || l.attention.kind == sdk::AttentionKind::mla;
  }
  ASSERT_EQ(has_moe, kind == "moe" || kind == "mla");
  ASSERT_EQ(has_mla, kind == "mla");
  // Lengths around the block size and a long prompt that needs several prefill chunks.
  const auto prompts = random_prompts(6, m.desc.vocab_size, 3, {5, 16, 17, 1, 40, 9});
  Request r;
  r.sampling = SamplingParams{1.0, 0, 0.95, 0.0};
  r.samples_per_prompt = 3;
  r.max_new_tokens = 20;
  r.seed = 1234;
  r.step = 5;

  Generator all(m.desc, gen_options());
  all.weights().load(m.weights, 0);
  Outs ref;
  const Stats st_ref = run(all, prompts, r, 100, ref);
  ASSERT_EQ(ref.size(), 18u);
  // Samples 1 and 2 of the 17- and 40-token prompts reuse their sibling's full prompt blocks.
  EXPECT_EQ(st_ref.shared_prompt_tokens, 2 * 16 + 2 * 32);

  // One prompt per call, in reverse order.
  Outs one;
  for (int64_t i = 5; i >= 0; --i) run(all, {prompts[size_t(i)]}, r, 100 + i, one);
  expect_same(ref, one, "one prompt per call");

  // Two calls (as two ranks would make them).
  Outs split;
  run(all, {prompts.begin(), prompts.begin() + 2}, r, 100, split);
  run(all, {prompts.begin() + 2, prompts.end()}, r, 102, split);
  expect_same(ref, split, "split in two calls");

  // Tight limits: 2 slots, 7-token steps (chunked prefill), blocks of 4, and a cache so small
  // that sequences must be preempted and recomputed; on one thread.
  Options tight = gen_options(1);
  tight.max_num_seqs = 2;
  tight.max_num_batched_tokens = 7;
  tight.block_size = 4;
  tight.kv_cache_bytes = int64_t(all.model().kv_layout(4).block_bytes()) * 16;  // 64 tokens
  Generator small(m.desc, tight);
  small.weights().load(m.weights, 0);
  Outs constrained;
  const Stats st = run(small, prompts, r, 100, constrained);
  EXPECT_LE(st.max_running, 2);
  EXPECT_GT(st.preemptions, 0) << "the budget was meant to force preemption";
  EXPECT_LE(st.kv_blocks_peak, 16);
  EXPECT_GT(st.shared_prompt_tokens, 0);
  expect_same(ref, constrained, "2 slots, 7-token steps, preemption, 1 thread");

  // Many slots with a large step budget: everything prefilled at once, on three threads.
  Options wide = gen_options(3);
  wide.max_num_seqs = 64;
  wide.max_num_batched_tokens = 4096;
  wide.block_size = 32;
  Generator big(m.desc, wide);
  big.weights().load(m.weights, 0);
  Outs at_once;
  run(big, prompts, r, 100, at_once);
  expect_same(ref, at_once, "all at once, 3 threads");

  // The keys matter: another seed, step or prompt index gives other samples.
  Outs other_seed, other_index;
  Request r2 = r;
  r2.seed = 1235;
  run(all, prompts, r2, 100, other_seed);
  run(all, prompts, r, 101, other_index);
  int same_seed = 0, same_index = 0;
  for (const auto& [k, o] : ref) {
    same_seed += other_seed[k].ids == o.ids;
    same_index += get(other_index, k.first + 1, k.second).ids == o.ids;
  }
  EXPECT_LT(same_seed, 3);
  EXPECT_LT(same_index, 3);
  // Samples of one prompt differ from each other.
  EXPECT_NE(get(ref, 100, 0).ids, get(ref, 100, 1).ids);
}

INSTANTIATE_TEST_SUITE_P(Models, Invariance, ::testing::Values("dense", "moe", "mla", "gemma", "gemma2"),
                         [](const auto& info) { return info.param; });

class TrainerMatch : public ::testing::TestWithParam<std::string> {};

TEST_P(TrainerMatch, LogprobsMatchTheTrainerUnderEveryFilter) {
  const Model m = GetParam() == "gemma" ? gemma_like() : GetParam() == "gemma2" ? gemma2_like() : qwen_like();
  engine::Engine eng(m.desc, rlh::test::engine_options());
  eng.load_parameters(m.weights);
  Generator g(m.desc, gen_options());
  g.weights().load(m.weights, 0);
  const auto prompts = random_prompts(4, m.desc.vocab_size, 9, {3, 12, 30, 7});
  for (const SamplingParams sp : {SamplingParams{1.0, 0, 1.0, 0.0}, SamplingParams{0.7, 50, 1.0, 0.0},
                                  SamplingParams{1.3, 0, 0.9, 0.0}, SamplingParams{0.9, 20, 0.8, 0.0},
                                  SamplingParams{0.0, 0, 1.0, 0.0}, SamplingParams{2.0, 1, 1.0, 0.0}}) {
    Request r;
    r.sampling = sp;
    r.samples_per_prompt = 4;
    r.max_new_tokens = 32;
    r.seed = 99;
    Outs outs;
    run(g, prompts, r, 0, outs);
    const Mismatch mm = trainer_mismatch(eng, prompts, 0, outs, sp);
    std::printf("T=%.1f top_k=%lld top_p=%.2f: mean |dlp| %.3g, max %.3g, token_mult_prob_error %.9f (%lld tokens)\n",
                sp.temperature, (long long)sp.top_k, sp.top_p, mm.mean_abs, mm.max_abs, mm.token_mult_prob_error,
                (long long)mm.tokens);
    EXPECT_EQ(mm.tokens, 4 * 4 * 32);
    EXPECT_LT(mm.mean_abs, 1e-5);
    EXPECT_LT(mm.max_abs, 1e-4);
    EXPECT_LT(mm.token_mult_prob_error - 1.0, 1e-5);
    if (sp.top_k == 1) {  // top-k 1 is greedy decoding with logprob 0
      for (const auto& [k, o] : outs)
        for (float lp : o.logprobs) EXPECT_EQ(lp, 0.f);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Generator, TrainerMatch, ::testing::Values("qwen", "gemma", "gemma2"),
                         [](const auto& info) { return info.param; });

// ---------------------------------------------------------------------------------------------
// Refit: views of the trainer's weights (may_alias) and copies.

std::vector<rlh_named_tensor> views_of(engine::Engine& eng, std::vector<std::vector<int64_t>>& shapes,
                                       std::vector<std::vector<int64_t>>& strides) {
  const auto& desc = eng.desc();
  std::vector<rlh_named_tensor> out;
  shapes.clear();
  strides.clear();
  shapes.reserve(desc.params.size());
  strides.reserve(desc.params.size());
  for (size_t i = 0; i < desc.params.size(); ++i) {
    const sdk::ParamDesc& p = desc.params[i];
    shapes.push_back(p.shape);
    std::vector<int64_t> st(p.shape.size(), 1);
    for (int d = int(st.size()) - 2; d >= 0; --d) st[size_t(d)] = st[size_t(d) + 1] * p.shape[size_t(d) + 1];
    strides.push_back(st);
    rlh_named_tensor t{};
    t.name = p.hf_names[0].c_str();
    t.tensor.data = eng.param(i).data();
    t.tensor.device = rlh_device{RLH_DEVICE_CPU, 0};
    t.tensor.ndim = int32_t(p.shape.size());
    t.tensor.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
    t.tensor.shape = shapes.back().data();
    t.tensor.strides = strides.back().data();
    out.push_back(t);
  }
  return out;
}

// Refit from "device" memory through a DeviceWeightSink (the CUDA executor's role), checked on
// the host: a sink that labels host memory as cuda:0 and copies the runs it is given into its own
// arena in the engine layout. Every layout of a piece is covered: whole tensors, stacked experts
// (slabs), and a fused parameter's concatenated pieces as strided views of the engine tensor.
struct HostSink final : DeviceWeightSink {
  const sdk::TransformerDesc& desc;
  std::vector<std::vector<float>> arena;  // per parameter, engine layout
  int flushes = 0, puts = 0;
  explicit HostSink(const sdk::TransformerDesc& d) : desc(d) {
    for (const auto& p : d.params) {
      int64_t n = 1;
      for (int64_t x : p.shape) n *= x;
      arena.emplace_back(size_t(n), std::nanf(""));
    }
  }
  rlh_device device() const override { return rlh_device{RLH_DEVICE_CUDA, 0}; }
  void put(size_t i, const rlh_dtype& dt, const void* data, std::span<const WeightRun> runs) override {
    EXPECT_EQ(dt.bits, 32);
    for (const WeightRun& r : runs)
      std::memcpy(arena[i].data() + r.dst, static_cast<const float*>(data) + r.src, size_t(r.count) * 4);
    ++puts;
  }
  void flush() override { ++flushes; }
};

// Every HF piece of m's weights as a "cuda:0" float32 tensor over the host arrays (a sink that
// reads host memory takes them): a stacked piece is its slab, a concatenated one (along columns)
// a strided block of the engine tensor, with its strides kept in `strides`.
std::vector<rlh_named_tensor> fake_device_pieces(const Model& m, std::vector<std::vector<int64_t>>& strides) {
  std::vector<rlh_named_tensor> ts;
  strides.reserve(256);
  for (size_t i = 0; i < m.desc.params.size(); ++i) {
    const sdk::ParamDesc& p = m.desc.params[i];
    for (size_t k = 0; k < p.hf_names.size(); ++k) {
      rlh_named_tensor t{};
      t.name = p.hf_names[k].c_str();
      t.tensor.device = rlh_device{RLH_DEVICE_CUDA, 0};
      t.tensor.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
      t.tensor.ndim = int32_t(p.hf_shapes[k].size());
      t.tensor.shape = const_cast<int64_t*>(p.hf_shapes[k].data());
      int64_t n = 1;
      for (int64_t x : p.hf_shapes[k]) n *= x;
      const float* base = m.weights[i].data();
      if (p.transform == sdk::ParamTransform::stack) {
        t.tensor.data = const_cast<float*>(base + int64_t(k) * n);
      } else if (p.transform == sdk::ParamTransform::concat) {
        strides.push_back({p.shape[1], 1});
        t.tensor.strides = strides.back().data();
        t.tensor.data = const_cast<float*>(base + (k == 0 ? 0 : p.hf_shapes[0][1]));
      } else {
        t.tensor.data = const_cast<float*>(base);
      }
      ts.push_back(t);
    }
  }
  return ts;
}

TEST(Generator, DeviceRefitPlacesEveryPieceLayout) {
  for (const std::string kind : {"dense", "moe", "fused"}) {
    SCOPED_TRACE(kind);
    Model m = kind == "moe" ? moe_like() : qwen_like();
    size_t fused = 0;
    if (kind == "fused") {
      // The first 2-D parameter as two pieces concatenated along its columns (axis 1), as a
      // checkpoint with a fused projection would describe it.
      while (m.desc.params[fused].shape.size() != 2) ++fused;
      sdk::ParamDesc& p = m.desc.params[fused];
      const int64_t O = p.shape[0], I = p.shape[1], I1 = I / 3;
      p.hf_names = {p.hf_names[0] + ".a", p.hf_names[0] + ".b"};
      p.hf_shapes = {{O, I1}, {O, I - I1}};
      p.transform = sdk::ParamTransform::concat;
      p.axis = 1;
    }
    Weights w(m.desc);
    HostSink sink(m.desc);
    w.set_device_sink(&sink);
    std::vector<std::vector<int64_t>> strides;
    const std::vector<rlh_named_tensor> ts = fake_device_pieces(m, strides);
    const size_t half = ts.size() / 2;
    w.update(3, {ts.data(), half}, false);
    EXPECT_FALSE(w.complete());
    w.update(3, {ts.data() + half, ts.size() - half}, false);
    ASSERT_TRUE(w.complete());
    EXPECT_EQ(w.version(), 3);
    EXPECT_EQ(sink.flushes, 2);
    EXPECT_EQ(sink.puts, int(ts.size()));
    for (size_t i = 0; i < m.desc.params.size(); ++i) {
      EXPECT_TRUE(w.on_device(i));
      EXPECT_EQ(w.param(i), nullptr);
      EXPECT_TRUE(sink.arena[i] == m.weights[i]) << m.desc.params[i].name;
    }
    EXPECT_EQ(w.owned_bytes(), 0);  // nothing kept on the host
  }
}

TEST(Generator, DeviceRefitRefusals) {
  const Model m = moe_like();
  std::vector<std::vector<int64_t>> strides;
  const std::vector<rlh_named_tensor> ts = fake_device_pieces(m, strides);
  const auto error_of = [](Weights& w, std::span<const rlh_named_tensor> part) -> std::string {
    try {
      w.update(1, part, false);
    } catch (const sdk::Error& e) {
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
      return e.what();
    }
    return "";
  };
  {  // no sink: a host-only generator (the CPU executor)
    Weights w(m.desc);
    const std::string e = error_of(w, {ts.data(), 1});
    EXPECT_NE(e.find("does not read"), std::string::npos) << e;
  }
  Weights w(m.desc);
  HostSink sink(m.desc);
  w.set_device_sink(&sink);
  rlh_named_tensor other = ts[0];
  other.tensor.device.device_id = 3;
  EXPECT_NE(error_of(w, {&other, 1}).find("does not read"), std::string::npos);
  // One stacked parameter's experts partly from "device" memory, partly from the host.
  std::vector<rlh_named_tensor> mixed = ts;
  for (auto& t : mixed)
    if (std::string(t.name).find(".experts.1.") != std::string::npos) t.tensor.device = rlh_device{RLH_DEVICE_CPU, 0};
  const std::string e = error_of(w, mixed);
  EXPECT_NE(e.find("partly in device memory"), std::string::npos) << e;
  EXPECT_THROW(w.require_complete(), sdk::Error);
  // The same set, whole, then completes and is in force.
  w.update(2, ts, false);
  EXPECT_TRUE(w.complete());
  EXPECT_EQ(w.version(), 2);
}

TEST(Generator, RefitByViewsAndCopies) {
  const Model m = qwen_like();
  engine::Engine eng(m.desc, rlh::test::engine_options());
  eng.load_parameters(m.weights);
  const auto prompts = random_prompts(3, m.desc.vocab_size, 5, {4, 11, 6});
  Request r;
  r.sampling = SamplingParams{0.9, 0, 1.0, 0.0};
  r.samples_per_prompt = 2;
  r.max_new_tokens = 12;

  Generator loaded(m.desc, gen_options());
  loaded.weights().load(m.weights, 0);
  Outs want;
  run(loaded, prompts, r, 0, want);

  Generator g(m.desc, gen_options());  // colocated: no weights until refit
  Outs none;
  try {
    run(g, prompts, r, 0, none);
    FAIL() << "generate without weights must fail";
  } catch (const sdk::Error& e) {
    EXPECT_EQ(e.code(), RLH_E_FAILED_PRECONDITION);
  }

  std::vector<std::vector<int64_t>> shapes, strides;
  std::vector<rlh_named_tensor> views = views_of(eng, shapes, strides);
  // Two buckets: the version is not in force until the second arrives.
  const size_t half = views.size() / 2;
  g.weights().update(3, {views.data(), half}, true);
  EXPECT_THROW(run(g, prompts, r, 0, none), sdk::Error);
  g.weights().update(3, {views.data() + half, views.size() - half}, true);
  EXPECT_EQ(g.weights().owned_bytes(), 0) << "views must not be copied";
  EXPECT_EQ(g.weights().param(0), eng.param(0).data());
  Outs got;
  run(g, prompts, r, 0, got);
  for (auto& [k, o] : got) EXPECT_EQ(o.weight_version, 3);
  for (auto& [k, o] : got) o.weight_version = 0;
  expect_same(want, got, "views of the trainer's weights");

  // A copy (may_alias = 0) does not follow later changes of the source.
  Generator copy(m.desc, gen_options());
  copy.weights().update(1, views, false);
  EXPECT_GT(copy.weights().owned_bytes(), 0);

  // The trainer changes its weights in place (an optimizer step would): the lm/embedding and
  // every norm move. The viewing generator sees them at the next refit, at no copy.
  for (size_t i = 0; i < eng.num_params(); ++i)
    for (float& x : eng.param(i)) x *= 1.25f;
  g.weights().update(4, views, true);
  EXPECT_EQ(g.weights().owned_bytes(), 0);
  Outs after, after_copy;
  run(g, prompts, r, 0, after);
  run(copy, prompts, r, 0, after_copy);
  for (auto& [k, o] : after_copy) o.weight_version = 0;
  expect_same(want, after_copy, "a copy keeps the old weights");
  std::vector<std::vector<float>> scaled = m.weights;
  for (auto& t : scaled)
    for (float& x : t) x *= 1.25f;
  Generator fresh(m.desc, gen_options());
  fresh.weights().load(scaled, 4);
  Outs want_after;
  run(fresh, prompts, r, 0, want_after);
  expect_same(want_after, after, "views after the trainer's update");
  bool changed = false;
  for (const auto& [k, o] : after) changed = changed || o.ids != want.at(k).ids;
  EXPECT_TRUE(changed);

  // Bad updates: an unknown name, a wrong shape, a non-float tensor.
  rlh_named_tensor bad = views[0];
  bad.name = "model.layers.99.nonsense.weight";
  EXPECT_THROW(g.weights().update(5, {&bad, 1}, true), sdk::Error);
  bad = views[0];
  int64_t wrong[2] = {1, 1};
  bad.tensor.shape = wrong;
  EXPECT_THROW(g.weights().update(5, {&bad, 1}, true), sdk::Error);
  bad = views[0];
  bad.tensor.dtype = rlh_dtype{RLH_DTYPE_INT, 32, 1};
  EXPECT_THROW(g.weights().update(5, {&bad, 1}, true), sdk::Error);
}

TEST(Generator, MoeRefitKeepsEveryExpertAView) {
  // The GRPO loop stages each HF tensor in its own buffer: expert pieces do not lie back to back,
  // yet none of them is copied.
  const Model m = moe_like();
  std::vector<std::vector<float>> pieces;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<rlh_named_tensor> ts;
  for (size_t i = 0; i < m.desc.params.size(); ++i) {
    const sdk::ParamDesc& p = m.desc.params[i];
    int64_t n = 1;
    for (int64_t d : p.hf_shapes[0]) n *= d;
    for (size_t k = 0; k < p.hf_names.size(); ++k) {
      ASSERT_NE(p.transform, sdk::ParamTransform::concat);
      const size_t off = p.transform == sdk::ParamTransform::stack ? k * size_t(n) : 0;
      pieces.emplace_back(m.weights[i].begin() + long(off), m.weights[i].begin() + long(off) + n);
      shapes.push_back(p.hf_shapes[k]);
    }
  }
  size_t at = 0;
  for (const sdk::ParamDesc& p : m.desc.params)
    for (size_t k = 0; k < p.hf_names.size(); ++k, ++at) {
      rlh_named_tensor t{};
      t.name = p.hf_names[k].c_str();
      t.tensor.data = pieces[at].data();
      t.tensor.device = rlh_device{RLH_DEVICE_CPU, 0};
      t.tensor.ndim = int32_t(shapes[at].size());
      t.tensor.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
      t.tensor.shape = shapes[at].data();
      ts.push_back(t);
    }
  ASSERT_GT(ts.size(), m.desc.params.size()) << "the model has stacked experts";
  Generator g(m.desc, gen_options());
  g.weights().update(1, ts, true);
  EXPECT_EQ(g.weights().owned_bytes(), 0);
  Generator want(m.desc, gen_options());
  want.weights().load(m.weights, 1);
  const auto prompts = random_prompts(3, m.desc.vocab_size, 4, {7, 20, 3});
  Request r;
  r.sampling = SamplingParams{1.0, 0, 1.0, 0.0};
  r.samples_per_prompt = 2;
  r.max_new_tokens = 12;
  Outs a, b;
  run(g, prompts, r, 0, a);
  run(want, prompts, r, 0, b);
  expect_same(b, a, "expert views apart");
}

TEST(Generator, Bf16RefitIsConvertedIntoOwnedMemory) {
  const Model m = qwen_like();
  Generator g(m.desc, gen_options());
  std::vector<std::vector<uint16_t>> bf(m.weights.size());
  std::vector<std::vector<float>> rounded(m.weights.size());
  std::vector<rlh_named_tensor> ts;
  std::vector<std::vector<int64_t>> shapes;
  shapes.reserve(m.weights.size());
  for (size_t i = 0; i < m.weights.size(); ++i) {
    for (float x : m.weights[i]) {
      uint32_t u;
      std::memcpy(&u, &x, 4);
      const uint16_t h = uint16_t(u >> 16);  // truncation: exact round trip below
      bf[i].push_back(h);
      const uint32_t back = uint32_t(h) << 16;
      float y;
      std::memcpy(&y, &back, 4);
      rounded[i].push_back(y);
    }
    shapes.push_back(m.desc.params[i].shape);
    rlh_named_tensor t{};
    t.name = m.desc.params[i].hf_names[0].c_str();
    t.tensor.data = bf[i].data();
    t.tensor.device = rlh_device{RLH_DEVICE_CPU, 0};
    t.tensor.ndim = int32_t(shapes.back().size());
    t.tensor.dtype = rlh_dtype{RLH_DTYPE_BFLOAT, 16, 1};
    t.tensor.shape = shapes.back().data();
    t.tensor.strides = nullptr;  // DLPack < 1.2 style: compact row-major
    ts.push_back(t);
  }
  g.weights().update(2, ts, true);  // bf16 cannot be a view of fp32 weights: converted
  EXPECT_GT(g.weights().owned_bytes(), 0);
  Generator want(m.desc, gen_options());
  want.weights().load(rounded, 2);
  const auto prompts = random_prompts(2, m.desc.vocab_size, 8, {6, 9});
  Request r;
  r.sampling.temperature = 0;
  r.max_new_tokens = 10;
  Outs a, b;
  run(g, prompts, r, 0, a);
  run(want, prompts, r, 0, b);
  expect_same(b, a, "bf16 refit");
}

// ---------------------------------------------------------------------------------------------
// Stops and limits

TEST(Generator, StopTokensStringsAndLimits) {
  const Model m = qwen_like();
  Generator g(m.desc, gen_options());
  g.weights().load(m.weights, 0);
  const auto prompts = random_prompts(3, m.desc.vocab_size, 21, {5, 8, 3});
  Request r;
  r.sampling = SamplingParams{1.0, 0, 1.0, 0.0};
  r.samples_per_prompt = 2;
  r.max_new_tokens = 40;
  r.seed = 3;
  Outs free_run;
  run(g, prompts, r, 0, free_run);
  for (const auto& [k, o] : free_run) {
    EXPECT_EQ(o.ids.size(), 40u);
    EXPECT_TRUE(o.truncated);
  }

  // Stop token ids: each sample ends at the first occurrence of its chosen stop id, inclusive.
  const Out& base = get(free_run, 1, 0);
  Request rs = r;
  rs.stop_token_ids = {base.ids[10], base.ids[25]};
  Outs stopped;
  run(g, prompts, rs, 0, stopped);
  for (const auto& [k, o] : free_run) {
    size_t end = o.ids.size();
    for (size_t t = 0; t < o.ids.size() && end == o.ids.size(); ++t)
      if (o.ids[t] == rs.stop_token_ids[0] || o.ids[t] == rs.stop_token_ids[1]) end = t + 1;
    const Out& s = stopped[k];
    EXPECT_EQ(s.ids, std::vector<int32_t>(o.ids.begin(), o.ids.begin() + long(end)));
    EXPECT_EQ(s.logprobs, std::vector<float>(o.logprobs.begin(), o.logprobs.begin() + long(end)));
    EXPECT_EQ(s.truncated, end == o.ids.size() && o.ids.size() == 40u &&
                               o.ids.back() != rs.stop_token_ids[0] && o.ids.back() != rs.stop_token_ids[1]);
  }

  // Stop strings over decoded text: three letters spanning token boundaries.
  CharDetok detok;
  Request rt = r;
  rt.detokenizer = &detok;
  const std::string text = detok.decode(base.ids);
  rt.stop_strings = {text.substr(14, 3)};
  Outs by_string;
  run(g, prompts, rt, 0, by_string);
  for (const auto& [k, o] : free_run) {
    size_t end = o.ids.size();
    for (size_t t = 1; t <= o.ids.size(); ++t)
      if (detok.decode({o.ids.data(), t}).find(rt.stop_strings[0]) != std::string::npos) {
        end = t;
        break;
      }
    EXPECT_EQ(by_string[k].ids, std::vector<int32_t>(o.ids.begin(), o.ids.begin() + long(end)))
        << "prompt " << k.first << " sample " << k.second;
  }
  EXPECT_LE(get(by_string, 1, 0).ids.size(), 17u);
  EXPECT_FALSE(get(by_string, 1, 0).truncated);

  // Stop strings need a detokenizer.
  Request no_detok = rt;
  no_detok.detokenizer = nullptr;
  Outs ignored;
  EXPECT_THROW(run(g, prompts, no_detok, 0, ignored), sdk::Error);

  // max_model_len ends samples (truncated) before max_new_tokens.
  Options o = gen_options();
  o.max_model_len = 12;
  Generator capped(m.desc, o);
  capped.weights().load(m.weights, 0);
  Outs short_run;
  run(capped, prompts, r, 0, short_run);
  for (const auto& [k, out] : short_run) {
    EXPECT_EQ(int64_t(out.ids.size()), 12 - int64_t(prompts[size_t(k.first)].size()));
    EXPECT_TRUE(out.truncated);
    EXPECT_EQ(out.ids, std::vector<int32_t>(free_run[k].ids.begin(), free_run[k].ids.begin() + long(out.ids.size())));
  }
}

TEST(Generator, RefusesBadRequests) {
  const Model m = qwen_like();
  Generator g(m.desc, gen_options());
  g.weights().load(m.weights, 0);
  auto code_of = [&](Request r, std::vector<std::vector<int32_t>> prompts) {
    Outs o;
    try {
      run(g, prompts, r, 0, o);
    } catch (const sdk::Error& e) {
      return e.code();
    }
    return RLH_OK;
  };
  Request ok;
  ok.max_new_tokens = 2;
  EXPECT_EQ(code_of(ok, {{1, 2}}), RLH_OK);
  EXPECT_EQ(code_of(ok, {{1, 384}}), RLH_E_INVALID_ARGUMENT);  // outside the vocabulary
  EXPECT_EQ(code_of(ok, {{1, -1}}), RLH_E_INVALID_ARGUMENT);
  EXPECT_EQ(code_of(ok, {{}}), RLH_E_INVALID_ARGUMENT);  // empty prompt
  Request r = ok;
  r.max_new_tokens = 0;
  EXPECT_EQ(code_of(r, {{1}}), RLH_E_INVALID_ARGUMENT);
  r = ok;
  r.sampling.temperature = -1;
  EXPECT_EQ(code_of(r, {{1}}), RLH_E_INVALID_ARGUMENT);
  r = ok;
  r.sampling.top_p = 0;
  EXPECT_EQ(code_of(r, {{1}}), RLH_E_INVALID_ARGUMENT);
  r = ok;
  r.sampling.min_p = 1.5;
  EXPECT_EQ(code_of(r, {{1}}), RLH_E_INVALID_ARGUMENT);
  r = ok;
  r.samples_per_prompt = 0;
  EXPECT_EQ(code_of(r, {{1}}), RLH_E_INVALID_ARGUMENT);
  r = ok;
  r.stop_strings = {""};
  CharDetok d;
  r.detokenizer = &d;
  EXPECT_EQ(code_of(r, {{1}}), RLH_E_INVALID_ARGUMENT);
  // A prompt that leaves no room for a new token.
  Options o = gen_options();
  o.max_model_len = 4;
  Generator capped(m.desc, o);
  capped.weights().load(m.weights, 0);
  Outs out;
  try {
    run(capped, {{1, 2, 3, 4}}, ok, 0, out);
    FAIL();
  } catch (const sdk::Error& e) {
    EXPECT_EQ(e.code(), RLH_E_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("max_model_len"), std::string::npos) << e.what();
  }
  // What the generator does not execute is refused with the reason (the layer program's one
  // answer): here a reward model's value head (score.weight), which has no tokens to sample.
  sdk::TransformerDesc scored = m.desc;
  sdk::ParamDesc score;
  score.name = "score.weight";
  score.shape = {1, scored.hidden_size};
  score.layer = -1;
  score.role = sdk::ParamRole::value_head;
  score.hf_names = {score.name};
  score.hf_shapes = {score.shape};
  scored.params.push_back(score);
  try {
    Generator bad(scored, gen_options());
    FAIL();
  } catch (const sdk::Error& e) {
    EXPECT_EQ(e.code(), RLH_E_UNIMPLEMENTED);
    EXPECT_NE(std::string(e.what()).find("value head"), std::string::npos) << e.what();
  }
  // An activation no executor knows is an inconsistent description.
  sdk::TransformerDesc relu = m.desc;
  relu.layers[1].mlp.hidden_act = "relu_cubed";
  try {
    Generator bad(relu, gen_options());
    FAIL();
  } catch (const sdk::Error& e) {
    EXPECT_EQ(e.code(), RLH_E_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("relu_cubed"), std::string::npos) << e.what();
  }
}

TEST(Generator, CacheBudgetEndsSamplesAndIsReleased) {
  const Model m = qwen_like();
  Options o = gen_options();
  o.block_size = 4;
  Generator probe(m.desc, o);
  o.kv_cache_bytes = probe.model().kv_layout(4).block_bytes() * 5;  // 20 tokens in all
  Generator g(m.desc, o);
  g.weights().load(m.weights, 0);
  Request r;
  r.sampling.temperature = 0;
  r.max_new_tokens = 50;
  Outs outs;
  const Stats st = run(g, {{1, 2, 3, 4, 5, 6}, {7, 8}}, r, 0, outs);
  EXPECT_EQ(get(outs, 0, 0).ids.size(), 14u);  // 6 + 14 = 20 tokens: the whole cache
  EXPECT_EQ(get(outs, 1, 0).ids.size(), 18u);
  EXPECT_TRUE(get(outs, 0, 0).truncated);
  EXPECT_EQ(st.kv_blocks, 5);
  EXPECT_GT(st.preemptions, 0);  // two sequences that each want the whole cache
  Outs too_long;
  EXPECT_THROW(run(g, {std::vector<int32_t>(20, 1)}, r, 0, too_long), sdk::Error);
}

}  // namespace
