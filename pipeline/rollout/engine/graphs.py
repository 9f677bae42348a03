"""Fixed-shape decode steps, captured as CUDA graphs on GPUs (SGLang's --cuda-graph-max-bs).

A decode step of B running requests runs as the step of the smallest batch bucket >= B. The step's
inputs go into that bucket's static buffers; rows B.. are padding (token 0 at position 0 of the free
cache slots B..bucket-1, which no request owns: a prefill overwrites them when it admits one). One
forward writes the KV cache and leaves the logits in a static buffer; the engine samples from its
first B rows. On CUDA each bucket's forward is captured once and replayed: one graph launch instead of
~1,800 kernel launches from Python per step (bench/results/h200/profile_decode_b1_after.log).
Elsewhere the same fixed-shape step runs eagerly, which is what the CPU tests check (padding, slots,
buffers). Key lengths live on the device (kernels.decode_attention), so nothing in the step depends on
the host.

MoE models too where every MoE block has stacked expert weights (pipeline/models/layers.py: the grouped
expert kernels keep the expert offsets on the device, so the step's launches do not depend on the
routing); each step records its routing (the top-k expert ids of every MoE layer, static tensors the
replay rewrites), which the engine reads back for requests that return routed experts. FP8 experts
(per-expert loop, one host read per layer) and speculative verify steps (their shape changes with the
draft) stay eager. MLA models (DeepSeek-V3) decode through the latent cache here too (attend_latent).
"""

from __future__ import annotations

import logging
import time

import torch

import lockstep_kernels as kernels
from pipeline.models.decoder_layer import MoeRouting
from pipeline.rollout.engine.kv_cache import KVCache, LatentCache

log = logging.getLogger(__name__)

_SMALL_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def batch_buckets(max_bs: int) -> list[int]:
    """The batch sizes that get a step: SGLang-like small steps, then every 64, ending at max_bs."""
    big = range(320, max_bs, 64)
    return sorted({b for b in (*_SMALL_BUCKETS, *big) if b < max_bs} | {max_bs})


class StaticDecodeAttention:
    """Decode attention for slots 0..bucket-1 at device-side positions: write each row's key/value at
    its position, attend over the slot's positions 0..pos."""

    def __init__(self, cache: KVCache | LatentCache, positions_B: torch.Tensor):
        self.cache, self.positions = cache, positions_B
        self.rows = torch.arange(positions_B.numel(), device=positions_B.device)

    def attend(self, layer_idx, q_BHD, k_BKD, v_BKD):
        kc, vc = self.cache.k[layer_idx], self.cache.v[layer_idx]
        kc[self.rows, :, self.positions] = k_BKD
        vc[self.rows, :, self.positions] = v_BKD
        return kernels.decode_attention(q_BHD, kc, vc, self.positions + 1)

    def attend_latent(self, layer_idx, q_BHD, latent_BL, mla):
        """MLA: write each row's latent at its position, attend over the slot's rows 0..pos (the whole
        cache length is read; later positions are masked)."""
        lat = self.cache.latent[layer_idx]
        lat[self.rows, self.positions] = latent_BL
        o_BH1V = mla.attend_cached(q_BHD[:, :, None], lat[: self.rows.numel()], self.positions[:, None], decode=True)
        return o_BH1V[:, :, 0]


