"""The megatron-core backend: weight conversion, logits equal to our model at TP=1/TP=2/EP=2 on gloo,
R3 replay reaching megatron's router, weights gathered back bit-exactly, and whole runs."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

import dist_helpers
from conftest import make_model_dir
from pipeline.models.hf_io import load_model
from pipeline.models.qwen3 import MoeRouting
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


def run_megatron(tmp_path, model_dir, world, tp, ep, replay=False, sp=False):
    out = tmp_path / f"out_{tp}_{ep}_{replay}_{sp}.pt"
    init = tmp_path / f"init_{tp}_{ep}_{replay}_{sp}"
    mp.start_processes(dist_helpers.megatron_logits, nprocs=world, start_method="spawn",
                       args=(world, str(init), model_dir, str(out), tp, ep, replay, sp))
    return torch.load(out)


def our_logits(model, replay_trace=None):
    from pipeline.models.attention import PackedCausal

    ids, cu, score, trace = dist_helpers.megatron_batch(model.args)
    routing = MoeRouting(trace_NLk=trace, replay=True) if replay_trace else None
    with torch.no_grad():
        return model(ids, PackedCausal(cu).positions, PackedCausal(cu), routing, logits_at_M=score)


@pytest.mark.parametrize("which,world,tp,ep,sp", [("dense_dir", 1, 1, 1, False), ("moe_dir", 1, 1, 1, False),
                                                  ("dense_dir", 2, 2, 1, False), ("moe_dir", 2, 1, 2, False),
                                                  ("dense_dir", 2, 2, 1, True), ("moe_dir", 2, 2, 1, True)])
def test_megatron_logits_equal_ours_and_weights_gather_back(which, world, tp, ep, sp, request, tmp_path):
    """sp: sequence parallelism (norms and the residual stream split over TP ranks along the sequence),
    which also lets megatron run MoE layers under TP (experts TP-sharded)."""
    model_dir = request.getfixturevalue(which)
    _, ours = load_model(model_dir)
    got = run_megatron(tmp_path, model_dir, world, tp, ep, sp=sp)
    torch.testing.assert_close(got["logits"], our_logits(ours), rtol=0, atol=2e-5)
    for k, v in ours.state_dict().items():  # TP shards and EP experts gathered, converted: exact
        assert torch.equal(got["state"][k], v), k


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
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        load_config("configs/tiny.yaml", ["train.backend=megatron", "train.pipeline_model_parallel_size=2",
                                          "train.num_gpus=2", "train.global_batch_size=256"])


def test_megatron_true_on_policy_is_bit_exact_with_the_engine(tmp_path):
    """Dense, TP=1, batch-invariant mode: megatron's layers run on Lockstep's kernels, so the trainer's
    logprobs equal the engine's bit for bit every step (the run itself stops if they do not)."""
    from test_e2e import lockstep
    from pipeline.observability.metrics import read_metrics

    res = lockstep("run", "configs/tiny.yaml", f"run_dir={tmp_path}/run", "train.backend=megatron", "num_rollout=6",
                   "determinism.true_on_policy=true", "logging.plot=false", "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(f"{tmp_path}/run")
    assert len(rows) == 6 and all(r["train/rollout_logprob_max_abs_diff"] == 0.0 for r in rows)


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
              "checkpoint.save_interval=6", *variant, "logging.plot=false", "--no-progress"]
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
    assert last > first + 0.02, (first, last)
    assert json.load(open(tmp_path / "run" / "hf" / "config.json"))["model_type"] in ("qwen3", "qwen3_moe")
