"""Process helpers shared by everything that starts a child process."""

from __future__ import annotations

import logging
import os
import signal
import sys


def die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the parent dies (even by SIGKILL), so no orphans."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the parent's own signal handling still ends its children
        pass


def exit_without_finalizing(code: int = 0) -> None:
    """End this process now: flush logging, stdout and stderr, then os._exit, skipping the interpreter's
    finalization.

    For a process that ran gloo collectives. Gloo's worker threads free a collective's tensors after it
    completes (a barrier keeps the collectives still in flight when it was issued until it is freed
    itself), and destroy_process_group leaves those threads running while anything (FSDP's mesh) still
    holds the group. A worker that frees a Python-owned tensor once the interpreter is finalizing dies
    taking the GIL, and the process aborts: SIGABRT, "terminate called without an active exception",
    after its work was done. No barrier or sleep closes that race; not finalizing does."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
