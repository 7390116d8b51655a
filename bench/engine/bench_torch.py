#!/usr/bin/python3
"""The peer for bench_engine: the same Llama-style model, batch and step in PyTorch (fp32, CPU).

Training step = forward, mean next-token NLL, backward, clip_grad_norm_(1.0), AdamW step.
Forward logprobs = no-grad forward + log_softmax + gather. Prints the BLAS configuration PyTorch
was built with, its measured sgemm GFLOP/s, and one "RESULT ..." line for run.sh.

    OPENBLAS_CORETYPE=SkylakeX OMP_NUM_THREADS=2 /usr/bin/python3 bench_torch.py --shape small
"""
import argparse
import os
import sys
import math
import statistics
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from torch_llama import RMSNorm, rope_tables, rotate_half  # noqa: E402

SHAPES = {
    # vocab, hidden, layers, heads, kv heads, head dim, ffn, batch, seq
    "tiny": (4096, 256, 4, 8, 4, 32, 768, 16, 128),
    "small": (32000, 768, 12, 12, 4, 64, 2048, 2, 128),
}


class Layer(torch.nn.Module):
    def __init__(self, C, Hq, Hkv, D, Fw):
        super().__init__()
        self.Hq, self.Hkv, self.D = Hq, Hkv, D
        self.attn_norm, self.mlp_norm = RMSNorm(C), RMSNorm(C)
        self.q = torch.nn.Linear(C, Hq * D, bias=False)
        self.k = torch.nn.Linear(C, Hkv * D, bias=False)
        self.v = torch.nn.Linear(C, Hkv * D, bias=False)
        self.o = torch.nn.Linear(Hq * D, C, bias=False)
        self.gate = torch.nn.Linear(C, Fw, bias=False)
        self.up = torch.nn.Linear(C, Fw, bias=False)
        self.down = torch.nn.Linear(Fw, C, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(B, T, self.Hq, self.D).transpose(1, 2)
        k = self.k(h).view(B, T, self.Hkv, self.D).transpose(1, 2)
        v = self.v(h).view(B, T, self.Hkv, self.D).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.Hq // self.Hkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(self.D) + mask
        a = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, self.Hq * self.D)
        x = x + self.o(a)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Model(torch.nn.Module):
    def __init__(self, V, C, L, Hq, Hkv, D, Fw):
        super().__init__()
        self.embed = torch.nn.Embedding(V, C)
        self.layers = torch.nn.ModuleList([Layer(C, Hq, Hkv, D, Fw) for _ in range(L)])
        self.norm = RMSNorm(C)
        self.lm_head = torch.nn.Linear(C, V, bias=False)
        self.D = D

    def forward(self, ids):
        B, T = ids.shape
        cos, sin = rope_tables(T, self.D)
        mask = torch.full((T, T), float("-inf")).triu(1)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.norm(x))


def token_logprobs(logits, ids):
    lp = logits[:, :-1].log_softmax(-1)
    return lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def blas_library():
    """The BLAS library this process loaded, and OpenBLAS's core/config when it is OpenBLAS."""
    import ctypes
    libs = set()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if "blas" in path.lower() and path.startswith("/"):
                libs.add(path)
    info = []
    for path in sorted(libs):
        text = path
        try:
            lib = ctypes.CDLL(path)
            lib.openblas_get_corename.restype = ctypes.c_char_p
            lib.openblas_get_config.restype = ctypes.c_char_p
            text += f" (OpenBLAS core {lib.openblas_get_corename().decode()}, " \
                    f"{lib.openblas_get_config().decode()})"
        except (OSError, AttributeError):
            pass
        info.append(text)
    return "; ".join(info) or "none found"


def sgemm_gflops(n=2048):
    a, b = torch.rand(n, n), torch.rand(n, n)
    a @ b
    it, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 2.0 or it < 3:
        a @ b
        it += 1
    return 2 * n ** 3 * it / (time.perf_counter() - t0) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="small", choices=SHAPES)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    V, C, L, Hq, Hkv, D, Fw, B, T = SHAPES[a.shape]
    print("torch", torch.__version__, "threads", torch.get_num_threads())
    print(torch.__config__.show())
    torch.rand(8, 8) @ torch.rand(8, 8)  # make sure the BLAS is loaded
    print("BLAS library:", blas_library())
    model = Model(V, C, L, Hq, Hkv, D, Fw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    ids = (torch.arange(B * T) * 7919 + 13).remainder(V).view(B, T)

    def train_step():
        opt.zero_grad(set_to_none=True)
        loss = -token_logprobs(model(ids), ids).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    # Each step timed alone; medians reported (as bench_engine does).
    for _ in range(a.warmup):
        train_step()
    train_times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = train_step()
        train_times.append(time.perf_counter() - t0)
    train_s = statistics.median(train_times)
    fwd_times = []
    with torch.no_grad():
        token_logprobs(model(ids), ids)
        for _ in range(a.steps):
            t0 = time.perf_counter()
            token_logprobs(model(ids), ids)
            fwd_times.append(time.perf_counter() - t0)
    fwd_s = statistics.median(fwd_times)
    g = sgemm_gflops()
    N = B * T
    print(f"shape {a.shape}: loss {loss:.4f}; train step median {train_s:.3f} s "
          f"(mean {statistics.mean(train_times):.3f}), {N / train_s:.0f} tok/s; forward logprobs "
          f"median {fwd_s:.3f} s, {N / fwd_s:.0f} tok/s; sgemm {g:.1f} GFLOP/s")
    print(f"RESULT impl=torch shape={a.shape} train_tok_s={N / train_s:.1f} fwd_tok_s={N / fwd_s:.1f} "
          f"sgemm_gflops={g:.1f}")


if __name__ == "__main__":
    main()
