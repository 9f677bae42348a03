"""SGLang as the rollout engine: the server command line, and a supervisor that keeps it serving.

`server_argv` is a pure function of the run's config: the contract tests feed what it returns to
`sglang.srt.server_args.ServerArgs`' own parser, for every combination of options below.

`SglangSupervisor` (one per engine, run as the `engine` component on a rollout node) starts
`python -m sglang.launch_server`, waits for /health, publishes the engine's address in the run
directory (rendezvous/engine_<i>.json, as the built-in engine does), then health-checks it: a server
that exits, or stops answering `health_failures` checks in a row, is killed and started again (up
to `max_restarts`), and its new address is published so the rollout manager and the trainer's
weight sync pick it up and catch it up to the current weights.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from pipeline.config.schema import RunConfig, SglangEngineConfig
from pipeline.errors import ComponentFailed
from pipeline.rollout.client import EngineClient
from pipeline.run import RunDir, free_port
from pipeline.utils.proc import die_with_parent

log = logging.getLogger("lockstep.sglang")


def server_argv(cfg: RunConfig, model_path: str, host: str, port: int, api_key: str | None = None) -> list[str]:
    """`sglang.launch_server` arguments for one engine of this run (without the interpreter)."""
    e = cfg.engine
    assert isinstance(e, SglangEngineConfig), "server_argv is for engine.type=sglang"
    argv = [
        "--model-path", model_path,
        "--host", host,
        "--port", str(port),
        "--tp-size", str(e.tp_size),
        "--mem-fraction-static", str(e.mem_fraction_static),
        "--dtype", cfg.model.dtype,
        "--context-length", str(cfg.data.max_prompt_len + cfg.rollout.rollout_max_response_len),
        "--max-running-requests", str(e.max_running_requests),
        "--random-seed", str(cfg.rollout.rollout_seed),
        "--weight-version", "0",
        "--skip-tokenizer-init",  # Lockstep sends token ids and reads token ids (TITO)
        "--log-level", "warning",
    ]
    if api_key:
        argv += ["--api-key", api_key]
    if cfg.determinism.true_on_policy:
        # SGLang's bitwise mode: batch-invariant kernels, and numerics aligned with an FSDP trainer.
        argv += ["--enable-deterministic-inference", "--rl-on-policy-target", "fsdp"]
    if cfg.determinism.routing_replay or cfg.determinism.record_routing:
        argv += ["--enable-return-routed-experts"]  # dense models: SGLang returns none
    if e.attention_backend:
        argv += ["--attention-backend", e.attention_backend]
    if e.quantization:
        argv += ["--quantization", e.quantization]
    if e.kv_cache_dtype:
        argv += ["--kv-cache-dtype", e.kv_cache_dtype]
    if e.chunked_prefill_size:
        argv += ["--chunked-prefill-size", str(e.chunked_prefill_size)]
    if e.ep_size > 1:  # MoE experts split over the engine's GPUs (DeepSeek-V3, Qwen3-MoE)
        argv += ["--ep-size", str(e.ep_size)]
    if e.attn_dp_size > 1:  # DP attention (SGLang 0.5.23's spelling of --dp-size N --enable-dp-attention)
        argv += ["--attn-dp-size", str(e.attn_dp_size)]
    if e.moe_a2a_backend:
        argv += ["--moe-a2a-backend", e.moe_a2a_backend]
    if e.speculative_algorithm:  # the MTP head in the checkpoint drafts (SGLang loads it as the draft model)
        k = e.speculative_num_steps
        argv += ["--speculative-algorithm", e.speculative_algorithm, "--speculative-num-steps", str(k),
                 "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(k + 1)]
    if e.disable_cuda_graph:  # SGLang 0.5.23 spelling (its --disable-cuda-graph is deprecated)
        argv += ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    if e.cuda_graph_max_bs:
        argv += ["--cuda-graph-max-bs-decode", str(e.cuda_graph_max_bs)]
    if e.colocated:
        argv += ["--enable-memory-saver"]  # lets /release_memory_occupation hand the GPU to the trainer
    return argv + list(e.extra_args)


def server_command(cfg: RunConfig, model_path: str, host: str, port: int, api_key: str | None = None) -> list[str]:
    return [cfg.engine.python, "-m", "sglang.launch_server", *server_argv(cfg, model_path, host, port, api_key)]


@dataclass
class Serving:
    proc: subprocess.Popen
    url: str
    log_path: str


class SglangSupervisor:
    """Keeps engine `index` serving (see the module docstring). `command` replaces the SGLang command
    line (tests start the built-in engine through it: same protocol, same supervision)."""

    def __init__(self, cfg: RunConfig, run_dir: str, index: int, host: str, model_path: str,
                 api_key: str | None = None, command=None):
        self.cfg, self.e = cfg, cfg.engine
        self.rundir, self.index, self.host, self.model_path, self.api_key = RunDir(run_dir), index, host, model_path, api_key
        self.command = command or (lambda port: server_command(cfg, model_path, host, port, api_key))
        self.restarts = 0
        self.current: Serving | None = None
        self._stop = False

    def start(self) -> Serving:
        port = free_port(self.host)
        log_path = self.rundir.log_file(f"sglang_{self.index}.{self.restarts}")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        cmd = self.command(port)
        log.info("engine %d: %s", self.index, " ".join(a if a != self.api_key else "***" for a in cmd))
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=die_with_parent)
        url = f"http://{self.host}:{port}"
        client = EngineClient(url, timeout_s=10.0, api_key=self.api_key)
        deadline = time.monotonic() + self.e.startup_timeout_s
        while not client.health(timeout_s=5.0):
            if proc.poll() is not None:
                raise ComponentFailed(f"engine_{self.index}", proc.returncode, tail(log_path))
            if time.monotonic() > deadline or self._stop:
                self.kill(proc)
                raise ComponentFailed(f"engine_{self.index}", None, f"no /health within {self.e.startup_timeout_s:.0f}s\n"
                                      + tail(log_path))
            time.sleep(1.0)
        self.rundir.publish_engine(self.index, {"url": url, "host": self.host, "port": port, "pid": proc.pid,
                                                "backend": "sglang", "restarts": self.restarts})
        log.info("engine %d serving on %s", self.index, url)
        self.current = Serving(proc, url, log_path)
        return self.current

    def run(self) -> None:
        """Serve until stopped (SIGTERM) or out of restarts (raises ComponentFailed, naming the engine)."""
        self.start()
        failures = 0
        while not self._stop:
            time.sleep(self.e.health_interval_s)
            s = self.current
            if self._stop:
                break
            exited = s.proc.poll() is not None
            failures = 0 if (not exited and EngineClient(s.url, api_key=self.api_key).health(timeout_s=10.0)) else failures + 1
            if not exited and failures < self.e.health_failures:
                continue
            why = f"exited with {s.proc.returncode}" if exited else f"failed {failures} health checks"
            if self.restarts >= self.e.max_restarts:
                self.kill(s.proc)
                raise ComponentFailed(f"engine_{self.index}", s.proc.returncode,
                                      f"{why}; no restarts left ({self.e.max_restarts})\n" + tail(s.log_path))
            log.warning("engine %d %s: restarting (%d/%d)", self.index, why, self.restarts + 1, self.e.max_restarts)
            self.kill(s.proc)
            self.restarts += 1
            failures = 0
            self.start()
        self.kill(self.current.proc)

    def stop(self, *_) -> None:
        self._stop = True

    @staticmethod
    def kill(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
        """End the server's whole process group (SGLang runs a scheduler process per TP rank)."""
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


def tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def main(cfg: RunConfig, run_dir: str, index: int, host: str) -> None:
    rundir = RunDir(run_dir)
    sup = SglangSupervisor(cfg, run_dir, index, host, rundir.model_dir(cfg), api_key=rundir.token())
    signal.signal(signal.SIGTERM, sup.stop)
    try:
        sup.run()
    except ComponentFailed as e:
        log.error("%s\n%s", e, e.log_tail)
        sys.exit(1)
