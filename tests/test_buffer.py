"""The HDF5 rollout buffer: schema round trip, atomic commits, corruption detection, kill safety."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from pipeline.buffer.reader import BufferReader, CorruptShardError, read_shard
from pipeline.buffer.schema import RolloutBatch, Sample, SampleStatus, expert_dtype
from pipeline.buffer.writer import ShardWriter, clean_uncommitted, step_dir

from conftest import REPO


def make_samples(n=6, moe=None, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(2, 9)), int(rng.integers(1, 7))
        routed = None
        if moe:
            layers, k, e = moe
            routed = rng.integers(0, e, size=(p + r - 1, layers, k))
        out.append(Sample(group_id=i // 2, sample_idx=i % 2, prompt_idx=10 + i,
                          prompt_ids=rng.integers(0, 50, p).tolist(), response_ids=rng.integers(0, 50, r).tolist(),
                          logprobs=(-rng.random(r)).tolist(), reward=float(i % 2), reward_components={"fmt": 0.5},
                          weight_version=3, status=[SampleStatus.COMPLETED, SampleStatus.TRUNCATED][i % 2], metadata={"i": i},
                          routed_experts=routed))
    return out


def test_roundtrip_all_columns(tmp_path):
    samples = make_samples(moe=(3, 2, 300))
    batch = RolloutBatch.from_samples(samples, num_experts=300)
    assert batch.routed_experts.dtype == np.uint16
    w = ShardWriter(str(tmp_path))
    w.write(0, batch)
    w.commit(0)
    got = BufferReader(str(tmp_path)).read_step(0)
    for i, s in enumerate(samples):
        assert got.sequence(i).tolist() == s.prompt_ids + s.response_ids
        assert got.logprobs[got.response_slice(i)].tolist() == pytest.approx(s.logprobs)
        assert got.routing(i).tolist() == s.routed_experts.tolist()
    assert got.status.tolist() == [0, 1] * 3 and got.weight_version.tolist() == [3] * 6
    assert got.reward_components["fmt"].tolist() == [0.5] * 6
    assert [int(m[-2]) for m in got.metadata] == list(range(6))


def test_every_status_round_trips_through_hdf5_as_its_number(tmp_path):
    """The shard stores SampleStatus values as the uint8 numbers of schema version 1 (0 completed ...
    4 deferred), and reads them back as the same numbers."""
    samples = make_samples(n=len(SampleStatus))
    for s, status in zip(samples, SampleStatus):
        s.status = status
    w = ShardWriter(str(tmp_path))
    w.write(0, RolloutBatch.from_samples(samples))
    w.commit(0)
    (path,) = [os.path.join(root, f) for root, _, files in os.walk(tmp_path) for f in files if f.endswith(".h5")]
    with h5py.File(path, "r") as f:
        assert f["status"].dtype == np.uint8 and f["status"][:].tolist() == [0, 1, 2, 3, 4]
    got = BufferReader(str(tmp_path)).read_step(0).status
    assert [SampleStatus(int(x)) for x in got] == list(SampleStatus)
    assert [s.label for s in SampleStatus] == ["completed", "truncated", "aborted", "failed", "deferred"]
    assert SampleStatus.from_label("deferred") is SampleStatus.DEFERRED


def test_expert_dtype_is_smallest():
    assert expert_dtype(8) == np.uint8 and expert_dtype(256) == np.uint8
    assert expert_dtype(257) == np.uint16 and expert_dtype(70000) == np.uint32


def test_columns_subset_reads_less(tmp_path):
    w = ShardWriter(str(tmp_path))
    w.write(0, RolloutBatch.from_samples(make_samples()))
    w.commit(0)
    path = os.path.join(step_dir(str(tmp_path), 0), "part-00000.h5")
    light = read_shard(path, columns=("rewards", "group_id"))
    assert len(light.tokens) == 0 and light.rewards.tolist() == [0, 1, 0, 1, 0, 1]


def test_step_invisible_until_commit_and_multi_producer(tmp_path):
    w0, w1 = ShardWriter(str(tmp_path), 0, 2), ShardWriter(str(tmp_path), 1, 2)
    reader = BufferReader(str(tmp_path))
    w0.write(5, RolloutBatch.from_samples(make_samples(seed=1)))
    assert not reader.is_committed(5) and reader.committed_steps() == []
    with pytest.raises(TimeoutError, match="producer 1"):
        w0.commit(5, timeout_s=0.2)
    w1.write(5, RolloutBatch.from_samples(make_samples(seed=2)))
    w0.commit(5)
    assert reader.committed_steps() == [5] and len(reader.read_step(5)) == 12


def commit_one(tmp_path, step=0):
    w = ShardWriter(str(tmp_path))
    w.write(step, RolloutBatch.from_samples(make_samples()))
    w.commit(step)
    return os.path.join(step_dir(str(tmp_path), step), "part-00000.h5")


def test_truncated_shard_is_detected_by_name(tmp_path):
    path = commit_one(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(CorruptShardError, match="part-00000.h5.*truncated"):
        BufferReader(str(tmp_path)).read_step(0)


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def data_offset(path, column):
    """File offset of a column's stored bytes (contiguous, or its first chunk)."""
    with h5py.File(path, "r") as f:
        d = f[column].id
        return d.get_offset() if d.get_offset() is not None else d.get_chunk_info(0).byte_offset


