"""Writing rollout shards: build the HDF5 file in memory, then one sequential atomic write.

Per step and producer: step_K/part-RRRRR.h5 (written under a hidden temp name, fsynced, renamed) and
a part record part-RRRRR.json with its size and an xxh3-64 checksum of every column's bytes. The step's leader (producer 0) waits for
every part record and writes step_K/COMMIT.json; readers take a step only once COMMIT.json exists.
HDF5 writes the columns straight into the temp file through a file object that keeps disk errors
out of HDF5 (as fast as a raw sequential write, bench/buffer_bench.py); checksums are taken over the arrays in memory (6+ GB/s), so neither writer
nor reader reads a file twice. No file
is ever written by two processes, so HDF5 file locking is off (as Lustre needs).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import h5py
import numpy as np
import xxhash

from pipeline.buffer.schema import SCHEMA_VERSION, RolloutBatch
from pipeline.errors import is_storage_failure, storage_error
from pipeline.utils.fs import atomic_write_json, fsync_dir, read_json, tmp_name

COMMIT_NAME = "COMMIT.json"


def step_dir(buffer_dir: str, step: int) -> str:
    return os.path.join(buffer_dir, f"step_{step:06d}")


def part_name(producer_rank: int) -> str:
    return f"part-{producer_rank:05d}.h5"


@dataclass
class WriteOptions:
    compression: str | None = "gzip"  # for token, mask and routing columns; None: contiguous, uncompressed
    compression_level: int = 1
    chunk_rows: int = 1 << 18

    @classmethod
    def from_config(cls, cfg) -> "WriteOptions":
        return cls(compression=None if cfg.compression == "none" else cfg.compression,
                   compression_level=cfg.compression_level)


def checksum(arr) -> str:
    """xxh3-64 of a column: the raw bytes of a numeric array, or the UTF-8 of a list of strings."""
    if isinstance(arr, list):
        return xxhash.xxh3_64_hexdigest("\x00".join(arr).encode())
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(arr))


class GuardedFile:
    """A file HDF5 writes through (h5py's file-object driver) that keeps I/O errors away from HDF5.

    When the disk fills or the filesystem goes away mid-write, HDF5 left with a failed write keeps
    its file open in a broken state, and the library's own clean-up at interpreter exit then crashes
    the process (SIGSEGV). Here the first OSError is recorded and every later write is dropped, so
    HDF5 always closes cleanly; `raise_if_failed` re-raises the error afterwards, and the caller
    removes the file, which was never renamed into place."""

    def __init__(self, path: str):
        self._f = open(path, "w+b", buffering=0)
        self.error: OSError | None = None
        self._pos = 0

    def write(self, b) -> int:
        n = len(memoryview(b).cast("B"))
        if self.error is None:
            try:
                self._f.seek(self._pos)
                self._f.write(b)
            except OSError as e:
                self.error = e
        self._pos += n
        return n

    def read(self, n: int = -1) -> bytes:
        self._f.seek(self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return data

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0:
            self._pos = pos
        elif whence == 1:
            self._pos += pos
        else:
            self._pos = os.fstat(self._f.fileno()).st_size + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        if self.error is None:
            try:
                self._f.truncate(size)
            except OSError as e:
                self.error = e
        return size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        """fsync and close; the first error of the whole write is raised here."""
        try:
            if self.error is None:
                try:
                    os.fsync(self._f.fileno())
                except OSError as e:
                    self.error = e
        finally:
            self._f.close()
        if self.error is not None:
            raise self.error


def write_shard_file(path: str, batch: RolloutBatch, attrs: dict, opts: WriteOptions) -> dict[str, str]:
    """Write one shard as an HDF5 file at `path` and fsync it (the caller renames it into place).
    Returns the checksum of every column."""
    sums: dict[str, str] = {}
    sink = GuardedFile(path)
    try:
        _write_columns(sink, batch, attrs, opts, sums)
    finally:
        sink.close()
    return sums


def _write_columns(sink: GuardedFile, batch: RolloutBatch, attrs: dict, opts: WriteOptions, sums: dict) -> None:
    with h5py.File(sink, "w", locking=False) as f:
        def put(name, arr, compress=False):
            arr = np.ascontiguousarray(arr)
            sums[name] = checksum(arr)
            kw = {}
            if arr.size and compress and opts.compression:
                kw["chunks"] = (min(len(arr), opts.chunk_rows),) + arr.shape[1:]
                kw.update(compression=opts.compression, shuffle=True)
                if opts.compression == "gzip":
                    kw["compression_opts"] = opts.compression_level
            f.create_dataset(name, data=arr, **kw)

        put("tokens", batch.tokens, compress=True)
        put("sample_offsets", batch.sample_offsets)
        for col in ("prompt_len", "response_len", "rewards", "group_id", "sample_idx", "prompt_idx",
                    "weight_version", "status"):
            put(col, getattr(batch, col))
        put("loss_mask", batch.loss_mask, compress=True)
        put("logprobs", batch.logprobs)
        f.create_dataset("metadata", data=np.array(batch.metadata, dtype=object), dtype=h5py.string_dtype())
        sums["metadata"] = checksum(list(batch.metadata))
        grp = f.create_group("reward_components")
        for k, v in batch.reward_components.items():
            grp.create_dataset(k, data=v)
            sums[f"reward_components/{k}"] = checksum(v)
        if batch.routed_experts is not None:
            put("routed_experts", batch.routed_experts, compress=True)
        f.attrs["schema_version"] = SCHEMA_VERSION
        f.attrs["num_samples"] = len(batch)
        f.attrs["num_tokens"] = batch.num_tokens
        f.attrs["created"] = time.time()
        for k, v in attrs.items():
            f.attrs[k] = v if v is not None else ""


class ShardWriter:
    """Writes this producer's part of each step, and (as leader) commits steps."""

    def __init__(self, buffer_dir: str, producer_rank: int = 0, num_producers: int = 1, model_id: str = "",
                 opts: WriteOptions | None = None):
        self.buffer_dir, self.rank, self.num_producers = buffer_dir, producer_rank, num_producers
        self.model_id = model_id
        self.opts = opts or WriteOptions()
        self.producer = f"{socket.gethostname()}:{os.getpid()}:rollout{producer_rank}"
        os.makedirs(buffer_dir, exist_ok=True)

    def write(self, step: int, batch: RolloutBatch, attrs: dict | None = None, summary: dict | None = None) -> dict:
        d = step_dir(self.buffer_dir, step)
        os.makedirs(d, exist_ok=True)
        meta = {"model_id": self.model_id, "step": step, "producer": self.producer}
        meta.update(attrs or {})
        name = part_name(self.rank)
        final = os.path.join(d, name)
        tmp = tmp_name(final)
        try:
            sums = write_shard_file(tmp, batch, meta, self.opts)
            nbytes = os.path.getsize(tmp)
            os.replace(tmp, final)
            fsync_dir(d)
            record = {"name": name, "bytes": nbytes, "hash": "xxh3_64", "checksums": sums, "num_samples": len(batch),
                      "num_tokens": batch.num_tokens, "producer": self.producer, "summary": summary or {}}
            atomic_write_json(os.path.join(d, name.replace(".h5", ".json")), record)
        except BaseException as e:  # the part record is what makes a part count: without it, none is taken
            for path in (tmp, final):
                if os.path.exists(path):
                    os.unlink(path)
            if is_storage_failure(e):
                raise storage_error(f"rollout shard of step {step}", final, e) from e
            raise
        return record

    def commit(self, step: int, timeout_s: float = 600.0, extra: dict | None = None) -> dict:
        """Leader only: wait for every producer's part record, then write COMMIT.json atomically."""
        assert self.rank == 0, "only producer 0 commits a step"
        d = step_dir(self.buffer_dir, step)
        deadline = time.monotonic() + timeout_s
        records = []
        for r in range(self.num_producers):
            path = os.path.join(d, part_name(r).replace(".h5", ".json"))
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"step {step}: producer {r} wrote no part within {timeout_s:.0f}s")
                time.sleep(0.05)
            records.append(read_json(path))
        commit = {"schema_version": SCHEMA_VERSION, "step": step, "parts": records, "created": time.time(),
                  "num_samples": sum(p["num_samples"] for p in records),
                  "num_tokens": sum(p["num_tokens"] for p in records)}
        commit.update(extra or {})
        atomic_write_json(os.path.join(d, COMMIT_NAME), commit)
        return commit


def clean_uncommitted(buffer_dir: str) -> list[str]:
    """On restart: remove temp files and parts of steps that never committed. Returns what was removed."""
    import shutil

    removed = []
    if not os.path.isdir(buffer_dir):
        return removed
    for name in sorted(os.listdir(buffer_dir)):
        d = os.path.join(buffer_dir, name)
        if not (name.startswith("step_") and os.path.isdir(d)):
            continue
        if os.path.exists(os.path.join(d, COMMIT_NAME)):
            for f in os.listdir(d):
                if f.endswith(".tmp"):
                    os.unlink(os.path.join(d, f))
                    removed.append(os.path.join(d, f))
            continue
        shutil.rmtree(d)
        removed.append(d)
    return removed


def remove_step(buffer_dir: str, step: int) -> None:
    """Garbage-collect a consumed step (commit record first, so no reader takes a half-deleted step)."""
    import shutil

    d = step_dir(buffer_dir, step)
    commit = os.path.join(d, COMMIT_NAME)
    if os.path.exists(commit):
        os.unlink(commit)
    shutil.rmtree(d, ignore_errors=True)
