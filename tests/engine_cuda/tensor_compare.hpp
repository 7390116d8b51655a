// How far two sets of tensors (desc().params order, fp32) are apart, for the engine tests that
// compare several ranks' results with one engine's.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace rlh::test {

using Tensors = std::vector<std::vector<float>>;

// ||a - b|| / ||b - base|| over all tensors: how far two updates from `base` differ.
inline double update_error(const Tensors& a, const Tensors& b, const Tensors& base) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t k = 0; k < a[i].size(); ++k) {
      num += std::pow(double(a[i][k]) - b[i][k], 2);
      den += std::pow(double(b[i][k]) - base[i][k], 2);
    }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// ||a - b|| / ||b|| over all tensors.
inline double relative_error(const Tensors& a, const Tensors& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t k = 0; k < a[i].size(); ++k) {
      num += std::pow(double(a[i][k]) - b[i][k], 2);
      den += std::pow(double(b[i][k]), 2);
    }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace rlh::test
