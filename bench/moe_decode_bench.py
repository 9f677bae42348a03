"""MoE decode: the engine's stacked experts path (one grouped Triton launch per projection for every
expert, no host sync) vs the per-expert loop, on one MoE block of a real-size preset, side by side.

    PYTHONPATH=$PWD python3 bench/moe_decode_bench.py --out DIR      (a GPU; ~1-2 minutes)
    PYTHONPATH=$PWD python3 bench/moe_decode_bench.py --tiny --out DIR   (CPU: a tiny block, the checks only)

Checks, batch-invariant mode (set_batch_invariant(True), the true on-policy engine's), at M = 1, 8, 64,
128, 512 tokens routed by the block's own router: the grouped kernel's rows of each expert equal
bi_matmul on that expert's rows alone (gate, up and down), and the block's output through the stacked
path equals the loop's, bitwise. Timings (median ms per MoE block forward, router included) at decode
sizes, both modes: the loop (what the engine ran before: default mode cuBLAS per expert, batch-invariant
mode bi_linear per expert, one host read per layer), the stacked path eager, and the stacked path
replayed from a CUDA graph; ratios are loop / stacked. Last (Qwen3-MoE presets), a 2-layer model of the
preset's layers in a built-in engine, batch-invariant mode: decode through CUDA graphs equals every
step eager bitwise (tokens, logprobs, routed experts), and the engine's logprobs equal a trainer-side
forward's (experts unstacked: the per-expert loop) exactly. Writes moe_decode.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import lockstep_kernels as kernels  # noqa: E402
from pipeline.models.config import model_preset  # noqa: E402
from pipeline.models.flat import flatten_parameters  # noqa: E402
from pipeline.models.layers import _assignments  # noqa: E402

CHECK_TOKENS = (1, 8, 64, 128, 512)
TIME_TOKENS = (1, 8, 32, 64, 128, 256)


def build_block(preset: str, tiny: bool, device: str, dtype: torch.dtype):
    """(args, block): one MoE block of the preset (or of the tiny one), weights ~N(0, 0.02), laid out as
    the engine lays them (one flat buffer, experts stacked as views of it)."""
    if tiny:
        args = model_preset("deepseek-v3-tiny" if preset.startswith("deepseek") else "tiny-moe", 64, 1, 0, 0)
    else:
        args = model_preset(preset, 1000, 1, 0, 0)
    if args.is_mla:
        from pipeline.models.deepseek import DeepseekMoE as Block
    else:
        from pipeline.models.decoder_layer import SparseMoeBlock as Block
    with torch.device("meta"):
        block = Block(args)
    block = block.to(dtype).to_empty(device=device)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.zeros_like(p) if name.endswith("correction_bias") else
                    torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).to(dtype) * 0.02)
    flatten_parameters(block)
    assert block.experts.stack(cpu=device == "cpu"), "the block's experts did not stack"
    return args, block


def routed(block, x_ND):
    """(idx [N, k], weights [N, k]) as the block's router picks them."""
    if hasattr(block.gate, "top_k"):  # DeepSeek's TopkRouter
        return block.gate(x_ND, None, 0)
    from pipeline.models.decoder_layer import default_route

    return default_route(block.gate(x_ND), block.top_k, block.norm_topk)


def forward(block, x_ND, stacked: bool):
    saved = block.experts.stacked
    block.experts.stacked = saved if stacked else None
    try:
        return block(x_ND, None, 0)
    finally:
        block.experts.stacked = saved


