// Weights: fixture checkpoints load into engine buffers that hold exactly the file's values and
// save back byte for byte; bf16/f16 sharded checkpoints round-trip; wrong checkpoints fail with
// the file and tensor named.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>

#include <nlohmann/json.hpp>

#include "model_test_util.hpp"
#include "rlhost/model/llama_family.hpp"

using namespace rlh;
using nlohmann::json;
using sdk::st::Checkpoint;
using sdk::st::DType;
using sdk::st::WriteTensor;
using test::ScratchDir;
namespace fs = std::filesystem;

namespace {

void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  }
}

fs::path fixture(const std::string& name) { return test::fixtures_dir() / name; }

// A copy of a fixture model converted to `dt`, written with `opt` into `dir` (with config.json).
void convert_fixture(const fs::path& src, const fs::path& dir, DType dt, const sdk::st::ShardedWriteOptions& opt) {
  const Checkpoint c = Checkpoint::open(src.string());
  std::vector<std::vector<std::byte>> storage;
  std::vector<WriteTensor> ts;
  storage.reserve(c.names().size());
  for (const auto& name : c.names()) {
    const auto vals = c.read_f32(name);
    std::vector<std::byte> b(vals.size() * sdk::st::dtype_size(dt));
    sdk::st::convert_from_f32(dt, vals.data(), vals.size(), b.data());
    storage.push_back(std::move(b));
    ts.push_back({name, dt, c.at(name).info->shape, {storage.back().data(), storage.back().size()}});
  }
  sdk::st::write_checkpoint(dir.string(), ts, opt);
  json cfg = json::parse(test::read_file(src / "config.json"));
  cfg["torch_dtype"] = dt == DType::BF16 ? "bfloat16" : "float16";
  cfg.erase("dtype");
  test::write_file(dir / "config.json", cfg.dump(2));
}

std::vector<std::string> shard_files(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().find(".safetensors") != std::string::npos) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST(WeightsIo, FixturesLoadExactlyAndSaveByteForByte) {
  int n = 0;
  for (const auto& dir : test::model_fixture_dirs()) {
    SCOPED_TRACE(dir.string());
    auto d = model::describe_model_dir(dir.string());
    const Checkpoint c = Checkpoint::open(dir.string());
    const auto loaded = sdk::load_weights_f32(d, c);
    EXPECT_TRUE(loaded.unused.empty());
    ASSERT_EQ(loaded.tensors.size(), d.params.size());
    for (size_t i = 0; i < d.params.size(); ++i) {
      const auto& p = d.params[i];
      size_t offset = 0;
      for (const auto& hf : p.hf_names) {  // none or stack: sources laid end to end
        const auto raw = c.read_f32(hf);
        ASSERT_LE(offset + raw.size(), loaded.tensors[i].size());
        EXPECT_EQ(std::memcmp(raw.data(), loaded.tensors[i].data() + offset, raw.size() * 4), 0) << hf;
        offset += raw.size();
      }
      EXPECT_EQ(offset, loaded.tensors[i].size()) << p.name;
    }
    ScratchDir out;
    sdk::save_weights_hf(d, loaded.tensors, out.path().string());
    EXPECT_TRUE(test::read_file(dir / "model.safetensors") == test::read_file(out / "model.safetensors"));
    ++n;
  }
  EXPECT_GT(n, 0);
}

TEST(WeightsIo, Bf16AndF16ShardedCheckpointsRoundTrip) {
  const fs::path src = fixture("llama-tiny");
  if (!fs::exists(src / "config.json")) GTEST_SKIP() << "no llama-tiny fixture";
  for (DType dt : {DType::BF16, DType::F16}) {
    ScratchDir in, out;
    sdk::st::ShardedWriteOptions opt;
    opt.max_shard_bytes = 100000;
    convert_fixture(src, in.path(), dt, opt);
    auto d = model::describe_model_dir(in.path().string());
    for (const auto& p : d.params) ASSERT_EQ(p.dtype, dt);
    const Checkpoint c = Checkpoint::open(in.path().string());
    ASSERT_TRUE(c.sharded());
    sdk::LoadOptions strict;
    strict.dtype_policy = sdk::DtypePolicy::strict;
    const auto loaded = sdk::load_weights_f32(d, c, strict);
    sdk::SaveOptions so;
    so.files = opt;
    sdk::save_weights_hf(d, loaded.tensors, out.path().string(), so);
    const auto files = shard_files(in.path());
    ASSERT_EQ(files, shard_files(out.path()));
    for (const auto& f : files) EXPECT_TRUE(test::read_file(in / f) == test::read_file(out / f)) << f;
  }
}

