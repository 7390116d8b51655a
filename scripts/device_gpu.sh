#!/usr/bin/env bash
# What every run on the H200 starts with: the `gpu` tests (ctest -L gpu's binaries), then
# optionally the GPU benchmarks. Runs from binaries built here and carried (BIN, default
# .devbin: test_*, bench_*, libkernels_cuda.so, fixtures/), since the device has no gtest or
# Boost. Logs go to $OUT when set.
#   scripts/device_gpu.sh [tests|bench|all]
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${BIN:-.devbin}
out=${OUT:-/tmp}
what=${1:-tests}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
export RLHOST_FIXTURES=$bin/fixtures RLH_KCUDA_PLUGIN=$bin/libkernels_cuda.so
rc=0
if [ "$what" != bench ]; then
  for t in test_kernels_cuda_plugin test_cuda_conformance test_cuda_kernels test_cuda_engine; do
    [ -x "$bin/$t" ] || continue
    echo "== $t =="
    "$bin/$t" --gtest_brief=1 2>&1 | tee "$out/$t.log" | grep -E "^\[  (PASSED|FAILED|SKIPPED) |bf16 on GPU|steady state|AdamW steps|FAILED|Failure|rror" | head -40
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
fi
if [ "$what" != tests ]; then
  RESULT_JSON=$out/engine.json bench/engine_cuda/run.sh "$bin/bench_cuda_engine" 2>&1 | tee "$out/bench.log" | tail -40
fi
exit $rc
