"""Slurm launching: reference scripts, refusals before submission, and real jobs on the local cluster.

The cluster tests need the Slurm daemons that scripts/test.sh starts (slurm/local/cluster.sh). When
LOCKSTEP_REQUIRE_SLURM=1 (set by scripts/test.sh once the cluster is up, so always in CI) a missing
cluster is a failure, not a skip.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pipeline.buffer.reader import BufferReader
from pipeline.launch.slurm.follow import describe
from pipeline.launch.slurm.jobctl import job_state, parse_node_events, parse_states, torn
from pipeline.launch.slurm.recovery import Action, Failure, RecoveryPolicy, SparePool, safe_exclusions
from pipeline.launch.slurm.steps import relocate
from pipeline.launch.slurm.templates import reference_scripts
from pipeline.models.hf_io import read_state_dict
from pipeline.observability.status import status
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


def lockstep(*args, timeout=600, env=None):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


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
    assert "srun --het-group=0 --nodes=2 --ntasks=16" in text
    engines = [line for line in lines if line.startswith("#   engine_")]  # one step per engine: restarted alone
    assert len(engines) == 8 and all("srun --het-group=1 --nodes=1 --ntasks=1" in e for e in engines)
    assert engines[7].endswith("--index 7") and all("--gpus-per-task=1" in e and "--overlap" not in e for e in engines)
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
    (["slurm.mode=colocated", "slurm.trainer.spare_nodes=1"], "a colocated job's engines must stay on its trainer's nodes"),
    (["slurm.rollout.spare_nodes=-1"], "spare_nodes (-1) must be >= 0"),
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


def test_sacct_states_fold_into_one_job_state():
    out = "7+0|REQUEUED\n7+1|PENDING\n7+0.batch|CANCELLED\n"
    assert parse_states(out) == {"7+0": "REQUEUED", "7+1": "PENDING"}  # steps are not the job
    assert job_state(parse_states(out)) == "REQUEUED"  # a requeue is not an end
    assert job_state({"7+0": "RUNNING", "7+1": "COMPLETED"}) == "RUNNING"
    assert job_state(parse_states("7+0|COMPLETED\n7+1|CANCELLED by 0\n")) == "CANCELLED"
    assert job_state({"7+0": "COMPLETED", "7+1": "COMPLETED"}) == "COMPLETED"
    assert job_state({}) == "UNKNOWN"
    # after a node failure Slurm requeues only the hetjob component on that node: the job never starts again
    assert torn({"7+0": "PENDING", "7+1": "COMPLETED"}) and not torn({"7+0": "PENDING", "7+1": "REQUEUED"})
    assert not torn({"7": "PENDING"}) and not torn({"7+0": "COMPLETED", "7+1": "FAILED"})


def test_node_events_name_the_node_that_went_down():
    rows = parse_node_events("n2|2026-12-04T23:57:11|DOWN|chaos\n|2026-12-04T23:11:05||Cluster Registered TRES\n")
    assert rows == [{"node": "n2", "start": "2026-12-04T23:57:11", "state": "DOWN", "reason": "chaos"}]


def test_recovery_restarts_then_requeues_without_the_node_then_gives_up():
    policy = RecoveryPolicy(engine_restarts=1, restarts=2, attempt=1, max_attempts=2)
    assert policy.decide(Failure("engine_0", "n2", "exit status 137"))[0] is Action.RESTART
    assert policy.decide(Failure("trainer", "n1", "exit status 1"))[0] is Action.RESTART
    f = Failure("trainer", "n1", "no heartbeat for 70 s")
    action, why = policy.decide(f)  # restarts are left, but n1 failed twice: the node is suspect
    assert action is Action.REQUEUE and why == "second failure on node n1" and policy.exclude(f) == ["n1"]
    f = Failure("engine_0", "n3", "exit status 137")
    action, why = policy.decide(f)
    assert action is Action.REQUEUE and why == "engine_0 is out of restarts (1)" and policy.exclude(f) == ["n1", "n3"]
    last = RecoveryPolicy(engine_restarts=0, restarts=0, attempt=2, max_attempts=2)
    action, why = last.decide(Failure("rollout", None, "exit status 1"))
    assert action is Action.FAIL and "attempt 2/2 was the last" in why
    assert safe_exclusions(["n1", "n3"], partition_nodes=4, needed_nodes=2) == ["n1", "n3"]
    assert safe_exclusions(["n1", "n3"], partition_nodes=3, needed_nodes=2) == ["n1"]  # the job must still fit
    assert safe_exclusions(["n1"], partition_nodes=0, needed_nodes=2) == []


def test_a_user_error_is_not_restarted_moved_or_requeued():
    policy = RecoveryPolicy(engine_restarts=3, restarts=3, attempt=1, max_attempts=3,
                            pools={"rollout": SparePool(["n1", "n2"], needed=1)})
    action, why = policy.decide(Failure("engine_0", "n1", "exit status 2", user_error=True))
    assert action is Action.FAIL and why.startswith("engine_0 failed on a user error")
    assert policy.used["engine_0"] == 0 and not policy.pools["rollout"].bad  # no restart or spare spent
    assert policy.decide(Failure("engine_0", "n1", "exit status 1"))[0] is Action.RESTART


def test_a_bad_nodes_steps_move_to_one_spare_until_none_is_left():
    pools = {"rollout": SparePool(["n2", "n3", "n4"], needed=1)}  # slurm.rollout: nodes 1, spare_nodes 2
    policy = RecoveryPolicy(engine_restarts=3, restarts=2, attempt=1, max_attempts=2, pools=pools)
    # the node went down: every step on it (two engines, the rollout manager) moves to the same spare
    for step in ("engine_0", "engine_1", "rollout"):
        action, why = policy.decide(Failure(step, "n2", "node failure", node_down=True))
        assert (action, why) == (Action.MOVE, "node n2 down: to spare node n3"), step
    assert pools["rollout"].where("n2") == "n3" and policy.used["engine_0"] == 0  # a move is not a restart
    # an ordinary crash on the spare restarts in place; a second one there moves on to the last spare
    assert policy.decide(Failure("engine_0", "n3", "exit status 137"))[0] is Action.RESTART
    assert policy.decide(Failure("engine_0", "n3", "exit status 137")) == (Action.MOVE, "second failure on node n3: to spare node n4")
    assert pools["rollout"].where("n2") == "n4" and pools["rollout"].bad == {"n2", "n3"}
    action, why = policy.decide(Failure("engine_1", "n4", "node failure", node_down=True))
    assert action is Action.REQUEUE and why == "node n4 down, no spare node left"
    # the trainer has no spare: a node failure under it requeues the job without the node
    action, why = policy.decide(Failure("trainer", "n1", "node failure", node_down=True))
    assert action is Action.REQUEUE and why == "node n1 down" and policy.exclude(Failure("trainer", "n1", "")) == ["n1", "n2", "n3", "n4"]


def test_a_moved_step_is_pinned_to_its_spare_or_kept_off_bad_nodes():
    engine = ["srun", "--het-group=1", "--nodes=1", "--relative=1", "--kill-on-bad-exit=1", "python3", "-m",
              "pipeline.launch.component", "engine", "--index", "1"]
    assert relocate(engine, node="n4") == ["srun", "--het-group=1", "--nodes=1", "--kill-on-bad-exit=1", "--nodelist=n4",
                                           *engine[5:]]
    assert relocate(relocate(engine, node="n4"), node="n5")[4:6] == ["--nodelist=n5", "python3"]
    trainer = ["srun", "--nodes=2", "--ntasks=16", "apptainer", "exec", "img.sif", "python3", "--exclude=x"]
    assert relocate(trainer, exclude=["n3", "n1"]) == ["srun", "--nodes=2", "--ntasks=16", "--exclude=n1,n3", *trainer[3:]]


def test_a_node_failure_counts_only_when_the_steps_current_start_saw_it(tmp_path):
    """srun logs outlive restarts and job attempts: a "Node failure" line an earlier start of the step
    wrote must not turn this start's ordinary end (exit 0) or crash into a node failure."""
    from types import SimpleNamespace

    from pipeline.launch.slurm.driver import SlurmDriver, log_size

    log_path = tmp_path / "srun_trainer.log"
    log_path.write_text("srun: error: Node failure on n1\n")  # attempt 1 of the job
    driver, p = SlurmDriver(str(tmp_path)), SimpleNamespace(log_path=str(log_path))
    driver.log_start = {"trainer": log_size(str(log_path))}  # attempt 2 starts the step
    assert driver.node_failure("trainer", p) is None
    with open(log_path, "a") as f:
        f.write("srun: error: n3: task 0: Killed\n")
    assert driver.node_failure("trainer", p) is None and driver.node_of("trainer", p) == "n3"
    with open(log_path, "a") as f:
        f.write("srun: error: Node failure on n3\n")
    assert driver.node_failure("trainer", p) == "n3"


