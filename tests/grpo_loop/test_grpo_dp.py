#!/usr/bin/env python3
"""GRPO, PPO, SFT, DPO and RM at data-parallel size 2 against one rank, through `rlhost` under mpirun
(ctest grpo.dp.*).

The demo's GRPO stage (examples/configs/grpo_demo_cpu.yaml) on a random tiny Llama, 6 steps of 8
prompts x 8 samples, validation and checkpoints every 3 steps:

  follows_dtensor   dtensor FSDP at DP=2: every step's reward, validation accuracy and token
                    count equal one rank's, loss and gradient norm within fp32 rounding; the
                    per-rank training state is half of one rank's (train/memory/state_bytes)
  follows_megatron  the same with megatron's distributed optimizer
  resume_at_one     the DP=2 run's step_3 checkpoint resumes on one rank and continues as the
                    DP=2 run did (steps 4-6)
  killed_rank       rank 1 is killed mid-run: the job stops non-zero within the timeout and the
                    last committed checkpoint resumes on one rank
  balanced_tokens   sequence packing at DP=2: the ranks' tokens are balanced (never above the
                    plain shards' largest, lower on some step) and the run follows one rank
  loops_dtensor     SFT, DPO and RM (their demo configs, 6 steps) at DP=2 under dtensor FSDP:
                    token and sample counts equal one rank's, losses, gradient norms, the loss's
                    metrics and the validation figures within fp32 rounding; rank 0 commits
                    the checkpoints
  loops_megatron    the same with megatron's distributed optimizer
  loops_resume      each loop's DP=2 step_3 resumes on one rank, and one rank's at DP=2, and
                    continues as the run it came from (steps 4-6)
  ppo_follows       PPO at DP=2 follows one rank (the critic sharded like the policy, GAE's
                    whitening over the gathered batch); a value batch size other than the
                    policy's is refused with one line

usage: test_grpo_dp.py CASE RLHOST RLH_TINY_MODEL MPIRUN SOURCE_DIR
"""
import json
import os
import re
import shutil
import signal
import subprocess
import time

from loop_runs import MPIRUN, MPI_ENV, RLHOST, SRC, check, close, compare, main, metrics, ppo_command, ppo_setup, run, setup  # noqa: E402

PLUGINS = ["environments", "tokenizer_hf", "model_llama", "kernels_cpu", "dtensor", "megatron", "generator", "grpo"]


def command(tmp, tag, backend, steps=6, extra=()):
    cmd = [RLHOST]
    for p in PLUGINS:
        cmd += ["--plugin", p]
    cmd += ["--config", os.path.join(SRC, "examples/configs/grpo_demo_cpu.yaml"),
            f"policy.model_name={tmp}/tiny", f"grpo.max_num_steps={steps}", "grpo.num_prompts_per_step=8",
            "grpo.num_generations_per_prompt=8", "grpo.val_period=3", "grpo.max_val_samples=64",
            "grpo.val_batch_size=64", "checkpointing.save_period=3", "checkpointing.keep_top_k=null",
            f"checkpointing.checkpoint_dir={tmp}/{tag}/ckpt", f"logger.log_dir={tmp}/{tag}/logs",
            "++rlhost.comm_timeout_s=10"]
    if backend == "megatron":
        cmd += ["policy.dtensor_cfg.enabled=false", "++policy.megatron_cfg.enabled=true",
                "++policy.megatron_cfg.optimizer.lr=1e-3", "++policy.megatron_cfg.optimizer.weight_decay=0",
                "++policy.megatron_cfg.optimizer.use_distributed_optimizer=true"]
    return cmd + list(extra)


