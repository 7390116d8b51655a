#!/usr/bin/env python3
"""Failure behaviour of rlhost under mpirun on CPU ranks (ctest comm.failure.*).

Each case runs `rlhost` with the comm_probe test algorithm (tests/comm/plugins/comm_probe.cpp)
on N ranks and checks what the ranks print, how they exit and how long it takes:

  healthy         4 ranks finish; only rank 0 writes metrics.jsonl
  sleeping_rank   rank 1 sleeps 60 s mid-run; the others fail within ~2x the 2 s timeout,
                  each with one line naming rank 1
  killed_rank     rank 2 is killed (SIGKILL) mid-run; mpirun stops the job at once, naming it
  killed_rank_kept_alive
                  the same under `mpirun --enable-recovery` (the launcher leaves the others
                  running): they find out by the deadline, each names rank 2 and exits non-zero
  failing_rank    rank 1 stops with its own error; the job stops, that line is printed
  late_rank       rank 2 starts 60 s late; the others give up at start within the timeout
  cluster_mismatch cluster.num_nodes x gpus_per_node = 1 x 4 on 2 ranks: every rank fails at
                  start naming both
  bad_env         RANK/WORLD_SIZE malformed: one line naming the variable (no mpirun)
  env_without_mpi a torchrun-style env of 2 ranks on CPU: no communicator can run, one line
  recv_any_healthy  3 ranks: rank 0 takes each step's messages of ranks 1 and 2 with recv_any
                  (COMM 0.2), whichever comes first; every rank finishes
  recv_any_sleeping_sender  rank 1 sleeps 60 s before sending: rank 0, which took rank 2's
                  message, fails within the 2 s timeout in recv_any with one line naming rank 1
  recv_any_killed_sender  rank 2 is killed before sending, under --enable-recovery: rank 0 finds
                  out at the deadline, names rank 2 in one line and exits non-zero

usage: test_failures.py CASE RLHOST COMM_PROBE_PLUGIN MPIRUN
"""
import os
import re
import subprocess
import sys
import tempfile
import time

CASE, RLHOST, PROBE, MPIRUN = sys.argv[1:5]

MPI_ENV = {
    "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
    "OMPI_MCA_btl": "self,vader",
    "OMPI_MCA_pml": "ob1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
}
# Variables of other launchers must not leak into the runs.
for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
          "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
    os.environ.pop(v, None)

failures = []


def check(ok, what, output=""):
    if not ok:
        failures.append(what)
        print(f"FAIL: {what}")
        if output:
            print("---- output ----\n" + output + "\n----------------")


