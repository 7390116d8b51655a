// Writing safetensors files and sharded checkpoints, atomically.
//
// Byte layout follows the Rust `safetensors` crate that Hugging Face uses: compact JSON header
// with "__metadata__" first and each tensor as {"dtype","shape","data_offsets"} in data order,
// padded with spaces to a multiple of 8 bytes so the data section stays 8-byte aligned.
//
// Atomicity: each file is written to a temp name in the destination folder, fsynced, renamed over
// the final name, and the folder is fsynced, so readers (and a restart after a crash) see either
// the old file or the complete new one. Checkpointing relies on this.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <regex>
#include <set>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "rlhost/sdk/safetensors.hpp"

namespace rlh::sdk::st {

namespace fs = std::filesystem;

namespace {

[[noreturn]] void fail(const std::string& label, const std::string& what) {
  throw std::runtime_error("safetensors: " + label + ": " + what);
}

// A string as a JSON string literal (nlohmann escapes exactly as serde_json does for the
// characters that matter: quotes, backslash, control characters).
std::string json_string(const std::string& s) { return nlohmann::json(s).dump(); }

void write_all(int fd, const void* buf, size_t n, const std::string& label) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail(label, std::string("write failed: ") + std::strerror(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail(dir.string(), std::string("cannot open folder to fsync: ") + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) fail(dir.string(), std::string("fsync of folder failed: ") + std::strerror(err));
}

// Writes `pieces` (in order) to `path` via a temp file in the same folder + rename.
void write_atomically(const fs::path& path, const std::vector<std::span<const std::byte>>& pieces) {
  static std::atomic<uint64_t> counter{0};
  const fs::path dir = path.parent_path();
  const fs::path tmp =
      dir / ("." + path.filename().string() + ".tmp." + std::to_string(::getpid()) + "." +
             std::to_string(counter.fetch_add(1)));
  const std::string label = path.string();
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) fail(label, std::string("cannot create temp file: ") + std::strerror(errno));
  try {
    for (const auto& piece : pieces) write_all(fd, piece.data(), piece.size(), label);
    if (::fsync(fd) != 0) fail(label, std::string("fsync failed: ") + std::strerror(errno));
    if (::close(fd) != 0) {
      fail(label, std::string("close failed: ") + std::strerror(errno));
    }
  } catch (...) {
    ::close(fd);  // harmless if already closed (EBADF)
    ::unlink(tmp.c_str());
    throw;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(label, std::string("rename failed: ") + std::strerror(err));
  }
  fsync_dir(dir);
}

uint64_t checked_nbytes(const WriteTensor& t, const std::string& label) {
  uint64_t n = dtype_size(t.dtype);
  for (int64_t d : t.shape) {
    if (d < 0) fail(label, "tensor '" + t.name + "': negative dimension");
    if (d != 0 && n > UINT64_MAX / static_cast<uint64_t>(d))
      fail(label, "tensor '" + t.name + "': shape overflows");
    n *= static_cast<uint64_t>(d);
  }
  if (n != t.data.size())
    fail(label, "tensor '" + t.name + "': " + std::to_string(t.data.size()) + " bytes given, " +
                    std::string(dtype_name(t.dtype)) + " shape needs " + std::to_string(n));
  return n;
}

// The file image minus tensor data: 8-byte length + padded header.
std::string build_header(const std::vector<WriteTensor>& tensors,
                         const std::vector<std::pair<std::string, std::string>>& metadata,
                         const std::string& label) {
  std::set<std::string> seen;
  std::string h = "{";
  bool first = true;
  if (!metadata.empty()) {
    h += "\"__metadata__\":{";
    for (size_t i = 0; i < metadata.size(); ++i) {
      if (i) h += ",";
      h += json_string(metadata[i].first) + ":" + json_string(metadata[i].second);
    }
    h += "}";
    first = false;
  }
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    if (t.name == "__metadata__") fail(label, "'__metadata__' is not a valid tensor name");
    if (!seen.insert(t.name).second) fail(label, "tensor '" + t.name + "' given twice");
    const uint64_t n = checked_nbytes(t, label);
    if (!first) h += ",";
    first = false;
    h += json_string(t.name) + ":{\"dtype\":\"" + std::string(dtype_name(t.dtype)) + "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (i) h += ",";
      h += std::to_string(t.shape[i]);
    }
    h += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + n) + "]}";
    offset += n;
  }
  h += "}";
  h.append((8 - h.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t len = h.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((len >> (8 * i)) & 0xff);
  return out + h;
}

}  // namespace

