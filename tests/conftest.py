"""Shared fixtures: tiny HF model directories and real engine server processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")
torch.set_num_threads(1)


# Whole runs (or kernel sweeps) that several tests read, from session or module fixtures: under
# pytest-xdist (`scripts/test.sh -n 2 --dist loadgroup`) the tests sharing one go to one worker, so it
# is made once.
SHARED = ("tiny_recipe_run", "ppo_small_run", "tracked_runs", "results")


def uses_slurm(item) -> bool:
    """Marked `slurm`, or asks for the cluster fixture."""
    return item.get_closest_marker("slurm") is not None or "slurm" in getattr(item, "fixturenames", ())


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    """xdist groups (`--dist loadgroup`): the Slurm tests share one local cluster and its nodes, so they
    run one after another on one worker; tests that share a fixture's run go to the worker that makes
    it. Order: the Slurm tests first (the longest chain), then the other slow ones, then the fast
    tier, whose short tests fill both workers to the end."""
    for item in items:
        shared = [f for f in SHARED if f in getattr(item, "fixturenames", ())]
        if uses_slurm(item):
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))
    items.sort(key=lambda item: 0 if uses_slurm(item) else 1 if item.get_closest_marker("slow") is not None else 2)


def pytest_collection_finish(session):
    """On an xdist worker with --dist loadgroup: the groups must have reached the node ids, or the Slurm
    tests would share the cluster concurrently (pytest 9.2 ignores the id xdist 3.8 sets: pyproject pins
    pytest < 9.2)."""
    config = session.config
    if hasattr(config, "workerinput") and config.getvalue("loadgroup"):
        slurm = [i.nodeid for i in session.items if uses_slurm(i)]
        if slurm and not all(n.endswith("@slurm") for n in slurm):
            raise pytest.UsageError(f"pytest-xdist did not group {slurm[0]} (pytest {pytest.__version__}): the "
                                    "Slurm tests would run at once on one cluster; use pytest < 9.2 or -n 0")


def make_model_dir(path: str, preset: str, seed: int = 0, tie: bool = False) -> str:
    import dataclasses

    from pipeline.models.config import model_preset
    from pipeline.models.hf_io import save_model
    from pipeline.models.qwen3 import Qwen3ForCausalLM
    from pipeline.models.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path + ".tok")
    args = model_preset(preset, tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    if tie:
        args = dataclasses.replace(args, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(args)
    model.init_weights(seed)
    with torch.no_grad():  # non-trivial norms, so a test notices a norm weight that is not applied
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    save_model(model.state_dict(), args, path, tokenizer_dir=path + ".tok")
    return path


@pytest.fixture(scope="session")
def dense_dir(tmp_path_factory) -> str:
    return make_model_dir(str(tmp_path_factory.mktemp("models") / "dense"), "tiny-dense")


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory) -> str:
    return make_model_dir(str(tmp_path_factory.mktemp("models") / "moe"), "tiny-moe", seed=1)


# PPO on the tiny recipe, 4 small steps, a checkpoint every 2 (test_determinism: a second run and a run
# killed after a checkpoint and resumed end bit-identical to it; test_megatron: the FSDP2 reference of
# megatron's PPO)
PPO_SMALL = ["configs/tiny.yaml", "rollout_batch_size=8", "global_batch_size=64", "algo.advantage_estimator=ppo",
             "checkpoint.save_interval=2", "num_rollout=4", "eval.interval=0", "logging.plot=false", "--no-progress"]


@pytest.fixture(scope="session")
def ppo_small_run(tmp_path_factory) -> str:
    """The run directory of one `lockstep run *PPO_SMALL` (one job, run once for the tests that need it)."""
    from test_e2e import lockstep

    run_dir = tmp_path_factory.mktemp("ppo-small") / "run"
    res = lockstep("run", *PPO_SMALL, f"run_dir={run_dir}")
    assert res.returncode == 0, res.stderr[-3000:]
    return str(run_dir)


@pytest.fixture(scope="session")
def tiny_recipe_run(tmp_path_factory):
    """The default recipe for 100 steps, as a user runs it: (its run directory, the finished `lockstep run`).
    test_e2e checks that it learns and leaves every output; test_lowprec compares FP8 rollouts with its
    first 30 steps."""
    from test_e2e import lockstep

    run_dir = tmp_path_factory.mktemp("tiny-recipe") / "run"
    return run_dir, lockstep("run", "configs/tiny.yaml", f"run_dir={run_dir}", "num_rollout=100")


class EngineProcess:
    """A built-in engine server in its own process (ended by PID)."""

    def __init__(self, model_dir: str, ready_file: str, extra: list[str] | None = None, env: dict | None = None):
        self.ready_file = ready_file
        self.log = open(ready_file + ".log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.rollout.engine.server", "--model-path", model_dir, "--port", "0",
             "--context-length", "128", "--ready-file", ready_file, *(extra or [])],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
            env=dict(os.environ, **(env or {})))
        from pipeline.run import wait_for

        def alive():
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited: {open(ready_file + '.log').read()[-2000:]}")

        self.url = wait_for(ready_file, 120, alive)["url"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def engine_factory(tmp_path):
    started = []

    def start(model_dir: str, extra: list[str] | None = None, env: dict | None = None) -> EngineProcess:
        e = EngineProcess(model_dir, str(tmp_path / f"engine_{len(started)}.json"), extra, env)
        started.append(e)
        return e

    yield start
    for e in started:
        e.stop()


def wait_until(pred, timeout=30.0, poll=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(poll)
    return False
