// vendor_fp8: a kernel provider as a vendor outside the rlhost tree would ship it, built only
// against the installed SDK (find_package(rlsdk)). It answers for FP8 and nothing else; every
// other op, dtype and shape falls through to the next provider (kernels_cuda). What it offers
// (README.md):
//
//   gemm          e4m3 (and e5m2 x e4m3, NeMo-RL's `hybrid` gradients) per docs/ops.md's fp8
//                 variant: A [M, K], B [N, K] with transpose_b = 1, a float32 dequantisation scale
//                 per operand appended after the inputs, C float32 or bf16 (alpha, beta), on
//                 cuBLASLt. `scaling` = 1: A's scales per 1x128 tile, B's per 128x128 block
//                 (DeepSeek-V3 blockwise); 2: both per 1x128 tile (the weight gradient).
//   amax          x (f32 or bf16, 1-D or [R, C]) -> max |x| as float32 [1].
//   quantize_fp8  x [R, C] (f32 or bf16) -> q (e4m3 or e5m2: q's dtype), its dequantisation
//                 scales (float32), and optionally the amax. Scales per tensor (current scaling,
//                 or delayed: `recipe` = 1, the amax history is the op's state, saved and loaded
//                 through state_save/state_load), per 1x128 tile or per 128x128 block;
//                 `transpose` = 1 writes x^T (the backward's K-major operands). With the scale
//                 as a second input (per tensor, current scaling) it quantises with that scale:
//                 x^T of an x already quantised needs no amax pass of its own.
//
// Operands live in the instance's device memory. Work is queued on rlh_op_call.stream. This
// file is the descriptor and the listing; the ops are ops_cuda.cpp, or ops_nocuda.cpp in a build
// without the CUDA toolkit, where the plugin still loads, lists its ops and says why it cannot
// run (probe and create).
#include "ops.hpp"
#include "rlhost/sdk/plugin.hpp"

namespace vendor_fp8 {
namespace {

// What the plugin offers, for list_ops. quantize_fp8 is this vendor's op (not in docs/ops.md):
// the conformance runner shows it as "no case"; the vendor's GPU test checks it.
constexpr char kOps[] =
    "[{\"name\":\"gemm\",\"dtypes\":[\"e4m3\"],\"backward\":\"gemm\"},"
    "{\"name\":\"amax\",\"dtypes\":[\"f32\",\"bf16\"],\"backward\":\"\"},"
    "{\"name\":\"quantize_fp8\",\"dtypes\":[\"f32\",\"bf16\"],\"backward\":\"\"}]";

rlh_status* k_list_ops(rlh_kernels*, rlh_write_fn write, void* user) {
  return rlh::sdk::guard(make_status(), [&] { write(user, kOps, sizeof(kOps) - 1); });
}

rlh_status* k_provider_info(rlh_kernels*, rlh_write_fn write, void* user) {
  return rlh::sdk::guard(make_status(), [&] {
    static const char kInfo[] = "{\"reference\":false,\"memory\":\"device\"}";
    write(user, kInfo, sizeof(kInfo) - 1);
  });
}

const rlh_kernels_api kApi = [] {
  rlh_kernels_api a{};
  a.struct_size = RLH_STRUCT_SIZE(rlh_kernels_api, workspace_size);
  a.create = k_create;
  a.destroy = k_destroy;
  a.list_ops = k_list_ops;
  a.get_op = k_get_op;
  a.op_info = k_op_info;
  a.run = k_run;
  a.release_op = k_release_op;
  a.provider_info = k_provider_info;
  a.state_save = k_state_save;
  a.state_load = k_state_load;
  a.memory_alloc = k_memory_alloc;
  a.memory_free = k_memory_free;
  a.memory_copy = k_memory_copy;
  a.synchronize = k_synchronize;
  a.workspace_size = k_workspace_size;
  return a;
}();

// The plugin honours NeMo-RL's policy.megatron_cfg.fp8_cfg (FP8 training) and
// policy.generation.vllm_cfg.precision (fp8: FP8 rollouts): claiming them tells the host that an
// FP8 linear provider is loaded (host/data/nemo_rl_support.tsv, rule `provider`); the backend and
// the generator reading them decide what they do with them.
const char* const kKeys[] = {"policy.megatron_cfg.fp8_cfg.*", "policy.generation.vllm_cfg.precision", nullptr};

const rlh_component_desc kComponent = rlh::sdk::component_desc(
    RLH_KIND_KERNELS, "vendor_fp8", "0.1.0", RLH_KERNELS_API_VERSION_MAJOR, RLH_KERNELS_API_VERSION_MINOR, &kApi,
    "FP8 GEMMs on cuBLASLt (tensorwise, delayed and blockwise scaling), quantize and amax; compute capability 8.9+",
    kKeys);
const rlh_component_desc* const kComponents[] = {&kComponent};

rlh_plugin_desc make_desc() {
  rlh_plugin_desc d = rlh::sdk::plugin_desc("vendor_fp8", "0.1.0", "example vendor", kComponents,
                                            "An out-of-tree FP8 kernel provider (examples/vendor_fp8)");
  d.probe = probe;
  return d;
}

}  // namespace
}  // namespace vendor_fp8

RLH_DEFINE_PLUGIN(vendor_fp8::make_desc());
