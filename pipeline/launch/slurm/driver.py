"""The in-job driver: runs in the batch shell, starts every component with srun, ends the job if one fails.

submitit pickles a `SlurmDriver` and runs it on the job's first node (or a user runs
`python -m pipeline.launch.slurm.driver --run-dir D` from a hand-written sbatch script). It
  - starts each component with its own entry point: `srun --het-group=0 ... component trainer`,
    `srun --het-group=1 ... component engine` and `... component rollout` (colocated: no het groups;
    paired: only its own side);
  - watches the steps: the first one that fails ends all the others, the job exits with an error
    naming it, and (paired) the partner job is told through run_dir/control/FAILED;
  - on USR2 (pre-emption or the time limit coming, `--signal=B:USR2@N`) asks the trainer to
    checkpoint at its next step boundary, waits for it, stops the components and lets submitit
    requeue the job; the requeued job resumes from the run directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time

from pipeline.config import load_resolved
from pipeline.errors import ComponentFailed
from pipeline.launch.local import Supervisor, tail
from pipeline.launch.slurm.profile import ClusterProfile, load_profile
from pipeline.observability.metrics import read_metrics
from pipeline.run import RunDir

log = logging.getLogger("lockstep.slurm")

try:  # submitit is a dependency; the driver also runs from hand-written scripts without it
    from submitit.helpers import Checkpointable, DelayedSubmission
except ImportError:  # pragma: no cover
    Checkpointable, DelayedSubmission = object, None


def srun_command(component: str, run_dir: str, *, group: int | None, nodes: int, ntasks: int, ntasks_per_node: int,
                 profile: ClusterProfile, overlap: bool = False, python: str | None = None,
                 gpus_per_task: int = 0) -> list[str]:
    """One component's srun line (pure: tested against the reference scripts)."""
    name = {"trainer": "trainer_%t", "engine": "engine_%t", "rollout": "rollout"}[component]
    cmd = ["srun"]
    if group is not None:
        cmd.append(f"--het-group={group}")
    cmd += [f"--nodes={nodes}", f"--ntasks={ntasks}", f"--ntasks-per-node={ntasks_per_node}", "--kill-on-bad-exit=1",
            "--unbuffered", f"--output={RunDir(run_dir).log_file(name)}", f"--job-name={component}"]
    if gpus_per_task:
        cmd.append(f"--gpus-per-task={gpus_per_task}")  # each engine gets its own GPU
    if overlap:
        cmd.append("--overlap")
    c = profile.container
    if c.runtime == "apptainer" and c.image:
        cmd += ["apptainer", "exec", *c.flags, "--bind", run_dir, c.image, "python3"]
    else:
        cmd.append(python or sys.executable)
    return cmd + ["-m", "pipeline.launch.component", component, "--run-dir", run_dir]


