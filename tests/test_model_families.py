"""Model families beside Qwen3 / Qwen3-MoE (Qwen2 / Qwen2.5, Llama 3.x) and RoPE scaling, against
transformers' own classes on checkpoints transformers wrote; the strict config.json reader; the
megatron conversion of the new families; whole true on-policy runs on transformers-written checkpoints."""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import pytest
import torch

from pipeline.errors import UserError
from pipeline.models.config import ModelArgs
from parity import hf_model, ours_logits, write_random_checkpoint
from pipeline.models.hf_io import load_model, read_state_dict, save_model
from pipeline.run import RunDir
from pipeline.models.hf_config import read_hf_config, write_hf_config

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
YARN_TUNED = {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 16, "beta_fast": 16,
              "beta_slow": 2, "truncate": False, "mscale": 2.0, "mscale_all_dim": 1.0}
LINEAR = {"rope_type": "linear", "factor": 2.0}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def hf_checkpoint(path: str, model_type: str, rope: dict | None = None, legacy: str | None = None, seed: int = 0,
                  tokenizer: bool = False, **overrides) -> str:
    """A tiny checkpoint written by transformers' save_pretrained, with random weights (biases and norms
    too, so one that is not applied shows). `legacy` ("type" or "rope_type") rewrites its RoPE the way
    transformers 4 wrote it: a top-level rope_theta and `rope_scaling` with the type under that key.
    `tokenizer` adds Lockstep's tiny tokenizer (for whole runs)."""
    from pipeline.models.tokenizer import build_tiny_tokenizer

    kw = dict(TINY, **(MOE if model_type == "qwen3_moe" else {}), **overrides)
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    if rope is not None:
        cfg.rope_parameters = {"rope_theta": 10_000.0, **rope}
    write_random_checkpoint(cfg, path, seed)
    if legacy:
        file = os.path.join(path, "config.json")
        raw = json.load(open(file))
        params = raw.pop("rope_parameters")
        raw["rope_theta"] = params.pop("rope_theta")
        params[legacy] = params.pop("rope_type")
        raw["rope_scaling"] = params if params[legacy] != "default" else None
        json.dump(raw, open(file, "w"), indent=2)
    if tokenizer:
        build_tiny_tokenizer(path)
    return path




