"""weights.type=tensor: colocated engines on this node read the exported buckets straight out of the
trainer's memory.

Per bucket, rank 0 posts SGLang's /update_weights_from_tensor with the bucket serialized as handles
(CUDA IPC on GPUs; named shared memory on CPU), `weight_version` on the last one, inside the
weight-update session common.py opens around every push, and waits for every engine's answer before
the next: the engine has copied out of the handle by then, so the
trainer may reuse the memory. weights.tensor_format=flattened (the default) shares one flat uint8
tensor per bucket with its tensors' metadata (SGLang's "flattened_bucket", rollout/tensor_bucket.py):
one handle, event and ref-counter entry per bucket instead of per tensor, which is what a MoE's
thousands of expert tensors cost. A bucket's tensors are views of one exported buffer, so the flat
tensor is a view of it too (no copy), and the engine's views of it keep that layout: it applies a
bucket with one span copy into its flat weights. There is no process group, no staging copy through
host memory and no broadcast.

Buckets land one by one, so this transport always pauses the engines around a send
(`always_pauses`): no request decodes with a mix of two versions. Membership, the host copy, retries
and catch-up of a restarted engine are common.py's (the cached host tensors go back onto the device
before they are shared).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from pipeline.config.schema import WeightsConfig
from pipeline.rollout import protocol, tensor_bucket
from pipeline.rollout.client import EngineClient
from pipeline.weights.buckets import buckets_of
from pipeline.weights.common import EngineSet, HostCache, NamedTensors, SyncedTransport, VersionSync

log = logging.getLogger("lockstep.weights")


class TensorTransport(SyncedTransport):
    always_pauses = True  # buckets are applied as they arrive: no decoding between two of them

    def __init__(self, cfg: WeightsConfig, clients: list[EngineClient], device: torch.device,
                 urls: Callable[[], list[str]] | None = None, api_key: str | None = None, engine_type: str = "local"):
        self.cfg, self.device = cfg, device
        self.members_joined = False
        self.metadata_cls = flattened_metadata_class(cfg.tensor_format, engine_type)
        self.sync = VersionSync(cfg, self, EngineSet(clients, cfg.timeout_s, urls, api_key),
                                HostCache(cfg.keep_host_copy, device))

    # ---- the link (common.Link): handles of the trainer's tensors -----------------------------------
    @property
    def joined(self) -> bool:
        return self.members_joined

    def join(self, engines: EngineSet) -> None:
        """Nothing to set up beyond taking engines.clients as the members."""
        self.members_joined = True
        log.info("colocated weight updates (%s handles, %s) to %d engine(s)",
                 "CUDA IPC" if self.device.type == "cuda" else "shared-memory",
                 "one per tensor" if self.metadata_cls is None else "one per bucket", len(engines.clients))

    def leave(self) -> None:
        self.members_joined = False

    def push(self, named_tensors: NamedTensors, version: int, engines: EngineSet) -> dict:
        assert self.joined, "join() first"
        t0 = time.monotonic()
        nbytes = nbuckets = 0
        messages = []
        for bucket, last in buckets_of(named_tensors, int(self.cfg.bucket_size_mb * (1 << 20))):
            bucket = [(n, t.to(self.device)) for n, t in bucket]  # host-cached tensors of a resend
            if self.metadata_cls is not None:  # `flat` (a view of the export, or a packed copy) lives until the answers
                flat, metadata = tensor_bucket.flatten(bucket, self.metadata_cls)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the export has landed before it is read
            if self.metadata_cls is None:
                body = protocol.update_tensor_body(bucket, version=version if last else None)
            else:
                body = protocol.update_flattened_bucket_body(flat, metadata, version=version if last else None)
            messages += [answer.get("message") for answer in engines.answers(
                engines.post("/update_weights_from_tensor", body))]
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            nbuckets += 1
        return {"bytes": nbytes, "buckets": nbuckets, "seconds": time.monotonic() - t0, "engine_messages": messages}


def flattened_metadata_class(tensor_format: str, engine_type: str) -> type | None:
    """The metadata class of flattened buckets for these engines, or None to send a handle per tensor:
    the built-in engine reads Lockstep's class; SGLang reads only its own, so the trainer must be able
    to import it (else per tensor, said once here)."""
    if tensor_format == "per_tensor":
        return None
    if engine_type != "sglang":
        return tensor_bucket.FlattenedTensorMetadata
    cls = tensor_bucket.sglang_metadata_class()
    if cls is None:
        log.warning("weights.tensor_format=flattened: the trainer cannot import sglang.srt.weight_sync.tensor_bucket"
                    " (SGLang's flattened_bucket metadata class), so SGLang engines get one handle per tensor"
                    " (slower for MoE models: install sglang beside the trainer)")
    return cls
