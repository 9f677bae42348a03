"""The built-in engine as an HTTP server speaking SGLang's protocol subset.

Endpoints (same paths, bodies and response shapes as `sglang.launch_server`):
  GET  /health, /health_generate, /model_info (/get_model_info), /server_info (/get_server_info),
       /get_weight_version (older SGLang; newer ones report weight_version in /model_info)
  POST /generate                 input_ids (one or a batch), sampling_params, return_logprob, return_routed_experts, rid
  POST /abort_request            rid | abort_all
  POST /flush_cache, /pause_generation, /continue_generation
  POST /begin_weight_update      selector; /end_weight_update: the session tensor / distributed updates run in
  POST /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group
  POST /update_weights_from_disk model_path
  POST /update_weights_from_tensor serialized_named_tensors (colocated: shared memory / CUDA IPC handles)
  POST /release_memory_occupation, /resume_memory_occupation  tags (weights, kv_cache)
So the rollout manager's client is the one a SGLang cluster uses.

Run it as `python -m pipeline.rollout.engine.server --model-path DIR --port N ...`.
"""

from __future__ import annotations

import argparse
import base64
import hmac
import json
import logging
import os
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from pipeline import faults
from pipeline.observability.startup import StartupClock
from pipeline.rollout import protocol
from pipeline.rollout.engine.core import Engine, Request, SamplingParams
from pipeline.weights.receiver import WeightReceiver

log = logging.getLogger("lockstep.engine")


def encode_routed_experts(chunks: list[torch.Tensor]) -> str:
    """[tokens, moe_layers, top_k] int32, base64 of the raw little-endian bytes (SGLang's format)."""
    if not chunks:
        return ""
    arr = torch.cat(chunks).to(torch.int32).numpy().astype("<i4")
    return base64.b64encode(arr.tobytes()).decode()


def build_response(req: Request, return_logprob: bool, return_routed: bool, tokenizer) -> dict:
    meta = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "weight_version": protocol.version_to_wire(req.weight_version),
        "e2e_latency": time.monotonic() - req.submitted,
    }
    if req.spec_verify_ct:  # speculative decoding (SGLang's names)
        meta["spec_verify_ct"] = req.spec_verify_ct
        meta["spec_accept_length"] = (len(req.output_ids) - 1) / req.spec_verify_ct  # tokens per verify forward
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(req.output_logprobs, req.output_ids)]
    if return_routed:
        meta["routed_experts"] = encode_routed_experts(req.routed)
    text = tokenizer.decode(req.output_ids) if tokenizer is not None else ""
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}