def write_config(tmp, timeout_s=2.0, probe=None, cluster=None, tp=2):
    probe = probe or {}
    lines = [
        "rlhost:",
        "  algorithm: comm_probe",
        f"  comm_timeout_s: {timeout_s}",
        "comm_probe:",
        "  steps: 4",
        f"  tp: {tp}",
    ]
    lines += [f"  {k}: {v}" for k, v in probe.items()]
    lines += ["logger:", f"  log_dir: {tmp}/logs", "  console_enabled: false"]
    if cluster:
        lines += ["cluster:"] + [f"  {k}: {v}" for k, v in cluster.items()]
    path = os.path.join(tmp, "probe.yaml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def rlhost_cmd(config):
    return [RLHOST, "--plugin", PROBE, "--config", config]


def mpirun(np, cmd, extra=(), timeout=120):
    full = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", str(np), *extra, *cmd]
    env = dict(os.environ, **MPI_ENV)
    t0 = time.monotonic()
    p = subprocess.run(full, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return p.returncode, p.stdout, time.monotonic() - t0


def error_lines(out):
    return [l for l in out.splitlines() if re.match(r"rlhost( rank \d+)?: error: ", l)]


def rank_line(out, rank):
    return [l for l in error_lines(out) if l.startswith(f"rlhost rank {rank}: error: ")]


def case_healthy(tmp):
    cfg = write_config(tmp, 20, cluster={"num_nodes": 1, "gpus_per_node": 0})
    rc, out, _ = mpirun(4, rlhost_cmd(cfg))
    check(rc == 0, f"4 healthy ranks exit 0 (got {rc})", out)
    for r in range(4):
        check(f"comm_probe: rank {r} of 4 finished 4 steps" in out, f"rank {r} finished", out)
    check("[rlhost rank 0] info: world: 4 ranks started by mpirun (OMPI_COMM_WORLD_SIZE=4), communicator 'comm_mpi'" in out,
          "rank 0 logs the world with its rank prefix", out)
    rows = open(os.path.join(tmp, "logs", "metrics.jsonl")).read().splitlines()
    sums = [l for l in rows if "probe/sum" in l]
    check(len(sums) == 4, f"metrics.jsonl has one row per step, written by rank 0 only (got {len(sums)} rows)", "\n".join(rows))


def case_sleeping_rank(tmp):
    cfg = write_config(tmp, 2, probe={"sleep_rank": 1, "sleep_s": 60, "at_step": 1})
    rc, out, secs = mpirun(4, rlhost_cmd(cfg))
    check(rc != 0, "the job exits non-zero", out)
    # 2 s timeout + at most 0.5 s of queries + start-up; a hang would take the full 60 s.
    check(secs < 20, f"the job ends within the timeout, not after the sleep ({secs:.1f} s)", out)
    for r in (0, 2, 3):
        lines = rank_line(out, r)
        check(len(lines) == 1, f"rank {r} prints exactly one error line (got {len(lines)})", out)
        if lines:
            l = lines[0]
            check("timed out after 2 s" in l and "rank 1 did not answer" in l,
                  f"rank {r}'s line names the collective's timeout and rank 1: {l}", out)


def case_killed_rank(tmp):
    cfg = write_config(tmp, 20, probe={"kill_rank": 2, "at_step": 1})
    rc, out, secs = mpirun(4, rlhost_cmd(cfg))
    check(rc != 0, "the job exits non-zero", out)
    check(secs < 20, f"the job ends within the 20 s timeout ({secs:.1f} s)", out)
    check(re.search(r"process rank 2 .*exited on signal 9", out) is not None, "mpirun names the killed rank 2", out)
    for line in error_lines(out):
        # Survivors that were inside a collective say why they stopped (mpirun's SIGTERM).
        check("cancelled" in line or "rank 2" in line, f"a survivor's line says why it stopped: {line}", out)


def case_killed_rank_kept_alive(tmp):
    cfg = write_config(tmp, 2, probe={"kill_rank": 2, "at_step": 1})
    wrapped = ["sh", "-c", '"$@"; echo "exit code of rank $OMPI_COMM_WORLD_RANK: $?"', "sh", *rlhost_cmd(cfg)]
    rc, out, secs = mpirun(4, wrapped, extra=["--enable-recovery"])
    check(secs < 20, f"the survivors end within the timeout ({secs:.1f} s)", out)
    for r in (0, 1, 3):
        lines = rank_line(out, r)
        check(len(lines) == 1 and "rank 2 did not answer" in lines[0] and "timed out after 2 s" in lines[0],
              f"rank {r} names rank 2 in one line", out)
        m = re.search(rf"exit code of rank {r}: (\d+)", out)
        check(m is not None and m.group(1) != "0", f"rank {r} exits non-zero", out)


def case_failing_rank(tmp):
    cfg = write_config(tmp, 20, probe={"fail_rank": 1, "at_step": 2})
    rc, out, secs = mpirun(4, rlhost_cmd(cfg))
    check(rc != 0, "the job exits non-zero", out)
    check(secs < 20, f"the job stops before the timeout ({secs:.1f} s)", out)
    lines = rank_line(out, 1)
    check(len(lines) == 1 and "comm_probe: rank 1 was told to fail" in lines[0], "rank 1 prints its own error", out)


def case_late_rank(tmp):
    cfg = write_config(tmp, 3)
    late = ["sh", "-c", 'if [ "$OMPI_COMM_WORLD_RANK" = 2 ]; then sleep 60; fi; exec "$@"', "sh", *rlhost_cmd(cfg)]
    rc, out, secs = mpirun(3, late)
    check(rc != 0, "the job exits non-zero", out)
    check(secs < 20, f"the waiting ranks give up within the timeout ({secs:.1f} s)", out)
    for r in (0, 1):
        lines = rank_line(out, r)
        check(len(lines) == 1 and "MPI did not start within 3 s on rank" in lines[0], f"rank {r} says the world did not start", out)


def case_cluster_mismatch(tmp):
    cfg = write_config(tmp, 20, cluster={"num_nodes": 1, "gpus_per_node": 4})
    rc, out, secs = mpirun(2, rlhost_cmd(cfg))
    check(rc != 0, "the job exits non-zero", out)
    check(secs < 20, f"it fails at start ({secs:.1f} s)", out)
    for r in (0, 1):
        lines = rank_line(out, r)
        check(len(lines) == 1 and "cluster.num_nodes x cluster.gpus_per_node = 1 x 4 = 4" in lines[0]
              and "mpirun (OMPI_COMM_WORLD_SIZE=2) started 2 ranks" in lines[0], f"rank {r} names both sizes", out)


def case_bad_env(tmp):
    cfg = write_config(tmp, 2)
    env = dict(os.environ, RANK="0", WORLD_SIZE="two")
    p = subprocess.run(rlhost_cmd(cfg), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    check(p.returncode != 0, "a malformed WORLD_SIZE fails", p.stdout)
    lines = error_lines(p.stdout)
    check(len(lines) == 1 and "environment variable WORLD_SIZE='two' is not a positive integer" in lines[0],
          "one line names the variable", p.stdout)


def case_env_without_mpi(tmp):
    cfg = write_config(tmp, 2)
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    t0 = time.monotonic()
    p = subprocess.run(rlhost_cmd(cfg), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    check(p.returncode != 0, "a torchrun-style launch without a communicator for it fails", p.stdout)
    check(time.monotonic() - t0 < 20, "at once", p.stdout)
    lines = error_lines(p.stdout)
    check(len(lines) == 1 and "communicator" in lines[0] and "comm_mpi" in lines[0], "one line saying why", p.stdout)


def case_recv_any_healthy(tmp):
    cfg = write_config(tmp, 20, probe={"recv_any": "true"}, tp=1)
    rc, out, _ = mpirun(3, rlhost_cmd(cfg))
    check(rc == 0, f"3 ranks with recv_any exit 0 (got {rc})", out)
    for r in range(3):
        check(f"comm_probe: rank {r} of 3 finished 4 steps" in out, f"rank {r} finished", out)


def case_recv_any_sleeping_sender(tmp):
    cfg = write_config(tmp, 2, probe={"recv_any": "true", "sleep_rank": 1, "sleep_s": 60, "at_step": 1}, tp=1)
    rc, out, secs = mpirun(3, rlhost_cmd(cfg))
    check(rc != 0, "the job exits non-zero", out)
    check(secs < 20, f"the job ends within the timeout, not after the sleep ({secs:.1f} s)", out)
    lines = rank_line(out, 0)
    check(len(lines) == 1, f"rank 0 prints exactly one error line (got {len(lines)})", out)
    if lines:
        check("recv_any (int64 x 2 from any rank)" in lines[0] and "timed out after 2 s" in lines[0]
              and "rank 1 did not answer" in lines[0], f"rank 0's line names recv_any, the timeout and rank 1: {lines[0]}", out)


def case_recv_any_killed_sender(tmp):
    cfg = write_config(tmp, 2, probe={"recv_any": "true", "kill_rank": 2, "at_step": 1}, tp=1)
    wrapped = ["sh", "-c", '"$@"; echo "exit code of rank $OMPI_COMM_WORLD_RANK: $?"', "sh", *rlhost_cmd(cfg)]
    rc, out, secs = mpirun(3, wrapped, extra=["--enable-recovery"])
    check(secs < 20, f"the survivors end within the timeout ({secs:.1f} s)", out)
    lines = rank_line(out, 0)
    check(len(lines) == 1 and "recv_any" in lines[0] and "rank 2 did not answer" in lines[0] and "timed out after 2 s" in lines[0],
          "rank 0 names rank 2 in one recv_any line", out)
    m = re.search(r"exit code of rank 0: (\d+)", out)
    check(m is not None and m.group(1) != "0", "rank 0 exits non-zero", out)


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}
if CASE not in CASES:
    sys.exit(f"unknown case {CASE}; known: {', '.join(CASES)}")
with tempfile.TemporaryDirectory() as tmp:
    CASES[CASE](tmp)
if failures:
    print(f"{len(failures)} check(s) failed in case {CASE}")
    sys.exit(1)
print(f"case {CASE}: ok")
