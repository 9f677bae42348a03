"""The weight-sync boundary: the trainer pushes a complete, versioned set of named tensors to engines."""

from __future__ import annotations

from typing import Iterable, Protocol

import torch


class WeightSender(Protocol):
    def connect(self) -> None:
        """Set up the transport with every engine (called once, after engines are up)."""

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        """Push all tensors; engines switch to `version` only once the last one arrived. Returns stats."""

    def close(self) -> None:
        """Tear the transport down."""
