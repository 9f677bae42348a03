"""HTTP client for SGLang-protocol engines (the built-in engine and real `sglang.launch_server`).

`EngineClient` wraps one server; `EnginePool` spreads requests over several by least in-flight load
and retries a failed request on another engine, so a dying engine costs time, not samples.
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from pipeline.rollout import protocol
from pipeline.rollout.protocol import MemoryAction, MemoryTag


class EngineError(RuntimeError):
    pass


class EngineStateError(EngineError):
    """The engine refuses the request in a state only a control call changes (HTTP 409: memory released,
    weights not refilled after a release): retrying the request elsewhere or later cannot help."""


@dataclass
class Generation:
    """One response, decoded from SGLang's /generate output."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int | None  # None: the engine reported none
    text: str = ""
    routed_experts: np.ndarray | None = None  # [prompt+response-1, moe_layers, top_k]
    engine_url: str = ""
    spec_verify_ct: int = 0  # speculative decoding: verify forwards that produced this response
    cached_tokens: int = 0  # prompt tokens the engine took from its prefix cache (SGLang's meta_info)


def decode_routed_experts(b64: str, num_moe_layers: int, top_k: int) -> np.ndarray:
    flat = np.frombuffer(base64.b64decode(b64), dtype="<i4") if b64 else np.zeros(0, dtype="<i4")
    return flat.reshape(-1, num_moe_layers, top_k)


