// The checkpoint manifest (every file with its size and CRC32C), its verification, and the
// synced-file primitives the commit protocol is built from.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <vector>

#include "checkpoint_io.hpp"
#include "rlhost/sdk/checkpoint.hpp"
#include "rlhost/sdk/crc32c.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::sdk {
namespace fs = std::filesystem;

namespace ckpt {

void io_fail(const fs::path& path, std::string_view what, int err) {
  throw Error(RLH_E_UNAVAILABLE, path.string() + ": " + std::string(what) + ": " + std::strerror(err));
}

namespace {

// Closes a descriptor on every path out.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void write_all(int fd, const fs::path& path, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      io_fail(path, "write failed", errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

std::string hex32(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08x", v);
  return buf;
}

}  // namespace

uint32_t write_file_synced(const fs::path& path, const void* data, size_t size) {
  Fd f{::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  if (f.fd < 0) io_fail(path, "cannot create", errno);
  write_all(f.fd, path, static_cast<const char*>(data), size);
  if (::fsync(f.fd) != 0) io_fail(path, "fsync failed", errno);
  const int fd = f.fd;
  f.fd = -1;
  if (::close(fd) != 0) io_fail(path, "close failed", errno);
  return crc32c(data, size);
}

uint32_t checksum_file(const fs::path& path, uint64_t* size, bool sync) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) io_fail(path, "cannot open", errno);
  std::vector<char> buf(1 << 20);
  uint32_t crc = 0;
  uint64_t total = 0;
  for (;;) {
    const ssize_t r = ::read(f.fd, buf.data(), buf.size());
    if (r < 0) {
      if (errno == EINTR) continue;
      io_fail(path, "read failed", errno);
    }
    if (r == 0) break;
    crc = crc32c_extend(crc, buf.data(), static_cast<size_t>(r));
    total += static_cast<uint64_t>(r);
  }
  // fsync through a read-only descriptor flushes the file's dirty pages all the same (Linux).
  if (sync && ::fsync(f.fd) != 0) io_fail(path, "fsync failed", errno);
  *size = total;
  return crc;
}

void fsync_dir(const fs::path& dir) {
  Fd f{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (f.fd < 0) io_fail(dir, "cannot open folder to fsync", errno);
  if (::fsync(f.fd) != 0) io_fail(dir, "fsync of folder failed", errno);
}

void write_manifest(const fs::path& dir, int64_t step, const std::vector<ManifestEntry>& entries) {
  nlohmann::ordered_json files = nlohmann::ordered_json::array();
  for (const auto& e : entries)
    files.push_back({{"path", e.path}, {"size", e.size}, {"crc32c", hex32(e.crc32c)}});
  nlohmann::ordered_json m;
  m["format"] = "rlhost-checkpoint-manifest";
  m["version"] = 1;
  m["step"] = step;
  m["files"] = std::move(files);
  const std::string text = m.dump(1) + "\n";
  write_file_synced(dir / kCheckpointManifest, text.data(), text.size());
}

bool is_safe_relative(std::string_view rel) {
  if (rel.empty() || rel.front() == '/') return false;
  fs::path p{std::string(rel)};
  for (const auto& part : p) {
    const std::string s = part.string();
    if (s == ".." || s == "." || s.empty()) return false;
  }
  return true;
}

int64_t parse_step_name(std::string_view name, std::string_view prefix) {
  if (name.size() <= prefix.size() || name.substr(0, prefix.size()) != prefix) return -1;
  const std::string_view digits = name.substr(prefix.size());
  if (digits.size() > 18) return -1;
  int64_t v = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return -1;
    v = v * 10 + (c - '0');
  }
  return v;
}

}  // namespace ckpt

VerifyResult verify_checkpoint(const fs::path& dir, VerifyLevel level) {
  VerifyResult r;
  auto fail = [&](std::string msg) {
    r.ok = false;
    r.error = std::move(msg);
    return r;
  };
  const fs::path manifest_path = dir / kCheckpointManifest;
  std::ifstream in(manifest_path, std::ios::binary);
  if (!in) return fail(manifest_path.string() + ": missing (not a complete checkpoint)");
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    return fail(manifest_path.string() + ": invalid JSON: " + e.what());
  }
  if (!m.is_object() || m.value("format", "") != "rlhost-checkpoint-manifest" ||
      !m.contains("files") || !m["files"].is_array() || !m.contains("step") ||
      !m["step"].is_number_integer())
    return fail(manifest_path.string() + ": not an rlhost checkpoint manifest");
  if (m.value("version", 0) != 1)
    return fail(manifest_path.string() + ": manifest version " + m["version"].dump() +
                " is not supported (this build reads 1)");
  const int64_t named_step = ckpt::parse_step_name(dir.filename().string(), "step_");
  if (named_step >= 0 && named_step != m["step"].get<int64_t>())
    return fail(manifest_path.string() + ": says step " + m["step"].dump() + " but the folder is step_" +
                std::to_string(named_step));
  for (const auto& e : m["files"]) {
    if (!e.is_object() || !e.contains("path") || !e["path"].is_string() || !e.contains("size") ||
        !e["size"].is_number_unsigned() || !e.contains("crc32c") || !e["crc32c"].is_string())
      return fail(manifest_path.string() + ": malformed entry " + e.dump());
    const std::string rel = e["path"].get<std::string>();
    if (!ckpt::is_safe_relative(rel)) return fail(manifest_path.string() + ": unsafe path '" + rel + "'");
    const fs::path file = dir / rel;
    const uint64_t want = e["size"].get<uint64_t>();
    struct stat st{};
    if (::lstat(file.c_str(), &st) != 0) return fail(file.string() + ": missing (listed in the manifest)");
    if (!S_ISREG(st.st_mode)) return fail(file.string() + ": not a regular file");
    if (static_cast<uint64_t>(st.st_size) != want)
      return fail(file.string() + ": size " + std::to_string(st.st_size) + ", manifest says " +
                  std::to_string(want));
    if (level == VerifyLevel::kChecksums) {
      uint64_t size = 0;
      uint32_t crc = 0;
      try {
        crc = ckpt::checksum_file(file, &size, /*sync=*/false);
      } catch (const std::exception& ex) {
        return fail(ex.what());
      }
      char hex[9];
      std::snprintf(hex, sizeof(hex), "%08x", crc);
      if (size != want || e["crc32c"].get<std::string>() != hex)
        return fail(file.string() + ": CRC32C " + hex + ", manifest says " + e["crc32c"].get<std::string>());
    }
    ++r.files;
    r.bytes += want;
  }
  r.ok = true;
  return r;
}

}  // namespace rlh::sdk
