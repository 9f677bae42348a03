"""The built-in engine's scheduler: continuous batching over a slot KV cache.

Requests wait in a queue; each scheduler step either admits waiting requests (one packed prefill
that also samples their first token) or decodes one token for every running request. Finished
requests leave at once and their slots are compacted. Sampling is seeded per request
(sampling.py), so a request's tokens do not depend on what else is running.

The scheduler runs in one thread; HTTP handlers submit requests and wait on an event. Weight
updates take `model_lock`, which a step holds, so weights never change in the middle of a forward.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch

from pipeline import faults
from pipeline.models.config import ModelArgs
from pipeline.models.flat import flatten_parameters
from pipeline.models.fp8 import load_into
from pipeline.models.layers import Experts, stack_experts
from pipeline.models.logprobs import token_logprobs
from pipeline.models.decoder_layer import MoeRouting
from pipeline.models.qwen3 import Qwen3ForCausalLM
from pipeline.rollout.engine.kv_cache import CacheAttention, make_cache
from pipeline.rollout.protocol import MemoryTag
from pipeline.rollout.engine.sampling import sample, sampling_rows


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None
    """Required by the engine (Request refuses None): a request's tokens are a function of its seed."""

    @classmethod
    def from_json(cls, d: dict | None) -> "SamplingParams":
        d = d or {}
        top_k = d.get("top_k", -1)
        return cls(
            max_new_tokens=int(d.get("max_new_tokens", 128)),
            temperature=float(d.get("temperature", 1.0)),
            top_p=float(d.get("top_p", 1.0)),
            top_k=int(top_k if top_k is not None else -1),
            stop_token_ids=list(d.get("stop_token_ids") or []),
            ignore_eos=bool(d.get("ignore_eos", False)),
            sampling_seed=int(d["sampling_seed"]) if d.get("sampling_seed") is not None else None,
        )