TEST(WeightsIo, LoadModelFromHubIdInLocalCache) {
  const fs::path src = fixture("qwen3-tiny");
  if (!fs::exists(src / "config.json")) GTEST_SKIP() << "fixture " << src << " not found (set RLHOST_FIXTURES)";
  ScratchDir cache;
  // HF cache layout: models--org--name/{refs/main, snapshots/<commit>/...}; a sharded bf16 copy.
  const fs::path repo = cache / "models--tiny-org--qwen3-tiny";
  const fs::path snap = repo / "snapshots" / "0123abcd";
  fs::create_directories(repo / "refs");
  test::write_file(repo / "refs" / "main", "0123abcd\n");
  sdk::st::ShardedWriteOptions opt;
  opt.max_shard_bytes = 150000;
  convert_fixture(src, snap, DType::BF16, opt);
  const char* old = std::getenv("HF_HUB_CACHE");
  const std::string saved = old ? old : "";
  setenv("HF_HUB_CACHE", cache.path().c_str(), 1);
  const auto m = model::load_model("tiny-org/qwen3-tiny");
  if (old) setenv("HF_HUB_CACHE", saved.c_str(), 1); else unsetenv("HF_HUB_CACHE");
  EXPECT_EQ(fs::canonical(m.dir), fs::canonical(snap));
  EXPECT_TRUE(m.checkpoint.sharded());
  EXPECT_EQ(m.weights.tensors.size(), m.desc.params.size());
  // bf16 copy of the f32 fixture: every loaded value is the bf16 rounding of the original.
  const Checkpoint orig = Checkpoint::open(src.string());
  const auto& p0 = m.desc.params[0];
  const auto ref = orig.read_f32(p0.hf_names[0]);
  for (size_t i = 0; i < ref.size(); i += 97)
    EXPECT_EQ(m.weights.tensors[0][i], sdk::st::bf16_to_f32(sdk::st::f32_to_bf16(ref[i])));
  EXPECT_THROW(model::load_model("tiny-org/absent-model"), std::runtime_error);
}

TEST(WeightsIo, DtypePolicy) {
  const fs::path src = fixture("llama-tiny");
  if (!fs::exists(src / "config.json")) GTEST_SKIP() << "fixture " << src << " not found (set RLHOST_FIXTURES)";
  // Description says bf16 (config), file holds f32.
  json cfg = json::parse(test::read_file(src / "config.json"));
  cfg["dtype"] = "bfloat16";
  const Checkpoint c = Checkpoint::open(src.string());
  auto d = model::describe(cfg);
  sdk::LoadOptions strict;
  strict.dtype_policy = sdk::DtypePolicy::strict;
  expect_error([&] { sdk::load_weights_f32(d, c, strict); },
               {(src / "model.safetensors").string(), "tensor 'model.embed_tokens.weight'", "F32", "BF16"});
  sdk::load_weights_f32(d, c);  // adopt
  for (const auto& p : d.params) EXPECT_EQ(p.dtype, DType::F32) << p.name;
}

TEST(WeightsIo, WrongCheckpointsNameFileAndTensor) {
  const fs::path src = fixture("qwen3-tiny");
  if (!fs::exists(src / "config.json")) GTEST_SKIP() << "fixture " << src << " not found (set RLHOST_FIXTURES)";
  const Checkpoint c = Checkpoint::open(src.string());
  const auto d0 = model::describe_model_dir(src.string());
  const std::string victim = "model.layers.1.self_attn.k_norm.weight";
  ASSERT_NE(c.find(victim).info, nullptr);

  auto rewrite = [&](const fs::path& dir, const std::function<void(std::vector<WriteTensor>&)>& edit) {
    std::vector<WriteTensor> ts;
    for (const auto& name : c.names()) {
      const auto r = c.at(name);
      ts.push_back({name, r.info->dtype, r.info->shape, r.file->data(*r.info)});
    }
    edit(ts);
    sdk::st::write_checkpoint(dir.string(), ts);
  };

  {  // missing tensor
    ScratchDir tmp;
    rewrite(tmp.path(), [&](auto& ts) {
      ts.erase(std::find_if(ts.begin(), ts.end(), [&](const WriteTensor& t) { return t.name == victim; }));
    });
    auto d = d0;
    expect_error([&] { sdk::load_weights_f32(d, Checkpoint::open(tmp.path().string())); },
                 {tmp.path().string(), "missing tensor '" + victim + "'", "layer 1"});
  }
  {  // wrong shape (same bytes, other shape)
    ScratchDir tmp;
    rewrite(tmp.path(), [&](auto& ts) {
      for (auto& t : ts)
        if (t.name == victim) t.shape = {2, 16};
    });
    auto d = d0;
    expect_error([&] { sdk::load_weights_f32(d, Checkpoint::open(tmp.path().string())); },
                 {(tmp / "model.safetensors").string(), "tensor '" + victim + "'", "shape [2,16]", "expects [32]"});
  }
  {  // integer dtype where a weight belongs
    ScratchDir tmp;
    rewrite(tmp.path(), [&](auto& ts) {
      for (auto& t : ts)
        if (t.name == victim) t.dtype = DType::I32;
    });
    auto d = d0;
    expect_error([&] { sdk::load_weights_f32(d, Checkpoint::open(tmp.path().string())); },
                 {"tensor '" + victim + "'", "I32", "not a float"});
  }
  {  // extra tensor: refused on request, else reported and passed through on save
    ScratchDir tmp, out;
    std::vector<std::byte> extra(16 * 4, std::byte{7});
    rewrite(tmp.path(), [&](auto& ts) { ts.push_back({"model.rotary_emb.inv_freq", DType::F32, {16}, {extra.data(), extra.size()}}); });
    const Checkpoint withx = Checkpoint::open(tmp.path().string());
    auto d = d0;
    sdk::LoadOptions no_extra;
    no_extra.allow_unused = false;
    expect_error([&] { sdk::load_weights_f32(d, withx, no_extra); },
                 {"tensor 'model.rotary_emb.inv_freq'", "not a parameter of Qwen3ForCausalLM"});
    const auto loaded = sdk::load_weights_f32(d, withx);
    ASSERT_EQ(loaded.unused, std::vector<std::string>{"model.rotary_emb.inv_freq"});
    sdk::SaveOptions so;
    so.passthrough = &withx;
    so.passthrough_names = loaded.unused;
    sdk::save_weights_hf(d, loaded.tensors, out.path().string(), so);
    EXPECT_TRUE(test::read_file(tmp / "model.safetensors") == test::read_file(out / "model.safetensors"));
  }
  {  // wrong number of tensors given to save
    ScratchDir out;
    EXPECT_THROW(sdk::save_weights_hf(d0, {}, out.path().string()), std::runtime_error);
  }
}