# (model_type, rope, legacy form, config overrides). Positions run to 60, past the original 16, where
# every scaling changes the table.
CASES = {
    "qwen2": ("qwen2", None, None, {}),
    "qwen2.5-yarn-legacy-type": ("qwen2", YARN, "type", {}),  # the Qwen2.5 long-context recipe's config
    "qwen2-linear-legacy-type": ("qwen2", LINEAR, "type", {}),
    "qwen2-tied": ("qwen2", None, None, dict(tie_word_embeddings=True)),
    "llama3": ("llama", None, None, {}),
    "llama3.1-rope": ("llama", LLAMA3, "rope_type", {}),  # as Llama 3.1 / 3.2 ship it
    "llama-rope_parameters": ("llama", LLAMA3, None, {}),  # as transformers 5 writes it
    "llama-biases": ("llama", None, None, dict(attention_bias=True, mlp_bias=True)),
    "llama-dynamic": ("llama", DYNAMIC, None, {}),
    "qwen3-yarn": ("qwen3", YARN, None, {}),
    "qwen3-yarn-tuned-legacy": ("qwen3", YARN_TUNED, "type", {}),
    "qwen3-bias-yarn-factor": ("qwen3", dict(YARN, attention_factor=1.25), None, dict(attention_bias=True)),
    "qwen3_moe-yarn": ("qwen3_moe", YARN, "rope_type", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_transformers_and_exports_reloadable(case, tmp_path):
    """Logits equal transformers' (fp32); the RoPE table and cos/sin factor are transformers' bit for
    bit; the export is loaded by transformers' AutoModelForCausalLM with the same logits, and its
    config.json keeps the family and the RoPE scaling in the form it was read in."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pipeline.models.rope import inv_freq

    model_type, rope, legacy, overrides = CASES[case]
    path = hf_checkpoint(str(tmp_path / "in"), model_type, rope, legacy, **overrides)
    hf = hf_model(path)
    args, ours = load_model(path)
    assert args.model_type == model_type
    ids = torch.randint(0, TINY["vocab_size"], (2, 60), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(ours_logits(ours, ids), ref, rtol=1e-5, atol=2e-5)
    if rope is not None:
        want, want_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf.config, None)
        got, got_scale = inv_freq(args)
        assert torch.equal(got, want) and got_scale == want_scale
        assert args.rope_scaling.rope_type == rope["rope_type"]

    save_model(ours.state_dict(), args, str(tmp_path / "out"), tokenizer_dir=None)
    back = hf_model(str(tmp_path / "out"))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, rtol=1e-5, atol=2e-5)
    written, read = (json.load(open(tmp_path / d / "config.json")) for d in ("out", "in"))
    assert written["model_type"] == model_type and written["architectures"] == read["architectures"]
    for key in ("rope_scaling", "rope_parameters", "rope_theta"):
        assert written.get(key) == read.get(key), key
    assert read_hf_config(written) == args


def test_legacy_rope_type_key_was_the_silent_case(tmp_path):
    """The transformers 4 form `"rope_scaling": {"type": "yarn", ...}` is YaRN, not default RoPE: the
    logits differ visibly from the same weights with plain RoPE, and ours follow transformers."""
    scaled = hf_checkpoint(str(tmp_path / "yarn"), "qwen2", YARN, legacy="type")
    plain = hf_checkpoint(str(tmp_path / "plain"), "qwen2")
    ids = torch.randint(0, TINY["vocab_size"], (1, 60), generator=torch.Generator().manual_seed(2))
    a, b = ours_logits(load_model(scaled)[1], ids), ours_logits(load_model(plain)[1], ids)
    assert (a - b).abs().max() > 0.1
    with torch.no_grad():
        torch.testing.assert_close(a, hf_model(scaled)(ids).logits, rtol=1e-5, atol=2e-5)


def test_moe_family_is_qwen3_or_deepseek_only():
    with pytest.raises(UserError, match="Qwen3-MoE and DeepSeek-V3 families only"):
        ModelArgs(**TINY, family="llama", **MOE)


# ---- the strict reader -------------------------------------------------------------------------

# config.json files as the public checkpoints ship them (values abridged to what the reader looks at).
QWEN25_7B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064}
R1_DISTILL_QWEN_1_5B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 1536, "initializer_range": 0.02, "intermediate_size": 8960,
    "max_position_embeddings": 131072, "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 12,
    "num_hidden_layers": 28, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.44.0",
    "use_cache": True, "use_mrope": False, "use_sliding_window": False, "vocab_size": 151936}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}
LLAMA31_8B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256}
LLAMA32_1B = dict(LLAMA31_8B_INSTRUCT, head_dim=64, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  eos_token_id=128001, tie_word_embeddings=True,
                  rope_scaling=dict(LLAMA31_8B_INSTRUCT["rope_scaling"], factor=32.0))
QWEN25_YARN = dict(QWEN25_7B_INSTRUCT, rope_scaling={"factor": 4.0, "original_max_position_embeddings": 32768,
                                                     "type": "yarn"})
REAL = {"Qwen2.5-7B-Instruct": QWEN25_7B_INSTRUCT, "DeepSeek-R1-Distill-Qwen-1.5B": R1_DISTILL_QWEN_1_5B,
        "Qwen3-8B": QWEN3_8B, "Qwen3-30B-A3B": QWEN3_30B_A3B, "Llama-3.1-8B-Instruct": LLAMA31_8B_INSTRUCT,
        "Llama-3.2-1B": LLAMA32_1B, "Qwen2.5-7B-Instruct+YaRN": QWEN25_YARN}


@pytest.mark.parametrize("name", list(REAL))
def test_public_configs_are_read_and_written_back(name):
    raw = REAL[name]
    args = read_hf_config(copy.deepcopy(raw))
    assert args.model_type == raw["model_type"]
    assert args.qk_norm == (raw["model_type"].startswith("qwen3")) and args.qkv_bias == (raw["model_type"] == "qwen2")
    written = write_hf_config(args)
    assert read_hf_config(written) == args
    assert written["rope_scaling"] == raw.get("rope_scaling") and written["rope_theta"] == raw["rope_theta"]
    assert written["eos_token_id"] == raw["eos_token_id"]  # a list stays a list (Llama 3.1's three)
    theirs = transformers.AutoConfig.for_model(**{k: v for k, v in written.items() if k != "architectures"})
    scaling = raw.get("rope_scaling") or {}
    assert theirs.rope_parameters["rope_type"] == scaling.get("rope_type", scaling.get("type", "default"))


def _edit(base: dict, **changes) -> dict:
    out = copy.deepcopy(base)
    for k, v in changes.items():
        if v is _DROP:
            out.pop(k, None)
        else:
            out[k] = v
    return out


_DROP = object()
REFUSED = [
    (_edit(QWEN3_8B, hidden_act="gelu"), "config.json: hidden_act='gelu' is not implemented"),
    (_edit(QWEN3_8B, use_sliding_window=True, sliding_window=4096,
           layer_types=["full_attention"] * 30 + ["sliding_attention"] * 6),
     "use_sliding_window=true with sliding_window=4096 on layers 30..35"),
    (_edit(QWEN25_7B_INSTRUCT, use_sliding_window=True, max_window_layers=20), "sliding_window=131072 on layers 20..27"),
    (_edit(QWEN3_30B_A3B, use_sliding_window=True, sliding_window=4096), "on layers 0..47"),
    (_edit(QWEN3_8B, attention_dropout=0.1), "attention_dropout=0.1 is not implemented"),
    (_edit(QWEN3_8B, rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}),
     "rope_scaling rope_type='longrope' is not implemented"),
    (_edit(QWEN3_8B, rope_scaling={"type": "fancy", "factor": 2.0}), "rope_type='fancy' is not implemented"),
    (_edit(QWEN3_8B, rope_scaling={"rope_type": "yarn", "factor": 4.0, "mrope_section": [16, 24, 24]}),
     "rope_scaling mrope_section=[16, 24, 24]: not read by rope_type 'yarn'"),
    (_edit(QWEN3_8B, rope_scaling={"rope_type": "linear"}), "rope_type 'linear' needs factor"),
    (_edit(QWEN3_8B, partial_rotary_factor=0.5), "partial_rotary_factor=0.5 is not implemented"),
    (_edit(QWEN3_8B, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
           rope_scaling=_DROP, rope_theta=_DROP), "partial_rotary_factor=0.25"),
    (_edit(QWEN3_8B, quantization_config={"quant_method": "awq", "bits": 4}), "quant_method='awq'"),
    (_edit(R1_DISTILL_QWEN_1_5B, use_mrope=True), "use_mrope=True: multimodal RoPE"),
    (_edit(QWEN25_7B_INSTRUCT, attention_bias=False), "attention_bias=False: not a field Lockstep implements for"
                                                      " model_type 'qwen2'"),
    (_edit(QWEN3_8B, num_experts=8), "num_experts=8: not a field"),
    (_edit(QWEN3_8B, auto_map={"AutoModelForCausalLM": "modeling_x.X"}), "auto_map="),
    (_edit(LLAMA31_8B_INSTRUCT, sliding_window=4096), "sliding_window=4096: not a field Lockstep implements for"
                                                      " model_type 'llama'"),
    (_edit(QWEN3_8B, pruned_heads={"0": [1]}), "pruned_heads="),
    (_edit(QWEN3_8B, layer_types=["full_attention"] * 35 + ["linear_attention"]), "layer_types=['full_attention'"),
    (_edit(QWEN3_8B, model_type="mistral"), "model_type 'mistral' is not supported"),
]


@pytest.mark.parametrize("cfg,fragment", REFUSED, ids=[f[1][:40] for f in REFUSED])
def test_fields_lockstep_does_not_implement_are_refused_by_name(cfg, fragment):
    with pytest.raises(UserError) as e:
        read_hf_config(cfg)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_harmless_fields_are_accepted_and_kept():
    cfg = _edit(QWEN25_7B_INSTRUCT, _name_or_path="Qwen/Qwen2.5-7B-Instruct", temperature=0.7, top_p=0.8,
                layer_types=["full_attention"] * 20 + ["sliding_attention"] * 8)  # sliding switched off
    args = read_hf_config(cfg)
    # switched on, but on no layer: max_window_layers (28) >= num_hidden_layers (28)
    read_hf_config(_edit(QWEN25_7B_INSTRUCT, use_sliding_window=True))
    written = write_hf_config(args)
    assert written["temperature"] == 0.7 and written["layer_types"] == cfg["layer_types"]
    assert written["use_sliding_window"] is False and "_name_or_path" not in written


def test_defaults_are_transformers_defaults():
    """A field config.json leaves out takes the value transformers' config class gives it."""
    from pipeline.models.hf_config import DEFAULTS

    for model_type, defaults in DEFAULTS.items():
        cls = type(transformers.AutoConfig.for_model(model_type))
        instance = cls()
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in defaults.items():
            if key == "rope_theta":
                theirs = cls.default_theta
            elif key not in fields:  # not a field: the modelling code derives it (head_dim)
                assert value is None, (model_type, key)
                continue
            elif fields[key].default is None and value is not None:  # set in __post_init__ (mlp_only_layers)
                theirs = getattr(instance, key)
            else:
                theirs = fields[key].default
            assert theirs == value, (model_type, key, theirs, value)


def test_dynamic_rope_refuses_sequences_past_max_position_embeddings(tmp_path):
    path = hf_checkpoint(str(tmp_path / "dyn"), "llama", DYNAMIC)
    args, _ = load_model(path)
    args.check_context_length(64, "context")
    with pytest.raises(UserError, match="rope_type 'dynamic' with context 65 > max_position_embeddings"):
        args.check_context_length(65, "context")


@pytest.mark.parametrize("model_type,edit,extra,fragment", [
    ("qwen2", dict(hidden_act="gelu"), [], "lockstep: error: config.json: hidden_act='gelu' is not implemented"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, layer_types=["full_attention", "sliding_attention"]), [],
     "lockstep: error: config.json: use_sliding_window=true with sliding_window=8 on layer 1"),
    ("qwen2", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), [],
     "lockstep: error: rope_scaling rope_type 'dynamic' with data.max_prompt_len + rollout.rollout_max_response_len"
     " 258 > max_position_embeddings (64)"),
    ("llama", dict(mlp_bias=True), ["train.backend=megatron"],
     "lockstep: error: train.backend=megatron does not support mlp_bias=true"),
])
def test_cli_refuses_before_anything_starts(model_type, edit, extra, fragment, tmp_path):
    from test_config import run_cli

    path = hf_checkpoint(str(tmp_path / "m"), model_type, tokenizer=True)
    raw = json.load(open(os.path.join(path, "config.json")))
    json.dump(dict(raw, **edit), open(os.path.join(path, "config.json"), "w"))
    res = run_cli("run", "configs/tiny.yaml", f"model.path={path}", f"run_dir={tmp_path}/run", *extra)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(fragment), res.stderr
    assert not os.path.exists(RunDir(tmp_path / "run").log_file("engine_0"))


