#!/usr/bin/env bash
# Packs what a run on the H200 needs into .devbin/devbin.txz (carried by the device tool, 64 MiB
# cap with the source tree; xz -9, whose large dictionary takes the CUDA fatbins to about 9 MiB where
# -6 gave 16.6 MiB and no longer fit beside the tree): the `gpu` test binaries, the GPU benchmark, rlhost with librlhost
# and the plugins, the shared libraries the device image lacks (yaml-cpp, Boost.ProgramOptions,
# PCRE2, utf8proc, libgomp). The fixtures travel with the source tree (tests/fixtures).
# Binaries come from build-cuda (-DRLH_BUILD_BENCH=ON; CUDA runtime static, cuBLASLt loaded at
# run time), stripped.
#   scripts/device_pack.sh            build the targets, then pack
#   SLIM=1 scripts/device_pack.sh     the same without the mpi/nccl2 stages' parts (smaller)
#   DROP="test_cuda_decode bench_*" scripts/device_pack.sh   without these (globs in the pack's
#                                     root): for one stage, when the tree has grown past the cap
# .devbin is ignored by git: pass carry: [".devbin"] to the device tool.
# On the device: cd .devbin && tar xJf devbin.txz && cd .. && scripts/device_gpu.sh all
set -euo pipefail
cd "$(dirname "$0")/.."
B=${BUILD:-build-cuda}
tests=(test_kernels_cuda_plugin test_cuda_conformance test_cuda_kernels test_cuda_decode test_cuda_engine test_cuda_engine_fp8
       test_cuda_engine_offload test_cuda_engine_fsdp test_cuda_engine_tp test_backend_cuda
       test_backend_cuda_loss
       test_backend_cuda_dp test_kernels_cudnn_plugin test_cudnn_graph test_cudnn_attention test_generator_cuda test_comm_nccl test_vendor_fp8)
plugins=(megatron dtensor model_llama kernels_cpu kernels_cuda kernels_cudnn tokenizer_hf generator grpo sft environments dataset_jsonl
         comm_nccl comm_mpi)
ninja -C "$B" -j"${JOBS:-2}" "${tests[@]}" comm_probe bench_cuda_engine bench_generator_cuda bench_fp8_gemm bench_parallel bench_l2_prefetch rlhost rlh_tiny_model \
  "${plugins[@]}" >/dev/null
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/plugins" "$stage/lib"
for t in "${tests[@]}"; do cp "$(find "$B/tests" -name "$t" -type f | head -1)" "$stage/"; done
cp "$B/bench/engine_cuda/bench_cuda_engine" "$B/bench/generator_cuda/bench_generator_cuda" "$B/bench/fp8/bench_fp8_gemm" \
  "$B/bench/parallel/bench_parallel" "$B/bench/kernels_cuda/bench_l2_prefetch" "$B/bin/rlhost" \
  "$B/bin/rlh_tiny_model" "$stage/"
# Every plugin of the build (kernel providers too: the engines find them on the plugin path).
cp "$B"/plugins/lib*.so "$stage/plugins/"
# The same folder without kernels_cudnn (links): device_gpu.sh's CUDNN=0, the A/B of the bench.
mkdir -p "$stage/plugins_nocudnn"
for f in "$stage"/plugins/lib*.so; do
  [ "$(basename "$f")" = libkernels_cudnn.so ] || ln -s "../plugins/$(basename "$f")" "$stage/plugins_nocudnn/"
done
# The comm_probe test algorithm, for device_gpu.sh nccl2 (comm_nccl over two GPUs).
mkdir -p "$stage/extra_plugins"
cp "$B"/test_plugins/libcomm_probe.so "$stage/extra_plugins/"
ln -s plugins/libkernels_cuda.so "$stage/libkernels_cuda.so"  # where the kernels_cuda tests look for it
# examples/vendor_fp8, built out of tree against this build's install by its ctest (which installs
# the build: every target must be built first), for device_gpu.sh fp8. Not on the plugin path:
# the fp8 stage loads it by path.
ninja -C "$B" -j"${JOBS:-2}" >/dev/null
ctest --test-dir "$B" -R '^sdk_vendor_fp8_out_of_tree$' --output-on-failure >/dev/null
mkdir -p "$stage/vendor"
cp "$B/tests/vendor_fp8/out_of_tree/example/libvendor_fp8.so" "$stage/vendor/"
cp -L "$B"/lib/librlhost.so.0.1 "$stage/lib/"
# OpenMPI, relocatable (the image has none): device_gpu.sh mpi runs several ranks on the GPU.
scripts/pack_openmpi.sh "$stage/openmpi" >/dev/null
for l in libyaml-cpp.so.0.7 libboost_program_options.so.1.74.0 libpcre2-8.so.0 libutf8proc.so.2 libgomp.so.1; do
  cp -L "/lib/x86_64-linux-gnu/$l" "$stage/lib/"
done
strip --strip-unneeded "$stage"/test_* "$stage"/bench_* "$stage"/rlhost "$stage"/rlh_tiny_model \
  "$stage"/plugins/*.so "$stage"/vendor/*.so "$stage"/extra_plugins/*.so "$stage"/lib/librlhost.so.0.1
# SLIM=1: without what only the mpi and nccl2 stages use (OpenMPI, the NCCL and multi-rank
# tests), when the pack beside the source tree would pass the carry cap.
if [ "${SLIM:-0}" = 1 ]; then
  rm -rf "$stage"/openmpi "$stage"/extra_plugins "$stage"/test_comm_nccl "$stage"/test_backend_cuda_dp
fi
for d in ${DROP:-}; do (cd "$stage" && rm -rf -- $d); done
mkdir -p .devbin
rm -f .devbin/devbin.tgz
tar cf - -C "$stage" . | xz -T2 -9 > .devbin/devbin.txz
ls -la .devbin/devbin.txz
