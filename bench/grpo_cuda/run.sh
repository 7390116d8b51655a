#!/usr/bin/env bash
# The whole GRPO step on one GPU beside its PyTorch/HF peer (torch_grpo_step.py), in the same run,
# at the peer's shape: Llama-3.2-1B (random weights, bf16 checkpoint, tied head, vocab 128,256),
# 64 prompts x 8 samples, prompts of 128 tokens, 256 new tokens at temperature 1, policy and
# reference logprobs, one optimizer step over the 512 sequences in micro-batches of 8.
#
#   bench/grpo_cuda/run.sh [BIN_DIR]      BIN_DIR holds rlhost and plugins/ (default .devbin, the
#                                         device pack; a build folder works too: BIN_DIR/bin/rlhost)
#     SHAPE=llama1b|small  STEPS=3  DEVICE=cuda|cpu  PEER=1 (0: rlhost only)  OUT=folder
#     RLHOST_EXTRA="++policy.generation.native_cfg.batch_invariant=true"  more overrides for rlhost's run
#
# rlhost runs NeMo-RL's grpo_math_1B_megatron.yaml with the megatron backend on the GPU in bf16
# and the generator on the same GPU (colocated: it refits from the trainer every step), the
# math environment, no checkpoints and no validation. tokens/s/GPU is NeMo-RL's: all tokens of
# the step (prompts and responses) over the step's wall time; rlhost's is the median over steps
# 2..STEPS (step 1 carries the first-touch costs: graph captures, GEMM plans), the peer's its
# second iteration. Rewards are all 0 (a random model never writes the answer), which changes no
# work: advantages are 0 and every sequence is still trained on.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=$(cd "${1:-$root/.devbin}" && pwd)
rlhost=$bin/rlhost
[ -x "$rlhost" ] || rlhost=$bin/bin/rlhost
shape=${SHAPE:-llama1b}
steps=${STEPS:-3}
device=${DEVICE:-cuda}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
echo "== making the $shape checkpoint and prompts in $out =="
python3 "$here/make_model.py" "$out" --shape "$shape" --prompts $((64 * steps)) --prompt-len 128 || exit 1
cd "$root"
plugins=(--plugin megatron --plugin generator --plugin grpo --plugin environments --plugin dataset_jsonl
         --plugin tokenizer_hf --plugin model_llama --plugin kernels_cpu)
precision=bfloat16
[ "$device" = cpu ] && precision=float32
echo "== rlhost: GRPO, $steps steps, policy and generator on $device =="
t0=$(date +%s.%N)
RLHOST_PLUGIN_PATH=$bin/plugins "$rlhost" "${plugins[@]}" --config examples/configs/grpo_math_1B_megatron.yaml \
  policy.model_name="$out/model" ++policy.tokenizer.chat_template=null \
  grpo.num_prompts_per_step=64 grpo.num_generations_per_prompt=8 grpo.max_num_steps="$steps" \
  grpo.val_period=0 grpo.val_at_start=false ++grpo.val_at_end=false checkpointing.enabled=false \
  policy.max_total_sequence_length=384 policy.train_micro_batch_size=8 policy.logprob_batch_size=32 \
  policy.sequence_packing.enabled=false policy.precision=$precision ++policy.device="$device" \
  policy.generation.max_new_tokens=256 policy.generation.vllm_cfg.gpu_memory_utilization=0.5 \
  data.max_input_seq_length=128 data.train.data_path="$out/train.jsonl" data.train.split_validation_size=0 \
  logger.log_dir="$out/logs" ++logger.console_enabled=false ${RLHOST_EXTRA:-} > "$out/rlhost.log" 2>&1
rc=$?
t1=$(date +%s.%N)
if [ $rc != 0 ]; then echo "rlhost failed (exit $rc):"; tail -5 "$out/rlhost.log"; exit 1; fi
peer=""
if [ "${PEER:-1}" = 1 ] && [ "$device" = cuda ]; then
  echo "== PyTorch/HF peer (torch_grpo_step.py) =="
  OUT=$out python3 "$here/torch_grpo_step.py" 2>&1 | grep -v Warning | tail -3
  peer=$out/grpo_anchor.json
fi
python3 - "$out" "$steps" "$t0" "$t1" "$peer" <<'PY'
import json, os, statistics, sys
out, steps, t0, t1, peer = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
rows = [json.loads(l) for l in open(os.path.join(out, "logs", "metrics.jsonl")) if l.strip()]
rows = [r for r in rows if "timing/train/total_step_time" in r]
use = [r for r in rows if r["step"] >= 2] or rows
med = lambda k: statistics.median(r.get(k, 0.0) for r in use)
tok = med("train/total_num_tokens")
step = med("timing/train/total_step_time")
print(f"\n== GRPO step, median of steps {use[0]['step']}..{use[-1]['step']} (process {t1 - t0:.1f} s for {steps} steps) ==")
parts = [("refit", "timing/train/prepare_for_generation/total"), ("generation", "timing/train/generation"),
         ("reward", "timing/train/reward_calculation"), ("logprobs", "timing/train/policy_and_reference_logprobs"),
         ("training", "timing/train/policy_training"), ("total step", "timing/train/total_step_time")]
p = json.load(open(peer))["grpo_step_hf_1b"] if peer and os.path.exists(peer) else None
pk = {"refit": "refit_s", "generation": "generate_s", "logprobs": "logprobs_s", "training": "train_s",
      "total step": "step_s"}
print(f"{'stage':<12}{'rlhost s':>10}{'peer s':>10}")
for name, key in parts:
    ps = f"{p[pk[name]]:10.2f}" if p and name in pk else f"{'':>10}"
    print(f"{name:<12}{med(key):10.2f}{ps}")
ours = tok / step
line = f"tokens/step {tok:.0f}; rlhost {ours:.0f} tokens/s/GPU"
if p:
    line += f"; peer {p['tok_per_s_gpu']:.0f} tokens/s/GPU; ratio {ours / p['tok_per_s_gpu']:.2f}x"
print(line)
# The train-generation mismatch GRPO logs every step (the generator's logprobs against the
# policy's logprob pass on the same tokens): exactly 1 / 0 in the deterministic mode.
print("mismatch per step: " + "; ".join(
    f"step {r['step']}: token_mult_prob_error {r.get('train/token_mult_prob_error', float('nan')):.6f}, "
    f"mean |dlp| {r.get('train/logprob_abs_error', float('nan')):.3g}, max {r.get('train/logprob_abs_error_max', float('nan')):.3g}"
    for r in rows))
print(f"RESULT name=grpo_step shape={os.environ.get('SHAPE', 'llama1b')} rlhost_tok_s_gpu={ours:.1f} "
      f"peer_tok_s_gpu={p['tok_per_s_gpu'] if p else 0:.1f} step_s={step:.3f}")
PY