# ---- megatron ------------------------------------------------------------------------------------

MEGATRON = {"qwen2-yarn": ("qwen2", YARN, "type"), "llama-llama3": ("llama", LLAMA3, "rope_type")}


@pytest.fixture(scope="module")
def megatron_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mg-families")
    return {name: hf_checkpoint(str(root / name), mt, rope, legacy, seed=3) for name, (mt, rope, legacy) in MEGATRON.items()}


@pytest.mark.parametrize("name", list(MEGATRON))
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_conversion_round_trips(name, tp, megatron_dirs):
    """q/k/v biases fuse per query group like the weights (TP splits whole groups); no q/k norms."""
    from pipeline.trainer.megatron.convert import fuse_qkv, to_hf, to_megatron

    args, model = load_model(megatron_dirs[name])
    hf = dict(model.state_dict())
    shards = [[to_megatron(hf, args, t, tp) for t in range(tp)]]
    assert not any("layernorm" in k and "self_attention" in k for k in shards[0][0])
    if args.qkv_bias:
        p = "model.layers.0.self_attn."
        fused = fuse_qkv(*(hf[p + n + "_proj.bias"] for n in "qkv"), args)
        d, per = args.head_dim, args.num_attention_heads // args.num_key_value_heads
        assert torch.equal(fused[(per + 2) * d:(per + 2) * d + per * d], hf[p + "q_proj.bias"][per * d:2 * per * d])
        parts = [s["decoder.layers.0.self_attention.linear_qkv.bias"] for s in shards[0]]
        assert torch.equal(torch.cat(parts), fused) and len(parts[0]) == len(fused) // tp
    back = to_hf(shards, args)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.slow
