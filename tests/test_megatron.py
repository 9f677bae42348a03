"""The megatron-core backend: weight conversion, logits and gradient norms equal to our model's at
TP=1/TP=2/EP=2/PP=2 on gloo, R3 replay reaching megatron's router, weights gathered back bit-exactly,
and whole runs."""

from __future__ import annotations

import json
import os

import pytest
import torch

import dist_helpers
from conftest import make_model_dir
from pipeline.models.hf_io import load_model
from pipeline.models.decoder_layer import MoeRouting
from pipeline.run import RunDir
from pipeline.trainer.megatron.convert import fuse_qkv, to_hf, to_megatron, unfuse_qkv

import megatron.core  # noqa: E402,F401  (a test dependency: scripts/setup.sh test installs it)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("mg") / "tied"), "tiny-dense", seed=4, tie=True)


@pytest.mark.parametrize("which,tp,ep", [("dense_dir", 1, 1), ("dense_dir", 2, 1), ("moe_dir", 2, 1),
                                         ("moe_dir", 1, 2), ("moe_dir", 2, 4), ("tied_dir", 2, 1)])
def test_conversion_round_trips_bit_exactly(which, tp, ep, request):
    args, model = load_model(request.getfixturevalue(which))
    hf = {k: v for k, v in model.state_dict().items()}
    shards = [[to_megatron(hf, args, t, tp, e, ep) for t in range(tp)] for e in range(ep)]
    if tp > 1:  # the shards really are split: each rank holds its part of the fused QKV rows
        qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
        assert shards[0][0][qkv].shape[0] * tp == fuse_qkv(hf["model.layers.0.self_attn.q_proj.weight"],
                                                           hf["model.layers.0.self_attn.k_proj.weight"],
                                                           hf["model.layers.0.self_attn.v_proj.weight"], args).shape[0]
    back = to_hf(shards, args)
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_qkv_fusion_is_grouped_by_kv_head(dense_dir):
    args, model = load_model(dense_dir)
    p = "model.layers.0.self_attn."
    q, k, v = (model.state_dict()[p + n + "_proj.weight"] for n in "qkv")
    fused = fuse_qkv(q, k, v, args)
    d, per = args.head_dim, args.num_attention_heads // args.num_key_value_heads
    # group 1 starts with query heads 2-3, then k head 1, then v head 1
    start = (per + 2) * d
    assert torch.equal(fused[start:start + per * d], q[per * d:2 * per * d])
    assert torch.equal(fused[start + per * d:start + (per + 1) * d], k[d:2 * d])
    assert all(torch.equal(a, b) for a, b in zip(unfuse_qkv(fused, args, args.num_key_value_heads), (q, k, v)))


def run_megatron(tmp_path, model_dir, world, tp, ep, replay=False, sp=False, pp=1):
    out = tmp_path / f"out_{tp}_{ep}_{replay}_{sp}_{pp}.pt"
    init = tmp_path / f"init_{tp}_{ep}_{replay}_{sp}_{pp}"
    dist_helpers.spawn(dist_helpers.megatron_logits, world, str(init), model_dir, str(out), tp, ep, replay, sp, pp)
    return torch.load(out)


def our_logits(model, replay_trace=None, grad=False):
    from pipeline.models.attention import PackedCausal

    ids, cu, score, trace = dist_helpers.megatron_batch(model.args)
    routing = MoeRouting(trace_NLk=trace, replay=True) if replay_trace else None
    with torch.set_grad_enabled(grad):
        return model(ids, PackedCausal(cu).positions, PackedCausal(cu), routing, logits_at_M=score)


def our_grad_norm(model) -> float:
    """The global gradient norm of dist_helpers.megatron_logits's loss, on our model."""
    model.zero_grad()
    our_logits(model, grad=True).float().square().mean().backward()
    return sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None) ** 0.5


@pytest.mark.slow
@pytest.mark.parametrize("which,world,tp,ep,sp,pp", [
    ("dense_dir", 1, 1, 1, False, 1), ("moe_dir", 1, 1, 1, False, 1), ("dense_dir", 2, 2, 1, False, 1),
    ("moe_dir", 2, 1, 2, False, 1), ("dense_dir", 2, 2, 1, True, 1), ("moe_dir", 2, 2, 1, True, 1),
    ("dense_dir", 2, 1, 1, False, 2), ("tied_dir", 2, 1, 1, False, 2), ("moe_dir", 2, 1, 1, False, 2)])
