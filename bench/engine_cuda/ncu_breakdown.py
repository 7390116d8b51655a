#!/usr/bin/env python3
# Kernel time of one training step by kind, from Nsight Compute's CSV (the device image has ncu, not nsys):
#   ncu --metrics gpu__time_duration.sum --csv bench_cuda_engine [--shape S] --only train --steps 1 --warmup 0 > step.csv
#   python3 bench/engine_cuda/ncu_breakdown.py step.csv [TOP]   (TOP: also the TOP longest kernels by name)
# SKIP_FIRST=1 (with --steps 2): only the last step's kernels (after the AdamW before it), so setup's probes
# and the weights' one-time cast are left out.
# ncu runs kernels one at a time at base clocks, so the sum exceeds a real step's time; the shares hold.
import csv, collections, os, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) == 15 and r[0].isdigit()]
if os.environ.get("SKIP_FIRST") == "1":
    # AdamW's launches come in runs (setup's probe, then one a step): keep what follows the
    # second-to-last run, the last step alone.
    ends = [i for i, r in enumerate(rows) if "adam" in r[4].lower() and
            (i + 1 == len(rows) or "adam" not in rows[i + 1][4].lower())]
    if len(ends) >= 2:
        rows = rows[ends[-2] + 1:]
kinds = [("amax_kernel", "FP8 amax (tensorwise)"), ("amax_flat", "FP8 amax (tensorwise)"),
         ("quantize_tr", "FP8 quantise, tensor scale, x^T (and x)"), ("quantize_rows", "FP8 quantise, tensor scale"),
         ("quantize_transposed", "FP8 quantise, tensor scale, transposed"), ("tile_rows", "FP8 1x128 tiles"),
         ("tile_transposed", "FP8 1x128 tiles, transposed"), ("block_kernel", "FP8 128x128 blocks (weights)"),
         ("history_", "FP8 scales (delayed)"), ("delayed_kernel", "FP8 scales (delayed)"), ("tensor_scale", "FP8 scales"),
         ("gg_mma", "grouped GEMM (MoE experts)"), ("sdpa_sm90_flash_fprop", "attention forward"),
         ("sdpa_sm90_flash_bprop", "attention backward"), ("dot_do_o", "attention (dO.O, dQ)"),
         ("fmha_reduce", "attention (dO.O, dQ)"), ("convert_dq", "attention (dO.O, dQ)"), ("attn_fwd", "attention forward"), ("attn_bwd", "attention backward"), ("attn", "attention (dO.O, dQ)"),
         ("grouped_gemm", "grouped GEMM (MoE experts)"), ("gemm", "GEMM (cuBLASLt)"), ("sm90", "GEMM (cuBLASLt)"),
         ("cutlass", "GEMM (cuBLASLt)"), ("xmma", "GEMM (cuBLASLt)"), ("nvjet", "GEMM (cuBLASLt)"), ("tile_grad", "head: logits gradient"),
         ("tile_stats", "head: log-sum-exp"), ("logprob", "head: finish"), ("router", "MoE router"),
         ("permute", "MoE permute/unpermute"), ("radix", "cub sorts and scans"), ("cub", "cub sorts and scans"),
         ("adam", "AdamW"), ("sumsq", "gradient norm"), ("sum_partials", "gradient norm"), ("rmsnorm", "RMSNorm"),
         ("rope", "RoPE"), ("swiglu", "SwiGLU"), ("add", "residual add"), ("embedding", "embedding"), ("combine", "MoE permute/unpermute"),
         ("cast", "bf16 cast (weights load)"), ("reduce", "column reductions (bias, norm weights)")]
tot, cnt = collections.defaultdict(float), collections.Counter()
for r in rows:
    name = r[4].lower()
    kind = next((k for key, k in kinds if key in name), "other")
    tot[kind] += float(r[14].replace(",", "")) / 1e6
    cnt[kind] += 1
total = sum(tot.values())
for k, v in sorted(tot.items(), key=lambda x: -x[1]):
    print(f"{k:42s} {v:8.2f} ms {100 * v / total:5.1f} %  ({cnt[k]} kernels)")
print(f"{'sum of kernel times':42s} {total:8.2f} ms")
if len(sys.argv) > 2:  # the longest kernels by name: what a kind's time is made of
    by, n = collections.defaultdict(float), collections.Counter()
    for r in rows:
        by[r[4][:110]] += float(r[14].replace(",", "")) / 1e6
        n[r[4][:110]] += 1
    for k, v in sorted(by.items(), key=lambda x: -x[1])[:int(sys.argv[2])]:
        print(f"{v:8.2f} ms {100 * v / total:5.1f} % {n[k]:4}x  {k}")
    # The GEMMs by kernel and grid (a grid stands for a shape): count, mean and total time.
    by, n = collections.defaultdict(float), collections.Counter()
    for r in rows:
        if any(key in r[4].lower() for key in ("nvjet", "sm90", "cutlass", "xmma", "gemm")):
            k = f"{r[4][:60]} grid {r[8]}"
            by[k] += float(r[14].replace(",", "")) / 1e6
            n[k] += 1
    for k, v in sorted(by.items(), key=lambda x: -x[1])[:int(sys.argv[2])]:
        print(f"GEMM {v:8.2f} ms {n[k]:4}x {1e3 * v / n[k]:8.1f} us  {k}")
