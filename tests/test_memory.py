"""The per-GPU memory estimate (pipeline/config/memory.py) and the pre-flight check that refuses a run
which cannot fit, before anything starts."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch

from pipeline.config import config_from_dict, load_config
from pipeline.config.core import load_yaml
from pipeline.config import memory as M
from pipeline.errors import UserError
from pipeline.launch.prepare import check_memory
from pipeline.models.config import model_preset

from conftest import REPO
from pipeline.models.hf_config import write_hf_config

BENCH = os.path.join(REPO, "configs", "bench-0.5b.yaml")
H200 = 139.0  # GiB usable on one H200
ONE_GPU = M.Placement(trainer_gpu=True, engine_gpu=True, shared=True, engines_per_gpu=1)  # `lockstep run` on one GPU


def bench(*overrides: str):
    return load_config(BENCH, list(overrides))


def test_presets_have_the_real_shapes():
    a = model_preset("qwen3-4b", 100, None, 0, 0)
    assert (a.hidden_size, a.num_hidden_layers, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
            a.intermediate_size, a.vocab_size, a.tie_word_embeddings) == (2560, 36, 32, 8, 128, 9728, 151936, True)
    m = model_preset("qwen3-moe-small", 100, None, 0, 0)
    assert m.is_moe and m.moe_layers == list(range(m.num_hidden_layers)) and 8 <= m.num_hidden_layers <= 12
    assert (m.hidden_size, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.num_attention_heads,
            m.num_key_value_heads, m.head_dim, m.norm_topk_prob, m.tie_word_embeddings) == (
        2048, 128, 8, 768, 32, 4, 128, True, False)
    assert write_hf_config(m)["model_type"] == "qwen3_moe"


@pytest.mark.parametrize("preset", ["qwen3-4b", "qwen3-moe-small", "tiny-moe", "deepseek-v3-tiny", "deepseek-v3-small"])
def test_parameter_counts_match_the_module(preset):
    """The estimator's per-layer and root counts add up to the real module's parameters (built on the
    meta device: no memory)."""
    from pipeline.models.qwen3 import Qwen3ForCausalLM

    a = model_preset(preset, 151936, None, 0, 0, mtp_layers=1)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(a)
    real = sum(p.numel() for p in model.parameters())  # tied weights counted once
    counted = sum(sum(M.layer_params(a, i)) for i in range(a.num_hidden_layers)) + M.root_params(a) + M.mtp_params(a)
    assert counted == real


class _FlashLike(torch.autograd.Function):
    """Attention that keeps for backward what flash attention's varlen kernel keeps: q, k, v, the
    output and an fp32 log-sum-exp per query head (the CPU grid path keeps padded copies instead)."""

    @staticmethod
    def forward(ctx, q, k, v):
        rep = q.shape[1] // k.shape[1]
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1), v.repeat_interleave(rep, 1).transpose(0, 1),
            is_causal=True).transpose(0, 1).contiguous()
        lse = torch.zeros(q.shape[0], q.shape[1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, o, lse)
        return o


class _FlashCtx:
    def attend(self, layer_idx, q, k, v):
        return _FlashLike.apply(q, k, v)

    def attend_latent(self, layer_idx, q, latent, mla):
        """MLA through PackedCausal's grid path (its v head dim differs: no varlen kernel): the latent
        rows expanded, q / k / v scattered into the grid (copies), the output gathered back (a copy)."""
        k, v = mla.expand(latent)
        return _FlashLike.apply(q.clone(), k.clone(), v.clone()).clone()


@pytest.mark.parametrize("moe", [False, True])
def test_layer_activation_bytes_are_what_autograd_keeps(moe):
    """layer_activation_bytes against the tensors a bf16 decoder layer really saves for backward
    (parameters, the layer's input and the shared RoPE tables excluded; attention keeps flash's set)."""
    from pipeline.models.decoder_layer import DecoderLayer, MoeRouting
    from pipeline.models.rope import rope_cos_sin

    a = model_preset("tiny-dense", 100, None, 0, 0)
    a = dataclasses.replace(a, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            intermediate_size=352,
                            **(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96) if moe else {}))
    n = 97
    torch.manual_seed(0)
    layer = DecoderLayer(a, 0).to(torch.bfloat16)
    x = torch.randn(n, a.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(n), a, torch.bfloat16)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, cos, sin, _FlashCtx(), MoeRouting() if moe else None)
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {
        t.untyped_storage().data_ptr() for t in (x, cos, sin)}
    kept = sum(nbytes for ptr, nbytes in saved.items() if ptr not in skip)
    assert M.layer_activation_bytes(a, 0, 2) * n == pytest.approx(kept, rel=0.002)


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["mla-dense", "mla-moe"])
def test_deepseek_layer_activation_bytes_are_what_autograd_keeps(layer_idx):
    """The same for DeepSeek-V3 layers: MLA (q LoRA, latent row, expanded keys / values in the grid)
    and the DeepSeek MoE block (fp32 grouped router, routed and shared experts)."""
    from pipeline.models.decoder_layer import DecoderLayer, MoeRouting
    from pipeline.models.rope import rope_cos_sin

    a = dataclasses.replace(model_preset("deepseek-v3-tiny", 100, None, 0, 0), hidden_size=128, intermediate_size=352,
                            moe_intermediate_size=96, kv_lora_rank=48, q_lora_rank=40, v_head_dim=12, n_shared_experts=2)
    n = 97
    torch.manual_seed(0)
    layer = DecoderLayer(a, layer_idx).to(torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.1)
    x = torch.randn(n, a.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(n), a, torch.bfloat16)
    saved = {}

    def pack(t):
        if t.numel() != a.num_experts * a.hidden_size:  # the router's fp32 copy of its weight: per layer
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, cos, sin, _FlashCtx(), MoeRouting() if layer_idx else None)
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {
        t.untyped_storage().data_ptr() for t in (x, cos, sin)}
    kept = sum(nbytes for ptr, nbytes in saved.items() if ptr not in skip)
    assert M.layer_activation_bytes(a, layer_idx, 2) * n == pytest.approx(kept, rel=0.002)


def test_the_4b_config_that_ran_out_of_memory_is_refused_naming_the_fixes():
    """qwen3-4b at the bench recipe's sizes, engine and trainer resident together on one H200, ran out
    of memory; the check refuses it with the settings that fit, the bigger saving first."""
    with pytest.raises(UserError) as e:
        M.check(bench("model.init=qwen3-4b"), ONE_GPU, H200)
    msg = str(e.value)
    assert msg.startswith("qwen3-4b on one 139 GiB GPU needs ~") and "resident together" in msg
    assert "engine.colocated=true" in msg and "train.recompute_activations=true" in msg
    assert msg.index("train.recompute_activations") < msg.index("engine.colocated")  # the bigger saving first
    assert "train.max_tokens_per_gpu to <=" in msg and "train.check_memory=false" in msg
    assert "\n" not in msg


def test_the_4b_config_fits_colocated_with_recompute():
    est = M.check(bench("model.init=qwen3-4b", "engine.colocated=true", "train.recompute_activations=true"), ONE_GPU, H200)
    assert est.total < H200 * M.GIB


@pytest.mark.parametrize("preset", ["qwen3-0.5b", "qwen3-1.7b"])
def test_the_bench_recipe_fits_one_h200(preset):
    est = M.check(bench(f"model.init={preset}"), ONE_GPU, H200)
    assert est.total < H200 * M.GIB
    assert "per GPU" in est.line() and "\n" not in est.line()


def test_deepseek_v3_small_has_real_widths_and_fits_colocated_with_recompute():
    """DeepSeek-V3's widths (the experts' intermediate size excepted: see pipeline/models/config.py) in a
    dense and two MoE layers; it fits one H200 with 10% to spare colocated with recompute, a fourth layer
    would not; its KV cache is the latent's (kv_lora_rank + rope dims per token and layer); the real
    expert width's AdamW states alone would take half the GPU."""
    a = model_preset("deepseek-v3-small", 100, None, 0, 0)
    assert (a.hidden_size, a.num_attention_heads, a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim,
            a.v_head_dim, a.num_experts, a.num_experts_per_tok, a.n_group, a.topk_group, a.n_shared_experts,
            a.intermediate_size, a.vocab_size, a.moe_layers) == (
        7168, 128, 1536, 512, 128, 64, 128, 256, 8, 8, 4, 1, 18432, 129280, [1, 2])
    assert write_hf_config(a)["model_type"] == "deepseek_v3"
    cfg = bench("model.init=deepseek-v3-small", "engine.colocated=true", "train.recompute_activations=true")
    est = M.check(cfg, ONE_GPU, H200)
    assert est.total < 0.9 * H200 * M.GIB
    one_more = dataclasses.replace(M.model_args(cfg), num_hidden_layers=4)
    assert M.estimate(cfg, ONE_GPU, H200, one_more).total > 0.9 * H200 * M.GIB
    assert est.engine.kv_cache == 3 * 256 * (512 + 64) * (256 + 512) * 2  # layers x slots x row x context x bf16
    real_experts = dataclasses.replace(M.model_args(cfg), moe_intermediate_size=2048)
    assert M.estimate(cfg, ONE_GPU, H200, real_experts).trainer.optimizer > H200 * M.GIB / 2


