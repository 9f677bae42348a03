"""Pointer offsets past 2^31 elements: the one rule every kernel here follows.

Triton computes integers in the type of their operands: program ids and tl.arange are int32, and an
int argument that fits in 32 bits (a row stride of 151936, a cache slot stride) arrives as int32
too. So `row * stride` wraps once a row starts past 2^31 elements: true on-policy training with
16384 tokens per GPU makes a [16384, 151936] LM-head output (2.49e9 elements), whose row 14135
starts past 2^31, and the GPU stopped with an illegal memory access (issue 20).

The rule: a program's base index (its row, its cache slot, the first row of its tile) goes to int64
before it meets a stride, and the kernel moves its base pointer there once:

    x_row = x_ptr + offset64(row, stride_x)                           # one program per row
    a_ptrs = a_ptr + offset64(start_m, stride_am) + rows[:, None] * stride_am + ...   # a tile

Offsets inside a program stay int32: a tile's rows (at most 128) times a stride, a row's columns,
a slot's positions, a sequence's heads. They are bounded by the size of one tile, row, slot or
sequence, far below 2^31 at every size Lockstep runs. So the cost is one 64-bit multiply per program, not per element, and the
kernels read the same elements in the same order as before: their bits do not change.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def offset64(index, stride):
    """index * stride in int64 (index: a program's row, slot or tile start; int32 or int64)."""
    return index.to(tl.int64) * stride
