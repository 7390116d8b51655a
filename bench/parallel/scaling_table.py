"""The multi-GPU scaling table from RESULT lines on stdin: bench_parallel --device cuda (rlhost) and
torch_fsdp2.py (torch), as scripts/device_gpu.sh multigpu prints them.

    ... | python3 bench/parallel/scaling_table.py

Per mode (fsdp, ddp, distributed optimizer) and GPU count: tokens/s per GPU, the scaling
efficiency against the same implementation on one GPU (weak scaling: the per-GPU batch is fixed,
so 100% is every GPU as fast as one alone), and rlhost over torch at the same count. For rlhost's
rows also the data-parallel bytes per step against the analytic count (bench_parallel.cpp).
"""
import sys


def rows(lines):
    out = []
    for line in lines:
        if not line.startswith("RESULT"):
            continue
        kv = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
        impl = kv.get("impl", "rlhost")
        mode = kv.get("mode", "?")
        if impl == "rlhost" and kv.get("backend") == "megatron" and mode == "distributed_optimizer":
            mode = "distopt"
        base = mode.split("+")[0]
        ranks = int(kv["ranks"])
        tok = float(kv["tok_s"])
        out.append(dict(impl=impl, mode=mode, base=base, ranks=ranks, per_gpu=tok / ranks,
                        comm=float(kv.get("comm_bytes", "nan")), analytic=float(kv.get("analytic_bytes", "nan"))))
    return out


def main():
    rs = rows(sys.stdin)
    if not rs:
        print("scaling_table: no RESULT lines")
        return 1
    one = {(r["impl"], r["mode"]): r["per_gpu"] for r in rs if r["ranks"] == 1}
    peer = {(r["base"], r["ranks"]): r["per_gpu"] for r in rs if r["impl"] == "torch"}
    print(f"{'impl':8} {'mode':14} {'GPUs':>4} {'tok/s/GPU':>10} {'scaling':>8} {'vs torch':>9} {'dp GB':>8} {'analytic':>9}")
    for r in sorted(rs, key=lambda r: (r["base"], r["impl"] != "rlhost", r["mode"], r["ranks"])):
        base = one.get((r["impl"], r["mode"]))
        eff = f"{100 * r['per_gpu'] / base:7.1f}%" if base else "       -"
        p = peer.get((r["base"], r["ranks"])) if r["impl"] == "rlhost" else None
        vs = f"{r['per_gpu'] / p:8.2f}x" if p else "        -"
        gb = f"{r['comm'] / 1e9:8.3f}" if r["impl"] == "rlhost" else "       -"
        an = f"{r['analytic'] / 1e9:9.3f}" if r["impl"] == "rlhost" and r["analytic"] >= 0 else "        -"
        print(f"{r['impl']:8} {r['mode']:14} {r['ranks']:>4} {r['per_gpu']:>10.0f} {eff} {vs} {gb} {an}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
