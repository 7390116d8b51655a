#!/usr/bin/env python3
"""The loops under megatron's tensor, pipeline and context parallelism against one rank, through
`rlhost` under mpirun (ctest grpo.mp.*).

Every rank of a model-parallel group trains on its data-parallel rank's share (the layout comes
from the backend's data_parallel slot, BACKEND 0.3), the group's ranks split each generate call
and all-gather the samples, and sums run over the data-parallel ranks only. A run follows the
one-rank run of the same config: counts and rewards equal, losses and gradient norms within fp32
rounding. Short runs on the demo's random tiny Llama (2 layers, 4 heads, 2 kv heads):

  grpo_tp2          GRPO (8 prompts x 8 samples, 3 steps, validation and a checkpoint at step 2)
                    at TP 2 (np 2); grpo.seed 5 gives every step some reward, so no loss is 0
  grpo_pp2          the same at PP 2 (np 2)
  grpo_cp2          the same at CP 2 (np 2)
  loops             SFT at TP 2, DPO at PP 2 and RM at CP 2 (np 2; 3 steps each, validation at
                    step 2)
  grpo_tp2_dp2_np4  GRPO at TP 2 x DP 2 (np 4) with sequence packing and responses of up to 6
                    tokens follows one rank: two data-parallel groups of two ranks, token
                    balancing over the data-parallel ranks
  ppo_cp2           PPO (the critic a value head on the same backend) at CP 2 (np 2), 3 steps
  reshard_np4       a GRPO checkpoint saved under TP 2 x PP 2 (np 4) resumes at DP 4 and on one
                    rank, and one rank's resumes under TP 2 x PP 2, each continuing as the run it
                    came from (label np4)

usage: test_loops_mp.py CASE RLHOST RLH_TINY_MODEL MPIRUN SOURCE_DIR
"""
import json
import os
import shutil

from loop_runs import RLHOST, SRC, check, close, main, metrics, ppo_command, ppo_setup, run, setup  # noqa: E402

MEGATRON = ["policy.dtensor_cfg.enabled=false", "++policy.megatron_cfg.enabled=true",
            "++policy.megatron_cfg.optimizer.weight_decay=0"]
LAYOUTS = {
    "tp2": ["++policy.megatron_cfg.tensor_model_parallel_size=2"],
    "pp2": ["++policy.megatron_cfg.pipeline_model_parallel_size=2"],
    "cp2": ["++policy.megatron_cfg.context_parallel_size=2"],
    "tp2dp2": ["++policy.megatron_cfg.tensor_model_parallel_size=2",
               "++policy.megatron_cfg.optimizer.use_distributed_optimizer=true"],
    "tp2pp2": ["++policy.megatron_cfg.tensor_model_parallel_size=2",
               "++policy.megatron_cfg.pipeline_model_parallel_size=2"],
    "dp": ["++policy.megatron_cfg.optimizer.use_distributed_optimizer=true"],
    "one": [],
}


def grpo_command(tmp, tag, layout, steps=3):
    cmd = [RLHOST]
    for p in ["environments", "tokenizer_hf", "model_llama", "kernels_cpu", "megatron", "generator", "grpo"]:
        cmd += ["--plugin", p]
    return cmd + ["--config", os.path.join(SRC, "examples/configs/grpo_demo_cpu.yaml"), f"policy.model_name={tmp}/tiny",
                  f"grpo.max_num_steps={steps}", "grpo.seed=5", "grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=8",
                  "grpo.val_period=2", "grpo.max_val_samples=32", "grpo.val_batch_size=32",
                  "checkpointing.save_period=2", "checkpointing.keep_top_k=null",
                  f"checkpointing.checkpoint_dir={tmp}/{tag}/ckpt", f"logger.log_dir={tmp}/{tag}/logs",
                  "++rlhost.comm_timeout_s=20", *MEGATRON, "++policy.megatron_cfg.optimizer.lr=1e-3",
                  *LAYOUTS[layout]]


GRPO_EQUAL = ("train/reward", "train/num_tokens", "train/total_num_tokens", "validation/accuracy",
              "validation/avg_length")
GRPO_NEAR = ("train/loss", "train/grad_norm", "train/actor_loss", "train/approx_entropy")


