"""The built-in engine: KV-cache decode equals a full forward, seeded sampling, SGLang's HTTP protocol."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import wait_until
from pipeline.models.attention import PackedCausal
from pipeline.models.hf_io import load_model
from pipeline.models.logprobs import token_logprobs
from pipeline.rollout.client import EngineClient, EngineError, EnginePool
from pipeline.rollout.engine.core import Engine, Request, SamplingParams
from pipeline.rollout.engine.sampling import hash_uniform, sample, truncation_mask
from pipeline.rollout.protocol import MemoryTag


def make_engine(model_dir, max_running=8, context=64, graph_bs=0, quantization=None, overlap=False):
    _, model = load_model(model_dir)
    engine = Engine(model, max_running=max_running, context_length=context, eos_token_ids=[0],
                    device=torch.device("cpu"), dtype=torch.float32, cuda_graph_max_bs=graph_bs,
                    quantization=quantization, overlap=overlap)
    engine.capture_graphs()  # as the server does before it serves
    return engine


def run_all(engine, reqs):
    for r in reqs:
        engine.submit(r)
    while engine.waiting or engine.running:
        engine.step()
    assert all(r.done.is_set() for r in reqs)
    return reqs


def full_forward_logprobs(model, prompt, output, temperature):
    seq = torch.tensor(prompt + output)
    ctx = PackedCausal.from_lengths([len(seq)])
    pos = torch.arange(len(prompt) - 1, len(seq) - 1)
    with torch.no_grad():
        logits = model(seq, ctx.positions, ctx, logits_at_M=pos)
    return token_logprobs(logits, torch.tensor(output), temperature)


@pytest.mark.parametrize("which", ["dense_dir", "moe_dir"])
def test_decode_logprobs_match_full_forward(which, request):
    engine = make_engine(request.getfixturevalue(which))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    reqs = [Request(p, SamplingParams(max_new_tokens=12, temperature=0.8, ignore_eos=True, sampling_seed=i))
            for i, p in enumerate(prompts)]
    run_all(engine, reqs)
    for r in reqs:
        assert len(r.output_ids) == 12 and r.finish_reason["type"] == "length"
        ref = full_forward_logprobs(engine.model, r.input_ids, r.output_ids, 0.8)
        torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, rtol=0, atol=2e-5)


def test_sampling_does_not_depend_on_batch_composition(dense_dir):
    engine = make_engine(dense_dir)
    alone = run_all(engine, [Request([5, 6, 7], SamplingParams(max_new_tokens=16, ignore_eos=True, sampling_seed=7))])[0]
    crowd = [Request([9] * n, SamplingParams(max_new_tokens=5 + n, ignore_eos=True, sampling_seed=100 + n))
             for n in range(1, 6)]
    target = Request([5, 6, 7], SamplingParams(max_new_tokens=16, ignore_eos=True, sampling_seed=7))
    run_all(engine, crowd[:2] + [target] + crowd[2:])
    assert target.output_ids == alone.output_ids
    other_seed = run_all(engine, [Request([5, 6, 7], SamplingParams(max_new_tokens=16, ignore_eos=True, sampling_seed=8))])[0]
    assert other_seed.output_ids != alone.output_ids


@pytest.mark.parametrize("graph_bs", [0, 3, 2])
def test_more_requests_than_slots_and_compaction(dense_dir, graph_bs):
    """graph_bs > 0: decode batches up to it run as the fixed-shape (CUDA-graph) step, padded to a
    bucket (batch 3 -> bucket 4 > slots is not made: buckets end at the slot count); larger ones eager."""
    engine = make_engine(dense_dir, max_running=3, graph_bs=graph_bs)
    reqs = [Request([5 + i % 7] * (1 + i % 4), SamplingParams(max_new_tokens=1 + (i * 5) % 9, ignore_eos=True,
                                                              sampling_seed=i)) for i in range(11)]
    run_all(engine, reqs)
    for r in reqs:
        assert len(r.output_ids) == r.params.max_new_tokens
        ref = full_forward_logprobs(engine.model, r.input_ids, r.output_ids, 1.0)
        torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, rtol=0, atol=2e-5)
    if graph_bs:
        assert engine.graphs.replays > 0 and engine.graphs.buckets == [1, 2, graph_bs][:2 + (graph_bs > 2)]


def test_fixed_shape_decode_survives_a_memory_release(dense_dir):
    """Released memory takes the captured steps with it (their addresses); after resume + a weight
    update the steps are made again and decode matches a full forward of the new weights."""
    engine = make_engine(dense_dir, max_running=4, graph_bs=4)
    run_all(engine, [Request([5, 6], SamplingParams(max_new_tokens=4, ignore_eos=True, sampling_seed=1))])
    assert engine.graphs.steps
    engine.pause()
    engine.release_memory(None)
    assert not engine.graphs.steps
    engine.resume_memory(None)
    _, fresh = load_model(dense_dir)
    new = {n: t + 0.01 for n, t in fresh.state_dict().items()}
    engine.load_weights(new, 2)
    reqs = [Request([5 + i, 6], SamplingParams(max_new_tokens=6, ignore_eos=True, sampling_seed=i)) for i in range(3)]
    run_all(engine, reqs)
    assert engine.graphs.steps and engine.weight_version == 2
    for r in reqs:
        ref = full_forward_logprobs(engine.model, r.input_ids, r.output_ids, 1.0)
        torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, rtol=0, atol=2e-5)


def test_fixed_shape_decode_is_bit_identical_in_batch_invariant_mode(dense_dir):
    """The CUDA-graph decode step (padded batch, full-length cache, device-side lengths) gives the eager
    step's tokens and logprobs bit for bit when the kernels are batch-invariant (true on-policy)."""
    from lockstep_kernels import batch_invariant_mode

    def run(graph_bs):
        engine = make_engine(dense_dir, max_running=6, graph_bs=graph_bs)
        reqs = [Request([3 + i] * (1 + 2 * i), SamplingParams(max_new_tokens=4 + 3 * i, ignore_eos=True, sampling_seed=i))
                for i in range(6)]
        with batch_invariant_mode():
            run_all(engine, reqs)
        return engine, [(r.output_ids, r.output_logprobs) for r in reqs]

    eager_engine, eager = run(0)
    graph_engine, static = run(6)
    assert graph_engine.graphs.replays >= 15 and eager_engine.graphs is None
    assert static == eager



