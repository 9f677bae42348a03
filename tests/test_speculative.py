"""MTP draft head and speculative decoding: exact tokens, bit-identical logprobs, acceptance that a
trained head earns, and a run whose rollouts do not change when speculative decoding is switched on."""

from __future__ import annotations

import json

import pytest
import torch

import lockstep_kernels as kernels
from conftest import make_model_dir
from pipeline.models.attention import PackedCausal
from pipeline.models.hf_io import load_model, read_state_dict
from pipeline.models.logprobs import token_logprobs
from pipeline.models.mtp import mtp_inputs
from pipeline.rollout.client import EngineClient
from pipeline.rollout.engine.core import Engine, Request, SamplingParams
from pipeline.rollout.engine.speculative import accepted_prefix
from pipeline.run import RunDir


@pytest.fixture(scope="module")
def mtp_dense_dir(tmp_path_factory) -> str:
    return make_model_dir(str(tmp_path_factory.mktemp("mtp") / "dense"), "tiny-dense", seed=3)


def engine_for(model, k: int, max_running: int = 4, context: int = 64) -> Engine:
    return Engine(model, max_running=max_running, context_length=context, eos_token_ids=[0],
                  device=torch.device("cpu"), dtype=torch.float32, speculative_num_steps=k)


def generate(engine: Engine, prompts, params: list[SamplingParams], routed: bool = False) -> list[Request]:
    reqs = [Request(list(p), sp, return_routed_experts=routed) for p, sp in zip(prompts, params)]
    for r in reqs:
        engine.submit(r)
    while engine.waiting or engine.running:
        engine.step()
    assert all(r.done.is_set() and r.finish_reason["type"] in ("stop", "length") for r in reqs)
    return reqs


PROMPTS = [[5, 6, 7], [8] * 9, [14], [3, 4, 5, 6, 7, 8], [20, 21], [9, 9, 9, 9]]


def mixed_params(temperature: float, stops: dict[int, int] | None = None) -> list[SamplingParams]:
    """Lengths, stop tokens and truncation differ per request, so requests finish in the middle of a
    verify step, at different steps, and their slots are compacted under the running ones."""
    out = []
    for i in range(len(PROMPTS)):
        out.append(SamplingParams(max_new_tokens=7 + 3 * i, temperature=temperature, top_p=0.9 if i == 2 else 1.0,
                                  top_k=8 if i == 3 else -1, sampling_seed=100 + i, ignore_eos=True,
                                  stop_token_ids=[stops[i]] if stops and i in stops else []))
    return out


def params_with_stops(model, temperature: float) -> list[SamplingParams]:
    """mixed_params where every other request stops at the token it would emit fifth."""
    free = generate(engine_for(model, 0), PROMPTS, mixed_params(temperature))
    return mixed_params(temperature, {i: r.output_ids[4] for i, r in enumerate(free) if i % 2})


def test_accepted_prefix_counts_the_leading_agreement():
    draft = torch.tensor([[1, 2, 3], [1, 9, 3], [7, 2, 3], [4, 5, 6]])
    target = torch.tensor([[1, 2, 3, 0], [1, 2, 3, 0], [1, 2, 3, 0], [4, 5, 6, 8]])
    assert accepted_prefix(draft, target).tolist() == [3, 1, 0, 3]
    assert accepted_prefix(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long)).tolist() == [0, 0]


