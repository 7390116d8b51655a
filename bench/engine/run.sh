#!/usr/bin/env bash
# Builds bench_engine and runs it beside PyTorch (Debian python3-torch, installed if missing) on
# the same shapes, batch and thread count; prints tokens/s, ratios and the share of the measured
# sgemm ceiling. PyTorch's OpenBLAS is pointed at its AVX-512 (SkylakeX) or AVX2 (Haswell)
# kernels with OPENBLAS_CORETYPE, as rlh_engine's loader does for itself.
#   bench/engine/run.sh            # THREADS=2 STEPS=5 BUILD_DIR=build-bench by default
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${BUILD_DIR:-$root/build-bench}
threads=${THREADS:-2}
steps=${STEPS:-5}

source "$root/bench/common/cpu_peer.sh"  # build_bench, python3-torch, $coretype
build_bench bench_engine

declare -A R
parse() {  # RESULT line -> R[impl.shape.key]=value
  local line impl shape kv
  line=$(grep '^RESULT' | tail -1)
  impl=$(sed -E 's/.*impl=([^ ]+).*/\1/' <<<"$line")
  shape=$(sed -E 's/.*shape=([^ ]+).*/\1/' <<<"$line")
  for kv in $line; do
    case $kv in *=*) R[$impl.$shape.${kv%%=*}]=${kv#*=} ;; esac
  done
}

for shape in tiny small; do
  echo "== $shape =="
  out=$(OMP_NUM_THREADS=$threads "$build/bench/engine/bench_engine" --shape $shape --steps "$steps" --threads "$threads")
  echo "$out" | grep -v '^RESULT'
  parse <<<"$out"
  out=$(OPENBLAS_CORETYPE=$coretype OMP_NUM_THREADS=$threads /usr/bin/python3 "$root/bench/engine/bench_torch.py" \
        --shape $shape --steps "$steps" --threads "$threads" 2>&1)
  echo "$out" | grep -E '^(torch|BLAS library|shape)'
  echo "$out" | grep -E 'BLAS_INFO' | tr ',' '\n' | grep -E 'BLAS_INFO|CPU capability' || true
  parse <<<"$out"
done

echo
echo "== summary ($threads threads) =="
printf "%-6s %14s %14s %8s %14s %14s %8s %16s\n" shape "train rlhost" "train torch" ratio \
  "fwd rlhost" "fwd torch" ratio "train % sgemm"
for shape in tiny small; do
  awk -v s=$shape -v tr="${R[rlhost.$shape.train_tok_s]}" -v tt="${R[torch.$shape.train_tok_s]}" \
      -v fr="${R[rlhost.$shape.fwd_tok_s]}" -v ft="${R[torch.$shape.fwd_tok_s]}" \
      -v gf="${R[rlhost.$shape.train_gflops]}" -v ce="${R[rlhost.$shape.sgemm_gflops]}" \
      'BEGIN { printf "%-6s %10.0f t/s %10.0f t/s %7.2fx %10.0f t/s %10.0f t/s %7.2fx %9.1f / %.0f = %.0f%%\n",
               s, tr, tt, tr / tt, fr, ft, fr / ft, gf, ce, 100 * gf / ce }'
done
echo "torch sgemm: tiny ${R[torch.tiny.sgemm_gflops]} GFLOP/s, small ${R[torch.small.sgemm_gflops]} GFLOP/s"
echo "goals: train >= 2x PyTorch; small-shape train >= 40% of the sgemm ceiling"
