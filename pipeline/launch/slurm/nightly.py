"""Nightly scaling matrix: nodes x model x mode, submitted as job arrays, and a report.

    lockstep nightly submit slurm/nightly/matrix.yaml [--dry-run] [--wait]
    lockstep nightly report OUT_DIR

A matrix file names a base recipe, overrides for every entry, and axes. Each entry gets its own run
directory under out_dir/. Colocated entries of the same shape (nodes, tasks, GPUs) become one Slurm
job array (arrays need uniform resources and cannot be heterogeneous); hetjob and paired entries are
submitted one after another. Every job writes its metrics into its run directory; `report` reads
them all and tabulates and plots step time, tokens/s per GPU and weight-sync time against node count.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

from pipeline.config import load_config, load_resolved
from pipeline.config.core import from_dict, load_yaml
from pipeline.config.schema import RunConfig
from pipeline.errors import UserError
from pipeline.launch.prepare import prepare_run
from pipeline.launch.slurm.plan import check_request, render_script
from pipeline.launch.slurm.profile import load_profile
from pipeline.launch.slurm.submit import submit
from pipeline.observability.metrics import read_metrics


@dataclass
class MatrixConfig:
    base: str = "configs/tiny-slurm-local.yaml"
    """The recipe every entry starts from."""
    out_dir: str = "runs/nightly"
    """Each entry runs in out_dir/<entry name>/."""
    overrides: list[str] = field(default_factory=list)
    """Overrides applied to every entry (key.sub=value)."""
    nodes: list[int] = field(default_factory=lambda: [1, 2])
    """Trainer node counts (train.num_gpus = nodes x slurm.trainer.tasks_per_node)."""
    models: list[str] = field(default_factory=lambda: ["tiny-dense", "tiny-moe"])
    """model.init presets (or model.path directories) to run."""
    modes: list[str] = field(default_factory=lambda: ["colocated"])
    """slurm.mode of the entries: colocated entries go into job arrays, the others run as a series."""
    array_parallelism: int = 4
    """Array elements running at the same time (%N)."""


@dataclass(frozen=True)
class Entry:
    name: str
    cfg: RunConfig


def expand(matrix: MatrixConfig) -> list[Entry]:
    base = load_config(matrix.base, matrix.overrides)
    entries = []
    for nodes, model, mode in itertools.product(matrix.nodes, matrix.models, matrix.modes):
        name = f"n{nodes}-{os.path.basename(model)}-{mode}"
        tasks = base.slurm.trainer.tasks_per_node
        over = [f"run_dir={os.path.join(matrix.out_dir, name)}", f"slurm.mode={mode}",
                f"slurm.trainer.nodes={nodes}", f"train.num_gpus={nodes * tasks}",
                "model.path=" + model if os.path.isdir(model) else f"model.init={model}"]
        cfg = load_config(matrix.base, list(matrix.overrides) + over)
        gbs = cfg.train.global_batch_size
        if gbs % cfg.train.num_gpus:
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=gbs - gbs % cfg.train.num_gpus))
        entries.append(Entry(name, cfg))
    return entries


def load_matrix(path: str) -> MatrixConfig:
    return from_dict(MatrixConfig, load_yaml(path))


def shape(cfg: RunConfig) -> tuple:
    t = cfg.slurm.trainer
    return (t.nodes, t.tasks_per_node, t.gpus_per_node, t.cpus_per_task, t.partition)


def array_script(entries: list[Entry], list_file: str, parallel: int) -> str:
    """One job array over colocated entries of one shape; element i runs the i-th line of list_file."""
    cfg = entries[0].cfg
    profile = load_profile(cfg.slurm.cluster)
    cmd = f'{shlex.quote(sys.executable)} -u -m pipeline.launch.slurm.driver --run-dir "$RUN_DIR" --role all'
    text = render_script(cfg, profile, "$RUN_DIR", cmd, output=os.path.join(os.path.dirname(list_file), "array-%A_%a.out"))
    lines = text.splitlines()
    head = lines.index("set -euo pipefail") - 1  # before the blank line that ends the #SBATCH block
    lines[head:head] = [f"#SBATCH --array=0-{len(entries) - 1}%{parallel}"]
    at = lines.index("set -euo pipefail") + 1
    lines[at:at] = [f'RUN_DIR=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {list_file})']
    return "\n".join(lines).replace("# Lockstep colocated job for $RUN_DIR", f"# Lockstep nightly array ({len(entries)} runs)")


def submit_matrix(matrix: MatrixConfig, dry_run: bool = False) -> dict:
    entries = expand(matrix)
    os.makedirs(matrix.out_dir, exist_ok=True)
    prepared = []
    for e in entries:
        profile = load_profile(e.cfg.slurm.cluster)
        check_request(e.cfg, profile)
        cfg, layout = prepare_run(e.cfg, profile)
        prepared.append(Entry(e.name, cfg))
    arrays: dict[tuple, list[Entry]] = {}
    series = []
    for e in prepared:
        (arrays.setdefault(shape(e.cfg), []) if e.cfg.slurm.mode == "colocated" else series).append(e)
    out = {"arrays": [], "series": [], "scripts": []}
    for i, group in enumerate(arrays.values()):
        list_file = os.path.abspath(os.path.join(matrix.out_dir, f"array{i}.txt"))
        with open(list_file, "w") as f:
            f.write("".join(e.cfg.run_dir + "\n" for e in group))
        script = os.path.join(matrix.out_dir, f"array{i}.sbatch")
        with open(script, "w") as f:
            f.write(array_script(group, list_file, matrix.array_parallelism))
        out["scripts"].append(script)
        if not dry_run:
            res = subprocess.run(["sbatch", "--parsable", script], capture_output=True, text=True)
            if res.returncode:
                raise UserError(f"sbatch {script} failed: {res.stderr.strip()}")
            out["arrays"].append({"job": res.stdout.strip().split(";")[0], "runs": [e.name for e in group]})
    for e in series:
        if not dry_run:
            out["series"].append({"job": submit(e.cfg, e.cfg.run_dir)[0].job_id, "run": e.name})
    with open(os.path.join(matrix.out_dir, "submitted.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def collect(out_dir: str) -> list[dict]:
    rows = []
    for name in sorted(os.listdir(out_dir)):
        run = os.path.join(out_dir, name)
        records = read_metrics(run) if os.path.isdir(run) else []
        if not records:
            continue
        cfg = load_resolved(run)
        steady = records[2:] or records  # the first steps include start-up and compilation
        step = sum(r["perf/step_time_s"] for r in steady) / len(steady)
        devices = cfg.train.num_gpus + cfg.engine.num_engines
        tokens = sum(r.get("train/tokens", 0) for r in steady) / len(steady)
        rows.append({"run": name, "nodes": cfg.slurm.trainer.nodes, "model": cfg.model.path or cfg.model.init,
                     "mode": cfg.slurm.mode, "steps": len(records), "step_time_s": step,
                     "tokens_per_s_per_gpu": tokens / step / devices,
                     "weight_sync_s": sum(r["perf/weight_sync_time_s"] for r in steady) / len(steady),
                     "reward_last": records[-1]["rollout/reward_mean"]})
    return rows


def report(out_dir: str) -> str:
    if not os.path.isdir(out_dir):
        raise UserError(f"{out_dir!r} is {'a file' if os.path.exists(out_dir) else 'not found'}: give the matrix's"
                        " out_dir (a directory of runs)")
    rows = collect(out_dir)
    if not rows:
        raise UserError(f"no finished runs with metrics under {out_dir}")
    lines = ["| run | nodes | model | mode | steps | step time s | tokens/s per GPU | weight sync s | reward |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['nodes']} | {r['model']} | {r['mode']} | {r['steps']} | {r['step_time_s']:.3f}"
                     f" | {r['tokens_per_s_per_gpu']:.1f} | {r['weight_sync_s']:.4f} | {r['reward_last']:.3f} |")
    table = "\n".join(lines)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, os.path.join(out_dir, "scaling.png"))
    return table


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    series: dict[tuple, list[dict]] = {}
    for r in rows:
        series.setdefault((r["model"], r["mode"]), []).append(r)
    for (model, mode), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["nodes"])
        xs = [r["nodes"] for r in rs]
        for ax, key in zip(axes, ("step_time_s", "tokens_per_s_per_gpu", "weight_sync_s")):
            ax.plot(xs, [r[key] for r in rs], marker="o", label=f"{model} {mode}")
    for ax, title in zip(axes, ("step time (s)", "tokens/s per GPU", "weight sync (s)")):
        ax.set(title=title, xlabel="trainer nodes")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def wait(submitted: dict, poll_s: float = 3.0) -> dict[str, str]:
    """Block until every submitted job has left the queue; returns sacct's final state per job."""
    import time

    jobs = [a["job"] for a in submitted["arrays"]] + [s["job"] for s in submitted["series"]]
    while True:
        q = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(jobs)],
                           capture_output=True, text=True).stdout.split()
        if not q:
            break
        time.sleep(poll_s)
    out = subprocess.run(["sacct", "-X", "-n", "--parsable2", "-o", "JobID,State", "-j", ",".join(jobs)],
                         capture_output=True, text=True).stdout.split()
    return dict(line.split("|")[:2] for line in out)
