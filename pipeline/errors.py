"""Error types a user can act on.

`UserError` (and its subclasses) carry one line that names the problem and the fix; the CLI prints
that line and exits with status 2, without a traceback. Everything else is a bug and propagates.
"""

import re


class UserError(ValueError):
    """Something the user can fix: bad config, missing file, impossible request."""


class ConfigError(UserError):
    """A config file or override is malformed, unknown, or inconsistent."""


class StorageError(UserError):
    """A file could not be written (disk full, read-only or unwritable run directory); nothing
    half-written was kept."""


def is_storage_failure(e: BaseException) -> bool:
    """An OSError, HDF5's RuntimeError for a failed file write (it carries the errno in its text), or
    torch DCP's CheckpointException whose every rank failed that way (it wraps (exception, trace)
    pairs per rank in `.failures`); a DCP failure of another kind (a bug, a bad state dict) is not."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return all(isinstance(f, tuple) and f and is_storage_failure(f[0]) for f in failures.values())
    return isinstance(e, OSError) or (isinstance(e, RuntimeError) and "file write failed" in str(e))


def storage_error(what: str, path: str, e: BaseException) -> StorageError:
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    m = re.search(r"error message = '([^']+)'", reason)  # HDF5's wording of the OS error
    reason = m.group(1) if m else reason
    if "Traceback" in reason:  # torch DCP's CheckpointException: each rank's traceback as text
        errors = re.findall(r"^\w*(?:Error|Exception): .*$", reason, flags=re.M)
        reason = errors[-1] if errors else reason.splitlines()[0]
    return StorageError(f"{what}: cannot write {path}: {reason} (free space or fix permissions, then resume)")


class NonFiniteError(UserError):
    """Training met a non-finite loss or gradient too many times in a row."""


class ComponentFailed(RuntimeError):
    """A launched component (engine, rollout manager, trainer rank) exited with an error."""

    def __init__(self, component: str, returncode: int | None, log_tail: str = ""):
        self.component = component
        self.returncode = returncode
        self.log_tail = log_tail
        cause = last_error_line(log_tail)
        super().__init__(f"component {component!r} failed (exit status {returncode})" + (f": {cause}" if cause else ""))


def last_error_line(log_tail: str) -> str:
    """The last `SomeError: message` line of a log (a Python traceback's final line), or ''."""
    lines = re.findall(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Failed)): (.*)$", log_tail, flags=re.M)
    return f"{lines[-1][0]}: {lines[-1][1]}" if lines else ""
