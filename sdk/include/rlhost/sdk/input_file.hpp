// rlhost SDK: reading input files that a user (or an attacker) names.
//
// Header-only. Every reader of a file that comes from outside (configs, JSON side files, message
// files, weights, manifests) goes through here so that one rule holds everywhere: only a regular
// file is read, and only up to a size the caller sets. A FIFO, socket or device given as
// "config.json" would otherwise block the open or stream forever (/dev/zero), and a huge file
// would be read into memory whole. The open never blocks (O_NONBLOCK, cleared once the file is
// known to be regular).
//
// Errors are InputError, one line: "<what> '<path>' <problem>", e.g.
//   config file 'a.yaml' is a FIFO, not a regular file
//   config file 'a.yaml' is 104857600 bytes, more than the limit of 16777216
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace rlh::sdk {

class InputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// "a FIFO", "a directory"... for a file type that is not a regular file.
inline const char* file_type_name(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// Owns a descriptor.
class InputFd {
 public:
  InputFd() = default;
  explicit InputFd(int fd) : fd_(fd) {}
  InputFd(InputFd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  InputFd& operator=(InputFd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.fd_;
      o.fd_ = -1;
    }
    return *this;
  }
  InputFd(const InputFd&) = delete;
  InputFd& operator=(const InputFd&) = delete;
  ~InputFd() { reset(); }
  int get() const { return fd_; }
  int release() {
    const int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// Opens `path` for reading when it is a regular file of at most `max_bytes` (0: no limit), and
// returns the descriptor (blocking again) with the file's size in *size.
inline InputFd open_input_file(const std::string& path, uint64_t max_bytes, const std::string& what,
                               uint64_t* size = nullptr) {
  const std::string name = what + " '" + path + "'";
  InputFd fd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (fd.get() < 0) {
    const int err = errno;
    if (err == ENOENT) throw InputError(name + " does not exist");
    if (err == ENXIO) throw InputError(name + " is " + "a socket or a FIFO without a writer, not a regular file");
    throw InputError(name + " cannot be read: " + std::strerror(err));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw InputError(name + " cannot be read: " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) {
    if (S_ISDIR(st.st_mode)) throw InputError(name + " is a directory");
    throw InputError(name + " is " + file_type_name(st.st_mode) + ", not a regular file");
  }
  const uint64_t n = static_cast<uint64_t>(st.st_size);
  if (max_bytes > 0 && n > max_bytes)
    throw InputError(name + " is " + std::to_string(n) + " bytes, more than the limit of " +
                     std::to_string(max_bytes));
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags >= 0) ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
  if (size != nullptr) *size = n;
  return fd;
}

// The whole content of a regular file of at most `max_bytes`. A file that grows while it is
// read is cut at the limit and refused, so the limit holds whatever happens to the file.
inline std::string read_input_file(const std::string& path, uint64_t max_bytes, const std::string& what) {
  uint64_t size = 0;
  InputFd fd = open_input_file(path, max_bytes, what, &size);
  std::string out;
  out.resize(static_cast<size_t>(size));
  size_t got = 0;
  for (;;) {
    if (got == out.size()) {
      if (max_bytes > 0 && out.size() >= max_bytes) {
        // At the limit: one more byte means the file grew past it.
        char extra;
        const ssize_t r = ::read(fd.get(), &extra, 1);
        if (r > 0)
          throw InputError(what + " '" + path + "' grew past the limit of " + std::to_string(max_bytes) +
                           " bytes while it was read");
        break;
      }
      out.resize(out.size() + 65536 > max_bytes && max_bytes > 0 ? static_cast<size_t>(max_bytes)
                                                                 : out.size() + 65536);
    }
    const ssize_t r = ::read(fd.get(), out.data() + got, out.size() - got);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw InputError(what + " '" + path + "' cannot be read: " + std::strerror(errno));
    }
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  out.resize(got);
  return out;
}

// Whether `path` names something that exists (any type), for callers that fall back to a
// default when a side file is absent: a FIFO is "present" and then refused by read_input_file.
inline bool input_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace rlh::sdk
