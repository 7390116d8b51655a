#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite, twice: a normal optimised build (gcc), then an
# ASan+UBSan build with the libFuzzer targets (clang-14), where each fuzzer runs a short session
# over its committed corpus. Incremental and ccache-friendly: re-running rebuilds only changes.
#   scripts/test.sh            everything
#   scripts/test.sh --fast     only the normal build
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
jobs=$(nproc)

echo "== build (gcc, RelWithDebInfo) =="
cmake -G Ninja -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRLH_BUILD_TESTS=ON >/dev/null
cmake --build build -j"$jobs"
echo "== tests =="
ctest --test-dir build --output-on-failure -j"$jobs" --timeout 900

if [ "${1:-}" = "--fast" ]; then exit 0; fi

echo "== build (clang-14, ASan+UBSan, libFuzzer) =="
cmake -G Ninja -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
  -DRLH_SANITIZE=ON -DRLH_FUZZ=ON -DRLH_CUDA=OFF -DRLH_BUILD_TESTS=ON >/dev/null
cmake --build build-asan -j"$jobs"
echo "== tests under ASan+UBSan, and fuzzing =="
# Tests labelled `heavy` are full-width memory/throughput checks: too slow under ASan, run above.
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j"$jobs" --timeout 900 -LE heavy
