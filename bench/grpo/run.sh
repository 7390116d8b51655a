#!/usr/bin/env bash
# GRPO step breakdown on CPU for the demo model (examples/configs/grpo_demo_cpu.yaml): median
# seconds per step of refit, generation, reward, logprobs (policy; no reference at beta 0) and
# training, with tokens/s for each, and the start-up time to the first train step.
#
#   bench/grpo/run.sh [BUILD_DIR] [override ...]     (BUILD_DIR default: build)
#
# Start-up is measured two ways: timing/train/startup (from the algorithm's creation — plugins
# loaded, config checked — to the first optimizer step starting: model and tokenizer loading,
# first refit, first rollout and logprobs), and the whole process of a one-step run.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$(cd "${1:-$ROOT/build}" && pwd)
shift || true
STEPS=${STEPS:-20}
OUT=$BUILD/bench_grpo
rm -rf "$OUT"
mkdir -p "$OUT"
cd "$ROOT"
"$BUILD/bin/rlh_tiny_model" "$OUT/tiny_model" --alphabet "0123456789-=" --seed 1 >/dev/null
run() {  # $1 = log dir, rest = overrides
  local logs=$1; shift
  RLHOST_PLUGIN_PATH=$BUILD/plugins "$BUILD/bin/rlhost" --plugin dtensor --plugin generator --plugin grpo \
    --plugin environments --plugin tokenizer_hf --plugin model_llama --plugin kernels_cpu \
    --config examples/configs/grpo_demo_cpu.yaml policy.model_name="$OUT/tiny_model" \
    checkpointing.enabled=false grpo.val_at_start=false grpo.val_at_end=false grpo.val_period=0 \
    logger.log_dir="$logs" ++logger.console_enabled=false "$@" > "$logs.log" 2>&1
}
t0=$(date +%s.%N)
run "$OUT/startup" grpo.max_num_steps=1 "$@"
t1=$(date +%s.%N)
run "$OUT/steps" grpo.max_num_steps="$STEPS" "$@"
python3 - "$OUT" "$t0" "$t1" "$STEPS" <<'PY'
import json, os, statistics, sys
out, t0, t1, steps = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
def rows(d):
    return [json.loads(l) for l in open(os.path.join(out, d, "metrics.jsonl")) if l.strip()]
start = rows("startup")[0]
r = [x for x in rows("steps") if x["step"] >= 2]  # step 1 carries the first-touch costs
med = lambda k: statistics.median(x.get(k, 0.0) for x in r)
def samples(x):  # every sample is one prompt plus its response
    return x["train/total_num_tokens"] / (x["train/mean_prompt_length"] + x["train/mean_gen_tokens_per_sample"])
gen_tok = statistics.median(x["train/mean_gen_tokens_per_sample"] * samples(x) for x in r)
tot_tok = med("train/total_num_tokens")
print(f"== GRPO step breakdown, demo model, CPU ({os.cpu_count()} cores), median of steps 2..{steps} ==")
print(f"samples/step {statistics.median(samples(x) for x in r):.0f}, "
      f"tokens/step {tot_tok:.0f} (generated {gen_tok:.0f}); generation tok/s counts new tokens, "
      f"logprobs/train all tokens")
parts = [("refit", "timing/train/prepare_for_generation/total", None),
         ("generation", "timing/train/generation", gen_tok),  # new tokens/s
         ("reward", "timing/train/reward_calculation", None),
         ("advantages", "timing/train/advantage_calculation", None),
         ("logprobs", "timing/train/policy_and_reference_logprobs", tot_tok),
         ("train", "timing/train/policy_training", tot_tok),
         ("total step", "timing/train/total_step_time", tot_tok)]
for name, key, tok in parts:
    s = med(key)
    rate = f"{tok / s:12.0f} tok/s" if tok and s > 0 else ""
    print(f"  {name:<11} {s*1000:9.2f} ms  {rate}")
print(f"start-up to the first train step: {start['timing/train/startup']:.3f} s (algorithm created -> first optimizer step); "
      f"one-step run, whole process: {t1 - t0:.3f} s (goal <= 2 s)")
PY
