// librlhost's component handles (host.h, ABI 0.4) through the C API only: token ids, logprobs of a
// padded batch and generation as DLPack tensors in and out, tensors shared and wrapped for legacy
// DLPack consumers and freed by their deleters (ASan/LSan in the sanitizer build), and every bad
// tensor (dtype, rank, device, lengths, ids) as one line naming the argument. The Python package's
// tests (python/tests/test_tensors.py) compare the numbers with `rlhost logprobs` and `generate`.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fixture_util.hpp"
#include "rlhost/host.h"
#include "rlhost/sdk/status.hpp"

namespace {

using rlh::test::fixtures_root;

const std::string kPlugins = RLH_PLUGIN_DIR;

std::string take_error(rlh_status* s, rlh_code* code = nullptr) {
  if (s == nullptr) return "";
  std::string m(s->message, s->message_len);
  if (code != nullptr) *code = s->code;
  rlh_status_destroy(s);
  return m;
}

void ok(rlh_status* s) { ASSERT_EQ(s, nullptr) << take_error(s); }

// Expects an INVALID_ARGUMENT whose one-line message has every part.
void expect_invalid(rlh_status* s, std::initializer_list<std::string> parts) {
  ASSERT_NE(s, nullptr) << "expected an error";
  rlh_code code = RLH_OK;
  const std::string m = take_error(s, &code);
  EXPECT_EQ(code, RLH_E_INVALID_ARGUMENT) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  for (const auto& p : parts) EXPECT_NE(m.find(p), std::string::npos) << "'" << p << "' not in: " << m;
}

// A borrowed view over caller memory.
struct View {
  std::vector<int64_t> shape, strides;
  rlh_tensor t{};
  View(void* data, rlh_dtype dtype, std::vector<int64_t> shp, std::vector<int64_t> str = {})
      : shape(std::move(shp)), strides(std::move(str)) {
    t.data = data;
    t.device = rlh_device{RLH_DEVICE_CPU, 0};
    t.ndim = int32_t(shape.size());
    t.dtype = dtype;
    t.shape = shape.data();
    t.strides = strides.empty() ? nullptr : strides.data();  // NULL: row-major (DLPack < 1.2)
  }
};

constexpr rlh_dtype kI32{RLH_DTYPE_INT, 32, 1}, kI64{RLH_DTYPE_INT, 64, 1}, kF32{RLH_DTYPE_FLOAT, 32, 1};

template <typename T>
std::vector<T> read(const rlh_managed_tensor* m) {
  int64_t n = 1;
  for (int i = 0; i < m->dl_tensor.ndim; ++i) n *= m->dl_tensor.shape[i];
  const T* p = static_cast<const T*>(m->dl_tensor.data);
  return std::vector<T>(p, p + n);
}

struct Capi : ::testing::Test {
  rlhost_t* h = nullptr;
  void SetUp() override {
    ok(rlhost_create(&h));
    rlhost_set_log_level(h, RLH_LOG_ERROR);
    for (const char* p : {"model_llama", "dtensor", "kernels_cpu", "generator", "tokenizer_hf"})
      ok(rlhost_load_plugin(h, (kPlugins + "/lib" + p + ".so").c_str()));
  }
  void TearDown() override { rlhost_destroy(h); }  // closes handles a test left open