def test_a_node_failure_counts_only_for_a_step_that_ran_on_that_node(tmp_path):
    """With --no-kill, srun tells every step of the allocation about a lost node: the rollout manager
    (seen beating on n1) ending normally after engine_1's node n3 went down is not a failure on n3 (it
    was moved to a spare and restarted: the spare-node test's second 'move'), while a step seen on n3 is,
    and a step never seen beating (no heartbeat yet) still counts it, as before."""
    import json
    from types import SimpleNamespace

    from pipeline.launch.slurm.driver import SlurmDriver

    driver = SlurmDriver(str(tmp_path))
    driver.log_start = {}
    os.makedirs(driver.rundir.heartbeat_dir)
    for component, node in (("rollout", "n1"), ("engine_1", "n3")):
        with open(driver.rundir.heartbeat_file(component), "w") as f:
            json.dump({"component": component, "node": node, "beat": 0.0}, f)
    driver.note_nodes(driver.rundir.heartbeats())
    driver.rundir.clear_heartbeats()  # both ended: their heartbeats are withdrawn, the driver remembers
    for step in ("rollout", "engine_1", "trainer"):
        (tmp_path / f"srun_{step}.log").write_text("srun: error: Node failure on n3\n")
    log = lambda step: SimpleNamespace(log_path=str(tmp_path / f"srun_{step}.log"))  # noqa: E731
    assert driver.node_failure("rollout", log("rollout")) is None
    assert driver.node_failure("engine_1", log("engine_1")) == "n3"
    assert driver.node_failure("trainer", log("trainer")) == "n3"  # never seen: counted
    driver.prepare_restart("engine_1")  # restarted elsewhere: what was seen of it no longer says where it runs
    assert "engine_1" not in driver.step_nodes


