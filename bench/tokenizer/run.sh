#!/usr/bin/env bash
# Builds bench_tokenize in build-bench/ (Release) and prints encode MB/s and tokens/s on one core
# for the llama3 fixture tokenizer (or the tokenizer.json / model dir given as $1).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${RLH_BENCH_BUILD:-$root/build-bench}
tok=${1:-${RLHOST_FIXTURES:-$root/tests/fixtures}/tokenizer-llama3/tokenizer.json}
cmake -G Ninja -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DRLH_BUILD_BENCH=ON -DRLH_BUILD_TESTS=OFF \
  ${RLH_EXCLUDE:+-DRLH_EXCLUDE="$RLH_EXCLUDE"} >/dev/null
ninja -C "$build" bench_tokenize >/dev/null
taskset -c 0 "$build/bench/tokenizer/bench_tokenize" "$tok" "${2:-24}" 2>/dev/null || "$build/bench/tokenizer/bench_tokenize" "$tok" "${2:-24}"
