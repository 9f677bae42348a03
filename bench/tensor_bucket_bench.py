"""Colocated weight sync of a MoE: one handle per tensor vs one flattened bucket (weights.tensor_format).

The tensor list of qwen3-moe-small (Qwen3-30B-A3B's layer, 9 layers: 3,540 tensors, 3,456 of them
expert projections) goes from this process to a real built-in engine server process through
TensorTransport (weights.type=tensor), the same versions alternately per tensor and flattened, best
and median of --reps each. Every send is a fresh export (views of one buffer per bucket, as
fsdp.full_state gives them), so the shared-memory move on CPU is paid by both forms, as in a run.
Per form it also times the sender's serialization of one bucket alone (what torch's reductions cost
per handle) and collects the engine's "handles opened in" times. The engine's weights are checked
against the sent ones after each form (a sample of parameters, bit for bit).

    python bench/tensor_bucket_bench.py                 # CUDA when available: real widths (12.4 GB bf16)
    python bench/tensor_bucket_bench.py --device cpu    # CPU shared memory: same tensor count, widths scaled down

Writes bench/results/tensor_bucket_<device>.json ($OUT when set).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import sync, write  # noqa: E402
from pipeline.config.schema import WeightsConfig  # noqa: E402
from pipeline.models.config import model_preset  # noqa: E402
from pipeline.models.hf_io import save_model  # noqa: E402
from pipeline.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from pipeline.models.tokenizer import build_tiny_tokenizer  # noqa: E402
from pipeline.rollout import protocol, tensor_bucket  # noqa: E402
from pipeline.rollout.client import EngineClient  # noqa: E402
from pipeline.run import wait_for  # noqa: E402
from pipeline.weights.buckets import buckets_of  # noqa: E402
from pipeline.weights.receiver import load_named_tensors  # noqa: E402
from pipeline.weights.tensor import TensorTransport  # noqa: E402

FORMATS = ("per_tensor", "flattened")
# CPU: qwen3-moe-small's tensor list (layers, experts, names) at widths a 2-core machine holds twice.
CPU_WIDTHS = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                  moe_intermediate_size=64)


def moe_small(tmp: str, device: torch.device, scaled: bool):
    tok = build_tiny_tokenizer(os.path.join(tmp, "tok"))
    args = model_preset("qwen3-moe-small", tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    if scaled:
        args = dataclasses.replace(args, vocab_size=tok.vocab_size, **CPU_WIDTHS)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(args).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():  # on the device: no 6.2B-value host generator
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return tok, args, model


def export(model, bucket_bytes: int, scale: float) -> list[tuple[str, torch.Tensor]]:
    """A fresh export of the model's weights (x scale): views of one new buffer per bucket."""
    out = []
    with torch.no_grad():
        for bucket, _ in buckets_of(list(model.named_parameters()), bucket_bytes):
            buf = torch.empty(sum(p.numel() for _, p in bucket), dtype=torch.bfloat16, device=bucket[0][1].device)
            offset = 0
            for name, p in bucket:
                view = buf[offset: offset + p.numel()].view(p.shape)
                view.copy_(p).mul_(scale)
                out.append((name, view))
                offset += p.numel()
    return out