class EngineServer:
    def __init__(self, engine: Engine, model_path: str, tokenizer=None, api_key: str | None = None):
        self.engine, self.model_path, self.tokenizer, self.api_key = engine, model_path, tokenizer, api_key
        self.receiver = WeightReceiver(engine)
        self.started = time.time()
        self.in_flight = 0  # /generate calls not yet answered
        self.requests = 0
        self.lock = threading.Lock()
        self.exit_at = int(faults.value("engine_exit_at_request") or 0)

    # Each handler returns (status, json-able body).
    def generate(self, body: dict):
        with self.lock:
            self.in_flight += 1
            self.requests += 1
            if self.requests == self.exit_at:  # fault injection: die with requests in flight
                log.error("fault injection: exiting at request %d", self.requests)
                os._exit(43)
        try:
            return self._generate(body)
        finally:
            with self.lock:
                self.in_flight -= 1

    def _generate(self, body: dict):
        why = self.engine.unavailable()
        if why:  # a state only the trainer's memory / weight calls change: retrying cannot help
            return HTTPStatus.CONFLICT, {"error": why}
        ids = body.get("input_ids")
        if ids is None:
            return HTTPStatus.BAD_REQUEST, {"error": "input_ids is required (this engine does not tokenize text)"}
        batch = bool(ids) and isinstance(ids[0], list)
        ids_list = ids if batch else [ids]
        n = len(ids_list)
        sp = body.get("sampling_params")
        sp_list = sp if isinstance(sp, list) else [sp] * n
        rid = body.get("rid")
        rids = rid if isinstance(rid, list) else ([f"{rid}-{i}" for i in range(n)] if (rid and batch) else [rid] * n)
        return_logprob = bool(body.get("return_logprob", False))
        return_routed = bool(body.get("return_routed_experts", False))
        try:  # every request checked before any is submitted
            reqs = [Request(input_ids=list(ids_list[i]), params=SamplingParams.from_json(sp_list[i]),
                            return_routed_experts=return_routed, **({"rid": str(rids[i])} if rids[i] else {}))
                    for i in range(n)]
        except ValueError as e:
            return HTTPStatus.BAD_REQUEST, {"error": str(e)}
        for req in reqs:
            self.engine.submit(req)
        for req in reqs:
            req.done.wait()
        if self.engine.error:
            return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"engine failed: {self.engine.error}"}
        out = [build_response(r, return_logprob, return_routed, self.tokenizer) for r in reqs]
        return HTTPStatus.OK, out if batch else out[0]

    def weights_by_name(self, body: dict):
        """SGLang's debug endpoint: a parameter's values (first `truncate_size` of the flattened tensor).
        An FP8 weight (engine.quantization=fp8) comes back as q * scale_inv, the values it computes with;
        its scales are the parameter `<name>_scale_inv` (SCALE_SUFFIX)."""
        from lockstep_kernels import fp8
        from pipeline.models.fp8 import SCALE_SUFFIX

        params = self.engine.params
        name = body.get("name")
        if name not in params:
            return HTTPStatus.BAD_REQUEST, {"error": f"no parameter {name!r}"}
        with self.engine.model_lock:
            p = params[name].detach()
            if p.dtype == fp8.FP8:
                p = fp8.dequantize(p, params[name + SCALE_SUFFIX].detach())
            flat = p.float().flatten().cpu()
        n = int(body.get("truncate_size", 100))
        return HTTPStatus.OK, flat[:n].tolist() if n >= 0 else flat.tolist()

    def route(self, method: str, path: str, body: dict):
        e = self.engine
        if path in ("/health", "/health_generate"):
            if e.error:
                return HTTPStatus.SERVICE_UNAVAILABLE, {"status": "failed", "error": e.error}
            return HTTPStatus.OK, {"status": "ok"}
        if path in ("/model_info", "/get_model_info"):  # SGLang >= 0.5.2x: /model_info; older: /get_model_info
            return HTTPStatus.OK, {"model_path": self.model_path, "is_generation": True,
                                   "weight_version": protocol.version_to_wire(e.weight_version)}
        if path in ("/server_info", "/get_server_info"):
            return HTTPStatus.OK, {"model_path": self.model_path, "max_running_requests": e.max_running,
                                   "context_length": e.context_length, "device": str(e.device), "stats": e.stats,
                                   "num_running_reqs": len(e.running), "num_waiting_reqs": len(e.waiting),
                                   "paused": e.paused, **(e.spec.stats() if e.spec else {}), **device_memory(e.device),
                                   **({"prefix_cache": dict(e.prefix.stats, hit_rate=e.prefix.hit_rate,
                                                            tokens=e.prefix.tokens)} if e.prefix else {}),
                                   "uptime_s": time.time() - self.started, "version": "lockstep-builtin"}
        if path == "/get_weight_version":
            return HTTPStatus.OK, {"weight_version": protocol.version_to_wire(e.weight_version)}
        if path == "/get_weights_by_name":
            return self.weights_by_name(body)
        if method != "POST" and path not in ("/flush_cache",):
            return HTTPStatus.METHOD_NOT_ALLOWED, {"error": f"{path} needs POST"}
        if path == "/generate":
            return self.generate(body)
        if path == "/abort_request":
            n = e.abort(body.get("rid"), bool(body.get("abort_all", False)))
            return HTTPStatus.OK, {"success": True, "aborted": n}
        if path == "/flush_cache":
            if e.prefix is None:
                return HTTPStatus.OK, {"success": True, "message": "no prefix cache to flush"}
            with e.model_lock:
                e.prefix.flush()
            return HTTPStatus.OK, {"success": True, "message": "prefix cache flushed"}
        if path == "/pause_generation":
            e.pause()
            return HTTPStatus.OK, {"success": True}
        if path == "/continue_generation":
            e.resume()
            return HTTPStatus.OK, {"success": True}
        if path == "/begin_weight_update":
            return self._result(self.receiver.begin_session(body))
        if path == "/end_weight_update":
            return self._result(self.receiver.end_session(body))
        if path == "/init_weights_update_group":
            return self._result(self.receiver.init_group(body))
        if path == "/update_weights_from_distributed":
            return self._result(self.receiver.update_from_distributed(body))
        if path == "/destroy_weights_update_group":
            return self._result(self.receiver.destroy_group(body))
        if path == "/update_weights_from_disk":
            return self._result(self.receiver.update_from_disk(body))
        if path == "/update_weights_from_tensor":
            return self._result(self.receiver.update_from_tensor(body))
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            try:
                (e.release_memory if path.startswith("/release") else e.resume_memory)(protocol.memory_tags(body))
            except (RuntimeError, ValueError) as exc:
                return HTTPStatus.BAD_REQUEST, {"success": False, "message": str(exc)}
            released = sorted(t.value for t in e.released)
            log.info("memory released: %s%s", ", ".join(released) or "none", e.held_memory())
            return HTTPStatus.OK, {"success": True, "message": f"released: {released}"}
        return HTTPStatus.NOT_FOUND, {"error": f"unknown endpoint {path}"}

    @staticmethod
    def _result(res: tuple[bool, str]):
        ok, msg = res
        return (HTTPStatus.OK if ok else HTTPStatus.BAD_REQUEST), {"success": ok, "message": msg}