def test_the_moe_preset_fits_with_room_when_colocated_with_recompute():
    est = M.check(bench("model.init=qwen3-moe-small", "engine.colocated=true", "train.recompute_activations=true"),
                  ONE_GPU, H200)
    # The preset's layer count is the most that keeps ~8% of the card for the estimate's error (which
    # has been on the safe side: 124 GiB estimated, 95 measured for its trainer on the H200).
    assert est.total < 0.92 * H200 * M.GIB
    one_more = dataclasses.replace(M.model_args(bench("model.init=qwen3-moe-small")),
                                   num_hidden_layers=model_preset("qwen3-moe-small", 1, None, 0, 0).num_hidden_layers + 1)
    cfg = bench("model.init=qwen3-moe-small", "engine.colocated=true", "train.recompute_activations=true")
    assert M.estimate(cfg, ONE_GPU, H200, one_more).total > 0.95 * H200 * M.GIB


def _trainer(cfg, layers=None):
    a = M.model_args(cfg)
    if layers:
        a = dataclasses.replace(a, num_hidden_layers=layers)
    return M.trainer_memory(a, cfg)


def test_components_scale_as_the_code_allocates():
    cfg = bench("model.init=qwen3-1.7b")
    t10, t20, t40 = (_trainer(cfg, n) for n in (10, 20, 40))
    for field in ("weights", "grads", "optimizer", "activations"):  # linear (affine) in layers
        assert getattr(t40, field) - getattr(t20, field) == pytest.approx(2 * (getattr(t20, field) - getattr(t10, field)))
    assert t10.logits == t40.logits  # the LM head does not depend on depth
    assert t10.optimizer == pytest.approx(2 * t10.weights) and t10.grads == t10.weights  # fp32 AdamW, fp32 grads
    a = M.model_args(cfg)
    kv = [M.engine_memory(a, bench("model.init=qwen3-1.7b", f"engine.max_running_requests={r}"), H200 * M.GIB).kv_cache
          for r in (64, 128, 256)]
    assert kv[1] == 2 * kv[0] and kv[2] == 4 * kv[0]
    # 28 layers x 2 (k, v) x 8 KV heads x 128 x 2 bytes per token, 256 slots of 256 + 512 positions
    assert kv[2] == 28 * 2 * 8 * 128 * 2 * 256 * 768
    full, recompute = _trainer(cfg), _trainer(bench("model.init=qwen3-1.7b", "train.recompute_activations=true"))
    assert recompute.activations < full.activations / 5
    assert (recompute.weights, recompute.logits) == (full.weights, full.logits)
    tokens = [_trainer(bench("model.init=qwen3-1.7b", f"train.max_tokens_per_gpu={n}")) for n in (4096, 8192)]
    assert tokens[1].activations == pytest.approx(2 * tokens[0].activations)
    assert tokens[1].logits == pytest.approx(2 * tokens[0].logits)
    two = _trainer(bench("model.init=qwen3-1.7b", "train.num_gpus=2"))
    assert two.optimizer == pytest.approx(full.optimizer / 2) and two.activations == full.activations  # FSDP shards state


