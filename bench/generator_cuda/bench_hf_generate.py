#!/usr/bin/env python3
"""Hugging Face generate, the peer of bench_generator_cuda on the same GPU and shapes:
   RESULT impl=hf name=<b1|b64|b256|grpo> tok_s=<new tokens/s> sec=<median>

LlamaForCausalLM at Llama-3.2-1B's shape (or 3B's, 3.1-8B's, `small`), random weights in bf16
on the GPU, SDPA attention, KV cache (transformers' default dynamic cache). The batch cases decode greedily,
exactly `new` new tokens (min_new_tokens = max_new_tokens, no EOS); grpo samples 8 sequences per
prompt at temperature 1 (num_return_sequences, top_k and top_p off), as a TRL-like GRPO rollout
does. Timing: one warm-up call, then the median of the timed calls, each synchronised."""
import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--shape", default="llama1b")
p.add_argument("--case", default="all")
p.add_argument("--prompt", type=int, default=128)
p.add_argument("--new", type=int, default=256)
p.add_argument("--repeats", type=int, default=1)
args = p.parse_args()

SHAPES = {  # V, C, L, Hq, Hkv, D, F, tied
    "llama1b": (128256, 2048, 16, 32, 8, 64, 8192, True),
    "llama3b": (128256, 3072, 28, 24, 8, 128, 8192, True),
    "llama8b": (128256, 4096, 32, 32, 8, 128, 14336, False),
    "small": (32000, 1024, 4, 16, 4, 64, 4096, True),
}
CASES = [("b1", 1, 1), ("b64", 64, 1), ("b256", 256, 1), ("grpo", 64, 8)]
V, C, L, Hq, Hkv, D, FF, tied = SHAPES[args.shape]
cfg = LlamaConfig(vocab_size=V, hidden_size=C, intermediate_size=FF, num_hidden_layers=L,
                  num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=D,
                  max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                  tie_word_embeddings=tied, attn_implementation="sdpa")
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
model.eval()
gc = model.generation_config
gc.eos_token_id = None
gc.pad_token_id = 0
gc.bos_token_id = None
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


for name, prompts, samples in CASES:
    if args.case != "all" and name not in args.case.split(","):
        continue
    ids = torch.randint(0, V, (prompts, args.prompt), device="cuda")
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, attention_mask=mask)
    if samples > 1:
        kw.update(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=samples)
    else:
        kw.update(do_sample=False)

    def run():
        with torch.no_grad():
            out = model.generate(ids, **kw)
        torch.cuda.synchronize()
        return out

    out = run()  # warm-up
    assert out.shape == (prompts * samples, args.prompt + args.new), out.shape
    secs = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        run()
        secs.append(time.perf_counter() - t0)
    t = median(secs)
    tokens = prompts * samples * args.new
    print(f"hf {name}: {prompts} prompts x {samples} samples, {tokens / t:.0f} tok/s ({t:.2f} s), peak mem "
          f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    print(f"RESULT impl=hf name={name} shape={args.shape} tok_s={tokens / t:.1f} sec={t:.4f}", flush=True)
    torch.cuda.empty_cache()
