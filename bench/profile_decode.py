"""Where a built-in engine decode step spends its time: torch.profiler over a few steps.

    python bench/profile_decode.py [--batch 1] [--steps 20] [--spec 0]   # GPU (or CPU with --tiny)

Prints the ops with the most self CPU and self device time, and the wall time per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import qwen3_0p5b, sync  # noqa: E402
from pipeline.models.config import model_preset  # noqa: E402
from pipeline.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from pipeline.rollout.engine.core import Engine, Request, SamplingParams  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--spec", type=int, default=0, help="speculative draft tokens (0: plain decode)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (plain decode steps from Python)")
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args = model_preset("tiny-dense", 64, None, 0, None) if a.tiny else qwen3_0p5b()
    args = dataclasses.replace(args, mtp_num_hidden_layers=1 if a.spec else 0)
    with torch.device(device):
        model = Qwen3ForCausalLM(args)
    model.init_weights(0)
    model = model.to(dtype).eval().requires_grad_(False)
    engine = Engine(model, max_running=a.batch, context_length=512, eos_token_ids=[0], device=device, dtype=dtype,
                    speculative_num_steps=a.spec, cuda_graph_max_bs=0 if a.eager or device.type != "cuda" else a.batch)
    engine.capture_graphs()
    for i in range(a.batch):
        engine.submit(Request([1 + (j * 7) % (min(args.vocab_size, 1000) - 1) for j in range(64)], SamplingParams(max_new_tokens=400, ignore_eos=True, sampling_seed=i)))
    for _ in range(5):  # prefill + warm-up decode steps
        engine.step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        engine.step()
    sync(device)
    per_step = (time.perf_counter() - t0) / a.steps
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(a.steps):
            engine.step()
        sync(device)
    keys = prof.key_averages()
    print(f"wall per step: {per_step * 1e3:.2f} ms (batch {a.batch}, spec {a.spec}, "
          f"{'CUDA graphs' if engine.graphs is not None and device.type == 'cuda' else 'eager'})")
    print(keys.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    if device.type == "cuda":
        print(keys.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
        busy = sum(getattr(k, "self_device_time_total", 0) or 0 for k in keys) / a.steps / 1e3
        print(f"device busy per step: {busy:.2f} ms of {per_step * 1e3:.2f} ms wall ({100 * busy / (per_step * 1e3):.0f}%):"
              " the rest is the host (launches, sampling bookkeeping, the token read-back) with the GPU idle")


if __name__ == "__main__":
    main()
