#!/usr/bin/env bash
# Sets up, builds and runs the main job on its embedded default: GRPO on CPU.
#
# 1. rlh_tiny_model writes a 2-layer Llama (d64) with random weights and a character-level
#    tokenizer (build/demo/tiny_model).
# 2. SFT pre-trains it on single-digit addition and multiplication only
#    (examples/configs/sft_demo_cpu.yaml; ~1 minute): it learns to read two operands and answer
#    in digits, and never sees a "-".
# 3. GRPO teaches it single-digit SUBTRACTION ("7-3=" -> "4") from the environment's exact-match
#    reward alone (examples/configs/grpo_demo_cpu.yaml). The console shows one line per step
#    (loss, reward, greedy validation accuracy every 25 steps, timings); the end prints the
#    validation accuracy before and after and the checkpoints written
#    (build/demo/results/grpo_demo/step_N/).
#
#   scripts/demo.sh                          # seed 1
#   SEED=2 scripts/demo.sh                   # another model init, data order and sampling seed
#   scripts/demo.sh grpo.max_num_steps=50    # any override of the GRPO config
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -G Ninja -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRLH_BUILD_TESTS=OFF >/dev/null
cmake --build build -j"$(nproc)"

SEED=${SEED:-1}
# Everything the demo writes stays under build/demo/ (the build folders are ignored by git).
SFT=build/demo/results/sft_demo
OUT=build/demo/results/grpo_demo
rm -rf build/demo  # a fresh run: an existing checkpoint would be resumed instead
PLUGINS=(--plugin dtensor --plugin environments --plugin tokenizer_hf --plugin model_llama --plugin kernels_cpu)
start=$(date +%s)
echo
./build/bin/rlh_tiny_model build/demo/tiny_model --alphabet "0123456789+-*=" --seed "$SEED"
echo
echo "== stage 1: SFT on addition and multiplication (examples/configs/sft_demo_cpu.yaml) =="
./build/bin/rlhost "${PLUGINS[@]}" --plugin sft --config examples/configs/sft_demo_cpu.yaml \
  policy.model_name=build/demo/tiny_model sft.seed="$SEED" checkpointing.checkpoint_dir="$SFT" \
  logger.log_dir="$SFT/logs"
ckpt=$(ls -d "$SFT"/step_* | sort -t_ -k2 -n | tail -1)
echo
echo "== stage 2: GRPO on subtraction from $ckpt/policy (examples/configs/grpo_demo_cpu.yaml) =="
./build/bin/rlhost "${PLUGINS[@]}" --plugin generator --plugin grpo \
  --config examples/configs/grpo_demo_cpu.yaml \
  policy.model_name="$ckpt/policy" grpo.seed="$SEED" checkpointing.checkpoint_dir="$OUT" \
  logger.log_dir="$OUT/logs" "$@"
end=$(date +%s)
echo
echo "== done in $((end - start)) s; GRPO checkpoints in $OUT: $(cd "$OUT" && ls -d step_* | tr '\n' ' ')=="
