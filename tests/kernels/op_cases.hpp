// Op test cases for kernels_cpu, in the style of llama.cpp's test-backend-ops: each case is one
// op on small random operands with
//   - the kernel's forward and backward at float and at double precision,
//   - an independent float64 oracle of the forward (a plain formula, no tiling or chunking),
//   - and, for the provider conformance test, the op's ABI name, tensors and attributes.
// test_kernels_cpu.cpp checks the kernel against the oracle and its backward against finite
// differences; test_op_conformance.cpp runs the same cases on every loaded provider.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace rlh::kcpu::testing {

template <class T>
using Bufs = std::vector<std::vector<T>>;

// How one float operand of a case is laid out as an ABI tensor (shape and strides in elements
// over the case's buffer of that operand, from offset elements in).
struct TensorLayout {
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // empty = contiguous
  int64_t offset = 0;
};

// An integer operand (ids, positions, sequence offsets, targets): always int32, contiguous.
struct IntOperand {
  std::vector<int32_t> values;
  std::vector<int64_t> shape;
};

// One operand of the ABI call: a float buffer of the case (input i or output i) or an integer
// operand (index into ints).
struct AbiOperand {
  // input/output/grad_input/grad_output/saved: float buffer `index` of the case's inputs,
  // forward outputs, input gradients, output gradients, forward outputs read by the backward.
  // ints: integer operand `index`. f32_const: float32 constant `index` (RoPE inv_freq).
  enum Kind { input, output, ints, grad_input, grad_output, saved, f32_const } kind;
  int index = 0;
  TensorLayout layout;
};

struct AbiAttr {
  std::string name;
  bool is_double = false;
  int64_t i = 0;
  double d = 0;
};

// The op as one ABI call (forward) and optionally a second one (backward).
struct AbiCall {
  std::string op;
  std::vector<AbiOperand> inputs, outputs;
  std::vector<AbiAttr> attrs;
  // In-out operands: before the call, output `second` is filled with input `first` (gemm's C
  // with beta != 0, bias_add's y, the optimizer's state).
  std::vector<std::pair<int, int>> init_outputs;
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
  std::vector<std::vector<float>> f32_consts;

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

  // Integer outputs (MoE: chosen experts, permutation rows, group offsets) are entries of `ints`
  // that the ABI forward lists among its outputs (kind ints); those entries hold the values
  // before the call (read by in/out operands, e.g. replayed experts). fwd_ints32 computes them
  // with kernels_cpu from the inputs fwd32 gets, ref_ints64 with the oracle; the conformance
  // test compares a provider's exactly, and its backward call reads the reference's. Cases
  // without integer outputs leave both empty. fwd32/bwd32 never need them: they recompute.
  std::function<void(const Bufs<float>&, std::vector<IntOperand>&)> fwd_ints32;
  std::function<void(const Bufs<double>&, std::vector<IntOperand>&)> ref_ints64;

  double fwd_tol = 2e-6;  // float kernel vs oracle, max|err| / max|ref| per output
  double bwd_tol = 2e-5;  // float backward vs double backward
  double fd_tol = 1e-6;   // double backward vs finite differences

  AbiCall abi_fwd;
  AbiCall abi_bwd;  // op empty when the op has no backward op (its backward is other ops)
};

// Every case, in a fixed order.
std::vector<OpCase> all_op_cases();

}  // namespace rlh::kcpu::testing
