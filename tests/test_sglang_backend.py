"""The SGLang path that runs here, with real processes: sglang-router (its Rust binary, from the
contract environment) in front of two built-in engines, the engine supervisor restarting a dead
server, and the colocated endpoints (tensor updates through shared memory, memory release/resume),
all through the client a SGLang cluster uses."""

from __future__ import annotations

import base64
import io
import os
import pickle
import re
import signal
import sys

import pytest
import torch

from conftest import REPO, wait_until
from pipeline.config import load_config
from pipeline.errors import ComponentFailed
from pipeline.models.hf_io import load_model
from pipeline.rollout import protocol
from pipeline.rollout.client import EngineClient, EngineError, EnginePool, EngineStateError
from pipeline.rollout.protocol import MemoryTag
from pipeline.rollout.router import SglangRouter
from pipeline.rollout.sglang_server import SglangSupervisor
from pipeline.run import RunDir
from pipeline.utils.fs import read_json

CONTRACT_ENV = os.path.join(REPO, ".venv", "sglang-contract")
TOKEN = "test-run-token"


def params(n=4, seed=7):
    return protocol.sampling_params(max_new_tokens=n, temperature=1.0, top_p=1.0, top_k=-1, seed=seed)


@pytest.fixture
def contract_env(monkeypatch):
    if not os.path.isfile(os.path.join(CONTRACT_ENV, ".installed")):
        pytest.fail(f"sglang-router is installed by `scripts/setup.sh test` into {CONTRACT_ENV}; it is missing")
    monkeypatch.setenv("PYTHONPATH", CONTRACT_ENV)


@pytest.mark.slow
def test_sglang_router_in_front_of_two_builtin_engines(dense_dir, engine_factory, contract_env, tmp_path):
    engines = [engine_factory(dense_dir, ["--api-key", TOKEN]) for _ in range(2)]
    router = SglangRouter("round_robin", api_key=TOKEN, log_path=str(tmp_path / "router.log"))
    try:
        pool = EnginePool([e.url for e in engines], api_key=TOKEN, frontend=router.sync, timeout_s=30)
        direct = EngineClient(engines[0].url, api_key=TOKEN).generate([[5, 6]], [params()])[0]
        gens = [pool.generate([[5, 6]], [params()], min_version=0)[0] for _ in range(6)]
        assert router.url and all(g.engine_url == router.url for g in gens)
        # seeded sampling: whichever engine the router picked, the same tokens and logprobs
        assert all(g.output_ids == direct.output_ids and g.logprobs == direct.logprobs for g in gens)
        served = [EngineClient(e.url, api_key=TOKEN).request("GET", "/server_info")["stats"]["finished"] for e in engines]
        assert min(served) >= 2 and sum(served) == 7, served  # round robin spread them over both
        with pytest.raises(EngineError, match="401"):
            EngineClient(router.url).generate([[5]], [params()])  # no token: the engines refuse it
        # an engine comes back on a new port: the router is restarted over the new list
        first = router.url
        engines[1].stop()
        replacement = engine_factory(dense_dir, ["--api-key", TOKEN])
        pool2 = EnginePool([engines[0].url, replacement.url], api_key=TOKEN, frontend=router.sync, timeout_s=30)
        assert pool2.generate([[5, 6]], [params()])[0].output_ids == direct.output_ids
        assert router.url != first and router.workers == [engines[0].url, replacement.url]
    finally:
        router.stop()


@pytest.mark.slow
def test_router_waits_for_every_engine_to_hold_the_version(dense_dir, engine_factory, contract_env, tmp_path):
    """Behind a router any engine may answer, so a step's requests go out only once all engines hold
    its weight version."""
    engines = [engine_factory(dense_dir, ["--api-key", TOKEN]) for _ in range(2)]
    router = SglangRouter("round_robin", api_key=TOKEN, log_path=str(tmp_path / "router.log"))
    try:
        pool = EnginePool([e.url for e in engines], api_key=TOKEN, frontend=router.sync, timeout_s=10,
                          retry_budget_s=2.0)
        _, model = load_model(dense_dir)
        named = list(model.state_dict().items())
        with EngineClient(engines[0].url, api_key=TOKEN).weight_update_session() as c:
            c.update_weights_from_tensor(named, version=1)
        with pytest.raises(EngineError, match="weight version >= 1"):
            pool.generate([[5]], [params()], min_version=1)
        with EngineClient(engines[1].url, api_key=TOKEN).weight_update_session() as c:
            c.update_weights_from_tensor(named, version=1)
        assert pool.generate([[5]], [params()], min_version=1)[0].weight_version == 1
    finally:
        router.stop()


