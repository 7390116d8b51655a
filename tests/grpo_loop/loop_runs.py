"""What the loops' mpirun tests share (test_grpo_dp.py, test_loops_mp.py, test_grpo_noncolocated.py):
their command line (CASE RLHOST RLH_TINY_MODEL MPIRUN SOURCE_DIR), OpenMPI's settings for
oversubscribed CPU ranks with one BLAS thread each, the launcher variables scrubbed (a test's own
launch must not inherit the caller's), the failure list and its check, launching and timing a run,
the demo's tiny model, a run's metrics by step, fp32-rounding closeness, the step-by-step
comparison of two GRPO runs, and the main that runs one case in a temporary folder."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

CASE, RLHOST, TINY, MPIRUN, SRC = sys.argv[1:6]

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
for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
          "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
    os.environ.pop(v, None)

failures = []


def check(ok, what, output=""):
    if not ok:
        failures.append(what)
        print(f"FAIL: {what}")
        if output:
            print("---- output ----\n" + output[-6000:] + "\n----------------")


def launch(cmd, np):
    """`cmd` under mpirun on `np` ranks (oversubscribed), or as it is for one rank."""
    return [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", str(np), *cmd] if np > 1 else cmd


def run(cmd, np=1, timeout=300):
    """Runs `cmd` on `np` ranks: (exit code, stdout and stderr together, seconds)."""
    t0 = time.monotonic()
    p = subprocess.run(launch(cmd, np), env=dict(os.environ, **MPI_ENV), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return p.returncode, p.stdout, time.monotonic() - t0


def setup(tmp):
    """The demo's random tiny Llama (character tokenizer for arithmetic) at tmp/tiny."""
    subprocess.run([TINY, f"{tmp}/tiny", "--alphabet", "0123456789+-*=", "--seed", "1"], check=True,
                   stdout=subprocess.DEVNULL)


def ppo_setup(tmp, n_train, n_val):
    """setup(), and PPO's demo task: the last of four random digits, n_train / n_val rows at
    tmp/ptrain.jsonl and tmp/pval.jsonl."""
    setup(tmp)
    import random
    rnd = random.Random(3)
    for name, n in (("ptrain", n_train), ("pval", n_val)):
        with open(f"{tmp}/{name}.jsonl", "w") as f:
            for _ in range(n):
                d = "".join(str(rnd.randrange(10)) for _ in range(4))
                f.write(json.dumps({"input": d, "output": d[-1]}) + "\n")


def ppo_command(tmp, tag, plugins, *settings):
    """rlhost with these plugins (and dataset_jsonl, ppo) on examples/configs/ppo_demo_cpu.yaml over
    ppo_setup's data, logging to tmp/tag/logs, then the settings."""
    cmd = [RLHOST]
    for p in list(plugins) + ["dataset_jsonl", "ppo"]:
        cmd += ["--plugin", p]
    return cmd + ["--config", os.path.join(SRC, "examples/configs/ppo_demo_cpu.yaml"), f"policy.model_name={tmp}/tiny",
                  f"data.train.data_path={tmp}/ptrain.jsonl", f"data.validation.data_path={tmp}/pval.jsonl",
                  f"logger.log_dir={tmp}/{tag}/logs", *settings]


def metrics(tmp, tag):
    """The run's metrics.jsonl as {step: {name: value}}."""
    rows = {}
    with open(os.path.join(tmp, tag, "logs", "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            rows.setdefault(r["step"], {}).update(r)
    return rows


def close(a, b, rel=1e-5, abs_=1e-6):
    return abs(a - b) <= abs_ + rel * abs(b)


def compare(one, two, steps, what, reference="one rank's"):
    """GRPO run `two` against `one` at `steps`: rewards, token counts and validation accuracy equal,
    loss and gradient norm within fp32 rounding."""
    for s in steps:
        a, b = one.get(s, {}), two.get(s, {})
        check("train/reward" in a and "train/reward" in b, f"{what}: step {s} has train/reward in both runs")
        if "train/reward" not in a or "train/reward" not in b:
            continue
        for k in ("train/reward", "train/num_tokens", "train/total_num_tokens"):
            check(a[k] == b[k], f"{what}: step {s} {k} {b[k]} equals {reference} {a[k]}")
        for k in ("train/loss", "train/grad_norm"):
            check(close(b[k], a[k]), f"{what}: step {s} {k} {b[k]} is within fp32 rounding of {reference} {a[k]}")
        if "validation/accuracy" in a:
            check(a["validation/accuracy"] == b.get("validation/accuracy"),
                  f"{what}: step {s} validation accuracy {b.get('validation/accuracy')} equals {a['validation/accuracy']}")


def main(cases, prefix):
    """Runs cases[CASE] in a fresh temporary folder; exits 1 when a check failed."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    try:
        cases[CASE](tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("ok")
