#!/usr/bin/env python3
"""PyTorch peers of bench_cuda_engine on the same GPU and shapes (HF transformers Llama; for the
MoE shapes qwen3moe / moesmall, Qwen3MoeForCausalLM with HF's own sparse MoE block, run eagerly:
experts_implementation "eager" where transformers has that switch, i.e. its loop over the
experts that got tokens; --experts picks another of its implementations):
   RESULT impl=torch name=<train|forward> mode=<eager|compile> shape=<...> value=<tok/s> unit=tok/s ms=<median>

train:   fp32 master weights, bf16 autocast, SDPA attention, fused AdamW(lr 1e-5, wd 0.01),
         clip_grad_norm_(1.0), loss = mean token cross-entropy; B4 x T2048 (the issue's setup:
         "fwd+bwd+AdamW, fp32 master").
forward: logprobs of the next tokens, bf16 weights, no_grad, B8 x T2048 (log_softmax over the
         [T, V] logits, then gather: what HF-based RL code does).
Timing: 2 warm-up steps (torch.compile: its compilation happens there), then the median of the
timed steps, each synchronised."""
import argparse
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--shape", default="llama1b")
p.add_argument("--steps", type=int, default=10)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--only", default="")
p.add_argument("--compile", action="store_true", help="torch.compile the model with its loss (train only)")
p.add_argument("--experts", default="eager",
               help="MoE shapes: transformers' experts_implementation (eager = HF's loop)")
args = p.parse_args()

SHAPES = {  # V, C, L, Hq, Hkv, D, F, tied, train_B, fwd_B, T, (E, K, Fe for MoE)
    "llama1b": (128256, 2048, 16, 32, 8, 64, 8192, True, 4, 8, 2048, None),
    "small": (32000, 1024, 4, 16, 4, 64, 4096, True, 2, 4, 1024, None),
    "qwen3moe": (32000, 1024, 12, 16, 4, 64, 3072, False, 4, 8, 2048, (64, 8, 512)),
    "moesmall": (32000, 512, 2, 8, 4, 64, 1536, False, 2, 4, 1024, (16, 4, 256)),
}
V, C, L, Hq, Hkv, D, FF, tied, TB, FB, T, moe = SHAPES[args.shape]
if moe is None:
    Model = LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=V, hidden_size=C, intermediate_size=FF, num_hidden_layers=L,
                      num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=D,
                      max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                      tie_word_embeddings=tied, attn_implementation="sdpa")
else:  # the shapes of bench_cuda_engine's qwen3moe / moesmall: every layer routed
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    Model = Qwen3MoeForCausalLM
    E, K, Fe = moe
    cfg = Qwen3MoeConfig(vocab_size=V, hidden_size=C, intermediate_size=FF,
                         moe_intermediate_size=Fe, num_experts=E, num_experts_per_tok=K,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                         num_hidden_layers=L, num_attention_heads=Hq, num_key_value_heads=Hkv,
                         head_dim=D, max_position_embeddings=131072, rms_norm_eps=1e-6,
                         rope_theta=1000000.0, tie_word_embeddings=tied,
                         output_router_logits=False, attn_implementation="sdpa",
                         experts_implementation=args.experts)
    # transformers 5 keeps the choice as (_)experts_implementation; older ones ignore the key
    # and run their one MoE block (also a loop over the experts that got tokens)
    used = getattr(cfg, "_experts_implementation", None) or getattr(cfg, "experts_implementation", "n/a")
    print(f"torch {torch.__version__}, Qwen3MoeForCausalLM, experts implementation {used}", flush=True)
dev = "cuda"
torch.manual_seed(0)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def batch(B):
    return torch.randint(0, V, (B, T), device=dev)


def timed(fn, steps, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return median(out)


mode = "compile" if args.compile else "eager"
if moe is not None and args.experts != "eager":
    mode += "+" + args.experts  # a row apart from HF's eager experts loop
if not args.only or args.only == "train":
    with torch.device(dev):  # initialised on the GPU (seconds, not a minute of CPU init)
        model = Model(cfg)  # fp32 master weights
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=True)
    ids = batch(TB)

    # The model and its loss in one function: torch.compile then fuses the head's cast, the
    # log-softmax and the loss into the graph (the strongest compiled peer; compiling the model
    # alone and computing the loss outside, as this script did before, is ~10% slower).
    def loss_of(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, V), ids[:, 1:].reshape(-1))

    fwd = torch.compile(loss_of) if args.compile else loss_of

    def step():
        loss = fwd(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    t = timed(step, args.steps, args.warmup)
    n = TB * T
    print(f"torch train ({mode}): {t * 1e3:.1f} ms/step, {n / t:.0f} tok/s, peak mem "
          f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    print(f"RESULT impl=torch name=train mode={mode} shape={args.shape}_B{TB}xT{T} value={n / t:.0f} unit=tok/s ms={t * 1e3:.3f}", flush=True)
    del model, fwd, opt
    torch.cuda.empty_cache()

if (not args.only or args.only == "forward") and not args.compile:
    with torch.device(dev):
        model = Model(cfg).to(dtype=torch.bfloat16).eval()
    ids = batch(FB)

    @torch.no_grad()
    def fwd_lp():
        logits = model(input_ids=ids).logits
        lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        return lp.gather(-1, ids[:, 1:, None])

    t = timed(fwd_lp, args.steps, args.warmup)
    n = FB * T
    print(f"torch forward logprobs ({mode}): {t * 1e3:.1f} ms, {n / t:.0f} tok/s", flush=True)
    print(f"RESULT impl=torch name=forward mode={mode} shape={args.shape}_B{FB}xT{T} value={n / t:.0f} unit=tok/s ms={t * 1e3:.3f}", flush=True)