def case_follows(tmp, backend):
    setup(tmp)
    rc, out, _ = run(command(tmp, "one", backend))
    check(rc == 0, f"{backend}: one rank runs (rc {rc})", out)
    rc, out, secs = run(command(tmp, "two", backend), np=2)
    check(rc == 0, f"{backend}: two ranks run (rc {rc})", out)
    if rc != 0:
        return
    check("data parallel over 2 ranks" in out, f"{backend}: the backend reports data parallelism over 2 ranks", out)
    one, two = metrics(tmp, "one"), metrics(tmp, "two")
    compare(one, two, range(1, 7), backend)
    s1, s2 = one[1]["train/memory/state_bytes"], two[1]["train/memory/state_bytes"]
    if backend == "dtensor":
        check(abs(s2 / s1 - 0.5) < 0.01, f"dtensor FSDP: per-rank training state {s2:.0f} B is half of one rank's {s1:.0f} B")
    else:
        check(abs(s2 / s1 - (2 + 3 / 2) / 4) < 0.01,
              f"megatron distributed optimizer: per-rank training state {s2:.0f} B is (2 + 3/2)/4 of one rank's {s1:.0f} B")
    check(two[1]["train/dp_size"] == 2, "the train step reports dp_size 2")
    print(f"{backend}: DP=2 followed one rank for 6 steps (rewards {[two[s]['train/reward'] for s in range(1, 7)]}); "
          f"state per rank {s2 / s1:.3f} of one rank's; DP=2 run took {secs:.1f} s")


def case_balanced_tokens(tmp):
    """Sequence packing at DP=2: the ranks balance their tokens (longest first to the least-loaded
    rank) and still follow one rank. Responses of up to 12 tokens at temperature 2 from a random
    model have uneven lengths. Two steps: later, generation at DP=2 draws differently from one rank
    also without balancing (see the closing note)."""
    setup(tmp)
    extra = ["policy.generation.max_new_tokens=12", "++policy.sequence_packing.enabled=true",
             "++policy.sequence_packing.train_mb_tokens=64", "++policy.sequence_packing.logprob_mb_tokens=64"]
    rc, out, _ = run(command(tmp, "one", "dtensor", steps=2, extra=extra))
    check(rc == 0, f"packing: one rank runs (rc {rc})", out)
    rc, out, _ = run(command(tmp, "two", "dtensor", steps=2, extra=extra), np=2)
    check(rc == 0, f"packing: two ranks run (rc {rc})", out)
    if rc != 0:
        return
    one, two = metrics(tmp, "one"), metrics(tmp, "two")
    compare(one, two, range(1, 3), "balanced")
    lowered = 0
    for s in (1, 2):
        m = two[s]
        hi, lo = m["train/dp_tokens_max"], m["train/dp_tokens_min"]
        phi, plo = m["train/dp_tokens_max_unbalanced"], m["train/dp_tokens_min_unbalanced"]
        check(hi + lo == m["train/total_num_tokens"] and phi + plo == m["train/total_num_tokens"],
              f"step {s}: the two ranks' tokens {hi} + {lo} (plain {phi} + {plo}) add up to the batch's")
        check(hi <= phi, f"step {s}: balancing does not raise the largest rank's tokens ({hi} vs plain {phi})")
        lowered += hi < phi
        print(f"step {s}: tokens per rank {lo:.0f}..{hi:.0f} balanced, {plo:.0f}..{phi:.0f} plain")
    check(lowered > 0, "balancing lowers the largest rank's tokens on some step")


def case_resume_at_one(tmp):
    setup(tmp)
    rc, out, _ = run(command(tmp, "two", "dtensor"), np=2)
    check(rc == 0, f"two ranks run (rc {rc})", out)
    if rc != 0:
        return
    # One rank resumes from the DP=2 run's step 3 (later checkpoints removed).
    os.makedirs(f"{tmp}/one/ckpt")
    shutil.copytree(f"{tmp}/two/ckpt/step_3", f"{tmp}/one/ckpt/step_3")
    rc, out, _ = run(command(tmp, "one", "dtensor"))
    check(rc == 0, f"one rank resumes the DP=2 checkpoint (rc {rc})", out)
    check("resumed from" in out and "step_3" in out, "the log says it resumed from step_3", out)
    if rc == 0:
        compare(metrics(tmp, "two"), metrics(tmp, "one"), range(4, 7), "resumed at one rank")


