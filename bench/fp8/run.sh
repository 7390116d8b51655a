#!/usr/bin/env bash
# The FP8 GEMM of examples/vendor_fp8 beside torch._scaled_mm on the same GPU, in one run:
# 8192^3, e4m3 operands, bf16 output, per-tensor and block scales. Prints both figures and the
# ratio (rlhost / torch), on the same data (N(0, 1/4) as e4m3; see bench_fp8_gemm.cpp); the
# issue's goal is >= 1,300 TFLOP/s (torch 1,357).
#   bench/fp8/run.sh BENCH_BINARY PLUGIN_SO    (device_gpu.sh passes the packed copies)
#     M=8192 N=8192 K=8192 REPS=50
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$1 so=$2
shape=(--m "${M:-8192}" --n "${N:-8192}" --k "${K:-8192}")
tmp=$(mktemp -d)
echo "== rlhost (vendor_fp8 on cuBLASLt) =="
"$bin" "$so" "${shape[@]}" --reps "${REPS:-50}" | tee "$tmp/rlhost.txt"
echo "== rlhost on uniformly random codes (more bits toggle: the clock effect, no torch peer) =="
"$bin" "$so" "${shape[@]}" --reps "${REPS:-50}" --data uniform
echo "== PyTorch torch._scaled_mm =="
python3 "$here/bench_torch.py" "${shape[@]}" --reps "${REPS:-50}" 2>&1 | grep -v Warning | tee "$tmp/torch.txt"
python3 - "$tmp/rlhost.txt" "$tmp/torch.txt" <<'PY'
import sys
def parse(path):
    rows = {}
    for line in open(path):
        if line.startswith("RESULT "):
            kv = dict(f.split("=", 1) for f in line.split()[1:])
            rows[kv["name"]] = float(kv["value"])
    return rows
a, b = parse(sys.argv[1]), parse(sys.argv[2])
for name in a:
    ratio = f"{a[name] / b[name]:.2f}x" if name in b else "no torch figure"
    print(f"{name}: rlhost {a[name]:.1f} TFLOP/s, torch {b.get(name, float('nan')):.1f} TFLOP/s, ratio {ratio}")
PY
