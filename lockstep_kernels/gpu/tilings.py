"""Which output tiling the batch-invariant matmul (matmul.py) takes, per GPU, dtype, weight shape and M.

A tiling is (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). It decides which program computes an
output element and how many k16 MMA steps one loop iteration issues, not the order in which a row's
products are summed (K from 0 upward into one fp32 accumulator), so on a GPU whose MMA instructions
round alike it gives a row the bits of matmul.CONFIGS' pinned tiling. Whether they do is a fact of the GPU,
not of the argument (Hopper's 16-row tiles select mma.sync, 64-row ones wgmma): a tiling enters a table
here only when `bench/bi_tile_probe.py` has shown on such a GPU that it gives the pinned bits at every
shape and M it probed, and `tests/triton_checks.py matmul_tilings` checks the table again. So the
choice may depend on M (small tiles at decode sizes, where 128 x 128 tiles leave most SMs idle) and a
row's bits still never do. A GPU not listed: the pinned tiling for every M.

Rows: (largest M, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, kernel]), ascending; the first row
whose largest M an M is not past wins; M past the last row takes the pinned tiling. A row ending in "tma"
runs the tiling as matmul_tma.py's persistent kernel (TMA loads, one program per SM walking the tiles):
the same tile reduction, so the probe holds it to the same rule (the pinned bits at every shape and M).
SHAPE_TILINGS (per weight shape (N, K), from the probe's fastest tiling at that shape) comes first,
TILINGS (one table for every shape, the best geometric mean over the probed shapes) for shapes it does
not list. Regenerate both with `python bench/bi_tile_probe.py --out DIR` on the GPU, then
`--propose DIR/bi_tile_probe.json` (several files: a later probe's shapes replace an earlier one's).
"""

from __future__ import annotations

import torch

Row = tuple  # (largest M, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, kernel])

HOPPER = (9, 0)

# From `bench/bi_tile_probe.py --propose bench/results/h100/bi_tile_probe.json
# bench/results/h100/probes/bi_tile_probe.json bench/results/h100/probes_graph/bi_tile_probe.json` on an
# H100: the 2026-12-05 probe (20 weight shapes of the Qwen3-1.7B, 4B and MoE-small presets x M = 1..16384 x
# 23 tilings of matmul.py's kernel), the 2026-12-06 probe's rows where it measured a shape (16 shapes, 33
# tilings, the TMA kernel at 5 tilings for M >= 256), and the 2026-12-08 probe's (Qwen3-1.7B's 7 shapes at
# M = 1..256, every candidate timed in one CUDA graph over weight copies larger than the L2, with the
# narrow BLOCK_N 16 / BLOCK_K 128 decode tilings); not one candidate differing in a bit in any of them.
# H200s are the same compute capability.
TILINGS: dict[tuple[int, int], dict[torch.dtype, list[Row]]] = {
    HOPPER: {torch.bfloat16: [(16, 16, 64, 128, 4, 3), (64, 64, 64, 64, 4, 4), (128, 64, 32, 128, 4, 3),
                             (256, 64, 64, 64, 4, 4)]},
}

