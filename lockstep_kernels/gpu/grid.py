"""Launch grids within CUDA's limits: the rule for the kernels' second and third grid axes.

CUDA allows 2^31 - 1 programs along a grid's first axis and 65535 along the second and third (HIP the
same or more). A launch past them fails with "Triton Error [CUDA]: invalid argument", which names
neither the kernel nor the axis. Found at real use (issue 26): true on-policy training of a
128-head DeepSeek-V3-shaped model on short answers packs ~500 sequences into a micro-batch, and the
attention kernel's grid had sequences x heads (65536) on its second axis. The rule: what grows with
the data (rows, sequences x heads, tiles of M) goes on the first axis; the second and third hold what
a model's shape bounds (KV heads, key splits, column blocks), and `checked` says which launch would
break, in words, before it is made.
"""

from __future__ import annotations

MAX_GRID = (2**31 - 1, 65535, 65535)


def checked(kernel: str, grid: tuple[int, ...]) -> tuple[int, ...]:
    """`grid`, after checking every axis against MAX_GRID; a ValueError naming the kernel otherwise."""
    for axis, (n, limit) in enumerate(zip(grid, MAX_GRID)):
        if n > limit:
            raise ValueError(f"{kernel}: {n} programs on grid axis {axis} exceed CUDA's {limit} (launch {grid})")
    return grid
