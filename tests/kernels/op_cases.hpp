// Op test cases for kernels_cpu, in the style of llama.cpp's test-backend-ops: each case is one
// op on small random operands with
//   - the kernel's forward and backward at float and at double precision,
//   - an independent float64 oracle of the forward (a plain formula, no tiling or chunking).
// test_kernels_cpu.cpp checks the kernel against the oracle and its backward against finite
// differences. The provider conformance cases (every provider through the ABI against
// kernels_cpu) are the SDK's: sdk/kernel_check/cases_*.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace rlh::kcpu::testing {

template <class T>
using Bufs = std::vector<std::vector<T>>;

// An integer operand (ids, positions, sequence offsets, targets): always int32, contiguous.
struct IntOperand {
  std::vector<int32_t> values;
  std::vector<int64_t> shape;
};

struct OpCase {
  std::string name;
  std::vector<int64_t> in_sizes;   // float inputs, in elements
  std::vector<bool> in_grad;       // inputs whose gradient the backward produces
  std::vector<double> in_scale;    // standard deviation of each random input
  std::vector<int64_t> out_sizes;  // float outputs of the forward
  std::vector<bool> out_loss;      // outputs that enter the loss (the rest is saved state)
  std::vector<bool> in_positive;   // inputs drawn as |x| (variances)
  std::vector<IntOperand> ints;

  // Forward: outputs (pre-sized, zero) from inputs. Backward: input gradients (pre-sized, zero)
  // from inputs, forward outputs and output gradients (zero for outputs not in the loss).
  std::function<void(const Bufs<float>&, Bufs<float>&)> fwd32;
  std::function<void(const Bufs<double>&, Bufs<double>&)> fwd64;
  std::function<void(const Bufs<float>&, const Bufs<float>&, const Bufs<float>&, Bufs<float>&)>
      bwd32;
  std::function<void(const Bufs<double>&, const Bufs<double>&, const Bufs<double>&,
                     Bufs<double>&)>
      bwd64;
  // The oracle: outputs that are in the loss (others left as is).
  std::function<void(const Bufs<double>&, Bufs<double>&)> ref64;

  // Integer outputs (MoE: chosen experts, permutation rows, group offsets) are entries of
  // `ints`; those entries hold the values before the call (replayed experts). fwd_ints32
  // computes them with kernels_cpu from the inputs fwd32 gets, ref_ints64 with the oracle.
  // Cases without integer outputs leave both empty. fwd32/bwd32 never need them: they
  // recompute.
  std::function<void(const Bufs<float>&, std::vector<IntOperand>&)> fwd_ints32;
  std::function<void(const Bufs<double>&, std::vector<IntOperand>&)> ref_ints64;

  double fwd_tol = 2e-6;  // float kernel vs oracle, max|err| / max|ref| per output
  double bwd_tol = 2e-5;  // float backward vs double backward
  double fd_tol = 1e-6;   // double backward vs finite differences
};

// Every case, in a fixed order.
std::vector<OpCase> all_op_cases();

}  // namespace rlh::kcpu::testing
