"""metrics.jsonl: one JSON object per step, appended and fsynced by trainer rank 0 (the sink that is
always on; the run summary, reward.png and the nightly report read it).

Keys are namespaced: rollout/*, train/*, perf/*, weights/*, eval/*. A reader ignores a torn last line (a
kill in the middle of an append), so the file is always readable. NaN is written as null, +-inf as
+-1e308 (JSON has neither).
"""

from __future__ import annotations

import json
import math
import os

from pipeline.run import RunDir


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


class JsonlSink:
    """run_dir/metrics.jsonl (a MetricSink)."""

    def __init__(self, run_dir: str, start_step: int = 0):
        self.path = RunDir(run_dir).metrics
        # On resume drop records of steps that will be re-run (and a torn last line), so the file has
        # one line per step.
        kept = [r for r in read_metrics(run_dir) if r.get("step", -1) < start_step]
        with open(self.path, "w") as f:
            for r in kept:
                f.write(json.dumps(r, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def write(self, record: dict, step: int) -> None:
        assert record.get("step", step) == step, (record.get("step"), step)
        line = json.dumps({k: _clean(v) for k, v in {"step": step, **record}.items()}, sort_keys=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def close(self) -> None:
        pass  # every write is already on disk


def read_metrics(run_dir: str) -> list[dict]:
    path = RunDir(run_dir).metrics
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # torn final line
    return out