@dataclass
class EngineClient:
    url: str
    timeout_s: float = 120.0
    api_key: str | None = None
    in_flight: int = 0
    _old_api: bool = field(default=False, repr=False)  # the server answers /get_weight_version, not /model_info
    _local: threading.local = field(default_factory=threading.local, repr=False)

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            u = urllib.parse.urlparse(self.url)
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=self.timeout_s)
            self._local.conn = conn
        return conn

    def request(self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None):
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in range(2):  # a kept-alive connection the server closed is retried once
            conn = self._conn()
            conn.timeout = timeout_s or self.timeout_s
            if conn.sock is not None:
                conn.sock.settimeout(conn.timeout)
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                payload = resp.read()
            except (ConnectionError, http.client.HTTPException, OSError) as e:
                conn.close()
                self._local.conn = None
                if attempt == 0 and isinstance(e, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)):
                    continue
                raise EngineError(f"{self.url}{path}: {type(e).__name__}: {e}") from None
            if resp.status == 409:
                raise EngineStateError(f"{self.url}{path}: {payload[:300].decode(errors='replace')}")
            if resp.status >= 400:
                raise EngineError(f"{self.url}{path}: HTTP {resp.status}: {payload[:300]!r}")
            if not payload:
                return {}
            try:
                return json.loads(payload)
            except json.JSONDecodeError:  # e.g. sglang-router's /health answers plain "OK"
                return {"text": payload.decode(errors="replace")}
        raise AssertionError("unreachable")

    def health(self, timeout_s: float = 5.0) -> bool:
        try:
            self.request("GET", "/health", timeout_s=timeout_s)
            return True
        except EngineError:
            return False

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict], *, return_logprob: bool = True,
                 return_routed_experts: bool = False, rid: list[str] | None = None,
                 moe_shape: tuple[int, int] | None = None, one_by_one: bool = False) -> list[Generation]:
        if one_by_one and len(input_ids) > 1:
            # sglang-router takes one prompt per request (its body type has a single sampling_params
            # map); each then goes to the engine the router picks.
            with ThreadPoolExecutor(max_workers=min(len(input_ids), 32)) as ex:
                parts = ex.map(lambda i: self.generate(
                    [input_ids[i]], [sampling_params[i]], return_logprob=return_logprob,
                    return_routed_experts=return_routed_experts, rid=[rid[i]] if rid else None, moe_shape=moe_shape,
                    one_by_one=True),
                    range(len(input_ids)))
                return [g for part in parts for g in part]
        if one_by_one:
            body = protocol.generate_body(input_ids[0], sampling_params[0], return_logprob=return_logprob,
                                          return_routed_experts=return_routed_experts, rid=rid[0] if rid else None)
        else:
            body = protocol.generate_body(input_ids, sampling_params, return_logprob=return_logprob,
                                          return_routed_experts=return_routed_experts, rid=rid)
        out = self.request("POST", "/generate", body)
        if isinstance(out, dict):
            out = [out]
        gens = []
        for item in out:
            meta = item["meta_info"]
            lps = meta.get("output_token_logprobs") or []
            routed = None
            if return_routed_experts and moe_shape is not None:
                routed = decode_routed_experts(meta.get("routed_experts") or "", *moe_shape)
            fr = meta.get("finish_reason") or {}
            gens.append(Generation(
                output_ids=list(item["output_ids"]),
                logprobs=[float(x[0]) for x in lps],
                finish_reason=fr.get("type", "length") if isinstance(fr, dict) else str(fr),
                weight_version=protocol.version_from_wire(meta.get("weight_version")),
                text=item.get("text", ""),
                routed_experts=routed,
                engine_url=self.url,
                spec_verify_ct=int(meta.get("spec_verify_ct") or 0),
                cached_tokens=int(meta.get("cached_tokens") or 0),
            ))
        return gens

    def flush_cache(self) -> None:
        self.request("POST", "/flush_cache", {})

    def pause_generation(self) -> None:
        self.request("POST", "/pause_generation", {})

    def continue_generation(self) -> None:
        self.request("POST", "/continue_generation", {})

    def abort_all(self) -> None:
        self.request("POST", "/abort_request", protocol.abort_body())

    def weight_version(self, timeout_s: float | None = None) -> int | None:
        """The version the engine holds (None: it reports none). SGLang >= 0.5.2x reports it in
        /model_info; older releases have /get_weight_version."""
        if not self._old_api:
            try:
                return protocol.version_from_wire(
                    self.request("GET", "/model_info", timeout_s=timeout_s).get("weight_version"))
            except EngineError as e:
                if "HTTP 404" not in str(e):
                    raise
                self._old_api = True
        return protocol.version_from_wire(self.request("GET", "/get_weight_version", timeout_s=timeout_s).get("weight_version"))

    def begin_weight_update(self, selector: protocol.WeightSelector = protocol.WeightSelector.ALL,
                            timeout_s: float | None = None) -> dict:
        """Open a weight-update session: SGLang (and the built-in engine) take /update_weights_from_tensor
        and /update_weights_from_distributed only inside one, and refuse a second while one is open."""
        return self.checked("/begin_weight_update", protocol.begin_weight_update_body(selector), timeout_s)

    def end_weight_update(self, timeout_s: float | None = None) -> dict:
        """Close the open weight-update session (after a version's last bucket)."""
        return self.checked("/end_weight_update", protocol.end_weight_update_body(), timeout_s)

    @contextmanager
    def weight_update_session(self, selector: protocol.WeightSelector = protocol.WeightSelector.ALL):
        """begin_weight_update(), the block, end_weight_update() (also when the block raises)."""
        self.begin_weight_update(selector)
        try:
            yield self
        finally:
            self.end_weight_update()

    def update_weights_from_tensor(self, named, version: int | None = None, tp_size: int = 1,
                                   timeout_s: float | None = None, flattened: bool = False) -> dict:
        """Colocated engines (same node), inside a weight-update session: tensors travel as shared-memory /
        CUDA IPC handles, one per tensor, or (flattened) one per request: SGLang's flattened_bucket with Lockstep's metadata class,
        which the built-in engine reads (weights/tensor.py picks SGLang's own class for SGLang)."""
        if not flattened:
            return self.checked("/update_weights_from_tensor", protocol.update_tensor_body(named, tp_size, version),
                                timeout_s)
        from pipeline.rollout import tensor_bucket  # torch: only where weights are sent

        flat, metadata = tensor_bucket.flatten(list(named))  # alive until the engine has answered
        return self.checked("/update_weights_from_tensor",
                            protocol.update_flattened_bucket_body(flat, metadata, tp_size, version), timeout_s)

    def update_weights_from_disk(self, model_path: str, version: int | None = None,
                                 timeout_s: float | None = None) -> dict:
        """Engines that share a filesystem with the trainer: an HF checkpoint directory."""
        return self.checked("/update_weights_from_disk", protocol.update_disk_body(model_path, version), timeout_s)

    def release_memory(self, tags: Sequence[MemoryTag] | None = None) -> dict:
        """Colocated engines: give the tags' device memory back (None: all)."""
        return self.memory(MemoryAction.RELEASE, tags)

    def resume_memory(self, tags: Sequence[MemoryTag] | None = None) -> dict:
        """Colocated engines: take the tags' device memory again (None: all)."""
        return self.memory(MemoryAction.RESUME, tags)

    def memory(self, action: MemoryAction, tags: Sequence[MemoryTag] | None = None) -> dict:
        return self.checked(f"/{MemoryAction(action).value}_memory_occupation", protocol.memory_body(tags))

    def checked(self, path: str, body: dict, timeout_s: float | None = None) -> dict:
        """POST to a weight endpoint and raise if it reports success: false."""
        out = self.request("POST", path, body, timeout_s=timeout_s)
        if not out.get("success", False):
            raise EngineError(f"{self.url}{path}: {out.get('message')}")
        return out


