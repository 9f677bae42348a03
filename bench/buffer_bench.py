"""Buffer throughput against the raw speed of the same filesystem, measured side by side in one run.

    python bench/buffer_bench.py [--dir /lustre/scratch/me/bench] [--samples 1024 --tokens 2048 --steps 3]

For each variant (compression x with/without routing traces) it writes `steps` rollout steps through
the real ShardWriter (in-memory HDF5 image, CRC-32, temp name, fsync, rename, commit record) and reads
them back through BufferReader (size + CRC-32 check, all columns). The raw baseline writes and reads
the same number of bytes with plain sequential write()+fsync / read() in 8 MiB blocks. Page-cache
copies are dropped (fadvise DONTNEED after fsync) before every read, for both. Ratios are
buffer time / raw time for the same logical bytes; bytes/token include all columns.
Prints a table and writes bench/results/buffer.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import h5py
import numpy as np

from pipeline.buffer.reader import BufferReader
from pipeline.buffer.schema import RolloutBatch, expert_dtype
from pipeline.buffer.writer import ShardWriter, WriteOptions, step_dir

BLOCK = 8 << 20


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def realistic_batch(samples: int, tokens: int, vocab: int, routing: tuple[int, int, int] | None, seed: int):
    """Prompt ~1/4 of each sequence; Zipf-like token ids; experts skewed per layer like real routers."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(tokens // 2, tokens + 1, samples)
    prompt = np.maximum(lengths // 4, 1)
    total = int(lengths.sum())
    offsets = np.zeros(samples + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    resp = lengths - prompt
    toks = np.minimum(rng.zipf(1.2, total), vocab - 1).astype(np.int32)
    routed = None
    if routing:
        layers, k, e = routing
        # Each layer prefers different experts (skewed like real routers); a token's k experts are distinct.
        rows = total - samples
        routed = np.empty((rows, layers, k), expert_dtype(e))
        stride = next(s for s in range(e // k, e) if np.gcd(s, e) == 1)
        for layer in range(layers):
            p = np.exp(rng.normal(0, 1.5, e))
            base = np.searchsorted(np.cumsum(p / p.sum()), rng.random(rows)).clip(0, e - 1)
            routed[:, layer] = (base[:, None] + stride * np.arange(k)[None, :]) % e
    r_total = int(resp.sum())
    return RolloutBatch(
        tokens=toks, sample_offsets=offsets, prompt_len=prompt.astype(np.int32), response_len=resp.astype(np.int32),
        loss_mask=np.ones(r_total, np.uint8), logprobs=(-rng.exponential(1.0, r_total)).astype(np.float32),
        rewards=rng.random(samples).astype(np.float32), group_id=np.arange(samples) // 8,
        sample_idx=(np.arange(samples) % 8).astype(np.int32), prompt_idx=np.arange(samples),
        weight_version=np.zeros(samples, np.int64), status=np.zeros(samples, np.uint8),
        metadata=['{"source": "bench"}'] * samples, routed_experts=routed)


def logical_bytes(b: RolloutBatch) -> int:
    arrays = [b.tokens, b.sample_offsets, b.prompt_len, b.response_len, b.loss_mask, b.logprobs, b.rewards,
              b.group_id, b.sample_idx, b.prompt_idx, b.weight_version, b.status]
    n = sum(a.nbytes for a in arrays) + sum(len(m) for m in b.metadata)
    return n + (b.routed_experts.nbytes if b.routed_experts is not None else 0)


def raw_io(directory: str, nbytes: int) -> tuple[float, float]:
    """Seconds to write (with fsync) and read back `nbytes` sequentially."""
    path = os.path.join(directory, "raw.bin")
    block = np.random.default_rng(0).integers(0, 255, BLOCK, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[: min(left, BLOCK)])
        os.fsync(f.fileno())
    t_write = time.perf_counter() - t0
    drop_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(BLOCK):
            pass
    t_read = time.perf_counter() - t0
    os.unlink(path)
    return t_write, t_read


def run_variant(directory, batches, compression, level):
    bdir = os.path.join(directory, f"buf_{compression}")
    shutil.rmtree(bdir, ignore_errors=True)
    writer = ShardWriter(bdir, opts=WriteOptions(compression=compression, compression_level=level))
    t0 = time.perf_counter()
    for step, b in enumerate(batches):
        writer.write(step, b)
        writer.commit(step)
    t_write = time.perf_counter() - t0
    file_bytes = routing_bytes = 0
    for step in range(len(batches)):
        path = os.path.join(step_dir(bdir, step), "part-00000.h5")
        file_bytes += os.path.getsize(path)
        with h5py.File(path, "r", locking=False) as f:
            if "routed_experts" in f:
                routing_bytes += f["routed_experts"].id.get_storage_size()
        drop_cache(path)
    reader = BufferReader(bdir, verify=True)
    t0 = time.perf_counter()
    for step in range(len(batches)):
        got = reader.read_step(step)
        assert got.num_tokens == batches[step].num_tokens
    t_read = time.perf_counter() - t0
    shutil.rmtree(bdir)
    return t_write, t_read, file_bytes, routing_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="filesystem to measure (default: a temp dir in the cwd)")
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=2048, help="max tokens per sample (lengths uniform in [T/2, T])")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--compressions", default="none,lzf,gzip")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "buffer_cpu.json"))
    args = p.parse_args()
    directory = tempfile.mkdtemp(prefix="lockstep-bench-", dir=args.dir or os.getcwd())
    results = []
    try:
        for routing in (None, (args.layers, args.topk, args.experts)):
            batches = [realistic_batch(args.samples, args.tokens, 151_936, routing, seed) for seed in range(args.steps)]
            logical = sum(logical_bytes(b) for b in batches)
            tokens = sum(b.num_tokens for b in batches)
            raw_w, raw_r = raw_io(directory, logical)
            for comp in args.compressions.split(","):
                w, r, fbytes, rbytes = run_variant(directory, batches, None if comp == "none" else comp, 1)
                results.append({
                    "routing": routing is not None, "compression": comp, "logical_MB": logical / 1e6,
                    "file_MB": fbytes / 1e6, "bytes_per_token": fbytes / tokens,
                    "routing_bytes_per_slot": rbytes / sum(b.routed_experts.size for b in batches) if routing else None,
                    "write_MBps": logical / w / 1e6, "read_MBps": logical / r / 1e6,
                    "raw_write_MBps": logical / raw_w / 1e6, "raw_read_MBps": logical / raw_r / 1e6,
                    "write_ratio": raw_w / w, "read_ratio": raw_r / r, "write_read_ratio": (raw_w + raw_r) / (w + r),
                })
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    head = f"{'routing':>7} {'comp':>5} {'MB':>8} {'B/tok':>7} {'write MB/s':>11} {'raw':>7} {'read MB/s':>10} {'raw':>7} {'w+r ratio':>9} {'route B/slot':>12}"
    print(head)
    for r in results:
        print(f"{'yes' if r['routing'] else 'no':>7} {r['compression']:>5} {r['logical_MB']:8.0f} {r['bytes_per_token']:7.1f}"
              f" {r['write_MBps']:11.0f} {r['raw_write_MBps']:7.0f} {r['read_MBps']:10.0f} {r['raw_read_MBps']:7.0f}"
              f" {r['write_read_ratio']:9.2f} {r['routing_bytes_per_slot'] or 0:12.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
