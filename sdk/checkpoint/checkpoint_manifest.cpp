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
#include "rlhost/sdk/json_input.hpp"
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

}  // namespace

std::string hex32(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08x", v);
  return buf;
}

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
    files.push_back({{"path", e.path}, {"size", e.size}, {"crc32c", ckpt::hex32(e.crc32c)}});
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

std::string parse_manifest(std::string_view text, const std::string& label, int64_t* step,
                           std::vector<ManifestFile>* files) {
  nlohmann::json m;
  try {
    m = parse_json_input(text, label);
  } catch (const InputError& e) {
    return e.what();
  }
  // (json::value() throws when the key holds another type: every field's type is checked first.)
  if (!m.is_object() || !m.contains("format") || m["format"] != "rlhost-checkpoint-manifest" || !m.contains("files") ||
      !m["files"].is_array() || !m.contains("step") || !m["step"].is_number_integer())
    return label + ": not an rlhost checkpoint manifest";
  if (!m.contains("version") || m["version"] != 1)
    return label + ": manifest version " + (m.contains("version") ? m["version"].dump() : std::string("(none)")) +
           " is not supported (this build reads 1)";
  if (m["step"].get<int64_t>() < 0) return label + ": step " + m["step"].dump() + " is negative";
  if (step != nullptr) *step = m["step"].get<int64_t>();
  for (const auto& e : m["files"]) {
    auto entry = [&]() { return e.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).substr(0, 200); };
    if (!e.is_object() || !e.contains("path") || !e["path"].is_string() || !e.contains("size") ||
        !e["size"].is_number_unsigned() || !e.contains("crc32c") || !e["crc32c"].is_string())
      return label + ": malformed entry " + entry();
    const std::string rel = e["path"].get<std::string>();
    if (!ckpt::is_safe_relative(rel) || rel == kCheckpointManifest) return label + ": unsafe path in entry " + entry();
    const std::string hex = e["crc32c"].get<std::string>();
    if (hex.size() != 8 || hex.find_first_not_of("0123456789abcdef") != std::string::npos)
      return label + ": CRC32C is not 8 hex digits in entry " + entry();
    if (files != nullptr)
      files->push_back({rel, e["size"].get<uint64_t>(), static_cast<uint32_t>(std::stoul(hex, nullptr, 16))});
  }
  return {};
}

VerifyResult verify_checkpoint(const fs::path& dir, VerifyLevel level) {
  VerifyResult r;
  auto fail = [&](std::string msg) {
    r.ok = false;
    r.error = std::move(msg);
    return r;
  };
  const fs::path manifest_path = dir / kCheckpointManifest;
  std::string text;
  try {
    text = read_input_file(manifest_path.string(), ckpt::kMaxManifestBytes, "checkpoint manifest");
  } catch (const InputError& e) {
    struct stat st{};
    if (::lstat(manifest_path.c_str(), &st) != 0) return fail(manifest_path.string() + ": missing (not a complete checkpoint)");
    return fail(e.what());
  }
  int64_t manifest_step = -1;
  std::vector<ManifestFile> files;
  if (std::string err = parse_manifest(text, manifest_path.string(), &manifest_step, &files); !err.empty())
    return fail(err);
  const int64_t named_step = ckpt::parse_step_name(dir.filename().string(), "step_");
  if (named_step >= 0 && named_step != manifest_step)
    return fail(manifest_path.string() + ": says step " + std::to_string(manifest_step) + " but the folder is step_" +
                std::to_string(named_step));
  for (const ManifestFile& e : files) {
    const fs::path file = dir / e.path;
    struct stat st{};
    if (::lstat(file.c_str(), &st) != 0) return fail(file.string() + ": missing (listed in the manifest)");
    if (!S_ISREG(st.st_mode)) return fail(file.string() + ": not a regular file");
    if (static_cast<uint64_t>(st.st_size) != e.size)
      return fail(file.string() + ": size " + std::to_string(st.st_size) + ", manifest says " + std::to_string(e.size));
    if (level == VerifyLevel::kChecksums) {
      uint64_t size = 0;
      uint32_t crc = 0;
      try {
        crc = ckpt::checksum_file(file, &size, /*sync=*/false);
      } catch (const std::exception& ex) {
        return fail(ex.what());
      }
      if (size != e.size || crc != e.crc32c)
        return fail(file.string() + ": CRC32C " + ckpt::hex32(crc) + ", manifest says " + ckpt::hex32(e.crc32c) +
                    " (the file changed after it was saved)");
    }
    ++r.files;
    r.bytes += e.size;
  }
  // The step the run records must be the folder's: a training_info.json edited to say another
  // step would make a resume restart there and overwrite every later checkpoint.
  const fs::path info_path = dir / "training_info.json";
  struct stat st{};
  if (::lstat(info_path.c_str(), &st) == 0) {
    nlohmann::json info;
    try {
      info = read_json_file(info_path.string(), ckpt::kMaxManifestBytes, "checkpoint file");
    } catch (const InputError& e) {
      return fail(e.what());
    }
    if (info.is_object() && info.contains("step")) {
      const auto& v = info["step"];
      if (!v.is_number_integer() || v.get<int64_t>() != manifest_step)
        return fail(info_path.string() + ": says step " + v.dump() + " but the checkpoint is step " +
                    std::to_string(manifest_step));
    }
  }
  r.ok = true;
  return r;
}

}  // namespace rlh::sdk
