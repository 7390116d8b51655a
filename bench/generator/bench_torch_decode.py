#!/usr/bin/python3
"""The peer for bench_generator: KV-cached greedy decoding of the same Llama-style shapes in
PyTorch (fp32, CPU, no_grad): one prefill of the prompts, then one step per new token with
per-layer key/value caches preallocated to the final length. Prints one "RESULT ..." line.

    OPENBLAS_CORETYPE=SkylakeX OMP_NUM_THREADS=2 /usr/bin/python3 bench_torch_decode.py --shape small --batch 16
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
from torch_llama import RMSNorm, rotate_half  # noqa: E402

SHAPES = {
    # vocab, hidden, layers, heads, kv heads, head dim, ffn
    "tiny": (4096, 256, 4, 8, 4, 32, 768),
    "small": (32000, 768, 12, 12, 4, 64, 2048),
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

    def forward(self, x, cos, sin, cache, start):
        """x [B, T, C] at positions start..start+T-1; cache = (k [B,Hkv,Tmax,D], v)."""
        B, T, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(B, T, self.Hq, self.D).transpose(1, 2)
        k = self.k(h).view(B, T, self.Hkv, self.D).transpose(1, 2)
        v = self.v(h).view(B, T, self.Hkv, self.D).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        kc, vc = cache
        kc[:, :, start:start + T] = k
        vc[:, :, start:start + T] = v
        end = start + T
        rep = self.Hq // self.Hkv
        keys = kc[:, :, :end].repeat_interleave(rep, dim=1)
        vals = vc[:, :, :end].repeat_interleave(rep, dim=1)
        s = (q @ keys.transpose(-1, -2)) / math.sqrt(self.D)
        if T > 1:  # causal within the new tokens
            s = s + torch.full((T, end), float("-inf")).triu(start + 1)
        a = (s.softmax(-1) @ vals).transpose(1, 2).reshape(B, T, self.Hq * self.D)
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
        self.Hkv, self.D = Hkv, D
        inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        self.register_buffer("inv", inv)

    def forward(self, ids, caches, start):
        T = ids.shape[1]
        f = torch.outer(torch.arange(start, start + T, dtype=torch.float32), self.inv)
        emb = torch.cat([f, f], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed(ids)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cos, sin, cache, start)
        return self.lm_head(self.norm(x[:, -1]))  # logits of the last position only

    def generate(self, prompts, new_tokens):
        B, P = prompts.shape
        Tmax = P + new_tokens
        caches = [(torch.empty(B, self.Hkv, Tmax, self.D), torch.empty(B, self.Hkv, Tmax, self.D))
                  for _ in self.layers]
        tok = self(prompts, caches, 0).argmax(-1)
        out = [tok]
        for t in range(1, new_tokens):
            tok = self(tok.view(B, 1), caches, P + t - 1).argmax(-1)
            out.append(tok)
        return torch.stack(out, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", choices=SHAPES)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    V, C, L, Hq, Hkv, D, Fw = SHAPES[a.shape]
    model = Model(V, C, L, Hq, Hkv, D, Fw).eval()
    prompts = (torch.arange(a.batch * a.prompt) * 7919 + 13).remainder(V).view(a.batch, a.prompt)
    times, cpu = [], []
    with torch.no_grad():
        model.generate(prompts, 4)  # warm-up
        for _ in range(a.repeats):
            c0, t0 = time.process_time(), time.perf_counter()
            model.generate(prompts, a.new)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    t, c = statistics.median(times), statistics.median(cpu)
    tok_s = a.batch * a.new / t
    cpu_tok_s = a.batch * a.new / c * a.threads
    print(f"torch {torch.__version__} threads {torch.get_num_threads()}: shape {a.shape} batch {a.batch}: "
          f"{a.new} new tokens after a {a.prompt}-token prompt in {t:.3f} s (median of {a.repeats}), {tok_s:.1f} tok/s; "
          f"{c:.3f} CPU-s, {cpu_tok_s:.1f} tok per CPU-s x {a.threads} threads")
    print(f"RESULT impl=torch shape={a.shape} batch={a.batch} tok_s={tok_s:.2f} cpu_tok_s={cpu_tok_s:.2f}")


if __name__ == "__main__":
    main()
