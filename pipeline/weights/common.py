"""What both weight transports share, by composition (neither transport knows the other):

  EngineSet    the engines a version goes to: the members, the live ones (from the rendezvous files
               when a resolver is given), requests to all of them in parallel and their answers within
               weights.timeout_s, pause / continue and SGLang's weight-update session (begin / end)
               around an update
  HostCache    trainer rank 0's host copy of the last version sent (weights.keep_host_copy), filled while
               the version is sent: a send cut off by a dying engine is retried from it, and a restarted
               engine is caught up from it without a trainer collective
  VersionSync  the logic around a transport's own `push`: send a version (retried from the host copy
               with the survivors) in a weight-update session on every member, catch up a restarted
               engine, the watcher thread that does so

A transport gives VersionSync its link (the `Link` protocol below: join the engines, leave, push one
version) and answers the WeightTransport interface (base.py) through it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Iterable, Iterator, Protocol

import torch

from pipeline.config.schema import WeightsConfig
from pipeline.rollout import protocol
from pipeline.rollout.client import EngineClient, EngineError

log = logging.getLogger("lockstep.weights")

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class EngineSet:
    """The engines of the current membership and how requests reach them."""

    def __init__(self, clients: list[EngineClient], timeout_s: float, urls: Callable[[], list[str]] | None = None,
                 api_key: str | None = None):
        self.clients = list(clients)
        self.timeout_s, self.urls_fn, self.api_key = timeout_s, urls, api_key
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="weights")

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.clients]

    def published(self) -> list[str]:
        """The engines' URLs as the rendezvous files have them now (without a resolver: the members')."""
        return self.urls_fn() if self.urls_fn is not None else self.urls

    def live(self) -> list[EngineClient]:
        """The engines that answer /health now (from the rendezvous files when a resolver is given)."""
        clients = self.clients
        if self.urls_fn is not None:
            known = {c.url: c for c in self.clients}
            clients = [known.get(u) or EngineClient(u, timeout_s=self.timeout_s, api_key=self.api_key)
                       for u in self.urls_fn()]
        return [c for c in clients if c.health(timeout_s=5.0)]

    def post(self, path: str, body: dict, clients: list[EngineClient] | None = None) -> list[Future]:
        """POST `body` to every member (or `clients`) at once; the futures raise if one reports failure."""
        return [self.pool.submit(c.checked, path, body, self.timeout_s) for c in (clients or self.clients)]

    def answers(self, futures: list[Future], note: str = "") -> list[dict]:
        """Every engine's answer to one update request, each within weights.timeout_s."""
        out = []
        for f in futures:
            try:
                out.append(f.result(timeout=self.timeout_s))
            except FutureTimeout as e:
                raise EngineError(f"weight update request got no answer within {self.timeout_s:.0f}s "
                                  f"(weights.timeout_s){note}") from e
        return out

    def begin_sessions(self) -> None:
        """Open a weight-update session on every member (SGLang takes tensor / distributed updates only
        inside one). A member that still holds one (its sender died mid-update) has it closed first."""
        futures = self.post("/begin_weight_update", protocol.begin_weight_update_body())
        for client, future in zip(self.clients, futures):
            try:
                self.answers([future])
            except EngineError as e:
                if protocol.SESSION_ALREADY_OPEN not in str(e):
                    raise
                log.warning("%s still had a weight-update session open (a sender died mid-update?): closing it",
                            client.url)
                client.end_weight_update(self.timeout_s)
                client.begin_weight_update(timeout_s=self.timeout_s)

    def end_sessions(self, best_effort: bool = False) -> None:
        """Close every member's session. best_effort (a failed version): failures are logged, not raised,
        so the error that ended the version is the one reported; a session left open is closed by the
        next begin_sessions()."""
        futures = self.post("/end_weight_update", protocol.end_weight_update_body())
        if not best_effort:
            self.answers(futures)
            return
        for client, future in zip(self.clients, futures):
            try:
                self.answers([future])
            except EngineError as e:
                log.warning("closing the weight-update session of %s failed: %s", client.url, e)

    def paused(self, fn: Callable[[], dict], pause: bool) -> dict:
        """fn()'s stats, with the engines' scheduling paused around it when `pause` (requests stay in
        place and continue on the new weights); stats gain `paused` and `pause_s`."""
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
                        pass  # a dead engine has nothing to continue; the next send finds it gone
        stats["paused"] = pause
        stats["pause_s"] = time.monotonic() - t0 if pause else 0.0
        return stats

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class HostCache:
    """The last version sent, in host memory (`keep`: weights.keep_host_copy; else it holds nothing).

    Device tensors are copied into pinned buffers kept per name between versions (a pageable copy of a
    0.5B model took 0.59 s on the H200) on a side stream, so a send waits for none of them (PCIe at
    ~50 GB/s would add ~0.16 s per 8 GB version); `settle()` waits for them before the cache is read."""

    def __init__(self, keep: bool, device: torch.device):
        self.keep = keep
        self.buffers: dict[str, torch.Tensor] = {}
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.named: list[tuple[str, torch.Tensor]] | None = None  # the last complete version
        self.version: int | None = None
        self.filling: list[tuple[str, torch.Tensor]] = []  # the version being sent

    def start(self) -> None:
        """A new version begins: the pinned buffers are rewritten with it, the old copy is gone."""
        self.named, self.version, self.filling = None, None, []

    def hold(self, name: str, t: torch.Tensor) -> None:
        if self.keep:
            self.filling.append((name, self._copy(name, t)))

    def tap(self, source: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """`source`'s items, each held as it passes."""
        for name, t in source:
            self.hold(name, t)
            yield name, t

    def commit(self, version: int) -> None:
        """The version being sent is complete (its copies may still be in flight: settle() before reading)."""
        if self.keep:
            self.named, self.version = self.filling, version

    def settle(self) -> None:
        """Wait for the host copies in flight."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def _copy(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`t` in host memory; a device tensor on the copy stream once the export has produced it, and
        its memory is not reused before the copy has read it."""
        if t.device.type != "cuda":
            return t.detach().to("cpu", copy=True)
        buf = self.buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.buffers[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.copy_stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.copy_stream):
            buf.copy_(t.detach(), non_blocking=True)
        t.record_stream(self.copy_stream)
        return buf


class Link(Protocol):
    """A transport's own part: how one version's tensors reach the engines."""

    always_pauses: bool
    """True: the engines are paused around every send of this transport, whatever the caller asks."""

    @property
    def joined(self) -> bool:
        """Set up with the current members (False: the next send joins them first)."""

    def join(self, engines: EngineSet) -> None:
        """Set up with engines.clients (raises EngineError / RuntimeError when one does not take part)."""

    def leave(self) -> None:
        """Forget the set-up."""

    def push(self, named_tensors: NamedTensors, version: int, engines: EngineSet) -> dict:
        """Move one complete version to engines.clients; engines switch with the last bucket. Stats:
        bytes, buckets, seconds."""


class VersionSync:
    """Send, retry, catch up and watch for a transport whose link does the moving."""

    def __init__(self, cfg: WeightsConfig, link: Link, engines: EngineSet, cache: HostCache, attempts: int = 3):
        self.cfg, self.link, self.engines, self.cache, self.attempts = cfg, link, engines, cache, attempts
        self.lock = threading.RLock()
        self._stop: threading.Event | None = None

    def connect(self, clients: list[EngineClient] | None = None) -> None:
        """(Re)join `clients` (default: the live engines). A member that cannot join (it died since its
        address was published, and its launcher is restarting it on a new one) costs a retry with the
        engines live then, each given weights.timeout_s to come back."""
        with self.lock:
            for attempt in range(self.attempts):
                if clients is None or attempt:
                    self.wait_live(self.cfg.timeout_s)
                    clients = self.engines.live()
                if not clients:
                    raise EngineError("no live engine to send weights to")
                self.engines.clients = list(clients)
                try:
                    self.link.join(self.engines)
                    return
                except (EngineError, RuntimeError) as e:
                    self.link.leave()
                    if attempt == self.attempts - 1:
                        raise EngineError(f"joining the engines failed {self.attempts} times: {e}") from e
                    log.warning("joining the engines failed (%s); again with the live ones", e)

    def ensure_members(self) -> bool:
        """Join again if the live engines are not the members. Returns True if it did."""
        with self.lock:
            live = self.engines.live()
            if [c.url for c in live] == self.engines.urls and self.link.joined:
                return False
            self.connect(live)
            return True

    def send(self, named_tensors: NamedTensors, version: int, pause: bool = False) -> dict:
        """Send a complete version (see WeightTransport.send). `named_tensors` may be a collective
        generator (FSDP gathers): it is always consumed to the end, also when the send fails, so the
        other trainer ranks never hang in a gather."""
        pause = pause or self.link.always_pauses
        with self.lock:
            source = iter(named_tensors)
            self.cache.start()
            try:
                self.ensure_members()
                stats = self._push(self.cache.tap(source), version, pause)
            except (EngineError, RuntimeError) as e:
                for name, t in source:  # the rest of the collective gather
                    self.cache.hold(name, t)
                self.cache.settle()
                if not self.cache.keep or self.attempts <= 1:
                    raise EngineError(f"weight update to version {version} failed: {e}") from e
                log.warning("weight update to version %d failed (%s); retrying with the live engines", version, e)
                stats = self._retry(self.cache.filling, version, pause, self.attempts - 1)
            self.cache.commit(version)
            return stats

    def _push(self, named_tensors: NamedTensors, version: int, pause: bool) -> dict:
        return self.engines.paused(lambda: self._push_in_session(named_tensors, version), pause)

    def _push_in_session(self, named_tensors: NamedTensors, version: int) -> dict:
        """The link's push inside a weight-update session on every member: every send, retry and
        catch-up comes here, so a restarted engine gets its own session. A push that fails closes the
        sessions best-effort before the error goes on."""
        try:
            self.engines.begin_sessions()
            stats = self.link.push(named_tensors, version, self.engines)
        except BaseException:
            self.engines.end_sessions(best_effort=True)
            raise
        self.engines.end_sessions()
        return stats

    def _retry(self, cached: list[tuple[str, torch.Tensor]], version: int, pause: bool, attempts: int) -> dict:
        for attempt in range(attempts):
            self.link.leave()
            try:
                self.wait_live(self.cfg.timeout_s)
                self.ensure_members()
                stats = self._push(cached, version, pause)
                stats["retries"] = attempt + 1
                return stats
            except (EngineError, RuntimeError) as e:
                if attempt == attempts - 1:
                    raise EngineError(f"weight update to version {version} failed {attempts + 1} times: {e}") from e
                log.warning("weight update retry %d failed (%s)", attempt + 1, e)
        raise AssertionError("unreachable")

    def wait_live(self, timeout_s: float) -> None:
        """Give a dead sole engine up to `timeout_s` to come back (its launcher restarts it) before a retry."""
        deadline = time.monotonic() + timeout_s
        while not self.engines.live() and time.monotonic() < deadline:
            time.sleep(1.0)

    def catch_up(self) -> bool:
        """If the published engine URLs changed (an engine was restarted on a new port), join the live
        ones and send them the last version from the host copy. Returns True if it did."""
        with self.lock:
            if self.engines.published() == self.engines.urls and self.link.joined:
                return False
            try:
                self.connect(self.engines.live())
                if self.cache.named is not None:
                    self.cache.settle()
                    stats = self._push(self.cache.named, self.cache.version, pause=True)
                    log.info("caught up %d engine(s) to version %s in %.2fs", len(self.engines.clients),
                             self.cache.version, stats["seconds"])
            except (EngineError, RuntimeError) as e:
                self.link.leave()  # try again on the next call
                self.engines.clients = []
                log.warning("catching up engines failed (%s); will retry", e)
                return False
            return True

    def watch(self, interval_s: float) -> None:
        """Run catch_up() every interval_s in a daemon thread until close()."""
        self._stop = stop = threading.Event()

        def loop():
            while not stop.wait(interval_s):
                try:
                    self.catch_up()
                except Exception:  # never let the watcher die silently
                    log.exception("engine watcher")

        threading.Thread(target=loop, name="engine-watch", daemon=True).start()

    def close(self) -> None:
        if self._stop is not None:
            self._stop.set()
        self.engines.close()
        self.link.leave()


class SyncedTransport:
    """The WeightTransport (base.py) methods every transport delegates to its VersionSync (`self.sync`):
    a transport class adds only its link (join / leave / push)."""

    sync: VersionSync

    @property
    def clients(self) -> list[EngineClient]:
        return self.sync.engines.clients

    def connect(self, clients: list[EngineClient] | None = None) -> None:
        self.sync.connect(clients)

    def send(self, named_tensors: NamedTensors, version: int, pause: bool = False) -> dict:
        return self.sync.send(named_tensors, version, pause)

    def catch_up(self) -> bool:
        return self.sync.catch_up()

    def watch(self, interval_s: float = 2.0) -> None:
        self.sync.watch(interval_s)

    def live_clients(self) -> list[EngineClient]:
        return self.sync.engines.live()

    def close(self) -> None:
        self.sync.close()
