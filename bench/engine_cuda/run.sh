#!/usr/bin/env bash
# Runs bench_cuda_engine and bench_torch.py (eager, then torch.compile for training) on the same
# GPU and prints rlhost's and PyTorch's tokens/s with the ratios; writes the rows as JSON.
#   bench/engine_cuda/run.sh [BENCH_BINARY]
#     BENCH_BINARY  default build-cuda/bench/engine_cuda/bench_cuda_engine (-DRLH_BUILD_BENCH=ON;
#                   it links the CUDA runtime statically and loads cuBLASLt at run time, so a
#                   copy runs on another machine)
#     SHAPE=llama1b STEPS=10   shape and timed steps
#     SHAPE=qwen3moe  the Qwen3-MoE shape (64 experts top-8; PyTorch: Qwen3MoeForCausalLM with
#                   HF's eager experts loop); moesmall is its quick check
#     TORCH_EXPERTS=grouped_mm  MoE shapes: also time transformers' grouped_mm experts backend
#     COMPILE=1     also time torch.compile's training step (compilation takes minutes)
#     RESULT_JSON   output file (default bench/results/h200-YYYY-MM-DD-engine.json)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=${1:-$root/build-cuda/bench/engine_cuda/bench_cuda_engine}
shape=${SHAPE:-llama1b}
steps=${STEPS:-10}
json=${RESULT_JSON:-$root/bench/results/h200-$(date +%F)-engine.json}
tmp=$(mktemp -d)
echo "== rlhost (engine_cuda) =="
"$bin" --shape "$shape" --steps "$steps" | tee "$tmp/rlhost.txt"
# Activation recompute: the same step keeping less (memory in GiB beside the speed).
for r in selective full; do
  "$bin" --shape "$shape" --steps "$steps" --only train --recompute "$r" | grep -v "^device:" | tee -a "$tmp/rlhost.txt"
done
echo "== PyTorch eager =="
python3 "$here/bench_torch.py" --shape "$shape" --steps "$steps" 2>&1 | grep -v Warning | tee "$tmp/torch.txt"
if [ -n "${TORCH_EXPERTS:-}" ]; then
  echo "== PyTorch eager, experts backend $TORCH_EXPERTS =="
  python3 "$here/bench_torch.py" --shape "$shape" --steps "$steps" --experts "$TORCH_EXPERTS" 2>&1 |
    grep -v Warning | tee -a "$tmp/torch.txt"
fi
if [ "${COMPILE:-0}" = 1 ]; then
  echo "== PyTorch torch.compile (training) =="
  python3 "$here/bench_torch.py" --shape "$shape" --steps "$steps" --compile --only train 2>&1 |
    grep -v Warning | tee -a "$tmp/torch.txt"
fi
python3 - "$tmp/rlhost.txt" "$tmp/torch.txt" "$json" <<'PY'
import datetime, json, re, sys
def parse(path):
    rows = []
    for line in open(path):
        if line.startswith("RESULT"):
            rows.append(dict(kv.split("=", 1) for kv in line.split()[1:]))
    return rows
ours, peers = parse(sys.argv[1]), parse(sys.argv[2])
device = ""
for line in open(sys.argv[1]):
    m = re.match(r"device: ([^,]+)", line)
    if m: device = m.group(1)
out = []
print(f"\n{'work':8} {'shape':22} {'rlhost tok/s':>13} {'peer':>14} {'peer tok/s':>11} {'ratio':>7}")
for r in ours:
    for p in [p for p in peers if p["name"] == r["name"]] or [None]:
        row = {"work": r["name"], "shape": r["shape"], "device": device,
               "date": datetime.date.today().isoformat(), "rlhost_tok_s": float(r["value"]),
               "rlhost_ms": float(r["ms"]), "mfu": float(r["mfu"])}
        for k in ("allocs", "syncs"):
            if k in r: row[k + "_per_step"] = float(r[k])
        if "gib" in r: row["device_gib"] = float(r["gib"])
        if p:
            row.update({"peer": "torch " + p["mode"], "peer_tok_s": float(p["value"]),
                        "ratio": float(r["value"]) / float(p["value"])})
        out.append(row)
        print(f"{r['name']:8} {r['shape']:22} {float(r['value']):13.0f} {row.get('peer', '-'):>14} "
              f"{row.get('peer_tok_s', 0):11.0f} {row.get('ratio', 0):6.2f}x")
with open(sys.argv[3], "w") as f:
    json.dump(out, f, indent=1)
print("wrote", sys.argv[3])
PY