@pytest.mark.parametrize("graph_bs", [0, 4])
def test_overlapped_decode_gives_the_step_by_step_results(dense_dir, graph_bs):
    """With overlap (engine.overlap_schedule: step t+1 launched from step t's tokens before the host reads step t) every request
    gets the tokens, logprobs and finish reason of the step-by-step engine: requests stopping on a stop
    token in the middle of a batch, length limits of every size, more requests than slots (admission
    while others decode), one abort. Batch-invariant kernels, so batch composition cannot hide a
    difference."""
    from lockstep_kernels import batch_invariant_mode

    def run(overlap):
        engine = make_engine(dense_dir, max_running=4, graph_bs=graph_bs, overlap=overlap)
        reqs = [Request([3 + i % 5] * (1 + i % 3), SamplingParams(
            max_new_tokens=2 + (i * 7) % 13, ignore_eos=True, sampling_seed=i,
            stop_token_ids=[7, 11] if i % 2 else [])) for i in range(10)]
        for r in reqs:
            engine.submit(r)
        in_flight, calls = 0, 0
        with batch_invariant_mode():
            while engine.waiting or engine.running:
                engine.step()
                calls += 1
                in_flight += engine.pending is not None
                if calls == 6:
                    engine.abort(reqs[1].rid)
        assert all(r.done.is_set() for r in reqs)
        return in_flight, [(r.output_ids, r.output_logprobs, r.finish_reason) for r in reqs]

    plain_in_flight, plain = run(False)
    overlap_in_flight, overlapped = run(True)
    assert plain_in_flight == 0 and overlap_in_flight > 10
    assert overlapped == plain
    reasons = [reason["type"] for _, _, reason in plain]
    assert {"stop", "length", "abort"} <= set(reasons), reasons


def test_engine_settings_from_the_config_reach_the_engine(dense_dir, tmp_path):
    """engine.overlap_schedule / engine.sampling_backend / determinism.kernel_backend travel as server
    flags (engine_argv) and the engine built from those flags runs with them; the defaults too."""
    import lockstep_kernels
    from lockstep_kernels import dispatch
    from pipeline.config import load_config
    from pipeline.launch.component import engine_argv
    from pipeline.rollout.engine import server

    def engine_for(*overrides):
        cfg = load_config("configs/tiny.yaml", list(overrides))
        argv = engine_argv(cfg, str(tmp_path), 0)
        args = server.parse_args(argv)
        args.model_path = dense_dir  # the run's own model is made by `lockstep run`
        return argv, server.engine_from_args(args)[0]

    try:
        argv, engine = engine_for("engine.overlap_schedule=true", "engine.sampling_backend=pytorch",
                                  "determinism.kernel_backend=torch")
        assert "--enable-overlap-schedule" in argv and argv[argv.index("--sampling-backend") + 1] == "pytorch"
        assert engine.overlap and not engine.fused_sampling and dispatch.backend() == "torch"
        reqs = [Request([5 + i, 6], SamplingParams(max_new_tokens=6, ignore_eos=True, sampling_seed=i)) for i in range(3)]
        run_all(engine, reqs)
        assert all(len(r.output_ids) == 6 for r in reqs)
        argv, engine = engine_for()
        assert "--enable-overlap-schedule" not in argv
        assert not engine.overlap and engine.fused_sampling and dispatch.backend() == "auto"
    finally:
        lockstep_kernels.set_backend("auto")
        lockstep_kernels.set_batch_invariant(False)