@pytest.mark.parametrize("which", ["dense", "moe"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_decode_is_bit_identical_to_plain_decode_in_true_on_policy_mode(which, temperature, tmp_path):
    model_dir = make_model_dir(str(tmp_path / which), f"tiny-{which}", seed=5)
    _, model = load_model(model_dir, mtp_layers=1)  # an untrained head: most drafts are rejected
    with kernels.batch_invariant_mode(True):
        params = params_with_stops(model, temperature)
        plain = generate(engine_for(model, 0), PROMPTS, params, routed=which == "moe")
        spec_engine = engine_for(model, 3)
        spec = generate(spec_engine, PROMPTS, params, routed=which == "moe")
    for a, b in zip(plain, spec):
        assert a.output_ids == b.output_ids
        assert a.output_logprobs == b.output_logprobs  # bit for bit, not approximately
        assert a.finish_reason == b.finish_reason
        if which == "moe":
            assert torch.equal(torch.cat(a.routed), torch.cat(b.routed))  # R3 traces unchanged too
            assert torch.cat(b.routed).shape[0] == len(b.input_ids) + len(b.output_ids) - 1
    assert spec_engine.stats["spec_rounds"] > 0 and spec_engine.stats["spec_draft_tokens"] > 0
    assert any(r.finish_reason["type"] == "stop" for r in spec)  # some stopped inside a verify step
    # fewer forwards than tokens once anything is accepted; never more steps than plain decoding
    assert spec_engine.stats["steps"] <= sum(len(r.output_ids) for r in spec)


def test_logprobs_match_plain_decode_closely_without_batch_invariance(mtp_dense_dir):
    _, model = load_model(mtp_dense_dir, mtp_layers=1)
    params = params_with_stops(model, 1.0)
    plain = generate(engine_for(model, 0), PROMPTS, params)
    spec = generate(engine_for(model, 3), PROMPTS, params)
    for a, b in zip(plain, spec):
        n = min(len(a.output_ids), len(b.output_ids))
        # same target distribution; logits of a (k+1)-token verify differ from one-token decode in the last bits
        first_diff = next((i for i in range(n) if a.output_ids[i] != b.output_ids[i]), n)
        torch.testing.assert_close(torch.tensor(b.output_logprobs[:first_diff]),
                                   torch.tensor(a.output_logprobs[:first_diff]), rtol=0, atol=1e-4)


def distill_head(model, prompts, steps: int = 150) -> float:
    """Train the MTP head alone on the target's own greedy continuations; returns the final loss."""
    seqs = [r.input_ids + r.output_ids for r in generate(engine_for(model, 0, max_running=16), prompts,
                                                         [SamplingParams(max_new_tokens=24, temperature=0.0,
                                                                         ignore_eos=True, sampling_seed=0)]
                                                         * len(prompts))]
    ctx = PackedCausal.from_lengths([len(s) for s in seqs])
    ids = torch.tensor([t for s in seqs for t in s])
    score = torch.cat([torch.arange(int(a), int(b) - 1) for a, b in zip(ctx.cu_seqlens[:-1], ctx.cu_seqlens[1:])])
    nxt, at, valid = mtp_inputs(ids, ctx.cu_seqlens, score)
    main_before = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("mtp.")}
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        _, mtp_logits = model(ids, ctx.positions, ctx, None, logits_at_M=score, mtp_next_ids_N=nxt, mtp_at_M=at)
        loss = -(token_logprobs(mtp_logits, ids[score + 1], 1.0) * valid).sum() / valid.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    for n, p in model.named_parameters():  # the head's loss never reaches the policy (all params were in Adam)
        if n in main_before:
            assert p.grad is None or not p.grad.any(), n
            assert torch.equal(p, main_before[n]), n
    model.eval()
    return float(loss.detach())


def test_a_trained_draft_head_is_accepted_and_saves_forwards(mtp_dense_dir):
    _, model = load_model(mtp_dense_dir, mtp_layers=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(32)]
    greedy = [SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, sampling_seed=0)] * 8

    def accept_rate():
        e = engine_for(model, 3)
        reqs = generate(e, prompts[:8], greedy)
        return e.spec.stats(), e.stats["steps"], reqs

    before, _, _ = accept_rate()
    distill_head(model, prompts)
    after, steps, reqs = accept_rate()
    plain = generate(engine_for(model, 0), prompts[:8], greedy)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]  # greedy: the same tokens
    assert before["spec_accept_rate"] < 0.2 < 0.6 < after["spec_accept_rate"], (before, after)
    assert after["avg_spec_accept_length"] > 2.5  # of at most k+1 = 4 tokens per verify forward
    assert steps < 0.6 * 8 * 24  # one prefill step + far fewer decode steps than 24 per request