SHAPE_TILINGS: dict[tuple[int, int], dict[torch.dtype, dict[tuple[int, int], list[Row]]]] = {
    HOPPER: {torch.bfloat16: {
        (512, 2048): [(256, 16, 64, 128, 4, 3), (2048, 64, 128, 128, 4, 3), (16384, 128, 256, 64, 8, 3, "tma")],
        (768, 2048): [(256, 16, 64, 128, 4, 3), (2048, 64, 64, 64, 4, 4)],
        (1024, 2048): [(1, 16, 16, 128, 4, 4), (256, 64, 16, 128, 4, 4), (2048, 128, 128, 128, 8, 3, "tma"),
                       (16384, 128, 256, 64, 8, 3, "tma")],
        (1024, 2560): [(16, 64, 32, 64, 4, 4), (64, 16, 64, 64, 4, 4), (256, 64, 32, 64, 4, 4),
                       (2048, 128, 128, 128, 8, 3), (16384, 128, 256, 64, 8, 3, "tma")],
        (2048, 768): [(1, 16, 64, 64, 4, 4), (16, 16, 64, 128, 4, 3), (64, 16, 64, 64, 4, 4),
                      (256, 64, 64, 64, 4, 4)],
        (2048, 2048): [(16, 16, 16, 128, 4, 4), (128, 64, 16, 128, 4, 4), (256, 64, 32, 128, 4, 3),
                       (16384, 128, 256, 64, 8, 3, "tma")],
        (2048, 4096): [(64, 16, 64, 128, 4, 3), (256, 64, 128, 128, 4, 3)],
        (2048, 6144): [(1, 16, 16, 128, 4, 4), (128, 64, 16, 128, 4, 4), (256, 64, 32, 128, 4, 3),
                       (16384, 128, 256, 64, 8, 3, "tma")],
        (2560, 4096): [(16, 16, 64, 128, 4, 3), (64, 64, 32, 64, 4, 4), (256, 64, 128, 128, 4, 3),
                       (2048, 128, 128, 64, 8, 4, "tma"),
                       (16384, 128, 256, 64, 8, 3, "tma")],
        (2560, 9728): [(64, 16, 64, 128, 4, 3), (256, 64, 128, 128, 4, 3), (2048, 128, 128, 64, 8, 4, "tma"),
                       (16384, 128, 256, 64, 8, 3, "tma")],
        (4096, 2048): [(16, 16, 16, 128, 4, 4), (64, 64, 16, 128, 4, 4), (128, 64, 32, 128, 4, 3),
                       (256, 64, 128, 64, 4, 4, "tma"), (16384, 128, 256, 64, 8, 3, "tma")],
        (4096, 2560): [(64, 16, 64, 128, 4, 3), (256, 64, 128, 128, 4, 3), (16384, 128, 256, 64, 8, 3, "tma")],
        (5120, 2048): [(64, 16, 64, 128, 4, 3), (256, 64, 64, 64, 4, 4)],
        (6144, 2048): [(16, 16, 16, 128, 4, 4), (128, 64, 32, 128, 4, 3), (256, 128, 128, 64, 8, 4, "tma"),
                       (16384, 128, 256, 64, 8, 3, "tma")],
        (6144, 2560): [(1, 32, 32, 64, 4, 4), (64, 16, 64, 128, 4, 3), (256, 64, 64, 64, 4, 4),
                       (16384, 128, 256, 64, 8, 3, "tma")],
        (9728, 2560): [(1, 16, 32, 64, 2, 4), (16, 16, 64, 128, 4, 3), (64, 64, 32, 64, 4, 4),
                       (256, 64, 128, 64, 4, 3), (16384, 128, 256, 64, 8, 3, "tma")],
        (12288, 2048): [(1, 16, 32, 128, 4, 3), (16, 16, 64, 128, 4, 3), (64, 64, 128, 128, 4, 3),
                        (128, 64, 64, 64, 4, 4), (16384, 128, 256, 64, 8, 3, "tma")],
        (19456, 2560): [(1, 16, 32, 64, 4, 4), (16, 16, 64, 128, 4, 3), (64, 64, 64, 64, 4, 4),
                        (256, 128, 128, 128, 8, 3, "tma"),
                        (16384, 128, 256, 64, 8, 3, "tma")],
        (151936, 2048): [(1, 16, 64, 128, 4, 3), (16, 64, 64, 64, 4, 3), (64, 64, 128, 128, 4, 3),
                         (128, 128, 128, 128, 8, 3, "tma"),
                         (16384, 128, 256, 64, 8, 3, "tma")],
        (151936, 2560): [(1, 64, 64, 64, 4, 3), (16, 64, 128, 128, 4, 3), (64, 64, 64, 64, 4, 3),
                         (16384, 128, 256, 64, 8, 3, "tma")],
    }},
}


def pick(m: int, n: int | None, k: int | None, dtype: torch.dtype, capability: tuple[int, int] | None) -> Row | None:
    """The table row an M-row product with an [N, K] weight takes on this GPU, or None (the pinned tiling)."""
    rows = SHAPE_TILINGS.get(capability, {}).get(dtype, {}).get((n, k))
    if rows is None:
        rows = TILINGS.get(capability, {}).get(dtype, [])
    return next((r for r in rows if m <= r[0]), None)