  rlhost_model_t* model() {
    rlhost_model_args a{};
    a.struct_size = sizeof a;
    const std::string path = fixtures_root() + "/llama-tiny";
    a.path = path.c_str();
    rlhost_model_t* m = nullptr;
    EXPECT_EQ(take_error(rlhost_model_open(h, &a, &m)), "");
    return m;
  }
  rlh_managed_tensor* logprobs(rlhost_model_t* m, const rlh_tensor* ids, const rlh_tensor* lengths, rlh_status** st) {
    rlhost_logprobs_args a{};
    a.struct_size = sizeof a;
    a.ids = ids;
    a.lengths = lengths;
    a.temperature = 1.0;
    rlh_managed_tensor* out = nullptr;
    *st = rlhost_logprobs(m, &a, &out);
    return out;
  }
};

TEST_F(Capi, TokenizeAndDetokenize) {
  rlhost_tokenizer_t* tok = nullptr;
  ok(rlhost_tokenizer_open(h, (fixtures_root() + "/tokenizer-llama3").c_str(), &tok));
  std::ifstream cases(fixtures_root() + "/tokenizer-llama3/cases.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(cases, line));
  const nlohmann::json c = nlohmann::json::parse(line);
  const std::string text = c["text"];
  rlh_managed_tensor* ids = nullptr;
  ok(rlhost_tokenize(tok, text.data(), text.size(), 0, &ids));
  ASSERT_NE(ids, nullptr);
  EXPECT_EQ(ids->version.major, 1u);
  EXPECT_EQ(ids->dl_tensor.ndim, 1);
  EXPECT_EQ(ids->dl_tensor.dtype.code, RLH_DTYPE_INT);
  EXPECT_EQ(ids->dl_tensor.dtype.bits, 64);
  EXPECT_EQ(ids->dl_tensor.device.device_type, RLH_DEVICE_CPU);
  EXPECT_EQ(read<int64_t>(ids), c["ids"].get<std::vector<int64_t>>());
  std::string back;
  ok(rlhost_detokenize(tok, &ids->dl_tensor, 0, rlh::sdk::write_to_string, &back));
  EXPECT_EQ(back, c["decoded"].get<std::string>());
  // int32, every other element of a buffer (stride 2), a byte offset.
  std::vector<int32_t> spaced = {-1};
  for (int64_t id : read<int64_t>(ids)) spaced.insert(spaced.end(), {int32_t(id), -7});
  View v(spaced.data(), kI32, {int64_t(read<int64_t>(ids).size())}, {2});
  v.t.byte_offset = sizeof(int32_t);
  back.clear();
  ok(rlhost_detokenize(tok, &v.t, 0, rlh::sdk::write_to_string, &back));
  EXPECT_EQ(back, c["decoded"].get<std::string>());
  ids->deleter(ids);
  spaced[1] = -3;
  expect_invalid(rlhost_detokenize(tok, &v.t, 0, rlh::sdk::write_to_string, &back), {"ids[0] = -3"});
  rlhost_tokenizer_close(tok);
}

TEST_F(Capi, LogprobsOfAPaddedBatch) {
  rlhost_model_t* m = model();
  ASSERT_NE(m, nullptr);
  const std::vector<int64_t> a = {5, 17, 42, 9, 300, 2}, b = {7, 8, 9};
  rlh_status* st = nullptr;
  View one(const_cast<int64_t*>(a.data()), kI64, {6});
  rlh_managed_tensor* single = logprobs(m, &one.t, nullptr, &st);
  ok(st);
  std::vector<int32_t> padded = {5, 17, 42, 9, 300, 2, 7, 8, 9, 99, 99, 99};
  std::vector<int64_t> lens = {6, 3};
  View batch(padded.data(), kI32, {2, 6});
  View lengths(lens.data(), kI64, {2}, {1});
  rlh_managed_tensor* both = logprobs(m, &batch.t, &lengths.t, &st);
  ok(st);
  ASSERT_EQ(both->dl_tensor.ndim, 2);
  EXPECT_EQ(both->dl_tensor.shape[0], 2);
  EXPECT_EQ(both->dl_tensor.shape[1], 6);
  EXPECT_EQ(both->dl_tensor.strides[0], 6);
  const std::vector<float> s = read<float>(single), p = read<float>(both);
  EXPECT_EQ(s[0], 0.0f);
  for (int t = 1; t < 6; ++t) {
    EXPECT_LT(s[size_t(t)], 0.0f);
    EXPECT_NEAR(p[size_t(t)], s[size_t(t)], 1e-5) << t;
  }
  EXPECT_EQ(p[6], 0.0f);
  for (int t = 3; t < 6; ++t) EXPECT_EQ(p[size_t(6 + t)], 0.0f) << "padding " << t;
  // Row 1 alone is row 1 of the batch.
  View row(const_cast<int64_t*>(b.data()), kI64, {3});
  rlh_managed_tensor* rb = logprobs(m, &row.t, nullptr, &st);
  ok(st);
  for (int t = 1; t < 3; ++t) EXPECT_NEAR(p[size_t(6 + t)], read<float>(rb)[size_t(t)], 1e-5);
  for (rlh_managed_tensor* x : {single, both, rb}) x->deleter(x);

  // Bad tensors: one line naming the argument.
  std::vector<float> f = {1, 2};
  View wrong_dtype(f.data(), kF32, {2});
  EXPECT_EQ(logprobs(m, &wrong_dtype.t, nullptr, &st), nullptr);
  expect_invalid(st, {"ids", "dtype float32", "int32 or int64"});
  View rank3(padded.data(), kI32, {2, 3, 2});
  logprobs(m, &rank3.t, nullptr, &st);
  expect_invalid(st, {"ids", "rank 3"});
  View on_gpu(padded.data(), kI32, {6});
  on_gpu.t.device = rlh_device{RLH_DEVICE_CUDA, 0};
  logprobs(m, &on_gpu.t, nullptr, &st);
  expect_invalid(st, {"ids", "device type 2 (CUDA)", "CPU"});
  lens[1] = 7;
  logprobs(m, &batch.t, &lengths.t, &st);
  expect_invalid(st, {"lengths[1] = 7", "1..6"});
  View three(lens.data(), kI64, {1});
  logprobs(m, &batch.t, &three.t, &st);
  expect_invalid(st, {"lengths", "1 lengths for 2 rows"});
  View no_rows(padded.data(), kI32, {0, 6});
  rlh_managed_tensor* empty = logprobs(m, &no_rows.t, nullptr, &st);
  ok(st);
  EXPECT_EQ(empty->dl_tensor.shape[0], 0);
  EXPECT_EQ(empty->dl_tensor.shape[1], 6);
  empty->deleter(empty);
  View null_data(nullptr, kI64, {3});
  logprobs(m, &null_data.t, nullptr, &st);
  expect_invalid(st, {"ids", "data is NULL"});
  logprobs(m, nullptr, nullptr, &st);
  expect_invalid(st, {"ids", "NULL tensor"});
  rlhost_logprobs_args old{};
  old.struct_size = sizeof(size_t);
  rlh_managed_tensor* out = nullptr;
  expect_invalid(rlhost_logprobs(m, &old, &out), {"struct_size"});
  rlhost_model_close(m);
}

TEST_F(Capi, ModelAndGeneratorOpenErrorsNameTheirCause) {
  rlhost_model_args a{};
  a.struct_size = sizeof a;
  a.path = "/nonexistent/model";
  rlhost_model_t* m = nullptr;
  rlh_code code = RLH_OK;
  const std::string msg = take_error(rlhost_model_open(h, &a, &m), &code);
  EXPECT_EQ(code, RLH_E_NOT_FOUND) << msg;
  EXPECT_NE(msg.find("/nonexistent/model"), std::string::npos) << msg;
  const std::string llama = fixtures_root() + "/llama-tiny";
  a.path = llama.c_str();
  a.backend = "no_such_backend";
  EXPECT_NE(take_error(rlhost_model_open(h, &a, &m), &code).find("no_such_backend"), std::string::npos);
  EXPECT_EQ(code, RLH_E_NOT_FOUND);
  a.backend = nullptr;
  a.config_json = "[1]";
  a.config_len = 3;
  expect_invalid(rlhost_model_open(h, &a, &m), {"config", "expected a JSON object"});
  EXPECT_EQ(m, nullptr);
}

TEST_F(Capi, GenerateBatchAndSamples) {
  rlhost_generator_args ga{};
  ga.struct_size = sizeof ga;
  const std::string path = fixtures_root() + "/llama-tiny";
  ga.path = path.c_str();
  rlhost_generator_t* g = nullptr;
  ok(rlhost_generator_open(h, &ga, &g));
  std::vector<int64_t> prompts = {5, 17, 42, 7, 8, 0};
  std::vector<int64_t> lens = {3, 2};
  View p(prompts.data(), kI64, {2, 3});
  View l(lens.data(), kI64, {2});
  rlh_sampling sp{};
  sp.struct_size = sizeof sp;
  sp.temperature = 0.8;
  sp.top_p = 1.0;
  sp.max_new_tokens = 5;
  sp.seed = 4;
  rlhost_generate_args a{};
  a.struct_size = sizeof a;
  a.prompt_ids = &p.t;
  a.prompt_lengths = &l.t;
  a.samples_per_prompt = 2;
  a.sampling = &sp;
  a.flags = RLHOST_GENERATE_IGNORE_EOS;
  rlhost_generation out{};
  out.struct_size = sizeof out;
  ok(rlhost_generate(g, &a, &out));
  ASSERT_NE(out.truncated, nullptr);
  const auto ids = read<int64_t>(out.ids), n = read<int64_t>(out.lengths);
  const auto lp = read<float>(out.logprobs);
  const auto tr = read<uint8_t>(out.truncated);
  ASSERT_EQ(out.ids->dl_tensor.shape[0], 4);
  const int64_t L = out.ids->dl_tensor.shape[1];
  EXPECT_EQ(L, 8);
  for (int64_t r = 0; r < 4; ++r) {
    const int64_t plen = lens[size_t(r / 2)];
    EXPECT_EQ(n[size_t(r)], plen + 5) << r;  // EOS ignored: every sample runs to max_new_tokens
    EXPECT_EQ(tr[size_t(r)], 1);
    for (int64_t t = 0; t < plen; ++t) {
      EXPECT_EQ(ids[size_t(r * L + t)], prompts[size_t(r / 2 * 3 + t)]);
      EXPECT_EQ(lp[size_t(r * L + t)], 0.0f);
    }
    for (int64_t t = plen; t < plen + 5; ++t) EXPECT_LT(lp[size_t(r * L + t)], 0.0f);
    for (int64_t t = plen + 5; t < L; ++t) EXPECT_EQ(ids[size_t(r * L + t)], 0);
  }
  for (rlh_managed_tensor* x : {out.ids, out.logprobs, out.lengths, out.truncated}) x->deleter(x);

  // A caller of an older rlhost_generation (no `truncated`) gets the rest and nothing past it.
  struct {
    rlhost_generation g;
    uint64_t sentinel;
  } older{};
  older.g.struct_size = RLH_STRUCT_SIZE(rlhost_generation, lengths);
  older.g.truncated = reinterpret_cast<rlh_managed_tensor*>(0x1);
  ok(rlhost_generate(g, &a, &older.g));
  EXPECT_EQ(older.g.truncated, reinterpret_cast<rlh_managed_tensor*>(0x1));
  for (rlh_managed_tensor* x : {older.g.ids, older.g.logprobs, older.g.lengths}) x->deleter(x);

  a.samples_per_prompt = 0;
  expect_invalid(rlhost_generate(g, &a, &out), {"samples_per_prompt"});
  a.samples_per_prompt = int64_t(1) << 40;
  expect_invalid(rlhost_generate(g, &a, &out), {"samples_per_prompt", "too many"});
  a.samples_per_prompt = 1;
  lens[0] = 0;
  expect_invalid(rlhost_generate(g, &a, &out), {"prompt_lengths[0] = 0"});
  EXPECT_EQ(out.ids, nullptr);
  // Left open: rlhost_destroy closes it (LSan would report a leak otherwise).
}

TEST_F(Capi, SharedAndLegacyTensorsOutliveTheirSource) {
  rlhost_tokenizer_t* tok = nullptr;
  ok(rlhost_tokenizer_open(h, (fixtures_root() + "/tokenizer-llama3").c_str(), &tok));
  rlh_managed_tensor* ids = nullptr;
  ok(rlhost_tokenize(tok, "abc def", 7, 0, &ids));
  const std::vector<int64_t> want = read<int64_t>(ids);
  rlh_managed_tensor* shared = nullptr;
  ok(rlhost_tensor_share(ids, &shared));
  EXPECT_EQ(shared->dl_tensor.data, ids->dl_tensor.data);
  ids->deleter(ids);
  EXPECT_EQ(read<int64_t>(shared), want);  // still owned by `shared`
  rlhost_legacy_tensor* legacy = nullptr;
  ok(rlhost_tensor_to_legacy(shared, &legacy));  // takes `shared`
  EXPECT_EQ(legacy->dl_tensor.ndim, 1);
  EXPECT_EQ(std::vector<int64_t>(static_cast<int64_t*>(legacy->dl_tensor.data),
                                 static_cast<int64_t*>(legacy->dl_tensor.data) + legacy->dl_tensor.shape[0]),
            want);
  legacy->deleter(legacy);  // frees both
  // Only librlhost's own tensors can be shared.
  rlh_managed_tensor foreign{};
  foreign.version = rlh_pack_version{1, 0};
  foreign.deleter = [](rlh_managed_tensor*) {};
  expect_invalid(rlhost_tensor_share(&foreign, &shared), {"not a tensor librlhost made"});
  foreign.version.major = 2;
  rlhost_legacy_tensor* none = nullptr;
  expect_invalid(rlhost_tensor_to_legacy(&foreign, &none), {"major version 2"});
  rlhost_tokenizer_close(tok);
  rlhost_tokenizer_close(nullptr);
  rlhost_model_close(nullptr);
  rlhost_generator_close(nullptr);
}

}  // namespace
