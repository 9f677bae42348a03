"""Where a trainer step spends its device time: torch.profiler over steps of bench/trainer_bench.py's setup.

    python bench/profile_train.py [--config 0.5B|1.7B] [--steps 2]   # GPU (or CPU with --tiny)

Prints the ops with the most self device (or CPU) time and the share of the step they take.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from bench.common import qwen3_0p5b, qwen3_1p7b, single_process_group, sync  # noqa: E402
from bench.trainer_bench import mixed_lengths, packed_batch  # noqa: E402
from pipeline.models.attention import PackedCausal  # noqa: E402
from pipeline.models.config import model_preset  # noqa: E402
from pipeline.models.logprobs import token_logprobs  # noqa: E402
from pipeline.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from pipeline.trainer.fsdp import shard  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--config", default="0.5B", choices=["0.5B", "1.7B"])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rows", type=int, default=25)
    a = p.parse_args(argv)
    device = single_process_group(a.tiny, 29558)
    args = model_preset("tiny-dense", 64, None, 0, None) if a.tiny else {"0.5B": qwen3_0p5b, "1.7B": qwen3_1p7b}[a.config]()
    lengths = [64] * 8 if a.tiny else mixed_lengths(16384, 128, 2048)
    torch.manual_seed(0)
    model = shard(Qwen3ForCausalLM(args).to(device), init_device_mesh(device.type, (1,)),
                  torch.bfloat16 if device.type == "cuda" else torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda" or None)
    ctx = PackedCausal.from_lengths(lengths, device=device)
    ids, score, targets, adv = packed_batch(args, device, lengths)

    def step():
        loss = -(token_logprobs(model(ids, ctx.positions, ctx, None, logits_at_M=score), targets, 1.0) * adv).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    sync(device)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(a.steps):
            step()
        sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=a.rows, max_name_column_width=70))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
