"""Low precision: blockwise FP8 quantisation, FP8 weight sync to an engine, FP8 rollouts in a run."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import REPO
from lockstep_kernels import fp8
from pipeline.config.schema import WeightsConfig
from pipeline.errors import ConfigError
from pipeline.models.hf_io import load_model
from pipeline.rollout.client import EngineClient
from pipeline.run import RunDir
from pipeline.weights.broadcast import BroadcastTransport
from pipeline.weights.quant import SCALE_SUFFIX, fp8_stream, is_fp8_target


def weights_like_a_model(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w[min(3, shape[0] - 1), 5] = 0.9  # an outlier: its block's other values fall into e4m3's subnormal range
    w[:, 130:140] *= 1e-4  # tiny columns: a block-relative error bound, not a per-value one
    return w


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (64, 64), (1, 129)])
def test_fp8_error_is_within_the_e4m3_bound_everywhere(shape):
    w = weights_like_a_model(shape)
    q, s = fp8.quantize_ref(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.shape == (fp8.num_blocks(shape[0]), fp8.num_blocks(shape[1])) and s.dtype == torch.float32
    back = fp8.dequantize_ref(q, s)
    err = (back - w).abs()
    assert torch.isfinite(back).all()
    assert (err <= fp8.error_bound(w, s)).all(), float((err / fp8.error_bound(w, s)).max())
    assert err.max() > 0  # it is a lossy format: a test that saw no error would be testing nothing
    # every block uses the full range: its largest value maps to +-448 exactly
    assert float(q.float().abs().max()) == fp8.E4M3_MAX
    # the scale is amax / 448, bit for bit
    block0 = w[:128, :128].abs().max()
    assert s[0, 0].item() == (block0 / fp8.E4M3_MAX).item()


def test_fp8_all_zero_block_and_sign():
    w = torch.zeros(128, 256)
    w[:, 128:] = -1.0
    q, s = fp8.quantize_ref(w)
    assert s[0, 0] == 1.0 and (q[:, :128].float() == 0).all()
    assert (fp8.dequantize_ref(q, s)[:, 128:] == -1.0).all()


def test_fp8_stream_quantizes_linear_weights_only_and_halves_their_bytes(dense_dir):
    _, model = load_model(dense_dir)
    state = {n: t.to(torch.bfloat16) for n, t in model.state_dict().items()}
    out = dict(fp8_stream(state.items()))
    linear = [n for n, t in state.items() if is_fp8_target(n, t)]
    assert linear and all(out[n].dtype == torch.float8_e4m3fn for n in linear)
    assert all(n + SCALE_SUFFIX in out for n in linear)
    for kept in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert out[kept].dtype == torch.bfloat16
    before = sum(state[n].numel() * state[n].element_size() for n in linear)
    after = sum(out[n].numel() * out[n].element_size() + out[n + SCALE_SUFFIX].numel() * 4 for n in linear)
    elems = sum(state[n].numel() for n in linear)
    blocks = sum(out[n + SCALE_SUFFIX].numel() for n in linear)
    assert after == elems + 4 * blocks and before == 2 * elems  # 1 byte per weight + one fp32 scale per block
    assert after / before <= 0.5 + 2 * blocks / elems


@pytest.mark.parametrize("sent,engine_quant", [("fp8", None), ("fp8", "fp8"), ("none", "fp8")])
def test_fp8_weight_sync_lands_on_the_engine_bit_exactly(dense_dir, engine_factory, sent, engine_quant):
    """Scales travel bit-exactly: the engine's weights are exactly q * scale_inv of the trainer's, whether
    it dequantises the pairs on receipt (a full-precision engine), keeps them (an FP8 engine), or
    quantises a full-precision update itself (an FP8 engine fed fp32)."""
    eng = engine_factory(dense_dir, ["--quantization", engine_quant] if engine_quant else None)
    _, model = load_model(dense_dir)
    g = torch.Generator().manual_seed(3)
    new = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in model.state_dict().items()}
    sender = BroadcastTransport(WeightsConfig(bucket_size_mb=0.01, quantization=sent),
                                [EngineClient(eng.url)], torch.device("cpu"), "127.0.0.1")
    sender.connect()
    stats = sender.send(list(fp8_stream(new.items())) if sent == "fp8" else list(new.items()), version=1)
    sender.close()
    c = EngineClient(eng.url)
    for name, w in new.items():
        got = torch.tensor(c.request("POST", "/get_weights_by_name", {"name": name, "truncate_size": 1 << 20}))
        if is_fp8_target(name, w):
            want = fp8.dequantize_ref(*fp8.quantize_ref(w))
            assert not torch.equal(want, w)  # the engine holds the FP8 values, not the fp32 ones
        else:
            want = w
        assert torch.equal(got, want.reshape(-1)), name
    fp32_bytes = sum(t.numel() * 4 for t in new.values())
    assert (stats["bytes"] < 0.6 * fp32_bytes) == (sent == "fp8"), stats
    assert c.weight_version() == 1


def test_fp8_engine_decodes_with_fp8_gemms(dense_dir):
    """engine.quantization=fp8: the projections hold e4m3 weights + block scales (half the bytes of
    bf16), the KV-cache decode matches a full forward of the same FP8 model, and its logprobs differ
    from the full-precision engine's by FP8's error: visibly, not wildly."""
    from test_engine import full_forward_logprobs, make_engine, run_all

    from pipeline.rollout.engine.core import Request, SamplingParams

    plain, low = make_engine(dense_dir), make_engine(dense_dir, quantization="fp8")
    params = dict(low.model.named_parameters())
    targets = [n for n, p in params.items() if p.dtype == fp8.FP8]
    assert targets and all(n + SCALE_SUFFIX in params for n in targets)
    assert params["lm_head.weight"].dtype == torch.float32 and params["model.embed_tokens.weight"].dtype == torch.float32
    outs = {}
    for name, engine in (("plain", plain), ("fp8", low)):
        reqs = [Request(p, SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True, sampling_seed=i))
                for i, p in enumerate([[5, 6, 7], [8, 9, 10, 11, 12], [14]])]
        run_all(engine, reqs)
        for r in reqs:
            ref = full_forward_logprobs(engine.model, r.input_ids, r.output_ids, 1.0)
            torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, rtol=0, atol=2e-5)
        outs[name] = reqs
    # Score the FP8 engine's tokens with the full-precision model: FP8's own error, nothing more.
    diffs = [(torch.tensor(r.output_logprobs) - full_forward_logprobs(plain.model, r.input_ids, r.output_ids, 1.0)).abs()
             for r in outs["fp8"]]
    worst = float(torch.cat(diffs).max())
    assert 1e-4 < worst < 0.3, worst


@pytest.mark.slow
def test_fp8_rollouts_train_with_tis_and_show_the_mismatch(tiny_recipe_run, tmp_path):
    """FP8 rollouts, fp32 training, TIS: the mismatch is visible in the metrics, the weight sync is a
    third of the fp32 bytes, and the run learns as the plain recipe of the same seed does (the shared
    tiny_recipe_run's first 30 steps: without TIS, whose weights are 1 to fp32 rounding there)."""
    from test_e2e import lockstep
    from pipeline.observability.metrics import read_metrics

    res = lockstep("run", "configs/tiny.yaml", f"run_dir={tmp_path}/fp8", "weights.quantization=fp8", "num_rollout=30",
                   "algo.off_policy_correction=tis", "eval.interval=0", "logging.plot=false", "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    plain, low = read_metrics(str(tiny_recipe_run[0]))[:30], read_metrics(f"{tmp_path}/fp8")
    assert len(low) == 30 == len(plain)
    def diff(rows):
        return sum(r["train/rollout_logprob_abs_diff"] for r in rows) / len(rows)

    assert diff(low) > 10 * diff(plain) and diff(low) > 1e-3  # FP8 rollouts, fp32 training: visible
    assert low[-1]["weights/bytes"] < 0.35 * plain[-1]["weights/bytes"]

    def reward(rows, sl):
        return sum(r["rollout/reward_mean"] for r in rows[sl]) / len(rows[sl])

    assert reward(low, slice(-5, None)) > reward(low, slice(0, 5)) + 0.05  # it learns
    assert reward(low, slice(-5, None)) > reward(plain, slice(-5, None)) - 0.05  # as well as without FP8


def test_fp8_config_conflicts_are_refused():
    from pipeline.config import load_config

    with pytest.raises(ConfigError, match="exclude each other"):
        load_config(os.path.join(REPO, "configs", "tiny.yaml"), ["weights.quantization=fp8",
                                                                 "determinism.true_on_policy=true"])
    with pytest.raises(ConfigError, match="engine.quantization=fp8"):
        load_config(os.path.join(REPO, "configs", "tiny.yaml"), ["weights.quantization=fp8", "engine.type=sglang"])
    with pytest.raises(ConfigError, match="engine.quantization=fp8 and determinism.true_on_policy"):
        load_config(os.path.join(REPO, "configs", "tiny.yaml"), ["engine.quantization=fp8", "determinism.true_on_policy=true"])


# ---- INT4 QAT ----------------------------------------------------------------------------------------

def test_int4_error_bound_grid_and_straight_through_gradient():
    from lockstep_kernels import int4

    w = weights_like_a_model((64, 128), seed=1).requires_grad_(True)
    q, s = int4.quantize(w, 32, torch.float32)
    assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7 and s.shape == (64, 4)
    back = int4.dequantize(q, s, 32)
    bound = s.repeat_interleave(32, 1) * 0.5 * (1 + 1e-5)  # half a step (the +7.5 end clamps to 7)
    assert ((back - w.detach()).abs() <= bound).all() and (back != w.detach()).any()
    fq = int4.fake_quant(w, 32, torch.float32)
    assert torch.equal(fq.detach(), back)
    c = torch.randn(64, 128)
    (fq * c).sum().backward()
    assert torch.equal(w.grad, c)  # straight through
    # bf16 scales: the scale used in training is the one a bf16 export stores
    _, s16 = int4.quantize(w, 32, torch.bfloat16)
    assert torch.equal(s16, s16.to(torch.bfloat16).float())


def test_int4_packing_matches_compressed_tensors():
    from lockstep_kernels import int4
    from test_sglang_contract import contract

    q = torch.randint(-8, 8, (6, 48), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    packed = int4.pack(q)
    assert packed.dtype == torch.int32 and packed.shape == (6, 6)
    assert torch.equal(int4.unpack(packed, q.shape), q)
    theirs = contract("int4_pack", {"q": q.tolist(), "packed": packed.tolist()})
    assert theirs["packed"] == packed.tolist()  # their packer gives our words
    assert theirs["unpacked"] == q.tolist()  # their unpacker reads our words back


@pytest.mark.slow
def test_int4_qat_recipe_trains_bit_exactly_and_exports_w4a16(tmp_path, engine_factory):
    """The recipe's first steps: the trainer (fake-quantized experts) and the engine (INT4 values by
    weight sync) agree bit for bit (the run asserts a zero logprob difference), the reward rises, and
    the export is a packed W4A16 checkpoint that loads back onto the INT4 grid and serves."""
    from test_e2e import lockstep
    from pipeline.models.hf_io import read_state_dict
    from pipeline.models.qat import is_int4_target
    from pipeline.observability.metrics import read_metrics

    run = tmp_path / "run"
    res = lockstep("run", "configs/tiny-moe-int4-qat.yaml", f"run_dir={run}", "num_rollout=40", "logging.plot=false",
                   "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(run))
    assert all(r["train/rollout_logprob_max_abs_diff"] == 0 for r in rows)
    first = sum(r["rollout/reward_mean"] for r in rows[:3]) / 3
    last = sum(r["rollout/reward_mean"] for r in rows[-3:]) / 3
    assert last > first + 0.1, (first, last)
    cfg = json.load(open(os.path.join(RunDir(run).hf_export, "config.json")))
    assert cfg["quantization_config"]["format"] == "pack-quantized"
    assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 16
    from safetensors.torch import load_file

    raw = load_file(os.path.join(RunDir(run).hf_export, "model.safetensors"))
    packed = [k for k in raw if k.endswith(".weight_packed")]
    assert packed and all(raw[k].dtype == torch.int32 for k in packed)
    dense = read_state_dict(RunDir(run).hf_export)
    experts = [k for k in dense if is_int4_target(k)]
    assert len(experts) == len(packed)
    for k in experts:  # each group is an integer multiple of its scale, within [-8, 7]
        w = dense[k].reshape(dense[k].shape[0], -1, 16)
        s = raw[k.removesuffix(".weight") + ".weight_scale"].float()[..., None]
        q = (w / s).round()
        assert ((w / s) - q).abs().max() < 1e-4 and q.min() >= -8 and q.max() <= 7
    eng = engine_factory(RunDir(run).hf_export)
    assert len(EngineClient(eng.url).generate([[5, 6]], [{"max_new_tokens": 2, "ignore_eos": True, "sampling_seed": 0}])[0].output_ids) == 2


@pytest.mark.slow
def test_int4_qat_on_megatron_experts_matches_fsdp(tmp_path):
    """INT4 QAT on the megatron backend (EP=2: each rank fake-quantizes its own experts' fc1/fc2) against
    FSDP2 on one rank: the same losses and rewards step by step; the engine, which gets the INT4
    values by weight sync, agrees with the trainer to fp32 rounding (with the fake quantiser
    off, the trainer is 6e-3 off); the export is packed W4A16."""
    from test_e2e import lockstep
    from pipeline.observability.metrics import read_metrics

    common = ["configs/tiny-moe-int4-qat.yaml", "rollout.rollout_batch_size=8", "train.global_batch_size=128",
              "determinism.true_on_policy=false", "num_rollout=3", "logging.plot=false", "--no-progress"]
    for name, extra in (("mg", ["train.backend=megatron", "train.num_gpus=2", "train.expert_model_parallel_size=2"]),
                        ("fsdp", [])):
        res = lockstep("run", *common, f"run_dir={tmp_path}/{name}", *extra)
        assert res.returncode == 0, res.stderr[-3000:]
    mg, fsdp = read_metrics(f"{tmp_path}/mg"), read_metrics(f"{tmp_path}/fsdp")
    for a, b in zip(mg, fsdp, strict=True):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4)
        assert a["train/rollout_logprob_max_abs_diff"] < 1e-5
    cfg = json.load(open(os.path.join(RunDir(tmp_path / "mg").hf_export, "config.json")))
    assert cfg["quantization_config"]["format"] == "pack-quantized"


@pytest.mark.slow
def test_int4_qat_on_a_dense_model_is_refused(tmp_path):
    from test_e2e import lockstep

    res = lockstep("run", "configs/tiny.yaml", f"run_dir={tmp_path}/run", "train.int4_qat=true", "num_rollout=1",
                   "--no-progress")
    assert res.returncode != 0 and "int4_qat quantizes MoE expert weights" in res.stderr