@pytest.mark.parametrize("column", ["logprobs", "tokens", "rewards", "group_id"])
def test_bit_flip_in_a_column_is_detected(tmp_path, column):
    path = commit_one(tmp_path)
    flip_byte(path, data_offset(path, column) + 3)
    with pytest.raises(CorruptShardError, match=f"part-00000.h5: column '{column}' (checksum mismatch|unreadable)"):
        BufferReader(str(tmp_path)).read_step(0)
    verify = BufferReader(str(tmp_path), verify=False)  # checksums off: the damage goes through...
    if column in ("logprobs", "rewards", "group_id"):
        verify.read_step(0)  # ...which is what buffer.verify_checksums=true is for


def test_damaged_hdf5_structure_is_detected(tmp_path):
    path = commit_one(tmp_path)
    with open(path, "r+b") as f:
        f.seek(0)
        f.write(b"\x00" * 64)  # the superblock
    with pytest.raises(CorruptShardError, match="part-00000.h5: not a readable HDF5 shard"):
        BufferReader(str(tmp_path)).read_step(0)


def test_corrupt_part_skipped_when_configured(tmp_path):
    w0, w1 = ShardWriter(str(tmp_path), 0, 2), ShardWriter(str(tmp_path), 1, 2)
    w0.write(0, RolloutBatch.from_samples(make_samples(seed=1)))
    w1.write(0, RolloutBatch.from_samples(make_samples(seed=2)))
    w0.commit(0)
    bad = os.path.join(step_dir(str(tmp_path), 0), "part-00001.h5")
    flip_byte(bad, data_offset(bad, "logprobs"))
    reader = BufferReader(str(tmp_path), on_corrupt="skip")
    assert len(reader.read_step(0)) == 6 and "part-00001.h5" in reader.skipped_parts[0]
    from pipeline.buffer.tools import verify

    ok, report = verify(str(tmp_path))
    assert not ok and "CORRUPT" in report and "part-00001.h5" in report


def test_unknown_schema_version_and_missing_column_refused(tmp_path):
    path = str(tmp_path / "x.h5")
    with h5py.File(path, "w") as f:
        f.attrs["schema_version"] = 99
    with pytest.raises(CorruptShardError, match="schema version 99"):
        read_shard(path)
    with h5py.File(path, "w") as f:
        f.attrs["schema_version"] = 1
        f["tokens"] = np.zeros(3, np.int32)
    with pytest.raises(CorruptShardError, match="missing columns"):
        read_shard(path)


WRITER = r"""
import sys, numpy as np
sys.path.insert(0, sys.argv[2])
from pipeline.buffer.schema import RolloutBatch
from pipeline.buffer.writer import ShardWriter, WriteOptions
n = 400  # 400 samples x 100k tokens: a ~200 MB shard, so the write takes long enough to be cut off
b = RolloutBatch(tokens=np.random.default_rng(0).integers(0, 1 << 30, n * 100_000, dtype=np.int32),
    sample_offsets=np.arange(n + 1, dtype=np.int64) * 100_000, prompt_len=np.full(n, 99_999, np.int32),
    response_len=np.ones(n, np.int32), loss_mask=np.ones(n, np.uint8), logprobs=np.zeros(n, np.float32),
    rewards=np.zeros(n, np.float32), group_id=np.arange(n), sample_idx=np.zeros(n, np.int32),
    prompt_idx=np.arange(n), weight_version=np.zeros(n, np.int64), status=np.zeros(n, np.uint8),
    metadata=["{}"] * n)
print("READY", flush=True)
w = ShardWriter(sys.argv[1], opts=WriteOptions(compression=None))
w.write(0, b)
w.commit(0)
"""


