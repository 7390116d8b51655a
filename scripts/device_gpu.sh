#!/usr/bin/env bash
# What every run on the H200 starts with: the `gpu` tests (ctest -L gpu's binaries), then
# optionally GRPO with the policy on the GPU and the GPU benchmarks. Runs from binaries built
# here and carried (BIN, default .devbin, packed by scripts/device_pack.sh: test_*, bench_*,
# rlhost, plugins/, lib/), since the device image has no gtest, Boost or yaml-cpp; the fixtures
# are the source tree's tests/fixtures.
# Logs go to $OUT when set.
#   scripts/device_gpu.sh [tests|grpo|bench|all]     (all = tests, grpo, bench)
set -uo pipefail
cd "$(dirname "$0")/.."
bin=$(cd "${BIN:-.devbin}" && pwd)
out=${OUT:-/tmp}
what=${1:-tests}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
# The fixtures travel with the tree: tests/fixtures and the engine's own (tests/engine/fixtures),
# linked into one folder.
mkdir -p "$bin/fixtures"
for f in tests/fixtures/*/ tests/engine/fixtures/*/; do ln -sfn "$PWD/$f" "$bin/fixtures/$(basename "$f")"; done
export RLHOST_FIXTURES=$bin/fixtures RLH_KCUDA_PLUGIN=$bin/libkernels_cuda.so
export LD_LIBRARY_PATH=$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RLH_TEST_PLUGIN_DIR=$bin/plugins RLHOST_PLUGIN_PATH=$bin/plugins
# comm_nccl opens libnccl.so.2 at run time: the image has it in PyTorch's nvidia-nccl wheel (too
# large to carry). NVLink multicast stays off (the device's rule).
nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
[ -n "$nccl_dir" ] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$nccl_dir
export NCCL_NVLS_ENABLE=0
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  for t in test_kernels_cuda_plugin test_cuda_conformance test_cuda_kernels test_cuda_decode test_cuda_engine test_backend_cuda \
           test_comm_nccl; do
    [ -x "$bin/$t" ] || continue
    echo "== $t =="
    "$bin/$t" --gtest_brief=1 2>&1 | tee "$out/$t.log" |
      grep -E "^\[  (PASSED|FAILED|SKIPPED) |bf16 on GPU|on the GPU|steady state|AdamW|recompute|deadline|FAILED|Failure|rror" | head -60
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
fi
if [ "$what" = grpo ] || [ "$what" = all ]; then
  # The demo's two stages (scripts/demo.sh) with stage 2's policy on the GPU: megatron,
  # policy.device=cuda, bf16; the generator stays on the CPU and refits from the device's weights.
  echo "== GRPO with the policy on the GPU =="
  d=$(mktemp -d)
  "$bin/rlh_tiny_model" "$d/tiny_model" --alphabet "0123456789+-*=" --seed 1 >/dev/null
  common=(--plugin environments --plugin tokenizer_hf --plugin model_llama --plugin kernels_cpu)
  "$bin/rlhost" "${common[@]}" --plugin dtensor --plugin sft --config examples/configs/sft_demo_cpu.yaml \
    policy.model_name="$d/tiny_model" checkpointing.checkpoint_dir="$d/sft" logger.log_dir="$d/sft/logs" \
    > "$out/grpo_gpu_sft.log" 2>&1 || { echo "SFT stage failed"; tail -5 "$out/grpo_gpu_sft.log"; rc=1; }
  ckpt=$(ls -d "$d"/sft/step_* 2>/dev/null | sort -t_ -k2 -n | tail -1)
  "$bin/rlhost" "${common[@]}" --plugin megatron --plugin generator --plugin grpo \
    --config examples/configs/grpo_demo_cpu.yaml policy.model_name="$ckpt/policy" \
    checkpointing.checkpoint_dir="$d/grpo" logger.log_dir="$d/grpo/logs" policy.dtensor_cfg.enabled=false \
    ++policy.megatron_cfg.enabled=true ++policy.megatron_cfg.optimizer.lr=1e-3 \
    ++policy.megatron_cfg.optimizer.weight_decay=0 policy.precision=bfloat16 ++policy.device=cuda 2>&1 |
    tee "$out/grpo_gpu.log" | grep -v "^\[rlhost\] step [0-9]*/" | tail -8
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  grep "^\[rlhost\] step" "$out/grpo_gpu.log" | tail -2
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  RESULT_JSON=$out/engine.json bench/engine_cuda/run.sh "$bin/bench_cuda_engine" 2>&1 | tee "$out/bench.log" | tail -40
fi
exit $rc
