"""Trainer side of the colocated transport (weights.type=tensor): engines on this node read the
exported buckets straight out of the trainer's memory.

Per bucket, rank 0 posts SGLang's /update_weights_from_tensor with the bucket's tensors serialized as
handles (CUDA IPC on GPUs; named shared memory on CPU), `weight_version` on the last one, and waits for
every engine's answer before the next: the engine has copied out of the handle by then, so the
trainer may reuse the memory. A bucket's tensors are views of one exported buffer, and the handles keep
that (one storage, offsets), so the engine applies a bucket with one span copy into its flat weights.
There is no process group, no staging copy through host memory and no broadcast.

Buckets land one by one; the engines are paused around the update, so no request decodes with a mix of
two versions. Membership changes, retries and catch-up of a restarted engine from the host copy are
the broadcast sender's (the cached host tensors go back onto the device before they are shared).
"""

from __future__ import annotations

import logging
import time
from typing import Iterable

import torch

from pipeline.rollout import protocol
from pipeline.rollout.client import EngineClient, EngineError
from pipeline.weights.broadcast import BroadcastSender
from pipeline.weights.buckets import buckets_of

log = logging.getLogger("lockstep.weights")


class TensorSender(BroadcastSender):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.joined = False

    @property
    def connected(self) -> bool:
        return self.joined

    def disconnect(self) -> None:
        self.joined = False

    def connect(self, clients: list[EngineClient] | None = None) -> None:
        """Take `clients` (default: the live engines) as the members; nothing to set up beyond that."""
        with self.lock:
            self.clients = clients if clients is not None else self.live_clients()
            if not self.clients:
                raise EngineError("no live engine to send weights to")
            self.joined = True
            log.info("colocated weight updates (%s handles) to %d engine(s)",
                     "CUDA IPC" if self.device.type == "cuda" else "shared-memory", len(self.clients))

    def send(self, named_tensors, version: int, pause: bool = False, attempts: int = 3) -> dict:
        # The engines must not decode while buckets land one by one: always pause (a no-op when idle).
        return super().send(named_tensors, version, pause=True, attempts=attempts)

    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        assert self.connected, "connect() first"
        t0 = time.monotonic()
        nbytes = nbuckets = 0
        messages = []
        for bucket, last in buckets_of(named_tensors, int(self.cfg.bucket_size_mb * (1 << 20))):
            bucket = [(n, t.to(self.device)) for n, t in bucket]  # host-cached tensors of a resend
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the export has landed before it is read
            body = protocol.update_tensor_body(bucket, version=version if last else None)
            futures = [self.pool.submit(c.checked, "/update_weights_from_tensor", body, self.cfg.timeout_s)
                       for c in self.clients]
            messages += [answer.get("message") for answer in self._answers(futures)]
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            nbuckets += 1
        return {"bytes": nbytes, "buckets": nbuckets, "seconds": time.monotonic() - t0, "engine_messages": messages}


def make_sender(cfg, *args, **kw) -> BroadcastSender:
    """The sender weights.type asks for."""
    return (TensorSender if cfg.type == "tensor" else BroadcastSender)(cfg, *args, **kw)