def case_killed_rank(tmp):
    setup(tmp)
    cmd = command(tmp, "two", "dtensor", steps=100000)
    full = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", "2", *cmd]
    p = subprocess.Popen(full, env=dict(os.environ, **MPI_ENV), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    # Wait for a committed checkpoint, then kill rank 1 mid-run.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not os.path.isdir(f"{tmp}/two/ckpt/step_6"):
        time.sleep(0.05)
    victim = None
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                exe = f.read().split(b"\0")[0]
        except OSError:
            continue
        if b"OMPI_COMM_WORLD_RANK=1" in env and exe.endswith(b"rlhost") and f"{tmp}/two".encode() in open(
                f"/proc/{pid}/cmdline", "rb").read():
            victim = int(pid)
    check(victim is not None, "found rank 1's process")
    t0 = time.monotonic()
    if victim is not None:
        os.kill(victim, signal.SIGKILL)
    try:
        out, _ = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        check(False, "the job stops within 60 s of the kill", out)
    secs = time.monotonic() - t0
    check(p.returncode != 0, f"the job exits non-zero (got {p.returncode})", out)
    check(secs < 30, f"the job stops within the 10 s timeout plus start-up ({secs:.1f} s)", out)
    # The last committed checkpoint resumes on one rank and trains a step.
    done = sorted(int(d[5:]) for d in os.listdir(f"{tmp}/two/ckpt") if d.startswith("step_"))
    check(len(done) > 0, "a committed checkpoint remains", out)
    if done:
        last = done[-1]
        rc, out2, _ = run(command(tmp, "two", "dtensor", steps=last + 1))
        check(rc == 0, f"one rank resumes step_{last} after the kill and trains a step (rc {rc})", out2)
        check(f"step_{last}" in out2, f"it resumed from step_{last}", out2)
        print(f"killed rank 1 after step_6 was saved: the job stopped in {secs:.1f} s (rc {p.returncode}); "
              f"step_{last} resumed on one rank")


BASE_PLUGINS = ["environments", "tokenizer_hf", "model_llama", "kernels_cpu", "dtensor", "megatron", "dataset_jsonl"]
# Per loop: its demo config, a short run's overrides (6 steps, validation and checkpoints every 3),
# and the metrics that must equal one rank's (counts) or follow it within fp32 rounding.
LOOPS = {
    "sft": ("sft_demo_cpu.yaml",
            ["sft.max_num_steps=6", "sft.val_period=3", "sft.val_global_batch_size=64",
             "policy.train_global_batch_size=64", "policy.train_micro_batch_size=16"],
            ["train/num_tokens", "train/num_unmasked_tokens", "train/num_valid_samples"],
            ["train/loss", "train/grad_norm", "validation/val_loss"]),
    "dpo": ("dpo_demo_cpu.yaml",
            ["dpo.max_num_steps=6", "dpo.val_period=3", "dpo.val_global_batch_size=32", "dpo.val_micro_batch_size=8",
             "policy.train_global_batch_size=16", "policy.train_micro_batch_size=4"],
            ["train/num_tokens", "train/num_valid_samples", "validation-default/num_valid_samples"],
            ["train/loss", "train/grad_norm", "train/accuracy", "train/preference_loss", "train/rewards_chosen_mean",
             "train/rewards_rejected_mean", "validation-default/loss", "validation-default/accuracy",
             "validation-default/rewards_chosen_mean", "validation-default/rewards_rejected_mean"]),
    "rm": ("rm_demo_cpu.yaml",
           ["rm.max_num_steps=6", "rm.val_period=3", "rm.val_global_batch_size=32", "rm.val_micro_batch_size=8",
            "policy.train_global_batch_size=16", "policy.train_micro_batch_size=4"],
           ["train/num_tokens", "train/num_valid_samples", "validation-default/num_valid_samples"],
           ["train/loss", "train/grad_norm", "train/accuracy", "train/rewards_chosen_mean",
            "train/rewards_rejected_mean", "validation-default/loss", "validation-default/accuracy",
            "validation-default/rewards_chosen_mean", "validation-default/rewards_rejected_mean"]),
}


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


def loop_command(tmp, algo, tag, backend, extra=()):
    cfg, overrides, _, _ = LOOPS[algo]
    cmd = [RLHOST]
    for p in BASE_PLUGINS + [algo]:
        cmd += ["--plugin", p]
    cmd += ["--config", os.path.join(SRC, "examples/configs", cfg), f"policy.model_name={tmp}/tiny",
            f"logger.log_dir={tmp}/{tag}/logs", f"checkpointing.checkpoint_dir={tmp}/{tag}/ckpt",
            "checkpointing.save_period=3", "checkpointing.keep_top_k=null", "++rlhost.comm_timeout_s=10", *overrides]
    if algo != "sft":
        cmd += [f"data.train.data_path={tmp}/train.jsonl", f"data.validation.data_path={tmp}/val.jsonl"]
    if backend == "megatron":
        cmd += ["policy.dtensor_cfg.enabled=false", "++policy.megatron_cfg.enabled=true",
                "++policy.megatron_cfg.optimizer.lr=3e-3", "++policy.megatron_cfg.optimizer.weight_decay=0",
                "++policy.megatron_cfg.optimizer.use_distributed_optimizer=true"]
    return cmd + list(extra)


def setup_loops(tmp):
    setup(tmp)
    write_pairs(f"{tmp}/train.jsonl", 256, 11)
    write_pairs(f"{tmp}/val.jsonl", 40, 12)  # 40 = a validation batch of 32 and one of 8


def compare_loop(algo, one, two, steps, what):
    _, _, equal, near = LOOPS[algo]
    seen = 0
    for s in steps:
        a, b = one.get(s, {}), two.get(s, {})
        check("train/loss" in a and "train/loss" in b, f"{what}: step {s} has train/loss in both runs")
        for k in equal:
            if k in a:
                check(a[k] == b.get(k), f"{what}: step {s} {k} {b.get(k)} equals one rank's {a[k]}")
        for k in near:
            # DPO's first step has policy = reference: its rewards are rounding noise around 0, and
            # which side of 0 each lands on (its accuracy) is not a figure to compare.
            if k in a and not (algo == "dpo" and s == 1 and k == "train/accuracy"):
                seen += 1
                check(k in b and close(b[k], a[k]), f"{what}: step {s} {k} {b.get(k)} is within fp32 rounding of one rank's {a[k]}")
    return seen


def case_loops(tmp, backend):
    """SFT, DPO and RM at DP=2 follow one rank: each rank trains on its share of every global
    batch with the global counts, validation is split over the ranks and summed."""
    setup_loops(tmp)
    for algo in LOOPS:
        rc, out, _ = run(loop_command(tmp, algo, f"{algo}_one", backend), timeout=200)
        check(rc == 0, f"{algo} {backend}: one rank runs (rc {rc})", out)
        rc, out, secs = run(loop_command(tmp, algo, f"{algo}_two", backend), np=2, timeout=200)
        check(rc == 0, f"{algo} {backend}: two ranks run (rc {rc})", out)
        if rc != 0:
            continue
        check("data parallel over 2 ranks" in out, f"{algo} {backend}: the backend reports 2 data-parallel ranks", out)
        one, two = metrics(tmp, f"{algo}_one"), metrics(tmp, f"{algo}_two")
        seen = compare_loop(algo, one, two, range(1, 7), f"{algo} {backend}")
        check(two[1].get("train/dp_size", 2) == 2, f"{algo} {backend}: the train step reports dp_size 2")
        ckpts = sorted(os.listdir(f"{tmp}/{algo}_two/ckpt"))
        check(ckpts == ["step_3", "step_6"], f"{algo} {backend}: rank 0 committed step_3 and step_6 ({ckpts})")
        val = [k for k in two[6] if k.startswith("validation")]
        print(f"{algo} {backend}: DP=2 followed one rank for 6 steps ({seen} figures compared; losses "
              f"{[round(two[s]['train/loss'], 6) for s in range(1, 7)]}; validation {sorted(val)}); DP=2 took {secs:.1f} s")


def case_loops_resume(tmp):
    """A DP=2 checkpoint of each loop resumes on one rank and continues as the DP=2 run did, and
    one rank's checkpoint resumes at DP=2."""
    setup_loops(tmp)
    for algo in LOOPS:
        rc, out, _ = run(loop_command(tmp, algo, f"{algo}_two", "dtensor"), np=2, timeout=200)
        check(rc == 0, f"{algo}: two ranks run (rc {rc})", out)
        rc1, out1, _ = run(loop_command(tmp, algo, f"{algo}_one", "dtensor"), timeout=200)
        check(rc1 == 0, f"{algo}: one rank runs (rc {rc1})", out1)
        if rc != 0 or rc1 != 0:
            continue
        for src, dst, np in (("two", "at_one", 1), ("one", "at_two", 2)):
            os.makedirs(f"{tmp}/{algo}_{dst}/ckpt")
            shutil.copytree(f"{tmp}/{algo}_{src}/ckpt/step_3", f"{tmp}/{algo}_{dst}/ckpt/step_3")
            rc, out, _ = run(loop_command(tmp, algo, f"{algo}_{dst}", "dtensor"), np=np, timeout=200)
            check(rc == 0, f"{algo}: the {src}-rank step_3 resumes at {np} rank(s) (rc {rc})", out)
            check("resumed from" in out and "step_3" in out, f"{algo}: the log says it resumed from step_3", out)
            if rc == 0:
                compare_loop(algo, metrics(tmp, f"{algo}_{src}"), metrics(tmp, f"{algo}_{dst}"), range(4, 7),
                             f"{algo} resumed from {src} rank(s) at {np}")
        print(f"{algo}: step_3 of DP=2 resumed at one rank, and one rank's at DP=2, each continuing alike")


def case_ppo_follows(tmp):
    """PPO at DP=2 (its demo task, 4 steps of 64 prompts x 1 sample): the critic's values of each
    rank's share, GAE over the gathered batch (its advantage whitening is global), the critic
    trained on the shares with the global counts: the policy's figures follow one rank within
    fp32 rounding, the critic's within 1e-3 (AdamW at the critic's lr 1e-2 magnifies rounding in
    near-zero gradients); both DP=2 checkpoints hold value/. A value batch size other than the
    policy's is refused at DP=2 with one line."""
    ppo_setup(tmp, 512, 64)

    def ppo(tag, extra=()):
        return ppo_command(tmp, tag, PLUGINS[:-1], "ppo.max_num_steps=4", "ppo.val_period=2",
                           "checkpointing.enabled=true", f"++checkpointing.checkpoint_dir={tmp}/{tag}/ckpt",
                           "++checkpointing.save_period=2", "++rlhost.comm_timeout_s=10", *extra)
    rc, out, _ = run(ppo("one"))
    check(rc == 0, f"ppo: one rank runs (rc {rc})", out)
    rc, out, secs = run(ppo("two"), np=2)
    check(rc == 0, f"ppo: two ranks run (rc {rc})", out)
    if rc == 0:
        one, two = metrics(tmp, "one"), metrics(tmp, "two")
        n = 0
        for s in range(0, 5):
            for k, a in one.get(s, {}).items():
                if (k.startswith(("timing", "rlhost")) or "memory" in k or "comm" in k or "dp_size" in k
                        or "num_micro_batches" in k or k == "step"):
                    continue
                b = two.get(s, {}).get(k)
                rel = 1e-3 if k.startswith("train/critic/") else 1e-5
                n += 1
                check(b is not None and close(b, a, rel=rel), f"ppo: step {s} {k} {b} follows one rank's {a}")
        for st in ("step_2", "step_4"):
            check(os.path.isdir(f"{tmp}/two/ckpt/{st}/value"), f"ppo: DP=2 {st} holds the critic (value/)")
        print(f"ppo: DP=2 followed one rank for 4 steps ({n} figures); DP=2 took {secs:.1f} s")
    rc, out, _ = run(ppo("bad", ["++value.train_global_batch_size=32"]), np=2, timeout=120)
    lines = [l for l in out.splitlines() if re.match(r"rlhost rank \d+: error: ", l)]
    check(rc != 0 and len(lines) >= 1 and all("value.train_global_batch_size = 32 must equal" in l for l in lines),
          "ppo: a value batch size other than the policy's is one line at DP=2", out)

def case_dynamic_sampling(tmp):
    """DAPO dynamic sampling at DP=2: the ranks generate halves of each generation batch, gather it
    whole, filter and select as one rank does and train on their shares, so the run follows one
    rank: the same generation batches, discarded samples, rewards and losses."""
    setup(tmp)
    extra = ["++grpo.use_dynamic_sampling=true", "++grpo.batch_multiplier=1.5",
             "++grpo.dynamic_sampling_max_gen_batches=20", "grpo.num_prompts_per_step=4",
             "policy.train_global_batch_size=16", "checkpointing.enabled=false"]
    rc, out, _ = run(command(tmp, "one", "megatron", steps=3, extra=extra))
    check(rc == 0, f"dynamic sampling: one rank runs (rc {rc})", out)
    rc, out, secs = run(command(tmp, "two", "megatron", steps=3, extra=extra), np=2)
    check(rc == 0, f"dynamic sampling: two ranks run (rc {rc})", out)
    if rc != 0:
        return
    check("data parallel over 2 ranks" in out, "dynamic sampling: the backend reports data parallelism over 2 ranks", out)
    one, two = metrics(tmp, "one"), metrics(tmp, "two")
    compare(one, two, range(1, 4), "dynamic sampling")
    for s in range(1, 4):
        for k in ("train/dynamic_sampling_num_gen_batches", "train/dynamic_sampling_num_discarded_valid_samples",
                  "train/num_valid_samples"):
            check(k in one.get(s, {}) and one[s][k] == two.get(s, {}).get(k),
                  f"dynamic sampling: step {s} {k} {two.get(s, {}).get(k)} equals one rank's {one.get(s, {}).get(k)}")
    print(f"dynamic sampling: DP=2 followed one rank for 3 steps (generation batches "
          f"{[two[s]['train/dynamic_sampling_num_gen_batches'] for s in range(1, 4)]}); DP=2 took {secs:.1f} s")

def case_duplicate_prompts(tmp):
    """Advantages group the samples of equal prompts over the whole step's batch, as one rank and
    NeMo-RL do: with grpo.seed 5 the demo's step 2 draws one prompt twice, and the two draws land
    on different ranks' shares; DP=2 still follows one rank (it did not when each rank grouped its
    own share: step 2's loss was 0.0431 against 0.0576)."""
    setup(tmp)
    extra = ["grpo.seed=5", "policy.generation.max_new_tokens=6", "checkpointing.enabled=false"]
    rc, out, _ = run(command(tmp, "one", "megatron", steps=3, extra=extra))
    check(rc == 0, f"duplicate prompts: one rank runs (rc {rc})", out)
    rc, out, _ = run(command(tmp, "two", "megatron", steps=3, extra=extra), np=2)
    check(rc == 0, f"duplicate prompts: two ranks run (rc {rc})", out)
    if rc != 0:
        return
    one, two = metrics(tmp, "one"), metrics(tmp, "two")
    compare(one, two, range(1, 4), "duplicate prompts")
    print(f"duplicate prompts: DP=2 followed one rank for 3 steps (losses {[two[s]['train/loss'] for s in range(1, 4)]})")


CASES = {
    "duplicate_prompts": case_duplicate_prompts,
    "dynamic_sampling": case_dynamic_sampling,
    "balanced_tokens": case_balanced_tokens,
    "loops_dtensor": lambda t: case_loops(t, "dtensor"),
    "loops_megatron": lambda t: case_loops(t, "megatron"),
    "loops_resume": case_loops_resume,
    "ppo_follows": case_ppo_follows,
    "follows_dtensor": lambda t: case_follows(t, "dtensor"),
    "follows_megatron": lambda t: case_follows(t, "megatron"),
    "resume_at_one": case_resume_at_one,
    "killed_rank": case_killed_rank,
}

if __name__ == "__main__":
    main(CASES, "rlh_grpo_dp_")