def compare(one, other, steps, what, equal=GRPO_EQUAL, near=GRPO_NEAR):
    """Counts and rewards equal one rank's, losses within fp32 rounding; returns how many nonzero
    losses were compared (a run whose losses are all 0 compares nothing)."""
    live = 0
    for s in steps:
        a, b = one.get(s, {}), other.get(s, {})
        check("train/loss" in a and "train/loss" in b, f"{what}: step {s} has train/loss in both runs")
        for k in equal:
            if k in a:
                check(a[k] == b.get(k), f"{what}: step {s} {k} {b.get(k)} equals one rank's {a[k]}")
        for k in near:
            if k in a:
                check(k in b and close(b[k], a[k]), f"{what}: step {s} {k} {b.get(k)} is within fp32 rounding of "
                                                    f"one rank's {a[k]}")
        live += a.get("train/loss", 0) != 0
    return live


PACKING = ["grpo.seed=6", "policy.generation.max_new_tokens=6", "++policy.sequence_packing.enabled=true",
           "++policy.sequence_packing.train_mb_tokens=64", "++policy.sequence_packing.logprob_mb_tokens=64"]


def case_grpo(tmp, layout, np=2, dp=1, extra=()):
    """GRPO under `layout` on `np` ranks (`dp` data-parallel ranks of model-parallel groups)
    follows one rank: the data-parallel ranks gather each step's batch, so advantages group equal
    prompts over the whole batch as one rank does."""
    setup(tmp)
    rc, out, _ = run(grpo_command(tmp, "one", "one") + list(extra), np=1)
    check(rc == 0, f"grpo: one rank runs (rc {rc})", out)
    rc, out, _ = run(grpo_command(tmp, layout, layout) + list(extra), np=np)
    check(rc == 0, f"grpo {layout}: {np} ranks run (rc {rc})", out)
    if rc != 0:
        return
    check(f"{dp} data-parallel rank{'s' if dp > 1 else ''}, model-parallel groups of 2" in out,
          f"grpo {layout}: the loop reports {dp} data-parallel rank(s), model-parallel groups of 2", out)
    check("split every generate call" in out, f"grpo {layout}: the group's ranks split generation", out)
    one, other = metrics(tmp, "one"), metrics(tmp, layout)
    live = compare(one, other, range(1, 4), f"grpo {layout}")
    if dp > 1:  # the data-parallel ranks' tokens (balanced) add up to the batch's, counted once
        for s in range(1, 4):
            m = other.get(s, {})
            check(m.get("train/dp_tokens_max", 0) + m.get("train/dp_tokens_min", 0) == m.get("train/total_num_tokens"),
                  f"grpo {layout}: step {s} the two data-parallel ranks' tokens add up to the batch's", json.dumps(m))
    check(live == 3, f"grpo {layout}: every step has a nonzero loss to compare ({live})")
    check(sorted(os.listdir(f"{tmp}/{layout}/ckpt")) == ["step_2", "step_3"],
          f"grpo {layout}: world rank 0 committed step_2 and the last step_3")
    print(f"grpo {layout}: followed one rank for 3 steps (losses {[other[s]['train/loss'] for s in range(1, 4)]}, "
          f"rewards {[other[s]['train/reward'] for s in range(1, 4)]})")


def write_pairs(path, n, seed):
    """Synthetic preferences (preference_fixture.hpp's): "abc=" prefers "a" to another digit."""
    mask = (1 << 64) - 1

    def nxt():
        nonlocal seed
        seed = (seed * 6364136223846793005 + 1442695040888963407) & mask
        return (seed >> 33) % 10
    with open(path, "w") as f:
        for _ in range(n):
            a, b, c = nxt(), nxt(), nxt()
            r = nxt()
            if r == a:
                r = (r + 1 + nxt() % 9) % 10
            f.write(json.dumps({"prompt": f"{a}{b}{c}=", "chosen": str(a), "rejected": str(r)}) + "\n")


