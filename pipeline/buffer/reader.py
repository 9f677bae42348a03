"""Reading rollout shards: committed steps only, checksums verified, columns read on demand.

A step exists for a reader when step_K/COMMIT.json exists. Each part's size is checked against the
commit record; with verify=True every column read is checked against its xxh3-64 checksum (damaged
HDF5 structure fails the open or the read and is reported the same way).
A corrupt part raises `CorruptShardError` naming the file, or is skipped with a warning when
on_corrupt="skip" — nothing silently wrong enters training. Files open with HDF5 locking off, as
Lustre needs; it is safe because no file is ever written by two processes.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

import h5py
import numpy as np

from pipeline.buffer.schema import PER_SAMPLE, REQUIRED_COLUMNS, SCHEMA_VERSION, RolloutBatch
from pipeline.buffer.writer import COMMIT_NAME, checksum, step_dir
from pipeline.errors import UserError
from pipeline.utils.fs import read_json

log = logging.getLogger("lockstep.buffer")
os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")


class CorruptShardError(UserError):
    pass


def read_shard(path: str, columns: tuple[str, ...] | None = None, checksums: dict[str, str] | None = None) -> RolloutBatch:
    """Read one shard file; `columns` limits which columns are loaded; with `checksums` (from the
    commit record) every column read is verified."""
    try:
        f = h5py.File(path, "r", locking=False)
    except OSError as e:
        raise CorruptShardError(f"{path}: not a readable HDF5 shard ({e})") from None
    with f:
        version = int(f.attrs.get("schema_version", -1))
        if version != SCHEMA_VERSION:
            raise CorruptShardError(f"{path}: schema version {version}, this Lockstep reads version {SCHEMA_VERSION}")
        missing = [c for c in REQUIRED_COLUMNS if c not in f]
        if missing:
            raise CorruptShardError(f"{path}: missing columns {missing}")
        want = set(columns) if columns is not None else None

        def verify(name, value):
            if checksums is not None and name in checksums and checksum(value) != checksums[name]:
                raise CorruptShardError(f"{path}: column {name!r} checksum mismatch (the file changed after commit)")
            return value

        def get(name, empty_dtype):
            if want is not None and name not in want:
                return np.zeros(0, dtype=empty_dtype)
            try:
                return verify(name, f[name][()])
            except (OSError, ValueError, KeyError) as e:
                raise CorruptShardError(f"{path}: column {name!r} unreadable ({e})") from None

        data = {c: get(c, np.int64) for c in PER_SAMPLE + ("sample_offsets",)}
        meta = []
        if want is None or "metadata" in want:
            try:
                meta = [m.decode() if isinstance(m, bytes) else str(m) for m in f["metadata"][()]]
            except (OSError, ValueError) as e:
                raise CorruptShardError(f"{path}: column 'metadata' unreadable ({e})") from None
            verify("metadata", meta)
        comps = {}
        if "reward_components" in f and (want is None or "reward_components" in want):
            comps = {k: verify(f"reward_components/{k}", v[()]) for k, v in f["reward_components"].items()}
        return RolloutBatch(
            tokens=get("tokens", np.int32),
            loss_mask=get("loss_mask", np.uint8),
            logprobs=get("logprobs", np.float32),
            metadata=meta,
            reward_components=comps,
            routed_experts=get("routed_experts", np.uint8) if "routed_experts" in f else None,
            **data,
        )


class BufferReader:
    def __init__(self, buffer_dir: str, verify: bool = True, on_corrupt: str = "error"):
        assert on_corrupt in ("error", "skip")
        self.buffer_dir, self.verify, self.on_corrupt = buffer_dir, verify, on_corrupt
        self.skipped_parts: list[str] = []

    def commit_path(self, step: int) -> str:
        return os.path.join(step_dir(self.buffer_dir, step), COMMIT_NAME)

    def is_committed(self, step: int) -> bool:
        return os.path.exists(self.commit_path(step))

    def committed_steps(self) -> list[int]:
        if not os.path.isdir(self.buffer_dir):
            return []
        steps = []
        for name in os.listdir(self.buffer_dir):
            if name.startswith("step_") and os.path.exists(os.path.join(self.buffer_dir, name, COMMIT_NAME)):
                steps.append(int(name[5:]))
        return sorted(steps)

    def commit(self, step: int) -> dict:
        c = read_json(self.commit_path(step))
        if c.get("schema_version") != SCHEMA_VERSION:
            raise CorruptShardError(f"{self.commit_path(step)}: schema version {c.get('schema_version')}, expected {SCHEMA_VERSION}")
        return c

    def wait_for_step(self, step: int, timeout_s: float = 3600.0, poll_s: float = 0.05,
                      alive: Callable[[], None] | None = None) -> dict:
        """Block until `step` is committed. `alive` is called while waiting (it may raise to give up)."""
        deadline = time.monotonic() + timeout_s
        while not self.is_committed(step):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout step {step} not committed within {timeout_s:.0f}s")
            if alive:
                alive()
            time.sleep(poll_s)
        return self.commit(step)

    def check_part(self, d: str, part: dict) -> str | None:
        path = os.path.join(d, part["name"])
        if not os.path.exists(path):
            return f"{path}: missing"
        size = os.path.getsize(path)
        if size != part["bytes"]:
            return f"{path}: {size} bytes, the commit record says {part['bytes']} (truncated or overwritten)"
        return None

    def read_step(self, step: int, columns: tuple[str, ...] | None = None) -> RolloutBatch:
        commit = self.commit(step)
        d = step_dir(self.buffer_dir, step)
        batches = []
        for part in commit["parts"]:
            path = os.path.join(d, part["name"])
            problem = self.check_part(d, part)
            batch = None
            if problem is None:
                try:
                    batch = read_shard(path, columns, part.get("checksums") if self.verify else None)
                except CorruptShardError as e:
                    problem = str(e)
            if problem is not None:
                if self.on_corrupt == "error":
                    raise CorruptShardError(problem)
                log.warning("skipping corrupt shard: %s", problem)
                self.skipped_parts.append(problem)
                continue
            batches.append(batch)
        if not batches:
            raise CorruptShardError(f"step {step}: no readable parts in {d}")
        return RolloutBatch.concat(batches)

    def summary(self, step: int) -> dict:
        """The commit's per-part summaries merged (rewards, timings) without opening the HDF5 files."""
        commit = self.commit(step)
        return {"commit": commit, "parts": [p.get("summary", {}) for p in commit["parts"]]}


def select_fresh(batch: RolloutBatch, current_version: int, max_staleness: int) -> tuple[RolloutBatch, int]:
    """Keep samples generated at most `max_staleness` versions ago (async mode). Returns (batch, dropped)."""
    keep = np.flatnonzero(batch.weight_version >= current_version - max_staleness)
    return (batch if len(keep) == len(batch) else batch.select(keep)), len(batch) - len(keep)


def aborted_samples(batch: RolloutBatch) -> np.ndarray:
    """Indices of samples whose generation was aborted (kept in the shard for continuation)."""
    from pipeline.buffer.schema import SampleStatus

    return np.flatnonzero(batch.status == SampleStatus.ABORTED)
