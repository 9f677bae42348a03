"""Batch-invariant kernels: a row's result does not depend on what else is computed with it.

`batch_invariant_mode()` switches the shared model code (pipeline.models) onto these ops, in engine
and trainer alike, so a token's logprob is the same bit for bit whether it was computed in a decode
step beside 200 other requests or in a packed training micro-batch. Each op has a Triton path for
GPUs (fixed tile sizes and reduction order, no autotuning, no split-K) and a torch path for CPUs with
the same property (fixed row tiles, fixed key blocks, transcendental functions chosen for being
position-invariant on CPU). On ROCm the Triton path runs through Triton's AMD backend; aiter has no
batch-invariant variants of these ops, so it is not used (lockstep_kernels/dispatch.py).

    with batch_invariant_mode():
        logits = model(...)
"""

from __future__ import annotations

import contextlib
import threading

_state = threading.local()
_global = {"enabled": False}


def is_batch_invariant() -> bool:
    return getattr(_state, "enabled", _global["enabled"])


def set_batch_invariant(enabled: bool) -> None:
    """Process-wide default (engines and trainers in true on-policy mode set it once at start)."""
    _global["enabled"] = bool(enabled)


def enable_batch_invariant_mode() -> None:
    set_batch_invariant(True)


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True):
    """Use the batch-invariant ops inside this block (this thread); the previous state returns after."""
    previous = getattr(_state, "enabled", None)
    _state.enabled = enabled
    try:
        yield
    finally:
        if previous is None:
            del _state.enabled
        else:
            _state.enabled = previous


from lockstep_kernels.ops import (attention, decode_attention, linear, log_softmax, packed_causal_attention,  # noqa: E402
                                  rms_norm, sigmoid, silu, softmax, token_logprobs, topk_indices)

__all__ = ["batch_invariant_mode", "is_batch_invariant", "set_batch_invariant", "enable_batch_invariant_mode",
           "linear", "attention", "packed_causal_attention", "decode_attention", "rms_norm", "log_softmax", "softmax", "sigmoid", "silu", "topk_indices", "token_logprobs"]
