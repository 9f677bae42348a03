"""Real gloo process groups: FSDP2 across 2 processes, and the weight update (broadcast or shared-memory handles) into an engine process."""

from __future__ import annotations

import pytest
import torch

from pipeline.config.schema import WeightsConfig
from pipeline.models.hf_io import load_model
from pipeline.rollout.client import EngineClient
from pipeline.weights.base import make_transport
from pipeline.weights.tensor import TensorTransport

import dist_helpers


def run_world(world, tmp_path, model_dir, overrides, tag):
    out = str(tmp_path / f"out_{tag}.pt")
    dist_helpers.spawn(dist_helpers.train_one_step, world, str(tmp_path / f"init_{tag}"), model_dir,
                       str(tmp_path / f"run_{tag}"), out, overrides)
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("which, algo", [("dense_dir", []), ("moe_dir", []),
                                         ("dense_dir", ["advantage_estimator=ppo", "algo.kl_coef=0.05",
                                                        "algo.off_policy_correction=tis", "loss_reduction=sample_mean"])])
def test_fsdp_two_ranks_equal_one(which, algo, request, tmp_path):
    model_dir = request.getfixturevalue(which)
    # Two optimizer steps per rollout (global batch 8 of 16 samples) and tiny micro-batches, so the
    # micro-batch count differs between ranks and the padding path runs.
    # adam_eps=1 makes the update ~ lr * gradient (Adam's first step is otherwise ~ lr * sign(gradient),
    # which turns fp32 reduction-order noise in near-zero gradients into full-size differences).
    overrides = ["train.adam_eps=1.0", "train.lr=1.0", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "train.global_batch_size=8",
                 "train.max_tokens_per_gpu=20", "data.max_prompt_len=8", "rollout.rollout_max_response_len=4", *algo]
    one = run_world(1, tmp_path, model_dir, overrides, "w1")
    two = run_world(2, tmp_path, model_dir, overrides, "w2")
    _, init = load_model(model_dir)
    moved = 0.0
    for name, p in one["state"].items():
        torch.testing.assert_close(two["state"][name], p, rtol=1e-5, atol=1e-6)
        moved = max(moved, float((p - init.state_dict()[name]).abs().max()))
    assert moved > 1e-3  # the steps really changed the weights (100x the tolerance)
    for key in ("train/pg_loss", "train/rollout_logprob_abs_diff", "train/tokens"):
        assert one["metrics"][key] == pytest.approx(two["metrics"][key], rel=1e-5, abs=1e-7)
    # The weight sync's flat-bucket export equals the parameter-by-parameter gather bit for bit, in
    # named_parameters order, on one rank and on two (shards of uneven row counts included), as views
    # of one buffer per bucket.
    for run in (one, two):
        for flat in run["flat"]:
            assert list(flat) == run["flat_order"] and set(flat) == set(run["state"])
            for name, t in flat.items():
                assert torch.equal(t, run["state"][name]), name
        assert run["flat_storages"][0] == 1 and run["flat_storages"][1] > 3
        assert all(torch.equal(t, 2 * run["state"][name]) for name, t in run["doubled"].items())


def test_weight_transports_come_from_one_factory():
    """Each weights.type builds its transport, which answers the WeightTransport interface; the tensor
    transport declares that it always pauses; an unknown type is refused by name."""
    from pipeline.weights.base import WeightTransport
    from pipeline.weights.broadcast import BroadcastTransport
    from pipeline.weights.common import SyncedTransport

    cpu = torch.device("cpu")
    for kind, cls, pauses in (("broadcast", BroadcastTransport, False), ("tensor", TensorTransport, True)):
        t = make_transport(WeightsConfig(type=kind), [EngineClient("http://127.0.0.1:9")], cpu, "127.0.0.1")
        assert type(t) is cls and isinstance(t, WeightTransport) and t.always_pauses is pauses
        # no transport is built from another one (they share only the VersionSync delegation)
        assert cls.__mro__ == (cls, SyncedTransport, object)
        t.close()
    with pytest.raises(ValueError, match="weights.type='files': use broadcast or tensor"):
        make_transport(WeightsConfig(type="files"), [], cpu, "127.0.0.1")


@pytest.mark.parametrize("transport", ["broadcast", "tensor"])
def test_weight_update_is_bit_exact(transport, dense_dir, engine_factory):
    """A gloo broadcast, or shared-memory handles of the trainer's tensors (weights.type=tensor)."""
    eng = engine_factory(dense_dir)
    client = EngineClient(eng.url)
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True, "sampling_seed": 0}
    before = client.generate([[5, 6, 7]], [greedy])[0]
    _, model = load_model(dense_dir)
    gen = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    # Small buckets: several update requests, the version switches only with the last one.
    sender = make_transport(WeightsConfig(type=transport, bucket_size_mb=0.02, timeout_s=60), [client],
                            torch.device("cpu"), "127.0.0.1")
    assert isinstance(sender, TensorTransport) == (transport == "tensor")
    sender.connect()
    stats = sender.send(list(new.items()), version=5)  # pause=False: only the tensor transport pauses anyway
    assert stats["bytes"] == sum(v.numel() * 4 for v in new.values()) and stats["buckets"] > 3
    assert stats["paused"] == (transport == "tensor") and (stats["pause_s"] > 0) == (transport == "tensor")
    assert client.weight_version() == 5
    for name, t in new.items():
        got = client.request("POST", "/get_weights_by_name", {"name": name, "truncate_size": -1})
        assert torch.equal(torch.tensor(got, dtype=torch.float32), t.flatten()), name
    after = client.generate([[5, 6, 7]], [greedy])[0]
    assert after.weight_version == 5 and before.weight_version == 0
    # A second update over the same group works too (the group is reused across steps).
    sender.send(list(model.state_dict().items()), version=6)
    again = client.generate([[5, 6, 7]], [greedy])[0]
    assert again.output_ids == before.output_ids and again.logprobs == before.logprobs
    sender.close()
