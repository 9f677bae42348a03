"""Trainer side of the broadcast transport: rank 0 -> every engine over one torch.distributed group.

Uses SGLang's endpoints: /init_weights_update_group once per membership, then per bucket
/update_weights_from_distributed {names, dtypes, shapes, group_name, weight_version on the last
bucket} while rank 0 broadcasts the bucket's tensors in the same order. NCCL/RCCL between GPUs
(InfiniBand RDMA across nodes), gloo on CPU.

Engines come and go (a dead one is restarted with a new address): the group is rebuilt whenever the
set of live engines changes. With keep_host_copy, rank 0 copies each tensor to host memory as it sends
it, so a send cut off by a dying engine is retried from that copy with the survivors, and a restarted
engine is caught up later from the same copy without a trainer collective.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Iterable

import torch

from pipeline.config.schema import WeightsConfig
from pipeline.rollout import protocol
from pipeline.rollout.client import EngineClient, EngineError
from pipeline.run import free_port, publish
from pipeline.weights.buckets import buckets_of
from pipeline.weights.quant import wire
from pipeline.weights.group import backend_for, broadcast, create_group

log = logging.getLogger("lockstep.weights")
GROUP_PREFIX = "lockstep_weights"


class BroadcastSender:
    def __init__(self, cfg: WeightsConfig, clients: list[EngineClient], device: torch.device,
                 host: str, publish_path: str | None = None, urls: Callable[[], list[str]] | None = None,
                 api_key: str | None = None):
        self.cfg, self.device, self.host = cfg, device, host
        self.clients = clients
        self.publish_path, self.urls_fn, self.api_key = publish_path, urls, api_key
        self.pg = None
        self.group_name = ""
        self.generation = 0
        self.staging = device
        self.lock = threading.RLock()
        self.cache: list[tuple[str, torch.Tensor]] | None = None
        self.host_buffers: dict[str, torch.Tensor] = {}
        self.cache_version: int | None = None
        # Host copies run on their own stream: a send waits for none of them (PCIe at ~50 GB/s would
        # add ~0.16 s per 8 GB version); they are waited for only before the cache is read.
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="weights")

    # ---- membership ------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self.pg is not None

    def disconnect(self) -> None:
        self.pg = None

    @property
    def members(self) -> list[str]:
        return [c.url for c in self.clients]

    def live_clients(self) -> list[EngineClient]:
        """The engines that answer /health now (from the rendezvous files when a resolver is given)."""
        clients = self.clients
        if self.urls_fn is not None:
            known = {c.url: c for c in self.clients}
            clients = [known.get(u) or EngineClient(u, timeout_s=self.cfg.timeout_s, api_key=self.api_key)
                       for u in self.urls_fn()]
        return [c for c in clients if c.health(timeout_s=5.0)]

    def connect(self, clients: list[EngineClient] | None = None) -> None:
        """(Re)build the group with `clients` (default: the live engines)."""
        with self.lock:
            self.clients = clients if clients is not None else self.live_clients()
            if not self.clients:
                raise EngineError("no live engine to send weights to")
            self.generation += 1
            self.group_name = f"{GROUP_PREFIX}_{self.generation}"
            port = free_port(self.host)
            backend = backend_for(self.device) if self.cfg.backend == "auto" else self.cfg.backend
            self.staging = torch.device("cpu") if backend == "gloo" else self.device
            world = 1 + len(self.clients)
            info = {"master_address": self.host, "master_port": port, "world_size": world, "backend": backend,
                    "group_name": self.group_name}
            if self.publish_path:
                publish(self.publish_path, dict(info, members=self.members))
            futures = [self.pool.submit(c.checked, "/init_weights_update_group", protocol.init_group_body(
                           rank_offset=1 + i, timeout_s=self.cfg.timeout_s, **info), self.cfg.timeout_s)
                       for i, c in enumerate(self.clients)]
            self.pg = create_group(self.host, port, 0, world, backend, self.cfg.timeout_s)
            for f in futures:
                f.result()
            log.info("weight group %s: %d engine(s)", self.group_name, len(self.clients))

    def ensure_members(self) -> bool:
        """Rebuild the group if the live engines are not the group's members. Returns True if rebuilt."""
        with self.lock:
            live = self.live_clients()
            if [c.url for c in live] == self.members and self.connected:
                return False
            self.connect(live)
            return True

    # ---- sending ---------------------------------------------------------------------------------
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, pause: bool = False,
             attempts: int = 3) -> dict:
        """Send a complete version; engines switch with the last bucket. pause: stop the engines'
        scheduling around the update (requests stay in place and continue on the new weights).

        `named_tensors` may be a collective generator (FSDP gathers): it is always consumed to the end,
        also when the send fails, so the other trainer ranks never hang in a gather."""
        with self.lock:
            keep = self.cfg.keep_host_copy
            cache: list[tuple[str, torch.Tensor]] = []
            source = iter(named_tensors)
            self.cache = None  # its pinned buffers are rewritten with this version

            def hold(n, t):
                if keep:
                    cache.append((n, self._host_copy(n, t)))

            def tapped():
                for n, t in source:
                    hold(n, t)
                    yield n, t

            try:
                self.ensure_members()
                stats = self._paused(lambda: self._send(tapped(), version), pause)
            except (EngineError, RuntimeError) as e:
                for n, t in source:  # the rest of the collective gather
                    hold(n, t)
                self._settle()
                if not keep or attempts <= 1:
                    raise EngineError(f"weight update to version {version} failed: {e}") from e
                log.warning("weight update to version %d failed (%s); retrying with the live engines", version, e)
                stats = self._retry(cache, version, pause, attempts - 1)
            if keep:  # its copies may still be in flight: _settle() before reading it
                self.cache, self.cache_version = cache, version
            return stats

    def _host_copy(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`t` copied to host memory: for device tensors into a pinned buffer kept per name between
        versions (a pageable copy of a 0.5B model took 0.59 s on the H200), on the copy stream once the
        export has produced `t`; `t`'s memory is not reused before the copy has read it. `_settle`
        waits for the copies."""
        if t.device.type != "cuda":
            return t.detach().to("cpu", copy=True)
        buf = self.host_buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.host_buffers[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.copy_stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.copy_stream):
            buf.copy_(t.detach(), non_blocking=True)
        t.record_stream(self.copy_stream)
        return buf

    def _settle(self) -> None:
        """Wait for the host copies in flight (before the cache is read)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def _retry(self, cache, version: int, pause: bool, attempts: int) -> dict:
        self._settle()
        for attempt in range(attempts):
            self.disconnect()
            try:
                self.ensure_members()
                stats = self._paused(lambda: self._send(cache, version), pause)
                stats["retries"] = attempt + 1
                return stats
            except (EngineError, RuntimeError) as e:
                if attempt == attempts - 1:
                    raise EngineError(f"weight update to version {version} failed {attempts + 1} times: {e}") from e
                log.warning("weight update retry %d failed (%s)", attempt + 1, e)
        raise AssertionError("unreachable")

    def resend_cached(self) -> dict | None:
        """Send the last version again to the group's members (after one was restarted)."""
        with self.lock:
            if self.cache is None:
                return None
            self._settle()
            return self._paused(lambda: self._send(self.cache, self.cache_version), pause=True)

    def catch_up(self) -> bool:
        """If the published engine URLs changed (an engine was restarted on a new port), rebuild the group
        with the live ones and send them the last version. Returns True if it did."""
        with self.lock:
            urls = self.urls_fn() if self.urls_fn is not None else self.members
            if urls == self.members and self.connected:
                return False
            try:
                self.connect(self.live_clients())
                if self.cache is not None:
                    stats = self.resend_cached()
                    log.info("caught up %d engine(s) to version %s in %.2fs", len(self.clients), self.cache_version,
                             stats["seconds"])
            except (EngineError, RuntimeError) as e:
                self.disconnect()  # try again on the next call
                self.clients = []
                log.warning("catching up engines failed (%s); will retry", e)
                return False
            return True

    def watch(self, interval_s: float = 2.0) -> None:
        """Run catch_up() every interval_s in a daemon thread (rank 0, while it waits for rollouts)."""
        self._stop = threading.Event()

        def loop():
            while not self._stop.wait(interval_s):
                try:
                    self.catch_up()
                except Exception:  # never let the watcher die silently
                    log.exception("engine watcher")

        threading.Thread(target=loop, name="engine-watch", daemon=True).start()

    def _paused(self, fn, pause: bool) -> dict:
        t0 = time.monotonic()
        if pause:
            for c in self.clients:
                c.pause_generation()
        try:
            stats = fn()
        finally:
            if pause:
                for c in self.clients:
                    try:
                        c.continue_generation()
                    except EngineError:
                        pass
        stats["pause_s"] = time.monotonic() - t0 if pause else 0.0
        return stats

    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        assert self.connected, "connect() first"
        t0 = time.monotonic()
        nbytes = nbuckets = 0
        for bucket, last in buckets_of(named_tensors, int(self.cfg.bucket_size_mb * (1 << 20))):
            body = protocol.update_distributed_body(bucket, self.group_name, version if last else None)
            futures = [self.pool.submit(c.checked, "/update_weights_from_distributed", body, self.cfg.timeout_s)
                       for c in self.clients]
            try:
                for _, t in bucket:
                    broadcast(self.pg, wire(t.to(self.staging).contiguous()), src=0)
                    nbytes += t.numel() * t.element_size()
            finally:
                self._answers(futures, "; the engine keeps its last complete version")
            nbuckets += 1
        return {"bytes": nbytes, "buckets": nbuckets, "seconds": time.monotonic() - t0}

    def _answers(self, futures, note: str = "") -> list[dict]:
        """Every engine's answer to one update request, each within weights.timeout_s."""
        out = []
        for f in futures:
            try:
                out.append(f.result(timeout=self.cfg.timeout_s))
            except FutureTimeout as e:
                raise EngineError(f"weight update request got no answer within {self.cfg.timeout_s:.0f}s "
                                  f"(weights.timeout_s){note}") from e
        return out

    def close(self) -> None:
        if getattr(self, "_stop", None) is not None:
            self._stop.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.disconnect()
