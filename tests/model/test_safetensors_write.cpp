// Writing: HF byte layout (fixtures reproduce byte for byte), sharded checkpoints with an index
// that load back identically, atomic replacement without leftovers.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>

#include "model_test_util.hpp"
#include "rlhost/sdk/safetensors.hpp"

using namespace rlh::sdk::st;
using rlh::test::ScratchDir;
namespace fs = std::filesystem;

namespace {

std::vector<WriteTensor> tensors_of(const File& f) {
  std::vector<WriteTensor> out;
  for (const auto& t : f.tensors()) out.push_back({t.name, t.dtype, t.shape, f.data(t)});
  return out;
}

std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// A synthetic model-like set of tensors of several dtypes with deterministic contents.
struct Synthetic {
  std::vector<std::vector<std::byte>> storage;
  std::vector<WriteTensor> tensors;
  Synthetic() {
    std::mt19937 rng(3);
    const struct {
      const char* name;
      DType dt;
      std::vector<int64_t> shape;
    } spec[] = {
        {"model.embed_tokens.weight", DType::BF16, {64, 16}},
        {"model.layers.0.self_attn.q_proj.weight", DType::BF16, {16, 16}},
        {"model.layers.0.self_attn.q_proj.bias", DType::F32, {16}},
        {"model.layers.1.mlp.up_proj.weight", DType::F16, {40, 16}},
        {"model.norm.weight", DType::F32, {16}},
        {"step", DType::I64, {1}},
        {"mask", DType::BOOL, {7}},
        {"lm_head.weight", DType::BF16, {64, 16}},
    };
    for (const auto& s : spec) {
      size_t n = dtype_size(s.dt);
      for (auto d : s.shape) n *= static_cast<size_t>(d);
      std::vector<std::byte> b(n);
      for (auto& x : b) x = static_cast<std::byte>(rng() & 0xff);
      storage.push_back(std::move(b));
    }
    for (size_t i = 0; i < std::size(spec); ++i)
      tensors.push_back({spec[i].name, spec[i].dt, spec[i].shape, {storage[i].data(), storage[i].size()}});
  }
};

}  // namespace

TEST(SafetensorsWrite, FixtureModelsRoundTripByteForByte) {
  for (const auto& dir : rlh::test::model_fixture_dirs()) {
    const File f = File::open((dir / "model.safetensors").string());
    ScratchDir tmp;
    // Tensors handed over in a scrambled order: the HF ordering must restore the file exactly.
    auto ts = tensors_of(f);
    std::reverse(ts.begin(), ts.end());
    const auto written = write_checkpoint(tmp.path().string(), ts);
    ASSERT_EQ(written.size(), 1u);
    EXPECT_EQ(fs::path(written[0]).filename(), "model.safetensors");
    EXPECT_TRUE(rlh::test::read_file(dir / "model.safetensors") == rlh::test::read_file(written[0])) << dir;
    // The reference file (not in HF order) reproduces when written in its own header order.
    const File ref = File::open((dir / "reference.safetensors").string());
    write_file((tmp / "ref.safetensors").string(), tensors_of(ref), ref.metadata());
    EXPECT_TRUE(rlh::test::read_file(dir / "reference.safetensors") == rlh::test::read_file(tmp / "ref.safetensors"))
        << dir;
  }
}

