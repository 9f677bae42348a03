"""The one mode switch of the kernel library: batch-invariant ops on or off.

Two levels, read by every op through `is_batch_invariant()`:
  the process default  `set_batch_invariant(default)`: set once at start from the run's config
                       (engines and trainers with determinism.true_on_policy); every thread sees it;
  a thread's override  `with batch_invariant_mode(enabled): ...`: this thread only, for the block;
                       the previous state comes back in `finally`, also when the block raises.
"""

from __future__ import annotations

import contextlib
import threading

_thread = threading.local()  # `enabled` while inside batch_invariant_mode(); absent otherwise
_default = False


def is_batch_invariant() -> bool:
    """This thread's override if it is inside batch_invariant_mode(), else the process default."""
    return getattr(_thread, "enabled", _default)


def set_batch_invariant(default: bool) -> None:
    """The process default (threads inside batch_invariant_mode() keep their override)."""
    global _default
    _default = bool(default)


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True):
    """Batch-invariant ops on (or off) in this block, on this thread; the previous state returns after."""
    previous = getattr(_thread, "enabled", None)
    _thread.enabled = bool(enabled)
    try:
        yield
    finally:
        if previous is None:
            del _thread.enabled
        else:
            _thread.enabled = previous
