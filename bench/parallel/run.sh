#!/usr/bin/env bash
# Data-parallel training steps on CPU ranks: dtensor FSDP and megatron's distributed optimizer at
# 1, 2 and 4 ranks (mpirun --oversubscribe, one BLAS thread per rank) on a random Llama made by
# rlh_tiny_model, through the backends' ABI. Prints each run's RESULT line and a table of step
# time, speed-up over one rank, per-rank training state and communication bytes per step
# against the analytic count (bench_parallel.cpp says how each is counted).
#   bench/parallel/run.sh [BUILD_DIR]        (BUILD_DIR configured with -DRLH_BUILD_BENCH=ON)
# Environment: HIDDEN (256), LAYERS (4), FFN (704), SEQS (16), LEN (64), MB_SEQS (4), STEPS (3).
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${1:-build}
ninja -C "$B" bench_parallel rlh_tiny_model comm_mpi dtensor megatron model_llama kernels_cpu >/dev/null
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$B/bin/rlh_tiny_model" "$tmp/model" --hidden "${HIDDEN:-256}" --layers "${LAYERS:-4}" --heads 4 --kv-heads 4 \
  --ffn "${FFN:-704}" --alphabet "0123456789abcdefghijklmnopqrstuvwxyz+-*=" --max-positions 512 >/dev/null
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
for np in 1 2 4; do
  for backend in dtensor megatron; do
    mpirun --allow-run-as-root --oversubscribe -np "$np" "$B/bench/parallel/bench_parallel" --model "$tmp/model" \
      --backend "$backend" --seqs "${SEQS:-16}" --len "${LEN:-64}" --mb-seqs "${MB_SEQS:-4}" --steps "${STEPS:-3}" |
      grep '^RESULT' | tee -a "$tmp/results"
  done
done
python3 - "$tmp/results" <<'PY'
import sys
rows = []
for line in open(sys.argv[1]):
    kv = dict(f.split("=", 1) for f in line.split()[1:])
    rows.append(kv)
base = {r["backend"]: float(r["step_s"]) for r in rows if r["ranks"] == "1"}
one_state = {r["backend"]: float(r["state_bytes"]) for r in rows if r["ranks"] == "1"}
print(f"{'backend':9} {'mode':22} {'ranks':>5} {'step s':>8} {'speed-up':>8} {'state/rank':>11} "
      f"{'comm MB/step':>12} {'analytic MB':>11} {'x param bytes':>13} {'in comm s':>9}")
for r in rows:
    b = r["backend"]
    print(f"{b:9} {r['mode']:22} {r['ranks']:>5} {float(r['step_s']):8.3f} {base[b] / float(r['step_s']):8.2f} "
          f"{float(r['state_bytes']) / one_state[b]:11.3f} {float(r['comm_bytes']) / 1e6:12.2f} "
          f"{float(r['analytic_bytes']) / 1e6:11.2f} {float(r['comm_over_param_bytes']):13.3f} {float(r['comm_s']):9.3f}")
PY