def test_megatron_logits_equal_ours(megatron_dirs, tmp_path):
    """megatron's GPTModel with q/k/v biases (split over TP=2), no q/k norm and Lockstep's RoPE table
    (YaRN's cos/sin factor included) gives our logits, and its weights gather back exactly. (Llama's
    table reaches megatron the same way; one spawned run keeps the test short.)"""
    import dist_helpers
    from test_megatron import our_logits

    path, tp = megatron_dirs["qwen2-yarn"], 2
    _, ours = load_model(path)
    out = tmp_path / "out.pt"
    dist_helpers.spawn(dist_helpers.megatron_logits, tp, str(tmp_path / "init"), path, str(out), tp, 1, False)
    got = torch.load(out)
    torch.testing.assert_close(got["logits"], our_logits(ours), rtol=0, atol=2e-5)
    assert got["state"].keys() == ours.state_dict().keys()
    assert all(torch.equal(got["state"][k], v) for k, v in ours.state_dict().items())


def test_megatron_refuses_biases_it_cannot_express():
    from pipeline.errors import ConfigError
    from pipeline.config.validate import check_megatron_model

    check_megatron_model(read_hf_config(QWEN25_7B_INSTRUCT))
    with pytest.raises(ConfigError, match="attention_bias=true on model_type 'llama' .o_proj bias., mlp_bias=true"):
        check_megatron_model(read_hf_config(_edit(LLAMA31_8B_INSTRUCT, attention_bias=True, mlp_bias=True)))


