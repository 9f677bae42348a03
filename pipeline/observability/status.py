"""`lockstep status RUN_DIR`: where a run stands and what happened to it, from the run directory alone.

Progress (steps in metrics.jsonl, the last complete checkpoint), then one row per job attempt (the
Slurm driver's run_dir/events.jsonl: when it started, on which nodes, the step it resumed from, how
it ended), then every failure with its node and what was done about it (restart in place, requeue).
"""

from __future__ import annotations

import time

from pipeline.observability.metrics import read_metrics
from pipeline.run import RunDir


def clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"


def attempts(events: list[dict]) -> list[dict]:
    """One row per start event: {attempt, job, started, nodes, resume_step, ended}."""
    rows: list[dict] = []
    for e in events:
        kind = e.get("event")
        if kind == "start":
            nodes = e.get("nodes")
            if isinstance(nodes, dict):
                nodes = " ".join(f"{'trainer' if g == '0' else 'rollout'}={n}" for g, n in sorted(nodes.items()))
            rows.append({"attempt": e.get("attempt"), "job": e.get("job"), "started": e.get("time"),
                         "nodes": nodes or "-", "resume_step": e.get("resume_step", 0), "ended": "running"})
        elif rows and kind == "requeue":
            rows[-1]["ended"] = f"requeued by the driver: {e['reason']}" + (
                f"; excluded {', '.join(e['exclude'])}" if e.get("exclude") else "")
        elif rows and kind == "preempted":
            rows[-1]["ended"] = f"pre-empted, checkpointed at step {e.get('checkpoint')}, requeued"
        elif rows and kind == "interrupted" and rows[-1]["ended"] == "running":
            rows[-1]["ended"] = "ended by Slurm (requeue, cancel or node failure)"
        elif rows and kind == "failure" and e.get("component") == "node":
            for r in rows:
                if r["attempt"] == e.get("attempt"):
                    r["ended"] = f"node {e['node']} failed ({e['reason']}); Slurm requeued the job"
        elif rows and kind == "end":
            rows[-1]["ended"] = "completed" if e["status"] == "completed" else f"failed: {e.get('reason', '')}"
    return rows


def status(run_dir: str) -> str:
    from pipeline.trainer.checkpoint import latest_checkpoint  # torch: only when asked

    rundir = RunDir(run_dir)
    records = read_metrics(run_dir)
    events = rundir.read_events()
    ckpt = latest_checkpoint(run_dir)
    steps = [r["step"] for r in records]
    lines = [f"run_dir {run_dir}: {len(records)} steps logged" + (f" (last step {steps[-1]})" if steps else "")
             + f", last checkpoint: {'step ' + str(ckpt) if ckpt is not None else 'none'}"]
    rows = attempts(events)
    if rows:
        lines += ["", f"{'attempt':<8} {'job':<8} {'started':<9} {'nodes':<26} {'resumed from':<13} ended"]
        for r in rows:
            lines.append(f"{r['attempt']:<8} {r['job']:<8} {clock(r['started']):<9} {r['nodes']:<26}"
                         f" {'step ' + str(r['resume_step']):<13} {r['ended']}")
    failures = [e for e in events if e.get("event") == "failure"]
    if failures:
        lines += ["", f"{'time':<9} {'attempt':<8} {'component':<10} {'node':<6} {'at step':<8} {'what':<24} action"]
        for e in failures:
            lines.append(f"{clock(e.get('time')):<9} {e.get('attempt', '-'):<8} {e['component']:<10}"
                         f" {e.get('node') or '?':<6} {str(e.get('step', '-')):<8} {e['reason'][:24]:<24}"
                         f" {e['action']} ({e['why']})")
    if not events:
        lines.append("no job events (a local run, or a job that has not started)")
    return "\n".join(lines)