def plan_steps(cfg, profile: ClusterProfile, run_dir: str, role: str, mode: str,
               python: str | None = None) -> list[tuple[str, list[str]]]:
    """(name, srun argv) of every job step this driver starts."""
    s = cfg.slurm
    het = mode == "hetjob"
    steps = []
    if role in ("all", "trainer"):
        t = s.trainer
        steps.append(("trainer", srun_command("trainer", run_dir, group=0 if het else None, nodes=t.nodes,
                                              ntasks=t.nodes * t.tasks_per_node, ntasks_per_node=t.tasks_per_node,
                                              profile=profile, overlap=mode == "colocated", python=python)))
    if role in ("all", "rollout"):
        r = s.trainer if mode == "colocated" else s.rollout
        group = 1 if het else None
        n_eng = cfg.engine.num_engines
        eng_nodes = min(r.nodes, n_eng)
        per_node = max(1, -(-n_eng // eng_nodes))
        steps.append(("engines", srun_command("engine", run_dir, group=group, nodes=eng_nodes, ntasks=n_eng,
                                              ntasks_per_node=per_node, profile=profile, overlap=True, python=python,
                                              gpus_per_task=gpus_per_engine(cfg) if r.gpus_per_node else 0)))
        steps.append(("rollout", srun_command("rollout", run_dir, group=group, nodes=1, ntasks=1, ntasks_per_node=1,
                                              profile=profile, overlap=True, python=python)))
    return steps


def gpus_per_engine(cfg) -> int:
    """An SGLang engine takes tp_size GPUs; the built-in engine one."""
    return getattr(cfg.engine, "tp_size", 1)


class SlurmDriver(Checkpointable):
    def __init__(self, run_dir: str, role: str = "all"):
        self.run_dir, self.role = run_dir, role
        self.rundir = RunDir(run_dir)
        self.sup: Supervisor | None = None

    def __call__(self) -> dict:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s driver %(levelname)s %(message)s")
        cfg = load_resolved(self.run_dir)
        profile = load_profile(cfg.slurm.cluster)
        os.makedirs(self.rundir.logs, exist_ok=True)
        self.rundir.reset_role(self.role)
        env = {k: str(v) for k, v in profile.env.items()}
        env["LOCKSTEP_BIND"] = profile.bind
        self.sup = Supervisor(self.rundir, env)
        steps = plan_steps(cfg, profile, self.run_dir, self.role, cfg.slurm.mode)
        log.info("job %s: starting %s", os.environ.get("SLURM_JOB_ID"), ", ".join(n for n, _ in steps))
        procs = {}
        try:
            for name, cmd in steps:
                log.info("%s: %s", name, shlex.join(cmd))
                procs[name] = self.sup.start_command(f"srun_{name}", cmd)  # they wait for the engines themselves
            self.supervise(procs)
        except ComponentFailed as e:
            self.fail(e)
            raise
        finally:
            self.sup.stop_all(grace_s=15)
        records = read_metrics(self.run_dir)
        last = records[-1] if records else {}
        return {"run_dir": self.run_dir, "steps": len(records), "reward_mean": last.get("rollout/reward_mean"),
                "weights_version": last.get("weights/version"),
                "preempted": self.rundir.checkpoint_done()}

    def check(self) -> None:
        self.sup.check()
        info = self.rundir.failure()
        if info is not None:
            raise ComponentFailed(f"{info.get('component')} (in job {info.get('job')})", info.get("returncode"))

    def supervise(self, procs: dict) -> None:
        """Return when the run is over (trainer finished, or the rollout side saw STOP)."""
        while True:
            self.check()
            if "trainer" in procs:
                if procs["trainer"].popen.poll() == 0:
                    return
            elif procs["rollout"].popen.poll() == 0:
                return
            time.sleep(0.5)

    def fail(self, e: ComponentFailed) -> None:
        log.error("%s; last lines of its log:\n%s", e, e.log_tail or tail(self.rundir.log_file(e.component)))
        self.rundir.publish_failure({"component": e.component, "returncode": e.returncode,
                                     "job": os.environ.get("SLURM_JOB_ID")})

    def checkpoint(self, *args, **kwargs):
        """submitit calls this on USR2: checkpoint the trainer, stop, requeue (the run resumes)."""
        cfg = load_resolved(self.run_dir)
        if self.role in ("all", "trainer"):
            self.rundir.request_checkpoint("slurm signal")
            try:
                self.rundir.wait_checkpoint_done(cfg.slurm.checkpoint_timeout_s)
                log.info("trainer checkpointed; requeueing")
            except TimeoutError:
                log.warning("no checkpoint within %.0fs; requeueing from the last one", cfg.slurm.checkpoint_timeout_s)
        if self.sup is not None:
            self.sup.stop_all(grace_s=15)
        return DelayedSubmission(SlurmDriver(self.run_dir, self.role))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Run a Lockstep job's components inside a Slurm allocation")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--role", default="all", choices=["all", "trainer", "rollout"])
    args = p.parse_args(argv)
    try:
        print(json.dumps(SlurmDriver(args.run_dir, args.role)()))
        return 0
    except ComponentFailed as e:
        print(f"lockstep: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
