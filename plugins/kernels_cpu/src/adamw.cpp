// Optimizer kernels: AdamW (with clipping folded in), sum of squares, scale.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "rlhost/kernels_cpu/kernels.hpp"

namespace rlh::kcpu {

// Loops over large arrays are scheduled in dynamic chunks so a thread slowed by another process
// does not hold up the other (the same reason as gemm.cpp's split).

// One pass over p, g, m, v: reads four arrays and writes three (four with zero_grad), the least
// memory traffic an unfused optimizer can have. Element-wise, so the thread split cannot change
// results.
void adamw(float* p, float* g, float* m, float* v, int64_t n, const AdamWOpts& o) {
  if (o.step < 1) throw std::invalid_argument("adamw: step counts from 1");
  const float b1 = float(o.beta1), b2 = float(o.beta2), eps = float(o.eps);
  const float decay = float(1.0 - o.lr * o.weight_decay);
  const float gs = float(o.grad_scale);
  // Bias corrections folded into the step size and the denominator (exactly torch's
  // formulation: p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)).
  const double bc1 = 1.0 - std::pow(o.beta1, double(o.step));
  const double bc2 = 1.0 - std::pow(o.beta2, double(o.step));
  const float step_size = float(o.lr / bc1);
  const float inv_sqrt_bc2 = float(1.0 / std::sqrt(bc2));
  const bool zero = o.zero_grad;
#pragma omp parallel for simd schedule(dynamic, 16384) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * gs;
    const float mi = b1 * m[i] + (1.f - b1) * gi;
    const float vi = b2 * v[i] + (1.f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - step_size * mi / (std::sqrt(vi) * inv_sqrt_bc2 + eps);
    if (zero) g[i] = 0.f;
  }
}

// Fixed 64K-element chunks summed in double, then added in chunk order: the same result for any
// thread count.
double sumsq(const float* x, int64_t n) {
  const int64_t chunk = 65536, chunks = (n + chunk - 1) / chunk;
  std::vector<double> part(chunks);
#pragma omp parallel for schedule(dynamic, 1) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t i0 = c * chunk, i1 = std::min(n, i0 + chunk);
    double acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = i0; i < i1; ++i) acc += double(x[i]) * double(x[i]);
    part[c] = acc;
  }
  double total = 0;
  for (double v : part) total += v;
  return total;
}

void scale(float* x, int64_t n, float s) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

}  // namespace rlh::kcpu
