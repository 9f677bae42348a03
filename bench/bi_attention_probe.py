"""Which launch configurations of the batch-invariant prefill attention keep its bits, and how fast (issue 27).

    PYTHONPATH=$PWD python3 bench/bi_attention_probe.py --out DIR                  (a GPU; ~1 minute)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 bench/bi_attention_probe.py --tiny --out DIR   (CPU: it runs)

The kernel (lockstep_kernels/gpu/attention.py) fixes each query's reduction by its key blocks; the query
rows per program (BLOCK_M), warps, pipeline stages and the heavy-first tile order only schedule it
(attention.PREFILL_CONFIG says why). For the packed training micro-batches of the 1.7B, 4B and MoE-small
presets (8 x 1024 and 4 x 4096 tokens at their heads), every candidate configuration's output is compared bitwise with the pinned one's
and timed against flash attention (torch SDPA, causal, GQA), the default mode's kernel. Writes
bi_attention_probe.json: per shape the pinned ratio (flash / pinned), each candidate's time, and the
candidates that differed in a bit (never to be used).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import bench, wall_ms  # noqa: E402
from lockstep_kernels.gpu.attention import PREFILL_CONFIG, attention_fwd  # noqa: E402

LAUNCHES = [dict(BLOCK_M=bm, num_warps=w, num_stages=s) for bm in (64, 128) for w in (4, 8) for s in (1, 2, 3, 4)]
# the heavy-first tile order, on the launches the H100 probe found fastest
FLAGGED = [dict(c, HEAVY_FIRST=True) for c in (LAUNCHES[2], LAUNCHES[13], LAUNCHES[14])]
CANDIDATES = LAUNCHES + FLAGGED
PRESETS = {"qwen3-1.7b": (16, 8, 128), "qwen3-4b": (32, 8, 128), "qwen3-moe-small": (32, 4, 128)}  # heads, kv heads, dim
SHAPES = [(8, 1024), (4, 4096)]  # sequences x tokens: 8k and 16k-token micro-batches


def key(cfg: dict) -> str:
    flags = "/heavy" if cfg.get("HEAVY_FIRST") else ""
    return f"m{cfg['BLOCK_M']}/w{cfg['num_warps']}/s{cfg['num_stages']}{flags}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
    p.add_argument("--tiny", action="store_true", help="CPU interpreter (TRITON_INTERPRET=1): one small shape")
    a = p.parse_args()
    if a.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--tiny runs on the CPU interpreter: set TRITON_INTERPRET=1")
    if a.tiny:
        dev, presets, shapes, candidates, timeit = "cpu", {"tiny": (4, 2, 16)}, [(2, 80)], LAUNCHES[:3] + LAUNCHES[8:9], wall_ms
    else:
        dev, presets, shapes, candidates = "cuda", PRESETS, SHAPES, CANDIDATES
        timeit = lambda fn: bench(fn, warmup=5, rep=25)  # noqa: E731
    dt = torch.bfloat16
    rows, differing = [], []
    torch.manual_seed(0)
    for preset, (h, g, d) in presets.items():
        for b, t in shapes:
            q = torch.randn(b, h, t, d, device=dev, dtype=dt)
            k, v = torch.randn(b, g, t, d, device=dev, dtype=dt), torch.randn(b, g, t, d, device=dev, dtype=dt)
            qpos = torch.arange(t, device=dev)[None].expand(b, t).contiguous()
            ref = attention_fwd(q, k, v, qpos, cfg=PREFILL_CONFIG)
            t_flash = timeit(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
            t_pinned = timeit(lambda: attention_fwd(q, k, v, qpos, cfg=PREFILL_CONFIG))
            times = {}
            for cfg in candidates:
                try:
                    out = attention_fwd(q, k, v, qpos, cfg=cfg)
                except Exception as e:  # out of shared memory, too many registers, ...
                    differing.append({"preset": preset, "shape": [b, t], "cfg": cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                    continue
                if not torch.equal(out.view(torch.int16), ref.view(torch.int16)):
                    frac = (out.view(torch.int16) != ref.view(torch.int16)).float().mean().item()
                    differing.append({"preset": preset, "shape": [b, t], "cfg": cfg, "frac_bits_differ": frac})
                    continue
                times[key(cfg)] = timeit(lambda: attention_fwd(q, k, v, qpos, cfg=cfg))
            best = min(times, key=times.get) if times else None
            rows.append({"preset": preset, "seqs": b, "tokens": t, "heads": h, "kv_heads": g, "head_dim": d,
                         "flash_ms": t_flash, "pinned_ms": t_pinned, "pinned_ratio": t_flash / t_pinned,
                         "best": best, "best_ratio": best and t_flash / times[best], "times_ms": times})
            print(f"{preset:<16} {b}x{t:<5} flash {t_flash:7.3f} ms  pinned {t_flash / t_pinned:.2f}x  "
                  f"best-equal {rows[-1]['best_ratio'] or 0:.2f}x {best}", flush=True)
            del q, k, v, ref
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "bi_attention_probe.json"), "w") as f:  # after every shape
                json.dump({"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu (interpreter)",
                           "pinned": PREFILL_CONFIG, "rows": rows, "differing": differing}, f, indent=1)
    bits = sum(1 for d in differing if "frac_bits_differ" in d)
    print(f"{len(rows)} shapes; candidates differing in bits: {bits}; failed to launch: {len(differing) - bits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