def test_a_request_without_a_seed_is_refused():
    with pytest.raises(ValueError, match="sampling_seed is missing.*pass sampling_seed"):
        Request([5, 6], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="sampling_seed is missing"):
        Request([5, 6], SamplingParams.from_json({"max_new_tokens": 4, "temperature": 0.0}))
    assert Request([5], SamplingParams.from_json({"sampling_seed": "7"})).seed() == 7


def test_greedy_and_stop(dense_dir):
    engine = make_engine(dense_dir)
    greedy = run_all(engine, [Request([5, 6], SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True,
                                                             sampling_seed=1))])[0]
    again = run_all(engine, [Request([5, 6], SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True,
                                                             sampling_seed=99))])[0]
    assert greedy.output_ids == again.output_ids  # greedy ignores the seed
    stop_tok = greedy.output_ids[3]
    first = greedy.output_ids.index(stop_tok)
    stopped = run_all(engine, [Request([5, 6], SamplingParams(max_new_tokens=10, temperature=0.0, sampling_seed=1,
                                                               stop_token_ids=[stop_tok], ignore_eos=True))])[0]
    assert stopped.output_ids == greedy.output_ids[: first + 1]
    assert stopped.finish_reason == {"type": "stop", "matched": stop_tok}


def test_gumbel_sampling_matches_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 20000
    seeds = torch.arange(n, dtype=torch.int64)
    toks = sample(logits.expand(n, 4), torch.ones(n), torch.ones(n), torch.full((n,), -1), seeds, torch.zeros(n, dtype=torch.int64))
    freq = torch.bincount(toks, minlength=4).double() / n
    torch.testing.assert_close(freq, torch.softmax(logits[0].double(), -1), atol=0.012, rtol=0)
    u = hash_uniform(seeds[:1000], torch.zeros(1000, dtype=torch.int64), 64)
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01


def test_top_k_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = truncation_mask(logits, torch.tensor([0.7]), torch.tensor([-1]))
    assert keep.tolist() == [[True, True, False, False]]
    keep = truncation_mask(logits, torch.tensor([1.0]), torch.tensor([3]))
    assert keep.tolist() == [[True, True, True, False]]
    toks = sample(logits.expand(500, 4), torch.ones(500), torch.full((500,), 0.7), torch.full((500,), -1),
                  torch.arange(500), torch.zeros(500, dtype=torch.int64))
    assert set(toks.tolist()) == {0, 1}


# ---- over HTTP, in a separate process ------------------------------------------------------------


def test_held_requests_wait_for_an_abort_then_the_hold_ends(dense_dir, monkeypatch):
    """The engine_hold_rid fault (pipeline/faults.py) that makes partial-rollout tests independent of
    timing: a matching request is never scheduled until an abort of all cuts it; after that it runs."""
    monkeypatch.setenv("LOCKSTEP_FAULTS", r"engine_hold_rid=^s0-g1-")
    engine = make_engine(dense_dir)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, sampling_seed=0)
    held, free = Request([5, 6], params, rid="s0-g1-0-t0"), Request([5, 6], params, rid="s0-g10-0-t0")
    run_all(engine, [free])
    engine.submit(held)
    assert not held.done.is_set() and engine.num_active() == 0  # never scheduled
    assert free.finish_reason["type"] == "length" and len(free.output_ids) == 4
    assert engine.abort(abort_all=True) == 1
    assert held.done.is_set() and held.finish_reason["type"] == "abort" and held.output_ids == []
    later = run_all(engine, [Request([5, 6], params, rid="s0-g1-0-t1")])[0]
    assert later.output_ids == free.output_ids  # the hold ended with the abort