TEST(WeightsIo, ConcatTransformLoadsAndSplitsBack) {
  // A description whose engine fuses q/k/v of layer 0 (axis 0) must load the concatenation and
  // save the three HF tensors back unchanged; likewise an axis-1 concat.
  const fs::path src = fixture("llama-tiny");
  if (!fs::exists(src / "config.json")) GTEST_SKIP() << "fixture " << src << " not found (set RLHOST_FIXTURES)";
  auto d = model::describe_model_dir(src.string());
  const Checkpoint c = Checkpoint::open(src.string());
  std::vector<sdk::ParamDesc> params;
  sdk::ParamDesc qkv;
  for (const auto& p : d.params) {
    const bool fuse = p.layer == 0 && (p.role == sdk::ParamRole::q || p.role == sdk::ParamRole::k || p.role == sdk::ParamRole::v);
    if (!fuse) {
      params.push_back(p);
      continue;
    }
    if (qkv.hf_names.empty()) {
      qkv = p;
      qkv.name = "model.layers.0.self_attn.qkv_proj.weight";
      qkv.transform = sdk::ParamTransform::concat;
      qkv.axis = 0;
      qkv.hf_names.clear();
      qkv.hf_shapes.clear();
      qkv.shape = {0, p.shape[1]};
    }
    qkv.hf_names.push_back(p.hf_names[0]);
    qkv.hf_shapes.push_back(p.shape);
    qkv.shape[0] += p.shape[0];
    if (p.role == sdk::ParamRole::v) params.push_back(qkv);
  }
  // Axis 1: gate|up of layer 1 side by side, [ffn, 2*hidden].
  for (auto it = params.begin(); it != params.end(); ++it) {
    if (it->layer == 1 && it->role == sdk::ParamRole::gate) {
      auto up = std::find_if(params.begin(), params.end(),
                             [](const sdk::ParamDesc& p) { return p.layer == 1 && p.role == sdk::ParamRole::up; });
      it->hf_names.push_back(up->hf_names[0]);
      it->hf_shapes.push_back(up->shape);
      it->transform = sdk::ParamTransform::concat;
      it->axis = 1;
      it->shape[1] *= 2;
      it->name = "model.layers.1.mlp.gate_up_side_by_side";
      params.erase(up);
      break;
    }
  }
  d.params = params;
  const auto loaded = sdk::load_weights_f32(d, c);
  const auto* fused = d.find_param("model.layers.0.self_attn.qkv_proj.weight");
  ASSERT_NE(fused, nullptr);
  const size_t fi = static_cast<size_t>(fused - d.params.data());
  const auto q = c.read_f32("model.layers.0.self_attn.q_proj.weight");
  const auto k = c.read_f32("model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(std::memcmp(loaded.tensors[fi].data(), q.data(), q.size() * 4), 0);
  EXPECT_EQ(std::memcmp(loaded.tensors[fi].data() + q.size(), k.data(), k.size() * 4), 0);
  const auto* gu = d.find_param("model.layers.1.mlp.gate_up_side_by_side");
  ASSERT_NE(gu, nullptr);
  const size_t gi = static_cast<size_t>(gu - d.params.data());
  const auto gate = c.read_f32("model.layers.1.mlp.gate_proj.weight");
  const auto up = c.read_f32("model.layers.1.mlp.up_proj.weight");
  const int64_t H = gu->hf_shapes[0][1];
  EXPECT_EQ(loaded.tensors[gi][1], gate[1]);
  EXPECT_EQ(loaded.tensors[gi][static_cast<size_t>(H)], up[0]);                      // row 0, right half
  EXPECT_EQ(loaded.tensors[gi][static_cast<size_t>(2 * H)], gate[static_cast<size_t>(H)]);  // row 1 starts
  ScratchDir out;
  sdk::save_weights_hf(d, loaded.tensors, out.path().string());
  EXPECT_TRUE(test::read_file(src / "model.safetensors") == test::read_file(out / "model.safetensors"));
}
