// CRC32C (Castagnoli polynomial 0x1EDC6F41, reflected 0x82F63B78).
//
// Two implementations with identical results: the SSE4.2 `crc32` instruction (8 bytes per
// instruction, chosen at run time from cpuid so the library still runs on any x86-64), and
// slicing-by-8 tables for other CPUs. Checkpoint manifests checksum every byte of a checkpoint,
// so the fast path matters for multi-gigabyte weights.
#include "rlhost/sdk/crc32c.hpp"

#include <array>
#include <cstring>

namespace rlh::sdk {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;

// tables[k][b]: CRC of byte b followed by k zero bytes, for slicing-by-8.
struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  constexpr Tables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int i = 0; i < 8; ++i) c = (c >> 1) ^ ((c & 1u) ? kPoly : 0u);
      t[0][b] = c;
    }
    for (int k = 1; k < 8; ++k)
      for (uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
  }
};
constexpr Tables kTables;

uint32_t extend_tables(uint32_t crc, const unsigned char* p, size_t n) {
  const auto& t = kTables.t;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
    crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
    --n;
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);  // little-endian hosts only (x86-64, aarch64)
    v ^= crc;
    crc = t[7][v & 0xFF] ^ t[6][(v >> 8) & 0xFF] ^ t[5][(v >> 16) & 0xFF] ^ t[4][(v >> 24) & 0xFF] ^
          t[3][(v >> 32) & 0xFF] ^ t[2][(v >> 40) & 0xFF] ^ t[1][(v >> 48) & 0xFF] ^
          t[0][(v >> 56) & 0xFF];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t extend_sse42(uint32_t crc, const unsigned char* p,
                                                        size_t n) {
  uint64_t c = crc;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
    c = __builtin_ia32_crc32qi(static_cast<uint32_t>(c), *p++);
    --n;
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = __builtin_ia32_crc32qi(static_cast<uint32_t>(c), *p++);
  return static_cast<uint32_t>(c);
}

bool have_sse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

}  // namespace

uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n) {
  return ~extend_tables(~crc, static_cast<const unsigned char*>(data), n);
}

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  crc = have_sse42() ? extend_sse42(crc, p, n) : extend_tables(crc, p, n);
#else
  crc = extend_tables(crc, p, n);
#endif
  return ~crc;
}

}  // namespace rlh::sdk