def test_http_protocol(dense_dir, engine_factory):
    eng = engine_factory(dense_dir)
    c = EngineClient(eng.url)
    assert c.health()
    with pytest.raises(EngineError, match="HTTP 400.*sampling_seed is missing"):  # no seed, no tokens
        c.request("POST", "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}})
    one = c.request("POST", "/generate", {"input_ids": [5, 6, 7], "return_logprob": True,
                                          "sampling_params": {"max_new_tokens": 4, "temperature": 0.0,
                                                              "sampling_seed": 0}})
    assert set(one) >= {"text", "output_ids", "meta_info"}
    meta = one["meta_info"]
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == len(one["output_ids"])
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert [x[1] for x in meta["output_token_logprobs"]] == one["output_ids"]
    gens = c.generate([[5, 6, 7], [8, 9]], [{"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True,
                                             "sampling_seed": 0}] * 2)
    assert gens[0].output_ids == one["output_ids"][:3] and len(gens[1].output_ids) == 3
    assert c.weight_version() == 0 and gens[0].weight_version == 0 and meta["weight_version"] == "0"
    assert c.request("GET", "/get_model_info")["model_path"] == dense_dir
    w = c.request("POST", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 5})
    _, model = load_model(dense_dir)
    assert w == model.model.norm.weight[:5].tolist()
    with pytest.raises(EngineError, match="input_ids is required"):
        c.request("POST", "/generate", {"text": "hello"})
    with pytest.raises(EngineError, match="HTTP 404"):
        c.request("POST", "/no_such_endpoint", {})


def test_http_abort_of_a_waiting_and_of_a_running_request(dense_dir, engine_factory):
    """Deterministic on any machine speed: the engine is paused while the abort lands, and its
    server info says where the request is (waiting, or running with tokens still to go)."""
    eng = engine_factory(dense_dir)
    c = EngineClient(eng.url)

    def info():
        return c.request("GET", "/get_server_info")

    def start(rid, results):
        body = {"input_ids": [5], "rid": rid, "sampling_params": {"max_new_tokens": 120, "ignore_eos": True,
                                                                  "sampling_seed": 0}}
        t = threading.Thread(target=lambda: results.update({rid: EngineClient(eng.url).request("POST", "/generate", body)}))
        t.start()
        return t

    results = {}
    c.request("POST", "/pause_generation", {})
    t = start("queued", results)
    assert wait_until(lambda: info()["num_waiting_reqs"] == 1, timeout=30)
    assert c.request("POST", "/abort_request", {"rid": "queued"})["aborted"] == 1
    c.request("POST", "/continue_generation", {})
    t.join(30)
    assert results["queued"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert results["queued"]["output_ids"] == []

    for attempt in range(5):  # a fast machine may finish all 120 tokens before the pause lands
        rid = f"running-{attempt}"
        t = start(rid, results)
        assert wait_until(lambda: info()["num_running_reqs"] == 1 or rid in results, timeout=30, poll=0.005)
        c.request("POST", "/pause_generation", {})
        if info()["num_running_reqs"] == 1:
            assert c.request("POST", "/abort_request", {"rid": rid})["aborted"] == 1
            c.request("POST", "/continue_generation", {})
            t.join(30)
            out = results[rid]
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            assert 0 < len(out["output_ids"]) < 120
            break
        c.request("POST", "/continue_generation", {})
        t.join(30)
    else:
        pytest.fail("the request never stayed running long enough to be aborted")
    assert c.request("POST", "/abort_request", {"rid": "no-such-request"})["aborted"] == 0


def test_pool_retries_on_another_engine(dense_dir, engine_factory):
    good = engine_factory(dense_dir)
    pool = EnginePool(["http://127.0.0.1:9", good.url], timeout_s=5, max_retries=3)
    gens = pool.generate([[5, 6]], [{"max_new_tokens": 2, "ignore_eos": True, "sampling_seed": 0}])
    assert len(gens[0].output_ids) == 2 and gens[0].engine_url == good.url
    assert pool.retries <= 1
    dead = EnginePool(["http://127.0.0.1:9"], timeout_s=2, max_retries=2)
    with pytest.raises(EngineError, match="after 2 attempts"):
        dead.generate([[5]], [{"max_new_tokens": 1, "sampling_seed": 0}])


def test_pool_asks_an_engine_its_version_once_for_a_step_of_concurrent_requests():
    """A step's requests all want the version the trainer just published: one of them asks the engine,
    the others wait for that answer (none falls into the retry back-off); the next version is asked for
    at once, and an engine still behind is asked at most twice a second."""

    class Answering:  # an engine as the pool sees it: a URL that answers /get_weight_version
        url = "http://engine"

        def __init__(self):
            self.version, self.asks = 3, 0

        def weight_version(self, timeout_s):
            self.asks += 1
            time.sleep(0.05)
            return self.version

    engine, pool = Answering(), EnginePool(["http://engine"])
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(pool.version_of(engine, 3))) for _ in range(16)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [3] * 16 and engine.asks == 1 and time.monotonic() - t0 < 0.4
    engine.version = 4
    assert pool.version_of(engine, 4) == 4 and engine.asks == 2  # a new version: asked at once
    assert pool.version_of(engine, 5) == 4 and engine.asks == 3  # behind ...
    assert pool.version_of(engine, 5) == 4 and engine.asks == 3  # ... and not asked again right away
    time.sleep(0.55)
    engine.version = 5
    assert pool.version_of(engine, 5) == 5 and engine.asks == 4


