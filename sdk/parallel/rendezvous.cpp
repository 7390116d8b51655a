// The TCP rendezvous (rendezvous.hpp): rank 0 serves one exchange with poll() and deadlines;
// the others connect (retrying until rank 0 listens), register, and wait for everyone's blobs.
//
// Wire format (little-endian u32 fields):
//   rank -> 0:  "RLHR" version rank size tag_len blob_len tag blob
//   0 -> rank:  status 0, then size x (len bytes); or status 1, code, len, message
#include "rlhost/sdk/rendezvous.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "rlhost/sdk/status.hpp"

namespace rlh::sdk {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kMagic = 0x52484c52;  // "RLHR"
constexpr uint32_t kVersion = 1;
constexpr size_t kMaxBlob = size_t{1} << 20;
constexpr size_t kMaxTag = 256;
constexpr size_t kHeader = 6 * 4;

struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd = o.fd;
      o.fd = -1;
    }
    return *this;
  }
  ~Fd() { reset(); }
  void reset() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

void put_u32(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL, 0) | O_NONBLOCK); }

// Writes all of `data` before the deadline; false on error or timeout.
bool write_all(int fd, const std::string& data, Clock::time_point deadline) {
  size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
    pollfd p{fd, POLLOUT, 0};
    const int left = remaining_ms(deadline);
    if (left == 0) return false;
    ::poll(&p, 1, std::min(left, 100));
  }
  return true;
}

std::string where(const RendezvousOptions& o) {
  return "rendezvous '" + o.tag + "' at " + (o.addr.empty() ? std::string("*") : o.addr) + ":" + std::to_string(o.port);
}

std::string seconds(std::chrono::milliseconds ms) {
  const double s = static_cast<double>(ms.count()) / 1000.0;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}

std::string error_reply(rlh_code code, const std::string& msg) {
  std::string out;
  put_u32(out, 1);
  put_u32(out, static_cast<uint32_t>(code));
  put_u32(out, static_cast<uint32_t>(msg.size()));
  return out + msg;
}

// ---- rank 0 -----------------------------------------------------------------------------------

struct Peer {
  Fd fd;
  std::string in;
  int rank = -1;  // set once registered
};