def check_grouped_rows(block, x_ND) -> None:
    """Each expert's rows of bi_grouped_linear equal bi_matmul of those rows alone, for gate, up, down."""
    from lockstep_kernels.gpu.grouped_matmul import bi_grouped_linear
    from lockstep_kernels.gpu.matmul import bi_matmul

    s = block.experts.stacked
    idx, w = routed(block, x_ND)
    _, token_A, _, _ = _assignments(idx, w)
    counts = torch.bincount(idx.reshape(-1), minlength=s.gate_EID.shape[0]).tolist()
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=x_ND.device)
    x_AD = x_ND[token_A]
    gate, up = bi_grouped_linear(x_AD, s.gate_EID, offsets), bi_grouped_linear(x_AD, s.up_EID, offsets)
    h_AI = kernels.silu(gate) * up
    down = bi_grouped_linear(h_AI, s.down_EDI, offsets)
    bounds = offsets.tolist()
    for e, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        if hi == lo:
            continue
        for name, inp, out, w_NK in (("gate", x_AD, gate, s.gate_EID[e]), ("up", x_AD, up, s.up_EID[e]),
                                     ("down", h_AI, down, s.down_EDI[e])):
            alone = bi_matmul(inp[lo:hi].contiguous(), w_NK.t())
            assert torch.equal(out[lo:hi], alone), f"{name} rows of expert {e} differ from bi_matmul alone"


def timed(fn, device: str) -> float:
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t0) / 3 * 1e3


