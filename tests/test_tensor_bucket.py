"""Colocated weight updates in SGLang's flattened_bucket form (pipeline/rollout/tensor_bucket.py): the
wire form on its own, then through a real engine process, bit for bit against the per-tensor form."""

from __future__ import annotations

import logging

import pytest
import torch

from pipeline.config.schema import WeightsConfig
from pipeline.models.fp8 import SCALE_SUFFIX, is_fp8_target
from pipeline.models.hf_io import load_model
from pipeline.rollout import protocol, tensor_bucket
from pipeline.rollout.client import EngineClient, EngineError
from pipeline.weights.buckets import buckets_of
from pipeline.weights.quant import fp8_stream
from pipeline.weights.receiver import load_named_tensors
from pipeline.weights.tensor import TensorTransport


def odd_tensors() -> list[tuple[str, torch.Tensor]]:
    """Every dtype a weight sync may carry, at sizes that misalign the next one."""
    g = torch.Generator().manual_seed(0)
    return [("bf16", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
            ("fp8", torch.randn(7, generator=g).to(torch.float8_e4m3fn)),
            ("scale", torch.rand(1, 1, generator=g)),
            ("i64", torch.arange(3)), ("i32", torch.arange(5, dtype=torch.int32)), ("mask", torch.rand(3) > 0.5),
            ("scalar", torch.tensor(2.5)), ("empty", torch.zeros(0, 4)), ("fp16", torch.randn(2, generator=g).half())]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def test_flattened_bucket_round_trips_every_dtype_through_shared_memory():
    named = odd_tensors()
    flat, metadata = tensor_bucket.flatten(named)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert all(m.start_idx % m.dtype.itemsize == 0 and m.numel == m.end_idx - m.start_idx for m in metadata)
    body = protocol.update_flattened_bucket_body(flat, metadata, version=2)
    assert body["load_format"] == "flattened_bucket" and body["weight_version"] == "2"
    got = load_named_tensors(body["serialized_named_tensors"][0], body["load_format"])
    assert [n for n, _ in got] == [n for n, _ in named]
    assert all(same_bits(a, b) for (_, a), (_, b) in zip(named, got))
    storages = {t.untyped_storage().data_ptr() for _, t in got if t.numel()}
    assert len(storages) == 1  # one shared storage: one handle for the bucket


def test_exported_bucket_is_flattened_without_a_copy():
    """A weight sync's bucket (views of one export buffer, fsdp.full_state) is shared as a view of it."""
    export = torch.randn(40)
    named = [("a", export[0:12].view(3, 4)), ("b", export[12:20]), ("c", export[20:21].view(()))]
    flat, metadata = tensor_bucket.flatten(named)
    assert flat.untyped_storage().data_ptr() == export.untyped_storage().data_ptr() and flat.numel() == 21 * 4
    assert [(m.start_idx, m.end_idx) for m in metadata] == [(0, 48), (48, 80), (80, 84)]
    assert all(same_bits(a, b) for (_, a), (_, b) in zip(named, tensor_bucket.reconstruct(flat, metadata)))
    # out of order, or with a gap: packed into a new buffer instead
    flat, _ = tensor_bucket.flatten([named[1], named[0]])
    assert flat.untyped_storage().data_ptr() != export.untyped_storage().data_ptr()


def test_malformed_flattened_buckets_are_refused():
    flat, metadata = tensor_bucket.flatten(odd_tensors()[:2])
    bad = tensor_bucket.FlattenedTensorMetadata("bf16", torch.Size([3, 5]), torch.bfloat16, 2, 40, 38)
    with pytest.raises(ValueError, match="do not hold"):
        tensor_bucket.reconstruct(flat, [bad])
    with pytest.raises(ValueError, match="1-D uint8"):
        tensor_bucket.reconstruct(flat.view(torch.int8), metadata)
    body = protocol.update_tensor_body(odd_tensors()[:1])
    with pytest.raises(ValueError, match="load_format 'direct'"):
        load_named_tensors(body["serialized_named_tensors"][0], "direct")
    with pytest.raises(ValueError, match="flattened_bucket payload holds"):  # a per-tensor payload, mislabelled
        load_named_tensors(body["serialized_named_tensors"][0], "flattened_bucket")


def test_sglang_engines_get_per_tensor_handles_when_sglang_does_not_import(caplog):
    """SGLang reads only its own metadata class; a trainer without SGLang says so once and sends per tensor."""
    cpu, clients = torch.device("cpu"), [EngineClient("http://127.0.0.1:9")]
    assert tensor_bucket.sglang_metadata_class() is None  # this environment has no SGLang
    with caplog.at_level(logging.WARNING, logger="lockstep.weights"):
        t = TensorTransport(WeightsConfig(type="tensor"), clients, cpu, engine_type="sglang")
    assert t.metadata_cls is None
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "one handle per tensor" in caplog.records[0].message
    assert TensorTransport(WeightsConfig(type="tensor"), clients, cpu).metadata_cls is tensor_bucket.FlattenedTensorMetadata
    assert TensorTransport(WeightsConfig(type="tensor", tensor_format="per_tensor"), clients, cpu).metadata_cls is None
    t.close()


def exported(named: dict[str, torch.Tensor], bucket_bytes: int) -> list[tuple[str, torch.Tensor]]:
    """The tensors as a weight sync exports them: views of one buffer per bucket (fsdp.full_state)."""
    out = []
    for bucket, _ in buckets_of(list(named.items()), bucket_bytes):
        buf = torch.cat([t.reshape(-1) for _, t in bucket])
        offset = 0
        for name, t in bucket:
            out.append((name, buf[offset: offset + t.numel()].view(t.shape)))
            offset += t.numel()
    return out


def engine_weights(c: EngineClient, names: list[str]) -> dict[str, list]:
    return {n: c.request("POST", "/get_weights_by_name", {"name": n, "truncate_size": -1}) for n in names}


@pytest.mark.parametrize("dtype,engine_quant,sent", [
    ("bfloat16", None, "none"),
    pytest.param("float32", None, "fp8", marks=pytest.mark.slow),  # ~40 s each on 2 busy cores
    pytest.param("bfloat16", "fp8", "fp8", marks=pytest.mark.slow)])
def test_flattened_update_leaves_the_engine_bit_equal_to_a_per_tensor_one(dense_dir, engine_factory, dtype,
                                                                         engine_quant, sent):
    """The same version sent per tensor and flattened (TensorTransport, several buckets; bf16 views of
    the export, or FP8 e4m3 + fp32 scales from weights.quantization=fp8, dequantised on receipt or kept
    by an FP8 engine): every engine parameter holds the same values after either."""
    extra = ["--dtype", dtype] + (["--quantization", engine_quant] if engine_quant else [])
    c = EngineClient(engine_factory(dense_dir, extra).url)
    _, model = load_model(dense_dir)
    g = torch.Generator().manual_seed(5)
    wire_dtype = getattr(torch, dtype)
    versions = [{n: (t + 0.02 * k * torch.randn(t.shape, generator=g)).to(wire_dtype)
                 for n, t in model.state_dict().items()} for k in (1, 2)]
    names = list(versions[0])
    if engine_quant:
        names += [n + SCALE_SUFFIX for n, t in versions[0].items() if is_fp8_target(n, t)]

    def send(state, fmt, version):
        sender = TensorTransport(WeightsConfig(type="tensor", bucket_size_mb=0.02, timeout_s=60, tensor_format=fmt,
                                               quantization=sent, keep_host_copy=False), [c], torch.device("cpu"))
        sender.connect()
        named = exported(state, 20 << 10)
        stats = sender.send(list(fp8_stream(named)) if sent == "fp8" else named, version)
        sender.close()
        assert stats["buckets"] > 3 and c.weight_version() == version
        return engine_weights(c, names)

    per_tensor = send(versions[0], "per_tensor", 1)
    other = send(versions[1], "flattened", 2)
    flattened = send(versions[0], "flattened", 3)
    assert other != per_tensor  # the flattened update did change the weights
    for n in names:
        assert flattened[n] == per_tensor[n], n
    if sent == "none":
        assert all(torch.equal(torch.tensor(flattened[n], dtype=wire_dtype), t.reshape(-1))
                   for n, t in versions[0].items())


def test_unknown_parameter_in_a_flattened_bucket_changes_nothing(dense_dir, engine_factory):
    c = EngineClient(engine_factory(dense_dir).url)
    name = "model.norm.weight"
    before = engine_weights(c, [name])
    with c.weight_update_session(), pytest.raises(EngineError, match="unknown parameter"):
        c.update_weights_from_tensor([(name, torch.zeros(64)), ("model.no_such.weight", torch.zeros(2))], version=4,
                                     flattened=True)
    assert engine_weights(c, [name]) == before and c.weight_version() == 0