@pytest.mark.slow
def test_sticky_sessions_return_to_their_engine(dense_dir, engine_factory):
    engines = [engine_factory(dense_dir) for _ in range(2)]
    pool = EnginePool([e.url for e in engines], timeout_s=30)
    homes = {s: pool.generate([[5]], [params(1)], session=s)[0].engine_url for s in ("a", "b", "c", "d")}
    assert set(homes.values()) == {e.url for e in engines}  # least loaded spreads new sessions
    for _ in range(3):
        for s, home in homes.items():
            assert pool.generate([[5, 6]], [params(1)], session=s)[0].engine_url == home


def test_colocated_tensor_update_memory_release_and_resume(dense_dir, engine_factory):
    eng = engine_factory(dense_dir)
    c = EngineClient(eng.url)
    before = c.generate([[5, 6, 7]], [params(6)])[0]
    _, model = load_model(dense_dir)
    original = {n: t.clone() for n, t in model.state_dict().items()}
    changed = dict(original, **{"model.norm.weight": torch.full_like(original["model.norm.weight"], 0.5)})
    with c.weight_update_session():
        c.update_weights_from_tensor(list(changed.items()), version=1)
    got = c.request("POST", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 3})
    assert got == [0.5, 0.5, 0.5] and c.weight_version() == 1

    c.release_memory()  # both weights and KV cache
    with pytest.raises(EngineStateError, match="memory released"):
        c.generate([[5]], [params()])
    assert "kv_cache" in c.release_memory([MemoryTag.KV_CACHE])["message"]  # releasing again is harmless
    with pytest.raises(EngineError, match="unknown memory tag"):
        c.checked("/release_memory_occupation", {"tags": ["gpu"]})
    c.resume_memory()
    with pytest.raises(EngineStateError, match="send a complete update"):
        c.generate([[5]], [params()])
    with c.weight_update_session():
        c.update_weights_from_tensor(list(original.items()), version=2)
    after = c.generate([[5, 6, 7]], [params(6)])[0]
    assert after.output_ids == before.output_ids and after.logprobs == before.logprobs
    assert after.weight_version == 2


