"""Triton kernels (GPU; also runnable through Triton's CPU interpreter for tests).

Each file: private @triton.jit kernel(s) with the formula in the docstring, a host launcher, an
autograd.Function, a functional wrapper named bi_<op>. lockstep_kernels/ops.py dispatches to them.
A program's row, slot or tile start meets a stride in int64 through offsets.py's `offset64`: tensors
at real sizes pass 2^31 elements ([16384, 151936] logits, a KV cache of many long slots).
"""
