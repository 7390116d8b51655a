#!/usr/bin/env python3
"""PyTorch's peer of bench_fp8_gemm on the same GPU: torch._scaled_mm at M x N x K with e4m3
operands (randn / 4, as bench_fp8_gemm draws them) and bf16 output, per-tensor scales (with and
without fast accumulation), and (where this PyTorch has it) DeepSeek-V3 block
scales (A 1x128 tiles, B 128x128 blocks). CUDA events around each call, warm-ups, median.
   RESULT impl=torch name=<case> shape=MxNxK value=<TFLOP/s> unit=TFLOP/s ms=<per call>"""
import argparse

import torch

p = argparse.ArgumentParser()
p.add_argument("--m", type=int, default=8192)
p.add_argument("--n", type=int, default=8192)
p.add_argument("--k", type=int, default=8192)
p.add_argument("--reps", type=int, default=50)
args = p.parse_args()
M, N, K = args.m, args.n, args.k
dev = "cuda"
a = (torch.randn(M, K, device=dev) / 4).to(torch.float8_e4m3fn)
b = (torch.randn(N, K, device=dev) / 4).to(torch.float8_e4m3fn).t()  # column-major K x N: _scaled_mm's layout


def time_ms(f):
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(args.reps + 1)]
    ev[0].record()
    for i in range(args.reps):
        f()
        ev[i + 1].record()
    torch.cuda.synchronize()
    t = sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(args.reps))
    return t[len(t) // 2]


def result(name, ms):
    print(f"RESULT impl=torch name={name} shape={M}x{N}x{K} value={2 * M * N * K / ms / 1e9:.1f} unit=TFLOP/s ms={ms:.4f}",
          flush=True)


one = torch.ones((), device=dev)
result("fp8_gemm_tensor", time_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)))
result("fp8_gemm_tensor_fast_accum",
       time_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)))
try:
    kb = (K + 127) // 128
    sa = torch.ones(kb, M, device=dev).t()  # [M, K/128], M fastest
    kb4 = (kb + 3) // 4 * 4
    sb = torch.ones((N + 127) // 128, kb4, device=dev).t()  # [kb4, N/128], K blocks fastest
    f = lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    f()
    result("fp8_gemm_block", time_ms(f))
except Exception as e:  # an older PyTorch: say so, no figure
    print(f"torch: no blockwise _scaled_mm here ({type(e).__name__}: {str(e).splitlines()[0][:160]})", flush=True)
