"""Publish and wait for the run directory's small control files (no Ray, no extra service).

A file is published atomically (pipeline/utils/fs.py: temp name, fsync, rename) with a `published`
time stamp added, so a reader polling for its name sees all of it or nothing.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from pipeline.utils.fs import atomic_write_json, read_json

__all__ = ["publish", "wait_for", "read_json"]


def publish(path: str, info: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_json(path, dict(info, published=time.time()))


def wait_for(path: str, timeout_s: float, alive: Callable[[], None] | None = None, poll_s: float = 0.05) -> dict:
    """The file's contents once it exists. `alive` is called while waiting (it raises when whatever
    should write the file has died)."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f}s")
        if alive:
            alive()
        time.sleep(poll_s)
    return read_json(path)