def test_spare_nodes_are_asked_for_and_the_job_survives_a_node(tmp_path):
    res = lockstep("submit", "configs/cluster-example.yaml", f"run_dir={tmp_path}/run", "slurm.rollout.spare_nodes=1",
                   "--dry-run")
    assert res.returncode == 0, res.stderr
    rollout = res.stdout.split("#SBATCH hetjob")[1]
    assert "#SBATCH --nodes=2\n" in rollout and "#SBATCH --no-kill" in rollout  # 1 node + 1 spare
    assert "--no-kill" not in res.stdout.split("#SBATCH hetjob")[0]
    assert "srun --het-group=1 --nodes=1 --ntasks=1 --ntasks-per-node=1 --relative=0" in rollout  # engines on node 0


def test_follower_lines_and_status_table(tmp_path):
    rd = RunDir(tmp_path)
    events = [{"event": "start", "job": "5", "attempt": 1, "max_attempts": 4, "resume_step": 0, "nodes": {"0": "n1", "1": "n2"}},
              {"event": "failure", "job": "5", "attempt": 1, "component": "engine_0", "node": "n2", "reason": "exit status 137",
               "action": "restart", "why": "restart 1/3", "step": 12},
              {"event": "interrupted", "job": "5", "attempt": 1},
              {"event": "start", "job": "5", "attempt": 2, "max_attempts": 4, "resume_step": 60, "nodes": {"0": "n1", "1": "n3"}},
              {"event": "end", "job": "5", "attempt": 2, "status": "completed"}]
    for e in events:
        rd.append_event(e)
    assert [e["event"] for e in rd.read_events()] == [e["event"] for e in events]
    lines = [describe(e) for e in rd.read_events()]
    assert lines[1] == "engine_0 failed on n2 (exit status 137): restarted in place (restart 1/3)"
    move = {"event": "failure", "job": "5", "attempt": 1, "component": "engine_0", "node": "n2", "reason": "node failure",
            "action": "move", "why": "node n2 down: to spare node n4", "to": "n4", "step": 3}
    assert describe(move) == "engine_0 failed on n2 (node failure): restarted on spare node n4 (node n2 down: to spare node n4)"
    assert lines[3] == "job 5 requeued (attempt 2/4), resuming from step 60"
    text = status(str(tmp_path))
    assert "1        5" in text and "trainer=n1 rollout=n2" in text and "ended by Slurm" in text
    assert "step 60       completed" in text and "engine_0   n2     12" in text


