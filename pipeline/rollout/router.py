"""sglang-router (the PyPI package `sglang-router`) in front of the engines, started by the rollout manager.

Only /generate goes through the router; the rollout manager and the trainer still talk to each
engine directly for pause/continue, abort, weight updates and weight versions. When the set of
engine addresses changes (an engine was restarted on a new port) the router is restarted with the new
list: requests in flight on it fail and are retried by the pool, so no sample is lost.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

from pipeline.rollout.client import EngineClient, EngineError
from pipeline.run import free_port
from pipeline.utils.proc import die_with_parent

log = logging.getLogger("lockstep.router")


def router_argv(worker_urls: list[str], host: str, port: int, policy: str, api_key: str | None = None,
                prometheus_port: int | None = None) -> list[str]:
    """`python -m sglang_router.launch_router` arguments (the contract tests parse them with its own parser).
    prometheus_port: where its metrics listen (the router's default, 29000, is one port per machine:
    a second router on the node would die with "Address already in use")."""
    argv = ["--worker-urls", *worker_urls, "--host", host, "--port", str(port), "--policy", policy,
            "--log-level", "warn"]
    if prometheus_port is not None:
        argv += ["--prometheus-host", host, "--prometheus-port", str(prometheus_port)]
    if api_key:
        argv += ["--api-key", api_key]
    return argv


class SglangRouter:
    def __init__(self, policy: str, host: str = "127.0.0.1", api_key: str | None = None, log_path: str | None = None,
                 python: str | None = None, startup_timeout_s: float = 120.0):
        self.policy, self.host, self.api_key = policy, host, api_key
        self.python = python or sys.executable
        self.log_path = log_path or os.devnull
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.workers: list[str] = []
        self.url = ""
        self.lock = threading.Lock()

    def start(self, worker_urls: list[str]) -> str:
        self.stop()
        port = free_port(self.host)
        cmd = [self.python, "-m", "sglang_router.launch_router",
               *router_argv(worker_urls, self.host, port, self.policy, self.api_key, free_port(self.host))]
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=die_with_parent)
        self.url, self.workers = f"http://{self.host}:{port}", list(worker_urls)
        client = EngineClient(self.url, timeout_s=5.0, api_key=self.api_key)
        deadline = time.monotonic() + self.startup_timeout_s
        while not client.health(timeout_s=2.0):
            if self.proc.poll() is not None:
                raise EngineError(f"sglang-router exited with {self.proc.returncode} (log: {self.log_path})")
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(f"sglang-router did not answer /health within {self.startup_timeout_s:.0f}s")
            time.sleep(0.2)
        log.info("sglang-router on %s (policy %s) over %d engine(s)", self.url, self.policy, len(worker_urls))
        return self.url

    def sync(self, worker_urls: list[str]) -> str:
        """The router's URL, restarted first if the engines' addresses changed or it died."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                log.warning("sglang-router is not running (exit %s): starting it again",
                            None if self.proc is None else self.proc.returncode)
                self.start(worker_urls)
            elif worker_urls != self.workers:
                log.info("engines changed (%s): restarting the router", ", ".join(worker_urls))
                self.start(worker_urls)
            return self.url

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