def test_writer_killed_mid_write_leaves_nothing_readable(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), REPO], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "READY"
    d = step_dir(str(tmp_path), 0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # SIGKILL the moment the shard's temp file exists (mid-write)
        if os.path.isdir(d) and any(f.endswith(".tmp") for f in os.listdir(d)):
            break
        time.sleep(0.001)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    leftovers = os.listdir(d)
    assert leftovers and all(f.startswith(".") and f.endswith(".tmp") for f in leftovers), leftovers
    reader = BufferReader(str(tmp_path))
    assert reader.committed_steps() == [] and not reader.is_committed(0)
    removed = clean_uncommitted(str(tmp_path))
    assert removed == [d] and not os.path.exists(d)


READER = r"""
import sys, time
sys.path.insert(0, sys.argv[2])
from pipeline.buffer.reader import BufferReader
r = BufferReader(sys.argv[1])
t0 = time.time()
c = r.wait_for_step(3, timeout_s=60)
print(len(r.read_step(3)), c["num_samples"], flush=True)
"""


def test_reader_in_another_process_sees_step_only_after_commit(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", READER, str(tmp_path), REPO], stdout=subprocess.PIPE, text=True)
    w = ShardWriter(str(tmp_path))
    w.write(3, RolloutBatch.from_samples(make_samples()))
    time.sleep(1.0)
    assert p.poll() is None  # part written but not committed: the reader still waits
    w.commit(3)
    out, _ = p.communicate(timeout=60)
    assert out.split() == ["6", "6"]


def test_select_and_concat_keep_samples_intact():
    b = RolloutBatch.from_samples(make_samples(moe=(2, 2, 8)), num_experts=8)
    sel = b.select([4, 1])
    assert sel.sequence(0).tolist() == b.sequence(4).tolist() and sel.routing(1).tolist() == b.routing(1).tolist()
    cat = RolloutBatch.concat([b.select([0, 1]), b.select([2, 3, 4, 5])])
    assert cat.tokens.tolist() == b.tokens.tolist() and cat.routed_experts.tolist() == b.routed_experts.tolist()


def test_select_fresh_by_weight_version_and_aborted_kept():
    from pipeline.buffer.reader import aborted_samples, select_fresh

    samples = make_samples(n=6)
    for i, s in enumerate(samples):
        s.weight_version = [5, 4, 3, 5, 2, 4][i]
    samples[1].status = SampleStatus.ABORTED
    b = RolloutBatch.from_samples(samples)
    fresh, dropped = select_fresh(b, current_version=5, max_staleness=1)
    assert fresh.weight_version.tolist() == [5, 4, 5, 4] and dropped == 2
    assert aborted_samples(b).tolist() == [1]


def test_gc_removes_commit_first(tmp_path):
    from pipeline.buffer.writer import remove_step

    commit_one(tmp_path, step=0)
    commit_one(tmp_path, step=1)
    remove_step(str(tmp_path), 0)
    assert BufferReader(str(tmp_path)).committed_steps() == [1]
    assert not os.path.exists(step_dir(str(tmp_path), 0))


def test_inspect_table(tmp_path):
    from pipeline.buffer.tools import inspect

    commit_one(tmp_path, step=0)
    os.makedirs(step_dir(str(tmp_path), 1))  # a step that never committed
    text = inspect(str(tmp_path))
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["step", "parts", "samples", "tokens"]
    assert lines[1].split()[:3] == ["0", "1", "6"]
    assert "uncommitted (ignored by readers): ['step_000001']" in text


def test_buffer_benchmark_runs(tmp_path):
    out = tmp_path / "b.json"
    res = subprocess.run([sys.executable, "bench/buffer_bench.py", "--samples", "16", "--tokens", "64", "--steps", "1",
                          "--layers", "2", "--topk", "2", "--experts", "8", "--dir", str(tmp_path), "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
    assert res.returncode == 0, res.stderr
    import json

    rows = json.load(open(out))["results"]
    assert len(rows) == 6 and all(r["write_MBps"] > 0 and r["read_MBps"] > 0 for r in rows)
    assert all(r["routing_bytes_per_slot"] <= 2 for r in rows if r["routing"])


@pytest.mark.slow
@pytest.mark.parametrize("script", ["engine_bench.py", "trainer_bench.py", "weight_sync_bench.py"])
def test_gpu_benchmarks_have_cpu_variants_that_run(tmp_path, script):
    """The GPU benchmarks' CPU-sized variants run here, so a change that breaks or slows them shows."""
    import json

    res = subprocess.run([sys.executable, f"bench/{script}", "--tiny"], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONPATH=REPO, OUT=str(tmp_path)))
    assert res.returncode == 0, res.stderr[-3000:]
    (path,) = tmp_path.glob("*.json")
    rows = json.load(open(path))["rows"]
    signed = {"first_mean_logprob"}  # trainer_bench: a log-probability, compared between two runs
    assert rows and all(v > 0 for r in rows for k, v in r.items() if isinstance(v, float) and k not in signed)
