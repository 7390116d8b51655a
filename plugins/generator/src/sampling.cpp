// SamplingParams checks (sampling.hpp); the draw is the registry's `sample` op.
#include "rlhost/generator/sampling.hpp"

#include <cmath>
#include <stdexcept>
#include <string>

namespace rlh::gen {

void validate(const SamplingParams& p) {
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature))
    throw std::invalid_argument("sampling: temperature must be a finite number >= 0 (0 = greedy), got " +
                                std::to_string(p.temperature));
  if (p.top_k < -1)
    throw std::invalid_argument("sampling: top_k must be >= 0 (0 or -1 = off), got " + std::to_string(p.top_k));
  if (!(p.top_p > 0 && p.top_p <= 1))
    throw std::invalid_argument("sampling: top_p must be in (0, 1], got " + std::to_string(p.top_p));
  if (!(p.min_p >= 0 && p.min_p <= 1))
    throw std::invalid_argument("sampling: min_p must be in [0, 1], got " + std::to_string(p.min_p));
}

}  // namespace rlh::gen
