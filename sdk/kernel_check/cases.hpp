// The conformance runner's op cases, as data: each case is one op of the contract (docs/ops.md)
// on small operands, as one ABI call (the forward) and optionally a second (its backward op),
// with the operand layouts (strided ones too), attributes, input distributions, integer
// operands, in/out and accumulated outputs. Nothing here knows a provider: the runner
// (runner.cpp) stages the buffers for the provider under test and for the reference and
// compares what they write.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace rlh::sdk::kcheck {

// Shape and strides (elements) of an operand over its buffer, from `offset` elements in.
struct Layout {
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // empty = contiguous
  int64_t offset = 0;
};

// Which buffer of the case an operand reads or writes.
enum class Src : uint8_t {
  input,        // case input i (random, drawn once per case)
  output,       // forward output i
  ints,         // integer operand i (ids, positions, offsets; MoE outputs are written here)
  grad_input,   // gradient of input i (written by the backward)
  grad_output,  // gradient of forward output i (random)
  saved,        // forward output i as the reference computed it, read by the backward
  constant,     // float32 constant i (RoPE inv_freq)
};

// The dtype an operand takes in a variant (kernel_check.hpp, KernelVariant).
enum class Role : uint8_t {
  automatic,  // filled in by finish(): ints -> i32, constants -> f32, else flt or stat
  flt,        // the op's float dtype (the variant's input or output dtype)
  stat,       // a statistic or parameter gradient: f32 in a "bf16+f32" op (docs/ops.md)
  i32,
  f32,        // always float32 (RoPE inv_freq, sample's logits and logprobs)
  f64,        // always float64 (sample's uniforms)
  bf16,       // always bfloat16 (adamw_bf16's working copy)
  weight,     // the op's float dtype, or a weight-only variant's weight dtype (gemm's B)
};

struct Operand {
  Src src;
  int index = 0;
  Layout layout;
  Role role = Role::automatic;
};

struct Attr {
  std::string name;
  bool is_double = false;
  int64_t i = 0;
  double d = 0;
};

struct Call {
  std::string op;  // empty: no such call
  std::vector<Operand> inputs, outputs;
  std::vector<Attr> attrs;
  // In/out outputs: before the call, output buffer `second` holds input buffer `first` (gemm's C
  // with beta != 0, bias_add's y, the optimizer's state).
  std::vector<std::pair<int, int>> init_outputs;
  // Output positions the op adds into (+=): they start from random values, not poison.
  std::vector<int> accumulate;
};

struct IntBuf {
  std::vector<int32_t> values;
  std::vector<int64_t> shape;
};

struct Case {
  std::string name;
  std::vector<int64_t> in_sizes;   // float inputs, elements
  std::vector<double> in_scale;    // standard deviation of each input's normal draws
  std::vector<bool> in_positive;   // inputs drawn as |x| (variances)
  std::vector<bool> in_uniform;    // inputs drawn uniform in [0, 1) (sample's u)
  std::vector<int64_t> out_sizes;  // float outputs of the forward, elements
  std::vector<IntBuf> ints;
  std::vector<std::vector<float>> consts;
  bool ints_read = false;  // integer outputs are read before they are written (routing replay)
  Call fwd, bwd;
  // A batch-invariant op (attribute batch_invariant = 1): the forward again on a prefix of the
  // rows, same buffers; the rows it writes must equal the full call's bit for bit.
  Call fwd_prefix;
};

// Every case, in a fixed order (cases_*.cpp).
std::vector<Case> all_cases();

// Per family (each file builds its own).
void add_dense_cases(std::vector<Case>& v);     // gemm .. add, cases_dense.cpp
void add_logprob_cases(std::vector<Case>& v);   // linear_logprob, cases_logprob.cpp
void add_moe_cases(std::vector<Case>& v);       // router, permute, grouped gemm, cases_moe.cpp
void add_optimizer_cases(std::vector<Case>& v); // adamw, adamw_bf16, sumsq, amax, scale, cases_moe.cpp
void add_loss_cases(std::vector<Case>& v);      // clipped_pg_loss, nll_loss, cases_loss.cpp
void add_decode_cases(std::vector<Case>& v);    // kv_cache_write, paged_attention, sample, cases_decode.cpp
// Cases added later, appended after all of the above: a case's index seeds its inputs, so a
// case inserted in the middle would draw new data for every case after it.
void add_dense_cases_late(std::vector<Case>& v);
void add_weight_only_cases(std::vector<Case>& v);
void add_decode_cases_late(std::vector<Case>& v);
void add_decode_layer_cases(std::vector<Case>& v);  // decode_layer_fwd, cases_decode.cpp
void add_fp8_cache_cases(std::vector<Case>& v);     // paged_attention over FP8 caches, cases_decode.cpp
void add_fused_product_cases(std::vector<Case>& v); // rmsnorm_gemm_fwd, gemm_add_fwd, cases_dense.cpp
void add_residual_epilogue_cases(std::vector<Case>& v);  // gemm_add_fwd round_product=0, cases_dense.cpp
void add_rope_kv_cases(std::vector<Case>& v);       // rope_kv_cache_write, cases_decode.cpp

// ---- Builders shared by the case files.

inline Layout contiguous(std::vector<int64_t> shape) { return Layout{std::move(shape), {}, 0}; }
inline Layout strided(std::vector<int64_t> shape, std::vector<int64_t> strides) {
  return Layout{std::move(shape), std::move(strides), 0};
}
inline Operand in(int i, Layout l) { return {Src::input, i, std::move(l)}; }
inline Operand out(int i, Layout l) { return {Src::output, i, std::move(l)}; }
inline Operand ints(int i, std::vector<int64_t> shape) { return {Src::ints, i, contiguous(std::move(shape))}; }
inline Operand cst(int i, std::vector<int64_t> shape) { return {Src::constant, i, contiguous(std::move(shape))}; }
inline Operand gin(int i, Layout l) { return {Src::grad_input, i, std::move(l)}; }
inline Operand gout(int i, Layout l) { return {Src::grad_output, i, std::move(l)}; }
inline Operand saved(int i, Layout l) { return {Src::saved, i, std::move(l)}; }
inline Attr attr_i(const char* n, int64_t v) { return Attr{n, false, v, 0}; }
inline Attr attr_d(const char* n, double v) { return Attr{n, true, 0, v}; }

// Sets the roles left automatic (statistics by the table of docs/ops.md) and checks the case's
// buffer references; throws std::logic_error on a malformed case.
void finish(Case& c);

}  // namespace rlh::sdk::kcheck
