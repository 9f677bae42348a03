"""The shared model against Hugging Face transformers, and HF checkpoint loading/saving."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pipeline.models.attention import PackedCausal
from pipeline.models.config import model_preset
from pipeline.models.hf_io import load_model, read_state_dict, save_model
from pipeline.models.decoder_layer import MoeRouting
from pipeline.models.tokenizer import load_tokenizer
from pipeline.models.hf_config import read_hf_config, write_hf_config

transformers = pytest.importorskip("transformers")


def ours_logits(model, ids_BT):
    b, t = ids_BT.shape
    ctx = PackedCausal.from_lengths([t] * b)
    with torch.no_grad():
        out = model(ids_BT.flatten(), ctx.positions, ctx, logits_at_M=torch.arange(b * t))
    return out.view(b, t, -1)


@pytest.mark.parametrize("which", ["dense_dir", "moe_dir"])
def test_logits_match_transformers(which, request):
    path = request.getfixturevalue(which)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    _, ours = load_model(path)
    ids = torch.randint(0, ours.args.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    got = ours_logits(ours, ids)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_packed_sequences_equal_separate_forwards(moe_dir):
    _, m = load_model(moe_dir)
    seqs = [torch.randint(0, m.args.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 11, 3)]
    packed = torch.cat(seqs)
    ctx = PackedCausal.from_lengths([len(s) for s in seqs])
    with torch.no_grad():
        out = m(packed, ctx.positions, ctx, logits_at_M=torch.arange(len(packed)))
        alone = torch.cat([ours_logits(m, s[None])[0] for s in seqs])
    torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)


def test_transformers_checkpoint_loads_into_ours(tmp_path):
    """A directory written by transformers' save_pretrained (what users download) loads into our module."""
    cfg = transformers.Qwen3MoeConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    _, ours = load_model(str(tmp_path / "hf"))
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours_logits(ours, ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_sharded_save_roundtrip_bit_exact(dense_dir, tmp_path):
    args, m = load_model(dense_dir)
    save_model(m.state_dict(), args, str(tmp_path / "sharded"), tokenizer_dir=dense_dir, max_shard_bytes=20_000)
    files = os.listdir(tmp_path / "sharded")
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    a, b = read_state_dict(dense_dir), read_state_dict(str(tmp_path / "sharded"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tied_embeddings_roundtrip(tmp_path):
    from conftest import make_model_dir

    path = make_model_dir(str(tmp_path / "tied"), "tiny-dense", tie=True)
    args, m = load_model(path)
    assert args.tie_word_embeddings and m.lm_head.weight is m.model.embed_tokens.weight
    assert "lm_head.weight" not in read_state_dict(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(0, args.vocab_size, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(ours_logits(m, ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_config_json_roundtrip(dense_dir, moe_dir):
    for path in (dense_dir, moe_dir):
        raw = json.load(open(os.path.join(path, "config.json")))
        args = read_hf_config(raw)
        assert read_hf_config(write_hf_config(args)) == args
    # transformers-5-style rope_parameters are read too
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    del raw["rope_theta"]
    assert read_hf_config(raw).rope_theta == 5e5


def test_unsupported_architecture_is_a_clear_error():
    from pipeline.errors import UserError

    with pytest.raises(UserError, match="model_type 'mistral' is not supported"):
        read_hf_config({"model_type": "mistral"})


def test_routing_record_and_replay(moe_dir):
    _, m = load_model(moe_dir)
    ids = torch.randint(0, m.args.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    ctx = PackedCausal.from_lengths([12])
    with torch.no_grad():
        rec = MoeRouting(record=True)
        base = m(ids, ctx.positions, ctx, rec, logits_at_M=torch.arange(12))
        trace = torch.stack(rec.recorded, 1)  # [N, L, k]
        assert trace.shape == (12, len(m.args.moe_layers), m.args.num_experts_per_tok)
        rep = MoeRouting(trace_NLk=trace, replay=True)
        again = m(ids, ctx.positions, ctx, rep, logits_at_M=torch.arange(12))
        assert torch.equal(base, again) and sum(int(x) for x in rep.mismatch) == 0
        # Replaying different experts changes the output and is counted as a mismatch.
        other = (trace + 1) % m.args.num_experts
        rep2 = MoeRouting(trace_NLk=other, replay=True)
        changed = m(ids, ctx.positions, ctx, rep2, logits_at_M=torch.arange(12))
        assert not torch.equal(base, changed) and sum(int(x) for x in rep2.mismatch) > 0


def test_tokenizer_loads_like_a_real_one(dense_dir):
    tok = load_tokenizer(dense_dir)
    hf_tok = transformers.AutoTokenizer.from_pretrained(dense_dir)
    text = "3+4=7"
    assert tok.encode(text) == hf_tok(text, add_special_tokens=False).input_ids
    assert tok.eos_token_id == hf_tok.eos_token_id
    assert tok.decode(tok.encode(text) + [tok.eos_token_id]) == text
    assert "<|im_start|>user" in tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_lockstep_packages_shadow_no_installed_distribution():
    """Lockstep's top-level packages are its own names: a package another installed distribution also
    provides would be shadowed by ours. (Lockstep's kernels were `kernels`, which is Hugging Face's
    kernel-hub package: transformers 5.25 imports it, and failed with ours in its place.)"""
    import importlib.metadata as md

    providers = md.packages_distributions()
    for name in ("pipeline", "lockstep_kernels"):
        assert set(providers.get(name, ["lockstep"])) <= {"lockstep"}, (name, providers[name])
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3 import modeling_qwen3  # noqa: F401  (imports its hub-kernels integration)

    assert transformers.AutoConfig.for_model("qwen3").model_type == "qwen3"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_run_grouped_as_one_index_add_per_expert(dtype):
    """run_experts (one host read of the per-expert counts per layer) computes, forward and backward, bit
    for bit what one index_add per expert computed (one device sync per expert: 85 s of decode per step
    for a 128-expert model on the H200)."""
    from pipeline.models.decoder_layer import SparseMoeBlock, default_route
    from pipeline.models.layers import run_experts

    args = model_preset("tiny-moe", 100, None, 0, 0)
    torch.manual_seed(0)
    block = SparseMoeBlock(args).to(dtype)
    x = torch.randn(37, args.hidden_size, dtype=dtype, requires_grad=True)
    idx, w = default_route(block.gate(x), block.top_k, block.norm_topk)
    ref = torch.zeros_like(x)
    for e, expert in enumerate(block.experts):
        tok, slot = torch.where(idx == e)
        if tok.numel():
            ref = ref.index_add(0, tok, (expert(x[tok]) * w[tok, slot, None]).to(dtype))
    out = run_experts(block.experts, x, idx, w)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    params = [x, *block.experts.parameters()]
    got = torch.autograd.grad(out, params, g, retain_graph=True, allow_unused=True)
    want = torch.autograd.grad(ref, params, g, allow_unused=True)
    assert all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(got, want))


def test_entropy_in_row_chunks_equals_the_whole():
    """Chunked entropy (fp32 temporaries of 1024 rows at a time, recomputed in backward) gives the
    whole-batch values and gradients: a 16384 x 151936 micro-batch's entropy took 40 GB at once."""
    from pipeline.models.logprobs import entropy

    logits = torch.randn(300, 50, dtype=torch.float64).to(torch.bfloat16).requires_grad_()
    whole = entropy(logits, 0.7, chunk_rows=10_000)
    chunked = entropy(logits, 0.7, chunk_rows=64)
    assert torch.equal(whole, chunked)
    g = torch.randn_like(whole)
    (gw,) = torch.autograd.grad(whole, logits, g)
    (gc,) = torch.autograd.grad(chunked, logits, g)
    assert torch.equal(gw, gc)
    with torch.no_grad():
        assert torch.equal(entropy(logits, 0.7, chunk_rows=64), whole)
