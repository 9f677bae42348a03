"""Faults survived, bad input refused, nothing lost: real processes, real signals, real filesystems."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipeline.config.schema import WeightsConfig
from pipeline.errors import StorageError
from pipeline.models.hf_io import load_model, read_state_dict
from pipeline.observability.metrics import read_metrics
from pipeline.rollout.client import EngineClient, EngineError
from pipeline.run import RunDir
from pipeline.weights.broadcast import BroadcastTransport

from conftest import REPO, wait_until
from test_e2e import lockstep, procs_of

# small steps, no evaluation (the tests that want one turn it on: test_eval.py, test_tracking.py)
SMALL = ["rollout_batch_size=8", "global_batch_size=64", "eval.interval=0", "logging.plot=false", "--no-progress"]


def launch(run_dir, *overrides, env=None):
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", "configs/tiny.yaml", f"run_dir={run_dir}",
                             *SMALL, *overrides], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **(env or {})))


def weights_equal(a_dir, b_dir) -> bool:
    a, b = read_state_dict(a_dir), read_state_dict(b_dir)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def engine_pid(run_dir, i=0) -> int:
    return json.load(open(RunDir(run_dir).engine_file(i)))["pid"]


# ---- engines die -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_engine_killed_mid_rollout_is_restarted_and_the_run_is_unchanged(tmp_path):
    """SIGKILL one of two engines while it generates: its requests go to the other engine, the launcher
    restarts it, the trainer catches it up to the current weights, and the run ends with exactly the
    weights of an uninterrupted run (true on-policy: results do not depend on which engine served)."""
    common = ["num_rollout=8", "engine.num_engines=2", "determinism.true_on_policy=true"]
    ref = lockstep("run", "configs/tiny.yaml", f"run_dir={tmp_path}/ref", *SMALL, *common)
    assert ref.returncode == 0, ref.stderr[-3000:]

    run = tmp_path / "faulty"
    p = launch(run, *common)
    assert wait_until(lambda: len(read_metrics(str(run))) >= 2, 180)
    first_pid = engine_pid(run, 0)
    # The trainer waits (stopped) until the restarted engine is up: the 6 steps left take about as long as
    # an engine's start, and the run must not end before the restart it is meant to live through.
    trainer = RunDir(run).heartbeats()["trainer_0"]["pid"]
    os.kill(trainer, signal.SIGSTOP)
    os.kill(first_pid, signal.SIGKILL)
    try:
        assert wait_until(lambda: engine_pid(run, 0) != first_pid, 120)  # a new process published its address
    finally:
        os.kill(trainer, signal.SIGCONT)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    assert "engine_0 died (exit -9); restarting it" in err
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == list(range(8))  # every step trained exactly once
    assert weights_equal(RunDir(tmp_path / "ref").hf_export, RunDir(run).hf_export)  # ... and on the same groups
    # The restarted engine rejoined the weight group: caught up by the trainer's watcher, or, when it
    # registered just before a step's sync, taken into that sync's rebuilt group (1 engine, then 2).
    trainer_log = open(RunDir(run).log_file("trainer_0")).read()
    assert "caught up" in trainer_log or re.search(r": 1 engine\(s\)\n(.*\n)*.*: 2 engine\(s\)", trainer_log)
    assert wait_until(lambda: not procs_of(run), 20)


@pytest.mark.slow
def test_engine_that_keeps_dying_ends_the_run_named(tmp_path):
    # Every engine process exits at its 3rd request: restarts run out and the run stops, naming it.
    p = launch(tmp_path / "run", "num_rollout=50", "engine.max_restarts=1",
               env={"LOCKSTEP_FAULTS": "engine_exit_at_request=3"})
    out, err = p.communicate(timeout=300)
    assert p.returncode == 1
    assert "restarting it (0 restarts left)" in err and "component 'engine_0' failed (exit status 43)" in err
    assert wait_until(lambda: not procs_of(tmp_path / "run"), 20)


# ---- trainer ranks die, checkpoints ------------------------------------------------------------------

@pytest.mark.slow
def test_trainer_rank_killed_stops_cleanly_and_resume_matches(tmp_path):
    common = ["num_rollout=6", "train.num_gpus=2", "checkpoint.save_interval=2"]
    ref = lockstep("run", "configs/tiny.yaml", f"run_dir={tmp_path}/ref", *SMALL, *common)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = tmp_path / "run"
    p = launch(run, *common)
    assert wait_until(lambda: os.path.exists(os.path.join(RunDir(run).checkpoints, "step_000002", "trainer_state.json")), 300)
    rank1 = next(pid for pid in procs_of(run) if "RANK=1" in open(f"/proc/{pid}/environ").read().split("\0"))
    os.kill(rank1, signal.SIGKILL)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 1 and "component 'trainer_1' failed" in err
    assert wait_until(lambda: not procs_of(run), 30), procs_of(run)
    res = lockstep("run", "configs/tiny.yaml", f"run_dir={run}", *SMALL, *common)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from checkpoint step" in open(RunDir(run).log_file("trainer_0")).read()
    assert [r["step"] for r in read_metrics(str(run))] == list(range(6))
    assert weights_equal(RunDir(tmp_path / "ref").hf_export, RunDir(run).hf_export)


@pytest.mark.slow
def test_kill_during_checkpoint_save_keeps_the_previous_one(tmp_path):
    run = tmp_path / "run"
    common = ["num_rollout=6", "checkpoint.save_interval=2", "checkpoint.keep_last=1"]
    p = launch(run, *common, env={"LOCKSTEP_FAULTS": "slow_checkpoint=4:60"})
    tmp_ckpt = Path(RunDir(run).checkpoints) / ".step_000004.tmp"
    assert wait_until(lambda: (tmp_ckpt / ".metadata").exists(), 300)  # DCP files written, not committed
    os.kill(p.pid, signal.SIGKILL)  # the launcher; its children follow it (PR_SET_PDEATHSIG)
    p.communicate()
    assert wait_until(lambda: not procs_of(run), 30)
    assert sorted(os.listdir(RunDir(run).checkpoints)) == [".step_000004.tmp", "step_000002"]
    res = lockstep("run", "configs/tiny.yaml", f"run_dir={run}", *SMALL, *common)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from checkpoint step 2" in open(RunDir(run).log_file("trainer_0")).read()
    assert sorted(os.listdir(RunDir(run).checkpoints)) == ["step_000006"]  # keep_last=1, no leftovers
    assert [r["step"] for r in read_metrics(str(run))] == list(range(6))


# ---- weight sync interrupted -----------------------------------------------------------------------

def perturbed(model_dir, seed):
    _, model = load_model(model_dir)
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def engine_weights(client, names):
    return {n: torch.tensor(client.request("POST", "/get_weights_by_name", {"name": n, "truncate_size": -1}))
            for n in names}


def assert_holds(client, weights, version):
    assert client.weight_version() == version
    got = engine_weights(client, weights)
    assert all(torch.equal(got[n], weights[n].flatten()) for n in weights)


SENDER = textwrap.dedent("""
    import sys, torch
    from pipeline.config.schema import WeightsConfig
    from pipeline.rollout.client import EngineClient
    from pipeline.weights.broadcast import BroadcastTransport
    url, path = sys.argv[1], sys.argv[2]
    weights = torch.load(path)
    s = BroadcastTransport(WeightsConfig(bucket_size_mb=0.01, timeout_s=5), [EngineClient(url)],
                           torch.device("cpu"), "127.0.0.1")
    s.connect()
    print("connected", flush=True)
    s.send(list(weights.items()), version=7)
    print("sent", flush=True)
