// Philox4x32-10 and the keyed uniform (rationale in rng.hpp).
#include "rlhost/generator/rng.hpp"

namespace rlh::gen {

namespace {

constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;  // round multipliers
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule increments

inline void mulhilo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = uint64_t(a) * uint64_t(b);
  *hi = uint32_t(p >> 32);
  *lo = uint32_t(p);
}

}  // namespace

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {  // the key advances between rounds
      k[0] += kWeyl0;
      k[1] += kWeyl1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kMul0, c[0], &hi0, &lo0);
    mulhilo(kMul1, c[2], &hi1, &lo1);
    c = {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
  }
  return c;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

double uniform01(const DrawKey& key, int64_t token_index) {
  const uint64_t k = splitmix64(key.seed ^ splitmix64(uint64_t(key.step)));
  const uint64_t p = uint64_t(key.prompt_index);
  const std::array<uint32_t, 4> r = philox4x32_10(
      {uint32_t(uint64_t(token_index)), uint32_t(uint64_t(key.sample_index)), uint32_t(p),
       uint32_t(p >> 32)},
      {uint32_t(k), uint32_t(k >> 32)});
  // 53 bits: 26 from one word, 27 from another (the usual double-from-two-words recipe).
  const uint64_t bits = (uint64_t(r[0] >> 6) << 27) | uint64_t(r[1] >> 5);
  return double(bits) * (1.0 / 9007199254740992.0);  // 2^-53
}

}  // namespace rlh::gen
