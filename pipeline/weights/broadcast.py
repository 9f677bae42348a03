"""weights.type=broadcast: rank 0 -> every engine over one torch.distributed group.

Uses SGLang's endpoints: /init_weights_update_group once per membership, then per bucket
/update_weights_from_distributed {names, dtypes, shapes, group_name, weight_version on the last
bucket} while rank 0 broadcasts the bucket's tensors in the same order, inside the weight-update
session (/begin_weight_update ... /end_weight_update) that common.py opens around every push. NCCL/RCCL
between GPUs (InfiniBand RDMA across nodes), gloo on CPU.

Engines come and go (a dead one is restarted with a new address): the group is rebuilt whenever the
set of live engines changes. Membership, the host copy, retries and catch-up are common.py's
(VersionSync); this file is the group and the broadcast.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from pipeline.config.schema import WeightsConfig
from pipeline.rollout import protocol
from pipeline.rollout.client import EngineClient
from pipeline.run import free_port, publish
from pipeline.weights.buckets import buckets_of
from pipeline.weights.common import EngineSet, HostCache, NamedTensors, SyncedTransport, VersionSync
from pipeline.weights.group import backend_for, broadcast, create_root_group
from pipeline.weights.quant import wire

log = logging.getLogger("lockstep.weights")
GROUP_PREFIX = "lockstep_weights"


class BroadcastTransport(SyncedTransport):
    always_pauses = False  # the engine stages buckets and applies them together with the last one

    def __init__(self, cfg: WeightsConfig, clients: list[EngineClient], device: torch.device, host: str,
                 publish_path: str | None = None, urls: Callable[[], list[str]] | None = None,
                 api_key: str | None = None):
        self.cfg, self.device, self.host, self.publish_path = cfg, device, host, publish_path
        self.pg = None
        self.group_name = ""
        self.generation = 0
        self.staging = device
        self.sync = VersionSync(cfg, self, EngineSet(clients, cfg.timeout_s, urls, api_key),
                                HostCache(cfg.keep_host_copy, device))

    # ---- the link (common.Link): a process group with the engines -------------------------------------
    @property
    def joined(self) -> bool:
        return self.pg is not None

    def join(self, engines: EngineSet) -> None:
        """A new group (its own name and port) with engines.clients: ranks 1.. in their order."""
        self.generation += 1
        self.group_name = f"{GROUP_PREFIX}_{self.generation}"
        port = free_port(self.host)
        backend = backend_for(self.device) if self.cfg.backend == "auto" else self.cfg.backend
        self.staging = torch.device("cpu") if backend == "gloo" else self.device
        world = 1 + len(engines.clients)
        info = {"master_address": self.host, "master_port": port, "world_size": world, "backend": backend,
                "group_name": self.group_name}
        if self.publish_path:
            publish(self.publish_path, dict(info, members=engines.urls))
        futures = [engines.pool.submit(c.checked, "/init_weights_update_group", protocol.init_group_body(
                       rank_offset=1 + i, timeout_s=self.cfg.timeout_s, **info), self.cfg.timeout_s)
                   for i, c in enumerate(engines.clients)]
        self.pg = create_root_group(self.host, port, world, backend, self.cfg.timeout_s, futures)
        log.info("weight group %s: %d engine(s)", self.group_name, len(engines.clients))

    def leave(self) -> None:
        self.pg = None

    def push(self, named_tensors: NamedTensors, version: int, engines: EngineSet) -> dict:
        assert self.joined, "join() first"
        t0 = time.monotonic()
        nbytes = nbuckets = 0
        for bucket, last in buckets_of(named_tensors, int(self.cfg.bucket_size_mb * (1 << 20))):
            body = protocol.update_distributed_body(bucket, self.group_name, version if last else None)
            futures = engines.post("/update_weights_from_distributed", body)
            try:
                for _, t in bucket:
                    broadcast(self.pg, wire(t.to(self.staging).contiguous()), src=0)
                    nbytes += t.numel() * t.element_size()
            finally:
                engines.answers(futures, "; the engine keeps its last complete version")
            nbuckets += 1
        return {"bytes": nbytes, "buckets": nbuckets, "seconds": time.monotonic() - t0}
