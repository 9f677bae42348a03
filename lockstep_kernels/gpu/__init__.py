"""Triton kernels (GPU; also runnable through Triton's CPU interpreter for tests).

Each file: private @triton.jit kernel(s) with the formula in the docstring, a host launcher, an
autograd.Function, a functional wrapper named bi_<op>. lockstep_kernels/ops.py dispatches to them.
"""