def one_bucket_s(named, fmt: str, reps: int = 10) -> dict:
    """Best seconds to build one bucket's body (torch's reductions: handles, events, ref counters), and
    on CPU to read it back as the engine does (a CUDA IPC handle cannot be opened by its own process)."""
    def body():
        if fmt == "per_tensor":
            return protocol.update_tensor_body(named)
        return protocol.update_flattened_bucket_body(*tensor_bucket.flatten(named))

    def best(fn):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    out = {"serialize_s": best(body)}
    if named[0][1].device.type == "cpu":
        sent = body()
        out["load_s"] = best(lambda: load_named_tensors(sent["serialized_named_tensors"][0], sent.get("load_format")))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--reps", type=int, default=5, help="updates per form (alternating); best and median reported")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="weights.bucket_size_mb (default: 512 on CUDA, as a run; 4 on CPU, ~as many buckets per byte)")
    p.add_argument("--real-widths", action="store_true", help="on CPU too (12.4 GB per copy)")
    a = p.parse_args(argv)
    device = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available()) else "cpu")
    scaled = device.type == "cpu" and not a.real_widths
    bucket_mb = a.bucket_mb or (512.0 if device.type == "cuda" else 4.0)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a crowded 2-core machine: no thread oversubscription with the engine
    with tempfile.TemporaryDirectory() as tmp:
        tok, args, model = moe_small(tmp, device, scaled)
        t0 = time.perf_counter()
        save_model({n: t for n, t in model.state_dict().items()}, args, os.path.join(tmp, "model"),
                   tokenizer_dir=os.path.join(tmp, "tok"))
        print(f"checkpoint written in {time.perf_counter() - t0:.1f}s", flush=True)
        ready, log_path = os.path.join(tmp, "engine.json"), os.path.join(tmp, "engine.log")
        log = open(log_path, "wb")
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.rollout.engine.server", "--model-path",
                                 os.path.join(tmp, "model"), "--device", device.type, "--dtype", "bfloat16",
                                 "--context-length", "64", "--max-running-requests", "1", "--disable-cuda-graph",
                                 "--ready-file", ready], stdout=log, stderr=subprocess.STDOUT)

        def alive():
            if proc.poll() is not None:
                sys.exit(open(log_path).read()[-3000:])

        try:
            client = EngineClient(wait_for(ready, 600, alive)["url"], timeout_s=600)
            result = run(model, client, device, a.reps, int(bucket_mb * (1 << 20)), bucket_mb)
        finally:
            proc.terminate()
            proc.wait(60)
            log.close()
    names = [n for n, _ in model.named_parameters()]
    result.update({"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                   "torch": torch.__version__, "tensors": len(names),
                   "expert_tensors": sum(".experts." in n for n in names),
                   "bytes": sum(p.numel() * 2 for p in model.parameters()), "bucket_mb": bucket_mb,
                   "widths": "real" if not scaled else CPU_WIDTHS, "reps": a.reps})
    pt, fl = result["per_tensor"], result["flattened"]
    result["ratio_best"] = pt["best_s"] / fl["best_s"]
    result["ratio_median"] = pt["median_s"] / fl["median_s"]
    print(f"qwen3-moe-small tensor list on {result['device']} ({'real widths' if not scaled else 'scaled widths'}):"
          f" {result['tensors']} tensors ({result['expert_tensors']} expert), {result['bytes'] / 1e9:.2f} GB bf16,"
          f" {pt['buckets']} buckets of {bucket_mb:g} MB")
    for fmt in FORMATS:
        r = result[fmt]
        one = r["one_bucket"]
        read = f", read back in {one['load_s'] * 1e3:6.2f} ms" if "load_s" in one else ""
        print(f"  {fmt:>10}: update best {r['best_s'] * 1e3:8.1f} ms, median {r['median_s'] * 1e3:8.1f} ms"
              f" | one bucket of {r['first_bucket_tensors']}: body built in {one['serialize_s'] * 1e3:6.2f} ms{read}"
              f" | engine opened handles in {r['engine_open_ms_sum']:7.1f} ms (sum over buckets)"
              f" | engine == sent: {r['engine_equals_sent']}")
    print(f"  per-tensor / flattened: {result['ratio_best']:.2f}x (best), {result['ratio_median']:.2f}x (median)")
    print("wrote", write(f"tensor_bucket_{'cpu' if device.type == 'cpu' else 'cuda'}", result))
    return result


def run(model, client: EngineClient, device, reps: int, bucket_bytes: int, bucket_mb: float) -> dict:
    names = [n for n, _ in model.named_parameters()]
    sample = [names[0], names[len(names) // 2], names[-1]] + [n for n in names if ".experts.127." in n][:3]
    times = {fmt: [] for fmt in FORMATS}
    out = {fmt: {} for fmt in FORMATS}
    version = 0
    for rep in range(reps + 1):  # rep 0: warm-up of both forms (first handles, allocator), not counted
        for fmt in FORMATS if rep % 2 else FORMATS[::-1]:
            cfg = WeightsConfig(type="tensor", tensor_format=fmt, bucket_size_mb=bucket_mb, keep_host_copy=False,
                                timeout_s=600)
            sender = TensorTransport(cfg, [client], device)
            sender.connect()
            scale = 1.0 + 0.01 * (version % 7)
            named = export(model, bucket_bytes, scale)
            sync(device)
            version += 1
            t0 = time.perf_counter()
            stats = sender.send(named, version)
            elapsed = time.perf_counter() - t0
            sender.close()
            if rep:
                times[fmt].append(elapsed)
            if rep == reps:  # the last one: check the engine, time the body alone, keep the engine's messages
                got = {n: client.request("POST", "/get_weights_by_name", {"name": n, "truncate_size": 4096})
                       for n in sample}
                sent = dict(named)
                equal = all(torch.equal(torch.tensor(got[n], dtype=torch.float32),
                                        sent[n].reshape(-1)[:4096].float().cpu()) for n in sample)
                first = next(buckets_of(named, bucket_bytes))[0]
                msgs = [m for m in stats["engine_messages"] if m]
                opened = [float(m.split("handles opened in ")[1].split(" ms")[0]) for m in msgs if "handles opened" in m]
                out[fmt] = {"buckets": stats["buckets"], "engine_equals_sent": equal and client.weight_version() == version,
                            "one_bucket": one_bucket_s(first, fmt), "first_bucket_tensors": len(first),
                            "engine_open_ms_sum": sum(opened), "engine_messages": msgs[:3] + msgs[-1:]}
            del named
    for fmt in FORMATS:
        out[fmt].update({"best_s": min(times[fmt]), "median_s": statistics.median(times[fmt]), "all_s": times[fmt]})
    return out


if __name__ == "__main__":
    main()
