#!/usr/bin/env python3
"""Non-colocated generation and asynchronous GRPO through `rlhost` under mpirun (ctest grpo.nc.*).

The demo's GRPO stage (examples/configs/grpo_demo_cpu.yaml) on a random tiny Llama, 8 prompts x 8
samples; with policy.generation.colocated.enabled=false the last resources.gpus_per_node ranks
generate and the ranks before them train (plugins/grpo/src/generation_ranks.hpp):

  follows         1 trainer + 1 generator rank follow one colocated rank for 6 steps (rewards,
                  token counts and validation accuracy equal, loss and gradient norm within fp32
                  rounding); every refit's bytes are the policy's fp32 weights
  follows_dp2     2 trainer + 2 generator ranks follow 2 colocated data-parallel ranks; each FSDP
                  trainer rank sends each generator rank its half of the weights, its flat shard
                  as it lies (the resharding refit, no gather)
  follows_dp2_shared  2 data-parallel trainer ranks sharing 1 generator rank (np 3; validation shares
                  of 16 and 17 rows, so the two make different numbers of calls) follow 2 colocated
                  ranks for 3 steps, and async GRPO on them (lags 0, 1, 1); the shared generator
                  rank takes the resharding refit (each trainer's FSDP shard), and with
                  rlhost.refit_reshard=false the broadcast, the two runs equal bitwise
  follows_dp4_shared_np6  4 data-parallel trainer ranks sharing 2 generator ranks (np 6, two each)
                  likewise against 4 colocated ranks
  multiturn_shared  multi-turn GRPO (the reveal task: only wrong first guesses take a second turn,
                  so the ranks' rounds differ) with 2 trainers sharing 1 generator rank (np 3)
                  follows 2 colocated ranks for 3 steps
  shared_mp_np4   2 data-parallel trainers sharing one TP 2 generator (np 4), and megatron TP 2 x DP 2
                  trainers sharing 1 generator rank (np 5), follow their colocated runs
  follows_1to2    1 trainer + 2 generator ranks (np 3: the trainer splits each call between them)
                  follow one colocated rank for 3 steps, synchronously and with async GRPO
                  (max_trajectory_age_steps 1: lags 0, 1, 1; and 2: lags 0, 1, 2)
  follows_gen_tp2 1 trainer + 2 generator ranks forming one tensor-parallel generator
                  (policy.generation.vllm_cfg.tensor_parallel_size 2, np 3: each rank holds half
                  the heads, the trainer talks to the group's first rank) follow one colocated rank
                  for 3 steps
  colocated_gen_tp2  colocated generation by a tensor-parallel generator over each TP 2 trainer
                  group (np 2, generator tensor_parallel_size 2) follows the same trainers with one
                  whole generator a rank for 3 steps; DP 2 trainers with a TP 2 generator (its
                  ranks on different data) are refused with one line
  follows_tp2     megatron TP 2 trainers + 1 generator rank (np 3) follow the colocated TP 2 run
                  for 3 steps (the group's first rank feeds the generator rank); async GRPO on the
                  same ranks: step 1 draws the synchronous run's samples, steps 2-3 train on
                  rollouts one version old
  follows_mp_np4  PP 2 trainers + 2 generator ranks (np 4: one per trainer rank, the group's
                  generation split between them) follow the colocated PP 2 run; CP 2 + 1 likewise
  follows_tp2dp2_np6  TP 2 x DP 2 trainers + 2 generator ranks (np 6: one per data-parallel group,
                  fed by the group's first rank) follow the colocated TP 2 x DP 2 run (np 4)
  ppo_follows     PPO with 1 trainer + 1 generator rank follows one colocated rank (the critic
                  trains on the trainer rank; only generation moves); asynchronous PPO on them
                  trains steps 2-3 one version behind
  refit_reshard   the resharding refit against trainer 0's broadcast (rlhost.refit_reshard=false),
                  2 steps each, equal bitwise, each generator rank receiving exactly its pieces:
                  megatron TP 2 -> 1 generator rank, 1 trainer -> a TP 2 generator, PP 2 -> 1 (np 3)
  refit_reshard_np4  TP 2 -> a TP 2 generator, and 2 FSDP trainers sharing a TP 2 generator (each
                  flat shard's boxes meet each generator rank's TP boxes)
  refit_reshard_np6  2 FSDP trainers with a TP 2 generator each (several TP generators)
  bad_layout      worlds the generator ranks do not fit (no trainer left, trainer and generator
                  counts that do not divide one another), and
                  the async settings rlhost cannot honour, are refused with one line naming them
  async_learns    async GRPO (1-step-off) from a short SFT stage: step 1 is the synchronous run's,
                  later steps train on rollouts one weight version old, and validation accuracy
                  rises on the demo task
  killed_generator  the generator rank is killed mid-run: the job stops non-zero within the timeout
  trainer_hangs   the trainer freezes (SIGSTOP) mid-run: its generator rank stops at the comm
                  timeout with one line and the job ends non-zero
  trainer_stops   the trainer is told to stop (SIGTERM) mid-run: both ranks exit non-zero within the
                  timeout, the generator rank with an error line of its own
  shared_stops    2 data-parallel trainers sharing 1 generator rank (np 3): a killed client (rank 1),
                  a killed generator rank, and a frozen client (SIGSTOP) each stop the job non-zero
                  within the timeout

usage: test_grpo_noncolocated.py CASE RLHOST RLH_TINY_MODEL MPIRUN SOURCE_DIR
"""
import json
import os
import random
import re
import signal
import subprocess
import time

from loop_runs import MPI_ENV, RLHOST, SRC, check, close, compare, launch, main, metrics, ppo_command, ppo_setup, run, setup  # noqa: E402

PLUGINS = ["environments", "tokenizer_hf", "model_llama", "kernels_cpu", "dtensor", "megatron", "generator", "grpo"]
NONCOLOCATED = ["++policy.generation.colocated.enabled=false"]
ASYNC = ["++grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"]


def generators(n):
    return NONCOLOCATED + [f"++policy.generation.colocated.resources.gpus_per_node={n}"]


def command(tmp, tag, steps=6, extra=(), model=None):
    cmd = [RLHOST]
    for p in PLUGINS:
        cmd += ["--plugin", p]
    cmd += ["--config", os.path.join(SRC, "examples/configs/grpo_demo_cpu.yaml"),
            f"policy.model_name={model or tmp + '/tiny'}", f"grpo.max_num_steps={steps}", "grpo.num_prompts_per_step=8",
            "grpo.num_generations_per_prompt=8", "grpo.val_period=3", "grpo.max_val_samples=64",
            "grpo.val_batch_size=64", "checkpointing.save_period=3", "checkpointing.keep_top_k=null",
            f"checkpointing.checkpoint_dir={tmp}/{tag}/ckpt", f"logger.log_dir={tmp}/{tag}/logs",
            "++rlhost.comm_timeout_s=10"]
    return cmd + list(extra)