Fd listen_on(const RendezvousOptions& o) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(o.port);
  if (int rc = ::getaddrinfo(nullptr, port.c_str(), &hints, &res); rc != 0)
    throw Error(RLH_E_UNAVAILABLE, where(o) + ": cannot resolve the listening address: " + ::gai_strerror(rc));
  std::string why = "no address to listen on";
  Fd out;
  // IPv6 first when there (dual-stack takes IPv4 too), else IPv4.
  std::vector<addrinfo*> order;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next)
    if (a->ai_family == AF_INET6) order.push_back(a);
  for (addrinfo* a = res; a != nullptr; a = a->ai_next)
    if (a->ai_family == AF_INET) order.push_back(a);
  for (addrinfo* a : order) {
    Fd s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (s.fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    int one = 1, zero = 0;
    ::setsockopt(s.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (a->ai_family == AF_INET6) ::setsockopt(s.fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    if (::bind(s.fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(s.fd, std::min(o.size, 4096)) != 0) {
      why = std::strerror(errno);
      continue;
    }
    set_nonblocking(s.fd);
    out = std::move(s);
    break;
  }
  ::freeaddrinfo(res);
  if (out.fd < 0) throw Error(RLH_E_UNAVAILABLE, where(o) + ": rank 0 cannot listen on port " + port + ": " + why);
  return out;
}

std::vector<std::string> serve(const RendezvousOptions& o, const std::string& mine) {
  Fd listener = listen_on(o);
  const auto deadline = Clock::now() + o.timeout;
  std::vector<Peer> peers;
  std::vector<std::string> blobs(static_cast<size_t>(o.size));
  std::vector<int> fd_of_rank(static_cast<size_t>(o.size), -1);
  blobs[0] = mine;
  fd_of_rank[0] = -2;  // rank 0 is here
  int arrived = 1;
  std::string failure;  // set when the exchange fails for everyone

  auto fail_all = [&](rlh_code code, const std::string& msg) {
    const auto until = Clock::now() + std::chrono::milliseconds(500);
    const std::string reply = error_reply(code, msg);
    for (auto& p : peers)
      if (p.rank >= 0) write_all(p.fd.fd, reply, until);
    throw Error(code, msg);
  };

  while (arrived < o.size) {
    const int left = remaining_ms(deadline);
    if (left == 0) {
      std::string missing;
      int count = 0;
      for (int r = 0; r < o.size; ++r) {
        if (fd_of_rank[static_cast<size_t>(r)] != -1) continue;
        if (++count <= 16) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      if (count > 16) missing += " and " + std::to_string(count - 16) + " more";
      fail_all(RLH_E_DEADLINE_EXCEEDED, where(o) + ": rank" + (count == 1 ? " " : "s ") + missing + " of " +
                                            std::to_string(o.size) + " did not arrive within " + seconds(o.timeout));
    }
    std::vector<pollfd> fds;
    fds.push_back({listener.fd, POLLIN, 0});
    for (auto& p : peers) fds.push_back({p.fd.fd, POLLIN, 0});
    ::poll(fds.data(), fds.size(), std::min(left, 200));
    if (fds[0].revents & POLLIN) {
      while (true) {
        const int c = ::accept4(listener.fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c < 0) break;
        // A bound on connections: registered ranks plus a few strays (port scanners, retries).
        if (peers.size() >= static_cast<size_t>(o.size) + 64) {
          ::close(c);
          continue;
        }
        int one = 1;
        ::setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        Peer p;
        p.fd = Fd(c);
        peers.push_back(std::move(p));
      }
    }
    for (size_t i = 0; i < peers.size(); ++i) {
      Peer& p = peers[i];
      if (p.fd.fd < 0 || p.rank >= 0) continue;
      char buf[65536];
      while (true) {
        const ssize_t n = ::recv(p.fd.fd, buf, sizeof buf, 0);
        if (n > 0) {
          p.in.append(buf, static_cast<size_t>(n));
          if (p.in.size() > kHeader + kMaxTag + kMaxBlob) break;
          continue;
        }
        if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) p.fd.reset();  // gone
        break;
      }
      if (p.fd.fd < 0 || p.in.size() < kHeader) continue;
      const char* h = p.in.data();
      const uint32_t magic = get_u32(h), version = get_u32(h + 4), rank = get_u32(h + 8), size = get_u32(h + 12),
                     tag_len = get_u32(h + 16), blob_len = get_u32(h + 20);
      if (magic != kMagic || version != kVersion || tag_len > kMaxTag || blob_len > kMaxBlob) {
        p.fd.reset();  // not one of ours
        continue;
      }
      if (p.in.size() < kHeader + tag_len + blob_len) continue;
      const std::string tag = p.in.substr(kHeader, tag_len);
      p.rank = static_cast<int>(rank);
      if (tag != o.tag)
        fail_all(RLH_E_INVALID_ARGUMENT, where(o) + ": rank " + std::to_string(rank) + " came for rendezvous '" + tag +
                                             "' (another job or another step on the same port?)");
      if (static_cast<int>(size) != o.size)
        fail_all(RLH_E_INVALID_ARGUMENT, where(o) + ": rank " + std::to_string(rank) + " says the world has " +
                                             std::to_string(size) + " ranks, rank 0 says " + std::to_string(o.size));
      if (rank == 0 || static_cast<int>(rank) >= o.size)
        fail_all(RLH_E_INVALID_ARGUMENT, where(o) + ": a process registered as rank " + std::to_string(rank) +
                                             " in a world of " + std::to_string(o.size));
      if (fd_of_rank[rank] != -1)
        fail_all(RLH_E_INVALID_ARGUMENT, where(o) + ": two processes registered as rank " + std::to_string(rank));
      fd_of_rank[rank] = p.fd.fd;
      blobs[rank] = p.in.substr(kHeader + tag_len, blob_len);
      ++arrived;
    }
  }
  std::string reply;
  put_u32(reply, 0);
  for (const auto& b : blobs) {
    put_u32(reply, static_cast<uint32_t>(b.size()));
    reply += b;
  }
  const auto until = Clock::now() + o.timeout;
  for (auto& p : peers)
    if (p.rank >= 0 && p.fd.fd >= 0) write_all(p.fd.fd, reply, until);
  return blobs;
}

// ---- other ranks ------------------------------------------------------------------------------

// Connects to rank 0, retrying refused connections until the deadline; -1 on timeout.
Fd connect_to(const RendezvousOptions& o, Clock::time_point deadline, std::string& why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string port = std::to_string(o.port);
  while (remaining_ms(deadline) > 0) {
    addrinfo* res = nullptr;
    if (int rc = ::getaddrinfo(o.addr.c_str(), port.c_str(), &hints, &res); rc != 0) {
      why = std::string("cannot resolve '") + o.addr + "': " + ::gai_strerror(rc);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      continue;
    }
    for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
      Fd s(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
      if (s.fd < 0) continue;
      int rc = ::connect(s.fd, a->ai_addr, a->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        pollfd p{s.fd, POLLOUT, 0};
        ::poll(&p, 1, std::min(remaining_ms(deadline), 1000));
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &err, &len);
        rc = (p.revents & POLLOUT) && err == 0 ? 0 : -1;
        if (rc != 0) errno = err != 0 ? err : ETIMEDOUT;
      }
      if (rc == 0) {
        ::freeaddrinfo(res);
        int one = 1;
        ::setsockopt(s.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        return s;
      }
      why = std::strerror(errno);
    }
    ::freeaddrinfo(res);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return Fd();
}

enum class Reply { ok, retry, timeout };

// Registers and reads rank 0's answer. `retry`: rank 0 closed before answering anything
// (a previous exchange's listener going away); the caller reconnects.
Reply exchange(const RendezvousOptions& o, int fd, const std::string& request, Clock::time_point deadline,
               std::vector<std::string>& out) {
  if (!write_all(fd, request, deadline)) return remaining_ms(deadline) == 0 ? Reply::timeout : Reply::retry;
  std::string in;
  while (true) {
    // Complete answer?
    if (in.size() >= 4) {
      const uint32_t status = get_u32(in.data());
      if (status == 1 && in.size() >= 12) {
        const uint32_t code = get_u32(in.data() + 4), len = get_u32(in.data() + 8);
        if (len > 4096) throw Error(RLH_E_INTERNAL, where(o) + ": malformed answer from rank 0");
        // Rank 0's failure with its code: a missing rank, or a mismatch.
        if (in.size() >= 12 + len) throw Error(static_cast<rlh_code>(code), in.substr(12, len));
      } else if (status == 0) {
        size_t off = 4;
        std::vector<std::string> blobs;
        bool complete = true;
        for (int r = 0; r < o.size; ++r) {
          if (in.size() < off + 4) { complete = false; break; }
          const uint32_t len = get_u32(in.data() + off);
          if (len > kMaxBlob) throw Error(RLH_E_INTERNAL, where(o) + ": malformed answer from rank 0");
          if (in.size() < off + 4 + len) { complete = false; break; }
          blobs.push_back(in.substr(off + 4, len));
          off += 4 + len;
        }
        if (complete) {
          out = std::move(blobs);
          return Reply::ok;
        }
      } else {
        throw Error(RLH_E_INTERNAL, where(o) + ": malformed answer from rank 0");
      }
    }
    const int left = remaining_ms(deadline);
    if (left == 0) return Reply::timeout;
    pollfd p{fd, POLLIN, 0};
    ::poll(&p, 1, std::min(left, 200));
    char buf[65536];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n > 0) {
      in.append(buf, static_cast<size_t>(n));
      if (in.size() > 8 + static_cast<size_t>(o.size) * (4 + kMaxBlob)) throw Error(RLH_E_INTERNAL, where(o) + ": answer too long");
      continue;
    }
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      if (in.empty()) return Reply::retry;
      throw Error(RLH_E_UNAVAILABLE, where(o) + ": rank 0 closed the connection in the middle of its answer");
    }
  }
}

std::vector<std::string> join(const RendezvousOptions& o, const std::string& mine) {
  std::string request;
  put_u32(request, kMagic);
  put_u32(request, kVersion);
  put_u32(request, static_cast<uint32_t>(o.rank));
  put_u32(request, static_cast<uint32_t>(o.size));
  put_u32(request, static_cast<uint32_t>(o.tag.size()));
  put_u32(request, static_cast<uint32_t>(mine.size()));
  request += o.tag + mine;
  // Rank 0 reports missing ranks at its own deadline; the others wait a little longer so that
  // its line (naming them) is what they print.
  const auto connect_deadline = Clock::now() + o.timeout;
  const auto answer_deadline = connect_deadline + std::chrono::seconds(2);
  std::string why = "nothing listening";
  bool reached = false;
  while (true) {
    Fd s = connect_to(o, connect_deadline, why);
    if (s.fd < 0) break;
    reached = true;
    std::vector<std::string> out;
    const Reply r = exchange(o, s.fd, request, answer_deadline, out);
    if (r == Reply::ok) return out;
    if (r == Reply::timeout) break;
  }
  throw Error(RLH_E_DEADLINE_EXCEEDED,
              where(o) + ": rank " + std::to_string(o.rank) + " of " + std::to_string(o.size) +
                  (reached ? ": rank 0 did not answer within " + seconds(o.timeout)
                           : ": rank 0 could not be reached within " + seconds(o.timeout) + " (" + why +
                                 "; is rank 0 running, and are MASTER_ADDR / MASTER_PORT the same on every rank?)"));
}

}  // namespace

std::vector<std::string> rendezvous_all_gather(const RendezvousOptions& o, const std::string& mine) {
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size)
    throw Error(RLH_E_INVALID_ARGUMENT, "rendezvous: rank " + std::to_string(o.rank) + " is not in a world of " + std::to_string(o.size));
  if (mine.size() > kMaxBlob) throw Error(RLH_E_INVALID_ARGUMENT, "rendezvous: a blob of " + std::to_string(mine.size()) + " bytes exceeds 1 MiB");
  if (o.tag.size() > kMaxTag) throw Error(RLH_E_INVALID_ARGUMENT, "rendezvous: tag longer than 256 bytes");
  if (o.timeout.count() <= 0) throw Error(RLH_E_INVALID_ARGUMENT, "rendezvous: timeout must be positive");
  if (o.size == 1) return {mine};
  if (o.port < 1 || o.port > 65535)
    throw Error(RLH_E_INVALID_ARGUMENT, "rendezvous '" + o.tag + "': port " + std::to_string(o.port) + " is not a TCP port (MASTER_PORT)");
  if (o.rank != 0 && o.addr.empty())
    throw Error(RLH_E_INVALID_ARGUMENT, "rendezvous '" + o.tag + "': no address for rank 0 (set MASTER_ADDR)");
  return o.rank == 0 ? serve(o, mine) : join(o, mine);
}

}  // namespace rlh::sdk