""")


@pytest.mark.slow  # ~40 s on 2 busy cores: two updates through a 0.3 s-per-bucket engine
def test_trainer_gone_mid_update_engine_keeps_last_complete_version(dense_dir, engine_factory, tmp_path):
    eng = engine_factory(dense_dir, env={"LOCKSTEP_FAULTS": "engine_update_delay_s=0.3"})
    client = EngineClient(eng.url)
    _, model = load_model(dense_dir)
    original = dict(model.state_dict())
    new = perturbed(dense_dir, 1)
    torch.save(new, tmp_path / "w.pt")
    sender = subprocess.Popen([sys.executable, "-c", SENDER, eng.url, str(tmp_path / "w.pt")], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    assert sender.stdout.readline().strip() == "connected"
    time.sleep(1.0)  # a few of its ~20 buckets are staged on the engine
    sender.kill()
    sender.wait()
    time.sleep(6)  # the engine's broadcast fails (peer gone, or the 5 s group timeout)
    assert_holds(client, original, 0)  # the old version, whole: nothing of the cut-off update applied
    assert len(client.generate([[5, 6]], [{"max_new_tokens": 3, "ignore_eos": True, "sampling_seed": 0}])[0].output_ids) == 3
    # The dead sender left its weight-update session open (SGLang refuses a second begin): the next
    # sender closes it and sends its version in a session of its own.
    stats = client.request("GET", "/server_info")["stats"]
    assert stats["weight_sessions_begun"] == 1 and stats["weight_sessions_ended"] == 0
    sender = BroadcastTransport(WeightsConfig(bucket_size_mb=1, timeout_s=5), [client], torch.device("cpu"),
                                "127.0.0.1")
    sender.connect()
    sender.send(list(new.items()), version=8)
    sender.close()
    assert_holds(client, new, 8)
    stats = client.request("GET", "/server_info")["stats"]
    assert stats["weight_sessions_begun"] == stats["weight_sessions_ended"] == 2


@pytest.mark.slow
def test_engine_killed_mid_update_survivors_get_it_and_a_restarted_one_catches_up(dense_dir, engine_factory):
    a = engine_factory(dense_dir)
    b = engine_factory(dense_dir, env={"LOCKSTEP_FAULTS": "engine_update_delay_s=0.5"})
    urls = [a.url, b.url]
    sender = BroadcastTransport(WeightsConfig(bucket_size_mb=0.01, timeout_s=5),
                                [EngineClient(u) for u in urls], torch.device("cpu"), "127.0.0.1", urls=lambda: urls)
    sender.connect()
    v1 = perturbed(dense_dir, 1)
    killer = threading.Timer(1.0, lambda: os.kill(b.proc.pid, signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    stats = sender.send(list(v1.items()), version=1)
    assert time.monotonic() - t0 < 60 and stats["retries"] >= 1
    assert [e.url for e in sender.clients] == [a.url]
    assert_holds(EngineClient(a.url), v1, 1)
    # A replacement engine (new process, new port) is picked up and sent the last version from the host copy.
    c = engine_factory(dense_dir)
    urls[1] = c.url
    assert sender.catch_up()
    assert [e.url for e in sender.clients] == [a.url, c.url]
    assert_holds(EngineClient(c.url), v1, 1)
    stats = EngineClient(c.url).request("GET", "/server_info")["stats"]
    assert stats["weight_sessions_begun"] == stats["weight_sessions_ended"] == 1  # its own session, closed
    assert not sender.catch_up()  # nothing changed since
    sender.close()


@pytest.mark.slow
def test_joining_an_engine_that_died_meanwhile_joins_its_replacement_at_once(dense_dir, engine_factory):
    """A restarted trainer reads the engine's published address while the engine is being killed and
    restarted (the chaos run with seed 16212: trainer and engine killed 2 s apart). The join to the dead
    address must fail within a poll and go to the replacement, not wait the group's timeout for a rank
    that never comes (the trainer sat 300 s in the rendezvous, and the driver then requeued the job)."""
    dead, new = engine_factory(dense_dir), engine_factory(dense_dir)
    os.kill(dead.proc.pid, signal.SIGKILL)
    dead.proc.wait()
    urls = [dead.url]
    sender = BroadcastTransport(WeightsConfig(bucket_size_mb=0.01, timeout_s=60), [EngineClient(dead.url)],
                                torch.device("cpu"), "127.0.0.1", urls=lambda: urls)
    urls[0] = new.url  # the replacement has published its address by the time the join fails
    t0 = time.monotonic()
    sender.connect([EngineClient(dead.url)])
    assert time.monotonic() - t0 < 20, "waited out the rendezvous timeout"
    assert [c.url for c in sender.clients] == [new.url]
    v1 = perturbed(dense_dir, 1)
    sender.send(list(v1.items()), version=1)
    assert_holds(EngineClient(new.url), v1, 1)
    sender.close()


@pytest.mark.slow
def test_weight_update_to_a_stopped_engine_times_out_with_a_clear_error(dense_dir, engine_factory):
    eng = engine_factory(dense_dir)
    sender = BroadcastTransport(WeightsConfig(bucket_size_mb=0.01, timeout_s=3), [EngineClient(eng.url)],
                                torch.device("cpu"), "127.0.0.1")
    sender.connect()
    os.kill(eng.proc.pid, signal.SIGSTOP)  # alive but silent: the case a hang would come from
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="weight update to version 1 failed"):
            sender.send(list(perturbed(dense_dir, 1).items()), version=1)
        assert time.monotonic() - t0 < 60
    finally:
        os.kill(eng.proc.pid, signal.SIGCONT)
    _, model = load_model(dense_dir)
    time.sleep(4)  # its own side of the broadcast times out too
    assert_holds(EngineClient(eng.url), dict(model.state_dict()), 0)
    sender.close()


# ---- storage ---------------------------------------------------------------------------------------

@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs (a real filesystem that fills up), or a skip naming why it cannot be mounted."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs CAP_SYS_ADMIN): {res.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])


def fill(path, leave_bytes):
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    with open(os.path.join(path, "filler"), "wb") as f:
        f.write(b"\0" * max(free - leave_bytes, 0))


DISK_FULL_WRITER = """
import os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from pipeline.buffer.schema import RolloutBatch
from pipeline.buffer.writer import ShardWriter
from pipeline.errors import StorageError
from test_buffer import make_samples
writer = ShardWriter(sys.argv[1])
try:
    writer.write(1, RolloutBatch.from_samples(make_samples(2000)))
