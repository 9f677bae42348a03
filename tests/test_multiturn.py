"""Multi-turn rollouts (issue 25): token-in-token-out across turns, tool tokens masked, the prefix cache,
partial rollouts that resume a half-finished trajectory, and a multi-turn MoE run with R3 bit-exact."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from pipeline.buffer.schema import RolloutBatch, Sample, SampleStatus
from pipeline.errors import ConfigError, UserError
from pipeline.models.hf_io import load_model
from pipeline.models.tokenizer import load_tokenizer
from pipeline.rollout.base import RolloutSample, TurnAborted
from pipeline.rollout.client import Generation
from pipeline.rollout.engine.core import Engine, Request, SamplingParams
from pipeline.rollout.functions import resolve_generate_fn, run_generate_fn
from pipeline.rollout.handle import PoolHandle
from pipeline.rollout.tito import compare_calls
from pipeline.rollout.trajectory import Trajectory, assemble_routing, calls_from_record


def make_engine(model_dir, prefix_cache_tokens=0):
    _, model = load_model(model_dir)
    return Engine(model, max_running=8, context_length=96, eos_token_ids=[0], device=torch.device("cpu"),
                  dtype=torch.float32, prefix_cache_tokens=prefix_cache_tokens)


class InProcessPool:
    """EnginePool.generate over an in-process Engine. `abort_at=(call, tokens)`: that call is aborted once
    it has produced `tokens` tokens (the over-sampled surplus of a step)."""

    def __init__(self, engine, abort_at=None):
        self.engine, self.abort_at, self.requests = engine, abort_at, []

    def generate(self, input_ids, sampling_params, min_version=0, session=None, return_routed_experts=False,
                 moe_shape=None, rid=None, **kw):
        e = self.engine
        out = []
        for ids, params in zip(input_ids, sampling_params):
            req = e.submit(Request(list(ids), SamplingParams.from_json(params), return_routed_experts=return_routed_experts))
            call = len(self.requests)
            self.requests.append(list(ids))
            while not req.done.is_set():
                if self.abort_at and self.abort_at[0] == call and len(req.output_ids) >= self.abort_at[1]:
                    e.abort(req.rid)
                e.step()
            routed = torch.cat(req.routed).numpy().astype(np.int32) if return_routed_experts and req.routed else None
            out.append(Generation(list(req.output_ids), list(req.output_logprobs), req.finish_reason["type"],
                                  req.weight_version, routed_experts=routed, cached_tokens=req.cached_tokens))
        return out


def handle_for(pool, prompt_len, replay=None, moe_shape=None):
    return PoolHandle(pool, session="g0", rid="s0-g0-0", temperature=1.0, top_p=1.0, top_k=-1, seed=3, min_version=0,
                      prompt_len=prompt_len, max_response_len=40, moe_shape=moe_shape, replay=replay)


def sample_for(tok, prompt: str, label="", metadata=None) -> RolloutSample:
    return RolloutSample(prompt_ids=tok.encode(prompt), label=label, metadata=metadata or {}, tokenizer=tok,
                         max_response_len=40, prompt_text=prompt)


def three_turns(sample: RolloutSample, engine) -> Trajectory:
    """A test environment: three turns of 5 tokens, a tool result of delimiter id + text between them."""
    tok = sample.tokenizer
    traj = Trajectory.start(sample)
    for turn in range(3):
        traj.add_turn(engine.generate(traj.tokens, {"max_new_tokens": 5, "ignore_eos": True}))
        if turn < 2:
            traj.add_env([tok.token_to_id("<|im_start|>")])
            traj.add_text(tok, f"r={turn}")
    traj.reward = 1.0
    return traj


def re_encoding(sample: RolloutSample, engine) -> Trajectory:
    """What not to do: rebuild the conversation from text between turns (decode, append, re-encode)."""
    tok = sample.tokenizer
    first = engine.generate(sample.prompt_ids, {"max_new_tokens": 5, "ignore_eos": True})
    text = sample.prompt_text + tok.decode(first[0], skip_special_tokens=True) + " ok"
    ids = tok.encode(text)
    traj = Trajectory(prompt_len=len(sample.prompt_ids), tokens=list(ids),
                      loss_mask=[1] * (len(ids) - len(sample.prompt_ids)),
                      logprobs=list(first[1]) + [0.0] * (len(ids) - len(sample.prompt_ids) - len(first[1])))
    traj.add_turn(engine.generate(traj.tokens, {"max_new_tokens": 5, "ignore_eos": True}))
    return traj


def test_trajectory_ids_are_engine_output_plus_env_ids_exactly(dense_dir):
    tok = load_tokenizer(dense_dir)
    pool = InProcessPool(make_engine(dense_dir))
    sample = sample_for(tok, "1+2=")
    handle = handle_for(pool, len(sample.prompt_ids))
    traj = run_generate_fn(three_turns, sample, handle)
    calls = handle.calls
    assert len(calls) == 3
    # id for id: prompt, output 1, env ids, output 2, env ids, output 3 -- no decode/re-encode anywhere
    env = [[tok.token_to_id("<|im_start|>")] + tok.encode(f"r={t}") for t in range(2)]
    expected = sample.prompt_ids + calls[0].output_ids + env[0] + calls[1].output_ids + env[1] + calls[2].output_ids
    assert traj.tokens == expected
    assert calls[1].input_ids == sample.prompt_ids + calls[0].output_ids + env[0]  # what the engine consumed
    assert calls[2].input_ids == expected[:len(expected) - 5]
    mask = [0] * len(sample.prompt_ids) + [1] * 5 + [0] * len(env[0]) + [1] * 5 + [0] * len(env[1]) + [1] * 5
    assert traj.loss_mask == mask[len(sample.prompt_ids):]
    assert compare_calls(traj.tokens, traj.prompt_len, traj.loss_mask, traj.logprobs, calls).total == 0
    # the generated tokens' logprobs are the engine's, the env tokens' 0
    gen = [lp for lp, m in zip(traj.logprobs, traj.loss_mask) if m]
    assert gen == calls[0].logprobs + calls[1].logprobs + calls[2].logprobs
    # a function that goes through text is caught by the comparator
    handle = handle_for(InProcessPool(make_engine(dense_dir)), len(sample.prompt_ids))
    bad = run_generate_fn(re_encoding, sample, handle)
    assert compare_calls(bad.tokens, bad.prompt_len, bad.loss_mask, bad.logprobs, handle.calls).total > 0


def test_async_generate_fn(dense_dir):
    tok = load_tokenizer(dense_dir)

    async def two_turns(sample, engine):
        traj = Trajectory.start(sample)
        traj.add_turn(await engine.generate(traj.tokens, {"max_new_tokens": 3, "ignore_eos": True}))
        traj.add_text(sample.tokenizer, "=")
        traj.add_turn(await engine.generate(traj.tokens, {"max_new_tokens": 3, "ignore_eos": True}))
        return traj

    sample = sample_for(tok, "4+4=")
    handle = handle_for(InProcessPool(make_engine(dense_dir)), len(sample.prompt_ids))
    traj = run_generate_fn(two_turns, sample, handle)
    assert len(handle.calls) == 2 and traj.loss_mask == [1, 1, 1, 0, 1, 1, 1]


def test_tool_tokens_get_no_gradient(dense_dir):
    from pipeline.algo.losses import PolicyLossConfig, PolicyTokens, grpo_loss, reduction_scale
    from pipeline.models.logprobs import entropy, token_logprobs
    from pipeline.trainer.batching import build_micro_batch

    tok = load_tokenizer(dense_dir)
    samples = []
    for i, prompt in enumerate(["1+2=", "3+3="]):
        sample = sample_for(tok, prompt)
        handle = handle_for(InProcessPool(make_engine(dense_dir)), len(sample.prompt_ids))
        traj = run_generate_fn(three_turns, sample, handle)
        samples.append(Sample(0, i, i, traj.tokens[:traj.prompt_len], traj.response_ids, traj.logprobs,
                              reward=float(i), loss_mask=traj.loss_mask))
    batch = RolloutBatch.from_samples(samples)
    adv_R = np.where(np.arange(len(batch.logprobs)) % 2, 1.0, -0.5).astype(np.float32)
    mb = build_micro_batch(batch, [0, 1], adv_R, "cpu")
    _, model = load_model(dense_dir)
    logits_MV = model(mb.input_ids_N, mb.positions_N, mb.attn, logits_at_M=mb.score_pos_M)
    logits_MV.retain_grad()
    logp_M = token_logprobs(logits_MV, mb.targets_M, 1.0)
    cfg = PolicyLossConfig(entropy_coef=0.03)
    scale_M = reduction_scale(mb.mask_M, mb.sample_of_M, mb.len_of_sample, "token_mean", float(mb.mask_M.sum()), 2, 0)
    loss, _ = grpo_loss(cfg, PolicyTokens(logp_M, logp_M.detach() + 0.1, mb.adv_M, mb.mask_M, scale_M,
                                          entropy_M=entropy(logits_MV, 1.0), sample_of_M=mb.sample_of_M, num_samples=2))
    loss.backward()
    env_rows = mb.mask_M == 0
    assert env_rows.sum() == 2 * 2 * 4  # 2 samples x 2 tool results x (delimiter + "r=N")
    assert torch.count_nonzero(logits_MV.grad[env_rows]) == 0  # tool / environment tokens: no gradient
    assert (logits_MV.grad[~env_rows].abs().sum(-1) > 0).all()  # every generated token: a gradient


@pytest.mark.parametrize("which", ["dense_dir", "moe_dir"])
def test_session_turns_hit_the_prefix_cache_with_the_same_logprobs(which, request):
    """Turn 2 of a conversation finds turn 1 in the cache (hit rate > 0) and samples the same tokens with
    the same logprobs, bit for bit, as an engine without the cache (true on-policy: batch-invariant kernels);
    with R3 the routing rows (cached prefix + new tokens) are the same too."""
    from lockstep_kernels import batch_invariant_mode

    model_dir = request.getfixturevalue(which)
    tok = load_tokenizer(model_dir)
    is_moe = which == "moe_dir"
    results = {}
    for cache in (0, 4096):
        engine = make_engine(model_dir, prefix_cache_tokens=cache)
        pool = InProcessPool(engine)
        trajs = []
        with batch_invariant_mode():
            for i, prompt in enumerate(["1+2=", "7+1=", "1+2="]):
                sample = sample_for(tok, prompt)
                handle = handle_for(pool, len(sample.prompt_ids), moe_shape=(2, 2) if is_moe else None)
                handle.seed = 10 + i
                traj = run_generate_fn(three_turns, sample, handle)
                routing = assemble_routing(handle.calls, len(traj.tokens), 2) if is_moe else None
                trajs.append((traj.tokens, traj.logprobs, routing, [c.cached_tokens for c in handle.calls]))
        results[cache] = trajs
        if cache:
            assert engine.prefix.hit_rate > 0
    for (ids0, lp0, r0, hits0), (ids1, lp1, r1, hits1) in zip(results[0], results[4096]):
        assert ids0 == ids1 and lp0 == lp1  # exactly
        if is_moe:
            assert np.array_equal(r0, r1)
        assert hits0 == [0, 0, 0]
        assert hits1[1] > 0 and hits1[2] > 0  # later turns: the earlier turns' tokens came from the cache
        # all of the previous turn but its last token (sampled, never fed) and the tool's ids: 4-token prompts
        assert hits1[1] == 4 + 5 - 1 and hits1[2] == 4 + 5 + 4 + 5 - 1
    # a new sample of a prompt seen before reuses its prompt too
    assert results[4096][2][3][0] > 0


def test_partial_rollout_resumes_a_half_finished_trajectory(dense_dir):
    tok = load_tokenizer(dense_dir)
    sample = sample_for(tok, "2+5=")
    reference = run_generate_fn(three_turns, sample, handle_for(InProcessPool(make_engine(dense_dir)), 4))
    # step k: turn 2 of 3 is aborted after 2 of its 5 tokens (the step had enough groups)
    pool = InProcessPool(make_engine(dense_dir), abort_at=(1, 2))
    handle = handle_for(pool, len(sample.prompt_ids))
    with pytest.raises(TurnAborted):
        run_generate_fn(three_turns, sample, handle)
    last = handle.calls[-1]
    assert last.finish_reason == "abort" and 0 < len(last.output_ids) < 5
    stored_tokens = last.input_ids + last.output_ids
    p = len(sample.prompt_ids)
    logprobs = [0.0] * (len(stored_tokens) - p)
    for c in handle.calls:
        a, b = c.span
        logprobs[a - p:b - p] = c.logprobs
    records = [c.record() for c in handle.calls]
    json.dumps(records)  # what the shard's metadata keeps
    # step k+1: the function runs again; turn 1 is replayed from the record, turn 2 continues where it was cut
    replay = calls_from_record(stored_tokens, p, logprobs, None, records)
    pool2 = InProcessPool(make_engine(dense_dir))
    handle2 = handle_for(pool2, p, replay=replay)
    traj = run_generate_fn(three_turns, sample, handle2)
    assert pool2.requests[0] == stored_tokens  # the first engine request continues the cut turn
    assert len(pool2.requests) == 2  # the continuation of turn 2, then turn 3: turn 1 was not generated again
    assert traj.tokens[:len(stored_tokens)] == stored_tokens
    assert len(traj.tokens) == len(reference.tokens) and not handle2.replay_diverged
    assert compare_calls(traj.tokens, p, traj.loss_mask, traj.logprobs, handle2.calls).total == 0
    assert [c.finish_reason for c in handle2.calls] == ["length", "abort", "length", "length"]


def test_generate_fn_config_errors_are_one_line():
    for path, words in [("no_such_module_xyz:generate", "not importable"),
                        ("pipeline.rollout.envs.calculator:nothing", "has no attribute 'nothing'"),
                        ("pipeline.rollout.envs.calculator:CALL", "not a function")]:
        with pytest.raises(UserError, match=words) as e:
            resolve_generate_fn(path)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="module:function"):
        from pipeline.config.schema import RolloutConfig

        RolloutConfig(generate_fn="pipeline.rollout.single_turn")
    assert resolve_generate_fn("pipeline.rollout.envs.guessing:generate")
    from pipeline.config import load_config

    with pytest.raises(ConfigError, match="exclude each other"):
        load_config("configs/tiny.yaml", ["engine.prefix_cache_tokens=64", "engine.speculative_algorithm=NEXTN",
                                          "model.mtp_num_layers=1"])


def test_example_environments_build_their_trajectories_by_appending(dense_dir):
    from pipeline.rollout.envs import calculator, guessing

    tok = load_tokenizer(dense_dir)
    for fn, row in [(calculator.generate, calculator.rows()[5]), (guessing.generate, guessing.rows()[3])]:
        for seed in range(6):
            sample = sample_for(tok, row["prompt"], row["label"], row["metadata"])
            handle = handle_for(InProcessPool(make_engine(dense_dir)), len(sample.prompt_ids))
            handle.seed = seed
            traj = run_generate_fn(fn, sample, handle)
            assert compare_calls(traj.tokens, traj.prompt_len, traj.loss_mask, traj.logprobs, handle.calls).total == 0
            assert traj.reward is not None and len(traj.loss_mask) == len(traj.response_ids)


@pytest.mark.slow
def test_multiturn_moe_run_with_r3_is_bit_exact_and_resumes_partials(tmp_path):
    # Tokens a resumed trajectory got from the previous step's weights are masked (off-policy by one version:
    # the trainer's logprob for them is the new policy's); every other generated token must match exactly.
    from pipeline.buffer.reader import BufferReader
    from pipeline.buffer.schema import TRAINABLE
    from pipeline.observability.metrics import read_metrics
    from pipeline.run import RunDir

    from test_e2e import lockstep

    run = tmp_path / "run"
    res = lockstep("run", "configs/tiny-calculator.yaml", f"run_dir={run}", "model.init=tiny-moe", "num_rollout=6",
                   "determinism.true_on_policy=true", "determinism.routing_replay=true", "rollout.rollout_batch_size=6",
                   "rollout.over_sampling_batch_size=12", "rollout.partial_rollout=true",
                   "rollout.mask_offpolicy_in_partial_rollout=true",
                   "rollout.n_samples_per_prompt=4",
                   "train.global_batch_size=24", "engine.max_running_requests=8", "checkpoint.export_hf=false",
                   "logging.plot=false", "--no-progress",
                   # Step 0: group 11 (the last of 12 draws) gets no engine call answered, groups 6-10 no
                   # call after their first, until the step fills with other groups and aborts the rest:
                   # group 11 is cut whatever the timing, those of 6-10 that reached a second call are
                   # cut mid-trajectory. Step 1 resumes them.
                   env=dict(os.environ, LOCKSTEP_FAULTS=r"engine_hold_rid=^s0-g(11-\d+-t|([6-9]|10)-\d+-t[1-9])"))
    assert res.returncode == 0, res.stderr[-3000:]
    records = read_metrics(str(run))
    assert len(records) == 6
    for r in records:
        assert r["train/rollout_logprob_max_abs_diff"] == 0.0 and r["train/routing_mismatch_frac"] == 0.0
        assert r["rollout/tito_turn_mismatch"] == 0
    assert max(r["rollout/turns_mean"] for r in records) > 1.0  # the tool was called
    assert max(r["rollout/prefix_cache_hit_rate"] for r in records) > 0.0
    reader = BufferReader(RunDir(run).buffer)
    resumed = 0
    for step in reader.committed_steps():
        batch = reader.read_step(step)
        assert batch.routed_experts is not None
        for i in range(len(batch)):
            meta = json.loads(batch.metadata[i])
            if batch.status[i] in TRAINABLE and any(t[3] == "abort" for t in meta["turns"]):
                resumed += 1
                assert SampleStatus(int(batch.status[i])) in TRAINABLE
    assert resumed > 0, "no trajectory was aborted and resumed"


def test_prefix_cache_index_replacement_and_eviction():
    from pipeline.rollout.engine.prefix_cache import PrefixCache

    pc = PrefixCache(max_tokens=8)
    pc.insert([1, 2, 3], [], None)
    pc.insert([1, 2, 3, 4, 5], [], None)  # the next turn of the same conversation replaces the last
    assert len(pc.entries) == 1 and pc.tokens == 5
    assert pc.match([1, 2, 3, 9], 4, False)[0] == 3 and pc.match([1, 2, 7], 3, False)[0] == 2
    assert pc.match([1, 2, 3, 4, 5, 6], 3, False)[0] == 3  # at most `limit` (a request's last token is prefilled)
    assert pc.match([1, 2], 2, True) == (0, None)  # no routing rows kept: no hit for a request that records them
    pc.insert([1, 2], [], None)  # already kept inside a longer sequence
    assert len(pc.entries) == 1
    pc.insert([7, 8, 9, 10], [], None)  # 9 tokens > 8: the least recently used goes
    assert [e.ids for e in pc.entries.values()] == [[7, 8, 9, 10]] and pc.match([1, 2], 2, False)[0] == 0
    assert pc.hit_rate == (3 + 2 + 3) / (4 + 3 + 6 + 2 + 2)


def manager_for(model_dir, pool, generate_fn, *overrides):
    """A RolloutManager without processes: its per-sample path over an in-process engine, one sample at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.config import load_config
    from pipeline.models.hf_io import read_model_args
    from pipeline.rollout.manager import RolloutManager
    from pipeline.rollout.rewards import resolve_reward

    m = object.__new__(RolloutManager)
    m.cfg = load_config("configs/tiny-calculator.yaml", ["rollout.n_samples_per_prompt=2", "rollout.rollout_batch_size=1",
                                                          "train.global_batch_size=2", "rollout.rollout_max_response_len=40", *overrides])
    m.args, m.tokenizer, m.pool = read_model_args(model_dir), load_tokenizer(model_dir), pool
    m.sample_executor = ThreadPoolExecutor(max_workers=1)  # the in-process engine is stepped by its caller
    m.generate_fn, m.reward_fn, m.record_routing = generate_fn, resolve_reward("arith"), False
    return m