# ---- real jobs on the local cluster -------------------------------------------------------------------

LOCAL = ["configs/tiny-slurm-local.yaml", "logging.progress=false", "logging.plot=false"]
# 8 prompts x 16 samples a step instead of 32 x 16 (one optimizer step each): for the jobs whose claims are
# about launching and recovery, not learning (that is test_hetjob_grpo_run_learns's)
SMALL = ["rollout.rollout_batch_size=8", "train.global_batch_size=128"]


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


def submit_bg(run_dir, *overrides):
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "submit", *LOCAL, f"run_dir={run_dir}", *overrides,
                             "--wait"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def pid_of(run_dir, component: str) -> int:
    """The process of a component, from its heartbeat (the fake nodes all run on this machine)."""
    return RunDir(run_dir).heartbeats()[component]["pid"]


def steps_done(run_dir) -> int:
    return len(read_metrics(str(run_dir)))


@pytest.mark.slurm
@pytest.mark.slow
def test_component_out_of_restarts_ends_the_job_named(slurm, tmp_path):
    run_dir = tmp_path / "run"
    p = submit_bg(run_dir, *SMALL, "num_rollout=500", "engine.max_restarts=0", "slurm.max_requeues=0")
    assert wait_until(lambda: steps_done(run_dir) >= 2, timeout=180)
    os.kill(pid_of(run_dir, "engine_0"), 9)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 1 and "Traceback" not in err, err[-2000:]
    assert "engine_0 failed on n2 (exit status" in err and "giving up (engine_0 is out of restarts (0)" in err, err
    assert "lockstep: error: job" in err and "ended FAILED" in err, err
    assert RunDir(run_dir).failure()["component"] == "engine_0"
    job = RunDir(run_dir).read_events()[0]["job"]
    assert wait_until(lambda: "RUNNING" not in subprocess.run(["squeue", "-h", "-j", job], capture_output=True,
                                                                text=True).stdout, timeout=60)  # allocation released


@pytest.mark.slurm
@pytest.mark.slow
def test_a_component_dying_of_a_user_error_ends_the_job_at_once_with_its_line(slurm, tmp_path):
    """A deterministic failure under srun: the engine exits with USER_ERROR_EXIT (a fault makes it, as a
    checkpoint edited after the launcher's checks would); srun passes that status through, and the job
    ends at its first failure with the engine's own line: no restart in place although restarts are
    left, no spare node, no requeue."""
    run_dir = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "submit", *LOCAL, f"run_dir={run_dir}", *SMALL,
                          "num_rollout=4", "engine.max_restarts=3", "slurm.max_requeues=2", "--wait"], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, LOCKSTEP_FAULTS="user_error=engine"))
    out, err = p.communicate(timeout=240)
    assert p.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert "failed on a user error" in err and "fault user_error=engine: the engine refuses to start" in err, err[-3000:]
    events = RunDir(run_dir).read_events()
    failures = [e for e in events if e["event"] == "failure"]
    assert [(e["component"], e["reason"], e["action"]) for e in failures] == [("engine_0", "exit status 2", "fail")], events
    assert not [e for e in events if e["event"] == "requeue"] and {e.get("attempt") for e in events} == {1}, events
    assert RunDir(run_dir).failure()["component"] == "engine_0" and not read_metrics(str(run_dir))


