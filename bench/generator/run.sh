#!/usr/bin/env bash
# Builds bench_generator and runs it beside PyTorch (Debian python3-torch, installed if missing)
# doing KV-cached greedy decoding of the same shapes, batch sizes and thread count; prints
# tokens/s and the ratios. PyTorch's OpenBLAS is pointed at its AVX-512 (SkylakeX) or AVX2
# (Haswell) kernels with OPENBLAS_CORETYPE, as kernels_cpu's loader does for itself.
#   bench/generator/run.sh     # THREADS=2 NEW=64 PROMPT=16 REPEATS=3 BUILD_DIR=build-bench
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${BUILD_DIR:-$root/build-bench}
threads=${THREADS:-2}
new=${NEW:-64}
prompt=${PROMPT:-16}
repeats=${REPEATS:-3}
# PyTorch's OpenMP runs best passive on this 2-core machine (tiny, batch 1: ~470 tok/s against
# ~290 with libgomp's default spin); the generator's own pool does not read the variable
# (docs/generator.md, "Work is split").
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}

source "$root/bench/common/cpu_peer.sh"  # build_bench, python3-torch, $coretype
build_bench bench_generator

declare -A R C F
for shape in tiny small; do
  for batch in 1 16; do
    out=$(OMP_NUM_THREADS=$threads "$build/bench/generator/bench_generator" --shape $shape --batch $batch \
          --new "$new" --prompt "$prompt" --repeats "$repeats" --threads "$threads")
    echo "$out" | grep -v '^RESULT'
    R[rlhost.$shape.$batch]=$(echo "$out" | sed -nE 's/^RESULT .* tok_s=([0-9.]+).*/\1/p')
    C[rlhost.$shape.$batch]=$(echo "$out" | sed -nE 's/^RESULT .*cpu_tok_s=([0-9.]+).*/\1/p')
    F[$shape.$batch]=$(echo "$out" | sed -nE 's/^RESULT .*roofline_pct=([0-9.]+).*/\1/p')
    out=$(OPENBLAS_CORETYPE=$coretype OMP_NUM_THREADS=$threads /usr/bin/python3 "$root/bench/generator/bench_torch_decode.py" \
          --shape $shape --batch $batch --new "$new" --prompt "$prompt" --repeats "$repeats" --threads "$threads" 2>&1)
    echo "$out" | grep -v '^RESULT'
    R[torch.$shape.$batch]=$(echo "$out" | sed -nE 's/^RESULT .* tok_s=([0-9.]+).*/\1/p')
    C[torch.$shape.$batch]=$(echo "$out" | sed -nE 's/^RESULT .*cpu_tok_s=([0-9.]+).*/\1/p')
  done
done

echo
echo "== decode tokens/s, greedy, $prompt-token prompts, $new new tokens, $threads threads, OMP_WAIT_POLICY=$OMP_WAIT_POLICY (load: $(cut -d' ' -f1-3 /proc/loadavg)) =="
# The issue's own PyTorch figures (tiny / small at batch 1 / 16), measured when it was written.
declare -A P=([tiny.1]=142 [tiny.16]=539 [small.1]=6.7 [small.16]=69)
printf "%-6s %6s %14s %14s %8s   %s   %s   %s\n" shape batch rlhost torch ratio "per CPU-second x threads: rlhost torch ratio" "weight reads / read probe" "vs the issue's torch figure"
for shape in tiny small; do
  for batch in 1 16; do
    awk -v s=$shape -v b=$batch -v r="${R[rlhost.$shape.$batch]}" -v t="${R[torch.$shape.$batch]}" \
        -v cr="${C[rlhost.$shape.$batch]}" -v ct="${C[torch.$shape.$batch]}" -v f="${F[$shape.$batch]}" -v p="${P[$shape.$batch]}" \
      'BEGIN { printf "%-6s %6d %10.1f t/s %10.1f t/s %7.2fx   %10.1f %10.1f %7.2fx   %26.0f%%   %7.1f t/s: %5.1fx\n", s, b, r, t, r / t, cr, ct, cr / ct, f, p, r / p }'
  done
done
echo "(wall-clock tokens/s; then tokens per CPU-second times the thread count, which a busy machine does not distort;"
echo " then the weight bytes a decoding step reads per second as a share of a plain vector read of as many bytes: near"
echo " or past 100% the step is bound by memory, and no fp32 decoder that reads every weight each step is faster)"
echo "goal: >= 5x PyTorch (the issue's peer figures: tiny 142 / 539, small 6.7 / 69 tok/s at batch 1 / 16; the"
echo "PyTorch loop measured above is a lean one and runs 2-4x faster than those)"