LOOPS = {
    "sft": ("sft_demo_cpu.yaml",
            ["sft.max_num_steps=3", "sft.val_period=2", "sft.val_global_batch_size=64",
             "policy.train_global_batch_size=64", "policy.train_micro_batch_size=16"],
            ("train/num_tokens", "train/num_unmasked_tokens", "train/num_valid_samples"),
            ("train/loss", "train/grad_norm", "validation/val_loss")),
    "dpo": ("dpo_demo_cpu.yaml",
            ["dpo.max_num_steps=3", "dpo.val_period=2", "dpo.val_global_batch_size=32", "dpo.val_micro_batch_size=8",
             "policy.train_global_batch_size=16", "policy.train_micro_batch_size=4"],
            ("train/num_tokens", "train/num_valid_samples", "validation-default/num_valid_samples"),
            ("train/loss", "train/grad_norm", "train/preference_loss", "train/rewards_chosen_mean",
             "train/rewards_rejected_mean", "validation-default/loss", "validation-default/rewards_chosen_mean",
             "validation-default/rewards_rejected_mean")),
    "rm": ("rm_demo_cpu.yaml",
           ["rm.max_num_steps=3", "rm.val_period=2", "rm.val_global_batch_size=32", "rm.val_micro_batch_size=8",
            "policy.train_global_batch_size=16", "policy.train_micro_batch_size=4"],
           ("train/num_tokens", "train/num_valid_samples", "validation-default/num_valid_samples"),
           ("train/loss", "train/grad_norm", "train/accuracy", "train/rewards_chosen_mean",
            "train/rewards_rejected_mean", "validation-default/loss", "validation-default/accuracy")),
}


def loop_command(tmp, algo, tag, layout):
    cfg, overrides, _, _ = LOOPS[algo]
    cmd = [RLHOST]
    for p in ["environments", "tokenizer_hf", "model_llama", "kernels_cpu", "megatron", "dataset_jsonl", algo]:
        cmd += ["--plugin", p]
    cmd += ["--config", os.path.join(SRC, "examples/configs", cfg), f"policy.model_name={tmp}/tiny",
            f"logger.log_dir={tmp}/{tag}/logs", f"checkpointing.checkpoint_dir={tmp}/{tag}/ckpt",
            "checkpointing.save_period=2", "checkpointing.keep_top_k=null", "++rlhost.comm_timeout_s=20",
            *overrides, *MEGATRON, "++policy.megatron_cfg.optimizer.lr=3e-3", *LAYOUTS[layout]]
    if algo != "sft":
        cmd += [f"data.train.data_path={tmp}/train.jsonl", f"data.validation.data_path={tmp}/val.jsonl"]
    return cmd


def case_loops(tmp):
    """SFT at TP 2, DPO at PP 2 and RM (a value head) at CP 2 follow one rank."""
    setup(tmp)
    write_pairs(f"{tmp}/train.jsonl", 128, 11)
    write_pairs(f"{tmp}/val.jsonl", 40, 12)
    for algo, layout in (("sft", "tp2"), ("dpo", "pp2"), ("rm", "cp2")):
        _, _, equal, near = LOOPS[algo]
        rc, out, _ = run(loop_command(tmp, algo, f"{algo}_one", "one"))
        check(rc == 0, f"{algo}: one rank runs (rc {rc})", out)
        rc, out, _ = run(loop_command(tmp, algo, f"{algo}_{layout}", layout), np=2)
        check(rc == 0, f"{algo} {layout}: two ranks run (rc {rc})", out)
        if rc != 0:
            continue
        one, other = metrics(tmp, f"{algo}_one"), metrics(tmp, f"{algo}_{layout}")
        live = compare(one, other, range(1, 4), f"{algo} {layout}", equal, near)
        check(live == 3, f"{algo} {layout}: every step has a nonzero loss ({live})")
        check("validation/val_loss" in other[2] or "validation-default/loss" in other[2],
              f"{algo} {layout}: validation ran at step 2")
        check(sorted(os.listdir(f"{tmp}/{algo}_{layout}/ckpt")) == ["step_2", "step_3"],
              f"{algo} {layout}: world rank 0 committed step_2 and the last step_3")
        print(f"{algo} {layout}: followed one rank for 3 steps (losses "
              f"{[round(other[s]['train/loss'], 6) for s in range(1, 4)]})")