@pytest.mark.slurm
@pytest.mark.slow
def test_engine_and_trainer_restarted_in_place(slurm, tmp_path):
    """Inside one allocation: a killed engine is restarted alone and rejoins the weight group; a killed
    trainer rank restarts the trainer step from the last checkpoint; every step is logged once."""
    run_dir = tmp_path / "run"
    p = submit_bg(run_dir, *SMALL, "num_rollout=16", "checkpoint.save_interval=4", "determinism.true_on_policy=true",
                  "buffer.keep_consumed=false")  # the restarted trainer needs the steps since its checkpoint
    assert wait_until(lambda: steps_done(run_dir) >= 3, timeout=180)
    os.kill(pid_of(run_dir, "engine_0"), 9)
    assert wait_until(lambda: steps_done(run_dir) >= 9, timeout=240)
    os.kill(pid_of(run_dir, "trainer_0"), 9)
    out, err = p.communicate(timeout=400)
    assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert "engine_0 failed on n2 (exit status" in err and "restarted in place (restart 1/3)" in err, err
    assert "trainer failed on n1 (exit status" in err and "restarted in place (restart 1/2), resuming from step 8" in err, err
    assert [r["step"] for r in read_metrics(str(run_dir))] == list(range(16))
    events = RunDir(run_dir).read_events()
    assert [e["event"] for e in events] == ["start", "failure", "failure", "end"]  # one attempt: no requeue
    assert BufferReader(RunDir(run_dir).buffer).committed_steps() == [15]  # consumed steps collected after all
    assert max(r["train/rollout_logprob_max_abs_diff"] for r in read_metrics(str(run_dir))) == 0.0  # engines caught up


@pytest.mark.slurm
@pytest.mark.slow
def test_rollout_manager_killed_is_restarted_and_the_run_is_unchanged(slurm, tmp_path):
    """The rollout manager killed mid-run: restarted in place after its last committed step; the run
    ends with every step once and the same rollouts and weights as an uninterrupted run."""
    common = [*SMALL, "num_rollout=10", "determinism.true_on_policy=true", "eval.interval=0"]
    ref = lockstep("run", *LOCAL, f"run_dir={tmp_path}/ref", *common, "--no-progress")
    assert ref.returncode == 0, ref.stderr[-3000:]
    run_dir = tmp_path / "run"
    p = submit_bg(run_dir, *common)
    assert wait_until(lambda: steps_done(run_dir) >= 4, timeout=180)
    node = RunDir(run_dir).heartbeats()["rollout"]["node"]
    os.kill(pid_of(run_dir, "rollout"), 9)
    out, err = p.communicate(timeout=400)
    assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert f"rollout failed on {node} (exit status" in err and "restarted in place (restart 1/" in err, err
    assert [r["step"] for r in read_metrics(str(run_dir))] == list(range(10))
    ours, theirs = BufferReader(RunDir(run_dir).buffer), BufferReader(RunDir(tmp_path / "ref").buffer)
    assert ours.committed_steps() == theirs.committed_steps() == list(range(10))
    for step in range(10):
        a, b = ours.read_step(step), theirs.read_step(step)
        assert all(torch.equal(torch.as_tensor(getattr(a, c)), torch.as_tensor(getattr(b, c)))
                   for c in ("tokens", "logprobs", "rewards")), step
    a, b = read_state_dict(RunDir(run_dir).hf_export), read_state_dict(RunDir(tmp_path / "ref").hf_export)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [e["event"] for e in RunDir(run_dir).read_events()] == ["start", "failure", "end"]


