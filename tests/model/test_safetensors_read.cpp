// Reading: fixtures load, and every kind of damaged file fails with one line naming the file and
// (where there is one) the tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>

#include "model_test_util.hpp"
#include "rlhost/sdk/safetensors.hpp"

using namespace rlh::sdk::st;
using rlh::test::ScratchDir;
using rlh::test::safetensors_image;

namespace {

// Runs fn, expects std::runtime_error whose one-line message contains every needle.
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

std::vector<std::byte> bytes_of(const std::string& s) {
  std::vector<std::byte> v(s.size());
  std::memcpy(v.data(), s.data(), s.size());
  return v;
}

File image(const std::string& header, const std::string& data, const std::string& label = "mem.safetensors") {
  return File::from_bytes(bytes_of(safetensors_image(header, data)), label);
}

}  // namespace

TEST(SafetensorsRead, FixtureModelsOpenAndTileTheirData) {
  int n = 0;
  for (const auto& dir : rlh::test::model_fixture_dirs()) {
    const File f = File::open((dir / "model.safetensors").string());
    ASSERT_FALSE(f.tensors().empty());
    ASSERT_EQ(f.metadata().size(), 1u);
    EXPECT_EQ(f.metadata()[0].first, "format");
    EXPECT_EQ(f.metadata()[0].second, "pt");
    EXPECT_EQ(f.header_size() % 8, 0u);
    uint64_t total = 0;
    for (const auto& t : f.tensors()) {
      EXPECT_EQ(t.nbytes(), t.numel() * dtype_size(t.dtype)) << t.name;
      total += t.nbytes();
    }
    // Every byte after the header belongs to exactly one tensor.
    EXPECT_EQ(8 + f.header_size() + total, std::filesystem::file_size(dir / "model.safetensors"));
    const auto& first = f.tensors().front();
    auto vals = f.read_f32(first.name);
    ASSERT_EQ(vals.size(), first.numel());
    float raw0;
    std::memcpy(&raw0, f.data(first).data(), 4);
    ASSERT_EQ(first.dtype, DType::F32);
    EXPECT_EQ(vals[0], raw0);
    ++n;
  }
  EXPECT_GT(n, 0) << "no model fixtures under " << rlh::test::fixtures_dir();
}

TEST(SafetensorsRead, ReferenceFixturesReadAsFloat64AndInt64) {
  for (const auto& dir : rlh::test::model_fixture_dirs()) {
    const Checkpoint ref = Checkpoint::open((dir / "reference.safetensors").string());
    const auto ids = ref.at("input_ids");
    EXPECT_EQ(ids.info->dtype, DType::I64);
    const auto logits = ref.at("logits");
    EXPECT_EQ(logits.info->dtype, DType::F64);
    ASSERT_EQ(logits.info->shape.size(), 3u);
    const int64_t vocab = logits.info->shape[2];
    for (double id : ref.read_f64("input_ids")) {
      EXPECT_EQ(id, std::floor(id));
      EXPECT_GE(id, 0);
      EXPECT_LT(id, vocab);
    }
    const auto loss = ref.read_f64("loss");
    ASSERT_EQ(loss.size(), 1u);
    const auto lp = ref.read_f64("token_logprobs");
    double mean = 0;
    for (double x : lp) mean -= x;
    mean /= static_cast<double>(lp.size());
    EXPECT_NEAR(mean, loss[0], 1e-9 * std::max(1.0, std::fabs(loss[0]))) << dir;
  }
}

TEST(SafetensorsRead, TinyValidFileWithZeroSizedTensor) {
  const std::string data = std::string("\x01\x02\x03\x04", 4) + std::string(8, '\0');
  const File f = image(R"({"__metadata__":{"k":"v"},"a":{"dtype":"U8","shape":[2,2],"data_offsets":[0,4]},)"
                       R"("e":{"dtype":"F32","shape":[0,3],"data_offsets":[4,4]},)"
                       R"("z":{"dtype":"I64","shape":[1],"data_offsets":[4,12]}})",
                       data);
  ASSERT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.tensors()[0].name, "a");
  EXPECT_EQ(f.at("e").numel(), 0u);
  EXPECT_EQ(f.read_f32("a")[3], 4.0f);
  EXPECT_EQ(f.read_f64("z")[0], 0.0);
  EXPECT_EQ(f.find("nope"), nullptr);
}

TEST(SafetensorsRead, TruncatedFile) {
  expect_error([] { File::from_bytes(bytes_of("abc"), "short.safetensors"); }, {"short.safetensors", "truncated"});
  // A real fixture cut short: the header is intact but data is missing.
  ScratchDir tmp;
  const auto src = rlh::test::model_fixture_dirs().at(0) / "model.safetensors";
  std::string bytes = rlh::test::read_file(src);
  bytes.resize(bytes.size() - 100);
  rlh::test::write_file(tmp / "cut.safetensors", bytes);
  const File whole = File::open(src.string());
  const std::string last = [&] {
    const TensorInfo* best = &whole.tensors()[0];
    for (const auto& t : whole.tensors())
      if (t.end > best->end) best = &t;
    return best->name;
  }();
  expect_error([&] { File::open((tmp / "cut.safetensors").string()); },
               {(tmp / "cut.safetensors").string(), "tensor '" + last + "'", "past the data section"});
}