void sort_tensors_like_hf(std::vector<WriteTensor>& tensors) {
  // The enum follows the Rust crate's Dtype declaration order, whose derived ordering the crate
  // sorts by (descending), then by name.
  std::stable_sort(tensors.begin(), tensors.end(), [](const WriteTensor& a, const WriteTensor& b) {
    if (a.dtype != b.dtype) return static_cast<int>(a.dtype) > static_cast<int>(b.dtype);
    return a.name < b.name;
  });
}

void write_file(const std::string& path, const std::vector<WriteTensor>& tensors,
                const std::vector<std::pair<std::string, std::string>>& metadata) {
  const std::string header = build_header(tensors, metadata, path);
  std::vector<std::span<const std::byte>> pieces;
  pieces.push_back({reinterpret_cast<const std::byte*>(header.data()), header.size()});
  for (const auto& t : tensors)
    if (!t.data.empty()) pieces.push_back(t.data);
  std::error_code ec;
  const fs::path p(path);
  if (!p.parent_path().empty()) fs::create_directories(p.parent_path(), ec);
  write_atomically(p, pieces);
}

std::vector<std::string> write_checkpoint(const std::string& dir, std::vector<WriteTensor> tensors,
                                          const ShardedWriteOptions& options) {
  if (options.prefix.empty() || options.prefix.find('/') != std::string::npos)
    fail(dir, "invalid checkpoint file prefix '" + options.prefix + "'");
  if (options.sort_like_hf) sort_tensors_like_hf(tensors);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir)) fail(dir, "cannot create folder");

  // Greedy split in order: a new shard starts when the next tensor would overflow this one.
  std::vector<std::vector<WriteTensor>> shards(1);
  uint64_t current = 0, total = 0;
  for (auto& t : tensors) {
    const uint64_t n = checked_nbytes(t, dir);
    if (!shards.back().empty() && current + n > options.max_shard_bytes) {
      shards.emplace_back();
      current = 0;
    }
    current += n;
    total += n;
    shards.back().push_back(std::move(t));
  }

  const fs::path d(dir);
  const std::string single_name = options.prefix + ".safetensors";
  const std::string index_name = options.prefix + ".safetensors.index.json";
  std::vector<std::string> written;
  std::set<std::string> keep;
  if (shards.size() == 1) {
    write_file((d / single_name).string(), shards[0], options.metadata);
    written.push_back((d / single_name).string());
    keep.insert(single_name);
  } else {
    char buf[64];
    nlohmann::json weight_map = nlohmann::json::object();
    for (size_t i = 0; i < shards.size(); ++i) {
      std::snprintf(buf, sizeof buf, "-%05zu-of-%05zu.safetensors", i + 1, shards.size());
      const std::string name = options.prefix + buf;
      write_file((d / name).string(), shards[i], options.metadata);
      written.push_back((d / name).string());
      keep.insert(name);
      for (const auto& t : shards[i]) weight_map[t.name] = name;
    }
    // HF writes the index with sorted keys, 2-space indent and a trailing newline.
    nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    const std::string text = index.dump(2) + "\n";
    write_atomically(d / index_name, {{reinterpret_cast<const std::byte*>(text.data()), text.size()}});
    written.push_back((d / index_name).string());
    keep.insert(index_name);
  }

  // Remove what an earlier save with this prefix left that this save did not write, so a loader
  // never mixes an old index with new shards.
  const std::regex shard_re(std::regex_replace(options.prefix, std::regex(R"([.^$|()\[\]{}*+?\\])"), R"(\$&)") +
                            R"(-\d{5}-of-\d{5}\.safetensors)");
  bool removed = false;
  for (const auto& e : fs::directory_iterator(d, ec)) {
    const std::string fname = e.path().filename().string();
    const bool ours = fname == single_name || fname == index_name || std::regex_match(fname, shard_re);
    if (ours && !keep.count(fname)) {
      fs::remove(e.path(), ec);
      removed = true;
    }
  }
  if (removed) fsync_dir(d);
  return written;
}

}  // namespace rlh::sdk::st