def device_memory(device: torch.device) -> dict:
    """This process's GPU memory: now and at its peak (the caching allocator's reserved bytes, GiB)."""
    if device.type != "cuda":
        return {}
    return {"memory_reserved_gib": torch.cuda.memory_reserved(device) / 2**30,
            "peak_memory_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}


def make_handler(server: EngineServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # TCP_NODELAY: the header and body writes of an answer would otherwise wait on the client's
        # delayed ACK (Nagle): ~40 ms added to every request on a kept-alive connection.
        disable_nagle_algorithm = True

        def log_message(self, fmt, *args):  # route access logs through logging at debug level
            log.debug("%s " + fmt, self.address_string(), *args)

        def _handle(self, method: str):
            given = self.headers.get("Authorization") or ""
            path = self.path.split("?")[0]
            probe = path.startswith(("/health", "/ready"))  # as SGLang: probes need no key (routers, k8s)
            if server.api_key and not probe and not hmac.compare_digest(given, f"Bearer {server.api_key}"):
                return self._send(HTTPStatus.UNAUTHORIZED, {"error": "missing or wrong API key"})
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else {}
            except json.JSONDecodeError:
                return self._send(HTTPStatus.BAD_REQUEST, {"error": "body is not JSON"})
            path = self.path.split("?")[0]
            try:
                status, out = server.route(method, path, body)
            except Exception as exc:  # report to the client, keep serving
                log.exception("request %s failed", path)
                status, out = HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(exc).__name__}: {exc}"}
            self._send(status, out)

        def _send(self, status, out):
            data = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._handle("GET")

        def do_POST(self):
            self._handle("POST")

    return Handler


def serve(engine_server: EngineServer, host: str, port: int, ready_file: str | None = None,
          allow_all_interfaces: bool = False, on_ready=None) -> None:
    """Serve until stopped; once listening, publish the address to `ready_file` and call on_ready()."""
    if host in ("0.0.0.0", "::", "") and not allow_all_interfaces:
        raise SystemExit("refusing to listen on all interfaces: give --host the node's cluster address or 127.0.0.1"
                         " (or pass --allow-all-interfaces)")
    httpd = ThreadingHTTPServer((host, port), make_handler(engine_server))
    httpd.daemon_threads = True
    actual_port = httpd.server_address[1]

    def schedule():
        try:
            engine_server.engine.run_forever()
        except BaseException:
            log.exception("engine scheduler failed; answering pending requests, then shutting down")
            deadline = time.monotonic() + 5.0
            while engine_server.in_flight and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)  # let the last handler finish writing its response
            httpd.shutdown()

    sched = threading.Thread(target=schedule, name="scheduler", daemon=True)
    sched.start()
    url = f"http://{host}:{actual_port}"
    log.info("engine serving on %s", url)
    if ready_file:
        from pipeline.run import publish

        publish(ready_file, {"url": url, "host": host, "port": actual_port, "pid": os.getpid()})
    if on_ready is not None:
        on_ready()
    try:
        httpd.serve_forever(poll_interval=0.2)
    finally:
        engine_server.engine.stop()
        httpd.server_close()
    if engine_server.engine.error:
        raise SystemExit(f"engine failed: {engine_server.engine.error}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Lockstep built-in engine (SGLang HTTP protocol subset)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--api-key", default=None, help="the run's token: requests without it are refused (HTTP 401)")
    p.add_argument("--ready-file", default=None, help="write {url, pid} here once serving (rendezvous)")
    p.add_argument("--true-on-policy", action="store_true", help="batch-invariant kernels")
    p.add_argument("--kernel-backend", default="auto", choices=["auto", "torch"],
                   help="auto: Triton kernels on GPUs; torch: the torch paths everywhere (determinism.kernel_backend)")
    p.add_argument("--enable-overlap-schedule", dest="overlap_schedule", action="store_true", default=False,
                   help="overlapped decode on GPUs: step t+1 launched before step t is read back (engine.overlap_schedule)")
    p.add_argument("--disable-overlap-schedule", dest="overlap_schedule", action="store_false",
                   help="step-by-step decode (SGLang's flag; the built-in engine's default)")
    p.add_argument("--sampling-backend", default="triton", choices=["triton", "pytorch"],
                   help="triton: the fused Triton sampler on GPUs; pytorch: the torch path (SGLang's flag; engine.sampling_backend)")
    p.add_argument("--mtp-num-layers", type=int, default=None,
                   help="MTP draft layers to build (default: as config.json; 1 adds a fresh head if it has none)")
    p.add_argument("--speculative-algorithm", default=None, choices=["NEXTN", "EAGLE"],
                   help="draft with the MTP head and verify (SGLang's flag)")
    p.add_argument("--speculative-num-steps", type=int, default=3, help="draft tokens per verify step")
    p.add_argument("--prefix-cache-tokens", type=int, default=0,
                   help="keep finished requests' KV for requests sharing a prefix, up to this many tokens (0: off)")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="blockwise FP8 linear layers and FP8 GEMMs (SGLang's flag)")
    p.add_argument("--disable-cuda-graph", action="store_true", help="every decode step eager (SGLang's flag)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="largest decode batch run from a CUDA graph (default: --max-running-requests; GPU only)")
    p.add_argument("--moe-grouped-experts", action=argparse.BooleanOptionalAction, default=True,
                   help="MoE: all experts of a projection in one grouped kernel, MoE decode from CUDA graphs (GPU only;"
                        " --no-moe-grouped-experts: the per-expert loop, MoE decode eager)")
    p.add_argument("--allow-all-interfaces", action="store_true", help="permit --host 0.0.0.0")
    p.add_argument("--startup-file", default=None, help="where to publish the start-up phases' seconds (JSON)")
    return p.parse_args(argv)


def build_engine(model_path: str, *, device: str, dtype: str, max_running: int, context_length: int,
                 mtp_layers: int | None = None, speculative_num_steps: int = 0, cuda_graph_max_bs: int | None = None,
                 quantization: str | None = None, overlap: bool = False, fused_sampling: bool = True,
                 prefix_cache_tokens: int = 0, grouped_experts: bool = False, clock: StartupClock | None = None):
    """The engine of a server, its decode graphs captured. cuda_graph_max_bs: None = max_running on a
    GPU, 0 = none (on CPUs always none: a graph there would only replay the same eager ops). overlap,
    fused_sampling: see Engine. `clock` times the phases (load, engine, graphs)."""
    from pipeline.models.hf_io import load_model
    from pipeline.models.tokenizer import load_tokenizer

    clock = clock or StartupClock()
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    tdtype = getattr(torch, dtype)
    with clock.phase("load"):
        # an FP8 engine keeps an FP8 checkpoint's own weights (the Engine quantises the rest)
        _, model = load_model(model_path, dtype=tdtype, device=dev, mtp_layers=mtp_layers, quantization=quantization)
        tokenizer = load_tokenizer(model_path)
    graph_bs = 0 if dev.type != "cuda" else (max_running if cuda_graph_max_bs is None else cuda_graph_max_bs)
    with clock.phase("engine"):  # flat weights, KV cache
        engine = Engine(model, max_running=max_running, context_length=context_length,
                        eos_token_ids=[tokenizer.eos_token_id], device=dev, dtype=tdtype,
                        speculative_num_steps=speculative_num_steps, cuda_graph_max_bs=graph_bs,
                        quantization=quantization, overlap=overlap, fused_sampling=fused_sampling,
                        prefix_cache_tokens=prefix_cache_tokens, grouped_experts=grouped_experts)
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # loading's transient blocks (flattening copies the weights once)
    with clock.phase("graphs"):
        engine.capture_graphs()
    return engine, tokenizer


def engine_from_args(args, clock: StartupClock | None = None):
    """The kernel library's process settings, then the engine and tokenizer the flags describe."""
    import lockstep_kernels

    # Before the engine captures its decode graphs: they record the kernels these settings pick.
    lockstep_kernels.set_backend(args.kernel_backend)
    lockstep_kernels.set_batch_invariant(args.true_on_policy)
    return build_engine(args.model_path, device=args.device, dtype=args.dtype,
                        max_running=args.max_running_requests, context_length=args.context_length,
                        mtp_layers=args.mtp_num_layers,
                        speculative_num_steps=args.speculative_num_steps if args.speculative_algorithm else 0,
                        cuda_graph_max_bs=0 if args.disable_cuda_graph else args.cuda_graph_max_bs,
                        quantization=args.quantization, overlap=args.overlap_schedule,
                        fused_sampling=args.sampling_backend == "triton",
                        prefix_cache_tokens=args.prefix_cache_tokens, grouped_experts=args.moe_grouped_experts,
                        clock=clock)


def main(argv=None) -> None:
    clock = StartupClock()
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.num_threads)
    engine, tokenizer = engine_from_args(args, clock)
    serve(EngineServer(engine, args.model_path, tokenizer, args.api_key), args.host, args.port, args.ready_file,
          args.allow_all_interfaces, on_ready=lambda: clock.publish(args.startup_file))


if __name__ == "__main__":
    main()
