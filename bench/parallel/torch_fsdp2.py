"""The PyTorch peer of bench_parallel --device cuda: the same Llama shape trained with FSDP2 (or DDP)
on the same GPUs, torchrun-launched, so rlhost's data-parallel step is measured beside it.

    torchrun --nproc_per_node N torch_fsdp2.py --model DIR [--mode fsdp|ddp] [--seqs 16] [--len 2048]
                                               [--mb-seqs 2] [--steps 5] [--warmup 1] [--compile]

--seqs is a multiple of N (no rank without data). The model is Hugging Face's LlamaForCausalLM built from DIR/config.json with random weights (the
values change no work), fp32 master weights, sdpa attention. FSDP2 as torchtitan applies it: one
fully_shard per decoder layer and one for the root, MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32), reshard_after_forward=True; DDP wraps a bf16-autocast model. AdamW (fused),
loss = mean next-token cross-entropy over the global batch (HF's loss inside the model, each
micro-batch scaled by its share of the rank's tokens). The global batch is --seqs sequences of
--len random tokens, each rank training on its --seqs / N in micro-batches of --mb-seqs, as
bench_parallel does. --compile compiles each decoder layer (torch.compile), the strongest eager
alternative.

Prints, on rank 0, one line like bench_parallel's:
    RESULT impl=torch mode=fsdp ranks=N params=.. micro_batches=.. step_s=.. tok_s=.. tok_s_per_gpu=.. peak_gib=..
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--mode", choices=["fsdp", "ddp"], default="fsdp")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--len", type=int, default=2048)
    p.add_argument("--mb-seqs", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--compile", action="store_true")
    return p.parse_args()


def build(model_dir, device):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    # fp32 masters on the GPU (the whole model for the moment it is built: 4 bytes a parameter,
    # sharded right after), random values drawn there.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    return model, cfg


def main():
    a = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.seqs % world:
        raise SystemExit(f"torch_fsdp2: --seqs {a.seqs} is not a multiple of the {world} ranks")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    torch.manual_seed(7)
    model, cfg = build(a.model, device)
    params = sum(p.numel() for p in model.parameters())
    layers = model.model.layers
    if a.compile:
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer)
    if a.mode == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in layers:
            fully_shard(layer, mp_policy=mp, reshard_after_forward=True)
        fully_shard(model, mp_policy=mp)
        train_model = model
    else:
        from torch.nn.parallel import DistributedDataParallel

        train_model = DistributedDataParallel(model, device_ids=[local])
    try:  # fused where this torch takes DTensor parameters for it, else foreach
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    # This rank's share of the global batch, in micro-batches.
    s0, s1 = a.seqs * rank // world, a.seqs * (rank + 1) // world
    g = torch.Generator(device="cpu").manual_seed(11)
    ids = torch.randint(0, cfg.vocab_size, (a.seqs, a.len), generator=g)[s0:s1].to(device)
    mbs = [ids[i : i + a.mb_seqs] for i in range(0, ids.shape[0], a.mb_seqs)]
    # every rank runs as many micro-batches as the rank with most (FSDP's collectives meet)
    most = torch.tensor([len(mbs)], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    mine_tokens = sum(m.numel() for m in mbs)

    def step():
        for k in range(int(most.item())):
            mb = mbs[k] if k < len(mbs) else ids[:1, :]
            weight = mb.numel() / max(mine_tokens, 1) if k < len(mbs) else 0.0
            if a.mode == "ddp":
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = train_model(input_ids=mb, labels=mb).loss
            else:
                loss = train_model(input_ids=mb, labels=mb).loss
            (loss * weight).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    for s in range(a.warmup + a.steps):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if s >= a.warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    step_s = times[len(times) // 2]
    tok_s = a.seqs * a.len / step_s
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    if rank == 0:
        print(
            f"RESULT impl=torch mode={a.mode}{'+compile' if a.compile else ''} ranks={world} params={params} "
            f"micro_batches={int(most.item())} step_s={step_s:.4f} tok_s={tok_s:.1f} tok_s_per_gpu={tok_s / world:.1f} "
            f"peak_gib={peak:.2f}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
