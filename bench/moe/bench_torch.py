#!/usr/bin/python3
"""The peer for bench_moe: the same Mixtral-style MoE model, batch and step in PyTorch (fp32, CPU).

The MoE block is Hugging Face's eager path (MixtralSparseMoeBlock): router softmax in float32,
top-2, renormalised, then a Python loop over the experts that got tokens, each gathering its
tokens, running its SwiGLU MLP and index_add_-ing the weighted result back.
Training step = forward, mean next-token NLL, backward, clip_grad_norm_(1.0), AdamW step.

    OPENBLAS_CORETYPE=SkylakeX OMP_NUM_THREADS=2 /usr/bin/python3 bench_torch.py --threads 2
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

V, C, L, HQ, HKV, D, E, K, FE, B, T = 4096, 256, 4, 8, 4, 32, 16, 2, 256, 16, 128


class Expert(torch.nn.Module):  # Mixtral's w1 (gate), w3 (up), w2 (down)
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(C, FE, bias=False)
        self.w3 = torch.nn.Linear(C, FE, bias=False)
        self.w2 = torch.nn.Linear(FE, C, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoeBlock(torch.nn.Module):
    """transformers' MixtralSparseMoeBlock.forward (eager), without jitter or aux-loss outputs."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(C, E, bias=False)
        self.experts = torch.nn.ModuleList([Expert() for _ in range(E)])

    def forward(self, hidden_states):
        b, t, d = hidden_states.shape
        hidden_states = hidden_states.view(-1, d)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, K, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros((b * t, d), dtype=hidden_states.dtype)
        expert_mask = F.one_hot(selected_experts, num_classes=E).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            e = int(expert_idx)
            idx, top_x = torch.where(expert_mask[e])
            current_state = hidden_states[None, top_x].reshape(-1, d)
            current = self.experts[e](current_state) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(hidden_states.dtype))
        return final.reshape(b, t, d)


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(C), RMSNorm(C)
        self.q = torch.nn.Linear(C, HQ * D, bias=False)
        self.k = torch.nn.Linear(C, HKV * D, bias=False)
        self.v = torch.nn.Linear(C, HKV * D, bias=False)
        self.o = torch.nn.Linear(HQ * D, C, bias=False)
        self.moe = SparseMoeBlock()

    def forward(self, x, cos, sin, mask):
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, HQ, D).transpose(1, 2)
        k = self.k(h).view(b, t, HKV, D).transpose(1, 2)
        v = self.v(h).view(b, t, HKV, D).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(HQ // HKV, dim=1)
        v = v.repeat_interleave(HQ // HKV, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D) + mask
        a = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, HQ * D)
        x = x + self.o(a)
        return x + self.moe(self.mlp_norm(x))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(V, C)
        self.layers = torch.nn.ModuleList([Layer() for _ in range(L)])
        self.norm = RMSNorm(C)
        self.lm_head = torch.nn.Linear(C, V, bias=False)

    def forward(self, ids):
        cos, sin = rope_tables(ids.shape[1], D)
        mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.norm(x))


def token_logprobs(logits, ids):
    lp = logits[:, :-1].log_softmax(-1)
    return lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print("torch", torch.__version__, "threads", torch.get_num_threads())
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    ids = (torch.arange(B * T) * 7919 + 13).remainder(V).view(B, T)

    def train_step():
        opt.zero_grad(set_to_none=True)
        loss = -token_logprobs(model(ids), ids).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    for _ in range(a.warmup):
        train_step()
    train_times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = train_step()
        train_times.append(time.perf_counter() - t0)
    fwd_times = []
    with torch.no_grad():
        token_logprobs(model(ids), ids)
        for _ in range(a.steps):
            t0 = time.perf_counter()
            token_logprobs(model(ids), ids)
            fwd_times.append(time.perf_counter() - t0)
    train_s, fwd_s = statistics.median(train_times), statistics.median(fwd_times)
    n = B * T
    print(f"MoE {E} experts top-{K}: loss {loss:.4f}; train step median {train_s:.3f} s, "
          f"{n / train_s:.0f} tok/s; forward logprobs median {fwd_s:.3f} s, {n / fwd_s:.0f} tok/s")
    print(f"RESULT impl=torch shape=moe train_tok_s={n / train_s:.1f} fwd_tok_s={n / fwd_s:.1f}")


if __name__ == "__main__":
    main()
