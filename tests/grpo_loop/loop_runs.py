"""What the loops' mpirun tests share (test_grpo_dp.py, test_loops_mp.py, test_grpo_noncolocated.py):
OpenMPI's settings for oversubscribed CPU ranks with one BLAS thread each, the launcher variables
scrubbed (a test's own launch must not inherit the caller's), the failure list and its check, a
run's metrics by step, fp32-rounding closeness, and the main that runs one case in a temporary
folder."""
import json
import os
import shutil
import sys
import tempfile

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


def main(cases, case, prefix):
    """Runs cases[case] in a fresh temporary folder; exits 1 when a check failed."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    try:
        cases[case](tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("ok")