def case_ppo_cp2(tmp):
    """PPO (policy and critic, a value head, on one backend) at CP 2 follows one rank: 3 steps of
    its demo task, every logged figure within 1e-5 relative (the critic's within 1e-3, as at
    DP 2: AdamW at the critic's lr magnifies rounding in near-zero gradients)."""
    ppo_setup(tmp, 256, 32)

    def ppo(tag, layout):
        return ppo_command(tmp, tag, ["environments", "tokenizer_hf", "model_llama", "kernels_cpu", "megatron", "generator"],
                           "ppo.max_num_steps=3", "ppo.val_period=2", "checkpointing.enabled=false",
                           "++rlhost.comm_timeout_s=20", *MEGATRON, *LAYOUTS[layout])
    rc, out, _ = run(ppo("one", "one"))
    check(rc == 0, f"ppo: one rank runs (rc {rc})", out)
    rc, out, _ = run(ppo("cp2", "cp2"), np=2)
    check(rc == 0, f"ppo cp2: two ranks run (rc {rc})", out)
    if rc != 0:
        return
    one, two = metrics(tmp, "one"), metrics(tmp, "cp2")
    n = 0
    for s in range(0, 4):
        for k, a in one.get(s, {}).items():
            if (k.startswith(("timing", "rlhost")) or "memory" in k or "comm" in k or "dp_size" in k
                    or "cp_size" in k or "num_micro_batches" in k or k == "step"):
                continue
            b = two.get(s, {}).get(k)
            n += 1
            rel = 1e-3 if k.startswith("train/critic/") else 1e-5
            check(b is not None and close(b, a, rel=rel), f"ppo cp2: step {s} {k} {b} follows one rank's {a}")
    check(n > 50 and any(k.startswith("train/critic/") for k in one.get(1, {})),
          f"ppo cp2: the policy's and the critic's figures were compared ({n})")
    print(f"ppo cp2: followed one rank for 3 steps ({n} figures)")


def case_reshard(tmp):
    """Checkpoints reshard between layouts: TP 2 x PP 2's step_2 continues at DP 4 and on one
    rank as the TP 2 x PP 2 run did; one rank's step_2 continues under TP 2 x PP 2 as one rank did."""
    setup(tmp)
    rc, out, _ = run(grpo_command(tmp, "tp2pp2", "tp2pp2"), np=4)
    check(rc == 0, f"TP 2 x PP 2 runs (rc {rc})", out)
    rc1, out1, _ = run(grpo_command(tmp, "one", "one"))
    check(rc1 == 0, f"one rank runs (rc {rc1})", out1)
    if rc != 0 or rc1 != 0:
        return
    check(compare(metrics(tmp, "one"), metrics(tmp, "tp2pp2"), range(1, 4), "TP 2 x PP 2") == 3,
          "TP 2 x PP 2: every step has a nonzero loss")
    for src, dst, layout, np in (("tp2pp2", "at_dp4", "dp", 4), ("tp2pp2", "at_one", "one", 1),
                                 ("one", "at_tp2pp2", "tp2pp2", 4)):
        os.makedirs(f"{tmp}/{dst}/ckpt")
        shutil.copytree(f"{tmp}/{src}/ckpt/step_2", f"{tmp}/{dst}/ckpt/step_2")
        rc, out, _ = run(grpo_command(tmp, dst, layout), np=np)
        check(rc == 0, f"{src}'s step_2 resumes as {dst} (rc {rc})", out)
        check("resumed from" in out and "step_2" in out, f"{dst}: the log says it resumed from step_2", out)
        if rc == 0:
            a, b = metrics(tmp, src), metrics(tmp, dst)
            check(sorted(b) == [3], f"{dst}: only step 3 ran ({sorted(b)})")
            check(compare(a, b, [3], f"{src}'s step_2 resumed as {dst}") == 1, f"{dst}: step 3's loss is nonzero")
            print(f"{src} step_2 -> {dst}: step 3 loss {b.get(3, {}).get('train/loss')} "
                  f"(the {src} run's {a[3]['train/loss']})")


CASES = {
    "grpo_tp2": lambda t: case_grpo(t, "tp2"),
    "grpo_pp2": lambda t: case_grpo(t, "pp2"),
    "grpo_cp2": lambda t: case_grpo(t, "cp2"),
    "grpo_tp2_dp2_np4": lambda t: case_grpo(t, "tp2dp2", np=4, dp=2, extra=PACKING),
    "loops": case_loops,
    "ppo_cp2": case_ppo_cp2,
    "reshard_np4": case_reshard,
}

if __name__ == "__main__":
    main(CASES, "rlh_loops_mp_")