def test_manager_stores_turns_counts_drift_and_resumes_with_older_turns_masked(dense_dir):
    from pipeline.rollout.data import Prompt
    from pipeline.rollout.manager import Group, RolloutManager

    tok = load_tokenizer(dense_dir)
    prompt = Prompt(0, tok.encode("1+2="), "3", {}, "1+2=")
    m = manager_for(dense_dir, InProcessPool(make_engine(dense_dir)), three_turns)
    g = m.run_group(0, Group(0, 0, prompt), 0)
    for s in g.samples:
        assert s.status == SampleStatus.TRUNCATED or s.status == SampleStatus.COMPLETED
        assert [t[:2] for t in s.metadata["turns"]] == [[4, 9], [13, 18], [22, 27]] and "tito_turn_mismatch" not in s.metadata
        assert s.loss_mask == [1] * 5 + [0] * 4 + [1] * 5 + [0] * 4 + [1] * 5 and s.reward == 1.0
    summary = RolloutManager.summarize(RolloutBatch.from_samples(g.samples), g.samples, 1.0)
    assert summary["rollout/tito_turn_mismatch"] == 0 and summary["rollout/turns_mean"] == 3
    bad = manager_for(dense_dir, InProcessPool(make_engine(dense_dir)), re_encoding).run_group(0, Group(0, 0, prompt), 0)
    summary = RolloutManager.summarize(RolloutBatch.from_samples(bad.samples), bad.samples, 1.0)
    assert summary["rollout/tito_turn_mismatch"] > 0 and summary["rollout/tito_turn_drift_frac"] > 0
    # abort in turn 2 at step 0, resume at step 1 on new weights (version 1): turn 1 and the cut part masked
    m = manager_for(dense_dir, InProcessPool(make_engine(dense_dir), abort_at=(1, 2)), three_turns,
                    "rollout.mask_offpolicy_in_partial_rollout=true")
    g = m.run_group(0, Group(0, 0, prompt), 0)
    assert g.samples[0].status == SampleStatus.ABORTED and len(g.samples[0].response_ids) == 5 + 4 + 2
    engine = make_engine(dense_dir)
    engine.weight_version = 1
    m.pool = InProcessPool(engine)
    g = m.run_group(1, g, 1)
    s = g.samples[0]
    assert s.status != SampleStatus.ABORTED and [t[2:] for t in s.metadata["turns"]] == [
        [0, "length"], [0, "abort"], [1, "length"], [1, "length"]]
    assert s.loss_mask == [0] * 5 + [0] * 4 + [0] * 2 + [1] * 3 + [0] * 4 + [1] * 5 and s.weight_version == 0
    assert len(m.pool.requests) == 2  # the cut turn's continuation and turn 3
