"""Routed experts' two paths (pipeline/models/layers.py): the per-expert loop and the engine's stacked
path (one kernels.grouped_linear launch per projection over [E, N, K] views of the experts' weights)
give the same bits; the engine stacks its MoE blocks' weights and generates exactly as with the loop,
also after a weight update. The Triton kernel itself runs through the interpreter in
tests/test_kernels_triton.py (check `grouped_matmul`)."""

from __future__ import annotations

import pytest
import torch

import lockstep_kernels as kernels
from pipeline.models.flat import flatten_parameters
from pipeline.models.layers import (MLP, Experts, run_experts, run_experts_loop, run_experts_stacked, stack_experts,
                                    unstack_experts)


def make_experts(e=7, d=24, i=40, dtype=torch.float32, seed=0) -> Experts:
    torch.manual_seed(seed)
    experts = Experts(MLP(d, i) for _ in range(e)).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    return experts


def routing(n, k, e, w_dtype, seed=1):
    """n tokens, each to k distinct experts out of the first e - 2 (the last two get no tokens), with
    uneven counts; weights in w_dtype."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, e, generator=gen) * torch.linspace(1, 3, e)
    scores[:, -2:] = -1
    idx_Nk = scores.topk(k, dim=-1).indices
    w_Nk = torch.rand(n, k, generator=gen).to(w_dtype)
    return idx_Nk, w_Nk


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "bf16-fp32-weights"])
def test_stacked_path_equals_the_loop_bitwise(dtypes):
    """Same bits from both paths for uneven expert loads (experts with no tokens among them), 1 to 37
    tokens, Qwen3-MoE's routing-weight dtype (the model's) and DeepSeek's (fp32). In batch-invariant
    mode: on CPUs default mode's F.silu rounds an element by its place in the tensor (vectorised body,
    scalar tail; lockstep_kernels/torch_ref.py), and the paths apply it to tensors of different lengths."""
    dtype, w_dtype = dtypes
    experts = make_experts(dtype=dtype)
    assert experts.stack(cpu=True)
    with torch.no_grad(), kernels.batch_invariant_mode():
        for n in (1, 2, 5, 37):
            x = torch.randn(n, 24, generator=torch.Generator().manual_seed(n)).to(dtype)
            idx, w = routing(n, 3, 7, w_dtype, seed=n)
            loop = run_experts_loop(experts, x, idx, w)
            stacked = run_experts_stacked(experts.stacked, x, idx, w)
            assert stacked.dtype == loop.dtype == dtype
            assert torch.equal(stacked, loop), (n, (stacked - loop).abs().max())
            assert torch.equal(run_experts(experts, x, idx, w), loop)  # the dispatch takes the stacked path


def test_stacked_weights_share_the_experts_memory():
    """Stacking unflattened experts re-points each Linear at its slice; flattened ones (the engine's
    buffer) become strided views without a copy; in both, an in-place update of a Linear's weight is
    what the stacked tensor reads."""
    experts = make_experts()
    before = [m.up_proj.weight.detach().clone() for m in experts]
    assert experts.stack()
    s = experts.stacked
    assert [tuple(t.shape) for t in (s.gate_EID, s.up_EID, s.down_EDI)] == [(7, 40, 24), (7, 40, 24), (7, 24, 40)]
    assert all(torch.equal(s.up_EID[e], before[e]) for e in range(7))
    assert all(m.gate_proj.weight.data_ptr() == s.gate_EID[e].data_ptr() for e, m in enumerate(experts))

    flat_model = make_experts(seed=3)
    (flat,) = flatten_parameters(flat_model)
    assert flat_model.stack(cpu=True)
    s = flat_model.stacked
    assert s.gate_EID.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert s.gate_EID.stride() == (3 * 40 * 24, 24, 1)
    with torch.no_grad():
        flat_model[4].down_proj.weight.copy_(torch.full((24, 40), 0.5))
    assert torch.equal(s.down_EDI[4], torch.full((24, 40), 0.5))
    assert s.views_of(flat_model)
    flatten_parameters(flat_model)  # parameters replaced: the stacked tensors are stale, and the path says so
    assert not s.views_of(flat_model)
    with torch.no_grad(), pytest.raises(AssertionError, match="stale"):
        run_experts(flat_model, torch.randn(2, 24), *routing(2, 3, 7, torch.float32))


def test_the_loop_runs_with_grad_and_where_the_stacked_path_does_not_apply():
    """Training (grad on) keeps the loop and its gradients, for every expert (the unused-expert trick);
    FP8 or QAT (weight_transform) experts are not stacked."""
    experts = make_experts()
    assert experts.stack(cpu=True)
    x = torch.randn(4, 24, requires_grad=True)
    idx, w = routing(4, 2, 7, torch.float32)
    run_experts(experts, x, idx, w).square().sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in experts.parameters())
    qat = make_experts()
    qat[2].up_proj.weight_transform = lambda t: t
    assert not qat.stack() and qat.stacked is None
    fp8 = make_experts()
    fp8[0].down_proj.fp8 = True
    assert stack_experts(torch.nn.ModuleList([fp8, make_experts()])) == 1 and fp8.stacked is None


def _generate(engine, prompts, n_new=10):
    from pipeline.rollout.engine.core import Request, SamplingParams

    reqs = [Request(p, SamplingParams(max_new_tokens=n_new, temperature=0.9, ignore_eos=True, sampling_seed=i))
            for i, p in enumerate(prompts)]
    for r in reqs:
        engine.submit(r)
    while engine.waiting or engine.running:
        engine.step()
    return [(r.output_ids, r.output_logprobs) for r in reqs]


def _engine(model_dir):
    from pipeline.models.hf_io import load_model
    from pipeline.rollout.engine.core import Engine

    _, model = load_model(model_dir)
    return Engine(model, max_running=4, context_length=48, eos_token_ids=[0], device=torch.device("cpu"),
                  dtype=torch.float32, grouped_experts=True)


def _ds_dir(tmp_path):
    pytest.importorskip("transformers")
    from test_deepseek import ds_checkpoint

    return ds_checkpoint(str(tmp_path / "ds"), seed=3)


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3"])
def test_engine_with_stacked_experts_generates_as_with_the_loop_also_after_an_update(family, moe_dir, tmp_path):
    """A built-in engine stacks its MoE blocks' expert weights (views of its flat buffer); with the
    stacked path forced on the CPU it gives the loop engine's tokens and logprobs bit for bit, before
    and after a weight update (which reaches the stacked path: the outputs change, and still agree).
    Batch-invariant mode, as in the test above."""
    model_dir = moe_dir if family == "qwen3-moe" else _ds_dir(tmp_path)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [3, 4]]
    with kernels.batch_invariant_mode():
        loop, fast = _engine(model_dir), _engine(model_dir)
        blocks = len(loop.args.moe_layers)
        assert loop.stacked_moe_blocks == fast.stacked_moe_blocks == blocks > 0
        unstack_experts(loop.model)
        assert stack_experts(fast.model, cpu=True) == blocks
        (flat,) = fast.flat_weights
        experts = next(m for m in fast.model.modules() if isinstance(m, Experts))
        assert experts.stacked.gate_EID.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        before = _generate(loop, prompts)
        assert _generate(fast, prompts) == before
        gen = torch.Generator().manual_seed(5)
        update = {name: p.detach() + 0.05 * torch.randn(p.shape, generator=gen)
                  for name, p in loop.params.items() if ".experts." in name}
        for engine in (loop, fast):
            engine.load_weights(dict(update), version=1)
        after = _generate(loop, prompts)
        assert after != before
        assert _generate(fast, prompts) == after


def test_moe_engine_decodes_fixed_shape_steps_with_routing_records(moe_dir):
    """MoE engines whose experts stacked decode through the fixed-shape (CUDA-graph) steps: the same
    tokens, logprobs and routed experts as every step eager (batch-invariant mode: the padding rows
    join the experts' GEMMs); an FP8 engine's experts do not stack and it keeps every step eager."""
    from pipeline.models.hf_io import load_model
    from pipeline.rollout.engine.core import Engine, Request, SamplingParams

    def run(graph_bs, quantization=None):
        _, model = load_model(moe_dir)
        engine = Engine(model, max_running=4, context_length=48, eos_token_ids=[0], device=torch.device("cpu"),
                        dtype=torch.float32, cuda_graph_max_bs=graph_bs, quantization=quantization,
                        grouped_experts=True)
        reqs = [Request(p, SamplingParams(max_new_tokens=n, temperature=0.9, ignore_eos=True, sampling_seed=i),
                        return_routed_experts=i != 1)
                for i, (p, n) in enumerate([([5, 6, 7], 8), ([8, 9], 5), ([14], 8), ([3, 4, 5, 6], 3)])]
        for r in reqs:
            engine.submit(r)
        while engine.waiting or engine.running:
            engine.step()
        return engine, [(r.output_ids, r.output_logprobs, torch.cat(r.routed).tolist() if r.routed else None)
                        for r in reqs]

    with kernels.batch_invariant_mode():
        eager, want = run(0)
        fixed, got = run(4)  # buckets 1, 2, 4: three running requests decode padded to four
    assert eager.graphs is None and fixed.graphs is not None and fixed.graphs.replays > 0
    assert got == want
    assert want[0][2] is not None and len(want[0][2]) == 3 + 8 - 1 and want[1][2] is None
    fp8, _ = run(4, quantization="fp8")
    assert fp8.stacked_moe_blocks == 0 and fp8.graphs is None
