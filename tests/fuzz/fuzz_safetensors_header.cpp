// libFuzzer target: arbitrary bytes as a safetensors file image. The reader must either accept it
// (and then every tensor it reports must be readable inside the image) or throw
// std::runtime_error; never crash, hang or read out of bounds (run under ASan/UBSan).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/sdk/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rlh::sdk::st;
  std::vector<std::byte> bytes(size);
  if (size) std::memcpy(bytes.data(), data, size);
  try {
    const File f = File::from_bytes(std::move(bytes), "fuzz.safetensors");
    uint64_t covered = 0;
    for (const auto& t : f.tensors()) {
      const auto span = f.data(t);
      if (span.size() != t.numel() * dtype_size(t.dtype)) __builtin_trap();
      covered += span.size();
      // Converting touches every byte of the tensor; ASan catches any overrun.
      std::vector<double> out(static_cast<size_t>(t.numel()));
      convert_to_f64(t.dtype, span.data(), out.size(), out.data());
      if (f.find(t.name) != &t) __builtin_trap();
    }
    if (8 + f.header_size() + covered != size) __builtin_trap();
  } catch (const std::runtime_error&) {
  }
  // The same bytes as JSON text through the strict parser (index files and configs use it).
  try {
    (void)parse_json_strict({reinterpret_cast<const char*>(data), size}, "fuzz.json");
  } catch (const std::runtime_error&) {
  }
  return 0;
}
