"""Where the seconds before the first step go: each component times its start-up phases and publishes
them as run_dir/startup/<component>.json (RunDir.startup_file); the launcher publishes when the
command began. The run summary and bench/gpu_matrix.py read them.

  {"started": <epoch s>, "ready": <epoch s>, "phases": [["imports", 1.9], ["load", 2.1], ...]}

For the trainer, "ready" is the moment its first step begins.
"""

from __future__ import annotations

import contextlib
import os
import time

from pipeline.run import RunDir
from pipeline.utils.fs import atomic_write_json, read_json

LAUNCH = "launch"


def process_started() -> float:
    """When this process began (epoch seconds; Linux /proc, so Python's own imports count too), or now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time in clock ticks
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return time.time()


class StartupClock:
    """Wall-clock seconds of named phases since the component's process started."""

    def __init__(self, started: float | None = None):
        self.phases: dict[str, float] = {}
        if started is None:  # from the process's start: the interpreter and its imports come first
            started = process_started()
            self.phases["imports"] = max(time.time() - started, 0.0)
        self.started = started

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.monotonic() - t0

    def publish(self, path: str | None) -> None:
        """Write the record (ready = now) to `path`; None: nowhere (a component run outside a run dir)."""
        if path is None:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write_json(path, {"started": self.started, "ready": time.time(),
                                 "phases": [[k, round(v, 3)] for k, v in self.phases.items()]})


def read_startup(run_dir: str) -> dict[str, dict]:
    """component -> its record, for every record published in this run directory."""
    return {name: read_json(path) for name, path in RunDir(run_dir).startup_files().items()}


def time_to_first_step(records: dict[str, dict]) -> float | None:
    """Seconds from the command's start to trainer rank 0's first step (None if either is unknown)."""
    if LAUNCH not in records or "trainer_0" not in records:
        return None
    return records["trainer_0"]["ready"] - records[LAUNCH]["started"]


def startup_line(run_dir: str) -> str | None:
    """'31.2s to the first step: engine_0 12.1s (load 2.0, graphs 8.1), trainer_0 ...' or None."""
    records = read_startup(run_dir)
    total = time_to_first_step(records)
    if total is None:
        return None
    parts = []
    for name, r in records.items():
        if name == LAUNCH:
            continue
        phases = ", ".join(f"{k} {v:.1f}" for k, v in r["phases"])
        parts.append(f"{name} {r['ready'] - r['started']:.1f}s ({phases})")
    return f"{total:.1f}s to the first step: " + "; ".join(parts)
