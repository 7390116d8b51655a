#!/usr/bin/env bash
# Training steps on CPU ranks: dtensor FSDP and megatron's distributed optimizer at 1, 2 and 4
# ranks, and megatron's model-parallel layouts (TP, TP + SP, PP, CP at 2 ranks; TP 4 and the
# products TP2xDP2, PP2xDP2, CP2xDP2, TP2xPP2, TP2xCP2 at 4), and expert parallelism (EP 2, EP 4
# and EP 2 x DP 2 on a Mixtral-style model of 8 experts, top-2), with mpirun --oversubscribe and one
# BLAS thread per rank, on random models made by rlh_tiny_model, through the backends' ABI.
# Prints each run's RESULT line and a table of step time, speed-up over one rank, per-rank
# training state, and communication bytes per step of the data-parallel and the model-parallel
# group against the analytic counts (bench_parallel.cpp says how each is counted). On a machine
# with fewer cores than ranks the step times measure contention, not scaling; the bytes are exact.
#   bench/parallel/run.sh [BUILD_DIR]        (BUILD_DIR configured with -DRLH_BUILD_BENCH=ON)
# Environment: HIDDEN (256), LAYERS (4), KV_HEADS (2), FFN (704), SEQS (16), LEN (64), MB_SEQS (4), STEPS (3).
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${1:-build}
ninja -C "$B" bench_parallel rlh_tiny_model comm_mpi dtensor megatron model_llama kernels_cpu >/dev/null
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$B/bin/rlh_tiny_model" "$tmp/model" --hidden "${HIDDEN:-256}" --layers "${LAYERS:-4}" --heads 4 --kv-heads "${KV_HEADS:-2}" \
  --ffn "${FFN:-704}" --alphabet "0123456789abcdefghijklmnopqrstuvwxyz+-*=" --max-positions 512 >/dev/null
"$B/bin/rlh_tiny_model" "$tmp/moe" --hidden "${HIDDEN:-256}" --layers "${LAYERS:-4}" --heads 4 --kv-heads "${KV_HEADS:-2}" \
  --ffn "${MOE_FFN:-176}" --experts 8 --top-k 2 --alphabet "0123456789abcdefghijklmnopqrstuvwxyz+-*=" --max-positions 512 >/dev/null
echo "machine: $(nproc --all) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
bench() {  # ranks backend [flags...]   (MODEL: dense or moe)
  local np=$1 backend=$2
  shift 2
  mpirun --allow-run-as-root --oversubscribe -np "$np" "$B/bench/parallel/bench_parallel" --model "$tmp/${MODEL:-model}" \
    --backend "$backend" --seqs "${SEQS:-16}" --len "${LEN:-64}" --mb-seqs "${MB_SEQS:-4}" --steps "${STEPS:-3}" "$@" |
    grep '^RESULT' | tee -a "$tmp/results"
}
for np in 1 2 4; do
  for backend in dtensor megatron; do bench "$np" "$backend"; done
done
for layout in "--tp 2" "--tp 2 --sp" "--pp 2" "--cp 2"; do bench 2 megatron $layout; done
for layout in "--tp 4" "--tp 2" "--pp 2" "--cp 2" "--tp 2 --pp 2" "--tp 2 --cp 2"; do bench 4 megatron $layout; done
MODEL=moe bench 1 megatron
MODEL=moe bench 2 megatron --ep 2
for ep in 2 4; do MODEL=moe bench 4 megatron --ep "$ep"; done
python3 - "$tmp/results" <<'PY'
import sys
rows = []
for line in open(sys.argv[1]):
    kv = dict(f.split("=", 1) for f in line.split()[1:])
    rows.append(kv)
one = {(r["backend"], r["experts"]): r for r in rows if r["ranks"] == "1"}
def mb(v):
    return "-" if float(v) < 0 else f"{float(v) / 1e6:.3f}"
print("mp = the model-parallel group's bytes (tp/ for layouts with TP, else pp/, cp/ or ep/); '-': no analytic count;")
print("EP's count is the expectation under uniform routing (test_backend_ep checks the exact one); moe = 8 experts, top-2")
print(f"{'backend':9} {'mode':22} {'layout':10} {'ranks':>5} {'step s':>7} {'speed-up':>8} {'state/rank':>10} "
      f"{'dp MB':>8} {'analytic':>8} {'mp MB':>8} {'analytic':>8}")
for r in rows:
    b, dp = r["backend"], int(r["ranks"]) // (int(r["tp"]) * int(r["pp"]) * int(r["cp"]))
    ep = int(r["ep"])
    if ep > 1:  # expert-parallel ranks are data-parallel ranks: the rest replicate the experts
        layout = f"ep{ep}" + (f" x edp{dp // ep}" if dp // ep > 1 else "")
    else:
        layout = r["layout"] + (f" x dp{dp}" if r["layout"] != "dp" and dp > 1 else "")
    if r["experts"] != "0":
        layout = "moe " + layout
    base = one[(b, r["experts"])]
    print(f"{b:9} {r['mode']:22} {layout:10} {r['ranks']:>5} {float(r['step_s']):7.3f} "
          f"{float(base['step_s']) / float(r['step_s']):8.2f} {float(r['state_bytes']) / float(base['state_bytes']):10.3f} "
          f"{mb(r['comm_bytes']):>8} {mb(r['analytic_bytes']):>8} {mb(r['mp_bytes']):>8} {mb(r['mp_analytic']):>8}")
PY