@dataclass
class Request:
    input_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_routed_experts: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    routed: list[torch.Tensor] = field(default_factory=list)  # chunks of [n, moe_layers, k]
    finish_reason: dict | None = None
    weight_version: int | None = None  # the engine's version when the request was first prefilled
    submitted: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    abort_requested: bool = False
    spec_hidden: torch.Tensor | None = None  # speculative decoding: target hidden states the draft head has not seen
    spec_start: int = 0  # position of spec_hidden's first row
    spec_verify_ct: int = 0  # verify rounds (SGLang's meta_info spec_verify_ct)
    spec_accepted: int = 0  # drafted tokens accepted
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (SGLang's meta_info cached_tokens)

    def __post_init__(self):
        if self.params.sampling_seed is None:
            raise ValueError(f"request {self.rid}: sampling_params.sampling_seed is missing: every request needs a"
                             " seed (its tokens are a function of it; Lockstep's rollout manager derives one per"
                             " sample from rollout.rollout_seed): pass sampling_seed=<int>")

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    def seed(self) -> int:
        return self.params.sampling_seed


class _Pending:
    """A decode step launched and not read back: row i is reqs[i] (running slot i). `overlap`: on a GPU
    the copy back starts now, into pinned memory, and read() waits for it alone."""

    def __init__(self, reqs: list[Request], tokens_B: torch.Tensor, logps_B: torch.Tensor, overlap: bool):
        self.reqs, self.tokens = reqs, tokens_B
        self.event = None
        if tokens_B.is_cuda and overlap:  # start the copy back now; read() waits for it alone
            self.host = (torch.empty(tokens_B.shape, dtype=tokens_B.dtype, pin_memory=True),
                         torch.empty(logps_B.shape, dtype=logps_B.dtype, pin_memory=True))
            self.host[0].copy_(tokens_B, non_blocking=True)
            self.host[1].copy_(logps_B, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = (tokens_B, logps_B)

    def read(self) -> tuple[list[int], list[float]]:
        if self.event is not None:
            self.event.synchronize()
        return self.host[0].tolist(), self.host[1].tolist()


class Engine:
    def __init__(
        self,
        model: Qwen3ForCausalLM,
        *,
        max_running: int,
        context_length: int,
        eos_token_ids: list[int],
        device: torch.device,
        dtype: torch.dtype,
        max_prefill_tokens: int = 16384,
        speculative_num_steps: int = 0,
        cuda_graph_max_bs: int = 0,
        quantization: str | None = None,
        overlap: bool = False,
        fused_sampling: bool = True,
        prefix_cache_tokens: int = 0,
        grouped_experts: bool = False,
    ):
        """overlap: overlapped decode (engine.overlap_schedule): step t+1 is launched from step t's tokens
        on the device before the host reads step t back (SGLang's overlap scheduler); GPUs, plain decode
        only. Off by default: on the H200 its first version ran at 0.67-1.06x of step-by-step decode (its
        host-to-device copies came from pageable memory, which waits for the stream); the pinned copies
        since then have not run on a GPU yet (BENCHMARKS.md). fused_sampling: the fused Triton sampler on
        GPUs (engine.sampling_backend=triton; rows without top-p/top-k), the same tokens as the torch path.
        prefix_cache_tokens: keep finished requests' KV for reuse by requests that share a prefix, up to this
        many tokens (prefix_cache.py; 0: none; not with speculative decoding, whose draft cache it does not hold).
        grouped_experts: MoE blocks' expert weights stacked for the grouped expert kernels and MoE decode from
        the fixed-shape steps (engine.moe_grouped_experts; GPUs; off: the per-expert loop, every MoE step eager)."""
        self.model = model.eval()
        self.overlap, self.fused_sampling = overlap, fused_sampling
        self.args: ModelArgs = model.args
        self.args.check_context_length(context_length, "the engine's context length")
        self.quantization = quantization
        if quantization == "fp8":  # FP8 linear layers (pipeline/models/fp8.py)
            from pipeline.models.fp8 import to_fp8

            to_fp8(self.model)
        elif quantization is not None:
            raise ValueError(f"engine quantization {quantization!r}: the built-in engine knows fp8 only")
        # Parameters as views of one buffer per dtype: an exported version is applied as one span copy
        # per bucket (pipeline/models/flat.py).
        self.flat_weights = flatten_parameters(self.model)
        # MoE blocks: expert weights as [E, N, K] views of the flat buffer, for the grouped expert kernels
        # (pipeline/models/layers.py run_experts; FP8 experts keep the per-expert loop). Updates copy into
        # the parameters, which are those views' memory.
        self.stacked_moe_blocks = stack_experts(self.model) if grouped_experts else 0
        self.params = dict(self.model.named_parameters())  # fixed from here on: updates copy into them
        self.router_jitter = faults.seconds("engine_router_jitter")  # a fault for the R3 tests; 0 otherwise
        self.decode_delay_s = faults.seconds("engine_decode_delay_s")  # a fault: slow decoding; 0 otherwise
        # a fault: requests whose rid matches are held (never scheduled) until aborted, up to the first
        # abort of all; None otherwise
        hold = faults.value("engine_hold_rid")
        self.hold = re.compile(hold) if hold else None
        self.held: list[Request] = []
        self.device, self.dtype = device, dtype
        self.max_running, self.context_length = max_running, context_length
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = list(eos_token_ids)
        self.cache = make_cache(self.args, max_running, context_length, dtype, device)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.cv = threading.Condition()
        self.model_lock = threading.Lock()
        self.paused = False
        self.weight_version = 0
        # weight_sessions_*: SGLang weight-update sessions begun / ended (the server's WeightReceiver)
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0, "finished": 0,
                      "weight_sessions_begun": 0, "weight_sessions_ended": 0}
        self._stop = False
        self.error: str | None = None  # set when the scheduler died
        self.released: set[MemoryTag] = set()  # tags whose memory is given back
        # Names written by weight updates since released weights' memory came back (None: the weights
        # hold a complete version). Colocated updates arrive in buckets, one request each: generation
        # waits until every parameter has been written again.
        self.refill: set[str] | None = None
        self.pending: _Pending | None = None  # a decode step in flight (overlap)
        self.spec = None
        if speculative_num_steps > 0:
            from pipeline.rollout.engine.speculative import SpecDecoder

            self.spec = SpecDecoder(self, speculative_num_steps)
        self.prefix = None
        if prefix_cache_tokens > 0:
            if self.spec is not None:
                raise ValueError("the prefix cache does not hold the MTP draft head's cache: set"
                                 " engine.prefix_cache_tokens=0 with speculative decoding")
            from pipeline.rollout.engine.prefix_cache import PrefixCache

            self.prefix = PrefixCache(prefix_cache_tokens)
        # Fixed-shape decode steps (CUDA graphs on GPUs) for batches up to cuda_graph_max_bs; plain
        # decoding of dense models and of MoE models whose experts all stacked (graphs.py says why; the
        # router-jitter fault perturbs eager steps only). 0: every step eager. Captured on first use, or
        # all at once by capture_graphs() (the server does so before it serves).
        self.graphs = None
        moe_graphs = (self.stacked_moe_blocks == sum(isinstance(m, Experts) for m in self.model.modules())
                      and not self.router_jitter)
        if cuda_graph_max_bs > 0 and (not self.args.is_moe or moe_graphs) and self.spec is None:
            from pipeline.rollout.engine.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.cache, min(cuda_graph_max_bs, max_running), device)

    def capture_graphs(self) -> None:
        """Capture every decode-step bucket now, so the first steps of a run pay no capture."""
        if self.graphs is not None:
            self.graphs.capture_all()

    # ---- client side -------------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        if self.error or self._stop:
            req.finish_reason = {"type": "abort", "message": f"engine is not running: {self.error or 'stopped'}"}
            req.done.set()
            return req
        if len(req.input_ids) >= self.context_length:
            req.finish_reason = {"type": "abort", "message": f"prompt of {len(req.input_ids)} tokens >= context length"}
            req.done.set()
            return req
        with self.cv:
            if self.hold is not None and self.hold.search(req.rid):
                self.held.append(req)
                return req
            self.waiting.append(req)
            self.cv.notify_all()
        return req

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        n = 0
        with self.cv:
            for req in list(self.waiting) + self.running:
                if abort_all or req.rid == rid:
                    req.abort_requested = True
                    n += 1
            for req in [r for r in self.held if abort_all or r.rid == rid]:
                self.held.remove(req)
                self._finish(req, {"type": "abort"})
                n += 1
            if abort_all:
                self.hold = None  # the fault holds until the first abort: a request sent after it runs
            self.cv.notify_all()
        return n

    def pause(self) -> None:
        """Stop scheduling after the current step; running requests stay in place."""
        with self.cv:
            self.paused = True
        with self.model_lock:  # wait for the step running now, then read back the one in flight
            self._drain()

    def resume(self) -> None:
        with self.cv:
            self.paused = False
            self.cv.notify_all()

    def num_active(self) -> int:
        with self.cv:
            return len(self.waiting) + len(self.running)

    def stop(self) -> None:
        with self.cv:
            self._stop = True
            for req in self.held:
                self._finish(req, {"type": "abort", "message": "engine stopped"})
            self.held.clear()
            self.cv.notify_all()

    # ---- scheduler -----------------------------------------------------------------------------
    def run_forever(self) -> None:
        """The scheduler loop. If a step raises, every waiting and running request is finished with
        the error (so no client waits for a dead scheduler) and the exception is re-raised."""
        try:
            while True:
                with self.cv:
                    while not self._stop and (self.paused or not (self.waiting or self.running)):
                        self.cv.wait(timeout=1.0)
                    if self._stop:
                        return
                self.step()
        except BaseException as e:
            self.error = f"{type(e).__name__}: {e}"
            self.pending = None
            with self.cv:
                for req in list(self.waiting) + self.running:
                    self._finish(req, {"type": "abort", "message": f"engine failed: {self.error}"})
                self.waiting.clear()
                self.running.clear()
                self._stop = True
            raise

    @torch.inference_mode()
    def step(self) -> None:
        with self.model_lock:
            self._drop_aborted_waiting()
            with self.cv:
                admit = self._admit()
            if admit or any(r.abort_requested for r in self.running):
                self._drain()  # the running set changes: nothing may be in flight
            self._drop_aborted_running()
            if admit:
                self._prefill(admit)
            elif self.running:
                self.spec.decode() if self.spec else self._decode()
            self.stats["steps"] += 1

    def _admit(self) -> list[Request]:
        admit, tokens = [], 0
        while self.waiting and len(self.running) + len(admit) < self.max_running:
            n = len(self.waiting[0].input_ids) + len(self.waiting[0].output_ids)
            if admit and tokens + n > self.max_prefill_tokens:
                break
            admit.append(self.waiting.popleft())
            tokens += n
        return admit

    def _drop_aborted_waiting(self) -> None:
        with self.cv:
            for req in [r for r in self.waiting if r.abort_requested]:
                self.waiting.remove(req)
                self._finish(req, {"type": "abort"})

    def _drop_aborted_running(self) -> None:
        for i in reversed(range(len(self.running))):
            if self.running[i].abort_requested:
                self._finish_running(i, {"type": "abort"})

    def _forward(self, ids: list[int] | torch.Tensor, ctx: CacheAttention, record: bool, logits_at: torch.Tensor):
        """Logits [B, V] at `logits_at` (each sequence's last new token), the routing record, and when
        speculating the last layer's hidden states [N, D] (what the MTP draft head reads; else None).
        `ids` may already be a device tensor (a decode step's tokens not read back yet)."""
        routing = MoeRouting(record=True, jitter=self.router_jitter) if (record and self.args.is_moe) else None
        ids_N = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long, device=self.device)
        out = self.model(ids_N, ctx.positions, ctx, routing, logits_at_M=logits_at, return_hidden=self.spec is not None)
        logits, hidden = out if self.spec is not None else (out, None)
        return logits, routing, hidden

    def _prefill(self, admit: list[Request]) -> None:
        base = len(self.running)
        slots = list(range(base, base + len(admit)))
        seqs = [r.input_ids + r.output_ids for r in admit]  # output_ids non-empty when continuing a partial rollout
        starts = self._reuse_prefixes(admit, slots, seqs)
        new = [len(s) - c for s, c in zip(seqs, starts)]
        ctx = CacheAttention(self.cache, slots, starts, new, self.device)
        record = any(r.return_routed_experts for r in admit)
        ends = torch.cumsum(torch.tensor(new, device=self.device), 0) - 1
        self.running.extend(admit)  # before the forward: if it fails, these are finished with the error
        logits, routing, hidden = self._forward([t for s, c in zip(seqs, starts) for t in s[c:]], ctx, record, ends)
        if self.spec:
            self.spec.after_prefill(admit, [len(s) for s in seqs], hidden)
        for r in admit:
            if r.weight_version is None:
                r.weight_version = self.weight_version
        self._keep_routing(admit, new, routing)
        self.stats["prefill_tokens"] += ctx.positions.numel()
        self._sample_and_advance(admit, logits, base)

    def _reuse_prefixes(self, admit: list[Request], slots: list[int], seqs: list[list[int]]) -> list[int]:
        """Copy each request's longest cached prefix into its slot (at least its last token is prefilled,
        for its logits); the number of cached positions of each. Routing rows of the prefix come along."""
        if self.prefix is None:
            return [0] * len(admit)
        starts = []
        for r, slot, seq in zip(admit, slots, seqs):
            n, entry = self.prefix.match(seq, len(seq) - 1, need_routing=r.return_routed_experts and self.args.is_moe)
            if entry is not None:
                self.cache.write(slot, entry.rows, n)
                if r.return_routed_experts and entry.routing is not None:
                    r.routed.append(entry.routing[:n])
            r.cached_tokens = n
            self.stats["cached_tokens"] = self.stats.get("cached_tokens", 0) + n
            starts.append(n)
        return starts

    def _keep_prefix(self, slot: int, req: Request) -> None:
        """A leaving request's KV rows (and routing rows) into the prefix cache."""
        n = req.num_tokens - 1  # the last token was sampled, never fed
        if self.prefix is None or n <= 0 or MemoryTag.KV_CACHE in self.released:
            return
        routing = None
        if req.return_routed_experts and self.args.is_moe and req.routed:
            routing = torch.cat(req.routed)[:n]
            if len(routing) < n:
                routing = None
        self.prefix.insert((req.input_ids + req.output_ids)[:n], self.cache.read(slot, n), routing)

    def _decode(self) -> None:
        """One decode step of every running request. Overlapped (self.overlap, no routing record): the step
        is launched from the previous step's tokens still on the device, and the host reads that
        previous step back (appends, finish checks) while this one runs. A step is not launched ahead
        when a request may reach its length limit with the step before (its row would run past it);
        when a request stops on a stop token, the step launched after it is read back at once (its
        row is discarded) and the finished requests leave the batch with nothing in flight."""
        if self.decode_delay_s:
            time.sleep(self.decode_delay_s)
        prev = self.pending
        if prev is not None and not self._can_run_ahead(self.running):
            self._drain()
            prev = None
            if not self.running:
                return
        step = self._launch_decode(self.running, prev)
        if prev is None:
            if self._overlappable(self.running):
                self.pending = step
            else:
                self._remove_finished(self._advance(step, 0))
            return
        self.pending = None
        finished = self._advance(prev, 0)
        if not finished:
            self.pending = step
            return
        self._remove_finished(finished + self._advance(step, 0, skip={slot for slot, _ in finished}))

    def _overlappable(self, reqs: list[Request]) -> bool:
        return self.overlap and self.spec is None and not any(r.return_routed_experts for r in reqs)

    def _can_run_ahead(self, reqs: list[Request]) -> bool:
        """True if no request can finish by length with the step in flight (host counts lag it by one)."""
        return self._overlappable(reqs) and all(
            len(r.output_ids) + 1 < r.params.max_new_tokens and r.num_tokens + 1 < self.context_length for r in reqs)

    def _launch_decode(self, reqs: list[Request], prev: _Pending | None) -> _Pending:
        b, ahead = len(reqs), 0 if prev is None else 1
        last = prev.tokens if prev is not None else [r.output_ids[-1] for r in reqs]
        starts = [r.num_tokens - 1 + ahead for r in reqs]
        if self.graphs is not None and b <= self.graphs.max_bs:
            logits = self.graphs.run(last, starts)
            if any(r.return_routed_experts for r in reqs):
                self._keep_routing(reqs, [1] * b, self.graphs.last_routing(b))
        else:
            ctx = CacheAttention(self.cache, list(range(b)), starts, [1] * b, self.device)
            record = any(r.return_routed_experts for r in reqs)
            logits, routing, _ = self._forward(last, ctx, record, torch.arange(b, device=self.device))
            self._keep_routing(reqs, [1] * b, routing)
        self.stats["decode_tokens"] += b
        return self._sample(reqs, logits, ahead)

    def _sample(self, reqs: list[Request], logits_BV: torch.Tensor, ahead: int = 0) -> _Pending:
        """Sample each row's next token (and its logprob); nothing read back yet."""
        rows = sampling_rows(reqs, self.device, ahead=ahead, pinned=self.overlap)
        tokens_B = sample(logits_BV, **rows, fused=self.fused_sampling)
        return _Pending(list(reqs), tokens_B, token_logprobs(logits_BV, tokens_B, rows["temperature_B"]), self.overlap)

    def _advance(self, step: _Pending, first_slot: int, skip: set[int] = frozenset()) -> list[tuple[int, dict]]:
        """Append a step's tokens and logprobs (rows in `skip`: finished before it, discarded); returns
        (slot, finish reason) of the requests it finished."""
        tokens, logps = step.read()
        finished = []
        for i, r in enumerate(step.reqs):
            if first_slot + i in skip:
                continue
            r.output_ids.append(tokens[i])
            r.output_logprobs.append(logps[i])
            reason = self._finish_reason(r, tokens[i])
            if reason:
                finished.append((first_slot + i, reason))
        return finished

    def _remove_finished(self, finished: list[tuple[int, dict]]) -> None:
        for slot, reason in sorted(finished, reverse=True):
            self._finish_running(slot, reason)

    @torch.inference_mode()
    def _drain(self) -> None:
        """Read back the decode step in flight, if any (callers hold model_lock)."""
        if self.pending is not None:
            step, self.pending = self.pending, None
            self._remove_finished(self._advance(step, 0))

    def _keep_routing(self, reqs: list[Request], counts: list[int], routing: MoeRouting | None) -> None:
        if routing is None:
            return
        stacked_NLk = torch.stack(routing.recorded, dim=1).to("cpu", torch.int16)
        for r, chunk in zip(reqs, torch.split(stacked_NLk, counts)):
            if r.return_routed_experts:
                r.routed.append(chunk)

    def _sample_and_advance(self, reqs: list[Request], logits_BV: torch.Tensor, first_slot: int) -> None:
        self._remove_finished(self._advance(self._sample(reqs, logits_BV), first_slot))

    def _finish_reason(self, r: Request, token: int) -> dict | None:
        stops = r.params.stop_token_ids + ([] if r.params.ignore_eos else self.eos_token_ids)
        if token in stops:
            return {"type": "stop", "matched": token}
        if len(r.output_ids) >= r.params.max_new_tokens or r.num_tokens >= self.context_length:
            return {"type": "length", "length": len(r.output_ids)}
        return None

    def _finish_running(self, slot: int, reason: dict) -> None:
        req = self.running[slot]
        self._keep_prefix(slot, req)
        last = len(self.running) - 1
        if slot != last:
            moved = self.running[last]
            self.cache.move(last, slot, moved.num_tokens)
            if self.spec:
                self.spec.move(last, slot, moved.num_tokens)
            self.running[slot] = moved
        self.running.pop()
        self._finish(req, reason)

    def _finish(self, req: Request, reason: dict) -> None:
        req.finish_reason = reason
        req.spec_hidden = None
        if req.weight_version is None:
            req.weight_version = self.weight_version
        self.stats["finished"] += 1
        req.done.set()

    # ---- weights ----------------------------------------------------------------------------------
    def load_weights(self, named: dict[str, torch.Tensor], version: int) -> None:
        """Swap in a complete set (or subset) of weights between steps."""
        assert isinstance(version, int), f"weight versions are ints inside Lockstep, got {version!r}"
        params = self.params
        with self.model_lock, torch.no_grad():
            self._drain()  # tokens of the step in flight came from the weights before
            if MemoryTag.WEIGHTS in self.released:  # memory comes back; the update fills it
                self._resume_weights()
            written = load_into(params, named)
            if self.prefix is not None:
                self.prefix.flush()  # its rows came from the weights before
            if self.refill is not None:
                self.refill |= written
                if self.refill >= params.keys():
                    self.refill = None
            if self.refill is None:  # a version half-refilled after a release is no version
                self.weight_version = version

    def missing_after_release(self) -> list[str]:
        """Parameters not yet written again since the weights' memory came back (empty when complete)."""
        return [] if self.refill is None else sorted(set(self.params) - self.refill)

    # ---- memory (colocated runs: the trainer takes the device while the engine sleeps) ---------------
    def release_memory(self, tags: list[MemoryTag] | None) -> None:
        """SGLang's /release_memory_occupation: free the KV cache and/or the weights' memory. Only while
        nothing runs (pause first). Released weights lose their values: the next weight update brings
        them back; until then /generate is refused."""
        tags = list(tags or MemoryTag)
        with self.cv:
            if self.waiting or self.running:
                raise RuntimeError(f"cannot release memory with {len(self.waiting) + len(self.running)} requests "
                                   "in flight (pause_generation and wait, or abort them first)")
            self.paused = True
        with self.model_lock:
            if MemoryTag.KV_CACHE in tags and MemoryTag.KV_CACHE not in self.released:
                for t in self._cache_tensors():
                    t.untyped_storage().resize_(0)
                if self.prefix is not None:
                    self.prefix.flush()
                self.released.add(MemoryTag.KV_CACHE)
            if MemoryTag.WEIGHTS in tags and MemoryTag.WEIGHTS not in self.released:
                for flat in self.flat_weights:
                    flat.untyped_storage().resize_(0)
                self.released.add(MemoryTag.WEIGHTS)
            if self.graphs is not None:  # graphs point at the memory just given back
                self.graphs.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self, tags: list[MemoryTag] | None) -> None:
        """SGLang's /resume_memory_occupation: take the memory back (weights hold no valid values
        until the next update; the KV cache is empty)."""
        tags = list(tags or MemoryTag)
        with self.model_lock:
            if MemoryTag.KV_CACHE in tags and MemoryTag.KV_CACHE in self.released:
                for t in self._cache_tensors():
                    t.untyped_storage().resize_(t.numel() * t.element_size())
                    t.zero_()
                self.released.discard(MemoryTag.KV_CACHE)
            if MemoryTag.WEIGHTS in tags and MemoryTag.WEIGHTS in self.released:
                self._resume_weights()
        if not self.released:
            self.resume()

    def held_memory(self) -> str:
        """What this process's caching allocator still holds on the engine's GPU, for the log of a memory
        release or resume ("" off GPUs). The CUDA context comes on top (not the allocator's)."""
        if self.device.type != "cuda":
            return ""
        allocated, reserved = torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
        return f" (torch holds {allocated / 2**30:.2f} GiB allocated, {reserved / 2**30:.2f} GiB reserved)"

    def _cache_tensors(self) -> list[torch.Tensor]:
        caches = [self.cache] + ([self.spec.cache] if self.spec else [])
        return [t for c in caches for t in c.tensors()]

    def _resume_weights(self) -> None:
        for flat in self.flat_weights:
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        self.released.discard(MemoryTag.WEIGHTS)
        self.refill = set()  # the memory is back, its values are not

    def unavailable(self) -> str | None:
        """Why /generate cannot be served right now (memory released, or weights not refilled)."""
        if self.released:
            return f"memory released ({', '.join(sorted(t.value for t in self.released))}): call /resume_memory_occupation"
        missing = self.missing_after_release()
        if missing:
            return (f"weights were released and {len(missing)} of {len(self.params)} parameters (e.g. {missing[0]}) "
                    "have not been written by a weight update since: send a complete update first")
        return None
