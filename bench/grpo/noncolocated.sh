#!/usr/bin/env bash
# The CPU demo (scripts/demo.sh: SFT, then GRPO on subtraction) with generation colocated, on a
# generator rank of its own, and asynchronous (1-step-off): validation accuracy every 25 steps,
# mean train reward per 25 steps, median step and refit times. Two CPU ranks under mpirun stand for
# a trainer GPU and a generator GPU (docs/parallelism.md#non-colocated-generation-and-asynchronous-grpo).
#
#   bench/grpo/noncolocated.sh [BUILD_DIR]      (STEPS=100 by default)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$(cd "${1:-$ROOT/build}" && pwd)
STEPS=${STEPS:-100}
OUT=$BUILD/bench_noncolocated
rm -rf "$OUT"
mkdir -p "$OUT"
cd "$ROOT"
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1 \
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
export RLHOST_PLUGIN_PATH=$BUILD/plugins
P=(--plugin dtensor --plugin environments --plugin tokenizer_hf --plugin model_llama --plugin kernels_cpu)
"$BUILD/bin/rlh_tiny_model" "$OUT/tiny" --alphabet "0123456789+-*=" --seed 1 >/dev/null
"$BUILD/bin/rlhost" "${P[@]}" --plugin sft --config examples/configs/sft_demo_cpu.yaml policy.model_name="$OUT/tiny" \
  sft.seed=1 checkpointing.checkpoint_dir="$OUT/sft" logger.log_dir="$OUT/sft/logs" > "$OUT/sft.log" 2>&1
grpo() {  # $1 = name, $2 = ranks, rest = overrides
  local name=$1 np=$2; shift 2
  local cmd=("$BUILD/bin/rlhost" "${P[@]}" --plugin generator --plugin grpo --config examples/configs/grpo_demo_cpu.yaml
    policy.model_name="$OUT/sft/step_120/policy" grpo.max_num_steps="$STEPS" checkpointing.enabled=false
    logger.log_dir="$OUT/$name/logs" ++rlhost.comm_timeout_s=60 "$@")
  if [ "$np" -gt 1 ]; then cmd=(mpirun --allow-run-as-root --oversubscribe -np "$np" "${cmd[@]}"); fi
  "${cmd[@]}" > "$OUT/$name.log" 2>&1
}
NC=(++policy.generation.colocated.enabled=false ++policy.generation.colocated.resources.gpus_per_node=1)
grpo colocated 1
grpo noncolocated 2 "${NC[@]}"
grpo async 2 "${NC[@]}" ++grpo.async_grpo.enabled=true loss_fn.use_importance_sampling_correction=true
python3 - "$OUT" "$STEPS" <<'PY'
import json, os, statistics, sys
out, steps = sys.argv[1], int(sys.argv[2])
print(f"CPU demo GRPO (32 prompts x 16 samples, tiny Llama after 120 SFT steps), {steps} steps, seed 1")
for name in ("colocated", "noncolocated", "async"):
    rows = {}
    for l in open(os.path.join(out, name, "logs", "metrics.jsonl")):
        r = json.loads(l)
        rows.setdefault(r["step"], {}).update(r)
    val = [(s, rows[s]["validation/accuracy"]) for s in sorted(rows) if "validation/accuracy" in rows[s]]
    rew = [statistics.mean(rows[s]["train/reward"] for s in range(a, a + 25) if s in rows) for a in range(1, steps + 1, 25)]
    step_t = statistics.median(rows[s]["timing/train/total_step_time"] for s in range(2, steps + 1))
    refit = statistics.median(rows[s].get("train/refit_broadcast_seconds", 0) for s in range(2, steps + 1))
    lag = max(rows[s].get("train/generation_weight_lag", 0) for s in range(1, steps + 1))
    print(f"{name:13s} validation accuracy " + " ".join(f"{s}:{v:.3f}" for s, v in val))
    print(f"{'':13s} train reward per 25 steps " + " ".join(f"{r:.3f}" for r in rew) +
          f"; median step {step_t:.3f} s, refit broadcast {refit:.4f} s, max weight lag {lag:.0f}")
PY
