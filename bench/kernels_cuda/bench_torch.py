#!/usr/bin/env python3
"""PyTorch peers of bench_kernels_cuda on the same GPU, same shapes, same names:
   RESULT impl=torch name=<op> shape=<...> value=<x> unit=<TFLOP/s|GB/s> ms=<median>
Timing: CUDA events around each call, 3 warm-ups, median of the repeats; random inputs;
memory-bound ops rotate through buffer sets (as the C++ side) so L2 does not serve them.
Backward times are (forward + backward) - forward where autograd needs the forward."""
import argparse
import math

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--reps", type=int, default=20)
p.add_argument("--only", default="")
args = p.parse_args()
dev = "cuda"
bf = torch.bfloat16
T, d, FF, V, Hq, Hkv, Dh, L = 8192, 2048, 8192, 128256, 32, 8, 64, 2048


def want(g):
    return not args.only or g in args.only


def time_ms(f, reps=None):
    reps = reps or args.reps
    for i in range(3):
        f(i)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    ev[0].record()
    for i in range(reps):
        f(i)
        ev[i + 1].record()
    torch.cuda.synchronize()
    t = sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(reps))
    return t[len(t) // 2]


def result(name, shape, ms, flops=0.0, nbytes=0.0):
    if flops:
        print(f"RESULT impl=torch name={name} shape={shape} value={flops / ms / 1e9:.1f} unit=TFLOP/s ms={ms:.4f}", flush=True)
    else:
        print(f"RESULT impl=torch name={name} shape={shape} value={nbytes / ms / 1e6:.0f} unit=GB/s ms={ms:.4f}", flush=True)


def sets_for(nbytes):
    return int(min(8, max(1, math.ceil(400e6 / nbytes))))


print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuda {torch.version.cuda}, cudnn {torch.backends.cudnn.version()}")

if want("copy"):
    n = 1 << 30
    a = torch.randn(n // 4, device=dev)
    b = torch.empty_like(a)
    result("copy", "1GiB", time_ms(lambda i: b.copy_(a)), nbytes=2.0 * n)
    del a, b

if want("gemm"):
    gs = [("gemm_qkv_fwd", False, True, T, 3072, d), ("gemm_o_fwd", False, True, T, d, d),
          ("gemm_gateup_fwd", False, True, T, 2 * FF, d), ("gemm_down_fwd", False, True, T, d, FF),
          ("gemm_lmhead_fwd", False, True, T, V, d), ("gemm_down_dx", False, False, T, FF, d),
          ("gemm_gateup_dw", True, False, 2 * FF, d, T), ("gemm_qkv_dw", True, False, 3072, d, T)]
    for name, ta, tb, M, N, K in gs:
        A = torch.randn((K, M) if ta else (M, K), device=dev, dtype=bf)
        B = torch.randn((N, K) if tb else (K, N), device=dev, dtype=bf) * 0.02
        Aop = A.t() if ta else A
        Bop = B.t() if tb else B
        C = torch.empty(M, N, device=dev, dtype=bf)
        ms = time_ms(lambda i: torch.matmul(Aop, Bop, out=C))
        result(name, f"{M}x{N}x{K}", ms, flops=2.0 * M * N * K)
        del A, B, C

if want("attn"):
    for D in (64, 128):
        hq, hkv = (Hq, Hkv) if D == 64 else (16, 4)
        S = T // L
        q = torch.randn(S, hq, L, D, device=dev, dtype=bf, requires_grad=True)
        k = torch.randn(S, hkv, L, D, device=dev, dtype=bf, requires_grad=True)
        v = torch.randn(S, hkv, L, D, device=dev, dtype=bf, requires_grad=True)
        do = torch.randn(S, hq, L, D, device=dev, dtype=bf)
        fwd_flops = 4.0 * S * hq * D * L * (L + 1) / 2
        shape = f"S4xT2048xHq{hq}xHkv{hkv}xD{D}"
        sfx = "" if D == 64 else "_d128"
        best = None
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for bname, backend in (("default", None), ("flash", SDPBackend.FLASH_ATTENTION),
                               ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            try:
                ctx = sdpa_kernel([backend]) if backend is not None else torch.autocast("cuda", enabled=False)
                with ctx:
                    f = lambda i: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    with torch.no_grad():
                        ms_f = time_ms(f)

                    def fb(i):
                        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                        torch.autograd.grad(o, (q, k, v), do)
                    ms_fb = time_ms(fb)
                ms_b = max(ms_fb - ms_f, 1e-6)
                print(f"  sdpa {bname}: fwd {fwd_flops / ms_f / 1e9:.1f} TFLOP/s, bwd {2.5 * fwd_flops / ms_b / 1e9:.1f} TFLOP/s")
                if bname == "default":
                    best = (ms_f, ms_b)
            except Exception as e:  # a backend may refuse GQA or this shape
                print(f"  sdpa {bname}: not available ({str(e).splitlines()[0][:100]})")
        result("attn_fwd" + sfx, shape, best[0], flops=fwd_flops)
        result("attn_bwd" + sfx, shape, best[1], flops=2.5 * fwd_flops)
        del q, k, v, do

if want("mem"):
    n = T * d
    R = sets_for(4.0 * n)
    xs = [torch.randn(T, d, device=dev, dtype=bf, requires_grad=True) for _ in range(R)]
    dys = [torch.randn(T, d, device=dev, dtype=bf) for _ in range(R)]
    w = torch.randn(d, device=dev, dtype=bf, requires_grad=True)

    def rms_eager(x):  # HF LlamaRMSNorm
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(bf)

    with torch.no_grad():
        ms = time_ms(lambda i: rms_eager(xs[i % R]))
    result("rmsnorm_fwd", "8192x2048", ms, nbytes=2.0 * 2 * n + 4.0 * T)
    with torch.no_grad():
        ms2 = time_ms(lambda i: F.rms_norm(xs[i % R], (d,), w, 1e-5))
    print(f"  F.rms_norm fwd: {2.0 * 2 * n / ms2 / 1e6:.0f} GB/s")

    def rms_fb(i):
        y = rms_eager(xs[i % R])
        torch.autograd.grad(y, (xs[i % R], w), dys[i % R])
    with torch.no_grad():
        ms_f = time_ms(lambda i: rms_eager(xs[i % R]))
    ms_fb = time_ms(rms_fb)
    result("rmsnorm_bwd", "8192x2048", max(ms_fb - ms_f, 1e-6), nbytes=3.0 * 2 * n + 4.0 * T)
    del xs, dys

    # rope (HF apply_rotary_pos_emb on q [T, 32, 64])
    nq = T * Hq * Dh
    R = sets_for(4.0 * nq)
    qs = [torch.randn(T, Hq, Dh, device=dev, dtype=bf) for _ in range(R)]
    pos = (torch.arange(T, device=dev) % L).float()
    inv = 500000.0 ** (-torch.arange(0, Dh, 2, device=dev).float() / Dh)
    fr = torch.outer(pos, inv)
    emb = torch.cat((fr, fr), -1)
    cos, sin = emb.cos().to(bf)[:, None, :], emb.sin().to(bf)[:, None, :]

    def rot(x):
        x1, x2 = x[..., : Dh // 2], x[..., Dh // 2:]
        return torch.cat((-x2, x1), -1)
    ms = time_ms(lambda i: qs[i % R] * cos + rot(qs[i % R]) * sin)
    result("rope_fwd", "8192x32x64", ms, nbytes=2.0 * 2 * nq)
    del qs

    # swiglu
    nf = T * FF
    R = sets_for(10.0 * nf)
    gs_ = [torch.randn(T, FF, device=dev, dtype=bf, requires_grad=True) for _ in range(R)]
    us = [torch.randn(T, FF, device=dev, dtype=bf, requires_grad=True) for _ in range(R)]
    dhs = [torch.randn(T, FF, device=dev, dtype=bf) for _ in range(R)]
    with torch.no_grad():
        ms_f = time_ms(lambda i: F.silu(gs_[i % R]) * us[i % R])
    result("swiglu_fwd", "8192x8192", ms_f, nbytes=3.0 * 2 * nf)

    def sw_fb(i):
        h = F.silu(gs_[i % R]) * us[i % R]
        torch.autograd.grad(h, (gs_[i % R], us[i % R]), dhs[i % R])
    ms_fb = time_ms(sw_fb)
    result("swiglu_bwd", "8192x8192", max(ms_fb - ms_f, 1e-6), nbytes=5.0 * 2 * nf)
    del gs_, us, dhs

    # embedding, add
    table = torch.randn(V, d, device=dev, dtype=bf)
    ids = torch.randint(0, V, (T,), device=dev)
    R = sets_for(6.0 * n)
    outs = [torch.empty(T, d, device=dev, dtype=bf) for _ in range(R)]
    As = [torch.randn(T, d, device=dev, dtype=bf) for _ in range(R)]
    Bs = [torch.randn(T, d, device=dev, dtype=bf) for _ in range(R)]
    ms = time_ms(lambda i: torch.index_select(table, 0, ids, out=outs[i % R]))
    result("embedding_fwd", "8192x2048", ms, nbytes=2.0 * 2 * n)
    ms = time_ms(lambda i: torch.add(As[i % R], Bs[i % R], out=outs[i % R]))
    result("add_fwd", "8192x2048", ms, nbytes=3.0 * 2 * n)
    del table, outs, As, Bs

    # AdamW (fused) over 16 fp32 tensors of 16M
    each = 1 << 24
    ps = [torch.nn.Parameter(torch.randn(each, device=dev)) for _ in range(16)]
    for p_ in ps:
        p_.grad = torch.randn_like(p_) * 1e-3
    opt = torch.optim.AdamW(ps, lr=1e-5, weight_decay=0.01, fused=True)
    ms = time_ms(lambda i: opt.step(), 10)
    result("adamw", "16x16M_f32", ms, nbytes=16.0 * each * 28)
    del ps, opt

if want("logprob"):
    h = torch.randn(T, d, device=dev, dtype=bf, requires_grad=True)
    W = (torch.randn(V, d, device=dev, dtype=bf) * 0.02).requires_grad_(True)
    tg = torch.randint(0, V, (T,), device=dev)
    dlp = torch.randn(T, device=dev)

    def fwd(i):
        logits = (h @ W.t()).float()
        return logits.log_softmax(-1).gather(-1, tg[:, None])[:, 0]
    with torch.no_grad():
        ms_f = time_ms(fwd, 10)
    result("logprob_fwd", "8192x2048xV128256_full_logits", ms_f, flops=2.0 * T * V * d)

    def fb(i):
        lp = fwd(i)
        torch.autograd.grad(lp, (h, W), dlp)
    ms_fb = time_ms(fb, 5)
    result("logprob_bwd", "8192x2048xV128256_full_logits", max(ms_fb - ms_f, 1e-6), flops=4.0 * T * V * d)
    print(f"  torch logprob peak memory {torch.cuda.max_memory_allocated() / 1e9:.1f} GB (full [T, V] logits)")