def test_mtp_head_names_config_and_loading(mtp_dense_dir, tmp_path):
    _, plain = load_model(mtp_dense_dir)
    assert not hasattr(plain, "mtp")
    _, with_head = load_model(mtp_dense_dir, mtp_layers=1)
    names = [n for n in with_head.state_dict() if n.startswith("mtp.")]
    # SGLang's Qwen3MoeForCausalLMMTP loader reads exactly these
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight"} <= set(names)
    assert with_head.mtp.fc.weight.shape == (64, 128)
    _, again = load_model(mtp_dense_dir, mtp_layers=1)  # a fresh head is seeded: equal in every process
    assert torch.equal(again.mtp.fc.weight, with_head.mtp.fc.weight)
    from pipeline.models.hf_io import save_model

    save_model(with_head.state_dict(), with_head.args, str(tmp_path / "out"))
    assert json.load(open(tmp_path / "out" / "config.json"))["mtp_num_hidden_layers"] == 1
    assert "mtp.fc.weight" in read_state_dict(str(tmp_path / "out"))
    args, back = load_model(str(tmp_path / "out"))  # the checkpoint's own head comes back
    assert args.mtp_num_hidden_layers == 1 and torch.equal(back.mtp.fc.weight, with_head.mtp.fc.weight)
    args, dropped = load_model(str(tmp_path / "out"), mtp_layers=0)
    assert args.mtp_num_hidden_layers == 0 and not hasattr(dropped, "mtp")


def test_engine_server_reports_speculative_stats(mtp_dense_dir, engine_factory):
    eng = engine_factory(mtp_dense_dir, ["--mtp-num-layers", "1", "--speculative-algorithm", "NEXTN",
                                         "--speculative-num-steps", "2"])
    c = EngineClient(eng.url)
    body = c.request("POST", "/generate", {"input_ids": [[5, 6, 7]], "sampling_params": {
        "max_new_tokens": 9, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 4}})
    meta = (body[0] if isinstance(body, list) else body)["meta_info"]
    assert meta["completion_tokens"] == 9 and 1 <= meta["spec_verify_ct"] <= 8
    assert meta["spec_accept_length"] == pytest.approx(8 / meta["spec_verify_ct"])
    info = c.request("GET", "/server_info", None)
    assert info["speculative_num_steps"] == 2 and 1.0 <= info["avg_spec_accept_length"] <= 3.0


def test_speculative_config_checks():
    from pipeline.config import load_config
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="mtp_num_layers=1"):
        load_config("configs/tiny.yaml", ["engine.speculative_algorithm=NEXTN"])
    with pytest.raises(ConfigError, match="0 or 1"):
        load_config("configs/tiny.yaml", ["model.mtp_num_layers=2"])
    with pytest.raises(ConfigError, match="speculative_num_steps"):
        load_config("configs/tiny-mtp.yaml", ["engine.speculative_num_steps=0"])


@pytest.mark.slow
def test_mtp_recipe_rollouts_are_unchanged_by_speculative_decoding(tmp_path):
    """The tiny-mtp recipe with and without speculative decoding: the same rewards, losses and head
    losses step for step (true on-policy: the run itself checks trainer == engine logprobs), and
    the head's metrics are reported."""
    from test_e2e import lockstep
    from pipeline.observability.metrics import read_metrics

    runs = {}
    for spec in ("NEXTN", "null"):
        res = lockstep("run", "configs/tiny-mtp.yaml", f"run_dir={tmp_path}/{spec}", "num_rollout=8",
                       f"engine.speculative_algorithm={spec}", "logging.plot=false", "--no-progress")
        assert res.returncode == 0, res.stderr[-3000:]
        runs[spec] = read_metrics(f"{tmp_path}/{spec}")
    with_spec, without = runs["NEXTN"], runs["null"]
    assert len(with_spec) == len(without) == 8
    for a, b in zip(with_spec, without):
        for key in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/mtp_loss", "train/mtp_acc"):
            assert a[key] == b[key], (a["step"], key)
        assert a["train/rollout_logprob_max_abs_diff"] == 0
    assert all(r["rollout/spec_accept_length"] >= 1.0 for r in with_spec)
    assert "rollout/spec_accept_length" not in without[0]
    assert with_spec[-1]["train/mtp_loss"] < with_spec[0]["train/mtp_loss"]  # the head learns
    assert "mtp.fc.weight" in read_state_dict(RunDir(tmp_path / "NEXTN").hf_export)
