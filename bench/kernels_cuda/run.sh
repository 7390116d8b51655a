#!/usr/bin/env bash
# Runs bench_kernels_cuda and bench_torch.py on the same GPU and prints, per op, rlhost's and
# PyTorch's figures with the ratio (PyTorch time / rlhost time: > 1 means rlhost is faster);
# writes the rows as JSON.
#   bench/kernels_cuda/run.sh [BENCH_BINARY]
#     BENCH_BINARY  default build-cuda/bench/kernels_cuda/bench_kernels_cuda (built with
#                   -DRLH_BUILD_BENCH=ON; the binary links the CUDA runtime statically and
#                   loads cuBLASLt at run time, so a copy runs on another machine)
#     REPS=20       repeats per measurement (median reported)
#     ONLY=...      groups to run: copy,gemm,attn,mem,logprob (default all)
#     RESULT_JSON   output file (default bench/results/h200-YYYY-MM-DD-kernels.json)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=${1:-$root/build-cuda/bench/kernels_cuda/bench_kernels_cuda}
reps=${REPS:-20}
only=${ONLY:-}
json=${RESULT_JSON:-$root/bench/results/h200-$(date +%F)-kernels.json}
tmp=$(mktemp -d)
only_arg=()
[ -n "$only" ] && only_arg=(--only "$only")

echo "== rlhost kernels_cuda =="
"$bin" --reps "$reps" "${only_arg[@]}" | tee "$tmp/rlhost.txt"
echo "== PyTorch =="
python3 "$here/bench_torch.py" --reps "$reps" "${only_arg[@]}" 2>&1 | tee "$tmp/torch.txt"

python3 - "$tmp/rlhost.txt" "$tmp/torch.txt" "$json" <<'PY'
import json, sys
def parse(path):
    rows = []
    for line in open(path):
        if line.startswith("RESULT"):
            rows.append(dict(kv.split("=", 1) for kv in line.split()[1:]))
    return rows
ours, peer = parse(sys.argv[1]), parse(sys.argv[2])
import datetime, re
device = ""
for line in open(sys.argv[1]):
    m = re.match(r"device: ([^,]+)", line)
    if m: device = m.group(1)
today = datetime.date.today().isoformat()
peer_by = {r["name"]: r for r in peer}
out = []
print()
print(f"{'op':18} {'shape':36} {'rlhost':>14} {'PyTorch':>14} {'ratio':>7}")
for r in ours:
    p = peer_by.get(r["name"])
    row = {"op": r["name"], "shape": r["shape"], "unit": r["unit"], "device": device, "date": today,
           "rlhost": float(r["value"]), "rlhost_ms": float(r["ms"])}
    if p:
        row.update({"peer": "torch", "peer_shape": p["shape"], "peer_value": float(p["value"]),
                    "peer_ms": float(p["ms"]), "ratio": float(p["ms"]) / float(r["ms"])})
    out.append(row)
    pv = f"{p['value']:>9} {p['unit'].split('/')[0][:6]:>4}" if p else f"{'-':>14}"
    ratio = f"{row['ratio']:6.2f}x" if p else f"{'-':>7}"
    print(f"{r['name']:18} {r['shape'][:36]:36} {r['value']:>9} {r['unit'].split('/')[0][:6]:>4} {pv} {ratio}")
print("ratio = PyTorch time / rlhost time (same op, same shape; logprob: PyTorch materialises the")
print("full [T, V] logits and its backward does 2 GEMMs where rlhost recomputes the logits: 3)")
with open(sys.argv[3], "w") as f:
    json.dump(out, f, indent=1)
print("wrote", sys.argv[3])
PY
