// Reading and writing safetensors files and sharded checkpoints (Hugging Face layout).
//
// Reading memory-maps each file and validates its header strictly before any tensor is handed
// out: every error is a one-line std::runtime_error naming the file (and the tensor where there is
// one), because a checkpoint problem found later, inside a kernel, is far harder to trace.
//
// Writing is atomic per file (temp file in the same folder, fsync, rename, fsync the folder), so a
// crash never leaves a half-written checkpoint under the final name. The writer reproduces the
// layout of Hugging Face's `safetensors` (compact JSON header, "__metadata__" first, header padded
// with spaces to a multiple of 8 bytes, tensor data packed in header order), so a load -> save of
// an unchanged HF file gives the same bytes when tensors are written in HF's order
// (sort_tensors_like_hf).
//
// Link rlh_safetensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "rlhost/sdk/safetensors_dtype.hpp"

namespace rlh::sdk::st {

// Header JSON deeper than this is refused (a safetensors header is 3 levels deep); bounds parser
// work on hostile input.
inline constexpr int kMaxJsonDepth = 32;
// Largest header accepted, as the reference implementation (100 MB).
inline constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

// ---------------------------------------------------------------------------------------------
// Element conversion. All conversions to float are exact except F64 -> F32 (round to nearest
// even). Conversions from float32 round to nearest even; bf16/f16 NaN stays NaN, overflow to f16
// becomes +-inf.

float bf16_to_f32(uint16_t bits);
uint16_t f32_to_bf16(float v);
float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float v);
float f8e4m3_to_f32(uint8_t bits);  // E4M3FN: no infinities, S.1111.111 is NaN, max 448
float f8e5m2_to_f32(uint8_t bits);  // E5M2: IEEE-like, with infinities

// n elements of `src` (raw little-endian bytes of dtype `t`) -> float32 / float64.
// Every dtype of the enum is accepted (integers and BOOL convert by value).
void convert_to_f32(DType t, const std::byte* src, size_t n, float* dst);
void convert_to_f64(DType t, const std::byte* src, size_t n, double* dst);
// n float32 values -> raw bytes of dtype `t`; `t` must be F32, F64, BF16 or F16
// (std::invalid_argument otherwise). dst holds n * dtype_size(t) bytes.
void convert_from_f32(DType t, const float* src, size_t n, std::byte* dst);

// ---------------------------------------------------------------------------------------------
// Reading

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets inside the data section (after the header)
  uint64_t end = 0;

  uint64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

// One safetensors file, validated and memory-mapped (or held in memory for from_bytes).
// Cheap to copy: copies share the mapping.
class File {
 public:
  // Maps and validates `path`. Throws std::runtime_error naming the file (and tensor).
  static File open(const std::string& path);
  // Validates an in-memory file image (used by tests and the fuzzer); `label` names it in errors.
  static File from_bytes(std::vector<std::byte> bytes, const std::string& label);

  const std::string& path() const { return path_; }
  // Tensors in header order (the order the writer put them in).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // "__metadata__" entries in header order.
  const std::vector<std::pair<std::string, std::string>>& metadata() const { return metadata_; }
  const TensorInfo* find(std::string_view name) const;
  // Like find but throws "<file>: no tensor '<name>'".
  const TensorInfo& at(std::string_view name) const;
  // Raw bytes of a tensor of this file.
  std::span<const std::byte> data(const TensorInfo& t) const;
  // Size of the JSON header (without the 8-byte length, including padding).
  uint64_t header_size() const { return header_size_; }

  // Converting reads; throw naming file and tensor when the tensor is missing.
  std::vector<float> read_f32(std::string_view name) const;
  std::vector<double> read_f64(std::string_view name) const;

 private:
  struct Storage;
  void parse(std::span<const std::byte> bytes);

  std::string path_;
  std::shared_ptr<const Storage> storage_;
  const std::byte* data_ = nullptr;  // start of the data section
  uint64_t data_size_ = 0;
  uint64_t header_size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::vector<std::pair<std::string, std::string>> metadata_;
  std::vector<size_t> sorted_by_name_;  // indices into tensors_, for find()
};

// A checkpoint: one file, or shards listed by an index (`*.safetensors.index.json` with a
// "weight_map"). open() accepts a folder (model.safetensors.index.json preferred over
// model.safetensors, as HF does), an index file or a .safetensors file.
class Checkpoint {
 public:
  static Checkpoint open(const std::string& path);

  // Where it was opened from (the folder, index or file path).
  const std::string& path() const { return path_; }
  bool sharded() const { return sharded_; }
  const std::vector<File>& files() const { return files_; }
  // Every tensor name: index order for sharded checkpoints (the index's key order), header order
  // for one file.
  const std::vector<std::string>& names() const { return names_; }

  struct Ref {
    const File* file = nullptr;
    const TensorInfo* info = nullptr;
  };
  // nullptr members when absent.
  Ref find(std::string_view name) const;
  // Throws "<checkpoint>: missing tensor '<name>'".
  Ref at(std::string_view name) const;

  std::vector<float> read_f32(std::string_view name) const;
  std::vector<double> read_f64(std::string_view name) const;

 private:
  std::string path_;
  bool sharded_ = false;
  std::vector<File> files_;
  std::vector<std::string> names_;
  struct Entry {
    std::string name;
    size_t file;    // index into files_
    size_t tensor;  // index into files_[file].tensors()
  };
  std::vector<Entry> index_;  // sorted by name; indices (not pointers) so copies stay valid
};

// Parses a JSON document with the depth bound above, refusing duplicate object keys at any level
// (nlohmann would silently keep one); object key order is kept. `label` names the source in the
// one-line error. Shared with the model plugin so config.json gets the same protection.
nlohmann::ordered_json parse_json_strict(std::string_view text, const std::string& label);

// ---------------------------------------------------------------------------------------------
// Writing

struct WriteTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::span<const std::byte> data;  // numel * dtype_size bytes, row-major
};

// HF's order: by dtype, widest first (the Rust library sorts by descending dtype), then by name.
void sort_tensors_like_hf(std::vector<WriteTensor>& tensors);

// Writes one file atomically with tensors in the given order. metadata defaults to
// {"format": "pt"}. Throws std::runtime_error naming the file (and tensor) on bad input or I/O.
void write_file(const std::string& path, const std::vector<WriteTensor>& tensors,
                const std::vector<std::pair<std::string, std::string>>& metadata = {{"format", "pt"}});

struct ShardedWriteOptions {
  // Largest shard (bytes of tensor data). A tensor larger than this gets a shard of its own.
  uint64_t max_shard_bytes = 5ull << 30;
  std::string prefix = "model";  // model-00001-of-00003.safetensors, model.safetensors.index.json
  bool sort_like_hf = true;      // apply sort_tensors_like_hf before splitting
  std::vector<std::pair<std::string, std::string>> metadata = {{"format", "pt"}};
};

// Writes a checkpoint into `dir` (created if missing): one `<prefix>.safetensors` when everything
// fits in a shard, else shards plus `<prefix>.safetensors.index.json` ({"metadata": {"total_size":
// bytes}, "weight_map": {name: file}}), as HF save_pretrained lays them out. Every file is written
// atomically, the index last; files of an earlier save with the same prefix that this one does
// not produce are removed afterwards. Returns the paths written (index last when sharded).
std::vector<std::string> write_checkpoint(const std::string& dir, std::vector<WriteTensor> tensors,
                                          const ShardedWriteOptions& options = {});

}  // namespace rlh::sdk::st
