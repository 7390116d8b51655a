// rlhost SDK: CRC32C (Castagnoli), the checksum of TFRecord framing (TensorBoard event files)
// and of checkpoint manifests.
//
// crc32c_extend(crc32c(a), b) == crc32c(a + b), so large files are checksummed in pieces.
// Uses the SSE4.2 crc32 instruction when the CPU has it, else slicing-by-8 tables; both give the
// same values (tests/metrics checks them against published vectors).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace rlh::sdk {

// Continues a CRC32C over `n` more bytes. `crc` is a previous result (0 to start).
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);

// The table implementation alone, whatever the CPU (tests compare it with crc32c_extend).
uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n);

inline uint32_t crc32c(const void* data, size_t n) { return crc32c_extend(0, data, n); }
inline uint32_t crc32c(std::string_view s) { return crc32c_extend(0, s.data(), s.size()); }

// TFRecord's masked CRC: rotated and offset, because a CRC of data that itself contains CRCs is
// weak (TensorFlow's record_io and tensorboard's reader apply and undo this).
inline uint32_t crc32c_mask(uint32_t crc) {
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}
inline uint32_t crc32c_unmask(uint32_t masked) {
  const uint32_t rot = masked - 0xa282ead8u;
  return (rot >> 17) | (rot << 15);
}

}  // namespace rlh::sdk
