#!/usr/bin/env bash
# Runs bench_generator_cuda and Hugging Face generate (bench_hf_generate.py) on the same GPU and
# prints tokens/s, the ratio, the bandwidth roofline and the issue's goals; writes JSON.
#   bench/generator_cuda/run.sh [BENCH_BINARY]
#     BENCH_BINARY  default build-cuda/bench/generator_cuda/bench_generator_cuda (-DRLH_BUILD_BENCH=ON)
#     SHAPE=llama1b CASE=all PROMPT=128 NEW=256 REPEATS=3 HF_REPEATS=1
#     EXTRA="--deterministic"   more flags for the generator (--no-graphs, --deterministic)
#     RESULT_JSON   output file (default bench/results/h200-YYYY-MM-DD-generator.json)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=${1:-$root/build-cuda/bench/generator_cuda/bench_generator_cuda}
shape=${SHAPE:-llama1b}
case_=${CASE:-all}
prompt=${PROMPT:-128}
new=${NEW:-256}
json=${RESULT_JSON:-$root/bench/results/h200-$(date +%F)-generator.json}
tmp=$(mktemp -d)
echo "== rlhost (generator on the GPU) =="
"$bin" --shape "$shape" --case "$case_" --prompt "$prompt" --new "$new" --repeats "${REPEATS:-3}" ${EXTRA:-} |
  tee "$tmp/rlhost.txt"
echo "== Hugging Face generate =="
python3 "$here/bench_hf_generate.py" --shape "$shape" --case "$case_" --prompt "$prompt" --new "$new" \
  --repeats "${HF_REPEATS:-1}" 2>&1 | grep -v Warning | tee "$tmp/hf.txt"
python3 - "$tmp/rlhost.txt" "$tmp/hf.txt" "$json" <<'PY'
import datetime, json, re, sys
def parse(path):
    return [dict(kv.split("=", 1) for kv in l.split()[1:]) for l in open(path) if l.startswith("RESULT")]
ours, hf = parse(sys.argv[1]), {r["name"]: r for r in parse(sys.argv[2])}
device = next((m.group(1) for m in (re.match(r"device: ([^,]+)", l) for l in open(sys.argv[1])) if m), "")
goals = {"b1": 1400, "b64": 30000, "b256": 60000, "grpo": 80000}
rows = []
print(f"\n{'case':6} {'rlhost tok/s':>13} {'HF tok/s':>10} {'ratio':>7} {'roofline':>9} {'% roof':>7} {'goal':>7}")
for r in ours:
    h = hf.get(r["name"])
    ours_t, roof = float(r["tok_s"]), float(r["roofline_tok_s"])
    hf_t = float(h["tok_s"]) if h else None
    row = {"case": r["name"], "shape": r["shape"], "prompts": int(r["prompts"]), "samples": int(r["samples"]),
           "prompt": int(r["prompt"]), "new": int(r["new"]), "device": device,
           "date": datetime.date.today().isoformat(), "rlhost_tok_s": ours_t, "hf_tok_s": hf_t,
           "roofline_tok_s": roof, "deterministic": r["deterministic"] == "1", "graphs": r["graphs"] == "1"}
    rows.append(row)
    ratio = f"{ours_t / hf_t:6.1f}x" if hf_t else "     -"
    print(f"{r['name']:6} {ours_t:13.0f} {hf_t if hf_t else 0:10.0f} {ratio:>7} {roof:9.0f} {100 * ours_t / roof:6.0f}% "
          f"{goals.get(r['name'], 0):7d}")
json.dump(rows, open(sys.argv[3], "w"), indent=1)
print(f"\nwritten {sys.argv[3]}")
PY
rm -rf "$tmp"
