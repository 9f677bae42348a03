"""Slurm launching: reference scripts, refusals before submission, and real jobs on the local cluster.

The cluster tests need the Slurm daemons that scripts/test.sh starts (slurm/local/cluster.sh). When
LOCKSTEP_REQUIRE_SLURM=1 (set by scripts/test.sh once the cluster is up, so always in CI) a missing
cluster is a failure, not a skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from pipeline.launch.slurm.templates import reference_scripts
from pipeline.observability.metrics import read_metrics
from pipeline.run import RunDir

from conftest import REPO, wait_until


def cluster_up() -> bool:
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def slurm():
    """The local cluster; when scripts/test.sh could not start it, one more try here (later, on a quieter machine)."""
    started = False
    if not cluster_up() and os.environ.get("LOCKSTEP_REQUIRE_SLURM") == "1" and os.geteuid() == 0:
        state = os.environ.get("LOCKSTEP_SLURM_STATE", "/tmp/lockstep-slurm")
        started = subprocess.run(["bash", os.path.join(REPO, "slurm", "local", "cluster.sh"), "start"],
                                 timeout=900).returncode == 0
        if started:
            os.environ["SLURM_CONF"] = os.path.join(state, "slurm.conf")
    if not cluster_up():
        if os.environ.get("LOCKSTEP_REQUIRE_SLURM") == "1":
            pytest.fail("LOCKSTEP_REQUIRE_SLURM=1 but no Slurm cluster answers (slurm/local/cluster.sh start)")
        pytest.skip("no Slurm cluster (scripts/test.sh starts one: slurm/local/cluster.sh start)")
    yield
    if started:
        subprocess.run(["bash", os.path.join(REPO, "slurm", "local", "cluster.sh"), "stop"], timeout=120)
        os.environ.pop("SLURM_CONF", None)


def lockstep(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def mean(xs):
    return sum(xs) / len(xs)


# ---- pure: scripts and refusals ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hetjob.sbatch", "colocated.sbatch", "paired-trainer.sbatch", "paired-rollout.sbatch"])
def test_reference_scripts_are_what_submit_renders(name):
    with open(os.path.join(REPO, "slurm", name)) as f:
        assert f.read() == reference_scripts()[name], "run `python -m pipeline.launch.slurm.templates`"


def test_hetjob_script_shape():
    text = reference_scripts()["hetjob.sbatch"]
    lines = text.splitlines()
    het = lines.index("#SBATCH hetjob")
    assert "#SBATCH --nodes=2" in lines[:het] and "#SBATCH --gpus-per-node=8" in lines[:het]
    assert "#SBATCH --nodes=1" in lines[het:] and "#SBATCH --signal=B:USR2@120" in lines
    assert "srun --het-group=0 --nodes=2 --ntasks=16" in text and "srun --het-group=1 --nodes=1 --ntasks=8" in text
    assert "--gpus-per-task=1" in text  # one GPU per engine
    assert "export NCCL_IB_HCA=mlx5" in text and "%j" not in text.split("#SBATCH hetjob")[1]


def test_dry_run_writes_the_exact_script(tmp_path):
    res = lockstep("submit", "configs/cluster-example.yaml", f"run_dir={tmp_path}/run", "--dry-run")
    assert res.returncode == 0, res.stderr
    path = RunDir(tmp_path / "run").sbatch_file("hetjob")
    script = open(path).read()
    assert res.stdout.startswith(f"# {path}") and script in res.stdout
    expected = reference_scripts()["hetjob.sbatch"].replace("/lustre/scratch/lockstep/runs/example", str(tmp_path / "run"))
    expected = expected.replace("python3 -u -m pipeline.launch.slurm.driver", f"{sys.executable} -u -m pipeline.launch.slurm.driver")
    expected = expected.replace("python3 -m pipeline.launch.component", f"{sys.executable} -m pipeline.launch.component")
    assert script == expected


@pytest.mark.parametrize("overrides, fragment", [
    (["--cluster", "no-such-cluster"], "cluster profile 'no-such-cluster' not found (available: frontier-amd, generic-nvidia, local)"),
    (["slurm.trainer.gpus_per_node=16", "slurm.trainer.tasks_per_node=8"], "gpus_per_node = 16 but profile 'generic-nvidia' has 8"),
    (["train.num_gpus=8"], "nodes x tasks_per_node = 16 but train.num_gpus = 8"),
    (["engine.num_engines=4"], "8 engines but engine.num_engines = 4"),
    (["--cluster", "local"], "slurm.trainer.gpus_per_node = 8 but profile 'local' has 0 GPUs per node"),
    (["slurm.mode=bogus"], "'bogus' is not one of"),
    (["weights.type=tensor"], "weights.type=tensor hands CUDA IPC handles to engines on trainer rank 0's node"),
])
def test_bad_requests_refused_before_submission(tmp_path, overrides, fragment):
    res = lockstep("submit", "configs/cluster-example.yaml", f"run_dir={tmp_path}/run", *overrides)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert fragment in res.stderr
    assert not os.path.exists(RunDir(tmp_path / "run").slurm_dir)  # nothing submitted, nothing written


def test_bad_profile_file_refused(tmp_path):
    bad = tmp_path / "weird.yaml"
    bad.write_text("name: weird\nbind: telepathy\n")
    res = lockstep("submit", "configs/tiny-slurm-local.yaml", f"run_dir={tmp_path}/run", "--cluster", str(bad), "--dry-run")
    assert res.returncode == 2 and "bind 'telepathy' is not hostname, loopback or interface:NAME" in res.stderr


# ---- real jobs on the local cluster -------------------------------------------------------------------

LOCAL = ["configs/tiny-slurm-local.yaml", "logging.progress=false"]


@pytest.mark.slurm
@pytest.mark.slow
def test_hetjob_grpo_run_learns(slurm, tmp_path):
    res = lockstep("submit", *LOCAL, f"run_dir={tmp_path}/run", "num_rollout=50", "--wait")
    assert res.returncode == 0, res.stderr[-3000:]
    records = read_metrics(f"{tmp_path}/run")
    assert len(records) == 50
    first, last = mean([r["rollout/reward_mean"] for r in records[:3]]), mean([r["rollout/reward_mean"] for r in records[-3:]])
    assert last > first + 0.15, (first, last)
    job = res.stderr.split("submitted ")[1].split()[0]
    states = subprocess.run(["sacct", "-j", job, "-X", "-n", "-o", "JobID,State,NodeList", "--parsable2"],
                            capture_output=True, text=True).stdout.split()
    rows = [s.split("|") for s in states]
    assert [r[0] for r in rows] == [f"{job}+0", f"{job}+1"] and all(r[1] == "COMPLETED" for r in rows)
    assert rows[0][2] != rows[1][2]  # trainer and rollout components on different nodes


@pytest.mark.slurm
@pytest.mark.slow
def test_failed_component_ends_the_job(slurm, tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "submit", *LOCAL, f"run_dir={run_dir}",
                          "num_rollout=500", "--wait"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_until(lambda: len(read_metrics(str(run_dir))) >= 2, timeout=180)
    engine = json.load(open(RunDir(run_dir).engine_file(0)))
    os.kill(engine["pid"], 9)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 1, err[-2000:]
    assert "srun_engines" in err or "engine" in err
    failed = RunDir(run_dir).failure()
    assert failed["component"] == "srun_engines"
    job = err.split("submitted ")[1].split()[0]
    assert wait_until(lambda: "RUNNING" not in subprocess.run(["squeue", "-h", "-j", job], capture_output=True,
                                                                text=True).stdout, timeout=60)  # allocation released


@pytest.mark.slurm
@pytest.mark.slow
def test_preemption_checkpoints_requeues_and_resumes(slurm, tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "submit", *LOCAL, f"run_dir={run_dir}",
                          "num_rollout=30", "--wait"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_until(lambda: len(read_metrics(str(run_dir))) >= 5, timeout=180)
    job = json.load(open(RunDir(run_dir).trainer_file))["job"]
    subprocess.run(["scancel", "-s", "USR2", "-b", job], check=True)  # what Slurm sends at pre-emption / time limit
    out, err = p.communicate(timeout=400)
    assert p.returncode == 0, err[-3000:]
    records = read_metrics(str(run_dir))
    assert [r["step"] for r in records] == list(range(30))
    ckpt = json.load(open(RunDir(run_dir).checkpoint_done_file)) if RunDir(run_dir).checkpoint_done() else None
    trainer_log = open(RunDir(run_dir).log_file("trainer_0")).read()
    assert "checkpointed at step" in trainer_log and "resumed from checkpoint step" in trainer_log
    del ckpt
    requeued = subprocess.run(["sacct", "-j", job, "-D", "-X", "-n", "-o", "State", "--parsable2"], capture_output=True,
                              text=True).stdout.split()
    assert "REQUEUED" in requeued and requeued[-1] == "COMPLETED", requeued


@pytest.mark.slurm
@pytest.mark.slow
def test_paired_jobs_find_each_other(slurm, tmp_path):
    res = lockstep("submit", *LOCAL, f"run_dir={tmp_path}/run", "num_rollout=8", "slurm.mode=paired", "--wait")
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(read_metrics(f"{tmp_path}/run")) == 8
    assert res.stderr.count("job ") >= 2


@pytest.mark.slurm
@pytest.mark.slow
def test_colocated_job(slurm, tmp_path):
    """One component runs trainer and engine on one node; weights go as shared-memory handles (weights.type=tensor)."""
    res = lockstep("submit", *LOCAL, f"run_dir={tmp_path}/run", "num_rollout=6", "slurm.mode=colocated",
                   "slurm.trainer.cpus_per_task=3", "weights.type=tensor", "--wait")
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(read_metrics(f"{tmp_path}/run")) == 6


@pytest.mark.slurm
@pytest.mark.slow
def test_nightly_matrix_job_array_and_report(slurm, tmp_path):
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(f"""base: configs/tiny-slurm-local.yaml
out_dir: {tmp_path}/nightly
overrides: [num_rollout=4, rollout.rollout_batch_size=8, train.global_batch_size=128, logging.progress=false,
            logging.plot=false, checkpoint.export_hf=false]
nodes: [1]
models: [tiny-dense, tiny-moe]
modes: [colocated]
""")
    res = lockstep("nightly", "submit", str(matrix), "--wait")
    assert res.returncode == 0, res.stderr[-3000:]
    submitted = json.load(open(tmp_path / "nightly" / "submitted.json"))
    assert len(submitted["arrays"]) == 1 and len(submitted["arrays"][0]["runs"]) == 2
    job = submitted["arrays"][0]["job"]
    assert f'"{job}_0": "COMPLETED"' in res.stderr and f'"{job}_1": "COMPLETED"' in res.stderr
    assert "| n1-tiny-moe-colocated | 1 | tiny-moe | colocated | 4 |" in res.stdout
    assert os.path.getsize(tmp_path / "nightly" / "scaling.png") > 5000
