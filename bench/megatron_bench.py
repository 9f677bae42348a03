"""Training step of the megatron-core backend (TP=1, one GPU) against the FSDP2 backend, side by side.

The same random 0.5B Qwen3 (Qwen2.5-0.5B's shape), the same packed batch (8 x 2048 tokens), the same
per-token logprob loss, clip and AdamW; bf16 compute over fp32 master weights in both. Megatron runs
its local layer spec (no Transformer Engine on the device): attention is its unfused
DotProductAttention with an explicit mask. MFU as in trainer_bench.py, against the measured matmul rate.

    python bench/megatron_bench.py          # GPU
    python bench/megatron_bench.py --tiny   # CPU
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import qwen3_0p5b, single_process_group, write  # noqa: E402
from bench.trainer_bench import matmul_rate, median_step_time, packed_batch, step_time, train_flops  # noqa: E402
from pipeline.models.config import model_preset  # noqa: E402
from pipeline.models.qwen3 import Qwen3ForCausalLM  # noqa: E402


def megatron_step_time(args, device, seq_len: int, seqs: int, steps: int) -> float:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pipeline.trainer.megatron.convert import to_megatron
    from pipeline.trainer.megatron.model import build_gpt, logits_at, transformer_config

    if device.type == "cpu":
        from pipeline.trainer.megatron.cpu_compat import install

        install()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(0)
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    ours = Qwen3ForCausalLM(args)
    ours.init_weights(0)
    gpt = build_gpt(args, transformer_config(args, tp=1, ep=1, sequence_parallel=False, dtype=compute,
                                             on_cpu=device.type == "cpu"))
    gpt.load_state_dict(to_megatron(ours.state_dict(), args), strict=False)
    del ours
    gpt = gpt.to(device)
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-5)
    cu = torch.arange(0, seq_len * seqs + 1, seq_len, device=device)
    ids, score, targets, adv = packed_batch(args, device, seq_len, seqs)

    def logits():
        with torch.autocast(device.type, dtype=compute, enabled=compute != torch.float32):
            return logits_at(gpt, ids, cu, score)

    t = median_step_time(logits, targets, adv, gpt, opt, device, steps)
    del gpt, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args(argv)
    device = single_process_group(a.tiny, 29556)
    name, args, seq_len, seqs = (("tiny-dense", model_preset("tiny-dense", 64, None, 0, None), 64, 8) if a.tiny
                                 else ("0.5B", qwen3_0p5b(), 2048, 8))
    peak = matmul_rate(device, 8192 if device.type == "cuda" else 512)
    flops = train_flops(args, seq_len * seqs, seq_len)
    rows = []
    for backend, fn in (("megatron", megatron_step_time), ("fsdp", step_time)):
        t = fn(args, device, seq_len, seqs, a.steps)
        rows.append({"backend": backend, "config": name, "step_s": t, "tokens_per_s": seq_len * seqs / t,
                     "tflops": flops / t / 1e12, "mfu_vs_matmul": flops / t / peak})
        print(f"{backend:>8} {name}: {t * 1e3:8.1f} ms/step  {seq_len * seqs / t:9.0f} tok/s  "
              f"{flops / t / 1e12:6.1f} TFLOP/s = {100 * flops / t / peak:5.1f}% of {peak / 1e12:.0f} TFLOP/s", flush=True)
    print(f"megatron / fsdp step time: {rows[0]['step_s'] / rows[1]['step_s']:.2f}x")
    dist.destroy_process_group()
    print("wrote", write("megatron_tiny" if a.tiny else "megatron", {"matmul_tflops": peak / 1e12, "rows": rows}))


if __name__ == "__main__":
    main()