def test_megatron_logits_equal_ours_and_weights_gather_back(which, world, tp, ep, sp, pp, request, tmp_path):
    """sp: sequence parallelism (norms and the residual stream split over TP ranks along the sequence),
    which also lets megatron run MoE layers under TP (experts TP-sharded). pp: pipeline stages (each
    holds half the layers; the tied embedding's copy on the last stage)."""
    model_dir = request.getfixturevalue(which)
    _, ours = load_model(model_dir)
    got = run_megatron(tmp_path, model_dir, world, tp, ep, sp=sp, pp=pp)
    torch.testing.assert_close(got["logits"], our_logits(ours), rtol=0, atol=2e-5)
    # every shard's gradient counted once in the clip norm (TP-split, TP-replicated, experts, stages)
    assert got["grad_norm"] == pytest.approx(our_grad_norm(ours), rel=1e-5)
    expected = {k: v for k, v in ours.state_dict().items()  # a tied lm_head is not sent (HF's layout)
                if not (k == "lm_head.weight" and ours.args.tie_word_embeddings)}
    assert set(got["state"]) == set(expected)
    for k, v in expected.items():  # TP shards, EP experts and pipeline stages gathered, converted: exact
        assert torch.equal(got["state"][k], v), k


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,sp", [(1, 2, False), (2, 1, True)])
def test_routing_replay_reaches_the_megatron_router(moe_dir, tmp_path, tp, ep, sp):
    """The trace is not what either router would pick; with replay both follow it, so their logits
    agree with each other and differ from live routing. Under sequence parallelism each TP rank's
    routers get their own slice of the trace."""
    _, ours = load_model(moe_dir)
    got = run_megatron(tmp_path, moe_dir, 2, tp, ep, replay=True, sp=sp)
    replayed = our_logits(ours, replay_trace=True)
    torch.testing.assert_close(got["logits"], replayed, rtol=0, atol=2e-5)
    assert (replayed - our_logits(ours)).abs().max() > 1e-3