def params_bytes(tmp):
    """The tiny model's weights in fp32 bytes, from its safetensors header."""
    total = 0
    for f in os.listdir(f"{tmp}/tiny"):
        if f.endswith(".safetensors"):
            with open(f"{tmp}/tiny/{f}", "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            for k, v in header.items():
                if k != "__metadata__":
                    count = 1
                    for d in v["shape"]:
                        count *= d
                    total += 4 * count
    return total


def reshard_lines(tmp, out, what, trainers, gens, want=None, senders=None):
    """The resharding refit's lines of a run on `trainers` trainer + `gens` generator ranks: each
    generator rank receives `want[g]` bytes (default: the whole model) from `senders` trainer ranks
    (default: all; a list: per generator rank). Returns {trainer rank: (held, sent, to)} from the
    trainer ranks' lines."""
    full = params_bytes(tmp)
    senders = [trainers] * gens if senders is None else senders
    for g in range(gens):
        got = want[g] if want else full
        line = f"refit: generator rank {trainers + g} receives its"
        check(any(line in l and f", {got} bytes, from {senders[g]} trainer rank" in l for l in out.splitlines()),
              f"{what}: generator rank {trainers + g} takes the resharding refit: {got} bytes from {senders[g]} trainer "
              f"rank(s)", out)
    sent = {}
    for l in out.splitlines():
        m = re.search(r"refit: trainer rank (\d+) sends its \d+ weight pieces \((\d+) bytes\) as (\d+) bytes to (\d+) "
                      r"generator rank", l)
        if m:
            sent[int(m.group(1))] = (int(m.group(2)), int(m.group(3)), int(m.group(4)))
    check(sorted(sent) == list(range(trainers)), f"{what}: every trainer rank logs what it sends ({sorted(sent)})", out)
    return sent


def check_fsdp_shards(tmp, sent, what, trainers, gens, whole=True):
    """FSDP trainers send their shards as they lie: trainer rank t holds its 1/T flat shard of every
    unit (all / T bytes, give or take T elements per unit: fewer units than tensors), the shards add
    up to the model, and (`whole`: every generator rank needs the whole model) it sends each
    generator rank that shard: nothing is gathered."""
    full = params_bytes(tmp)
    slack = 4 * trainers * len(tiny_tensors(tmp)[0])
    held = [sent.get(t, (0, 0, 0))[0] for t in range(trainers)]
    check(sum(held) == full, f"{what}: the trainer ranks' shards add up to the model ({held}, {full} bytes)")
    check(all(abs(h - full // trainers) <= slack for h in held),
          f"{what}: each trainer rank holds its 1/{trainers} shard ({held}; {full // trainers} +- {slack} bytes)")
    check(not whole or all(sent[t][1] == gens * sent[t][0] and sent[t][2] == gens for t in sent),
          f"{what}: each trainer rank sends its shard, as it holds it, to each of the {gens} generator rank(s) ({sent})")
    return f"FSDP shards of {held} bytes ({full} in all) sent as they lie"


def case_follows(tmp, trainers):
    setup(tmp)
    rc, out, _ = run(command(tmp, "colocated"), np=trainers)
    check(rc == 0, f"{trainers} colocated rank(s) run (rc {rc})", out)
    rc, out, secs = run(command(tmp, "nc", extra=generators(trainers)), np=2 * trainers)
    check(rc == 0, f"{trainers} trainer + {trainers} generator ranks run (rc {rc})", out)
    if rc != 0:
        return
    one, two = metrics(tmp, "colocated"), metrics(tmp, "nc")
    compare(one, two, range(1, 7), f"non-colocated x{trainers}", "the colocated run's")
    want = params_bytes(tmp)
    for s in range(1, 7):
        got = two[s].get("train/refit_bytes")
        check(got == want, f"step {s}: the refit broadcast {got} bytes, the policy's fp32 weights ({want})")
        check(two[s].get("train/refit_broadcast_seconds", -1) >= 0, f"step {s}: the refit's seconds are logged")
    check(f"data parallel over {trainers} ranks" in out, f"the backend trains on {trainers} rank(s), not the generators", out)
    sent = reshard_lines(tmp, out, f"{trainers}+{trainers}", trainers, trainers)
    shards = check_fsdp_shards(tmp, sent, f"{trainers}+{trainers}", trainers, trainers) if trainers > 1 else ""
    print(f"{trainers}+{trainers} ranks followed {trainers} colocated for 6 steps (rewards "
          f"{[two[s]['train/reward'] for s in range(1, 7)]}); refit {want} B in "
          f"{[round(two[s]['train/refit_broadcast_seconds'], 4) for s in range(1, 7)]} s; {shards}; run took {secs:.1f} s")


MEGATRON = ["policy.dtensor_cfg.enabled=false", "++policy.megatron_cfg.enabled=true",
            "++policy.megatron_cfg.optimizer.weight_decay=0"]
MP_LAYOUTS = {
    "tp2": ["++policy.megatron_cfg.tensor_model_parallel_size=2"],
    "tp2dp2": ["++policy.megatron_cfg.tensor_model_parallel_size=2",
               "++policy.megatron_cfg.optimizer.use_distributed_optimizer=true"],
    "pp2": ["++policy.megatron_cfg.pipeline_model_parallel_size=2"],
    "cp2": ["++policy.megatron_cfg.context_parallel_size=2"],
}


def follows_mp(tmp, layout, gens, steps=3, trainers=2, dp=1):
    """Megatron `layout` on `trainers` ranks (`dp` data-parallel groups) with `gens` generator ranks
    follows the colocated run of the same layout for `steps` steps, and every refit sends each
    generator rank the policy's fp32 weights, resharded from every trainer rank's pieces. Returns
    the non-colocated run's metrics."""
    mp = MEGATRON + MP_LAYOUTS[layout]
    reference = f"colocated_{layout}"
    rc, out, _ = run(command(tmp, reference, steps=steps, extra=mp), np=trainers)
    check(rc == 0, f"colocated {layout} runs (rc {rc})", out)
    if rc != 0:
        return None
    tag = f"nc_{layout}_{gens}"
    rc, out, secs = run(command(tmp, tag, steps=steps, extra=mp + generators(gens)), np=trainers + gens)
    check(rc == 0, f"{layout} trainers + {gens} generator rank(s) run (rc {rc})", out)
    if rc != 0:
        return None
    groups = f"{dp} data-parallel rank{'s' if dp > 1 else ''}, model-parallel groups of {trainers // dp}"
    check(groups in out, f"{layout}: the trainers form {groups}", out)
    parts = max(1, gens // dp)  # generator ranks per data-parallel group (1: groups share one)
    check(f"into {parts} part" in out, f"{layout}: each group splits its generation into {parts} part(s)", out)
    one, two = metrics(tmp, reference), metrics(tmp, tag)
    compare(one, two, range(1, steps + 1), f"{layout} + {gens} generator rank(s)", f"the colocated {layout} run's")
    want = params_bytes(tmp)
    for s in range(1, steps + 1):
        got = two.get(s, {}).get("train/refit_bytes")
        check(got == want, f"{layout}: step {s}: the refit sent {got} bytes, the policy's fp32 weights ({want})")
    reshard_lines(tmp, out, f"{layout} + {gens}", trainers, gens)
    print(f"{layout} trainers + {gens} generator rank(s) followed the colocated run for {steps} steps (rewards "
          f"{[two[s]['train/reward'] for s in range(1, steps + 1)]}); refit {want} B; {secs:.1f} s")
    return two


def case_follows_1to2(tmp):
    setup(tmp)
    rc, out, _ = run(command(tmp, "colocated", steps=3))
    check(rc == 0, f"one colocated rank runs (rc {rc})", out)
    rc, out, secs = run(command(tmp, "nc", steps=3, extra=generators(2)), np=3)
    check(rc == 0, f"1 trainer + 2 generator ranks run (rc {rc})", out)
    rc2, out2, _ = run(command(tmp, "async", steps=3, extra=generators(2) + ASYNC), np=3)
    check(rc2 == 0, f"async GRPO on 1 trainer + 2 generator ranks runs (rc {rc2})", out2)
    if rc != 0 or rc2 != 0:
        return
    check("each trainer rank splits its calls over 2" in out, "the trainer splits its calls over its 2 generator ranks", out)
    one, two, a = metrics(tmp, "colocated"), metrics(tmp, "nc"), metrics(tmp, "async")
    compare(one, two, range(1, 4), "1 trainer + 2 generator ranks", "the colocated run's")
    want = params_bytes(tmp)
    check(all(two[s].get("train/refit_bytes") == want for s in range(1, 4)),
          f"every refit broadcasts the policy's {want} bytes to both generator ranks")
    check(a[1]["train/reward"] == one[1]["train/reward"], "async: step 1 draws the colocated run's samples")
    lags = [a[k]["train/generation_weight_lag"] for k in (1, 2, 3)]
    check(lags == [0, 1, 1], f"async: steps 2-3 train on rollouts one version old (lags {lags})")
    # max_trajectory_age_steps = 2: step 1 sends steps 2 and 3 ahead, both drawn with the first
    # weights; step 2 sends step 4's. Step 2 then draws what the 1-step-off run drew.
    rc3, out3, _ = run(command(tmp, "async2", steps=3, extra=generators(2) + ASYNC +
                               ["++grpo.async_grpo.max_trajectory_age_steps=2"]), np=3)
    check(rc3 == 0, f"async GRPO with max_trajectory_age_steps = 2 runs (rc {rc3})", out3)
    if rc3 == 0:
        a2 = metrics(tmp, "async2")
        lags2 = [a2[k]["train/generation_weight_lag"] for k in (1, 2, 3)]
        check(lags2 == [0, 1, 2], f"age 2: step 3 trains on rollouts two versions old (lags {lags2})")
        check(a2[1]["train/reward"] == a[1]["train/reward"] and a2[2]["train/reward"] == a[2]["train/reward"],
              "age 2: steps 1-2 draw the 1-step-off run's samples")
        print(f"async GRPO, max_trajectory_age_steps 2: lags {lags2}")
    print(f"1 trainer + 2 generator ranks followed one colocated rank for 3 steps (rewards "
          f"{[two[s]['train/reward'] for s in range(1, 4)]}); async lags {lags}; {secs:.1f} s")


GEN_TP2 = ["++policy.generation.vllm_cfg.tensor_parallel_size=2"]


# Validation shares of unequal length (33 rows over 2 ranks: 16 and 17, in batches of 16), so the
# ranks sharing a generator rank make different numbers of generate calls.
UNEVEN_VAL = ["grpo.max_val_samples=33", "grpo.val_batch_size=16"]


def shared(tmp, trainers, gens, steps=3, broadcast=False):
    """`trainers` data-parallel trainer ranks sharing `gens` generator ranks follow as many colocated
    ranks for `steps` steps, synchronously and with async GRPO (lags 0, 1, 1). Every refit is the
    resharding one: each generator rank takes every FSDP trainer rank's shard, its clients' and the
    others' (on the pieces' own communicator, which its recv_any never reads). `broadcast`: also
    with rlhost.refit_reshard=false, which broadcasts instead and equals the resharded run bitwise."""
    setup(tmp)
    rc, out, _ = run(command(tmp, "colocated", steps=steps, extra=UNEVEN_VAL), np=trainers)
    check(rc == 0, f"{trainers} colocated ranks run (rc {rc})", out)
    rc, out, secs = run(command(tmp, "nc", steps=steps, extra=UNEVEN_VAL + generators(gens)), np=trainers + gens)
    check(rc == 0, f"{trainers} trainer + {gens} generator rank(s) run (rc {rc})", out)
    rc2, out2, secs2 = run(command(tmp, "async", steps=steps, extra=UNEVEN_VAL + generators(gens) + ASYNC), np=trainers + gens)
    check(rc2 == 0, f"async GRPO on {trainers} trainer + {gens} generator rank(s) runs (rc {rc2})", out2)
    if rc != 0 or rc2 != 0:
        return
    per = trainers // gens
    check(f"every {per} groups share one, fed by their first ranks" in out,
          f"every {per} data-parallel trainer ranks share a generator rank", out)
    one, two, a = metrics(tmp, "colocated"), metrics(tmp, "nc"), metrics(tmp, "async")
    compare(one, two, range(1, steps + 1), f"{trainers} trainer + {gens} generator rank(s)", f"the {trainers} colocated ranks'")
    check("validation/accuracy" in one.get(0, {}) and one[0]["validation/accuracy"] == two.get(0, {}).get("validation/accuracy"),
          "the validation at the start (unequal shares) equals the colocated run's", str(two.get(0)))
    want = params_bytes(tmp)
    check(all(two[s].get("train/refit_bytes") == want for s in range(1, steps + 1)),
          f"every refit sends each generator rank the policy's {want} bytes")
    sent = reshard_lines(tmp, out, f"{trainers} sharing {gens}", trainers, gens)
    shards = check_fsdp_shards(tmp, sent, f"{trainers} sharing {gens}", trainers, gens)
    reshard_lines(tmp, out2, f"async, {trainers} sharing {gens}", trainers, gens)
    if broadcast:
        rc3, out3, _ = run(command(tmp, "broadcast", steps=steps, extra=UNEVEN_VAL + generators(gens) +
                                   ["++rlhost.refit_reshard=false"]), np=trainers + gens)
        check(rc3 == 0, f"{trainers} sharing {gens} with rlhost.refit_reshard=false runs (rc {rc3})", out3)
        if rc3 == 0:
            check("receives its" not in out3 and "sends its" not in out3,
                  "rlhost.refit_reshard=false: the shared generator rank gets the broadcast", out3)
            same_steps(metrics(tmp, "broadcast"), two, range(1, steps + 1), f"{trainers} sharing {gens}")
    check(a[1]["train/reward"] == one[1]["train/reward"], "async: step 1 draws the colocated run's samples")
    lags = [a[k]["train/generation_weight_lag"] for k in range(1, steps + 1)]
    check(lags == [0] + [1] * (steps - 1), f"async: later steps train on rollouts one version old (lags {lags})")
    print(f"{trainers} data-parallel trainers sharing {gens} generator rank(s) followed {trainers} colocated ranks for "
          f"{steps} steps (rewards {[two[s]['train/reward'] for s in range(1, steps + 1)]}; {secs:.1f} s); async lags "
          f"{lags} ({secs2:.1f} s); resharding refit: {shards}" + ("; = the broadcast run bitwise" if broadcast else ""))


def case_multiturn_shared(tmp):
    """Multi-turn GRPO (the reveal task: a wrong first guess is answered with the digit, so only
    some samples take a second turn, a different number on each rank) with 2 data-parallel trainer
    ranks sharing 1 generator rank follows 2 colocated ranks for 3 steps."""
    setup(tmp)
    rng = random.Random(5)
    for name, n in (("train", 64), ("val", 24)):
        with open(f"{tmp}/{name}.jsonl", "w") as f:
            for _ in range(n):
                f.write(json.dumps({"input": "=", "output": str(rng.randrange(10))}) + "\n")

    def mt(tag, extra=()):
        cmd = [RLHOST]
        for p in PLUGINS + ["dataset_jsonl"]:
            cmd += ["--plugin", p]
        return cmd + ["--config", os.path.join(SRC, "examples/configs/grpo_multiturn_demo_cpu.yaml"),
                      f"policy.model_name={tmp}/tiny", "grpo.max_num_steps=3", "grpo.num_prompts_per_step=8",
                      "grpo.num_generations_per_prompt=8", "grpo.val_period=3", "grpo.max_val_samples=17",
                      "grpo.val_batch_size=8", "++policy.train_global_batch_size=64", f"data.train.data_path={tmp}/train.jsonl",
                      f"data.validation.data_path={tmp}/val.jsonl", f"logger.log_dir={tmp}/{tag}/logs",
                      "++rlhost.comm_timeout_s=10", *extra]
    rc, out, _ = run(mt("colocated"), np=2)
    check(rc == 0, f"multi-turn: 2 colocated ranks run (rc {rc})", out)
    rc2, out2, secs = run(mt("nc", generators(1)), np=3)
    check(rc2 == 0, f"multi-turn: 2 trainer ranks sharing 1 generator rank run (rc {rc2})", out2)
    if rc != 0 or rc2 != 0:
        return
    one, two = metrics(tmp, "colocated"), metrics(tmp, "nc")
    compare(one, two, range(1, 4), "multi-turn, 2 trainers + 1 generator rank", "the 2 colocated ranks'")
    reshard_lines(tmp, out2, "multi-turn, 2 sharing 1", 2, 1)
    turns = [two.get(s, {}).get("train/avg_turns_per_sample", 0) for s in range(1, 4)]
    check(all(1 < t < 2 for t in turns), f"multi-turn: some samples take a second turn, not all ({turns})")
    check("validation/accuracy" in one.get(0, {}) and one[0]["validation/accuracy"] == two.get(0, {}).get("validation/accuracy"),
          "multi-turn: the validation at the start equals the colocated run's", str(two.get(0)))
    print(f"multi-turn GRPO, 2 trainers sharing 1 generator rank followed 2 colocated ranks for 3 steps (rewards "
          f"{[two[s]['train/reward'] for s in range(1, 4)]}, turns per sample {turns}); {secs:.1f} s")


def case_follows_gen_tp2(tmp):
    setup(tmp)
    rc, out, _ = run(command(tmp, "colocated", steps=3))
    check(rc == 0, f"one colocated rank runs (rc {rc})", out)
    rc, out, secs = run(command(tmp, "nc_gen_tp2", steps=3, extra=generators(2) + GEN_TP2), np=3)
    check(rc == 0, f"1 trainer + one TP 2 generator on 2 ranks runs (rc {rc})", out)
    if rc != 0:
        return
    check("each trainer rank splits its calls" not in out, "the trainer does not split its calls: one generator", out)
    check("generator native: tensor parallel over 2 ranks (this one 1)" in out,
          "both generator ranks run one TP 2 generator", out)
    one, two = metrics(tmp, "colocated"), metrics(tmp, "nc_gen_tp2")
    compare(one, two, range(1, 4), "1 trainer + a TP 2 generator", "the colocated run's")
    want = params_bytes(tmp)
    pieces = tp2_piece_bytes(tmp)
    check(all(two[s].get("train/refit_bytes") == max(pieces) for s in range(1, 4)),
          f"every refit sends each generator rank only its pieces (at most {max(pieces)} of the {want} bytes)")
    # Async GRPO: the requests sent ahead reach the leader, which shares them with its group.
    rc, out, _ = run(command(tmp, "async_gen_tp2", steps=3, extra=generators(2) + GEN_TP2 + ASYNC), np=3)
    check(rc == 0, f"async GRPO with a TP 2 generator runs (rc {rc})", out)
    if rc != 0:
        return
    a = metrics(tmp, "async_gen_tp2")
    check(a[1]["train/reward"] == one[1]["train/reward"], "async TP 2 generator: step 1 draws the colocated run's samples")
    lags = [a[k]["train/generation_weight_lag"] for k in (1, 2, 3)]
    check(lags == [0, 1, 1], f"async TP 2 generator: steps 2-3 train on rollouts one version old (lags {lags})")
    print(f"1 trainer + a TP 2 generator (2 ranks) followed one colocated rank for 3 steps (rewards "
          f"{[two[s]['train/reward'] for s in range(1, 4)]}), async lags {lags}; {secs:.1f} s")


def case_colocated_gen_tp2(tmp):
    setup(tmp)
    mp = MEGATRON + MP_LAYOUTS["tp2"]
    rc, out, _ = run(command(tmp, "colocated_tp2", steps=3, extra=mp), np=2)
    check(rc == 0, f"colocated TP 2 runs (rc {rc})", out)
    rc, out, secs = run(command(tmp, "colocated_tp2_gen_tp2", steps=3, extra=mp + GEN_TP2), np=2)
    check(rc == 0, f"colocated TP 2 with a TP 2 generator runs (rc {rc})", out)
    if rc != 0:
        return
    check("generator native: tensor parallel over 2 ranks (this one 1)" in out, "the two ranks run one TP 2 generator", out)
    check("into 1 part and all-gather the samples (each part by a tensor-parallel generator over 2 ranks)" in out,
          "the group makes each call once, on its TP 2 generator", out)
    one, two = metrics(tmp, "colocated_tp2"), metrics(tmp, "colocated_tp2_gen_tp2")
    compare(one, two, range(1, 4), "colocated TP 2 with a TP 2 generator", "one generator a rank")
    # The generator's own logprobs against the trainer's recomputation: a group mixing two calls'
    # activations would sample from wrong logits.
    errs = [two[s].get("train/logprob_abs_error_max", 1.0) for s in range(1, 4)]
    check(all(e < 1e-5 for e in errs), f"the TP 2 generator's logprobs equal the trainer's (max |error| {errs})")
    # Ranks on different data cannot form one generator: refused before anything generates.
    rc, out, _ = run(command(tmp, "colocated_dp2_gen_tp2", steps=1, extra=GEN_TP2), np=2, timeout=60)
    check(rc != 0, f"DP 2 trainers with a colocated TP 2 generator are refused (rc {rc})", out)
    one_error_line(out, "policy.generation.vllm_cfg.tensor_parallel_size = 2 with colocated generation: ranks 0..1 "
                        "would form one generator, but rank 1 trains on data-parallel share 1",
                   "DP 2 with a colocated TP 2 generator")
    print(f"colocated TP 2 trainers with a TP 2 generator followed one generator a rank for 3 steps (rewards "
          f"{[two[s]['train/reward'] for s in range(1, 4)]}); {secs:.1f} s")


def tiny_tensors(tmp):
    """{name: shape} of the tiny model's safetensors, and its config."""
    shapes = {}
    for f in os.listdir(f"{tmp}/tiny"):
        if f.endswith(".safetensors"):
            with open(f"{tmp}/tiny/{f}", "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                for k, v in json.loads(fh.read(n)).items():
                    if k != "__metadata__":
                        shapes[k] = v["shape"]
    with open(f"{tmp}/tiny/config.json") as fh:
        return shapes, json.load(fh)


def tp2_piece_bytes(tmp):
    """The fp32 bytes each rank of a TP 2 generator holds of the tiny Llama (Megatron's plan,
    sdk/tensor_parallel.hpp): q/gate/up rows and o/down columns halved, k/v halved by kv heads (one
    head each when there are fewer kv heads than ranks), the vocabulary in blocks of ceil(V / 2)
    rows, norms whole on both."""
    shapes, cfg = tiny_tensors(tmp)
    kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    ranks = [0, 0]
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        if name.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight", "o_proj.weight", "down_proj.weight")):
            mine = [n // 2, n // 2]
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            mine = [n // 2] * 2 if kv >= 2 else [n] * 2
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            V, B = shape[0], (shape[0] + 1) // 2
            mine = [B * n // V, (V - B) * n // V]
        else:
            mine = [n, n]
        ranks = [ranks[0] + 4 * mine[0], ranks[1] + 4 * mine[1]]
    return ranks


# Timings and byte counts differ between the two refits; everything else a step logs is the same.
REFIT_KEYS = ("train/refit_bytes", "train/refit_bytes_total")


def same_steps(a, b, steps, what):
    """Every metric of steps `steps` but timings and refit bytes equal bitwise."""
    for s in steps:
        x, y = a.get(s, {}), b.get(s, {})
        keys = [k for k in x if k not in REFIT_KEYS and "seconds" not in k and "time" not in k and "per_sec" not in k
                and "per_second" not in k and not k.startswith("timing")]
        check(len(keys) > 5 and "train/reward" in keys, f"{what}: step {s} has metrics to compare")
        differ = [k for k in keys if x.get(k) != y.get(k)]
        check(not differ, f"{what}: step {s}: the resharded refit's run equals the broadcast's bitwise"
              + (f" (differ: {', '.join(differ[:5])})" if differ else ""))


def refit_reshard(tmp, name, layout, gens, gen_tp, np, senders=None):
    """`layout` trainers (MP_LAYOUTS key, or None: one dtensor rank) + `gens` generator ranks
    forming generators of `gen_tp` ranks, with the resharding refit and with trainer 0's broadcast
    (rlhost.refit_reshard=false), 2 steps each: the runs are equal bitwise (same samples, so the same
    tokens, rewards and logprobs), and each generator rank receives exactly its pieces."""
    extra = (MEGATRON + MP_LAYOUTS[layout] if layout else []) + generators(gens)
    if gen_tp > 1:
        extra += [f"++policy.generation.vllm_cfg.tensor_parallel_size={gen_tp}"]
    rc, out, secs = run(command(tmp, f"{name}_pieces", steps=2, extra=extra), np=np)
    check(rc == 0, f"{name}: the resharding refit's run (rc {rc})", out)
    rc2, out2, _ = run(command(tmp, f"{name}_broadcast", steps=2, extra=extra + ["++rlhost.refit_reshard=false"]), np=np)
    check(rc2 == 0, f"{name}: the broadcast refit's run (rc {rc2})", out2)
    if rc != 0 or rc2 != 0:
        return
    pieces, whole = metrics(tmp, f"{name}_pieces"), metrics(tmp, f"{name}_broadcast")
    same_steps(whole, pieces, (1, 2), name)
    full = params_bytes(tmp)
    want = [tp2_piece_bytes(tmp)[g % 2] for g in range(gens)] if gen_tp == 2 else [full] * gens
    for s in (1, 2):
        check(whole[s].get("train/refit_bytes") == full, f"{name}: step {s}: the broadcast sends the whole {full} bytes")
        check(pieces[s].get("train/refit_bytes") == max(want) and pieces[s].get("train/refit_bytes_total") == sum(want),
              f"{name}: step {s}: the generator ranks receive {want} bytes (at most {pieces[s].get('train/refit_bytes')}, "
              f"in all {pieces[s].get('train/refit_bytes_total')})")
    sent = reshard_lines(tmp, out, name, np - gens, gens, want=[want[g % len(want)] for g in range(gens)], senders=senders)
    if not layout and np - gens > 1:  # FSDP trainers: each sends what its shard holds of each rank's part
        check_fsdp_shards(tmp, sent, name, np - gens, gens, whole=gen_tp == 1)
    check("receives its" not in out2, f"{name}: the broadcast run does not reshard", out2)
    print(f"{name}: resharded refit = broadcast refit bitwise over 2 steps; generator ranks receive {want} B "
          f"(broadcast: {full} B each); {secs:.1f} s")


def case_refit_reshard(tmp):
    setup(tmp)
    refit_reshard(tmp, "tp2_to_1", "tp2", 1, 1, 3)
    refit_reshard(tmp, "1_to_tp2", None, 2, 2, 3)
    refit_reshard(tmp, "pp2_to_1", "pp2", 1, 1, 3)


def case_refit_reshard_np6(tmp):
    """Several tensor-parallel generators: 2 FSDP trainers, each with a TP 2 generator of its own."""
    setup(tmp)
    refit_reshard(tmp, "fsdp2_to_2x_tp2", None, 4, 2, 6)


def case_refit_reshard_np4(tmp):
    setup(tmp)
    # TP rank 0 of the generator takes all from trainer rank 0 (its slice, and the norms it sends);
    # TP rank 1 its slice from trainer rank 1 and the norms from trainer rank 0.
    refit_reshard(tmp, "tp2_to_tp2", "tp2", 2, 2, 4, senders=[1, 2])
    # 2 FSDP trainers sharing one TP 2 generator: each flat shard's boxes meet each rank's TP boxes.
    refit_reshard(tmp, "fsdp2_to_shared_tp2", None, 2, 2, 4)


def case_follows_tp2(tmp):
    setup(tmp)
    sync = follows_mp(tmp, "tp2", 1)
    # Async GRPO under TP 2: the group's first rank sends the next step's requests ahead.
    rc, out, _ = run(command(tmp, "async_tp2", steps=3, extra=MEGATRON + MP_LAYOUTS["tp2"] + generators(1) + ASYNC), np=3)
    check(rc == 0, f"async GRPO with TP 2 trainers runs (rc {rc})", out)
    if rc != 0 or sync is None:
        return
    a = metrics(tmp, "async_tp2")
    check(a[1]["train/reward"] == sync[1]["train/reward"],
          f"async TP 2: step 1 draws the synchronous run's samples (reward {a[1]['train/reward']} vs {sync[1]['train/reward']})")
    lags = [a[k]["train/generation_weight_lag"] for k in (1, 2, 3)]
    check(lags == [0, 1, 1], f"async TP 2: steps 2-3 train on rollouts one version old (lags {lags})")
    print(f"async GRPO with TP 2 trainers + 1 generator rank: lags {lags}, rewards "
          f"{[a[k]['train/reward'] for k in (1, 2, 3)]}")


def case_follows_mp_np4(tmp):
    setup(tmp)
    follows_mp(tmp, "pp2", 2)
    follows_mp(tmp, "cp2", 1)


def case_follows_tp2dp2_np6(tmp):
    setup(tmp)
    follows_mp(tmp, "tp2dp2", 2, trainers=4, dp=2)


def case_shared_mp_np4(tmp):
    """Shared generators with model parallelism on either side: 2 data-parallel trainers sharing one
    TP 2 generator (np 4) follow 2 colocated ranks; megatron TP 2 x DP 2 trainers sharing 1 generator
    rank (np 5: each group's first rank is a client) follow the colocated TP 2 x DP 2 run."""
    setup(tmp)
    rc, out, _ = run(command(tmp, "colocated", steps=3), np=2)
    check(rc == 0, f"2 colocated ranks run (rc {rc})", out)
    rc2, out2, secs = run(command(tmp, "nc_gen_tp2", steps=3, extra=generators(2) + GEN_TP2), np=4)
    check(rc2 == 0, f"2 trainers sharing one TP 2 generator run (rc {rc2})", out2)
    if rc == 0 and rc2 == 0:
        check("every 2 groups share one" in out2, "the 2 trainer ranks share the TP 2 generator", out2)
        reshard_lines(tmp, out2, "2 sharing a TP 2 generator", 2, 2, want=tp2_piece_bytes(tmp))
        compare(metrics(tmp, "colocated"), metrics(tmp, "nc_gen_tp2"), range(1, 4), "2 trainers + a TP 2 generator",
                "the 2 colocated ranks'")
        print(f"2 data-parallel trainers sharing one TP 2 generator followed 2 colocated ranks for 3 steps; {secs:.1f} s")
    two = follows_mp(tmp, "tp2dp2", 1, trainers=4, dp=2)
    check(two is not None, "TP 2 x DP 2 trainers sharing 1 generator rank follow the colocated run")


def case_ppo_follows(tmp):
    """PPO (its demo task, 3 steps of 64 prompts x 1 sample) with 1 trainer + 1 generator rank: the
    policy's and the critic's figures follow one colocated rank within fp32 rounding."""
    ppo_setup(tmp, 256, 32)

    def ppo(tag, extra=()):
        return ppo_command(tmp, tag, PLUGINS[:-1], "ppo.max_num_steps=3", "ppo.val_period=3",
                           "checkpointing.enabled=false", "++rlhost.comm_timeout_s=10", *extra)
    rc, out, _ = run(ppo("colocated"))
    check(rc == 0, f"ppo: one colocated rank runs (rc {rc})", out)
    rc2, out2, secs = run(ppo("nc", generators(1)), np=2)
    check(rc2 == 0, f"ppo: 1 trainer + 1 generator rank run (rc {rc2})", out2)
    if rc != 0 or rc2 != 0:
        return
    one, two = metrics(tmp, "colocated"), metrics(tmp, "nc")
    n = 0
    for s in range(0, 4):
        for k, a in one.get(s, {}).items():
            if (k.startswith(("timing", "rlhost")) or "memory" in k or "seconds" in k or "refit" in k
                    or k == "step"):
                continue
            b = two.get(s, {}).get(k)
            n += 1
            check(b is not None and close(b, a), f"ppo: step {s} {k} {b} follows the colocated run's {a}")
    check(n > 50 and any(k.startswith("train/critic/") for k in one.get(1, {})),
          f"ppo: the policy's and the critic's figures are compared ({n})")
    check(two.get(1, {}).get("train/refit_bytes", 0) > 0, "ppo: the refit to the generator rank is logged")
    # Asynchronous PPO (ppo.async_ppo): step 1 on-policy, as the synchronous run; steps 2-3 on
    # rollouts one step old, the critic training beside the policy as before. The lag counts
    # weight versions: ppo_demo_cpu.yaml's ppo_epochs = 4 policy updates a step.
    rc3, out3, _ = run(ppo("async", generators(1) + ["++ppo.async_ppo.enabled=true",
                                                     "++loss_fn.use_importance_sampling_correction=true"]), np=2)
    check(rc3 == 0, f"ppo: asynchronous PPO runs (rc {rc3})", out3)
    if rc3 == 0:
        a = metrics(tmp, "async")
        lags = [a[s].get("train/generation_weight_lag") for s in (1, 2, 3)]
        check(lags == [0, 4, 4], f"ppo: async steps 2-3 train on rollouts one step (4 policy updates) old (lags {lags})")
        check(close(a[1]["train/reward"], one[1]["train/reward"]), "ppo: async step 1 draws the synchronous run's samples")
        check(any(k.startswith("train/critic/") for k in a.get(3, {})), "ppo: async: the critic trains")
        print(f"ppo: asynchronous, lags {lags}")
    async_ppo = generators(1) + ["++ppo.async_ppo.enabled=true", "++loss_fn.use_importance_sampling_correction=true"]
    for extra, text in [(["++ppo.async_ppo.warmup_generation_lead_steps=2"], "ppo.async_ppo.warmup_generation_lead_steps = 2"),
                        (["++ppo.async_ppo.drop_incomplete_targets_on_restore=false"],
                         "ppo.async_ppo.drop_incomplete_targets_on_restore: false is not implemented"),
                        (["policy.generation.colocated.enabled=true"],
                         "ppo.async_ppo.enabled: true needs policy.generation.colocated.enabled: false")]:
        rc, out, _ = run(ppo("refused", async_ppo + extra), np=2, timeout=60)
        check(rc != 0, f"ppo: {extra} is refused (rc {rc})", out)
        one_error_line(out, text, f"ppo {extra}")
    print(f"ppo: 1 trainer + 1 generator rank followed one colocated rank for 3 steps ({n} figures); {secs:.1f} s")


def one_error_line(out, text, what):
    lines = [l for l in out.splitlines() if "error:" in l]
    check(any(text in l for l in lines), f"{what}: an error line says '{text}'", out)
    # One line per rank: the message itself never spans lines.
    check(all(l.count("error:") == 1 for l in lines), f"{what}: each error is one line", out)


def case_bad_layout(tmp):
    setup(tmp)
    for np, gen, text in [
            (5, 2, "gpus_per_node x num_nodes = 2 x 1 = 2 generator ranks, but 5 ranks were launched: the 3 trainer "
                   "ranks and the 2 generator ranks must divide one another"),
            (2, 2, "gpus_per_node x num_nodes = 2 x 1 = 2 generator ranks, but 2 ranks were launched: at least one"),
            (1, 1, "gpus_per_node x num_nodes = 1 x 1 = 1 generator ranks, but 1 ranks were launched")]:
        rc, out, secs = run(command(tmp, f"bad{np}{gen}", extra=generators(gen)), np=np, timeout=60)
        check(rc != 0, f"{np} ranks with {gen} generator rank(s) are refused (rc {rc})", out)
        one_error_line(out, text, f"{np} ranks, {gen} generators")
        check(secs < 30, f"the refusal comes at start ({secs:.1f} s)", out)
    rc, out, _ = run(command(tmp, "nores", extra=NONCOLOCATED), timeout=60)
    check(rc != 0, "non-colocated without resources is refused", out)
    one_error_line(out, "policy.generation.colocated.resources.gpus_per_node", "no resources")
    refused = [
        (ASYNC, "grpo.async_grpo.enabled: true needs policy.generation.colocated.enabled: false"),
        (ASYNC + generators(1) + ["++grpo.async_grpo.max_trajectory_age_steps=0"],
         "grpo.async_grpo.max_trajectory_age_steps = 0: must be at least 1"),
        (ASYNC + generators(1) + ["++grpo.async_grpo.in_flight_weight_updates=true"], "grpo.async_grpo.in_flight_weight_updates"),
        (ASYNC + generators(1) + ["++grpo.async_grpo.max_generation_failures=3"], "grpo.async_grpo.max_generation_failures = 3"),
        (["++grpo.async_grpo.enabled=true"] + generators(1), "needs loss_fn.use_importance_sampling_correction: true"),
        (ASYNC + generators(1) + ["grpo.max_rollout_turns=2"], "grpo.max_rollout_turns = 2 with grpo.async_grpo.enabled"),
        (GEN_TP2, "policy.generation.vllm_cfg.tensor_parallel_size = 2 does not divide the 1 colocated ranks"),
        (GEN_TP2 + generators(1), "policy.generation.vllm_cfg.tensor_parallel_size = 2 does not divide the 1 generator ranks"),
    ]
    for extra, text in refused:
        rc, out, _ = run(command(tmp, "refused", extra=extra), timeout=60)
        check(rc != 0, f"{' '.join(extra)} is refused (rc {rc})", out)
        one_error_line(out, text, " ".join(extra))
    print("bad layouts and unsupported async settings are refused with one line each")


def case_async_learns(tmp):
    setup(tmp)
    # A short SFT stage, as the demo's (scripts/demo.sh), so that GRPO has rewards to follow.
    sft = [RLHOST, "--plugin", "dtensor", "--plugin", "environments", "--plugin", "tokenizer_hf", "--plugin",
           "model_llama", "--plugin", "kernels_cpu", "--plugin", "sft", "--config",
           os.path.join(SRC, "examples/configs/sft_demo_cpu.yaml"), f"policy.model_name={tmp}/tiny", "sft.seed=1",
           "sft.max_num_steps=60", f"checkpointing.checkpoint_dir={tmp}/sft", f"logger.log_dir={tmp}/sft/logs"]
    rc, out, _ = run(sft)
    check(rc == 0, f"the SFT stage runs (rc {rc})", out)
    if rc != 0:
        return
    model = f"{tmp}/sft/step_60/policy"
    demo = ["grpo.num_prompts_per_step=32", "grpo.num_generations_per_prompt=16", "grpo.val_period=20",
            "grpo.max_val_samples=256", "grpo.val_batch_size=256", "checkpointing.enabled=false", "++rlhost.comm_timeout_s=30"]
    rc, out, secs = run(command(tmp, "async", steps=40, model=model, extra=demo + generators(1) + ASYNC), np=2)
    check(rc == 0, f"async GRPO runs (rc {rc})", out)
    rc2, out2, _ = run(command(tmp, "sync", steps=1, model=model,
                               extra=demo + generators(1) + ["loss_fn.use_importance_sampling_correction=true"]), np=2)
    check(rc2 == 0, f"the synchronous non-colocated run runs (rc {rc2})", out2)
    if rc != 0 or rc2 != 0:
        return
    a, s = metrics(tmp, "async"), metrics(tmp, "sync")
    check(a[1]["train/reward"] == s[1]["train/reward"] and close(a[1]["train/loss"], s[1]["train/loss"]),
          f"step 1 (nothing to overlap yet) is the synchronous run's: reward {a[1]['train/reward']} vs {s[1]['train/reward']}")
    check(a[1]["train/generation_weight_lag"] == 0, "step 1 trains on rollouts of the current weights")
    lags = [a[k]["train/generation_weight_lag"] for k in range(2, 41)]
    check(all(l == 1 for l in lags), f"steps 2-40 train on rollouts exactly one weight version old: {sorted(set(lags))}")
    v0, v1 = a[0]["validation/accuracy"], a[40]["validation/accuracy"]
    check(v1 >= v0 + 0.15, f"validation accuracy rises from {v0:.3f} to {v1:.3f} (by at least 0.15)")
    curve = [round(a[k]["validation/accuracy"], 3) for k in (0, 20, 40)]
    print(f"async GRPO: validation accuracy {curve} at steps 0/20/40; rewards "
          f"{[round(a[k]['train/reward'], 3) for k in (1, 10, 20, 30, 40)]}; {secs:.1f} s")


def rank_pid(tmp, tag, rank):
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if (f"OMPI_COMM_WORLD_RANK={rank}".encode() in env and cmdline.split(b"\0")[0].endswith(b"rlhost")
                and f"{tmp}/{tag}".encode() in cmdline):
            return int(pid)
    return None


def case_stop(tmp, victim_rank, sig, tag, trainers=1):
    setup(tmp)
    full = launch(command(tmp, tag, steps=100000, extra=generators(1)), trainers + 1)
    p = subprocess.Popen(full, env=dict(os.environ, **MPI_ENV), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not os.path.isdir(f"{tmp}/{tag}/ckpt/step_6") and p.poll() is None:
        time.sleep(0.05)
    victim = rank_pid(tmp, tag, victim_rank)
    check(victim is not None, f"found rank {victim_rank}'s process")
    t0 = time.monotonic()
    if victim is not None:
        os.kill(victim, sig)
    try:
        out, _ = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        check(False, "the job stops within 60 s", out)
    secs = time.monotonic() - t0
    check(p.returncode != 0, f"the job exits non-zero (got {p.returncode})", out)
    check(secs < 30, f"the job stops within the 10 s timeout plus start-up ({secs:.1f} s)", out)
    return out, secs, p.returncode


def case_killed_generator(tmp):
    _, secs, rc = case_stop(tmp, 1, signal.SIGKILL, "killed")
    print(f"killed the generator rank after step_6 was saved: the job stopped in {secs:.1f} s (rc {rc})")


def case_trainer_stops(tmp):
    out, secs, rc = case_stop(tmp, 0, signal.SIGTERM, "stopped")
    # The generator rank stops with its own error line: told by its trainer ("its trainer (rank 0)
    # stopped with an error"), or cancelled by the launcher when the trainer exits first.
    check("rlhost rank 1: error:" in out, "the generator rank stops with an error line of its own", out)
    print(f"SIGTERM to the trainer: both ranks stopped in {secs:.1f} s (rc {rc})")


def case_trainer_hangs(tmp):
    """The trainer freezes (SIGSTOP) mid-run: its generator rank, waiting for the next request,
    stops at the communicator's timeout (10 s here) with one line, and the launcher ends the job."""
    out, secs, rc = case_stop(tmp, 0, signal.SIGSTOP, "hung")
    check(any("rlhost rank 1: error:" in l and "timed out" in l for l in out.splitlines()),
          "the generator rank stops with a timeout line of its own", out)
    check(secs >= 5, f"it waited for the timeout rather than stopping at once ({secs:.1f} s)", out)
    print(f"SIGSTOP to the trainer: the generator rank timed out and the job stopped in {secs:.1f} s (rc {rc})")


def case_shared_stops(tmp):
    """2 data-parallel trainer ranks sharing 1 generator rank (np 3): killing a client that is not
    trainer rank 0, or the shared generator rank, stops the job non-zero within the timeout, and a
    frozen client makes the others stop at the timeout with one line each."""
    for victim, sig, tag in [(1, signal.SIGKILL, "client"), (2, signal.SIGKILL, "generator"), (1, signal.SIGSTOP, "frozen")]:
        os.makedirs(os.path.join(tmp, tag), exist_ok=True)
        out, secs, rc = case_stop(os.path.join(tmp, tag), victim, sig, tag, trainers=2)
        if sig == signal.SIGSTOP:
            lines = [l for l in out.splitlines() if "error:" in l]
            check(any("timed out" in l for l in lines), "a rank stops at the timeout", out)
            check(all(l.count("error:") == 1 for l in lines), "each error is one line", out)
        print(f"shared generator rank, {signal.Signals(sig).name} to rank {victim}: the job stopped in {secs:.1f} s (rc {rc})")


CASES = {
    "trainer_hangs": case_trainer_hangs,
    "follows": lambda t: case_follows(t, 1),
    "follows_dp2": lambda t: case_follows(t, 2),
    "follows_1to2": case_follows_1to2,
    "follows_dp2_shared": lambda t: shared(t, 2, 1, broadcast=True),
    "follows_dp4_shared_np6": lambda t: shared(t, 4, 2),
    "multiturn_shared": case_multiturn_shared,
    "shared_mp_np4": case_shared_mp_np4,
    "follows_gen_tp2": case_follows_gen_tp2,
    "colocated_gen_tp2": case_colocated_gen_tp2,
    "follows_tp2": case_follows_tp2,
    "follows_mp_np4": case_follows_mp_np4,
    "follows_tp2dp2_np6": case_follows_tp2dp2_np6,
    "ppo_follows": case_ppo_follows,
    "refit_reshard": case_refit_reshard,
    "refit_reshard_np4": case_refit_reshard_np4,
    "refit_reshard_np6": case_refit_reshard_np6,
    "bad_layout": case_bad_layout,
    "async_learns": case_async_learns,
    "killed_generator": case_killed_generator,
    "trainer_stops": case_trainer_stops,
    "shared_stops": case_shared_stops,
}

if __name__ == "__main__":
    main(CASES, "rlh_grpo_nc_")
