"""Error types a user can act on.

`UserError` (and its subclasses) carry one line that names the problem and the fix; the CLI prints
that line and exits with status 2, without a traceback. Everything else is a bug and propagates.
"""


class UserError(ValueError):
    """Something the user can fix: bad config, missing file, impossible request."""


class ConfigError(UserError):
    """A config file or override is malformed, unknown, or inconsistent."""


class ComponentFailed(RuntimeError):
    """A launched component (engine, rollout manager, trainer rank) exited with an error."""

    def __init__(self, component: str, returncode: int | None, log_tail: str = ""):
        self.component = component
        self.returncode = returncode
        self.log_tail = log_tail
        super().__init__(f"component {component!r} failed (exit status {returncode})")
