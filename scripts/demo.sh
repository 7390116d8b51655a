#!/usr/bin/env bash
# Sets up, builds and runs the main job on its embedded default: GRPO on CPU
# (examples/configs/grpo_demo_cpu.yaml).
#
# A 2-layer Llama (d64) is created with random weights and a character-level tokenizer, so it has
# never been trained on anything; GRPO then teaches it single-digit subtraction ("7-3=" -> "4")
# from the environment's exact-match reward alone. The console shows one line per step (loss,
# reward, greedy validation accuracy every 10 steps, timings); the end prints the validation
# accuracy before and after and the checkpoints written (results/grpo_demo/step_N/).
#
#   scripts/demo.sh                 # seed 1
#   SEED=2 scripts/demo.sh          # another model init, data order and sampling seed
#   scripts/demo.sh grpo.max_num_steps=50   # any config override
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -G Ninja -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRLH_BUILD_TESTS=OFF >/dev/null
cmake --build build -j"$(nproc)"

SEED=${SEED:-1}
OUT=results/grpo_demo
rm -rf build/demo "$OUT"  # a fresh run: an existing checkpoint would be resumed instead
echo
./build/bin/rlh_tiny_model build/demo/tiny_model --alphabet "0123456789-=" --seed "$SEED"
echo
echo "== rlhost --config examples/configs/grpo_demo_cpu.yaml grpo.seed=$SEED $* =="
start=$(date +%s)
./build/bin/rlhost --plugin dtensor --plugin generator --plugin grpo --plugin environments \
  --plugin tokenizer_hf --plugin model_llama --plugin kernels_cpu \
  --config examples/configs/grpo_demo_cpu.yaml \
  policy.model_name=build/demo/tiny_model grpo.seed="$SEED" checkpointing.checkpoint_dir="$OUT" \
  logger.log_dir="$OUT/logs" "$@"
end=$(date +%s)
echo
echo "== done in $((end - start)) s; checkpoints in $OUT: $(cd "$OUT" && ls -d step_* | tr '\n' ' ')=="