TEST(SafetensorsWrite, ShardedCheckpointLoadsAndRoundTrips) {
  Synthetic syn;
  ScratchDir tmp;
  ShardedWriteOptions opt;
  opt.max_shard_bytes = 2048;  // forces several shards
  const auto written = write_checkpoint(tmp.path().string(), syn.tensors, opt);
  ASSERT_GE(written.size(), 3u);  // >= 2 shards + index
  EXPECT_EQ(fs::path(written.back()).filename(), "model.safetensors.index.json");
  const size_t shards = written.size() - 1;
  char expect_name[64];
  std::snprintf(expect_name, sizeof expect_name, "model-00001-of-%05zu.safetensors", shards);
  EXPECT_EQ(fs::path(written[0]).filename(), expect_name);

  const Checkpoint c = Checkpoint::open(tmp.path().string());
  EXPECT_TRUE(c.sharded());
  EXPECT_EQ(c.files().size(), shards);
  EXPECT_EQ(c.names().size(), syn.tensors.size());
  for (const auto& t : syn.tensors) {
    const auto r = c.at(t.name);
    EXPECT_EQ(r.info->dtype, t.dtype) << t.name;
    EXPECT_EQ(r.info->shape, t.shape) << t.name;
    const auto d = r.file->data(*r.info);
    ASSERT_EQ(d.size(), t.data.size());
    EXPECT_EQ(std::memcmp(d.data(), t.data.data(), d.size()), 0) << t.name;
  }
  // Index content: total_size is the sum of tensor bytes.
  const auto index = rlh::test::read_file(written.back());
  size_t total = 0;
  for (const auto& t : syn.tensors) total += t.data.size();
  EXPECT_NE(index.find("\"total_size\": " + std::to_string(total)), std::string::npos) << index;

  // Load -> save of the sharded checkpoint reproduces every file byte for byte.
  ScratchDir again;
  std::vector<WriteTensor> back;
  for (const auto& name : c.names()) {
    const auto r = c.at(name);
    back.push_back({name, r.info->dtype, r.info->shape, r.file->data(*r.info)});
  }
  const auto written2 = write_checkpoint(again.path().string(), back, opt);
  ASSERT_EQ(written2.size(), written.size());
  for (size_t i = 0; i < written.size(); ++i)
    EXPECT_TRUE(rlh::test::read_file(written[i]) == rlh::test::read_file(written2[i])) << written[i];

  // Opening the index file directly works too.
  EXPECT_EQ(Checkpoint::open(written.back()).names().size(), syn.tensors.size());
}

TEST(SafetensorsWrite, ResavingReplacesStaleFilesAtomically) {
  Synthetic syn;
  ScratchDir tmp;
  ShardedWriteOptions sharded;
  sharded.max_shard_bytes = 2048;
  write_checkpoint(tmp.path().string(), syn.tensors, sharded);
  // Now a single-file save into the same folder: old shards and index must go.
  const auto written = write_checkpoint(tmp.path().string(), syn.tensors);
  ASSERT_EQ(written.size(), 1u);
  EXPECT_EQ(listing(tmp.path()), std::vector<std::string>{"model.safetensors"});
  const Checkpoint c = Checkpoint::open(tmp.path().string());
  EXPECT_FALSE(c.sharded());
  EXPECT_EQ(c.names().size(), syn.tensors.size());
  // Overwriting an existing file leaves no temp files behind.
  write_file((tmp / "model.safetensors").string(), syn.tensors);
  EXPECT_EQ(listing(tmp.path()), std::vector<std::string>{"model.safetensors"});
  // Other files in the folder are left alone.
  rlh::test::write_file(tmp / "config.json", "{}");
  write_checkpoint(tmp.path().string(), syn.tensors, sharded);
  const auto files = listing(tmp.path());
  EXPECT_NE(std::find(files.begin(), files.end(), "config.json"), files.end());
  EXPECT_EQ(std::find(files.begin(), files.end(), "model.safetensors"), files.end());
}

TEST(SafetensorsWrite, HeaderIsPaddedAndTensorsStayAligned) {
  Synthetic syn;
  ScratchDir tmp;
  write_file((tmp / "a.safetensors").string(), syn.tensors, {});
  const File f = File::open((tmp / "a.safetensors").string());
  EXPECT_EQ(f.header_size() % 8, 0u);
  EXPECT_TRUE(f.metadata().empty());
  EXPECT_EQ(f.tensors().size(), syn.tensors.size());
  // Header order is the order given.
  for (size_t i = 0; i < syn.tensors.size(); ++i) EXPECT_EQ(f.tensors()[i].name, syn.tensors[i].name);
}

TEST(SafetensorsWrite, BadInputIsRefused) {
  Synthetic syn;
  ScratchDir tmp;
  auto dup = syn.tensors;
  dup.push_back(dup[0]);
  EXPECT_THROW(write_file((tmp / "d.safetensors").string(), dup), std::runtime_error);
  auto wrong = syn.tensors;
  wrong[1].shape = {3, 3};
  try {
    write_file((tmp / "w.safetensors").string(), wrong);
    ADD_FAILURE();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(wrong[1].name), std::string::npos);
  }
  EXPECT_EQ(listing(tmp.path()), std::vector<std::string>{});  // nothing half-written
}
