"""Launch grids stay inside CUDA's per-axis limits (lockstep_kernels/gpu/grid.py).

The attention kernel's grid once had sequences x heads on its second axis (limit 65535): true on-policy
training of a 128-head DeepSeek-V3-shaped model on single-digit answers (~500 sequences per
micro-batch) failed on the H200 with "Triton Error [CUDA]: invalid argument"."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from lockstep_kernels.gpu.attention import attention_grid  # noqa: E402
from lockstep_kernels.gpu.grid import MAX_GRID, checked  # noqa: E402


def test_attention_grid_of_many_short_sequences_and_many_heads_fits():
    # 512 sequences x 128 heads = 65536 programs: past the second axis's limit, inside the first's
    grid = attention_grid(512, 128, 7)
    assert grid == (65536, 2)
    assert all(n <= limit for n, limit in zip(grid, MAX_GRID))
    # a 16384-token micro-batch of one-token sequences of a 128-head model
    assert attention_grid(16384, 128, 1)[0] == 16384 * 128 <= MAX_GRID[0]


def test_a_grid_past_the_limits_is_refused_naming_kernel_and_axis():
    assert checked("k", (2**31 - 1, 65535, 65535)) == (2**31 - 1, 65535, 65535)
    with pytest.raises(ValueError, match=r"bi_attention: 65536 programs on grid axis 1 exceed CUDA's 65535"):
        checked("bi_attention", (2, 65536))
    with pytest.raises(ValueError, match="axis 0"):
        checked("x", (2**31,))