except StorageError as e:
    print("refused:", e)
"""


def test_disk_full_while_writing_a_shard(small_fs):
    """In a process of its own, because the failure used to surface at interpreter exit: HDF5 left
    with a failed write crashed the process (SIGSEGV) after the test itself had passed."""
    from pipeline.buffer.reader import BufferReader
    from pipeline.buffer.writer import ShardWriter, step_dir
    from pipeline.buffer.schema import RolloutBatch
    from test_buffer import make_samples

    writer = ShardWriter(RunDir(small_fs).buffer)
    writer.write(0, RolloutBatch.from_samples(make_samples(8)))
    writer.commit(0)
    fill(small_fs, 64 << 10)
    res = subprocess.run([sys.executable, "-c", DISK_FULL_WRITER, RunDir(small_fs).buffer], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "refused:" in res.stdout and "No space left on device" in res.stdout, res.stdout
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    step1 = Path(step_dir(RunDir(small_fs).buffer, 1))
    assert not step1.exists() or os.listdir(step1) == []  # no part, no record, no temp file
    reader = BufferReader(RunDir(small_fs).buffer)
    assert reader.committed_steps() == [0] and len(reader.read_step(0)) == 8


def test_disk_full_during_checkpoint_keeps_the_previous_one(small_fs, dense_dir):
    from pipeline.trainer import checkpoint

    _, model = load_model(dense_dir)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    port = 29000 + os.getpid() % 1000
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        checkpoint.save(str(small_fs), 1, model, opt, sched, {}, keep_last=3)
        fill(small_fs, 16 << 10)
        with pytest.raises(StorageError, match="checkpoint of step 2.*No space left"):
            checkpoint.save(str(small_fs), 2, model, opt, sched, {}, keep_last=3)
        assert checkpoint.list_checkpoints(str(small_fs)) == [1]
        assert not [n for n in os.listdir(RunDir(small_fs).checkpoints) if n.endswith(".tmp")]
        os.unlink(small_fs / "filler")
        assert checkpoint.load(str(small_fs), 1, model, opt, sched)["step"] == 1
    finally:
        dist.destroy_process_group()


def test_read_only_run_dir_is_a_clear_error(small_fs):
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    res = lockstep("run", "configs/tiny.yaml", f"run_dir={small_fs}/run", "--no-progress", timeout=120)
    assert res.returncode == 2
    assert "cannot write" in res.stderr and "Read-only file system" in res.stderr
    assert "Traceback" not in res.stderr


# ---- bad input -------------------------------------------------------------------------------------

def bad_rows_file(path):
    rows = [json.dumps({"prompt": "1+2=", "label": "3"}), "{not json", json.dumps(["a list"]),
            json.dumps({"prompt": 12, "label": "1"}), json.dumps({"label": "no prompt"}),
            json.dumps({"prompt": "9" * 5000, "label": "9"}), json.dumps({"prompt": "2+2=", "label": "4"})]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_bad_rows_are_skipped_and_counted_or_refused(tmp_path):
    from pipeline.config.schema import DataConfig
    from pipeline.errors import UserError
    from pipeline.models.tokenizer import build_tiny_tokenizer
    from pipeline.rollout.data import PromptDataset

    data = bad_rows_file(tmp_path / "bad.jsonl")
    tok = build_tiny_tokenizer(str(tmp_path / "tok"))
    ds = PromptDataset(DataConfig(prompt_data=str(data), max_prompt_len=64), tok, seed=0)
    assert ds.stats.kept == 2 and ds.stats.rows == 7
    assert sum(ds.stats.skipped.values()) == 5 and "invalid JSON" in ds.stats.skipped
    with pytest.raises(UserError, match=r"bad.jsonl:2: invalid JSON"):
        PromptDataset(DataConfig(prompt_data=str(data), on_bad_row="error"), tok, seed=0)


def failing_reward(response, label, metadata):
    if len(response) % 2:
        raise ValueError("reward service hiccup")
    return 1.0


@pytest.mark.slow
def test_reward_function_raising_marks_samples_failed_and_the_run_goes_on(tmp_path):
    res = lockstep("run", "configs/tiny.yaml", f"run_dir={tmp_path}/run", *SMALL, "num_rollout=3",
                   "rollout.rm_type=test_reliability:failing_reward", "checkpoint.export_hf=false",
                   env=dict(os.environ, PYTHONPATH=f"{REPO}/tests:{REPO}"))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(f"{tmp_path}/run")
    assert len(rows) == 3 and all(r["rollout/reward_failed"] > 0 for r in rows)


@pytest.mark.slow
def test_nan_gradient_is_skipped_then_too_many_stop_the_run(tmp_path):
    res = lockstep("run", "configs/tiny.yaml", f"run_dir={tmp_path}/once", *SMALL, "num_rollout=4",
                   "checkpoint.export_hf=false", env=dict(os.environ, LOCKSTEP_FAULTS="nan_grad_steps=1"))
    assert res.returncode == 0, res.stderr[-3000:]
    skipped = [r["train/skipped_steps"] for r in read_metrics(f"{tmp_path}/once")]
    assert skipped[1] > 0 and skipped[0] == skipped[2] == skipped[3] == 0
    res = lockstep("run", "configs/tiny.yaml", f"run_dir={tmp_path}/always", *SMALL, "num_rollout=20",
                   "train.max_consecutive_nonfinite=2", "checkpoint.export_hf=false",
                   env=dict(os.environ, LOCKSTEP_FAULTS="nan_grad_steps=2-100"))
    assert res.returncode != 0
    log = open(RunDir(tmp_path / "always").log_file("trainer_0")).read()
    assert "2 optimizer steps in a row had a non-finite loss or gradient" in log
    assert len(read_metrics(f"{tmp_path}/always")) <= 3


# ---- network surfaces ------------------------------------------------------------------------------

def test_engine_rejects_requests_without_the_run_token(dense_dir, engine_factory):
    eng = engine_factory(dense_dir, extra=["--api-key", "s3cret"])
    with pytest.raises(EngineError, match="HTTP 401"):
        EngineClient(eng.url).request("POST", "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 1, "sampling_seed": 0}})
    with pytest.raises(EngineError, match="HTTP 401"):
        EngineClient(eng.url, api_key="wrong").request("GET", "/get_weight_version")
    assert EngineClient(eng.url, api_key="s3cret").weight_version() == 0


def test_engine_refuses_all_interfaces_by_default(dense_dir):
    res = subprocess.run([sys.executable, "-m", "pipeline.rollout.engine.server", "--model-path", dense_dir,
                          "--host", "0.0.0.0", "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "refusing to listen on all interfaces" in res.stderr


def test_run_token_is_private_and_used(tmp_path):
    res = lockstep("run", "configs/tiny.yaml", f"run_dir={tmp_path}/run", *SMALL, "num_rollout=1",
                   "checkpoint.export_hf=false")
    assert res.returncode == 0, res.stderr[-3000:]
    token = Path(RunDir(tmp_path / "run").token_file)
    assert oct(token.stat().st_mode & 0o777) == "0o600" and len(token.read_text().strip()) == 32


def test_storage_failures_are_told_apart_from_bugs():
    """A DCP save that failed because the disk is full is the user's to fix (StorageError, resume);
    one that failed for another reason stays the exception it was."""
    from torch.distributed.checkpoint.api import CheckpointException
    from pipeline.errors import is_storage_failure, storage_error

    full = OSError(28, "No space left on device")
    assert is_storage_failure(full)
    assert is_storage_failure(CheckpointException("save", {0: (full, None), 1: (full, None)}))
    assert not is_storage_failure(CheckpointException("save", {0: (full, None), 1: (KeyError("w"), None)}))
    assert not is_storage_failure(CheckpointException("save", {0: (TypeError("bad state dict"), None)}))
    assert not is_storage_failure(ValueError("x"))
    assert "No space left on device" in str(storage_error("checkpoint of step 2", "/x", full))
