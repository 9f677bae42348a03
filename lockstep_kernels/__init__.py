"""Batch-invariant kernels: a row's result does not depend on what else is computed with it.

`batch_invariant_mode()` switches the shared model code (pipeline.models) onto these ops, in engine
and trainer alike, so a token's logprob is the same bit for bit whether it was computed in a decode
step beside 200 other requests or in a packed training micro-batch. Each op has a Triton path for
GPUs (fixed tile sizes and reduction order, no autotuning, no split-K) and a torch path for CPUs with
the same property (fixed row tiles, fixed key blocks, transcendental functions chosen for being
position-invariant on CPU). On ROCm the Triton path runs through Triton's AMD backend; aiter has no
batch-invariant variants of these ops, so it is not used (lockstep_kernels/dispatch.py).

The mode (lockstep_kernels/mode.py) is a process default plus a per-thread override:

    set_batch_invariant(True)          # once, at start (true on-policy engines and trainers)
    with batch_invariant_mode():       # this thread, this block
        logits = model(...)

This package imports nothing from `pipeline` (tests/test_determinism.py checks it).
"""

from __future__ import annotations

from lockstep_kernels.dispatch import set_backend
from lockstep_kernels.mode import batch_invariant_mode, is_batch_invariant, set_batch_invariant
from lockstep_kernels.ops import (GREEDY_EPS, attention, decode_attention, grouped_linear, linear, log_softmax,
                                  packed_causal_attention, rms_norm, scaled_logits, sigmoid, silu, softmax,
                                  token_logprobs, topk_indices)

__all__ = ["batch_invariant_mode", "is_batch_invariant", "set_batch_invariant", "set_backend",
           "linear", "grouped_linear", "attention", "packed_causal_attention", "decode_attention", "rms_norm",
           "log_softmax", "softmax", "sigmoid", "silu", "topk_indices", "token_logprobs", "scaled_logits", "GREEDY_EPS"]