def test_scheduler_failure_fails_requests_and_ends_the_server(dense_dir, engine_factory):
    """A crash inside a forward must not leave clients waiting: they get an error, the process exits."""
    eng = engine_factory(dense_dir, extra=["--context-length", "64"])
    c = EngineClient(eng.url, timeout_s=30)
    # A token id past the vocabulary makes the embedding lookup raise inside the scheduler.
    with pytest.raises(EngineError, match="HTTP 500.*engine failed"):
        c.request("POST", "/generate", {"input_ids": [5, 10_000_000],
                                        "sampling_params": {"max_new_tokens": 2, "sampling_seed": 0}})
    assert eng.proc.wait(timeout=30) != 0


def test_a_truncating_neighbour_does_not_truncate_a_row_that_asked_for_none(monkeypatch):
    """softmax([30, 0, 0]) rounds the tail's cumulative mass to 1 in fp32, so a top-p mask at p=1 would
    drop tokens 1-2. Noise that makes token 1 win shows whether row 0 was masked because row 1 asked
    for top-p."""
    import pipeline.rollout.engine.sampling as S

    noise = torch.tensor([[0.5, 1 - 1e-15, 0.5]], dtype=torch.float64)
    monkeypatch.setattr(S, "hash_uniform", lambda seeds, pos, v: noise.expand(len(seeds), v))
    row = torch.tensor([[30.0, 0.0, 0.0]])
    one = dict(temperature_B=torch.tensor([1.0]), seeds_B=torch.tensor([0]), positions_B=torch.tensor([0]))
    alone = S.sample(row, top_p_B=torch.tensor([1.0]), top_k_B=torch.tensor([-1]), **one)
    two = {k: v.repeat(2) for k, v in one.items()}
    with_neighbour = S.sample(row.repeat(2, 1), top_p_B=torch.tensor([1.0, 0.5]), top_k_B=torch.tensor([-1, -1]), **two)
    assert alone.tolist() == [1]
    assert with_neighbour.tolist() == [1, 0]  # row 1 is truncated to its top token; row 0 is not


def test_engine_weights_are_one_buffer_and_an_export_in_that_layout_is_one_copy(dense_dir):
    """The engine's parameters are views of one buffer in named_parameters order; an update whose
    tensors are views of one buffer in the same order (the trainer's flat-bucket export) is applied as
    one span copy, separate tensors by the multi-tensor copy; a memory release and resume keep the layout."""
    from pipeline.models.flat import copy_tensors

    _, model = load_model(dense_dir)
    engine = Engine(model, max_running=2, context_length=32, eos_token_ids=[0], device=torch.device("cpu"),
                    dtype=torch.float32)
    (flat,) = engine.flat_weights
    params = list(model.named_parameters())
    assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for _, p in params)
    offsets = [p.storage_offset() for _, p in params]
    assert offsets == [sum(p.numel() for _, p in params[:i]) for i in range(len(params))]

    export = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(0))
    named, at = {}, 0
    for n, p in params:
        named[n] = export[at: at + p.numel()].view(p.shape)
        at += p.numel()
    assert copy_tensors([p for _, p in params], list(named.values())) == 1
    assert torch.equal(flat, export)
    engine.load_weights({n: t * 2 for n, t in named.items()}, 2)  # separate tensors
    assert torch.equal(flat, export * 2)
    engine.pause()
    engine.release_memory([MemoryTag.WEIGHTS])
    assert flat.untyped_storage().nbytes() == 0
    engine.resume_memory([MemoryTag.WEIGHTS])
    engine.load_weights(named, 3)
    assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for _, p in params)
    assert torch.equal(flat, export) and torch.equal(params[1][1], named[params[1][0]])
