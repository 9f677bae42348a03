"""Trainer side of the broadcast transport: rank 0 -> every engine over one torch.distributed group.

Uses SGLang's endpoints: /init_weights_update_group once, then per bucket
/update_weights_from_distributed {names, dtypes, shapes, group_name, weight_version on the last
bucket} while rank 0 broadcasts the bucket's tensors in the same order. NCCL/RCCL between GPUs
(InfiniBand RDMA across nodes), gloo on CPU.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch

from pipeline.config.schema import BroadcastWeightsConfig
from pipeline.launch.rendezvous import free_port, publish
from pipeline.rollout.client import EngineClient, EngineError
from pipeline.weights.buckets import buckets_of
from pipeline.weights.group import backend_for, broadcast, create_group

GROUP_NAME = "lockstep_weights"


class BroadcastSender:
    def __init__(self, cfg: BroadcastWeightsConfig, clients: list[EngineClient], device: torch.device,
                 host: str, publish_path: str | None = None):
        self.cfg, self.clients, self.device, self.host = cfg, clients, device, host
        self.publish_path = publish_path
        self.pg = None
        self.staging = device
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(clients)), thread_name_prefix="weights")

    def connect(self) -> None:
        port = free_port(self.host)
        backend = backend_for(self.device) if self.cfg.backend == "auto" else self.cfg.backend
        self.staging = torch.device("cpu") if backend == "gloo" else self.device
        world = 1 + len(self.clients)
        info = {"master_address": self.host, "master_port": port, "world_size": world, "backend": backend,
                "group_name": GROUP_NAME}
        if self.publish_path:
            publish(self.publish_path, info)
        futures = [self.pool.submit(c.checked, "/init_weights_update_group",
                                    dict(info, rank_offset=1 + i, timeout_s=self.cfg.timeout_s), self.cfg.timeout_s)
                   for i, c in enumerate(self.clients)]
        self.pg = create_group(self.host, port, 0, world, backend, self.cfg.timeout_s)
        for f in futures:
            f.result()

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, pause: bool = False) -> dict:
        """Send every tensor; engines switch to `version` with the last bucket. pause: stop the engines'
        scheduling first (requests stay in place and continue on the new weights), resume after."""
        assert self.pg is not None, "connect() first"
        t0 = time.monotonic()
        if pause:
            for c in self.clients:
                c.pause_generation()
        try:
            stats = self._send(named_tensors, version)
        finally:
            if pause:
                for c in self.clients:
                    c.continue_generation()
        stats["pause_s"] = time.monotonic() - t0 if pause else 0.0
        return stats

    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        t0 = time.monotonic()
        nbytes = 0
        nbuckets = 0
        for bucket, last in buckets_of(named_tensors, int(self.cfg.bucket_size_mb * (1 << 20))):
            body = {
                "names": [n for n, _ in bucket],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": GROUP_NAME,
                "flush_cache": last,
            }
            if last:
                body["weight_version"] = str(version)
            futures = [self.pool.submit(c.checked, "/update_weights_from_distributed", body, self.cfg.timeout_s)
                       for c in self.clients]
            for _, t in bucket:
                broadcast(self.pg, t.to(self.staging).contiguous(), src=0)
                nbytes += t.numel() * t.element_size()
            for f in futures:
                f.result(timeout=self.cfg.timeout_s)
            nbuckets += 1
        dt = time.monotonic() - t0
        return {"bytes": nbytes, "buckets": nbuckets, "seconds": dt}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.pg = None
