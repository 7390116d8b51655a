#!/usr/bin/env bash
# Sets up, builds and runs the main job on its embedded default.
#
# Until the GRPO plugin lands (issue: GRPO end to end on CPU), the main job cannot run yet: this
# builds everything and shows what the host can do today — the plugins it finds (with whether
# each can run here) and a NeMo-RL configuration resolved through defaults, interpolation and
# command-line overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -G Ninja -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRLH_BUILD_TESTS=OFF >/dev/null
cmake --build build -j"$(nproc)"
echo
echo "== rlhost --list-plugins =="
./build/bin/rlhost --list-plugins
echo
echo "== rlhost --print-config --config examples/configs/grpo_math_1B.yaml grpo.num_prompts_per_step=8 =="
./build/bin/rlhost --print-config --config examples/configs/grpo_math_1B.yaml grpo.num_prompts_per_step=8