@pytest.mark.slow
def test_megatron_activation_recompute_keeps_the_gradients(moe_dir, tmp_path):
    """train.recompute_activations on megatron (full, every layer): each layer's forward runs under
    megatron's activation checkpoint and is recomputed in backward, R3's replayed experts included,
    and the gradients are bit-identical to keeping the activations."""
    got = {}
    for recompute in (True, False):
        out = tmp_path / f"grads_{recompute}.pt"
        dist_helpers.spawn(dist_helpers.megatron_grads, 1, str(tmp_path / f"init_{recompute}"), moe_dir, str(out), recompute)
        got[recompute] = torch.load(out)
    assert got[True]["checkpointed"] > 0 and got[False]["checkpointed"] == 0
    a, b = got[True]["grads"], got[False]["grads"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(a[k].abs().sum() > 0 for k in a if "router" in k)


def test_megatron_config_refusals():
    from pipeline.config import load_config
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="train.backend=megatron"):
        load_config("configs/tiny.yaml", ["train.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match="divisible by train.tensor_model_parallel_size"):
        load_config("configs/tiny.yaml", ["train.backend=megatron", "train.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match="true_on_policy with tensor parallelism"):
        load_config("configs/tiny.yaml", ["train.backend=megatron", "determinism.true_on_policy=true",
                                          "train.tensor_model_parallel_size=2", "train.num_gpus=2"])
    with pytest.raises(ConfigError, match="tensor_model_parallel_size x train.pipeline_model_parallel_size"):
        load_config("configs/tiny.yaml", ["train.backend=megatron", "train.pipeline_model_parallel_size=2",
                                          "train.tensor_model_parallel_size=2", "train.num_gpus=2"])


@pytest.mark.slow
def test_megatron_ppo_critic_matches_fsdp_and_resumes(ppo_small_run, tmp_path):
    """PPO on the megatron backend (TP=2, the critic a GPTModel with a value head, stopped after its
    step-2 checkpoint and rerun to step 4) against FSDP2 on one rank: the same value losses, gradient
    norms and rewards step by step (to fp32 rounding), so the critic trains alike and comes back
    from the megatron checkpoint. The FSDP2 run is the shared ppo_small_run (the same job)."""
    from conftest import PPO_SMALL
    from test_e2e import lockstep
    from pipeline.observability.metrics import read_metrics

    mg = ["train.backend=megatron", "train.num_gpus=2", "train.tensor_model_parallel_size=2", f"run_dir={tmp_path}/mg"]
    for n in (2, 4):
        res = lockstep("run", *PPO_SMALL, *mg, f"num_rollout={n}")
        assert res.returncode == 0, res.stderr[-3000:]
    ours, theirs = read_metrics(f"{tmp_path}/mg"), read_metrics(ppo_small_run)
    assert [r["step"] for r in ours] == [0, 1, 2, 3]
    for a, b in zip(ours, theirs, strict=True):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
        for key in ("train/value_loss", "train/grad_norm", "train/pg_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), (key, a["step"])


def test_pipeline_stage_split_round_trips(tied_dir):
    """Each stage keeps its layers (renumbered from 0) and its ends; the tied embedding's copy sits on
    the last stage as its output layer; the stages' shards put back together are the whole model's."""
    from pipeline.config.validate import check_parallel
    from pipeline.trainer.megatron.convert import global_names, stage_shard

    args, model = load_model(tied_dir)
    whole = to_megatron(model.state_dict(), args)
    n = args.num_hidden_layers
    halves = [range(0, n // 2), range(n // 2, n)]
    first, last = stage_shard(whole, args, halves[0], True, False), stage_shard(whole, args, halves[1], False, True)
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert torch.equal(last["output_layer.weight"], whole["embedding.word_embeddings.weight"])
    assert "decoder.final_layernorm.weight" in last and "decoder.final_layernorm.weight" not in first
    assert torch.equal(last["decoder.layers.0.input_layernorm.weight"], whole[f"decoder.layers.{n // 2}.input_layernorm.weight"])
    merged = {**global_names(first, args, halves[0]), **global_names(last, args, halves[1])}
    assert merged.keys() == whole.keys() and all(torch.equal(merged[k], whole[k]) for k in whole)
    with pytest.raises(ValueError, match="divisible by pipeline parallel size"):
        check_parallel(args, 1, 1, n + 1)


@pytest.mark.slow
def test_megatron_pipeline_stages_train_like_one_rank(tmp_path):
    """Two pipeline stages (a tied-embedding MoE model, R3 replay, entropy bonus, PPO: the critic's stage
    hand-overs share the policy's backward) against the same run on one rank: the same rewards, losses
    and value losses step by step and bit-identical final weights, so the stages' hand-over (forward
    and backward), the tied embedding's gradient and the gathered weights are exact. The engine's
    logprobs agree with the trainer's to fp32 rounding."""
    from safetensors.torch import load_file

    from conftest import make_model_dir
    from test_e2e import lockstep
    from pipeline.observability.metrics import read_metrics

    model_dir = make_model_dir(str(tmp_path / "tied-moe"), "tiny-moe", seed=3, tie=True)
    runs = {}
    for pp in (2, 1):
        res = lockstep("run", "configs/tiny.yaml", f"run_dir={tmp_path}/pp{pp}", f"model.path={model_dir}",
                       "train.backend=megatron", f"train.num_gpus={pp}", f"train.pipeline_model_parallel_size={pp}",
                       "determinism.routing_replay=true", "algo.advantage_estimator=ppo", "num_rollout=4",
                       "eval.interval=0", "logging.plot=false", "--no-progress")
        assert res.returncode == 0, res.stderr[-3000:]
        runs[pp] = read_metrics(f"{tmp_path}/pp{pp}")
    for a, b in zip(runs[1], runs[2], strict=True):
        for key in ("rollout/reward_mean", "train/loss", "train/value_loss"):
            assert a[key] == b[key], (key, a, b)
        assert b["train/rollout_logprob_max_abs_diff"] < 1e-5
    one, two = (load_file(os.path.join(RunDir(tmp_path / f"pp{pp}").hf_export, "model.safetensors")) for pp in (1, 2))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


@pytest.mark.slow
def test_megatron_true_on_policy_is_bit_exact_with_the_engine(tmp_path):
    """Dense, TP=1, batch-invariant mode: megatron's layers run on Lockstep's kernels, so the trainer's
    logprobs equal the engine's bit for bit every step (the run itself stops if they do not)."""
    from test_e2e import lockstep
    from pipeline.observability.metrics import read_metrics

    res = lockstep("run", "configs/tiny.yaml", f"run_dir={tmp_path}/run", "train.backend=megatron", "num_rollout=6",
                   "determinism.true_on_policy=true", "eval.interval=0", "logging.plot=false", "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(f"{tmp_path}/run")
    assert len(rows) == 6 and all(r["train/rollout_logprob_max_abs_diff"] == 0.0 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("variant,resume", [
    (["model.init=tiny-dense", "train.tensor_model_parallel_size=2"], True),
    (["model.init=tiny-moe", "train.expert_model_parallel_size=2", "determinism.routing_replay=true"], False),
    (["model.init=tiny-moe", "train.tensor_model_parallel_size=2", "train.sequence_parallel=true",
      "determinism.routing_replay=true"], False),
])
def test_megatron_runs_train_and_resume(variant, resume, tmp_path):
    """Two gloo ranks, megatron backend: the engine's logprobs match the trainer's to fp32 rounding
    every step (so the gathered weights reach it intact), the reward rises, and (TP=2) a second
    invocation resumes from the per-rank DCP checkpoint."""
    from test_e2e import lockstep
    from pipeline.observability.metrics import read_metrics

    common = ["configs/tiny.yaml", f"run_dir={tmp_path}/run", "train.backend=megatron", "train.num_gpus=2",
              "checkpoint.save_interval=6", *variant, "eval.interval=0", "logging.plot=false", "--no-progress"]
    res = lockstep("run", *common, "num_rollout=12")
    assert res.returncode == 0, res.stderr[-3000:]
    if resume:
        res = lockstep("run", *common, "num_rollout=18")
        assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(f"{tmp_path}/run")
    if resume:
        assert [r["step"] for r in rows][-6:] == list(range(12, 18))
    assert max(r["train/rollout_logprob_max_abs_diff"] for r in rows) < 1e-5
    first = sum(r["rollout/reward_mean"] for r in rows[:3]) / 3
    last = sum(r["rollout/reward_mean"] for r in rows[-3:]) / 3
    # 12 steps of the tiny MoE on the 44 training sums: the reward roughly doubles (0.021 -> 0.040; the runs
    # are deterministic, so the margin is not a matter of luck)
    assert last > first + 0.015, (first, last)
    assert json.load(open(os.path.join(RunDir(tmp_path / "run").hf_export, "config.json")))["model_type"] in ("qwen3", "qwen3_moe")