@pytest.mark.slurm
@pytest.mark.slow
def test_unrecoverable_failure_requeues_the_job_without_its_node(slurm, tmp_path):
    """Out of restarts in place: the driver requeues its own job, excluding the node the failure happened
    on; the next attempt runs elsewhere and resumes from the last checkpoint."""
    run_dir = tmp_path / "run"
    p = submit_bg(run_dir, *SMALL, "num_rollout=10", "checkpoint.save_interval=4", "engine.max_restarts=0",
                  "slurm.max_requeues=1")
    assert wait_until(lambda: steps_done(run_dir) >= 5, timeout=180)
    os.kill(pid_of(run_dir, "engine_0"), 9)
    out, err = p.communicate(timeout=400)
    assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert "engine_0 failed on n2 (exit status 137): requeueing the job (engine_0 is out of restarts (0))" in err, err
    assert "put back in the queue without n2" in err and "requeued (attempt 2/2), resuming from step 4" in err, err
    starts = [e for e in RunDir(run_dir).read_events() if e["event"] == "start"]
    assert [s["attempt"] for s in starts] == [1, 2] and starts[0]["nodes"]["1"] == "n2" and starts[1]["nodes"]["1"] != "n2"
    assert [r["step"] for r in read_metrics(str(run_dir))] == list(range(10))
    assert "requeued by the driver: engine_0 failed on n2 (exit status 137); excluded n2" in lockstep("status", str(run_dir)).stdout


@pytest.mark.slurm
@pytest.mark.slow
def test_node_down_under_an_engine_moves_it_to_a_spare_node(slurm, tmp_path):
    """Paired jobs, the rollout job on 2 nodes + 1 spare (engine_1 on its second node: the first runs the
    job's driver, whose loss ends the job): that node taken down mid-run, engine_1 restarts on the spare
    inside the same allocation (srun reports the node failure with exit status 0); no requeue, every
    step once, the moved engine caught up with the trainer's weights. cpus_per_task keep the trainer
    job off the rollout job's nodes (the fake nodes have 4 CPUs)."""
    run_dir = tmp_path / "run"
    p = submit_bg(run_dir, "num_rollout=10", "slurm.mode=paired", "engine.num_engines=2", "slurm.rollout.nodes=2",
                  "slurm.rollout.spare_nodes=1", "slurm.trainer.cpus_per_task=3", "determinism.true_on_policy=true")
    assert wait_until(lambda: steps_done(run_dir) >= 3, timeout=180)
    beats = RunDir(run_dir).heartbeats()
    node = beats["engine_1"]["node"]
    assert node not in (beats["engine_0"]["node"], beats["trainer_0"]["node"]), beats
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=test"], check=True)
    try:
        out, err = p.communicate(timeout=400)
    finally:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
    assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
    events = RunDir(run_dir).read_events()
    moves = [e for e in events if e.get("event") == "failure"]
    assert [(e["component"], e["node"], e["action"]) for e in moves] == [("engine_1", node, "move")], events
    spare = moves[0]["to"]
    assert f"engine_1 failed on {node} (node failure): restarted on spare node {spare} (node {node} down" in err, err
    assert RunDir(run_dir).heartbeats()["engine_1"]["node"] == spare != node
    assert not [e for e in events if e["event"] in ("requeue", "interrupted")], events
    records = read_metrics(str(run_dir))
    assert [r["step"] for r in records] == list(range(10))
    assert max(r["train/rollout_logprob_max_abs_diff"] for r in records) == 0.0


@pytest.mark.slurm
@pytest.mark.slow
def test_hung_engine_is_detected_by_its_heartbeat_and_restarted(slurm, tmp_path):
    run_dir = tmp_path / "run"
    p = submit_bg(run_dir, *SMALL, "num_rollout=8", "faults.heartbeat_interval_s=1", "faults.heartbeat_timeout_s=5")
    assert wait_until(lambda: steps_done(run_dir) >= 3, timeout=180)
    node = RunDir(run_dir).heartbeats()["engine_0"]["node"]  # where Slurm put it (n2 on an idle cluster)
    os.kill(pid_of(run_dir, "engine_0"), signal.SIGSTOP)  # alive, silent: what a hung GPU looks like from outside
    out, err = p.communicate(timeout=400)
    assert p.returncode == 0, err[-3000:]
    assert f"engine_0 failed on {node} (no heartbeat from engine_0 for" in err and "restarted in place" in err, err
    assert [r["step"] for r in read_metrics(str(run_dir))] == list(range(8))
    # one failure, no other: components that finished their work (the rollout manager) stop beating quietly
    assert [e["event"] for e in RunDir(run_dir).read_events()] == ["start", "failure", "end"]


