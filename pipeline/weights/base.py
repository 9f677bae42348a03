"""The weight-sync boundary: trainer rank 0 pushes complete, versioned sets of named tensors to engines.

One interface, one implementation per file (broadcast.py, tensor.py), shared parts in common.py, and
one factory on weights.type. The trainer loop calls connect / send / watch / live_clients / close;
the watcher thread calls catch_up.
"""

from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

import torch

from pipeline.config.schema import WeightsConfig
from pipeline.rollout.client import EngineClient


@runtime_checkable
class WeightTransport(Protocol):
    always_pauses: bool
    """True: engines are paused around every send, whatever `send(pause=...)` says (tensor: its buckets
    are applied one by one, so no request may decode between two of them)."""

    clients: list[EngineClient]
    """The engines of the current membership."""

    def connect(self, clients: list[EngineClient] | None = None) -> None:
        """Set up the transport with `clients` (default: the live engines)."""

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, pause: bool = False) -> dict:
        """Push a complete version; engines switch to `version` with its last bucket, never to half of it.
        Rebuilds the membership first if the live engines changed, retries from the host copy with the
        survivors when one dies mid-send. pause: stop the engines' scheduling around the update.
        Returns stats: bytes, buckets, seconds, paused, pause_s (and retries)."""

    def catch_up(self) -> bool:
        """If an engine was restarted (the published URLs changed), rejoin the live ones and resend the
        cached last version (weights.keep_host_copy). Returns True if it did."""

    def watch(self, interval_s: float = 2.0) -> None:
        """Run catch_up() every interval_s in a daemon thread until close()."""

    def live_clients(self) -> list[EngineClient]:
        """The engines that answer now (colocated runs release and resume their memory through these)."""

    def close(self) -> None:
        """Stop the watcher and tear the transport down."""


def make_transport(cfg: WeightsConfig, clients: list[EngineClient], device: torch.device, host: str,
                   publish_path: str | None = None, urls=None, api_key: str | None = None,
                   engine_type: str = "local") -> WeightTransport:
    """The transport weights.type names. host / publish_path: the broadcast group's address and where
    it is published; urls() -> the engines' current URLs (rendezvous), for membership and catch-up;
    engine_type: engine.type (what the colocated payload may hold)."""
    if cfg.type == "broadcast":
        from pipeline.weights.broadcast import BroadcastTransport

        return BroadcastTransport(cfg, clients, device, host, publish_path=publish_path, urls=urls, api_key=api_key)
    if cfg.type == "tensor":
        from pipeline.weights.tensor import TensorTransport

        return TensorTransport(cfg, clients, device, urls=urls, api_key=api_key, engine_type=engine_type)
    raise ValueError(f"weights.type={cfg.type!r}: use broadcast or tensor")
