"""Heartbeats: each process rewrites run_dir/heartbeat/<component>.json every few seconds.

A supervisor (the Slurm driver) that finds one older than `faults.heartbeat_timeout_s` treats the
component as dead, even while its process still exists: a stopped or frozen process, a node that
stopped answering. The record names the node, so a failure can be pinned on it.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from pipeline.run.files import publish
from pipeline.run.rundir import RunDir


def node_name() -> str:
    """The Slurm node this process runs on (its hostname outside Slurm)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class Heartbeat:
    """A daemon thread publishing {component, node, pid, beat} every `interval_s` seconds."""

    def __init__(self, rundir: RunDir, component: str, interval_s: float):
        assert interval_s > 0, interval_s
        self.rundir, self.component, self.interval_s = rundir, component, interval_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"heartbeat-{component}", daemon=True)

    def start(self) -> "Heartbeat":
        self.beat()
        self.thread.start()
        return self

    def beat(self) -> None:
        publish(self.rundir.heartbeat_file(self.component),
                {"component": self.component, "node": node_name(), "pid": os.getpid(), "beat": time.time()})

    def _loop(self) -> None:
        while not self.stopped.wait(self.interval_s):
            self.beat()  # a run directory it cannot write to ends the beats: the component counts as dead

    def stop(self) -> None:
        self.stopped.set()

    def end(self) -> None:
        """The component finished its work: stop beating and withdraw the file (nothing to watch)."""
        self.stop()
        self.thread.join()
        try:
            os.unlink(self.rundir.heartbeat_file(self.component))
        except FileNotFoundError:
            pass


def silent(beats: dict[str, dict], timeout_s: float, now: float | None = None) -> dict[str, float]:
    """component -> seconds since its last beat, for those silent longer than `timeout_s`."""
    now = time.time() if now is None else now
    return {name: now - b["beat"] for name, b in beats.items() if now - b["beat"] > timeout_s}
