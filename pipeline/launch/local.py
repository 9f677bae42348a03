"""Run every component of a job as local processes (the embedded default: no Slurm needed).

The same entry points Slurm's srun starts (pipeline.launch.component): engines first (waited for
until they serve), then the rollout manager and the trainer ranks. If any process fails, all are
stopped and the failing one is named with the end of its log. Children run in their own process
groups and are ended by PID, never by name.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from pipeline.config.schema import RunConfig
from pipeline.errors import ComponentFailed
from pipeline.launch.component import USER_ERROR_EXIT
from pipeline.observability.metrics import read_metrics
from pipeline.observability.report import ProgressBar
from pipeline.run import RunDir, free_port
from pipeline.utils.proc import die_with_parent

log = logging.getLogger("lockstep.launch")
RESTART_MARK = "=== lockstep: restarted"


def tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except FileNotFoundError:
        return ""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: str
    required: bool = True  # its failure fails the run
    cmd: list[str] | None = None
    env: dict | None = None
    restarts_left: int = 0  # > 0: a death restarts it instead of failing the run


class Supervisor:
    """Starts components, watches them, and ends them all when one fails or the run is over."""

    def __init__(self, rundir: RunDir, env: dict | None = None):
        self.rundir = rundir
        self.env = dict(os.environ, **(env or {}))
        self.procs: list[Proc] = []
        self.stopping = False

    def start(self, name: str, args: list[str], env: dict | None = None) -> Proc:
        """Start component entry point `python -m pipeline.launch.component ARGS`."""
        return self.start_command(name, component_cmd(*args), env)

    def start_command(self, name: str, cmd: list[str], env: dict | None = None, required: bool = True,
                      restarts: int = 0) -> Proc:
        proc = Proc(name, self._spawn(name, cmd, env), self.rundir.log_file(name), required, cmd, env, restarts)
        self.procs.append(proc)
        return proc

    def _spawn(self, name: str, cmd: list[str], env: dict | None) -> subprocess.Popen:
        logf = open(self.rundir.log_file(name), "ab")
        try:
            return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=dict(self.env, **(env or {})),
                                    start_new_session=True, preexec_fn=die_with_parent)
        finally:
            logf.close()

    def restart_dead(self) -> list[str]:
        """Restart processes that may be restarted and have died, unless of a UserError (USER_ERROR_EXIT:
        it would die of it again); returns their names."""
        restarted = []
        for p in self.procs:
            rc = p.popen.poll()
            if rc not in (None, 0, USER_ERROR_EXIT) and p.restarts_left > 0 and not self.stopping:
                p.restarts_left -= 1
                log.warning("%s died (exit %s); restarting it (%d restarts left)", p.name, rc, p.restarts_left)
                self.restart(p, f"exit status {rc}")
                restarted.append(p.name)
        return restarted

    def restart(self, p: Proc, why: str) -> None:
        """Start an exited process again with its command and environment; its log continues after a
        marker line (RESTART_MARK)."""
        assert p.popen.poll() is not None, f"{p.name} is still running"
        with open(p.log_path, "a") as f:
            f.write(f"\n{RESTART_MARK} after {why} ===\n")
        p.popen = self._spawn(p.name, p.cmd, p.env)

    def check(self) -> None:
        """Restart what may be restarted; raise ComponentFailed for the first other process that exited
        with an error."""
        self.restart_dead()
        for p in self.procs:
            rc = p.popen.poll()
            if rc not in (None, 0) and p.required:
                raise ComponentFailed(p.name, rc, tail(p.log_path))

    def stop_all(self, grace_s: float = 5.0) -> None:
        self.stopping = True
        for p in self.procs:
            if p.popen.poll() is None:
                try:
                    os.killpg(p.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.popen.wait()


def component_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.launch.component", *args]


def trainer_env(rank: int, world: int, port: int) -> dict:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def run_local(cfg: RunConfig, rundir: RunDir, progress: bool = True) -> None:
    """Run the job to the end; raises ComponentFailed if a component fails."""
    sup = Supervisor(rundir)
    bar = ProgressBar(cfg.num_rollout, enabled=progress and cfg.logging.progress)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # scancel / kill: stop children, then exit
    try:
        # Everything starts at once: engines load and capture graphs while the trainer loads and shards;
        # the rollout manager and the trainer wait for the engines' addresses themselves. SFT
        # (algo.loss_type=sft_loss) trains on the data file: trainers only.
        if not cfg.sft:
            start_rollout_side(sup, cfg, rundir)
        port = free_port()
        rundir.publish_trainer({"master_addr": "127.0.0.1", "master_port": port})
        world = cfg.train.num_gpus
        trainers = [sup.start(f"trainer_{r}", ["trainer", "--run-dir", rundir.root], env=trainer_env(r, world, port))
                    for r in range(world)]
        while any(t.popen.poll() is None for t in trainers):
            sup.check()
            bar.update(read_metrics(rundir.root))
            time.sleep(0.25)
        sup.check()
        bar.update(read_metrics(rundir.root))
    except KeyboardInterrupt:
        log.warning("interrupted: stopping all components")
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        bar.close()
        sup.stop_all()


def start_rollout_side(sup: Supervisor, cfg: RunConfig, rundir: RunDir) -> None:
    """The engines and the rollout manager."""
    for i in range(cfg.engine.num_engines):
        sup.start_command(f"engine_{i}", component_cmd("engine", "--run-dir", rundir.root, "--index", str(i)),
                          restarts=cfg.engine.max_restarts if cfg.engine.type == "local" else 0)
    sup.start("rollout", ["rollout", "--run-dir", rundir.root])


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
