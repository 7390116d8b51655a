// Builds an executor's KernelRegistry (kernels.hpp) from the host's kernel providers: every
// usable KERNELS component, in the host's score order, that creates an instance on the device;
// providers that declare themselves the reference (provider_info) go last. Static library
// rlh_kernel_registry.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "rlhost/sdk/kernel_check.hpp"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/plugin.hpp"

namespace rlh::sdk {

// (op or op family, provider) pairs, e.g. {"gemm", "vendor_x"}, {"attention", "kernels_cudnn"}.
using KernelPins = std::vector<std::pair<std::string, std::string>>;

// The pins of a `policy.kernels` config section (JSON object text): every key but "verify"
// names an op or op family and its value a provider; "auto", "" or null pins nothing. Throws
// Error(INVALID_ARGUMENT) naming the key when a value is not a string.
KernelPins kernel_pins_from_json(const std::string& section_json);

// policy.kernels.verify of the same section: true when absent; throws Error(INVALID_ARGUMENT)
// when it is not a boolean.
bool kernel_verify_from_json(const std::string& section_json);

// The registry for `device`. A provider whose create() answers UNIMPLEMENTED or UNAVAILABLE
// (another device kind, no GPU here) is left out quietly; one that fails otherwise is left out
// with a warning naming it, unless a pin names it, which is then an error. Pins naming a
// provider the host does not have are errors naming the key. `who` prefixes log lines
// ("megatron", "generator"). `instance_config` (a JSON object) is every provider's create()
// config: keys a provider does not know it ignores (kernels_cpu: {"num_threads": N}, the threads
// of its decode-sized ops).
// With `verify` (policy.kernels.verify, default true) no provider is chosen unchecked: every
// provider but the reference runs the conformance runner (kernel_check.hpp) on the device first,
// and an op it fails is left out for it, with one warning line naming the provider, the op, the
// dtype and the worst error (the op then falls through to the next provider). A pin to a
// provider for an op it fails is an error; no reference to check against is an error.
std::unique_ptr<KernelRegistry> make_kernel_registry(const Host& host, rlh_device device,
                                                     const KernelPins& pins,
                                                     const std::string& who,
                                                     const std::string& instance_config = "{}",
                                                     bool verify = true);

}  // namespace rlh::sdk
