// The default Scratch: 64-byte aligned heap memory.
#include <cstdlib>

#include "rlhost/kernels_cpu/scratch.hpp"

namespace rlh::kcpu {
namespace {
void* default_alloc(void*, size_t bytes) {
  return std::aligned_alloc(64, (bytes + 63) / 64 * 64);
}
void default_free(void*, void* p, size_t) { std::free(p); }
}  // namespace

const Scratch& scratch_default() {
  static const Scratch s{default_alloc, default_free, nullptr};
  return s;
}
}  // namespace rlh::kcpu
