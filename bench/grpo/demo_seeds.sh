#!/usr/bin/env bash
# The CPU demo (scripts/demo.sh: SFT on addition and multiplication, then GRPO on subtraction) on
# three seeds: each seed draws its own random tiny model, data order and samples. For each it
# prints the greedy validation accuracy on subtraction before GRPO and at the end, the best, the
# wall time and the checkpoints, and fails unless accuracy starts under 20%, ends over 80% and a
# checkpoint was saved.
#
#   bench/grpo/demo_seeds.sh [BUILD_DIR] [override ...]     (BUILD_DIR default: build)
#
# Also the ctest `grpo_demo_seeds` (label heavy).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$(cd "${1:-$ROOT/build}" && pwd)
shift || true
SEEDS=${SEEDS:-"1 2 3"}
OUT=$BUILD/demo_seeds
rm -rf "$OUT"
mkdir -p "$OUT"
cd "$ROOT"
status=0
summary=()
for seed in $SEEDS; do
  dir=$OUT/seed$seed
  "$BUILD/bin/rlh_tiny_model" "$dir/tiny_model" --alphabet "0123456789+-*=" --seed "$seed" >/dev/null
  start=$(date +%s.%N)
  plugins=(--plugin dtensor --plugin environments --plugin tokenizer_hf --plugin model_llama --plugin kernels_cpu)
  RLHOST_PLUGIN_PATH=$BUILD/plugins "$BUILD/bin/rlhost" "${plugins[@]}" --plugin sft \
    --config examples/configs/sft_demo_cpu.yaml policy.model_name="$dir/tiny_model" sft.seed="$seed" \
    checkpointing.checkpoint_dir="$dir/sft" logger.log_dir="$dir/sft/logs" ++logger.console_enabled=false \
    > "$dir/sft.log" 2>&1 || { echo "seed $seed: SFT failed:"; tail -5 "$dir/sft.log"; status=1; continue; }
  ckpt=$(ls -d "$dir"/sft/step_* | sort -t_ -k2 -n | tail -1)
  RLHOST_PLUGIN_PATH=$BUILD/plugins "$BUILD/bin/rlhost" "${plugins[@]}" --plugin generator --plugin grpo \
    --config examples/configs/grpo_demo_cpu.yaml \
    policy.model_name="$ckpt/policy" grpo.seed="$seed" checkpointing.checkpoint_dir="$dir/results" \
    logger.log_dir="$dir/logs" ++logger.console_enabled=false "$@" > "$dir/run.log" 2>&1 || {
      echo "seed $seed: rlhost failed:"; tail -5 "$dir/run.log"; status=1; continue; }
  end=$(date +%s.%N)
  line=$(python3 - "$dir" "$seed" "$start" "$end" <<'PY'
import json, os, sys
d, seed, t0, t1 = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
rows = [json.loads(l) for l in open(os.path.join(d, "logs", "metrics.jsonl")) if l.strip()]
val = [(r["step"], r["validation/accuracy"]) for r in rows if r.get("validation/accuracy") is not None]
steps = max(r["step"] for r in rows)
ckpts = sorted(int(n[5:]) for n in os.listdir(os.path.join(d, "results")) if n.startswith("step_"))
first, last = val[0], val[-1]
best = max(val, key=lambda v: (v[1], v[0]))
ok = first[1] < 0.2 and last[1] > 0.8 and ckpts
tput = [r.get("timing/train/total_step_time") for r in rows if r.get("timing/train/total_step_time")]
print(f"seed {seed}: validation accuracy {first[1]*100:5.1f}% at step {first[0]} -> {last[1]*100:5.1f}% at step {last[0]} "
      f"(best {best[1]*100:5.1f}% at step {best[0]}), SFT + {steps} GRPO steps in {t1-t0:5.1f} s "
      f"({sum(tput)/len(tput):.3f} s/step), checkpoints {['step_%d' % c for c in ckpts]} "
      f"{'PASS' if ok else 'FAIL'}")
PY
)
  echo "$line"
  summary+=("$line")
  case "$line" in *FAIL*) status=1 ;; esac
done
echo
echo "== GRPO CPU demo on seeds $SEEDS =="
printf '%s\n' "${summary[@]}"
exit $status
