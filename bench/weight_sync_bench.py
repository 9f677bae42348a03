"""Weight sync throughput: a full update trainer -> engine, against the device's measured copy bandwidth.

Colocated path (trainer and engine on one GPU): the FSDP2 trainer's `full_state` (bf16 gather of each
parameter, what Trainer.sync_weights sends) staged on the device, then the engine's `load_weights`
applies the whole version at once under its model lock (that is the engine's pause), as the
receiver does with the last bucket. Distributed (NCCL broadcast
between GPUs) needs two GPUs: issue 12's run. The host copy kept for catching up restarted engines
(weights.keep_host_copy) is timed too, as the extra cost it adds to a step.

    python bench/weight_sync_bench.py            # GPU, 0.5B and 1.7B-class
    python bench/weight_sync_bench.py --tiny     # CPU-sized variant
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from bench.common import copy_bandwidth, qwen3_0p5b, qwen3_1p7b, sync, write  # noqa: E402
from pipeline.models.config import tiny_preset  # noqa: E402
from pipeline.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from pipeline.rollout.engine.core import Engine  # noqa: E402
from pipeline.trainer.fsdp import full_state, shard  # noqa: E402


def measure(args, device, dtype, reps=3) -> dict:
    torch.manual_seed(0)
    trainer = shard(Qwen3ForCausalLM(args).to(device), init_device_mesh(device.type, (1,)), dtype)
    engine = Engine(Qwen3ForCausalLM(args).to(device=device, dtype=dtype), max_running=1, context_length=64,
                    eos_token_ids=[0], device=device, dtype=dtype)
    nbytes = sum(t.numel() * t.element_size() for _, t in full_state(trainer, args, dtype))
    best = {"update_s": float("inf"), "pause_s": float("inf"), "host_copy_s": float("inf")}
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        staged = dict(full_state(trainer, args, dtype))  # what the engine's receiver stages, bucket by bucket
        sync(device)
        t1 = time.perf_counter()
        engine.load_weights(staged, "1")  # applied at once, under the model lock: the engine's pause
        sync(device)
        t2 = time.perf_counter()
        best["update_s"] = min(best["update_s"], t2 - t0)
        best["pause_s"] = min(best["pause_s"], t2 - t1)
        del staged
        t0 = time.perf_counter()
        host = [(n, t.to("cpu", copy=True)) for n, t in full_state(trainer, args, dtype)]
        best["host_copy_s"] = min(best["host_copy_s"], time.perf_counter() - t0)
        del host
    del trainer, engine
    return {"bytes": nbytes, **best}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="tcp://127.0.0.1:29556",
                            rank=0, world_size=1)
    bw = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 26) / 2  # bytes copied per second
    configs = ([("tiny-dense", tiny_preset("tiny-dense", 64, None, 0, None))] if a.tiny
               else [("0.5B", qwen3_0p5b()), ("1.7B", qwen3_1p7b())])
    rows = []
    for name, args in configs:
        m = measure(args, device, dtype)
        rate = m["bytes"] / m["update_s"]
        rows.append({"config": name, **m, "gbs": rate / 1e9, "copy_gbs": bw / 1e9, "frac_of_copy": rate / bw})
        print(f"{name:>10}: {m['bytes'] / 1e9:6.2f} GB in {m['update_s'] * 1e3:8.1f} ms = {rate / 1e9:7.1f} GB/s "
              f"({100 * rate / bw:5.1f}% of the {bw / 1e9:.0f} GB/s device copy); engine paused "
              f"{m['pause_s'] * 1e3:.1f} ms; host copy for restarts +{m['host_copy_s'] * 1e3:.1f} ms", flush=True)
    dist.destroy_process_group()
    payload = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "rows": rows,
               "torch": torch.__version__}
    print("wrote", write("weight_sync_tiny" if a.tiny else "weight_sync", payload))
    return payload


if __name__ == "__main__":
    main()
