#!/usr/bin/env bash
# Builds bench_moe and runs it beside PyTorch (Debian python3-torch, installed if missing, run
# with /usr/bin/python3) on the same MoE shape, batch and thread count: the issue's shape,
# vocab 4096, d 256, 4 layers, 8/4 heads of 32, 16 experts top-2 of ffn 256, batch 16 x 128.
# PyTorch runs Hugging Face's eager MoE block (a loop over the experts); its OpenBLAS is pointed
# at its AVX-512 (SkylakeX) or AVX2 (Haswell) kernels, as rlh_engine's loader does for itself.
# The two run in alternation ROUNDS times and each side's best round is reported (step times are
# medians within a round): on a machine shared with other jobs, the best round is the one least
# disturbed, and alternating gives both sides the same chances.
#   bench/moe/run.sh            # THREADS=2 STEPS=5 ROUNDS=3 BUILD_DIR=build-bench by default
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${BUILD_DIR:-$root/build-bench}
threads=${THREADS:-2}
steps=${STEPS:-5}
rounds=${ROUNDS:-3}

source "$root/bench/common/cpu_peer.sh"  # build_bench, python3-torch, $coretype
build_bench bench_moe

value() { grep '^RESULT' | tail -1 | tr ' ' '\n' | sed -n "s/^$1=//p"; }
best() { awk -v a="$1" -v b="$2" 'BEGIN { print (a == "" || b > a) ? b : a }'; }

tr_ours=""; fw_ours=""; tr_theirs=""; fw_theirs=""
for r in $(seq 1 "$rounds"); do
  echo "== round $r: rlhost =="
  ours=$(OMP_NUM_THREADS=$threads "$build/bench/moe/bench_moe" --steps "$steps" --threads "$threads")
  echo "$ours" | grep -v '^RESULT' | { [ "$r" -eq 1 ] && cat || grep -E '^(MoE|train)'; }
  echo "== round $r: PyTorch (HF eager MoE block) =="
  theirs=$(OPENBLAS_CORETYPE=$coretype OMP_NUM_THREADS=$threads /usr/bin/python3 \
           "$root/bench/moe/bench_torch.py" --steps "$steps" --threads "$threads" 2>&1)
  echo "$theirs" | grep -v '^RESULT'
  tr_ours=$(best "$tr_ours" "$(value train_tok_s <<<"$ours")")
  fw_ours=$(best "$fw_ours" "$(value fwd_tok_s <<<"$ours")")
  tr_theirs=$(best "$tr_theirs" "$(value train_tok_s <<<"$theirs")")
  fw_theirs=$(best "$fw_theirs" "$(value fwd_tok_s <<<"$theirs")")
done

echo
echo "== summary ($threads threads, best of $rounds rounds) =="
awk -v a="$tr_ours" -v b="$tr_theirs" -v c="$fw_ours" -v d="$fw_theirs" 'BEGIN {
  printf "train:   rlhost %8.0f tok/s   PyTorch %8.0f tok/s   %.2fx\n", a, b, a / b
  printf "forward: rlhost %8.0f tok/s   PyTorch %8.0f tok/s   %.2fx\n", c, d, c / d }'
echo "goal: train >= 2x PyTorch"
