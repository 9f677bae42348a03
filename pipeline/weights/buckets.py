"""Group a stream of named tensors into buckets of about `bucket_bytes` (a tensor is never split)."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch


def buckets_of(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
               ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Yield (bucket, is_last). Looks one bucket ahead so the last one is known when it is sent."""
    pending: list[tuple[str, torch.Tensor]] | None = None
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > bucket_bytes:
            if pending is not None:
                yield pending, False
            pending, current, size = current, [], 0
        current.append((name, t))
        size += nbytes
    if pending is not None:
        yield pending, not current
    if current:
        yield current, True
