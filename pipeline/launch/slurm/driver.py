"""The in-job driver: runs in the batch shell, starts every component with srun, keeps the run going.

submitit pickles a `SlurmDriver` and runs it on the job's first node (or a user runs
`python -m pipeline.launch.slurm.driver --run-dir D` from a hand-written sbatch script). It
  - starts each component as its own job step (steps.py): the trainer ranks, one step per engine,
    the rollout manager (colocated: no het groups; paired: only its own side);
  - watches them: a step that exits with an error, or whose processes stop beating
    (run_dir/heartbeat/, faults.heartbeat_timeout_s: the step is killed first), has failed;
    recovery.py decides: restart it in place (an engine alone; the trainer from its last checkpoint;
    the rollout manager after its last committed step), move it to a spare node of its component
    when its node went down or failed twice (slurm.<component>.spare_nodes; srun reports a node
    failure with exit status 0, so the step's log is read too), requeue the job without the node it
    failed on, or end the job naming it (and, paired, tell the partner job through run_dir/control/FAILED);
  - on USR2 (pre-emption or the time limit coming, `--signal=B:USR2@N`) asks the trainer to
    checkpoint at its next step boundary, waits for it, stops the components and lets submitit
    requeue the job; the requeued job resumes from the run directory;
  - on SIGTERM (Slurm ending the allocation: `scontrol requeue`, scancel, a node failure) stops the
    components without calling anything a failure;
  - writes what happened to run_dir/events.jsonl (attempts, restarts, failures and their nodes,
    requeues, the end): `lockstep status` and `lockstep submit --wait` read it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter

from pipeline.config import load_resolved
from pipeline.errors import ComponentFailed
from pipeline.launch.component import USER_ERROR_EXIT
from pipeline.launch.local import Proc, Supervisor, tail
from pipeline.launch.slurm import jobctl
from pipeline.launch.slurm.profile import load_profile
from pipeline.launch.slurm.recovery import Action, Failure, RecoveryPolicy, SparePool, component_of, safe_exclusions
from pipeline.launch.slurm.steps import plan_steps, relocate, step_group
from pipeline.observability.metrics import read_metrics
from pipeline.run import RunDir
from pipeline.run.heartbeat import silent

log = logging.getLogger("lockstep.slurm")

try:  # submitit is a dependency; the driver also runs from hand-written scripts without it
    from submitit.helpers import Checkpointable, DelayedSubmission
except ImportError:  # pragma: no cover
    Checkpointable, DelayedSubmission = object, None

SRUN_TASK_ERROR = re.compile(r"^srun: error: (\S+): tasks? [\d,\-]+: ", re.M)
NODE_FAILURE = re.compile(r"^srun: error: Node failure on (\S+)", re.M)


class JobEnding(Exception):
    """Slurm is ending this allocation (requeue, cancel, node failure): stop, claim nothing."""


class SlurmDriver(Checkpointable):
    def __init__(self, run_dir: str, role: str = "all"):
        self.run_dir, self.role = run_dir, role
        self.rundir = RunDir(run_dir)
        self.sup: Supervisor | None = None
        self.procs: dict[str, Proc] = {}
        # the nodes each step's processes were seen beating on since its last start (a finished step
        # withdraws its heartbeat, so the driver keeps what it saw)
        self.step_nodes: dict[str, set[str]] = {}

    # ---- the job ------------------------------------------------------------------------------------
    def __call__(self) -> dict:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s driver %(levelname)s %(message)s")
        self.cfg = cfg = load_resolved(self.run_dir)
        profile = load_profile(cfg.slurm.cluster)
        self.job = os.environ.get("SLURM_JOB_ID", "")
        self.attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0) + 1
        self.ending = self.requeued = False
        signal.signal(signal.SIGTERM, self.on_term)  # (submitit's handler only logs it)
        os.makedirs(self.rundir.logs, exist_ok=True)
        self.rundir.reset_role(self.role)
        for side in {"all": [None], "trainer": ["trainer"], "rollout": ["engine", "rollout"]}[self.role]:
            self.rundir.clear_heartbeats(side)  # paired: the partner job's stay
        self.policy = RecoveryPolicy(engine_restarts=cfg.engine.max_restarts, restarts=cfg.slurm.max_restarts,
                                     attempt=self.attempt, max_attempts=1 + cfg.slurm.max_requeues,
                                     node_failures=self.earlier_node_failures(), pools=self.spare_pools())
        self.record_start()
        env = {k: str(v) for k, v in profile.env.items()}
        env["LOCKSTEP_BIND"] = profile.bind
        self.sup = Supervisor(self.rundir, env)
        steps = plan_steps(cfg, profile, self.run_dir, self.role, cfg.slurm.mode)
        log.info("job %s attempt %d: starting %s", self.job, self.attempt, ", ".join(n for n, _ in steps))
        self.procs: dict[str, Proc] = {}
        self.hung: dict[str, str] = {}
        # where each step's srun log stood when it last started: the logs outlive restarts and job
        # attempts, and only what this start of the step wrote tells of its failure
        self.log_start: dict[str, int] = {}
        try:
            for name, cmd in steps:
                log.info("%s: %s", name, shlex.join(cmd))
                self.log_start[name] = log_size(self.rundir.log_file(f"srun_{name}"))
                self.procs[name] = self.sup.start_command(f"srun_{name}", cmd)  # they wait for the engines themselves
            self.supervise()
        except JobEnding:
            log.warning("Slurm is ending this allocation; components stopped")
            if not self.requeued:
                self.rundir.append_event({"event": "interrupted", "job": self.job, "attempt": self.attempt})
            return {"run_dir": self.run_dir, "interrupted": True}
        except ComponentFailed as e:
            self.fail(e)
            raise
        finally:
            self.sup.stop_all(grace_s=15)
        records = read_metrics(self.run_dir)
        last = records[-1] if records else {}
        self.rundir.append_event({"event": "end", "status": "completed", "job": self.job, "attempt": self.attempt,
                                  "steps": len(records)})
        return {"run_dir": self.run_dir, "steps": len(records), "reward_mean": last.get("rollout/reward_mean"),
                "weights_version": last.get("weights/version"), "preempted": self.rundir.checkpoint_done()}

    def run_over(self) -> bool:
        """The trainer is done. A paired rollout job's engines serve until the trainer job says so
        (control/STOP, after its final weight sync): its rollout manager committing the last step is not
        the end, the trainer still trains that step and sends the result."""
        return self.role != "rollout" or self.rundir.stop_requested()

    def on_term(self, signum, frame) -> None:
        self.ending = True

    def supervise(self) -> None:
        """Return when the run is over (trainer finished; paired rollout side: its rollout manager finished
        and the trainer job asked to stop); recover failures."""
        while True:
            if self.ending:
                raise JobEnding()
            info = self.rundir.failure()
            if info is not None:  # the partner job (paired mode) failed
                raise ComponentFailed(f"{info.get('component')} (in job {info.get('job')})", info.get("returncode"))
            beats = self.rundir.heartbeats()
            self.kill_silent(beats)
            self.note_nodes(beats)
            for name, p in self.procs.items():
                rc = p.popen.poll()
                if rc not in (None, 0) or (rc == 0 and self.node_failure(name, p)):
                    time.sleep(1.0)  # Slurm ending the job kills the steps and signals us at about the same time
                    if self.ending:
                        raise JobEnding()
                    self.recover(name, p, rc)
            main = self.procs.get("trainer") or self.procs["rollout"]
            if main.popen.poll() == 0 and self.run_over():
                return
            time.sleep(0.5)

    # ---- failures -------------------------------------------------------------------------------------
    def step_of(self, component: str) -> str:
        """The job step a heartbeat's component runs in (engine_1 -> engine_1, trainer_3 -> trainer)."""
        return component if component in self.procs else component.rsplit("_", 1)[0]

    def kill_silent(self, beats: dict[str, dict]) -> None:
        """Kill the steps whose processes stopped beating (hung, frozen, on a node gone silent)."""
        quiet = silent(beats, self.cfg.faults.heartbeat_timeout_s)
        for component, age in quiet.items():
            step = self.step_of(component)
            p = self.procs.get(step)
            if p is None or p.popen.poll() is not None or step in self.hung:
                continue
            node = beats.get(component, {}).get("node")
            self.hung[step] = f"no heartbeat from {component} for {age:.0f} s" + (f" (node {node})" if node else "")
            log.warning("%s: killing step %s", self.hung[step], step)
            abort_step(p)

    def since_start(self, step: str, p: Proc) -> str:
        """What the step's srun wrote since its last start."""
        try:
            with open(p.log_path, "rb") as f:
                f.seek(self.log_start.get(step, 0))
                return f.read()[-65536:].decode(errors="replace")
        except FileNotFoundError:
            return ""

    def note_nodes(self, beats: dict[str, dict]) -> None:
        """Remember where each step's processes beat (step_nodes)."""
        for component, beat in beats.items():
            if beat.get("node"):
                self.step_nodes.setdefault(self.step_of(component), set()).add(beat["node"])

    def node_failure(self, step: str, p: Proc) -> str | None:
        """The node Slurm lost under this step since its last start (srun then exits 0), if any. srun
        with --no-kill also tells a step of a node of the allocation the step never ran on: that is
        another step's failure, not this one's (a rollout manager ending normally after an engine's node
        went down must not be moved), so a node the step was seen beating elsewhere than is not counted."""
        m = NODE_FAILURE.search(self.since_start(step, p))
        if m is None:
            return None
        seen = self.step_nodes.get(step)
        return m.group(1) if not seen or m.group(1) in seen else None

    def recover(self, step: str, p: Proc, rc: int) -> None:
        down = self.node_failure(step, p)
        if down:
            self.hung.pop(step, None)
            f = Failure(step, down, "node failure", node_down=True)
        else:
            hung = self.hung.pop(step, None)
            f = Failure(step, self.node_of(step, p), hung or f"exit status {rc}",
                        user_error=hung is None and rc == USER_ERROR_EXIT)
        action, why = self.policy.decide(f)
        event = {"event": "failure", "job": self.job, "attempt": self.attempt, "component": f.step, "node": f.node,
                 "reason": f.reason, "action": action.value, "why": why, "step": self.last_step()}
        log.warning("%s failed on %s (%s): %s (%s)", f.step, f.node or "?", f.reason, action.value, why)
        if action is Action.MOVE:
            pool = self.policy.pools[component_of(f.step)]
            # an engine is pinned to its node's replacement; the other steps keep off every bad node
            p.cmd = (relocate(p.cmd, node=pool.where(f.node)) if f.step.startswith("engine")
                     else relocate(p.cmd, exclude=sorted(pool.bad)))
            event["to"] = pool.where(f.node)
        if action in (Action.RESTART, Action.MOVE):
            event["resume_step"] = self.prepare_restart(f.step)
            self.rundir.append_event(event)
            self.log_start[f.step] = log_size(p.log_path)
            self.sup.restart(p, f.reason)
            return
        self.rundir.append_event(event)
        if action is Action.REQUEUE:
            self.requeue_self(f)
            raise JobEnding()
        raise ComponentFailed(f.step, rc, tail(self.rundir.log_file(self.log_name(f.step))) or tail(p.log_path))

    def prepare_restart(self, step: str) -> int | None:
        """Clear what the step's old processes published; the step it will resume from (trainer)."""
        self.rundir.clear_heartbeats(step)
        self.step_nodes.pop(step, None)  # it may start elsewhere
        if step != "trainer":
            return None
        for path in (self.rundir.trainer_file, self.rundir.weights_file):
            if os.path.exists(path):
                os.unlink(path)  # ranks of the new step must not meet at the dead one's address
        return self.last_checkpoint()

    def requeue_self(self, f: Failure) -> None:
        """Stop everything and put the job back in the queue without the nodes that failed."""
        self.requeued = True
        self.sup.stop_all(grace_s=15)
        s = self.cfg.slurm
        needed = s.trainer.nodes + s.trainer.spare_nodes + (0 if s.mode == "colocated" else s.rollout.nodes + s.rollout.spare_nodes)
        exclude = safe_exclusions(self.policy.exclude(f), partition_size(), needed)
        components = [self.job] if s.mode != "hetjob" else [f"{self.job}+0", f"{self.job}+1"]
        self.rundir.append_event({"event": "requeue", "job": self.job, "attempt": self.attempt, "exclude": exclude,
                                  "reason": f"{f.step} failed on {f.node or '?'} ({f.reason})"})
        log.warning("requeueing job %s (next attempt %d) without %s", self.job, self.attempt + 1, exclude or "exclusions")
        jobctl.requeue(self.job, components, exclude)

    def node_of(self, step: str, p: Proc) -> str | None:
        """Where a step failed: srun's own error line (`srun: error: n2: task 0: Killed`), else the
        heartbeat of its process, else its component's only node."""
        m = SRUN_TASK_ERROR.search(self.since_start(step, p))
        if m:
            return m.group(1)
        beats = self.rundir.heartbeats()
        nodes = {b.get("node") for name, b in beats.items() if name == step or name.startswith(step + "_")}
        if len(nodes) == 1:
            return nodes.pop()
        group = step_group(step, self.cfg.slurm.mode)
        nodelist = os.environ.get(f"SLURM_JOB_NODELIST_HET_GROUP_{group}" if group is not None else "SLURM_JOB_NODELIST")
        names = jobctl.expand_nodes(nodelist or "")
        return names[0] if len(names) == 1 else None

    def spare_pools(self) -> dict[str, SparePool]:
        """The components of this job that hold spare nodes: their nodes, in Slurm's order."""
        s = self.cfg.slurm
        pools = {}
        for group, (name, g) in enumerate((("trainer", s.trainer), ("rollout", s.rollout))):
            if not g.spare_nodes or self.role not in ("all", name):
                continue
            var = f"SLURM_JOB_NODELIST_HET_GROUP_{group}" if s.mode == "hetjob" else "SLURM_JOB_NODELIST"
            pools[name] = SparePool(jobctl.expand_nodes(os.environ.get(var, "")), needed=g.nodes)
        return pools

    def log_name(self, step: str) -> str:
        return "trainer_0" if step == "trainer" else step

    def fail(self, e: ComponentFailed) -> None:
        log.error("%s; last lines of its log:\n%s", e, e.log_tail or tail(self.rundir.log_file(e.component)))
        self.rundir.publish_failure({"component": e.component, "returncode": e.returncode, "job": self.job})
        self.rundir.append_event({"event": "end", "status": "failed", "job": self.job, "attempt": self.attempt,
                                  "reason": str(e)})

    # ---- history --------------------------------------------------------------------------------------
    def last_checkpoint(self) -> int:
        from pipeline.trainer.checkpoint import latest_checkpoint

        return latest_checkpoint(self.run_dir) or 0

    def last_step(self) -> int:
        records = read_metrics(self.run_dir)
        return records[-1]["step"] + 1 if records else 0

    def earlier_node_failures(self) -> Counter:
        return Counter(e["node"] for e in self.rundir.read_events() if e.get("event") == "failure" and e.get("node"))

    def record_start(self) -> None:
        """This attempt's start, and the nodes that went down during the previous one (Slurm ended and
        requeued it: NODE_FAIL). sacct marks every component NODE_FAIL; the accounting database's node
        events say which node it was."""
        starts = [e for e in self.rundir.read_events() if e.get("event") == "start" and e.get("job") == self.job]
        if self.attempt > 1 and starts:
            prev = starts[-1]
            nodes = prev["nodes"].values() if isinstance(prev["nodes"], dict) else [prev["nodes"]]
            names = [n for group in nodes for n in jobctl.expand_nodes(group)]
            for ev in jobctl.node_events(names, since=prev["time"]):
                self.policy.node_failures[ev["node"]] += 1
                self.rundir.append_event({"event": "failure", "job": self.job, "attempt": prev["attempt"],
                                          "component": "node", "node": ev["node"],
                                          "reason": f"{ev['state']}: {ev['reason']}" if ev["reason"] else ev["state"],
                                          "action": "requeue", "why": "Slurm requeued the job"})
        nodes = {k[len("SLURM_JOB_NODELIST_HET_GROUP_"):]: v for k, v in os.environ.items()
                 if k.startswith("SLURM_JOB_NODELIST_HET_GROUP_")}
        self.rundir.append_event({"event": "start", "job": self.job, "attempt": self.attempt, "role": self.role,
                                  "max_attempts": 1 + self.cfg.slurm.max_requeues, "resume_step": self.last_checkpoint(),
                                  "nodes": nodes or os.environ.get("SLURM_JOB_NODELIST", "")})

    # ---- pre-emption ----------------------------------------------------------------------------------
    def checkpoint(self, *args, **kwargs):
        """submitit calls this on USR2: checkpoint the trainer, stop, requeue (the run resumes)."""
        cfg = load_resolved(self.run_dir)
        step = None
        if self.role in ("all", "trainer"):
            self.rundir.request_checkpoint("slurm signal")
            try:
                step = self.rundir.wait_checkpoint_done(cfg.slurm.checkpoint_timeout_s).get("step")
                log.info("trainer checkpointed; requeueing")
            except TimeoutError:
                log.warning("no checkpoint within %.0fs; requeueing from the last one", cfg.slurm.checkpoint_timeout_s)
        self.requeued = True
        self.rundir.append_event({"event": "preempted", "job": os.environ.get("SLURM_JOB_ID", ""),
                                  "attempt": int(os.environ.get("SLURM_RESTART_COUNT") or 0) + 1, "checkpoint": step})
        if self.sup is not None:
            self.sup.stop_all(grace_s=15)
        return DelayedSubmission(SlurmDriver(self.run_dir, self.role))


def log_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def abort_step(p: Proc) -> None:
    """End a job step even if its tasks are stopped: srun aborts the step (SIGKILL to every task) on a
    second SIGINT within a second."""
    for _ in range(2):
        try:
            os.kill(p.popen.pid, signal.SIGINT)
        except ProcessLookupError:
            return
        time.sleep(0.3)


def partition_size() -> int:
    """Nodes in the job's partition that are not down (0 when unknown)."""
    part = os.environ.get("SLURM_JOB_PARTITION", "").split(",")[0]
    cmd = ["sinfo", "-h", "-o", "%D", "-t", "idle,alloc,mix,comp"] + (["-p", part] if part else [])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    return sum(int(x) for x in res.stdout.split() if x.isdigit()) if res.returncode == 0 else 0


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