@pytest.mark.slurm
@pytest.mark.slow
def test_preemption_checkpoints_requeues_and_resumes(slurm, tmp_path):
    run_dir = tmp_path / "run"
    p = submit_bg(run_dir, *SMALL, "num_rollout=20")
    assert wait_until(lambda: len(read_metrics(str(run_dir))) >= 3, timeout=180)
    job = json.load(open(RunDir(run_dir).trainer_file))["job"]
    subprocess.run(["scancel", "-s", "USR2", "-b", job], check=True)  # what Slurm sends at pre-emption / time limit
    out, err = p.communicate(timeout=400)
    assert p.returncode == 0, err[-3000:]
    records = read_metrics(str(run_dir))
    assert [r["step"] for r in records] == list(range(20))
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
    """Two jobs, one run. The rollout job's engines serve until the trainer job is done: its rollout
    manager commits the last step while the trainer still trains it (held 8 s here by a fault) and then
    sends the final weights, which must find the engines (they stopped with the manager once, and the
    send waited weights.timeout_s for them)."""
    res = lockstep("submit", *LOCAL, *SMALL, f"run_dir={tmp_path}/run", "num_rollout=8", "slurm.mode=paired", "--wait",
                   env=dict(os.environ, LOCKSTEP_FAULTS="slow_train_step=7:8"))
    assert res.returncode == 0, res.stderr[-3000:]
    records = read_metrics(f"{tmp_path}/run")
    assert [r["step"] for r in records] == list(range(8))
    assert records[-1]["weights/bytes"] > 0 and records[-1]["perf/weight_sync_time_s"] < 60, records[-1]
    assert res.stderr.count("job ") >= 2
    assert [e["event"] for e in RunDir(tmp_path / "run").read_events() if e["event"] != "start"] == ["end", "end"]


@pytest.mark.slurm
@pytest.mark.slow
def test_colocated_job(slurm, tmp_path):
    """One component runs trainer and engine on one node; weights go as shared-memory handles (weights.type=tensor)."""
    res = lockstep("submit", *LOCAL, *SMALL, f"run_dir={tmp_path}/run", "num_rollout=6", "slurm.mode=colocated",
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


def sacct_states(job: str) -> list[str]:
    return subprocess.run(["sacct", "-j", job, "-D", "-X", "-n", "-o", "State", "--parsable2"], capture_output=True,
                          text=True).stdout.split()


@pytest.mark.slurm
@pytest.mark.slow
def test_wait_follows_an_admin_requeue_to_the_end(slurm, tmp_path):
    """The bug of issue 24: `scontrol requeue` made `--wait` print a submitit traceback and exit 1 while
    the job went on. It follows the job across the requeue and returns the job's final status."""
    run_dir = tmp_path / "run"
    p = submit_bg(run_dir, *SMALL, "num_rollout=12", "checkpoint.save_interval=4")
    assert wait_until(lambda: len(read_metrics(str(run_dir))) >= 6, timeout=240)
    job = RunDir(run_dir).read_events()[0]["job"]
    subprocess.run(["scontrol", "requeue", job], check=True)
    out, err = p.communicate(timeout=400)
    assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
    resumed = RunDir(run_dir).read_events()[-2]["resume_step"]  # the second start (then the end)
    assert resumed in (4, 8), resumed  # the last checkpoint before the requeue
    assert f"job {job} requeued (attempt 2/4), resuming from step {resumed}" in err, err
    assert f"job {job} COMPLETED" in err
    assert [r["step"] for r in read_metrics(str(run_dir))] == list(range(12))  # every step once
    states = sacct_states(job)
    assert "REQUEUED" in states and states[-1] == "COMPLETED", states
    res = lockstep("status", str(run_dir))
    assert res.returncode == 0 and "ended by Slurm (requeue, cancel or node failure)" in res.stdout, res.stdout
    assert f"step {resumed:<8} completed" in res.stdout and "last checkpoint: step 12" in res.stdout, res.stdout
