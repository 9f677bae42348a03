"""Writing rollout shards: build the HDF5 file in memory, then one sequential atomic write.

Per step and producer: step_K/part-RRRRR.h5 (temp name -> fsync -> rename) and a part record
part-RRRRR.json with its size and CRC-32. The step's leader (producer 0) waits for every part record
and writes step_K/COMMIT.json; readers take a step only once COMMIT.json exists. Building the file in
memory makes the checksum free and turns the write into one large sequential write, which is what
Lustre is good at; no file is ever written by two processes, so HDF5 file locking is not needed.
"""

from __future__ import annotations

import os
import socket
import time
import zlib
from dataclasses import dataclass

import h5py
import numpy as np

from pipeline.buffer.schema import SCHEMA_VERSION, RolloutBatch
from pipeline.utils.fs import atomic_write_bytes, atomic_write_json, read_json

COMMIT_NAME = "COMMIT.json"


def step_dir(buffer_dir: str, step: int) -> str:
    return os.path.join(buffer_dir, f"step_{step:06d}")


def part_name(producer_rank: int) -> str:
    return f"part-{producer_rank:05d}.h5"


@dataclass
class WriteOptions:
    compression: str | None = "gzip"  # for token and routing columns; None disables
    compression_level: int = 1
    chunk_rows: int = 1 << 16

    @classmethod
    def from_config(cls, cfg) -> "WriteOptions":
        return cls(compression=None if cfg.compression == "none" else cfg.compression,
                   compression_level=cfg.compression_level)


def encode_shard(batch: RolloutBatch, attrs: dict, opts: WriteOptions) -> bytes:
    """The HDF5 file image of one shard."""
    f = h5py.File(f"shard-{id(batch)}", "w", driver="core", backing_store=False)
    try:
        def put(name, arr, compress=False):
            arr = np.ascontiguousarray(arr)
            kw = {}
            if arr.size:
                rows = min(len(arr), opts.chunk_rows)
                kw["chunks"] = (rows,) + arr.shape[1:]
                kw["fletcher32"] = True
                if compress and opts.compression:
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
        grp = f.create_group("reward_components")
        for k, v in batch.reward_components.items():
            grp.create_dataset(k, data=v)
        if batch.routed_experts is not None:
            put("routed_experts", batch.routed_experts, compress=True)
        f.attrs["schema_version"] = SCHEMA_VERSION
        f.attrs["num_samples"] = len(batch)
        f.attrs["num_tokens"] = batch.num_tokens
        f.attrs["created"] = time.time()
        for k, v in attrs.items():
            f.attrs[k] = v if v is not None else ""
        f.flush()
        return f.id.get_file_image()
    finally:
        f.close()


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
        image = encode_shard(batch, meta, self.opts)
        name = part_name(self.rank)
        atomic_write_bytes(os.path.join(d, name), image)
        record = {"name": name, "bytes": len(image), "crc32": zlib.crc32(image), "num_samples": len(batch),
                  "num_tokens": batch.num_tokens, "producer": self.producer, "summary": summary or {}}
        atomic_write_json(os.path.join(d, name.replace(".h5", ".json")), record)
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
