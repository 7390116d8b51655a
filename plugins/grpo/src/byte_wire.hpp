// Bytes for the loops' collectives: the ranks exchange batches and rollouts as flat byte
// strings (all_gather_bytes), written and read by these two. Lengths are int64; a reader checks
// every count against the bytes left before it allocates, so malformed bytes are an error naming
// `what` and `from`, never a huge allocation.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "rlhost/sdk/plugin.hpp"

namespace rlh::grpo {

struct ByteWriter {
  std::vector<uint8_t> out;
  void raw(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  }
  void i64(int64_t v) { raw(&v, sizeof v); }
  void f64(double v) { raw(&v, sizeof v); }
  void str(const std::string& s) {
    i64(static_cast<int64_t>(s.size()));
    raw(s.data(), s.size());
  }
  template <class T>
  void vec(const std::vector<T>& v) {
    i64(static_cast<int64_t>(v.size()));
    raw(v.data(), v.size() * sizeof(T));
  }
};

struct ByteReader {
  std::span<const uint8_t> in;
  std::string what;  // e.g. "token balancing: rank 1's batch"
  size_t at = 0;
  [[noreturn]] void fail(const char* how) const { throw sdk::Error(RLH_E_INTERNAL, what + " bytes are " + how); }
  void raw(void* p, size_t n) {
    if (n > in.size() - at) fail("truncated");
    if (n > 0) std::memcpy(p, in.data() + at, n);
    at += n;
  }
  int64_t i64() {
    int64_t v = 0;
    raw(&v, sizeof v);
    if (v < 0) fail("malformed");
    return v;
  }
  int64_t s64() {  // a signed value (e.g. a weight version of -1)
    int64_t v = 0;
    raw(&v, sizeof v);
    return v;
  }
  double f64() {
    double v = 0;
    raw(&v, sizeof v);
    return v;
  }
  // Throws unless `n` items of `each` bytes fit in what is left.
  void fits(int64_t n, size_t each) const {
    if (n < 0 || static_cast<uint64_t>(n) > (in.size() - at) / each) fail("truncated");
  }
  std::string str() {
    const int64_t n = i64();
    fits(n, 1);
    std::string s(static_cast<size_t>(n), '\0');
    raw(s.data(), s.size());
    return s;
  }
  template <class T>
  std::vector<T> vec() {
    const int64_t n = i64();
    fits(n, sizeof(T));
    std::vector<T> v(static_cast<size_t>(n));
    raw(v.data(), v.size() * sizeof(T));
    return v;
  }
};

}  // namespace rlh::grpo
