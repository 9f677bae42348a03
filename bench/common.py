"""Shared bits of the benchmarks: timing, a ~0.5B Qwen3-style config, result files."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from pipeline.models.config import ModelArgs, model_preset  # noqa: E402


def qwen3_0p5b(vocab: int = 151936, layers: int = 24, moe: bool = False) -> ModelArgs:
    """The qwen3-0.5b preset (Qwen2.5-0.5B's shape: hidden 896, 14 heads, 2 kv heads, head dim 64) with
    EOS id 0, optionally fewer layers or MoE MLPs."""
    extra = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=1216) if moe else {}
    return replace(model_preset("qwen3-0.5b", vocab, None, 0, None), vocab_size=vocab, num_hidden_layers=layers, **extra)


def qwen3_1p7b(vocab: int = 151936) -> ModelArgs:
    return real_size("qwen3-1.7b", vocab)


def real_size(name: str, vocab: int = 151936) -> ModelArgs:
    """A real-size preset of model.init (qwen3-0.5b, qwen3-1.7b, qwen3-4b, qwen3-moe-small) with EOS id 0."""
    return replace(model_preset(name, vocab, None, 0, None), vocab_size=vocab)


def single_process_group(tiny: bool, port: int) -> torch.device:
    """A one-rank process group (NCCL on the GPU, gloo for --tiny or without one); returns the device."""
    import torch.distributed as dist

    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    return device


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def generate(model, prompts: list[list[int]], new: int, device, dtype, temperature: float = 1.0, k: int = 0,
             graphs: bool = True, quantization: str | None = None, overlap: bool = False,
             fused_sampling: bool = True):
    """(requests, seconds, engine): the built-in engine generates `new` tokens for every prompt in one
    batch (prefill included; ignore EOS), with `k` speculative draft tokens per step (0: plain).
    graphs: plain decode steps from CUDA graphs (on a GPU; captured before the clock starts), as a
    server runs them by default. overlap, fused_sampling: the engine's settings (engine.overlap_schedule,
    engine.sampling_backend=triton), defaults as a server's."""
    from pipeline.rollout.engine.core import Engine, Request, SamplingParams

    graph_bs = len(prompts) if graphs and torch.device(device).type == "cuda" else 0
    engine = Engine(model, max_running=len(prompts), context_length=len(prompts[0]) + new + 8, eos_token_ids=[0],
                    device=device, dtype=dtype, speculative_num_steps=k, cuda_graph_max_bs=graph_bs,
                    quantization=quantization, overlap=overlap, fused_sampling=fused_sampling)
    engine.capture_graphs()
    reqs = [Request(p, SamplingParams(max_new_tokens=new, temperature=temperature, ignore_eos=True, sampling_seed=i))
            for i, p in enumerate(prompts)]
    sync(device)
    t0 = time.perf_counter()
    for r in reqs:
        engine.submit(r)
    while engine.waiting or engine.running:
        engine.step()
    sync(device)
    return reqs, time.perf_counter() - t0, engine


def copy_bandwidth(device, nbytes: int) -> float:
    """Bytes moved per second by a device-to-device copy (each byte read once and written once: 2x)."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    for _ in range(2):
        y.copy_(x)
    sync(device)
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def bench(fn, warmup=5, rep=20) -> float:
    """Median milliseconds of fn() on the GPU (CUDA events via triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_ms(fn, calls: int, reps: int = 20) -> float:
    """Median device milliseconds per call of fn(i), i = 0..calls-1, all captured in one CUDA graph and
    replayed: no host launch cost, as the engine's decode graphs run. `bench` times each call between
    two events after an L2 flush, so a launch that costs the host more than the flush takes the GPU
    (tens of microseconds of Python) shows up as GPU time; at decode sizes that was most of a small
    kernel's `bench` time. The caller rotates its operands over i (separate weight copies) so the L2
    does not hold them from one call to the next, as in a decode step, where each layer reads its own."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compiles, autotuner-free launch caches, allocations: before capture
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return sorted(times)[reps // 2]


def cold_copies(t: torch.Tensor, l2_multiple: int = 3, most: int = 64) -> list[torch.Tensor]:
    """t and copies of it, together at least `l2_multiple` times the GPU's L2 (at most `most` tensors):
    operands for `graph_ms` that are not in the L2 when a call reads them."""
    l2 = getattr(torch.cuda.get_device_properties(t.device), "L2_cache_size", 50 << 20)
    n = max(1, min(most, -(-l2_multiple * l2 // (t.numel() * t.element_size()))))
    return [t] + [t.clone() for _ in range(n - 1)]


def wall_ms(fn, reps: int = 3) -> float:
    """Median wall-clock milliseconds of fn() (the CPU interpreter's runs of the probes; `bench` needs a GPU)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[reps // 2]


def write(name: str, payload) -> str:
    out = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    return path


def device_info() -> dict:
    p = torch.cuda.get_device_properties(0)
    return {"gpu": p.name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": __import__("triton").__version__}