class EnginePool:
    """Least-loaded routing over engines, with retry on another engine when one fails.

    Sticky sessions: `generate(session=key)` goes back to the engine that served `key` last while it is
    alive and ready (a continued partial rollout or a multi-turn conversation finds its prefix in that
    engine's cache), else to the least loaded one, which then becomes the session's engine.

    `resolve` (optional) returns the engines' current URLs: after a failure the pool re-reads them,
    so an engine that was restarted (new port) is used again. `generate(min_version=v)` routes only to
    engines that hold weight version >= v (a freshly restarted engine starts at version 0 until the
    trainer has caught it up). Retries go on, with backoff, for `retry_budget_s` seconds in all.
    """

    def __init__(self, urls: list[str], timeout_s: float = 120.0, max_retries: int = 3, api_key: str | None = None,
                 resolve=None, retry_budget_s: float | None = None, frontend=None):
        if not urls:
            raise EngineError("no engines to route to")
        self.timeout_s, self.api_key, self.resolve = timeout_s, api_key, resolve
        self.clients = [EngineClient(u, timeout_s=timeout_s, api_key=api_key) for u in urls]
        self.max_retries = max_retries
        self.retry_budget_s = retry_budget_s
        self.lock = threading.Lock()
        self.failures: dict[str, int] = {}
        self.versions: dict[str, int] = {}
        self.asked: dict[str, tuple[float, int]] = {}  # url -> (when, the version wanted) of its last ask
        self.asking: dict[str, threading.Event] = {}  # url -> set when the ask in flight has its answer
        self.refreshed = time.monotonic()
        self.retries = 0
        self.sticky: OrderedDict[str, str] = OrderedDict()  # session -> engine URL, least recent first
        self.max_sessions = 100_000
        self.turn = 0
        # frontend(urls) -> a router's URL: /generate goes there (the router picks the engine), once
        # every engine holds the wanted weight version; versions are still asked of each engine.
        self.frontend = frontend
        self.frontend_clients: dict[str, EngineClient] = {}

    def abort_all(self) -> None:
        """Abort every in-flight request on every engine (the surplus of an over-sampled step)."""
        for c in list(self.clients):
            try:
                c.abort_all()
            except EngineError:
                pass  # an engine that is gone has nothing in flight

    def refresh(self) -> None:
        """Re-read the engines' URLs (a restarted engine publishes a new one)."""
        if self.resolve is None:
            return
        self.refreshed = time.monotonic()
        urls = self.resolve()
        with self.lock:
            known = {c.url: c for c in self.clients}
            self.clients = [known.get(u) or EngineClient(u, timeout_s=self.timeout_s, api_key=self.api_key) for u in urls]
            for u in list(self.versions):
                if u not in urls:
                    del self.versions[u]

    def version_of(self, client: EngineClient, at_least: int = 0) -> int:
        """The engine's weight version: the last one seen, asked again while it is below `at_least`: at
        once for a version not asked for yet (the next step's), else at most twice a second (a restarted
        engine is caught up by the trainer a little later). One ask per engine at a time: a caller that
        finds one in flight waits for its answer (half a second at most) rather than take the version it
        had, which would send each of a step's requests into a retry's back-off (0.4 s) at its start."""
        url = client.url
        while True:
            with self.lock:
                v = self.versions.get(url, -1)
                if v >= at_least:
                    return v
                asking = self.asking.get(url)
                if asking is None:
                    when, wanted = self.asked.get(url, (0.0, -1))
                    if at_least <= wanted and time.monotonic() - when <= 0.5:
                        return v
                    self.asked[url] = (time.monotonic(), at_least)
                    answered = self.asking[url] = threading.Event()
                    break
            if not asking.wait(0.5):
                return v  # the engine is slow to answer: the version it had
        try:
            reply = client.weight_version(timeout_s=5.0)
            with self.lock:
                v = self.versions[url] = max(self.versions.get(url, -1), reply if reply is not None else 0)
            return v
        finally:
            with self.lock:
                del self.asking[url]
            answered.set()

    def note_version(self, url: str, version: int | None) -> None:
        if version is not None:
            self.versions[url] = max(self.versions.get(url, 0), version)

    def _pick(self, exclude: set[str], n: int, min_version: int, session: str | None = None) -> EngineClient | None:
        if time.monotonic() - self.refreshed > 5.0:  # pick up restarted engines even when nothing failed
            self.refresh()
        with self.lock:
            candidates = [c for c in self.clients if c.url not in exclude] or list(self.clients)
        ready = []
        for c in candidates:
            try:
                if self.version_of(c, min_version) >= min_version:
                    ready.append(c)
            except EngineError:
                self.versions.pop(c.url, None)
        if not ready:
            return None
        if self.frontend is not None:
            if len(ready) < len(candidates):
                return None  # the router may pick any engine: wait until all are caught up
            url = self.frontend([c.url for c in self.clients])
            with self.lock:
                client = self.frontend_clients.setdefault(url, EngineClient(url, self.timeout_s, self.api_key))
                client.in_flight += n
                return client
        with self.lock:
            home = self.sticky.get(session) if session is not None else None
            self.turn += 1  # ties (e.g. all idle) go round robin
            rotated = ready[self.turn % len(ready):] + ready[:self.turn % len(ready)]
            client = next((c for c in ready if c.url == home), None) or min(
                rotated, key=lambda c: (c.in_flight, self.failures.get(c.url, 0)))
            client.in_flight += n  # reserved under the lock, released when the call returns
            return client

    def remember(self, session: str | None, url: str) -> None:
        if session is None:
            return
        with self.lock:
            self.sticky[session] = url
            self.sticky.move_to_end(session)
            while len(self.sticky) > self.max_sessions:
                self.sticky.popitem(last=False)

    def generate(self, input_ids, sampling_params, min_version: int = 0, session: str | None = None,
                 **kw) -> list[Generation]:
        tried: set[str] = set()
        last: Exception | None = None
        budget = self.retry_budget_s
        deadline = time.monotonic() + budget if budget else None
        attempt = 0
        while True:
            attempt += 1
            client = self._pick(tried, len(input_ids), min_version, session)
            if client is not None:
                try:
                    gens = client.generate(input_ids, sampling_params, one_by_one=self.frontend is not None, **kw)
                    stale = [g.weight_version for g in gens
                             if g.weight_version is not None and g.weight_version < min_version]
                    if stale:  # only through a router: an engine restarted behind it answered first
                        raise EngineError(f"{client.url} answered with weight version {stale[0]} < {min_version}")
                    for g in gens:
                        self.note_version(client.url, g.weight_version)
                    self.remember(session, client.url)
                    return gens
                except EngineStateError:
                    raise
                except EngineError as e:
                    last = e
                    tried.add(client.url)
                    with self.lock:
                        self.failures[client.url] = self.failures.get(client.url, 0) + 1
                        self.retries += 1
                        self.versions.pop(client.url, None)
                finally:
                    with self.lock:
                        client.in_flight -= len(input_ids)
            else:
                last = last or EngineError(f"no engine holds weight version >= {min_version} yet")
            out_of_time = deadline is not None and time.monotonic() > deadline
            if (deadline is None and attempt >= self.max_retries) or out_of_time:
                raise EngineError(f"request failed on {len(tried)} engine(s) after {attempt} attempts: {last}")
            time.sleep(min(0.2 * 2 ** min(attempt, 4), 2.0))
            self.refresh()
            if len(tried) >= len(self.clients):
                tried.clear()  # every engine failed once: try them again (one may have come back)
