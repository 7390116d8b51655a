// The kernel conformance runner (static library rlh_kernel_check): every op a kernel provider
// lists, in every dtype variant it claims, on the device of its instance, against the contract's
// reference provider (the one whose provider_info says "reference": true; kernels_cpu), in
// float64 where the reference offers it. Cases are data (sdk/kernel_check/cases_*.cpp): small
// random operands (never zeros), strided layouts, in/out and accumulated outputs, integer
// operands. A device-memory provider's operands are staged through its memory services;
// written outputs are poisoned with NaN first; integer outputs must match exactly; nothing
// outside an output's layout may change. The SDK names no provider: `rlhost check-kernels`
// and make_kernel_registry's verification (kernel_registry.hpp) both run this.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "rlhost/kernels.h"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/plugin.hpp"

namespace rlh::sdk {

// A dtype variant of an op: the dtype of each kind of float operand. A provider claims the
// variants named by the "dtypes" of its list_ops entry; "bf16" also makes the runner try
// "bf16+f32" (statistics and parameter gradients f32: what an engine passes), which counts as
// not offered where every case is refused. FP8 variants name the format of the op's float
// inputs; each fp8 input has a float32 [1] dequantisation scale (value = scale x stored),
// appended after the call's inputs in input order (docs/ops.md, "dtypes"). Tolerances are on
// max|err| / max|ref| over an output, the reference computing on the same (rounded) inputs.
struct KernelVariant {
  const char* name;    // as listed and as the table's column: f32, bf16, bf16+f32, f64, e4m3, e5m2
  const char* family;  // the listed dtype that claims it when it is probed
  rlh_dtype inputs, outputs, statistics;
  bool scaled;         // fp8 inputs with per-tensor scales
  bool probed;         // tried when `family` is listed
  double tolerance;
  // A weight-only variant: the dtype of the operands cases mark as weights (gemm's B; with its
  // scale appended), the others in `inputs`; only such cases run in it. bits 0: not one.
  rlh_dtype weights{};
};
const std::vector<KernelVariant>& kernel_variants();

// "cpu", "cuda:0", ...
std::string device_name(rlh_device d);

// Facts a provider instance states about itself (provider_info; defaults when absent).
struct ProviderFacts {
  bool reference = false;
  bool device_memory = false;
};
ProviderFacts provider_facts(const rlh_kernels_api* api, rlh_kernels* instance);

// The reference provider with an instance on the CPU.
class ReferenceKernels {
 public:
  // The first of the host's KERNELS components (score order) that creates an instance on the
  // CPU and says "reference": true; null when there is none.
  static std::unique_ptr<ReferenceKernels> find(const Host& host);
  ReferenceKernels(std::string name, const rlh_kernels_api* api, rlh_kernels* instance)
      : name_(std::move(name)), api_(api), instance_(instance) {}
  ~ReferenceKernels();
  ReferenceKernels(const ReferenceKernels&) = delete;
  ReferenceKernels& operator=(const ReferenceKernels&) = delete;
  const std::string& name() const { return name_; }
  const rlh_kernels_api* api() const { return api_; }
  rlh_kernels* instance() const { return instance_; }

 private:
  std::string name_;
  const rlh_kernels_api* api_;
  rlh_kernels* instance_;
};

struct KernelCheckOptions {
  std::vector<std::string> ops;  // only these ops (empty: every op)
};

// One (op, variant) of a report.
struct KernelCheckCell {
  enum State {
    not_offered,   // the provider does not list the op, or not this dtype
    same,          // bf16+f32 of an op without statistics operands: the bf16 column
    no_case,       // listed, but the runner has no case for the op (its coverage fails)
    no_reference,  // the reference cannot run the op's cases
    refused,       // listed, but every case was refused at resolve (UNIMPLEMENTED)
    pass,
    fail,
  } state = not_offered;
  double worst = 0;      // max|err| / max|ref| over every case and output (pass, fail)
  double tolerance = 0;  // of the worst output
  int calls = 0;         // op calls compared
  int refused_cases = 0;  // cases refused at resolve
  std::string where;     // fail: the case and output of the worst error, or the failure
  std::string note;      // refusals: the first reason
};

struct KernelCheckRow {
  std::string op;
  bool listed = false;
  std::vector<KernelCheckCell> cells;  // one per kernel_variants() entry
  bool failed() const;
};

struct KernelCheckReport {
  std::string provider, reference, device;
  std::vector<KernelCheckRow> rows;  // every op the runner has cases for, then listed ops without
  bool failed() const;
  // One line per failing (op, variant): "gemm f32: worst error 3.2e-01 > 1e-05 in case '...'".
  std::vector<std::string> failures() const;
  // The op x variant table, then the failures and the refusals.
  std::string table() const;
  const KernelCheckRow* row(const std::string& op) const;
};

// Checks `instance` of provider `name` (created on `device`) against the reference.
KernelCheckReport check_kernels(const ReferenceKernels& ref, const std::string& name,
                                const rlh_kernels_api* api, rlh_kernels* instance,
                                rlh_device device, const KernelCheckOptions& opts = {});

// The ops the runner has cases for, in case order.
std::vector<std::string> kernel_check_ops();

}  // namespace rlh::sdk
