"""Built-in engine decode throughput vs Hugging Face transformers `generate`, and vs the memory bound.

Same weights for both (a random ~0.5B Qwen3-style model written as an HF checkpoint, loaded by each),
same batch, same prompt and response lengths (ignore EOS), sampling at temperature 1. The bound is
(weights + KV cache bytes read per decode step) / measured device copy bandwidth.

    python bench/engine_bench.py                  # GPU: 0.5B, batch 1 16 64 256
    python bench/engine_bench.py --tiny           # CPU-sized variant (runs here, in the tests)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import copy_bandwidth, generate, qwen3_0p5b, sync, write  # noqa: E402
from pipeline.models.config import model_preset  # noqa: E402
from pipeline.models.hf_io import load_model, save_model  # noqa: E402
from pipeline.models.qwen3 import Qwen3ForCausalLM  # noqa: E402


def prompts_for(model, batch, prompt):
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(1, min(1000, model.args.vocab_size), (prompt,), generator=g).tolist() for _ in range(batch)]


def engine_run(model, batch, prompt, new, device, dtype, graphs=True, quantization=None, **settings) -> float:
    """Seconds to generate `new` tokens for `batch` requests (prefill included); `settings`: the engine's
    overlap / fused_sampling."""
    reqs, dt, _ = generate(model, prompts_for(model, batch, prompt), new, device, dtype, graphs=graphs,
                           quantization=quantization, **settings)
    assert all(len(r.output_ids) == new for r in reqs)
    return dt


def on_vs_off(setting: str, default: bool, rate: float, rerun) -> float:
    """Decode rate with the engine setting on over the rate with it off: `rate` was measured with the
    setting at its default; `rerun(setting=value)` measures with it switched the other way."""
    other = rerun(**{setting: not default})
    return rate / other if default else other / rate


def graphs_bit_identical(model, device, dtype) -> bool:
    """In batch-invariant mode the CUDA-graph decode gives the eager decode's tokens and logprobs bit
    for bit: 8 requests of different prompt and output lengths (the batch shrinks through the buckets),
    graphs dropped after 6 steps and captured again mid-run (what a memory release does)."""
    from lockstep_kernels import batch_invariant_mode
    from pipeline.rollout.engine.core import Engine, Request, SamplingParams

    def run(graph_bs):
        engine = Engine(model, max_running=8, context_length=128, eos_token_ids=[0], device=device, dtype=dtype,
                        cuda_graph_max_bs=graph_bs)
        engine.capture_graphs()
        reqs = [Request(p[: 5 + 7 * i], SamplingParams(max_new_tokens=10 + 3 * i, ignore_eos=True, sampling_seed=i))
                for i, p in enumerate(prompts_for(model, 8, 64))]
        for r in reqs:
            engine.submit(r)
        steps = 0
        while engine.waiting or engine.running:
            engine.step()
            steps += 1
            if steps == 6 and engine.graphs is not None:
                engine.graphs.reset()
        return [(r.output_ids, r.output_logprobs) for r in reqs]

    with batch_invariant_mode():
        return run(0) == run(8 if torch.device(device).type == "cuda" else 0)


def hf_run(hf, batch, prompt, new, device) -> float:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, min(1000, hf.config.vocab_size), (batch, prompt), generator=g).to(device)
    sync(device)
    t0 = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=True,
                      temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    sync(device)
    assert out.shape[1] == prompt + new
    return time.perf_counter() - t0


def decode_rate(run, batch, prompt, new) -> float:
    """Decode tokens/s: a run of `new` tokens minus a run of 1 token (the prefill), per decoded token."""
    run(batch, prompt, 1)  # warm-up (kernels, allocator)
    t1 = min(run(batch, prompt, 1) for _ in range(2))
    tn = run(batch, prompt, new)
    return batch * (new - 1) / max(tn - t1, 1e-9)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized model and batches")
    p.add_argument("--batches", type=int, nargs="*")
    p.add_argument("--prompt", type=int)
    p.add_argument("--new", type=int)
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--fused-sampling", action="store_true",
                   help="also the engine with the fused Triton sampler switched the other way (engine.sampling_backend), side by side")
    p.add_argument("--overlap", action="store_true",
                   help="also the engine with overlapped decode switched the other way (engine.overlap_schedule), side by side")
    p.add_argument("--fp8", action="store_true", help="also the engine with FP8 linear layers (engine.quantization=fp8)")
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args = model_preset("tiny-dense", 64, None, 0, None) if a.tiny else qwen3_0p5b()
    batches = a.batches or ([1, 4] if a.tiny else [1, 16, 64, 256])
    prompt, new = a.prompt or (16 if a.tiny else 128), a.new or (16 if a.tiny else 128)
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="engine_bench_")
    save_model(Qwen3ForCausalLM(args).state_dict(), args, tmp)
    _, model = load_model(tmp, dtype=dtype, device=device)
    hf = None
    if not a.no_hf:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, torch_dtype=dtype).to(device).eval()
    bw = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 26)
    unique = {t.data_ptr(): t for t in model.parameters()}  # a tied LM head is read once
    weight_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    kv_per_token = 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * torch.finfo(dtype).bits // 8
    rows = []
    for b in batches:
        ours = decode_rate(lambda bb, pp, nn: engine_run(model, bb, pp, nn, device, dtype), b, prompt, new)
        eager = decode_rate(lambda bb, pp, nn: engine_run(model, bb, pp, nn, device, dtype, graphs=False), b, prompt, new)
        low = None
        if a.fp8:  # a copy: the FP8 engine quantises its model's linear layers in place
            import copy

            low = decode_rate(lambda bb, pp, nn: engine_run(copy.deepcopy(model), bb, pp, nn, device, dtype,
                                                            quantization="fp8"), b, prompt, new)
        rerun = lambda **settings: decode_rate(  # noqa: E731
            lambda bb, pp, nn: engine_run(model, bb, pp, nn, device, dtype, **settings), b, prompt, new)
        fused = on_vs_off("fused_sampling", True, ours, rerun) if a.fused_sampling else None  # fused sampler vs torch's
        overlap = on_vs_off("overlap", False, ours, rerun) if a.overlap else None  # overlapped vs step by step
        theirs = decode_rate(lambda bb, pp, nn: hf_run(hf, bb, pp, nn, device), b, prompt, new) if hf else None
        kv_bytes = b * (prompt + new / 2) * kv_per_token  # average context over the decode
        bound = b / ((weight_bytes + kv_bytes) / (bw / 2))  # a step reads weights + KV once
        rows.append({"batch": b, "engine_tok_s": ours, "engine_eager_tok_s": eager, "graphs_vs_eager": ours / eager,
                     "fused_sampling_vs_torch": fused, "overlap_vs_step_by_step": overlap, "engine_fp8_tok_s": low, "fp8_vs_bf16": low / ours if low else None,
                     "hf_tok_s": theirs,
                     "engine_vs_hf": ours / theirs if theirs else None, "bound_tok_s": bound,
                     "frac_of_bound": ours / bound})
        print(f"batch {b:4d}: engine {ours:10.1f} tok/s (eager {eager:8.1f}, graphs {ours / eager:5.2f}x"
              + (f", fp8 {low:8.1f} = {low / ours:4.2f}x" if low else "")
              + (f", fused sampler vs torch {fused:4.2f}x" if fused else "")
              + (f", overlapped vs step by step {overlap:4.2f}x" if overlap else "") + f")   transformers {theirs or float('nan'):10.1f} tok/s   "
              f"ratio {rows[-1]['engine_vs_hf'] or float('nan'):5.2f}x   bound {bound:10.1f} tok/s   "
              f"{100 * ours / bound:5.1f}% of bound", flush=True)
    identical = graphs_bit_identical(model, device, dtype)
    print(f"CUDA-graph decode == eager decode bit for bit in batch-invariant mode: {identical}", flush=True)
    payload = {"device": str(device), "graphs_bit_identical_batch_invariant": identical, "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               "dtype": str(dtype), "params": sum(t.numel() for t in unique.values()),
               "prompt": prompt, "new": new, "copy_bandwidth_gbs": bw / 1e9, "rows": rows,
               "transformers": __import__("transformers").__version__ if hf else None, "torch": torch.__version__}
    print("wrote", write("engine_tiny" if a.tiny else "engine", payload))
    return payload


if __name__ == "__main__":
    main()
