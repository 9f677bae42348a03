"""Where each step's metrics go: a sink takes one record per step (the dict trainer rank 0 builds, keys
namespaced rollout/*, train/*, perf/*, weights/*) and keeps it somewhere a person looks.

Implementations, one per file: metrics.py (metrics.jsonl, always on), tensorboard_sink.py,
wandb_sink.py; sinks.py builds the set a config asks for.
"""

from __future__ import annotations

from typing import Protocol


class MetricSink(Protocol):
    def write(self, record: dict, step: int) -> None:
        """Keep the record of `step`. Steps arrive in increasing order, except after a resume: a sink
        opened with start_step=k first drops or shadows what it held for steps >= k."""

    def close(self) -> None:
        """Flush and release files / connections; nothing is written after."""


def scalars(record: dict, aliases: dict[str, str] | None = None) -> dict[str, float]:
    """The numeric values of a record as floats (bools as 0/1; NaN and inf kept: a tracker shows
    them), plus a copy under each alias of a key present. Strings, None and containers are left out,
    and so is `step` itself (trackers take it as the x axis)."""
    out = {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
    for ours, alias in (aliases or {}).items():
        if ours in out:
            out[alias] = out[ours]
    return out
