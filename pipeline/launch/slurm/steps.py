"""The job steps a driver starts: one `srun` line per component (pure; the reference scripts list them).

  trainer      all trainer ranks in one step (they share a process group: one dies, all restart)
  engine_<i>   one step per engine, so a dead engine is restarted alone (`--relative` places it on
               its node of the component)
  rollout      the rollout manager

A step moved off a bad node (recovery.py: a spare node) runs the same line with its placement changed
(`relocate`): an engine pinned to its spare (--nodelist), other steps kept off the bad nodes (--exclude).
"""

from __future__ import annotations

import sys

from pipeline.launch.slurm.profile import ClusterProfile
from pipeline.run import RunDir


def srun_command(component: str, run_dir: str, *, group: int | None, nodes: int, ntasks: int, ntasks_per_node: int,
                 profile: ClusterProfile, overlap: bool = False, python: str | None = None,
                 gpus_per_task: int = 0, index: int | None = None, relative: int | None = None) -> list[str]:
    """One component's srun line. Engines: `index` is the engine's, `relative` its node in the component."""
    name = {"trainer": "trainer_%t", "engine": f"engine_{index}", "rollout": "rollout"}[component]
    cmd = ["srun"]
    if group is not None:
        cmd.append(f"--het-group={group}")
    cmd += [f"--nodes={nodes}", f"--ntasks={ntasks}", f"--ntasks-per-node={ntasks_per_node}"]
    if relative is not None:
        cmd.append(f"--relative={relative}")
    cmd += ["--kill-on-bad-exit=1", "--unbuffered", f"--output={RunDir(run_dir).log_file(name)}",
            f"--job-name={component if index is None else name}"]
    if gpus_per_task:
        cmd.append(f"--gpus-per-task={gpus_per_task}")  # each engine gets its own GPU
    if overlap:
        cmd.append("--overlap")
    c = profile.container
    if c.runtime == "apptainer" and c.image:
        cmd += ["apptainer", "exec", *c.flags, "--bind", run_dir, c.image, "python3"]
    else:
        cmd.append(python or sys.executable)
    cmd += ["-m", "pipeline.launch.component", component, "--run-dir", run_dir]
    return cmd + (["--index", str(index)] if index is not None else [])


def plan_steps(cfg, profile: ClusterProfile, run_dir: str, role: str, mode: str,
               python: str | None = None) -> list[tuple[str, list[str]]]:
    """(name, srun argv) of every job step this driver starts: trainer, engine_0.., rollout."""
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
        per_node = max(1, -(-n_eng // min(r.nodes, n_eng)))
        gpus = gpus_per_engine(cfg) if r.gpus_per_node else 0
        # Engines with GPUs of their own take them exclusively (no --overlap: two steps never get one GPU);
        # CPU engines, and colocated ones that share the trainer's GPUs, overlap.
        overlap = not gpus or mode == "colocated"
        for i in range(n_eng):
            steps.append((f"engine_{i}", srun_command("engine", run_dir, group=group, nodes=1, ntasks=1, ntasks_per_node=1,
                                                      profile=profile, overlap=overlap, python=python, gpus_per_task=gpus,
                                                      index=i, relative=i // per_node)))
        steps.append(("rollout", srun_command("rollout", run_dir, group=group, nodes=1, ntasks=1, ntasks_per_node=1,
                                              profile=profile, overlap=True, python=python)))
    return steps


def relocate(argv: list[str], node: str | None = None, exclude: list[str] = ()) -> list[str]:
    """`argv` (an srun line) placed on `node` (instead of its --relative node), or kept off `exclude`."""
    srun, rest = [], list(argv)
    while rest and rest[0].startswith("-") or rest[:1] == ["srun"]:  # srun's own options end at the program
        arg = rest.pop(0)
        if not arg.startswith(("--relative=", "--nodelist=", "--exclude=")):
            srun.append(arg)
    if node is not None:
        srun.append(f"--nodelist={node}")
    if exclude:
        srun.append(f"--exclude={','.join(sorted(exclude))}")
    return srun + rest


def gpus_per_engine(cfg) -> int:
    """An SGLang engine takes tp_size GPUs; the built-in engine one."""
    return getattr(cfg.engine, "tp_size", 1)


def step_group(step: str, mode: str) -> int | None:
    """The het group a step runs in (None outside hetjobs)."""
    if mode != "hetjob":
        return None
    return 0 if step == "trainer" else 1