@pytest.mark.parametrize("flattened", [False, True], ids=["per_tensor", "flattened"])
def test_colocated_update_in_buckets_refills_released_weights(dense_dir, engine_factory, flattened):
    """Issue 20: a 4B colocated run sent its version in 16 buckets (one request each) after a memory
    release; the engine counted only the last request's names as refilled and refused every /generate
    of the next step with 503, which the rollout manager retried for 5 minutes. Now the buckets
    accumulate, an update whose last bucket leaves parameters unwritten fails at once, and a refusal
    in that state (409) is not retried. The same with flattened buckets (one handle per request)."""
    eng = engine_factory(dense_dir)
    c = EngineClient(eng.url)
    before = c.generate([[5, 6, 7]], [params(6)])[0]
    _, model = load_model(dense_dir)
    items = list(model.state_dict().items())
    first, rest = items[: len(items) // 2], items[len(items) // 2:]
    c.release_memory()
    c.resume_memory([MemoryTag.WEIGHTS])
    c.resume_memory([MemoryTag.KV_CACHE])
    c.begin_weight_update()  # one session for all the buckets, as the tensor transport opens it
    c.update_weights_from_tensor(first, flattened=flattened)  # a bucket without a version
    with pytest.raises(EngineStateError, match="have not been written"):
        c.generate([[5]], [params()])
    with pytest.raises(EngineError, match="incomplete after a memory release"):
        c.update_weights_from_tensor(rest[:-1], version=1, flattened=flattened)  # the "last" bucket, one tensor short
    pool = EnginePool([eng.url], timeout_s=30)
    with pytest.raises(EngineStateError):
        pool.generate([[5]], [params()])
    assert pool.retries == 0  # refused at once, not retried for rollout.retry_budget_s
    c.update_weights_from_tensor(rest[-1:], version=1, flattened=flattened)
    c.end_weight_update()
    after = c.generate([[5, 6, 7]], [params(6)])[0]
    assert after.output_ids == before.output_ids and after.logprobs == before.logprobs


def test_tensor_update_refuses_anything_but_tensors(dense_dir, engine_factory):
    eng = engine_factory(dense_dir)
    c = EngineClient(eng.url)
    evil = base64.b64encode(pickle.dumps(os.getcwd)).decode()  # a callable instead of (name, tensor)s
    with c.weight_update_session():
        with pytest.raises(EngineError, match="not allowed"):
            c.checked("/update_weights_from_tensor", {"serialized_named_tensors": [evil]})
        with pytest.raises(EngineError, match="unknown parameter"):
            c.update_weights_from_tensor([("model.no_such.weight", torch.zeros(2))], version=5)
    assert c.weight_version() == 0


def test_weight_updates_run_only_in_a_session_as_sglang_requires(dense_dir, engine_factory):
    """SGLang 0.5.2x refuses tensor and distributed updates outside /begin_weight_update ..
    /end_weight_update, a second begin, and an end without a begin; the built-in engine answers each
    with SGLang's message (HTTP 400), so a trainer that skips the session fails here on CPU."""
    eng = engine_factory(dense_dir)
    c = EngineClient(eng.url)
    norm = [("model.norm.weight", torch.full((64,), 0.5))]
    with pytest.raises(EngineError, match=re.escape(protocol.SESSION_REQUIRED.format(
            endpoint="update_weights_from_tensor"))):
        c.update_weights_from_tensor(norm, version=1)
    with pytest.raises(EngineError, match=re.escape(protocol.SESSION_REQUIRED.format(
            endpoint="update_weights_from_distributed"))):
        c.checked("/update_weights_from_distributed", protocol.update_distributed_body(norm, "g", 1))
    with pytest.raises(EngineError, match=re.escape(protocol.SESSION_NOT_OPEN)):
        c.end_weight_update()
    assert c.weight_version() == 0
    with pytest.raises(EngineError, match="invalid selector"):
        c.checked("/begin_weight_update", {"selector": "both"})
    c.begin_weight_update()
    with pytest.raises(EngineError, match=re.escape(protocol.SESSION_ALREADY_OPEN)):
        c.begin_weight_update()
    c.update_weights_from_tensor(norm, version=1)
    c.end_weight_update()
    assert c.weight_version() == 1
    stats = c.request("GET", "/server_info")["stats"]
    assert stats["weight_sessions_begun"] == stats["weight_sessions_ended"] == 1


@pytest.mark.slow
def test_supervisor_restarts_a_dead_server_and_publishes_its_new_address(dense_dir, tmp_path):
    """The SGLang supervisor's loop, run over the built-in engine (same protocol, same /health)."""
    cfg = load_config(os.path.join(REPO, "configs", "tiny.yaml"),
                      ["engine.type=sglang", "engine.health_interval_s=0.3", "engine.max_restarts=1",
                       "engine.startup_timeout_s=120"])
    run_dir = str(tmp_path / "run")

    def command(port):
        return [sys.executable, "-m", "pipeline.rollout.engine.server", "--model-path", dense_dir,
                "--port", str(port), "--context-length", "64"]

    sup = SglangSupervisor(cfg, run_dir, 0, "127.0.0.1", dense_dir, command=command)
    import threading

    errors = []
    t = threading.Thread(target=lambda: _run(sup, errors), daemon=True)
    t.start()
    path = RunDir(run_dir).engine_file(0)
    assert wait_until(lambda: os.path.exists(path), timeout=120)
    first = read_json(path)
    assert EngineClient(first["url"]).generate([[5]], [params(2)])[0].output_ids
    os.kill(first["pid"], signal.SIGKILL)
    assert wait_until(lambda: read_json(path)["url"] != first["url"], timeout=120)
    second = read_json(path)
    assert second["restarts"] == 1 and EngineClient(second["url"]).health()
    os.kill(second["pid"], signal.SIGKILL)  # no restarts left: the engine component fails, named
    t.join(120)
    assert errors and isinstance(errors[0], ComponentFailed) and errors[0].component == "engine_0"
    assert "no restarts left" in errors[0].log_tail


def _run(sup, errors):
    try:
        sup.run()
    except Exception as e:
        errors.append(e)


@pytest.mark.slow
def test_run_through_sglang_router_with_colocated_engines_matches_a_plain_run(tmp_path, contract_env):
    """A whole job with the router in front of two engines that give their memory back while the trainer
    trains: the same final weights, bit for bit, as the plain run (true on-policy makes results
    independent of which engine served what)."""
    from test_reliability import SMALL, weights_equal
    from test_e2e import lockstep

    common = ["num_rollout=4", "engine.num_engines=2", "determinism.true_on_policy=true"]
    ref = lockstep("run", "configs/tiny.yaml", f"run_dir={tmp_path}/ref", *SMALL, *common)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = tmp_path / "routed"
    res = lockstep("run", "configs/tiny.yaml", f"run_dir={run}", *SMALL, *common, "engine.router=sglang_router",
                   "engine.router_policy=round_robin", "engine.colocated=true")
    assert res.returncode == 0, res.stderr[-3000:]
    assert weights_equal(RunDir(tmp_path / "ref").hf_export, RunDir(run).hf_export)
    assert os.path.exists(RunDir(run).log_file("router_0"))
    for i in range(2):  # each engine gave its memory back once per step, and took it back for the update
        text = open(RunDir(run).log_file(f"engine_{i}")).read()
        assert text.count("memory released: kv_cache, weights") == 4, text[-2000:]