class _BucketStep:
    def __init__(self, model, cache: KVCache, bucket: int, device):
        self.model, self.bucket = model, bucket
        self.inputs = torch.zeros(2, bucket, dtype=torch.long, device=device)  # token ids, positions
        self.ctx = StaticDecodeAttention(cache, self.inputs[1])
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.routing = MoeRouting(record=True) if model.args.is_moe else None

    def forward(self) -> torch.Tensor:
        if self.routing is not None:  # the last forward's records (in a graph: the captured ones, replays rewrite them)
            self.routing.recorded = []
        return self.model(self.inputs[0], self.inputs[1], self.ctx, self.routing, logits_at_M=self.ctx.rows)

    def capture(self, pool) -> None:
        """Warm up (Triton compiles, cuBLAS picks kernels) on a side stream, then capture. Warm-up runs
        compute the step held in the buffers, so a capture in the middle of a run rewrites the same
        cache entries with the same values."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # HTTP threads may use CUDA
            self.logits = self.forward()
        self.graph = graph

    def run(self) -> torch.Tensor:
        if self.graph is None:
            self.logits = self.forward()
        else:
            self.graph.replay()
        return self.logits


class DecodeGraphs:
    """One fixed-shape decode step per batch bucket up to `max_bs`; CUDA graphs when on CUDA."""

    def __init__(self, model, cache: KVCache, max_bs: int, device: torch.device):
        assert 0 < max_bs <= cache.num_slots, (max_bs, cache.num_slots)
        self.model, self.cache, self.device = model, cache, torch.device(device)
        self.max_bs = max_bs
        self.buckets = batch_buckets(max_bs)
        self.use_graphs = self.device.type == "cuda"
        self.steps: dict[int, _BucketStep] = {}
        self.pool = None
        self.replays = 0
        self.last: _BucketStep | None = None  # the step the last run() ran

    def bucket(self, b: int) -> int:
        return next(x for x in self.buckets if x >= b)

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Capture every bucket now, largest first (smaller graphs reuse its memory pool), so the
        first steps of a run pay no capture. Returns seconds taken."""
        t0 = time.perf_counter()
        for b in reversed(self.buckets):
            if b not in self.steps:
                self._make(b)
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        log.info("captured %d decode graphs (batch %d..%d) in %.1f s", len(self.buckets), self.buckets[0],
                 self.buckets[-1], dt)
        return dt

    def _make(self, bucket: int, inputs: torch.Tensor | None = None) -> _BucketStep:
        step = _BucketStep(self.model, self.cache, bucket, self.device)
        if inputs is not None:  # a capture in the middle of a run computes this step (see capture())
            step.inputs.copy_(inputs)
        if self.use_graphs:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            step.capture(self.pool)
        self.steps[bucket] = step
        return step

    def run(self, token_ids: list[int] | torch.Tensor, positions: list[int]) -> torch.Tensor:
        """Logits [B, V] for B decode rows (slot b holds row b), through the bucket's step. token_ids
        may be a device tensor (the tokens the previous step sampled, not read back yet): it is copied
        into the step's buffer on the device."""
        b = len(positions)
        bucket = self.bucket(b)
        pad = [0] * (bucket - b)
        on_device = isinstance(token_ids, torch.Tensor)
        host = torch.tensor([[0] * bucket if on_device else token_ids + pad, positions + pad], dtype=torch.long)
        if self.use_graphs and on_device:  # overlapped decode: pageable memory would wait for the stream
            host = host.pin_memory()
        step = self.steps.get(bucket)
        if step is None:  # not made yet, or dropped by reset()
            if on_device:
                host[0, :b] = token_ids.cpu()
            step = self._make(bucket, host)
        elif on_device:
            step.inputs[1].copy_(host[1], non_blocking=True)
            step.inputs[0, :b].copy_(token_ids)  # rows b.. keep earlier valid ids: padding either way
        else:
            step.inputs.copy_(host, non_blocking=True)
        self.replays += 1
        self.last = step
        return step.run()[:b]

    def last_routing(self, b: int) -> MoeRouting:
        """The routing the last run() recorded (MoE models), its first b rows (the padding rows' dropped)."""
        routing = MoeRouting()
        routing.recorded = [idx_Bk[:b] for idx_Bk in self.last.routing.recorded]
        return routing

    def reset(self) -> None:
        """Forget every step (their graphs hold addresses of weights and cache memory, which a memory
        release gives back); steps are made again on use."""
        self.steps.clear()
        self.pool = None
