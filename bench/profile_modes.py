"""Where true on-policy mode's rollout loses time: the built-in engine's rollout in default and
batch-invariant mode side by side, one process, the same random weights.

    python bench/profile_modes.py [--preset qwen3-1.7b] [--batch 128] [--prompt 64] [--new 256] --out DIR
    python bench/profile_modes.py --tiny                                       # CPU: the launch only

Per mode: the rollout's wall time as the engine serves it (CUDA-graph decode, the same as `lockstep run`),
split into the prefill step and the decode steps; then a torch.profiler pass over a few eager decode
steps and one prefill, its device time per kernel and per kind (GEMM, attention, norm, sampling,
elementwise). Prints the ratios default / batch-invariant and writes profile_modes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import lockstep_kernels as kernels  # noqa: E402
from bench.common import real_size, sync  # noqa: E402
from pipeline.models.config import model_preset  # noqa: E402
from pipeline.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from pipeline.rollout.engine.core import Engine, Request, SamplingParams  # noqa: E402

KINDS = [  # (kind, kernel-name pattern), first match wins
    ("attention", r"attn|attention|flash|fmha|decode"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|matmul|_mm_|sm90_|wgmma|splitk|gemv"),
    ("norm", r"norm"),
    ("sampling", r"sampl|softmax|topk|sort|argmax|gumbel|exponential|philox"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, pat in KINDS if re.search(pat, low)), "elementwise/other")


def requests(n: int, prompt: int, new: int, vocab: int) -> list[Request]:
    return [Request([1 + (i * 131 + j * 7) % (min(vocab, 30000) - 1) for j in range(prompt)],
                    SamplingParams(max_new_tokens=new, ignore_eos=True, sampling_seed=i)) for i in range(n)]


def rollout(engine: Engine, reqs: list[Request], device: torch.device) -> dict:
    """Serve reqs to the end: the first step (the prefill of every request that fits) and the rest."""
    for r in reqs:
        engine.submit(r)
    sync(device)
    t0 = time.perf_counter()
    engine.step()
    sync(device)
    t1 = time.perf_counter()
    steps = 0
    while engine.num_active():
        engine.step()
        steps += 1
    sync(device)
    t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": steps, "total_s": t2 - t0}


def kernel_times(engine: Engine, reqs: list[Request], device: torch.device, steps: int) -> tuple[dict, dict]:
    """Device ms per kernel name and per kind: one prefill plus `steps` eager decode steps."""
    for r in reqs:
        engine.submit(r)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(1 + steps):
            engine.step()
        sync(device)
    engine.abort(abort_all=True)
    while engine.num_active():
        engine.step()
    per_kernel: dict[str, float] = {}
    for k in prof.key_averages():
        if getattr(k, "device_type", None) == torch.autograd.DeviceType.CUDA or (device.type == "cpu" and not k.cpu_children):
            t = (getattr(k, "self_device_time_total", 0) or 0) if device.type == "cuda" else k.self_cpu_time_total
            if t:
                per_kernel[k.key[:90]] = per_kernel.get(k.key[:90], 0.0) + t / 1e3
    per_kind: dict[str, float] = {}
    for name, ms in per_kernel.items():
        per_kind[kind_of(name)] = per_kind.get(kind_of(name), 0.0) + ms
    return per_kernel, per_kind


def run_mode(model, args, a, device, dtype, bi: bool) -> dict:
    kernels.set_batch_invariant(bi)
    try:
        ctx = a.prompt + a.new + 16
        graphs = Engine(model, max_running=a.batch, context_length=ctx, eos_token_ids=[0], device=device, dtype=dtype,
                        cuda_graph_max_bs=a.batch if device.type == "cuda" else 0, grouped_experts=args.is_moe)
        graphs.capture_graphs()
        rollout(graphs, requests(a.batch, a.prompt, 4, args.vocab_size), device)  # warm-up (compiles, caches)
        served = rollout(graphs, requests(a.batch, a.prompt, a.new, args.vocab_size), device)
        del graphs
        if device.type == "cuda":
            torch.cuda.empty_cache()
        eager = Engine(model, max_running=a.batch, context_length=ctx, eos_token_ids=[0], device=device, dtype=dtype,
                       cuda_graph_max_bs=0, grouped_experts=args.is_moe)
        rollout(eager, requests(a.batch, a.prompt, 4, args.vocab_size), device)
        per_kernel, per_kind = kernel_times(eager, requests(a.batch, a.prompt, a.new, args.vocab_size), device, a.profile_steps)
        del eager
        return {"served": served, "per_kind_ms": per_kind, "per_kernel_ms": per_kernel}
    finally:
        kernels.set_batch_invariant(False)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--preset", default="qwen3-1.7b")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join("bench", "results"))
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if a.tiny:
        args = model_preset("tiny-dense", 64, None, 0, None)
        a.batch, a.prompt, a.new, a.profile_steps = min(a.batch, 4), min(a.prompt, 8), min(a.new, 6), min(a.profile_steps, 2)
    else:
        args = real_size(a.preset)
    with torch.device(device):
        model = Qwen3ForCausalLM(args)
    model.init_weights(0)
    model = model.to(dtype).eval().requires_grad_(False)
    res = {"preset": "tiny-dense" if a.tiny else a.preset, "batch": a.batch, "prompt": a.prompt, "new": a.new,
           "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}
    for bi in (False, True):
        res["batch_invariant" if bi else "default"] = run_mode(model, args, a, device, dtype, bi)
    d, b = res["default"], res["batch_invariant"]
    print(f"{res['preset']} on {res['gpu']}: {a.batch} requests x {a.prompt} prompt + {a.new} new tokens")
    print("| served rollout | default s | batch-invariant s | default / batch-invariant |")
    print("|---|---|---|---|")
    for key in ("prefill_s", "decode_s", "total_s"):
        print(f"| {key[:-2]} | {d['served'][key]:.3f} | {b['served'][key]:.3f} | {d['served'][key] / max(b['served'][key], 1e-9):.2f}x |")
    print(f"\nprofiled: 1 prefill + {a.profile_steps} eager decode steps, device ms")
    print("| kind | default | batch-invariant | extra |")
    print("|---|---|---|---|")
    for kind in sorted(set(d["per_kind_ms"]) | set(b["per_kind_ms"])):
        x, y = d["per_kind_ms"].get(kind, 0.0), b["per_kind_ms"].get(kind, 0.0)
        print(f"| {kind} | {x:.2f} | {y:.2f} | {y - x:+.2f} |")
    for mode in ("default", "batch_invariant"):
        print(f"\ntop kernels, {mode} (device ms)")
        for name, ms in sorted(res[mode]["per_kernel_ms"].items(), key=lambda kv: -kv[1])[:14]:
            print(f"  {ms:9.2f}  [{kind_of(name)}] {name}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "profile_modes.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
