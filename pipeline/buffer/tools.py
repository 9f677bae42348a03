"""`lockstep buffer inspect RUN_DIR` and `lockstep buffer verify RUN_DIR`."""

from __future__ import annotations

import os

import numpy as np

from pipeline.buffer.reader import BufferReader, CorruptShardError, read_shard
from pipeline.buffer.schema import SampleStatus
from pipeline.buffer.writer import COMMIT_NAME, step_dir
from pipeline.run import RunDir


def buffer_dir_of(run_dir: str) -> str:
    d = RunDir(run_dir).buffer
    return d if os.path.isdir(d) else run_dir


def inspect(run_dir: str) -> str:
    bdir = buffer_dir_of(run_dir)
    reader = BufferReader(bdir, verify=False)
    rows = [("step", "parts", "samples", "tokens", "reward", "resp_len", "versions", "status", "MB")]
    total_bytes = 0
    for step in reader.committed_steps():
        commit = reader.commit(step)
        batch = reader.read_step(step, columns=PER_SAMPLE_ONLY)
        nbytes = sum(p["bytes"] for p in commit["parts"])
        total_bytes += nbytes
        counts = np.bincount(batch.status, minlength=len(SampleStatus))
        status = " ".join(f"{SampleStatus(i).label[0]}{c}" for i, c in enumerate(counts) if c)
        v = batch.weight_version
        rows.append((str(step), str(len(commit["parts"])), str(len(batch)), str(commit["num_tokens"]),
                     f"{batch.rewards.mean():.3f}", f"{batch.response_len.mean():.1f}",
                     f"{v.min()}-{v.max()}" if v.min() != v.max() else str(v.min()), status, f"{nbytes / 1e6:.2f}"))
    pending = uncommitted_steps(bdir)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(f"{len(rows) - 1} committed steps, {total_bytes / 1e6:.2f} MB"
                 + (f"; uncommitted (ignored by readers): {pending}" if pending else ""))
    lines.append("status: " + " ".join(f"{s.label[0]}={s.label}" for s in SampleStatus))
    return "\n".join(lines)


PER_SAMPLE_ONLY = ("prompt_len", "response_len", "rewards", "group_id", "sample_idx", "prompt_idx",
                   "weight_version", "status", "sample_offsets")


def uncommitted_steps(bdir: str) -> list[str]:
    if not os.path.isdir(bdir):
        return []
    return sorted(n for n in os.listdir(bdir) if n.startswith("step_")
                  and not os.path.exists(os.path.join(bdir, n, COMMIT_NAME)))


def verify(run_dir: str) -> tuple[bool, str]:
    """Check sizes and the checksum of every column of every committed part. Returns (all good, report)."""
    bdir = buffer_dir_of(run_dir)
    reader = BufferReader(bdir, verify=True)
    lines, ok = [], True
    steps = reader.committed_steps()
    for step in steps:
        d = step_dir(bdir, step)
        try:
            commit = reader.commit(step)
        except (CorruptShardError, ValueError) as e:
            ok = False
            lines.append(f"CORRUPT step {step}: {e}")
            continue
        for part in commit["parts"]:
            problem = reader.check_part(d, part)
            if problem is None:
                try:
                    read_shard(os.path.join(d, part["name"]), checksums=part.get("checksums", {}))
                except CorruptShardError as e:
                    problem = str(e)
            if problem:
                ok = False
                lines.append(f"CORRUPT {problem}")
    lines.append(f"{'OK' if ok else 'FAILED'}: {len(steps)} committed steps checked in {bdir}")
    return ok, "\n".join(lines)
