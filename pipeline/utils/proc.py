"""Process helpers shared by everything that starts a child process."""

from __future__ import annotations

import signal


def die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the parent dies (even by SIGKILL), so no orphans."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the parent's own signal handling still ends its children
        pass