def test_reference_critic_and_entropy_add_what_they_load():
    base = _trainer(bench("model.init=qwen3-1.7b"))
    ref = _trainer(bench("model.init=qwen3-1.7b", "algo.kl_loss_coef=0.01"))
    assert ref.reference == pytest.approx(base.weights)  # an fp32 copy, nothing else
    ppo = _trainer(bench("model.init=qwen3-1.7b", "algo.advantage_estimator=ppo"))
    assert ppo.weights == pytest.approx(2 * base.weights, rel=0.01) and ppo.activations == pytest.approx(2 * base.activations)
    ent = _trainer(bench("model.init=qwen3-1.7b", "algo.entropy_coef=0.01"))
    v, n = 151936, 16384  # one more bf16 gradient of the logits, and one chunk's fp32 temporaries
    assert ent.logits - base.logits == pytest.approx(1.1 * (2 * n + M.ENTROPY_BYTES * M.ENTROPY_CHUNK_ROWS) * v)


def test_colocated_engines_sleep_while_the_trainer_trains():
    cfg = bench("model.init=qwen3-1.7b")
    together = M.estimate(cfg, ONE_GPU, H200)
    colocated = M.estimate(bench("model.init=qwen3-1.7b", "engine.colocated=true"), ONE_GPU, H200)
    t, e = together.trainer, together.engine
    assert together.total == t.peak + e.peak
    assert colocated.total == max(t.peak + e.idle, t.resident + e.peak) < together.total
    apart = M.estimate(cfg, M.Placement(True, True, shared=False), H200)  # hetjob: GPUs of their own
    assert apart.total == max(t.peak, e.peak)
    two_engines = M.estimate(cfg, M.Placement(True, True, True, engines_per_gpu=2), H200)
    assert two_engines.total == t.peak + 2 * e.peak