def graphed(fn, device: str):
    """fn captured in a CUDA graph (warmed up on a side stream first): a replay callable."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def engine_check(preset: str, tiny: bool, device: str, dtype: torch.dtype) -> dict:
    """A 2-layer model of the preset's layers in a built-in engine, batch-invariant mode: decode through
    CUDA graphs (MoE graphs need the stacked path) equals every step eager, tokens, logprobs and routed
    experts bitwise; and the engine's logprobs equal a trainer-side forward's (the per-expert loop,
    experts unstacked), the true on-policy property."""
    import dataclasses

    from pipeline.models.attention import PackedCausal
    from pipeline.models.layers import stack_experts, unstack_experts
    from pipeline.models.logprobs import token_logprobs
    from pipeline.models.qwen3 import Qwen3ForCausalLM
    from pipeline.rollout.engine.core import Engine, Request, SamplingParams

    args = model_preset("tiny-moe" if tiny else preset, 512, 1, 0, 0)
    args = dataclasses.replace(args, num_hidden_layers=2, vocab_size=512)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(args)
    model = model.to(dtype).to_empty(device=device)
    model.init_weights(0)

    def generate(graph_bs):
        engine = Engine(model, max_running=8, context_length=96, eos_token_ids=[0], device=torch.device(device),
                        dtype=dtype, cuda_graph_max_bs=graph_bs, grouped_experts=True)
        engine.capture_graphs()
        g = torch.Generator().manual_seed(0)
        reqs = [Request(torch.randint(1, 512, (3 + 5 * i,), generator=g).tolist(),
                        SamplingParams(max_new_tokens=24 - 2 * i, ignore_eos=True, sampling_seed=i),
                        return_routed_experts=True) for i in range(8)]
        for r in reqs:
            engine.submit(r)
        while engine.waiting or engine.running:
            engine.step()
        return engine, reqs

    out = {}
    with torch.inference_mode():
        kernels.set_batch_invariant(True)
        eager, want = generate(0)
        graphs, got = generate(8 if device == "cuda" else 0)
        out["stacked_moe_blocks"] = graphs.stacked_moe_blocks
        out["graph_replays"] = graphs.graphs.replays if graphs.graphs is not None else 0
        same = all(a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs
                   and torch.equal(torch.cat(a.routed), torch.cat(b.routed)) for a, b in zip(want, got))
        out["graphs_equal_eager"] = same
        unstack_experts(model)  # the trainer's forward: the per-expert loop
        seqs = [r.input_ids + r.output_ids for r in got]
        ctx = PackedCausal.from_lengths([len(s) for s in seqs], device=device)
        starts = torch.cumsum(torch.tensor([0] + [len(s) for s in seqs[:-1]]), 0)
        pos = torch.cat([st + torch.arange(len(r.input_ids) - 1, len(s) - 1) for st, r, s in zip(starts, got, seqs)])
        logits = model(torch.tensor([t for s in seqs for t in s], device=device), ctx.positions, ctx, None,
                       logits_at_M=pos.to(device))
        lp = token_logprobs(logits, torch.tensor([t for r in got for t in r.output_ids], device=device), 1.0)
        eng = torch.tensor([x for r in got for x in r.output_logprobs], device=device)
        out["engine_vs_trainer_max_abs_diff"] = float((lp - eng).abs().max())
        stack_experts(model)
        kernels.set_batch_invariant(False)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
    p.add_argument("--preset", default="qwen3-moe-small", choices=["qwen3-moe-small", "deepseek-v3-small"])
    p.add_argument("--tiny", action="store_true", help="a tiny block on the CPU (checks the script runs)")
    a = p.parse_args(argv)
    device = "cpu" if a.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    args, block = build_block(a.preset, a.tiny, device, dtype)
    d = args.hidden_size
    result = {"preset": a.preset, "tiny": a.tiny, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "dtype": str(dtype), "experts": args.num_experts, "top_k": args.num_experts_per_tok,
              "hidden": d, "expert_inner": args.moe_intermediate_size, "torch": torch.__version__,
              "checks": {}, "timings": [], "failures": []}
    gen = torch.Generator(device).manual_seed(1)

    def tokens(m):
        return torch.randn(m, d, generator=gen, device=device, dtype=torch.float32).to(dtype)

    with torch.inference_mode():
        kernels.set_batch_invariant(True)
        for m in CHECK_TOKENS:
            x = tokens(m)
            try:
                if device == "cuda":
                    check_grouped_rows(block, x)
                loop, fast = forward(block, x, False), forward(block, x, True)
                assert torch.equal(fast, loop), f"stacked path != loop (max diff {(fast - loop).abs().max().item()})"
                result["checks"][f"M={m}"] = "bitwise equal" + (" (grouped rows too)" if device == "cuda" else "")
            except AssertionError as e:
                result["checks"][f"M={m}"] = f"FAILED: {e}"
                result["failures"].append(f"check M={m}: {e}")
            print(f"check M={m}: {result['checks'][f'M={m}']}", flush=True)
        for mode in ("default", "batch_invariant"):
            kernels.set_batch_invariant(mode == "batch_invariant")
            for m in TIME_TOKENS if not a.tiny else (1, 8):
                x = tokens(m)
                row = {"mode": mode, "tokens": m,
                       "loop_ms": timed(lambda: forward(block, x, False), device),
                       "stacked_ms": timed(lambda: forward(block, x, True), device)}
                if mode == "default":
                    loop, fast = forward(block, x, False), forward(block, x, True)
                    row["rel_diff_vs_loop"] = ((fast.float() - loop.float()).norm() / loop.float().norm()).item()
                if device == "cuda":
                    try:
                        replay = graphed(lambda: forward(block, x, True), device)
                        row["graph_ms"] = timed(replay, device)
                        row["loop_over_graph"] = row["loop_ms"] / row["graph_ms"]
                    except Exception as e:  # reported: a host sync inside the path would end up here
                        row["graph_error"] = f"{type(e).__name__}: {e}"
                        result["failures"].append(f"graph {mode} M={m}: {row['graph_error']}")
                        traceback.print_exc()
                row["loop_over_stacked"] = row["loop_ms"] / row["stacked_ms"]
                result["timings"].append(row)
                print(json.dumps(row), flush=True)
        kernels.set_batch_invariant(False)
    if not a.preset.startswith("deepseek"):
        e = result["engine"] = engine_check(a.preset, a.tiny, device, dtype)
        print("engine:", json.dumps(e), flush=True)
        if not e["graphs_equal_eager"] or e["engine_vs_trainer_max_abs_diff"] != 0.0:
            result["failures"].append(f"engine check: {e}")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "moe_decode.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}; {len(result['failures'])} failure(s)")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
