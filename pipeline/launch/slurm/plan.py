"""What a submission asks for, checked before anything is submitted, and the sbatch text (pure)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from pipeline.config.schema import RunConfig, SlurmGroupConfig
from pipeline.errors import UserError
from pipeline.launch.slurm.profile import ClusterProfile
from pipeline.launch.slurm.steps import plan_steps
from pipeline.run import RunDir


@dataclass(frozen=True)
class Component:
    """One het group (or one job in paired mode)."""

    name: str  # trainer | rollout | all
    group: SlurmGroupConfig
    partition: str | None


def components(cfg: RunConfig, profile: ClusterProfile) -> list[Component]:
    s = cfg.slurm
    if s.mode == "colocated":
        return [Component("all", s.trainer, s.trainer.partition or profile.partition)]
    return [Component("trainer", s.trainer, s.trainer.partition or profile.partition),
            Component("rollout", s.rollout, s.rollout.partition or profile.partition)]


def check_request(cfg: RunConfig, profile: ClusterProfile) -> None:
    """Refuse impossible requests before submission, each with the fix."""
    s = cfg.slurm
    if cfg.sft:
        raise UserError("algo.loss_type=sft_loss runs with `lockstep run` only so far (the Slurm plan always has a"
                        " rollout component): run it there, or inside an salloc")
    trainer_tasks = s.trainer.nodes * s.trainer.tasks_per_node
    if trainer_tasks != cfg.train.num_gpus:
        raise UserError(f"slurm.trainer: nodes x tasks_per_node = {trainer_tasks} but train.num_gpus = {cfg.train.num_gpus}:"
                        " make them equal (one trainer process per GPU)")
    engines = s.rollout.nodes * s.rollout.tasks_per_node
    if s.mode != "colocated" and engines != cfg.engine.num_engines:
        raise UserError(f"slurm.rollout: nodes x tasks_per_node = {engines} engines but engine.num_engines ="
                        f" {cfg.engine.num_engines}: make them equal")
    if cfg.weights.type == "tensor" and (s.mode != "colocated" or s.trainer.nodes > 1):
        raise UserError(f"weights.type=tensor hands CUDA IPC handles to engines on trainer rank 0's node: use"
                        f" slurm.mode=colocated on one node (got mode {s.mode!r}, {s.trainer.nodes} trainer node(s)),"
                        " or weights.type=broadcast")
    tp = getattr(cfg.engine, "tp_size", 1)
    if s.mode != "colocated" and s.rollout.gpus_per_node and s.rollout.tasks_per_node * tp > s.rollout.gpus_per_node:
        raise UserError(f"slurm.rollout: {s.rollout.tasks_per_node} engines per node x engine.tp_size {tp} GPUs"
                        f" > gpus_per_node {s.rollout.gpus_per_node}: lower tasks_per_node or tp_size")
    spares = {name: g.spare_nodes for name, g in (("trainer", s.trainer), ("rollout", s.rollout)) if g.spare_nodes}
    if spares and s.mode == "colocated":
        raise UserError(f"slurm spare nodes ({', '.join(f'slurm.{k}.spare_nodes={v}' for k, v in spares.items())}) take"
                        " the steps of a failed node in hetjob or paired mode; a colocated job's engines must stay on"
                        " its trainer's nodes: set them to 0, or use slurm.mode=hetjob")
    for comp in components(cfg, profile):
        g = comp.group
        if g.gpus_per_node > profile.gpus_per_node:
            raise UserError(f"slurm.{comp.name if comp.name != 'all' else 'trainer'}.gpus_per_node = {g.gpus_per_node} but"
                            f" profile {profile.name!r} has {profile.gpus_per_node} GPUs per node")
        if profile.gpus_per_node and g.tasks_per_node > profile.gpus_per_node and comp.name == "trainer":
            raise UserError(f"slurm.trainer.tasks_per_node = {g.tasks_per_node} > {profile.gpus_per_node} GPUs per node")


def group_lines(comp: Component, cfg: RunConfig) -> list[str]:
    g, s = comp.group, cfg.slurm
    lines = [f"#SBATCH --nodes={g.nodes + g.spare_nodes}", f"#SBATCH --ntasks-per-node={g.tasks_per_node}",
             f"#SBATCH --cpus-per-task={g.cpus_per_task}"]
    if g.spare_nodes:
        lines.append("#SBATCH --no-kill")  # a node going down leaves the job running: the driver moves its steps
    if comp.partition:
        lines.append(f"#SBATCH --partition={comp.partition}")
    if g.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={g.gpus_per_node}")
    if g.mem_gb:
        lines.append(f"#SBATCH --mem={int(g.mem_gb)}G")
    if s.account:
        lines.append(f"#SBATCH --account={s.account}")
    if s.qos:
        lines.append(f"#SBATCH --qos={s.qos}")
    return lines


def render_script(cfg: RunConfig, profile: ClusterProfile, run_dir: str, command: str, role: str = "all",
                  output: str | None = None, python: str | None = None) -> str:
    """The batch script. `command` runs the driver (submitit's `_submit` or the driver module directly).

    hetjob: two components, `#SBATCH hetjob` between them; colocated: one; paired: call once per
    role ("trainer" / "rollout"), each a job of its own. The driver starts each component with its
    own `srun --het-group=N` line (pipeline/launch/slurm/driver.py).
    """
    s = cfg.slurm
    comps = components(cfg, profile)
    if s.mode == "paired":
        comps = [c for c in comps if c.name == role]
    out = output or RunDir(run_dir).slurm_output
    lines = ["#!/bin/bash",
             f"# Lockstep {s.mode} job for {run_dir}",
             f"# cluster profile: {profile.name} ({profile.description})",
             f"#SBATCH --job-name={s.job_name}" + (f"-{role}" if s.mode == "paired" else ""),
             f"#SBATCH --time={s.time_min}",
             f"#SBATCH --output={out}",
             f"#SBATCH --signal=B:USR2@{s.signal_delay_s}",
             "#SBATCH --requeue",
             "#SBATCH --open-mode=append"]
    for i, comp in enumerate(comps):
        if i:
            lines.append("#SBATCH hetjob")
        lines.append(f"# -- component {i}: {comp.name}")
        lines.extend(group_lines(comp, cfg))
    lines += ["", "set -euo pipefail"]
    lines += [f"module load {m}" for m in profile.modules]
    for k, v in sorted(profile.env.items()):
        lines.append(f"export {k}={shlex.quote(str(v))}")
    lines += ["export SUBMITIT_EXECUTOR=slurm",
              f"export LOCKSTEP_CLUSTER={shlex.quote(profile.name)}",
              f"export LOCKSTEP_SLURM_MODE={s.mode}",
              f"export LOCKSTEP_SLURM_ROLE={role}",
              "", "# The driver starts these job steps and watches them: a failed or silent one is restarted in",
              "# place, or the job requeued without its node (slurm.max_restarts, slurm.max_requeues); on USR2",
              "# it has the trainer checkpoint, then requeues the job (which resumes from run_dir):"]
    for name, argv in plan_steps(cfg, profile, run_dir, role, s.mode, python=python):
        lines.append(f"#   {name}: {shlex.join(argv)}")
    lines += [f"exec {command}", ""]
    return "\n".join(lines)