def sglang_bench(*overrides: str):
    data = load_yaml(BENCH)
    data["engine"] = {"type": "sglang", "max_running_requests": data["engine"]["max_running_requests"]}
    return config_from_dict(data, list(overrides))


def test_sglang_engines_take_their_fraction_of_the_gpu():
    e = M.estimate(sglang_bench("model.init=qwen3-1.7b", "engine.mem_fraction_static=0.5"), ONE_GPU, H200).engine
    assert e.weights + e.kv_cache == pytest.approx(0.5 * H200 * M.GIB)
    with pytest.raises(UserError) as err:  # 0.8 of the GPU beside a trainer cannot fit
        M.check(sglang_bench("model.init=qwen3-1.7b"), ONE_GPU, H200)
    assert "engine.colocated=true" in str(err.value)


def test_placements():
    cfg = bench()
    assert M.local_placement(cfg, gpu_visible=False) == M.Placement(True, True, True, 1)  # bench pins device: cuda
    tiny = load_config(os.path.join(REPO, "configs", "tiny.yaml"), ["engine.num_engines=2"])
    assert M.local_placement(tiny, gpu_visible=False) == M.Placement(False, False, False, 2)
    assert M.local_placement(tiny, gpu_visible=True) == M.Placement(True, True, True, 2)  # all engines on GPU 0
    het = load_config(os.path.join(REPO, "configs", "cluster-example.yaml"))
    p = M.slurm_placement(het, gpus=True)
    assert p.trainer_gpu and not p.shared
    colo = load_config(os.path.join(REPO, "configs", "cluster-example.yaml"), ["slurm.mode=colocated"])
    assert M.slurm_placement(colo, gpus=True).shared
    assert not M.slurm_placement(colo, gpus=False).trainer_gpu


def test_a_cpu_run_is_not_checked():
    cfg = load_config(os.path.join(REPO, "configs", "tiny.yaml"),
                      ["train.device=cpu", "engine.device=cpu", "train.gpu_memory_gib=0.001"])
    check_memory(cfg)  # nothing on a GPU: no estimate, no error


def test_a_gpu_run_is_checked_against_the_given_memory():
    check_memory(bench("train.gpu_memory_gib=139"))
    with pytest.raises(UserError, match="qwen3-0.5b on one 10 GiB GPU needs"):
        check_memory(bench("train.gpu_memory_gib=10"))
    check_memory(bench("train.gpu_memory_gib=10", "train.check_memory=false"))  # the opt-out


def test_unknown_gpu_memory_skips_the_check_with_a_warning(caplog):
    from pipeline.launch.slurm.profile import load_profile

    profile = load_profile("generic-nvidia")
    assert profile.gpu_memory_gib is None
    cfg = load_config(os.path.join(REPO, "configs", "cluster-example.yaml"), ["model.init=qwen3-4b"])
    with caplog.at_level(logging.WARNING, logger="lockstep.launch"):
        check_memory(cfg, profile)
    assert "GPU memory check skipped" in caplog.text and "gpu_memory_gib" in caplog.text
    check_memory(cfg, dataclasses.replace(profile, gpu_memory_gib=80.0))  # 16 trainer GPUs shard the 4B's state
    with pytest.raises(UserError, match="qwen3-4b on each 24 GiB GPU needs"):
        check_memory(cfg, dataclasses.replace(profile, gpu_memory_gib=24.0))


def test_engine_constants_follow_the_engine():
    import inspect

    from pipeline.rollout.engine.core import Engine

    assert inspect.signature(Engine.__init__).parameters["max_prefill_tokens"].default == M.ENGINE_PREFILL_TOKENS


def test_cli_refuses_in_one_line_before_creating_the_run_dir(tmp_path):
    from test_config import run_cli

    run_dir = tmp_path / "run"
    res = run_cli("run", "configs/bench-0.5b.yaml", "model.init=qwen3-4b", "train.gpu_memory_gib=139", f"run_dir={run_dir}")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("lockstep: error: qwen3-4b on one 139 GiB GPU needs ~")
    assert "engine.colocated=true" in lines[0] and "train.recompute_activations=true" in lines[0]
    assert not run_dir.exists()
