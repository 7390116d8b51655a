// Fuzzes interpolation and the resolvers: each NUL-separated part of the input is the value of
// one key (x0, x1, ... added with ++xN=...) in a config holding 64-bit extremes, floats and a
// list, so ${mul:...}, ${div:...}, ${add:...}, ${max:...}, ${min:...}, nested and relative
// references, cycles and expansion bombs are all reachable. Resolving must succeed or throw a
// one-line ConfigError: no wrap, no SIGFPE, no unbounded expansion.
#include <cstdint>
#include <string>
#include <vector>

#include "config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> parts(1);
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0) parts.emplace_back();
    else parts.back() += static_cast<char>(data[i]);
  }
  rlh::host::Config cfg;
  try {
    cfg.load_text(
        "n:\n  max: 9223372036854775807\n  min: -9223372036854775808\n  neg: -1\n  zero: 0\n  f: 2.5\n"
        "  big: 1.0e308\n  s: text\n  l: [1, 2, 3]\n  m: {a: 1, b: '${n.max}'}\n",
        "fuzz");
    for (size_t i = 0; i < parts.size() && i < 12; ++i) cfg.apply_override("++x" + std::to_string(i) + "=" + parts[i]);
    const rlh::host::Json r = cfg.resolved();
    (void)rlh::host::to_yaml(r);
  } catch (const rlh::host::ConfigError& e) {
    const std::string m = e.what();
    if (m.empty()) __builtin_trap();
  }
  return 0;
}
