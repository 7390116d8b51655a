// Fuzzes the plugin file checks that run before dlopen: the input is the file. check_elf_image
// must accept only images whose headers, segments and dynamic tables lie inside the file, and
// must never read outside it (the reader below traps if asked to).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "plugin_file.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string r = rlh::host::check_elf_image(size, [&](uint64_t offset, size_t len, void* out) {
    if (offset > size || len > size - offset) __builtin_trap();  // the check must bound its reads
    std::memcpy(out, data + offset, len);
    return true;
  });
  if (r.find('\n') != std::string::npos) __builtin_trap();
  return 0;
}
