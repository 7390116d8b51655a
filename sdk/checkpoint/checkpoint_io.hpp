// File primitives shared by the checkpoint folder logic and the manifest (internal).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace rlh::sdk::ckpt {

// Throws rlh::sdk::Error(UNAVAILABLE) "<path>: <what>: <strerror(err)>".
[[noreturn]] void io_fail(const std::filesystem::path& path, std::string_view what, int err);

// Writes `size` bytes to `path` (created or truncated), fsyncs it; returns its CRC32C.
uint32_t write_file_synced(const std::filesystem::path& path, const void* data, size_t size);
// Reads `path` once: CRC32C and size; fsyncs it too when `sync` (files written by others).
uint32_t checksum_file(const std::filesystem::path& path, uint64_t* size, bool sync);
void fsync_dir(const std::filesystem::path& dir);

// The manifest: every regular file under `dir` except the manifest itself.
struct ManifestEntry {
  std::string path;  // relative, '/'-separated
  uint64_t size = 0;
  uint32_t crc32c = 0;
};
// Writes `dir`/checkpoint_manifest.json (fsynced).
void write_manifest(const std::filesystem::path& dir, int64_t step,
                    const std::vector<ManifestEntry>& entries);

// "0000abcd".
std::string hex32(uint32_t v);

// Manifests and training_info.json are read as untrusted input up to this size.
inline constexpr uint64_t kMaxManifestBytes = 64u << 20;

// A relative path that stays inside its folder ("a/b.bin", not "../x", "/x" or "").
bool is_safe_relative(std::string_view rel);

// "step_12" -> 12, "tmp_step_3" with prefix "tmp_step_" -> 3; -1 when `name` is not
// <prefix><digits>.
int64_t parse_step_name(std::string_view name, std::string_view prefix);

}  // namespace rlh::sdk::ckpt
