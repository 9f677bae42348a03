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
from pipeline.models.config import tiny_preset  # noqa: E402
from pipeline.models.hf_io import load_model, save_model  # noqa: E402
from pipeline.models.qwen3 import Qwen3ForCausalLM  # noqa: E402


def engine_run(model, batch, prompt, new, device, dtype) -> float:
    """Seconds to generate `new` tokens for `batch` requests (prefill included)."""
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(1, min(1000, model.args.vocab_size), (prompt,), generator=g).tolist() for _ in range(batch)]
    reqs, dt, _ = generate(model, prompts, new, device, dtype)
    assert all(len(r.output_ids) == new for r in reqs)
    return dt


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
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args = tiny_preset("tiny-dense", 64, None, 0, None) if a.tiny else qwen3_0p5b()
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
        theirs = decode_rate(lambda bb, pp, nn: hf_run(hf, bb, pp, nn, device), b, prompt, new) if hf else None
        kv_bytes = b * (prompt + new / 2) * kv_per_token  # average context over the decode
        bound = b / ((weight_bytes + kv_bytes) / (bw / 2))  # a step reads weights + KV once
        rows.append({"batch": b, "engine_tok_s": ours, "hf_tok_s": theirs,
                     "engine_vs_hf": ours / theirs if theirs else None, "bound_tok_s": bound,
                     "frac_of_bound": ours / bound})
        print(f"batch {b:4d}: engine {ours:10.1f} tok/s   transformers {theirs or float('nan'):10.1f} tok/s   "
              f"ratio {rows[-1]['engine_vs_hf'] or float('nan'):5.2f}x   bound {bound:10.1f} tok/s   "
              f"{100 * ours / bound:5.1f}% of bound", flush=True)
    payload = {"device": str(device), "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               "dtype": str(dtype), "params": sum(t.numel() for t in unique.values()),
               "prompt": prompt, "new": new, "copy_bandwidth_gbs": bw / 1e9, "rows": rows,
               "transformers": __import__("transformers").__version__ if hf else None, "torch": torch.__version__}
    print("wrote", write("engine_tiny" if a.tiny else "engine", payload))
    return payload


if __name__ == "__main__":
    main()
