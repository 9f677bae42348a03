"""Weight sync throughput: a full update trainer -> engine, against the device's measured copy bandwidth.

Colocated path (trainer and engine on one GPU): the FSDP2 trainer's `full_state` (bf16 gather of each
parameter, what Trainer.sync_weights sends) staged on the device, then the engine's `load_weights`
applies the whole version at once under its model lock (that is the engine's pause), as the
receiver does with the last bucket. Then the same update into a real engine server in another
process, through the two transports a run can use there: weights.type=tensor (CUDA IPC handles of the
exported buckets, /update_weights_from_tensor) and a gloo broadcast through host memory (what one GPU
shared by trainer and engine needed before). Distributed (NCCL broadcast between GPUs) needs two
GPUs: issue 12's run. The host copy kept for catching up restarted engines (weights.keep_host_copy) is
timed too, as the extra cost it adds to a step.

    python bench/weight_sync_bench.py            # GPU, 0.5B and 1.7B-class
    python bench/weight_sync_bench.py --tiny     # CPU-sized variant (shared memory instead of CUDA IPC)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from bench.common import copy_bandwidth, qwen3_0p5b, qwen3_1p7b, sync, write  # noqa: E402
from pipeline.models.config import model_preset  # noqa: E402
from pipeline.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from pipeline.config.schema import WeightsConfig  # noqa: E402
from pipeline.run import wait_for  # noqa: E402
from pipeline.models.hf_io import save_model  # noqa: E402
from pipeline.models.tokenizer import build_tiny_tokenizer  # noqa: E402
from pipeline.rollout.client import EngineClient  # noqa: E402
from pipeline.rollout.engine.core import Engine  # noqa: E402
from pipeline.weights.base import make_transport  # noqa: E402
from pipeline.trainer.fsdp import full_state, shard  # noqa: E402


def measure(args, device, dtype, reps=5) -> dict:
    """Best of `reps` for each path. flat: the weight sync's export (flat buckets in the forward's
    dtype) applied by the engine as span copies; per_param: a gather of each parameter in fp32, cast,
    applied by one multi-tensor copy (the path before flat buckets)."""
    torch.manual_seed(0)
    trainer = shard(Qwen3ForCausalLM(args).to(device), init_device_mesh(device.type, (1,)), dtype)
    engine = Engine(Qwen3ForCausalLM(args).to(device=device, dtype=dtype), max_running=1, context_length=64,
                    eos_token_ids=[0], device=device, dtype=dtype)
    nbytes = sum(t.numel() * t.element_size() for _, t in full_state(trainer, args, dtype))
    paths = {"flat": lambda: dict(full_state(trainer, args, dtype)),
             "per_param": lambda: {n: t.to(dtype) for n, t in full_state(trainer, args, None)}}
    out = {"bytes": nbytes}
    for name, export in paths.items():
        best = {"update_s": float("inf"), "pause_s": float("inf"), "export_s": float("inf")}
        for _ in range(reps):
            sync(device)
            t0 = time.perf_counter()
            staged = export()  # what the engine's receiver stages, bucket by bucket
            sync(device)
            t1 = time.perf_counter()
            engine.load_weights(staged, 1)  # applied at once, under the model lock: the engine's pause
            sync(device)
            t2 = time.perf_counter()
            best = {"update_s": min(best["update_s"], t2 - t0), "pause_s": min(best["pause_s"], t2 - t1),
                    "export_s": min(best["export_s"], t1 - t0)}
            del staged
        out[name] = best
    ref = {n: t.clone() for n, t in full_state(trainer, args, None)}
    out["engine_equals_trainer"] = all(torch.equal(p, ref[n].to(dtype)) for n, p in engine.model.named_parameters())
    t0 = time.perf_counter()
    host = [(n, t.to("cpu", copy=True)) for n, t in full_state(trainer, args, dtype)]
    out["host_copy_s"] = time.perf_counter() - t0
    del host, trainer, engine
    return out


def measure_process(args, device, dtype, reps=5) -> dict:
    """Best of `reps` full updates from this process's FSDP2 trainer into an engine server process on the
    same device, per transport (the sender's own stats: export, send, engine apply, answers)."""
    torch.manual_seed(0)
    trainer = shard(Qwen3ForCausalLM(args).to(device), init_device_mesh(device.type, (1,)), dtype)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        tok = os.path.join(tmp, "tok")
        build_tiny_tokenizer(tok)
        state = dict(full_state(trainer, args, dtype))
        save_model(state, args, os.path.join(tmp, "model"), tokenizer_dir=tok)
        want = state.pop("model.norm.weight").float().cpu().tolist()
        del state
        ready = os.path.join(tmp, "engine.json")
        log = open(os.path.join(tmp, "engine.log"), "wb")
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.rollout.engine.server", "--model-path",
                                 os.path.join(tmp, "model"), "--device", device.type, "--dtype", str(dtype).split(".")[1],
                                 "--context-length", "64", "--max-running-requests", "1", "--disable-cuda-graph",
                                 "--ready-file", ready], stdout=log, stderr=subprocess.STDOUT)

        def alive():
            if proc.poll() is not None:
                sys.exit(open(os.path.join(tmp, "engine.log")).read()[-3000:])

        try:
            client = EngineClient(wait_for(ready, 300, alive)["url"], timeout_s=120)
            for transport, backend in (("tensor", "auto"), ("broadcast", "gloo")):
                cfg = WeightsConfig(type=transport, backend=backend, keep_host_copy=False, timeout_s=120)
                sender = make_transport(cfg, [client], device, "127.0.0.1")
                sender.connect()
                best = float("inf")
                for rep in range(reps):
                    sync(device)
                    t0 = time.perf_counter()
                    stats = sender.send(full_state(trainer, args, dtype), version=rep + 1)
                    best = min(best, time.perf_counter() - t0)
                sender.close()
                norm = client.request("POST", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": -1})
                out[transport] = {"update_s": best, "bytes": stats["bytes"], "buckets": stats["buckets"],
                                  "engine_messages": stats.get("engine_messages"),
                                  "engine_equals_trainer": norm == want and client.weight_version() == reps}
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()
    del trainer
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="tcp://127.0.0.1:29556",
                            rank=0, world_size=1)
    bw = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 26) / 2  # bytes copied per second
    configs = ([("tiny-dense", model_preset("tiny-dense", 64, None, 0, None))] if a.tiny
               else [("0.5B", qwen3_0p5b()), ("1.7B", qwen3_1p7b())])
    rows = []
    print(f"device copy: {bw / 1e9:.0f} GB/s (bytes copied per second). An update cast from fp32 master weights"
          " reads 2 bytes per byte it writes: its ceiling is 2/3 of that.")
    for name, args in configs:
        m = measure(args, device, dtype)
        m["process"] = measure_process(args, device, dtype)
        flat, old = m["flat"], m["per_param"]
        rate = m["bytes"] / flat["update_s"]
        rows.append({"config": name, **m, "gbs": rate / 1e9, "copy_gbs": bw / 1e9, "frac_of_copy": rate / bw,
                     "apply_frac_of_copy": m["bytes"] / flat["pause_s"] / bw,
                     "speedup_vs_per_param": old["update_s"] / flat["update_s"]})
        print(f"{name:>6}: {m['bytes'] / 1e9:5.2f} GB | flat buckets {flat['update_s'] * 1e3:6.2f} ms = {rate / 1e9:6.1f} GB/s"
              f" ({100 * rate / bw:4.1f}% of copy; export {flat['export_s'] * 1e3:.2f} ms, engine paused"
              f" {flat['pause_s'] * 1e3:.2f} ms = {100 * m['bytes'] / flat['pause_s'] / bw:4.1f}% of copy)"
              f" | per parameter {old['update_s'] * 1e3:6.2f} ms (paused {old['pause_s'] * 1e3:.2f} ms)"
              f" | {old['update_s'] / flat['update_s']:.1f}x | engine == trainer: {m['engine_equals_trainer']}"
              f" | host copy for restarts +{m['host_copy_s'] * 1e3:.0f} ms", flush=True)
        ipc, gloo = m["process"]["tensor"], m["process"]["broadcast"]
        rows[-1].update({"ipc_frac_of_copy": m["bytes"] / ipc["update_s"] / bw,
                         "ipc_speedup_vs_gloo": gloo["update_s"] / ipc["update_s"]})
        print(f"{'':>6}  engine process: {'CUDA IPC' if device.type == 'cuda' else 'shared memory'} handles"
              f" {ipc['update_s'] * 1e3:6.2f} ms = {m['bytes'] / ipc['update_s'] / 1e9:6.1f} GB/s"
              f" ({100 * m['bytes'] / ipc['update_s'] / bw:4.1f}% of copy) | gloo broadcast {gloo['update_s'] * 1e3:7.2f} ms"
              f" | {gloo['update_s'] / ipc['update_s']:.1f}x | engine == trainer: {ipc['engine_equals_trainer']}"
              f" / {gloo['engine_equals_trainer']} | engine: {'; '.join(ipc['engine_messages'] or [])}", flush=True)
    dist.destroy_process_group()
    payload = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "rows": rows,
               "torch": torch.__version__}
    print("wrote", write("weight_sync_tiny" if a.tiny else "weight_sync", payload))
    return payload


if __name__ == "__main__":
    main()
