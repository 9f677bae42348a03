"""`lockstep submit`: heterogeneous (or colocated, or paired) Slurm jobs through submitit.

submitit has no hetjob support. `LockstepExecutor` keeps its machinery — the job folder with the
pickled callable, `Job` objects, state tracking through sacct, requeue of `Checkpointable`s — and
replaces only the batch script: ours (plan.render_script) has one `#SBATCH` block per component with
`#SBATCH hetjob` between them and runs submitit's `_submit` in the batch shell, where the pickled
SlurmDriver starts each component with its own `srun --het-group=N`.
"""

from __future__ import annotations

import os
import shlex
import sys

from pipeline.config.schema import RunConfig
from pipeline.launch.slurm.driver import SlurmDriver
from pipeline.launch.slurm.plan import check_request, render_script
from pipeline.launch.slurm.profile import ClusterProfile, load_profile
from pipeline.run import RunDir


def driver_command(run_dir: str, role: str, python: str | None = None) -> str:
    """The command a hand-submitted script runs (no pickle needed)."""
    return " ".join([shlex.quote(python or sys.executable), "-u", "-m", "pipeline.launch.slurm.driver",
                     "--run-dir", shlex.quote(run_dir), "--role", role])


def roles(cfg: RunConfig) -> list[str]:
    return ["trainer", "rollout"] if cfg.slurm.mode == "paired" else ["all"]


def dry_run(cfg: RunConfig, profile: ClusterProfile, run_dir: str) -> list[str]:
    """Write the exact batch script(s) to run_dir/slurm/ without submitting; return their paths."""
    rundir = RunDir(run_dir)
    os.makedirs(rundir.slurm_dir, exist_ok=True)
    paths = []
    for role in roles(cfg):
        path = rundir.sbatch_file(cfg.slurm.mode if role == "all" else f"{cfg.slurm.mode}-{role}")
        with open(path, "w") as f:
            f.write(render_script(cfg, profile, run_dir, driver_command(run_dir, role), role=role))
        os.chmod(path, 0o755)
        paths.append(path)
    return paths


def het_state(states: list[str]) -> str:
    """One state for a heterogeneous job from its components' states (sacct lists 5+0, 5+1)."""
    bad = [s for s in states if s.split()[0] in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                                                  "BOOT_FAIL", "DEADLINE", "PREEMPTED")]
    if bad:
        return bad[0]
    if states and all(s == "COMPLETED" for s in states):
        return "COMPLETED"
    for s in ("RUNNING", "REQUEUED", "PENDING"):
        if s in states:
            return s
    return states[0] if states else "UNKNOWN"


def job_class():
    from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

    class HetInfoWatcher(SlurmInfoWatcher):
        """submitit's sacct reader, plus hetjob components folded into the job id it submitted."""

        def read_info(self, string):
            info = super().read_info(string)
            groups: dict[str, list] = {}
            for jid, stats in info.items():
                if "+" in jid:
                    groups.setdefault(jid.split("+")[0], []).append((jid, stats))
            for leader, parts in groups.items():
                parts.sort()
                merged = dict(parts[0][1])
                merged["State"] = het_state([st.get("State", "UNKNOWN") for _, st in parts])
                merged["NodeList"] = ",".join(st.get("NodeList", "") for _, st in parts)
                info[leader] = merged
            return info

    class HetJob(SlurmJob):
        watcher = HetInfoWatcher(delay_s=5)

    return HetJob


def make_executor(cfg: RunConfig, profile: ClusterProfile, run_dir: str, role: str):
    import submitit

    class LockstepExecutor(submitit.SlurmExecutor):
        job_class = job_class()

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            out = str(self.folder / "%j_log.out")
            return render_script(cfg, profile, run_dir, command, role=role, output=out)

        def _num_tasks(self) -> int:
            return 1  # the driver; components are job steps it starts itself

    folder = cfg.slurm.submit_dir or RunDir(run_dir).slurm_dir
    ex = LockstepExecutor(folder=folder, max_num_timeout=cfg.slurm.max_requeues)
    ex.update_parameters(time=cfg.slurm.time_min, job_name=cfg.slurm.job_name, signal_delay_s=cfg.slurm.signal_delay_s)
    return ex


def submit(cfg: RunConfig, run_dir: str, profile: ClusterProfile | None = None) -> list:
    """Submit the run; returns submitit Job objects (one, or two in paired mode)."""
    profile = profile or load_profile(cfg.slurm.cluster)
    check_request(cfg, profile)
    jobs = []
    for role in roles(cfg):
        jobs.append(make_executor(cfg, profile, run_dir, role).submit(SlurmDriver(run_dir, role)))
    return jobs
