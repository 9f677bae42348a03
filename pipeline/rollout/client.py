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
from dataclasses import dataclass, field

import numpy as np


class EngineError(RuntimeError):
    pass


@dataclass
class Generation:
    """One response, decoded from SGLang's /generate output."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str
    text: str = ""
    routed_experts: np.ndarray | None = None  # [prompt+response-1, moe_layers, top_k]
    engine_url: str = ""


def decode_routed_experts(b64: str, num_moe_layers: int, top_k: int) -> np.ndarray:
    flat = np.frombuffer(base64.b64decode(b64), dtype="<i4") if b64 else np.zeros(0, dtype="<i4")
    return flat.reshape(-1, num_moe_layers, top_k)


@dataclass
class EngineClient:
    url: str
    timeout_s: float = 120.0
    api_key: str | None = None
    in_flight: int = 0
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
            if resp.status >= 400:
                raise EngineError(f"{self.url}{path}: HTTP {resp.status}: {payload[:300]!r}")
            return json.loads(payload) if payload else {}
        raise AssertionError("unreachable")

    def health(self, timeout_s: float = 5.0) -> bool:
        try:
            self.request("GET", "/health", timeout_s=timeout_s)
            return True
        except EngineError:
            return False

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict], *, return_logprob: bool = True,
                 return_routed_experts: bool = False, rid: list[str] | None = None,
                 moe_shape: tuple[int, int] | None = None) -> list[Generation]:
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob}
        if return_routed_experts:
            body["return_routed_experts"] = True
        if rid is not None:
            body["rid"] = rid
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
                weight_version=str(meta.get("weight_version", "")),
                text=item.get("text", ""),
                routed_experts=routed,
                engine_url=self.url,
            ))
        return gens

    def flush_cache(self) -> None:
        self.request("POST", "/flush_cache", {})

    def pause_generation(self) -> None:
        self.request("POST", "/pause_generation", {})

    def continue_generation(self) -> None:
        self.request("POST", "/continue_generation", {})

    def abort_all(self) -> None:
        self.request("POST", "/abort_request", {"abort_all": True, "rid": ""})

    def weight_version(self) -> str:
        return str(self.request("GET", "/get_weight_version").get("weight_version"))

    def checked(self, path: str, body: dict, timeout_s: float | None = None) -> dict:
        """POST to a weight endpoint and raise if it reports success: false."""
        out = self.request("POST", path, body, timeout_s=timeout_s)
        if not out.get("success", False):
            raise EngineError(f"{self.url}{path}: {out.get('message')}")
        return out


class EnginePool:
    """Least-loaded routing over engines, with retry on another engine when one fails."""

    def __init__(self, urls: list[str], timeout_s: float = 120.0, max_retries: int = 3, api_key: str | None = None):
        if not urls:
            raise EngineError("no engines to route to")
        self.clients = [EngineClient(u, timeout_s=timeout_s, api_key=api_key) for u in urls]
        self.max_retries = max_retries
        self.lock = threading.Lock()
        self.failures: dict[str, int] = {}
        self.retries = 0

    def abort_all(self) -> None:
        """Abort every in-flight request on every engine (the surplus of an over-sampled step)."""
        for c in self.clients:
            try:
                c.abort_all()
            except EngineError:
                pass  # an engine that is gone has nothing in flight

    def _pick(self, exclude: set[str], n: int) -> EngineClient:
        with self.lock:
            candidates = [c for c in self.clients if c.url not in exclude] or self.clients
            client = min(candidates, key=lambda c: (c.in_flight, self.failures.get(c.url, 0)))
            client.in_flight += n  # reserved under the lock, released when the call returns
            return client

    def generate(self, input_ids, sampling_params, **kw) -> list[Generation]:
        tried: set[str] = set()
        last: Exception | None = None
        for attempt in range(self.max_retries):
            client = self._pick(tried, len(input_ids))
            try:
                return client.generate(input_ids, sampling_params, **kw)
            except EngineError as e:
                last = e
                tried.add(client.url)
                with self.lock:
                    self.failures[client.url] = self.failures.get(client.url, 0) + 1
                    self.retries += 1
                time.sleep(min(0.2 * 2**attempt, 2.0))
            finally:
                with self.lock:
                    client.in_flight -= len(input_ids)
        raise EngineError(f"request failed on {len(tried)} engine(s) after {self.max_retries} attempts: {last}")