# ---- whole runs -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("model_type,rope,legacy,overrides", [
    ("qwen2", YARN, "type", dict(max_position_embeddings=128)),  # Qwen2.5-shaped, the YaRN recipe's config
    ("llama", LLAMA3, "rope_type", dict(max_position_embeddings=128, tie_word_embeddings=True)),  # Llama-3.2-shaped
])
def test_true_on_policy_run_on_a_transformers_checkpoint(model_type, rope, legacy, overrides, tmp_path):
    """`lockstep run` on a checkpoint transformers wrote: engine and trainer logprobs are equal bit for
    bit every step, and the exported policy is the same family, loads in transformers and keeps its
    RoPE scaling as written."""
    from test_e2e import lockstep

    from pipeline.observability.metrics import read_metrics

    path = hf_checkpoint(str(tmp_path / "ckpt"), model_type, rope, legacy, tokenizer=True, **overrides)
    run_dir = tmp_path / "run"
    res = lockstep("run", "configs/tiny.yaml", f"model.path={path}", "determinism.true_on_policy=true",
                   "num_rollout=3", f"run_dir={run_dir}", "rollout.rollout_batch_size=8",
                   "rollout.n_samples_per_prompt=4", "train.global_batch_size=32", "eval.interval=0",
                   "logging.plot=false", "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(run_dir))
    assert len(rows) == 3 and all(r["train/rollout_logprob_max_abs_diff"] == 0.0 for r in rows)
    written, read = (json.load(open(os.path.join(d, "config.json"))) for d in (RunDir(run_dir).hf_export, path))
    assert written["model_type"] == model_type and written["rope_scaling"] == read["rope_scaling"]
    hf = hf_model(RunDir(run_dir).hf_export)
    args, ours = load_model(RunDir(run_dir).hf_export)
    ids = torch.randint(0, TINY["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours_logits(ours, ids), hf(ids).logits, rtol=1e-5, atol=2e-5)
    trained, start = read_state_dict(RunDir(run_dir).hf_export), read_state_dict(path)
    assert any(not torch.equal(trained[k], start[k]) for k in start)