TEST(SafetensorsRead, HeaderLongerThanFile) {
  std::string img = safetensors_image("{}", "");
  img[0] = static_cast<char>(200);
  expect_error([&] { File::from_bytes(bytes_of(img), "long.safetensors"); },
               {"long.safetensors", "header length 200", "longer than the file"});
  std::string huge(8, '\xff');
  expect_error([&] { File::from_bytes(bytes_of(huge), "huge.safetensors"); }, {"huge.safetensors", "exceeds"});
}

TEST(SafetensorsRead, InvalidJsonHeader) {
  expect_error([] { image(R"({"a":{"dtype":"F32",)", ""); }, {"mem.safetensors", "invalid JSON"});
  expect_error([] { image(R"([1,2])", ""); }, {"mem.safetensors", "not a JSON object"});
  std::string deep(100, '[');
  expect_error([&] { image(deep, ""); }, {"mem.safetensors", "nested deeper"});
}

TEST(SafetensorsRead, OverlappingOffsets) {
  expect_error([] {
    image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
          std::string(12, '\0'));
  }, {"mem.safetensors", "tensor 'b'", "overlaps"});
}

TEST(SafetensorsRead, OutOfRangeOffsets) {
  expect_error([] { image(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", std::string(8, '\0')); },
               {"mem.safetensors", "tensor 'a'", "past the data section"});
  expect_error([] { image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", std::string(8, '\0')); },
               {"tensor 'a'", "end before begin"});
  expect_error([] { image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", std::string(8, '\0')); },
               {"tensor 'a'", "data_offsets"});
}

TEST(SafetensorsRead, OffsetsNotMatchingDtypeTimesShape) {
  expect_error([] { image(R"({"a":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0')); },
               {"mem.safetensors", "tensor 'a'", "span 8 bytes", "BF16", "needs 6"});
  expect_error([] {
    image(R"({"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", std::string(8, '\0'));
  }, {"tensor 'a'", "overflows"});
}

TEST(SafetensorsRead, GapsAndLeftoverBytes) {
  expect_error([] { image(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})", std::string(4, '\0')); },
               {"tensor 'a'", "gap"});
  expect_error([] { image(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", std::string(5, '\0')); },
               {"mem.safetensors", "data section has 5 bytes but tensors cover 2"});
}

TEST(SafetensorsRead, UnknownDtype) {
  expect_error([] { image(R"({"w":{"dtype":"Q4_K","shape":[1],"data_offsets":[0,1]}})", std::string(1, '\0')); },
               {"mem.safetensors", "tensor 'w'", "unknown dtype 'Q4_K'"});
}

TEST(SafetensorsRead, DuplicateNames) {
  expect_error([] {
    image(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
          std::string(2, '\0'));
  }, {"mem.safetensors", "duplicate key 'w'"});
}

TEST(SafetensorsRead, MalformedEntries) {
  expect_error([] { image(R"({"w":{"shape":[1],"data_offsets":[0,1]}})", std::string(1, '\0')); },
               {"tensor 'w'", "missing dtype"});
  expect_error([] { image(R"({"w":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", std::string(1, '\0')); },
               {"tensor 'w'", "shape"});
  expect_error([] { image(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}})", std::string(1, '\0')); },
               {"tensor 'w'", "unexpected field 'x'"});
  expect_error([] { image(R"({"__metadata__":{"a":1}})", ""); }, {"__metadata__"});
}

TEST(SafetensorsRead, MissingTensorIsNamed) {
  const auto dir = rlh::test::model_fixture_dirs().at(0);
  const Checkpoint c = Checkpoint::open(dir.string());
  EXPECT_FALSE(c.sharded());
  expect_error([&] { c.at("model.layers.99.mlp.up_proj.weight"); },
               {dir.string(), "missing tensor 'model.layers.99.mlp.up_proj.weight'"});
  const File& f = c.files()[0];
  expect_error([&] { f.read_f32("nope.weight"); }, {f.path(), "no tensor 'nope.weight'"});
}

TEST(SafetensorsRead, ShardedIndexErrors) {
  ScratchDir tmp;
  const std::string shard = safetensors_image(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "x");
  rlh::test::write_file(tmp / "model-00001-of-00002.safetensors", shard);
  // Shard file named by the index is missing.
  rlh::test::write_file(tmp / "model.safetensors.index.json",
                        R"({"metadata":{},"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}})");
  expect_error([&] { Checkpoint::open(tmp.path().string()); },
               {"model.safetensors.index.json", "tensor 'b'", "model-00002-of-00002.safetensors", "does not exist"});
  // The index places a tensor in a shard that does not hold it.
  rlh::test::write_file(tmp / "model.safetensors.index.json",
                        R"({"weight_map":{"a":"model-00001-of-00002.safetensors","c":"model-00001-of-00002.safetensors"}})");
  expect_error([&] { Checkpoint::open(tmp.path().string()); }, {"tensor 'c'", "does not hold it"});
  // Shard names must stay inside the folder.
  rlh::test::write_file(tmp / "model.safetensors.index.json", R"({"weight_map":{"a":"../evil.safetensors"}})");
  expect_error([&] { Checkpoint::open(tmp.path().string()); }, {"tensor 'a'", "leaves the checkpoint folder"});
  // No weight_map.
  rlh::test::write_file(tmp / "model.safetensors.index.json", R"({"metadata":{}})");
  expect_error([&] { Checkpoint::open(tmp.path().string()); }, {"weight_map"});
  // Empty folder.
  ScratchDir empty;
  expect_error([&] { Checkpoint::open(empty.path().string()); }, {empty.path().string(), "no model.safetensors"});
}
